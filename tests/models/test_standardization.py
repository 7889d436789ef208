"""The standardization loss (Collins, Balle, Shlens 2019, arXiv 1903.00925) against a NumPy
reference, its placement in the encoder, and a few training steps with it."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lambjax.models import bert, encoder, hf, standardization
from lambjax.models.config import BertConfig
from lambjax.models.encoder import LayerOptions
from lambjax.models.params import init_params
from lambjax.train import step as step_lib
from lambjax.train.config import optimizer_config
from lambjax.train.optimizer import make_optimizer
from lambjax.train.state import TrainState
from tests.helpers import random_batch

CONFIG = BertConfig(
    vocab_size=128,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    intermediate_size=64,
    dtype="float32",
    hidden_dropout=0.0,
    attention_dropout=0.0,
    normalization="none",
)


@functools.cache
def initial_params():
    # Jitted: eager initialisation runs op by op.
    return jax.jit(init_params, static_argnums=0)(CONFIG, jax.random.key(0))


def numpy_standardization_loss(x, token_mask):
    """1/2 sum_i (mu_i^2 + sigma_i^2 - log sigma_i^2 - 1) over the unpadded tokens, float64."""
    tokens = np.asarray(x, np.float64)[np.asarray(token_mask) > 0]  # [tokens, H]
    mean, variance = tokens.mean(0), tokens.var(0)
    eps = standardization.LOG_VARIANCE_EPS
    return 0.5 * np.sum(mean**2 + variance - np.log(variance + eps) - 1)


def padded_mask(batch, seq, seed):
    lengths = np.random.default_rng(seed).integers(seq // 2, seq + 1, batch)
    return (np.arange(seq)[None] < lengths[:, None]).astype(np.int32)


def test_the_loss_matches_numpy_and_ignores_padding():
    rng = np.random.default_rng(0)
    x = 0.3 + 2.0 * rng.standard_normal((4, 10, 6))
    mask = padded_mask(4, 10, 1)
    x[mask == 0] = 1e3  # padding must not count
    loss = standardization.standardization_loss(jnp.asarray(x, jnp.float32), mask)
    np.testing.assert_allclose(loss, numpy_standardization_loss(x, mask), rtol=1e-5)
    standard = rng.standard_normal((1000, 6))
    standard = (standard - standard.mean(0)) / standard.std(0)
    zero = standardization.standardization_loss(jnp.asarray(standard[None]), np.ones((1, 1000)))
    assert abs(float(zero)) < 1e-4  # mu = 0, sigma^2 = 1: no loss (up to the log's eps)


@pytest.mark.slow
@pytest.mark.parametrize("layer_norm", ["post", "pre"])
def test_it_attaches_to_every_tensor_a_layer_norm_normalized(layer_norm):
    """One layer. PostLN: the embeddings' sum and the two residual sums; PreLN: the
    embeddings' sum, each sub-layer's input and the final LayerNorm's input; each through
    the scale and bias that replace its LayerNorm."""
    # Unrolled layers here; the training test below runs the scanned form.
    config = dataclasses.replace(CONFIG, scan_layers=False, layer_norm=layer_norm)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    params = jax.tree.map(  # non-trivial scales and biases
        lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape), params
    )
    batch = random_batch(seq=12, batch=4, vocab_size=128)
    batch["input_mask"] = padded_mask(4, 12, 2)
    options = LayerOptions(standardization_site="residual")
    encode = jax.jit(functools.partial(encoder.encoder_outputs, config, options=options))
    h, loss = encode(params, batch["input_ids"], batch["segment_ids"], batch["input_mask"])
    embeddings = params["embeddings"]
    layer = jax.tree.map(lambda x: x[0], params["encoder"]["layers"])
    bias = encoder.attention_bias(batch["input_mask"])

    def affine(x, norm):
        return x * norm["scale"] + norm["bias"]

    def attention(x):
        return bert.Attention(config).apply({"params": layer["attention"]}, x, bias, True)

    def mlp(x):
        return bert.Mlp(config).apply({"params": layer["mlp"]}, x, True)

    seq = np.arange(12)
    sites = [
        embeddings["word"]["embedding"][batch["input_ids"]]
        + embeddings["position"]["embedding"][seq][None]
        + embeddings["token_type"]["embedding"][batch["segment_ids"]]
    ]
    x = affine(sites[0], embeddings["layer_norm"])
    if layer_norm == "post":
        sites.append(x + attention(x))
        x = affine(sites[-1], layer["attention_layer_norm"])
        sites.append(x + mlp(x))
        expected_h = affine(sites[-1], layer["mlp_layer_norm"])
    else:
        sites.append(x)
        x = x + attention(affine(x, layer["attention_layer_norm"]))
        sites.append(x)
        sites.append(x + mlp(affine(x, layer["mlp_layer_norm"])))
        expected_h = affine(sites[-1], params["encoder"]["final_layer_norm"]["layer_norm"])
    expected = sum(numpy_standardization_loss(site, batch["input_mask"]) for site in sites)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(h, expected_h, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_training_with_it_lowers_both_losses_and_logs_it():
    optimizer = make_optimizer(optimizer_config("lamb"), optax.constant_schedule(1e-2))
    step = jax.jit(
        functools.partial(
            step_lib.train_step,
            settings=step_lib.StepSettings(
                model_config=CONFIG,
                optimizer=optimizer,
                schedule=optax.constant_schedule(1e-2),
                grad_accum_steps=2,
                options=step_lib.StepOptions(standardization_loss_weight=1e-2),
            ),
        )
    )
    state = TrainState.create(initial_params(), optimizer)
    batch = random_batch(seq=16, batch=8, vocab_size=128)
    history = []
    for index in range(12):
        state, metrics = step(state, batch, jax.random.key(index))
        history.append((float(metrics["loss"]), float(metrics["standardization_loss"])))
    # LAMB at 1e-2 moves each tensor ~1% a step: measured 5.51 -> 5.30 and 299 -> ~255.
    assert history[-1][0] < history[0][0] - 0.1, history
    assert history[-1][1] < 0.95 * history[0][1], history
    assert "standardization_loss" not in step_lib.eval_step(
        state.params, batch, model_config=CONFIG
    )


def test_export_refuses_a_model_without_layer_norm(tmp_path):
    params = initial_params()
    with pytest.raises(ValueError, match="normalization='none'"):
        hf.to_transformers(CONFIG, params, str(tmp_path / "hf"))


def test_at_the_preactivations_it_is_the_loss_of_each_ffn_input_to_gelu():
    """Two layers, scanned: the sum of L_std of each layer's intermediate dense output (before GELU,
    captured with Flax's intermediates), nothing from the residual sums; the outputs are
    those of the residual placement, the loss is not."""
    config = dataclasses.replace(CONFIG, num_layers=2)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    batch = random_batch(seq=12, batch=4, vocab_size=128)
    batch["input_mask"] = padded_mask(4, 12, 3)
    inputs = (batch["input_ids"], batch["segment_ids"], batch["input_mask"])

    def encode(site):
        return jax.jit(
            functools.partial(
                encoder.encoder_outputs, config, options=LayerOptions(standardization_site=site)
            )
        )(params, *inputs)

    h, loss = encode("preactivation")
    h_residual, loss_residual = encode("residual")
    # The pre-activations, layer by layer, from an unrolled run that captures them.
    x = bert.Embeddings(config).apply(
        {"params": params["embeddings"]}, batch["input_ids"], batch["segment_ids"], True
    )
    bias = encoder.attention_bias(batch["input_mask"])
    preactivations = []
    for i in range(2):
        layer = jax.tree.map(lambda p, i=i: p[i], params["encoder"]["layers"])
        x, captured = bert.Layer(config).apply(
            {"params": layer},
            x,
            bias,
            1.0,
            True,
            capture_intermediates=lambda module, _: module.name == "intermediate",
            mutable=["intermediates"],
        )
        preactivations.append(captured["intermediates"]["mlp"]["intermediate"]["__call__"][0])
    expected = sum(numpy_standardization_loss(p, batch["input_mask"]) for p in preactivations)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_array_equal(h, h_residual)
    np.testing.assert_allclose(h, x, rtol=1e-5, atol=1e-6)
    assert abs(float(loss) - float(loss_residual)) > 1.0  # different tensors


@pytest.mark.slow
def test_weight_zero_is_bitwise_the_model_without_normalization():
    """At weight 0 the site adds nothing: two steps with the pre-activation site are the
    plain no-norm model's, bit for bit (the sites' losses differ: the test above)."""
    optimizer = make_optimizer(optimizer_config("adamw"), optax.constant_schedule(1e-3))
    batch = random_batch(seq=16, batch=8, vocab_size=128)

    def two_steps(**standardization):
        step = jax.jit(
            functools.partial(
                step_lib.train_step,
                settings=step_lib.StepSettings(
                    model_config=CONFIG,
                    optimizer=optimizer,
                    schedule=optax.constant_schedule(1e-3),
                    grad_accum_steps=1,
                    options=step_lib.StepOptions(**standardization),
                ),
            )
        )
        state = TrainState.create(initial_params(), optimizer)
        for index in range(2):
            state, _ = step(state, batch, jax.random.key(index))
        return state.params

    zero = two_steps(standardization_loss_weight=0.0, standardization_loss_site="preactivation")
    jax.tree.map(np.testing.assert_array_equal, zero, two_steps())
