import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lambjax import sharding
from lambjax.models import encoder, pretraining
from lambjax.models.config import BertConfig
from lambjax.models.encoder import LayerOptions
from lambjax.models.params import init_params, param_logical_axes

CONFIG = BertConfig.preset("tiny", vocab_size=64, num_layers=3, dtype="float32")


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.key(0))


def batch(seed=0, b=2, s=12, p=3):
    rng = np.random.default_rng(seed)
    return {
        "input_ids": jnp.asarray(rng.integers(5, 64, (b, s)), jnp.int32),
        "input_mask": jnp.ones((b, s), jnp.int32),
        "segment_ids": jnp.zeros((b, s), jnp.int32),
        "masked_lm_positions": jnp.asarray(np.sort(rng.integers(1, s, (b, p)), 1), jnp.int32),
        "masked_lm_ids": jnp.asarray(rng.integers(5, 64, (b, p)), jnp.int32),
        "masked_lm_weights": jnp.ones((b, p), jnp.float32),
        "next_sentence_labels": jnp.asarray([0, 1], jnp.int32),
    }


def hidden(config, params, x, options=None):
    outputs = encoder.encoder_outputs(
        config,
        params,
        x["input_ids"],
        x["segment_ids"],
        x["input_mask"],
        options=options or LayerOptions(),
    )
    return outputs.hidden_states


def test_scan_and_unrolled_are_identical(params):
    unrolled = dataclasses.replace(CONFIG, scan_layers=False)
    np.testing.assert_array_equal(
        hidden(CONFIG, params, batch()), hidden(unrolled, params, batch())
    )


def test_losses_and_hits_match_a_float64_log_softmax(params):
    x = batch(seed=3, b=4, p=5)
    x["masked_lm_weights"] = x["masked_lm_weights"].at[0, -2:].set(0.0)  # padded predictions
    x["next_sentence_labels"] = jnp.asarray([0, 1, 1, 0], jnp.int32)
    logits = pretraining.pretraining_logits(CONFIG, params, x)
    mlm, nsp = (np.asarray(a, np.float64) for a in logits)
    stats = pretraining.pretraining_stats(CONFIG, params, x)

    def nll_and_hits(logits, labels):
        shifted = logits - logits.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        nll = -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]
        return nll, (np.argmax(logits, -1) == labels).astype(np.float64)

    weights = np.asarray(x["masked_lm_weights"], np.float64)
    mlm_nll, mlm_hits = nll_and_hits(mlm, np.asarray(x["masked_lm_ids"]))
    nsp_nll, nsp_hits = nll_and_hits(nsp, np.asarray(x["next_sentence_labels"]))
    np.testing.assert_allclose(stats["mlm_loss_sum"], np.sum(mlm_nll * weights), rtol=1e-5)
    np.testing.assert_allclose(stats["mlm_correct_sum"], np.sum(mlm_hits * weights))
    np.testing.assert_allclose(stats["mlm_weight_sum"], np.sum(weights))
    np.testing.assert_allclose(stats["nsp_loss_sum"], np.sum(nsp_nll), rtol=1e-5)
    np.testing.assert_allclose(stats["nsp_correct_sum"], np.sum(nsp_hits))

    # The gradient of the summed loss with respect to the logits is softmax - one_hot.
    logits = jnp.asarray(mlm[0], jnp.float32)  # [P, V]
    labels = x["masked_lm_ids"][0]
    grad = jax.grad(lambda z: jnp.sum(pretraining._cross_entropy(z.T, labels, axis=0)[0]))(logits)
    expected = jax.nn.softmax(logits) - jax.nn.one_hot(labels, CONFIG.vocab_size)
    np.testing.assert_allclose(grad, expected, atol=1e-6)


@pytest.mark.slow
def test_remat_gives_the_same_gradients(params):
    remat = dataclasses.replace(CONFIG, remat=True)

    def loss(config, p):
        return pretraining.pretraining_stats(config, p, batch())["mlm_loss_sum"]

    a = jax.grad(lambda p: loss(CONFIG, p))(params)
    b = jax.grad(lambda p: loss(remat, p))(params)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_bfloat16_forward_stays_close_to_float32(params):
    bf16 = dataclasses.replace(CONFIG, dtype="bfloat16")
    a, b = hidden(CONFIG, params, batch()), hidden(bf16, params, batch())
    assert b.dtype == jnp.bfloat16
    error = np.abs(np.asarray(b, np.float32) - np.asarray(a))
    assert error.mean() < 0.03 and error.max() < 0.3  # LayerNorm output has unit scale


@pytest.mark.slow
def test_bfloat16_gradients_stay_close_to_float32(params):
    # On CPU every bfloat16 matmul of the backward pass runs through lambjax.models.matmul.
    bf16 = dataclasses.replace(CONFIG, dtype="bfloat16")

    def grads(config):
        return jax.jit(
            jax.grad(lambda p: pretraining.pretraining_stats(config, p, batch())["mlm_loss_sum"])
        )(params)

    for a, b in zip(jax.tree.leaves(grads(CONFIG)), jax.tree.leaves(grads(bf16)), strict=True):
        assert b.dtype == jnp.float32
        # About 1% per leaf; the key bias's true gradient is 0 (softmax ignores it).
        assert np.linalg.norm(b - a) <= 0.03 * np.linalg.norm(a) + 1e-4


@pytest.mark.slow
def test_bfloat16_gradients_on_8_sharded_devices_match_one_device(params):
    bf16 = dataclasses.replace(CONFIG, dtype="bfloat16")
    x = batch(seed=1, b=8)
    x["next_sentence_labels"] = jnp.asarray([0, 1] * 4, jnp.int32)

    def loss(p, x):
        return pretraining.pretraining_stats(bf16, p, x)["mlm_loss_sum"]

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    param_shardings = sharding.tree_shardings(params, param_logical_axes(bf16), mesh)
    batch_shardings = jax.tree.map(lambda _: sharding.batch_sharding(mesh), x)
    sharded = jax.jit(jax.value_and_grad(loss), in_shardings=(param_shardings, batch_shardings))
    one = jax.jit(jax.value_and_grad(loss))(params, x)
    # Sharded products and bias gradients sum bfloat16 terms in another order: up to 3%
    # apart per leaf, as far as from float32 (a wrong sharding is off by far more).
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(sharded(params, x)), strict=True):
        assert np.linalg.norm(b - a) <= 0.03 * np.linalg.norm(a) + 1e-4


def test_presets_have_the_published_parameter_counts():
    def count(name):
        shapes = jax.eval_shape(
            lambda k: init_params(BertConfig.preset(name), k), jax.random.key(0)
        )
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))

    # transformers' BertForPreTraining (decoder tied): base 110,106,428; large 336,226,108.
    assert count("base") == 110_106_428
    assert count("large") == 336_226_108


def test_parameters_get_the_rules_shardings_on_8_devices():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    config = BertConfig.preset("tiny", vocab_size=64)
    abstract = jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))
    shardings = sharding.tree_shardings(abstract, param_logical_axes(config), mesh)
    params = jax.jit(lambda k: init_params(config, k), out_shardings=shardings)(jax.random.key(0))
    P = jax.sharding.PartitionSpec
    layers = params["encoder"]["layers"]
    assert layers["attention"]["query"]["kernel"].sharding.spec == P(None, "fsdp", "tensor", None)
    assert layers["mlp"]["intermediate"]["kernel"].sharding.spec == P(None, "fsdp", "tensor")
    assert layers["mlp"]["output"]["kernel"].sharding.spec == P(None, "tensor", "fsdp")
    assert params["embeddings"]["word"]["embedding"].sharding.spec == P("tensor", "fsdp")
    for leaf in jax.tree.leaves(params):
        assert len(leaf.sharding.device_set) == 8


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_size=129), "hidden_size=129 is not divisible by num_heads=2"),
        (dict(layer_norm="middle"), "layer_norm='middle'"),
        (dict(num_layers=0), "num_layers=0"),
        (dict(hidden_dropout=1.5), "hidden_dropout=1.5"),
        (dict(dtype="int8"), "dtype='int8'"),
    ],
)
def test_bad_configs_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        BertConfig.preset("tiny", **overrides)
    with pytest.raises(ValueError, match="unknown BERT preset 'huge'"):
        BertConfig.preset("huge")


def test_dropped_layer_is_exactly_the_identity(params):
    keep = jnp.asarray([True, False, True])
    dropped = hidden(CONFIG, params, batch(), LayerOptions(keep=keep))
    two_layers = dataclasses.replace(CONFIG, num_layers=2)
    without = {
        **params,
        "encoder": {
            "layers": jax.tree.map(lambda x: x[jnp.asarray([0, 2])], params["encoder"]["layers"])
        },
    }
    np.testing.assert_array_equal(dropped, hidden(two_layers, without, batch()))


@pytest.mark.slow
def test_frozen_layers_get_no_gradient(params):
    def loss(p):
        options = LayerOptions(num_frozen_layers=2)
        stats = pretraining.pretraining_stats(CONFIG, p, batch(), options=options)
        return stats["mlm_loss_sum"]

    grads = jax.grad(loss)(params)
    layers = grads["encoder"]["layers"]
    for leaf in jax.tree.leaves(layers):
        assert np.all(np.asarray(leaf[:2]) == 0) and np.any(np.asarray(leaf[2]) != 0)
    assert np.all(np.asarray(grads["embeddings"]["position"]["embedding"]) == 0)


def test_a_recorded_config_reads_back_and_drops_the_retired_accumulation_field():
    config = BertConfig.preset("tiny", vocab_size=128)
    recorded = dataclasses.asdict(config)
    assert BertConfig.from_dict(recorded) == config
    assert BertConfig.from_dict({**recorded, "matmul_accumulation": "float32"}) == config
