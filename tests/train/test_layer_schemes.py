"""Progressive layer dropping and multi-stage layerwise training, at the train-step level."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lambjax.models import bert, encoder, pretraining
from lambjax.models.config import BertConfig
from lambjax.models.encoder import LayerOptions
from lambjax.models.params import init_params, param_logical_axes
from lambjax.train import config as config_lib
from lambjax.train import layerwise, plan, throughput, variants
from lambjax.train import step as step_lib
from lambjax.train.config import optimizer_config
from lambjax.train.layer_drop import LayerDrop
from lambjax.train.optimizer import learning_rate_schedule, make_optimizer
from lambjax.train.state import TrainState
from tests.helpers import dot_flops, random_batch

CONFIG = BertConfig.preset("tiny", vocab_size=128, num_layers=4, dtype="float32", layer_norm="pre")


@functools.cache
def optimizer(name):
    return make_optimizer(optimizer_config(name), optax.constant_schedule(1e-3))


def run_steps(name="lamb", steps=3, accum=2, **step_kwargs):
    step = jax.jit(
        functools.partial(
            step_lib.train_step,
            settings=step_lib.StepSettings(
                model_config=CONFIG,
                optimizer=optimizer(name),
                schedule=optax.constant_schedule(1e-3),
                grad_accum_steps=accum,
                options=step_lib.StepOptions(**step_kwargs),
            ),
        )
    )
    params = init_params(CONFIG, jax.random.key(0))
    frozen = step_kwargs.get("num_frozen_layers", 0)
    decoder = step_kwargs.get("train_decoder", False)
    state = TrainState.create(params, optimizer(name), frozen, train_decoder=decoder)
    history = []
    for index in range(steps):
        state, metrics = step(state, random_batch(index), jax.random.key(1))
        history.append(jax.device_get(metrics))
    return params, state, history


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------------------
# Progressive layer dropping


def numpy_theta(theta_bar, gamma, t):
    return (1 - theta_bar) * np.exp(-gamma * t) + theta_bar


def deepspeed_rule(theta, num_layers):
    """DeepSpeedExamples' modelingpreln_layerdrop.py, transcribed: per layer i (0-based),
    (keep probability, scale of a kept layer)."""
    drop_step = (1 - theta) / num_layers
    keep = [1 - i * drop_step for i in range(num_layers)]
    scale = [1 / (1 - (i + 1) * drop_step) for i in range(num_layers)]
    return np.array(keep), np.array(scale)


def paper_rule(theta, num_layers):
    """The paper's p_l = 1 - (l / L)(1 - theta), l = 1..L, a kept layer scaled by 1/p_l."""
    p = np.array([1 - (layer / num_layers) * (1 - theta) for layer in range(1, num_layers + 1)])
    return p, 1 / p


RULES = {"deepspeed": deepspeed_rule, "paper": paper_rule}


@pytest.mark.parametrize("depth_rule", RULES)
def test_keep_probabilities_and_scales_follow_the_rule(depth_rule):
    drop = LayerDrop(theta_bar=0.6, gamma=0.01, step_offset=100, depth_rule=depth_rule)
    for step in [0, 1, 50, 400]:
        theta = numpy_theta(0.6, 0.01, step + 100)
        np.testing.assert_allclose(drop.theta(step), theta, rtol=1e-6)
        keep, scale = RULES[depth_rule](theta, 12)
        np.testing.assert_allclose(drop.keep_probabilities(step, 12), keep, rtol=1e-6)
        np.testing.assert_allclose(drop.scales(step, 12), scale, rtol=1e-6)
    assert float(LayerDrop(0.5, 0.001).theta(0)) == 1.0  # theta(0) = 1: nothing dropped
    np.testing.assert_allclose(LayerDrop(0.5, 0.001).theta(10**7), 0.5)  # -> theta_bar


def test_the_default_rule_is_deepspeeds_and_never_drops_the_first_layer():
    assert LayerDrop().depth_rule == "deepspeed"
    drop = LayerDrop(theta_bar=0.5, gamma=1.0)
    probabilities = drop.keep_probabilities(50, 4)  # theta(50) = 0.5: step = 1/8
    np.testing.assert_allclose(probabilities, [1.0, 7 / 8, 6 / 8, 5 / 8], rtol=1e-6)
    np.testing.assert_allclose(drop.scales(50, 4), [8 / 7, 8 / 6, 8 / 5, 8 / 4], rtol=1e-6)


@pytest.mark.parametrize("depth_rule", RULES)
def test_layers_are_kept_as_often_as_the_rule_says(depth_rule):
    drop = LayerDrop(theta_bar=0.5, gamma=1.0, depth_rule=depth_rule)
    draws = 20000
    keys = jax.random.split(jax.random.key(0), draws)
    keep, scale = jax.vmap(lambda k: drop.sample(k, 50, 4))(keys)
    expected_keep, expected_scale = RULES[depth_rule](0.5, 4)  # theta(50) = 0.5 in float32
    # Four standard errors of a frequency over 20,000 draws: at most 0.014.
    np.testing.assert_allclose(keep.mean(0), expected_keep, atol=4 * np.sqrt(0.25 / draws))
    if depth_rule == "deepspeed":
        assert bool(keep[:, 0].all())  # the first layer ran in every draw
    np.testing.assert_allclose(scale[0], expected_scale, rtol=1e-6)


@pytest.mark.parametrize(
    "bad",
    [dict(theta_bar=0.0), dict(theta_bar=1.5), dict(gamma=-1.0), dict(depth_rule="reference")],
)
def test_bad_layer_drop_settings_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        LayerDrop(**bad)


@pytest.mark.slow
def test_theta_one_gives_the_baseline_bit_for_bit():
    _, baseline, baseline_metrics = run_steps()
    _, always_kept, metrics = run_steps(layer_drop=LayerDrop(theta_bar=1.0, gamma=0.5))
    assert_trees_equal(baseline.params, always_kept.params)
    assert_trees_equal(baseline.opt_state, always_kept.opt_state)
    assert [m["loss"] for m in baseline_metrics] == [m["loss"] for m in metrics]
    assert all(m["pld_layers_run"] == CONFIG.num_layers for m in metrics)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lamb", "lans"])
def test_dropping_trains_with_accumulation_and_both_optimizers(name):
    _, state, metrics = run_steps(name, steps=4, layer_drop=LayerDrop(theta_bar=0.5, gamma=2.0))
    layers_run = [m["pld_layers_run"] for m in metrics]
    assert layers_run[0] == CONFIG.num_layers  # theta(0) = 1
    assert min(layers_run[1:]) < CONFIG.num_layers  # later steps skip some layers
    assert all(np.isfinite(m["loss"]) and m["nonfinite"] == 0 for m in metrics)
    np.testing.assert_allclose(metrics[-1]["pld_theta"], 0.5 + 0.5 * np.exp(-6.0), rtol=1e-6)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))


@pytest.mark.slow
def test_dropping_gives_the_same_step_on_8_sharded_devices():
    """The keep draws depend on the step's key only, so every replica drops the same layers."""
    from lambjax import sharding

    drop = LayerDrop(theta_bar=0.5, gamma=2.0)
    _, single, single_metrics = run_steps(steps=3, layer_drop=drop)
    mesh = sharding.make_mesh({"data": 4, "fsdp": 2, "tensor": 1})
    params = init_params(CONFIG, jax.random.key(0))
    state = TrainState.create(params, optimizer("lamb"))
    param_shardings = sharding.tree_shardings(params, param_logical_axes(CONFIG), mesh)
    state = state.replace(params=jax.device_put(state.params, param_shardings))
    step = jax.jit(
        functools.partial(
            step_lib.train_step,
            settings=step_lib.StepSettings(
                model_config=CONFIG,
                optimizer=optimizer("lamb"),
                schedule=optax.constant_schedule(1e-3),
                grad_accum_steps=2,
                options=step_lib.StepOptions(layer_drop=drop),
            ),
        )
    )
    for index in range(3):
        batch = jax.device_put(random_batch(index), sharding.batch_sharding(mesh))
        state, metrics = step(state, batch, jax.random.key(1))
        assert metrics["pld_layers_run"] == single_metrics[index]["pld_layers_run"]
        np.testing.assert_allclose(metrics["loss"], single_metrics[index]["loss"], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(single.params), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------
# Multi-stage layerwise training


def test_split_and_merge_are_inverse():
    params = init_params(CONFIG, jax.random.key(0))
    trainable, frozen = layerwise.split(params, 3)
    assert "embeddings" not in trainable
    assert jax.tree.leaves(trainable["encoder"]["layers"])[0].shape[0] == 1
    assert_trees_equal(layerwise.merge(trainable, frozen), params)
    assert layerwise.split(params, 0) == (params, None)


@pytest.mark.slow
def test_frozen_layers_and_embeddings_stay_bit_identical_through_a_stage():
    params, state, metrics = run_steps(steps=3, num_frozen_layers=2)
    before, after = params["encoder"]["layers"], state.params["encoder"]["layers"]
    assert_trees_equal(jax.tree.map(lambda x: x[:2], before), jax.tree.map(lambda x: x[:2], after))
    assert_trees_equal(params["embeddings"], state.params["embeddings"])
    changed = [
        bool(jnp.any(a[2:] != b[2:]))
        for a, b in zip(*map(jax.tree.leaves, (before, after)), strict=True)
    ]
    assert all(changed)
    assert any(
        bool(jnp.any(a != b))
        for a, b in zip(
            *map(jax.tree.leaves, (params["heads"], state.params["heads"])), strict=True
        )
    )
    assert all(np.isfinite(m["loss"]) for m in metrics)


def test_optimizer_state_exists_only_for_the_trained_layers():
    params = init_params(CONFIG, jax.random.key(0))
    trainable, _ = layerwise.split(params, 3)
    state = TrainState.create(params, optimizer("lans"), num_frozen_layers=3)
    shapes = lambda tree: [x.shape for x in jax.tree.leaves(tree)]  # noqa: E731
    assert shapes(state.opt_state) == shapes(optimizer("lans").init(trainable))
    assert not optax.tree_utils.tree_get_all_with_path(state.opt_state, "embeddings")
    stacked = optax.tree_utils.tree_get_all_with_path(state.opt_state, "layers")
    assert stacked and all(x.shape[0] == 1 for _, sub in stacked for x in jax.tree.leaves(sub))


def test_no_backward_pass_runs_through_frozen_layers():
    """The traced matmuls of the gradient: forward everywhere, backward above the frozen."""
    config = dataclasses.replace(CONFIG, scan_layers=False)
    params = init_params(config, jax.random.key(0))
    x = random_batch(0)
    frozen_count = 3
    trainable, frozen = layerwise.split(params, frozen_count)

    def loss(trainable):
        merged = layerwise.merge(trainable, frozen)
        options = LayerOptions(num_frozen_layers=frozen_count)
        stats = pretraining.pretraining_stats(config, merged, x, options=options)
        return stats["mlm_loss_sum"]

    traced = dot_flops(jax.make_jaxpr(jax.grad(loss))(trainable).jaxpr)
    batch, seq, predictions = x["input_ids"].shape + (x["masked_lm_ids"].shape[1],)
    expected = throughput.train_step_flops(
        config, batch, seq, predictions, num_frozen_layers=frozen_count
    )
    full = throughput.train_step_flops(config, batch, seq, predictions)
    assert expected < 0.55 * full  # 3 of 4 layers without their backward
    assert 0.8 * expected < traced <= expected


def test_grow_layers_copies_the_top_layers():
    config = BertConfig.preset("tiny", vocab_size=64, num_layers=3, dtype="float32")
    params = init_params(config, jax.random.key(0))
    grown_config, grown = layerwise.grow_layers(config, params, 5)
    assert grown_config.num_layers == 5
    src = params["encoder"]["layers"]["mlp"]["output"]["kernel"]
    new = grown["encoder"]["layers"]["mlp"]["output"]["kernel"]
    for target, source in [(0, 0), (1, 1), (2, 2), (3, 1), (4, 2)]:
        np.testing.assert_array_equal(new[target], src[source])


def stage_plans(num_steps=90, continue_schedule=False):
    """The `mslt` variant's three stages of a 4-layer model (depths 1, 2, 4), resolved."""
    config = config_lib.base_config()
    config.model.overrides.num_layers = 4
    config_lib.with_phases(
        config,
        phase1=config_lib.phase_config(
            max_seq_length=32,
            max_predictions_per_seq=5,
            global_batch_size=8,
            num_steps=num_steps,
            learning_rate=1e-3,
            warmup_fraction=0.1,
        ),
    )
    config = variants.apply(config, ["mslt"])
    for name in config.phase_order[1:]:
        config.phases[name].continue_schedule = continue_schedule
    return plan.resolve(config, vocab_size=128, num_devices=1).phases


def numpy_poly_warmup(peak, total, warmup, steps):
    """NVIDIA's PolyWarmUpScheduler, steps counted from 1."""
    p = (np.asarray(steps) + 1) / total
    return np.where(p < warmup, peak * p / warmup, peak * np.clip(1 - p, 0, 1) ** 0.5)


@pytest.mark.parametrize("continue_schedule", [False, True])
def test_one_schedule_runs_on_across_the_stages(continue_schedule):
    phases = stage_plans(continue_schedule=continue_schedule)
    assert [(p.model.num_layers, p.step.num_frozen_layers, p.num_steps) for p in phases] == [
        (1, 0, 30),
        (2, 1, 30),
        (4, 2, 30),
    ]
    # Each stage's schedule at its own step count 0 ... 29, as the train step calls it.
    rates = np.concatenate(
        [
            np.asarray(jax.vmap(learning_rate_schedule(p.schedule))(jnp.arange(p.num_steps)))
            for p in phases
        ]
    )
    if continue_schedule:  # one warm-up over 9 steps, one decay to 0 at step 90
        expected = numpy_poly_warmup(1e-3, 90, 0.1, np.arange(90))
    else:  # each stage re-warms over 3 steps and decays to 0 at its end
        expected = np.tile(numpy_poly_warmup(1e-3, 30, 0.1, np.arange(30)), 3)
    np.testing.assert_allclose(rates, expected, rtol=1e-5, atol=1e-12)
    jumps = np.abs(np.diff(rates)).max()
    assert jumps < 1.2e-4 if continue_schedule else jumps > 3e-4


@pytest.mark.slow
def test_a_trained_decoder_changes_while_the_frozen_layers_and_lookups_do_not():
    params, state, metrics = run_steps(steps=3, num_frozen_layers=2, train_decoder=True)
    before, after = params["encoder"]["layers"], state.params["encoder"]["layers"]
    assert_trees_equal(jax.tree.map(lambda x: x[:2], before), jax.tree.map(lambda x: x[:2], after))
    other_embeddings = lambda tree: {k: v for k, v in tree["embeddings"].items() if k != "word"}  # noqa: E731
    assert_trees_equal(other_embeddings(params), other_embeddings(state.params))
    word = params["embeddings"]["word"]["embedding"]
    assert bool(jnp.any(state.params["embeddings"]["word"]["embedding"] != word))
    view, _ = layerwise.split(params, 2, train_decoder=True)
    shapes = lambda tree: [x.shape for x in jax.tree.leaves(tree)]  # noqa: E731
    assert shapes(state.opt_state) == shapes(optimizer("lamb").init(view))
    moments = optax.tree_utils.tree_get_all_with_path(state.opt_state, "word")
    assert any(x.shape == word.shape for _, m in moments for x in jax.tree.leaves(m))
    assert all(np.isfinite(m["loss"]) for m in metrics)


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False])
def test_the_trained_decoder_gradient_is_the_output_projection_part(scan_layers):
    """The word embeddings' gradient in a stage is that of the tied decoder alone: the MLM
    loss differentiated with respect to the matrix the heads project onto, the encoder's
    output held fixed. Trained from the input as well (no frozen layers), it differs."""
    config = dataclasses.replace(CONFIG, scan_layers=scan_layers)
    params = init_params(config, jax.random.key(0))
    x = random_batch(0)
    trainable, frozen = layerwise.split(params, 2, train_decoder=True)

    def stage_loss(trainable):
        merged = layerwise.merge(trainable, frozen)
        stats = pretraining.pretraining_stats(
            config, merged, x, options=LayerOptions(num_frozen_layers=2)
        )
        return stats["mlm_loss_sum"]

    gradient = jax.grad(stage_loss)(trainable)["embeddings"]["word"]["embedding"]
    hidden = encoder.encode(config, params, x["input_ids"], x["segment_ids"], x["input_mask"])

    def decoder_loss(decoder):
        logits = bert.Heads(config).apply(
            {"params": params["heads"]}, hidden, x["masked_lm_positions"], decoder
        )
        return pretraining.stats_from_logits(*logits, x)["mlm_loss_sum"]

    word = params["embeddings"]["word"]["embedding"]
    reference = jax.grad(decoder_loss)(word)
    np.testing.assert_allclose(gradient, reference, rtol=1e-5, atol=1e-7)
    full = jax.grad(lambda p: pretraining.pretraining_stats(config, p, x)["mlm_loss_sum"])(params)[
        "embeddings"
    ]["word"]["embedding"]
    assert float(jnp.abs(full - reference).max()) > 100 * 1e-7
