"""The pure train step: accumulation, non-finite skipping, metrics."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from lambjax import optim
from lambjax.models import layer_layout, pretraining
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params
from lambjax.train import layerwise, trainer
from lambjax.train import step as step_lib
from lambjax.train.config import optimizer_config
from lambjax.train.optimizer import make_optimizer
from lambjax.train.state import TrainState
from tests import helpers
from tests.optim.references import update_and_apply

CONFIG = BertConfig.preset(
    "tiny", vocab_size=128, num_layers=2, dtype="float32", hidden_dropout=0.0, attention_dropout=0.0
)
BATCH, SEQ, PRED = 8, 16, 4


def random_batch(seed=0):
    return helpers.random_batch(seed, batch=BATCH, seq=SEQ, predictions=PRED, vocab_size=128)


@pytest.fixture(scope="module")
def optimizer():
    return make_optimizer(optimizer_config("lamb"), optax.constant_schedule(1e-3))


@functools.cache
def jitted_step(optimizer, accum, num_frozen_layers=0):
    return jax.jit(
        functools.partial(
            step_lib.train_step,
            settings=step_lib.StepSettings(
                model_config=CONFIG,
                optimizer=optimizer,
                schedule=optax.constant_schedule(1e-3),
                grad_accum_steps=accum,
                options=step_lib.StepOptions(num_frozen_layers=num_frozen_layers),
            ),
        )
    )


def fresh_state(optimizer, num_frozen_layers=0):
    params = init_params(CONFIG, jax.random.key(0))
    return TrainState.create(params, optimizer, num_frozen_layers)


@pytest.mark.slow
def test_accumulation_gives_the_global_batch_gradient(optimizer):
    batch = random_batch()
    one, metrics_one = jitted_step(optimizer, 1)(fresh_state(optimizer), batch, jax.random.key(1))
    four, metrics_four = jitted_step(optimizer, 4)(fresh_state(optimizer), batch, jax.random.key(1))
    for key in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "grad_norm", "update_norm"):
        np.testing.assert_allclose(metrics_four[key], metrics_one[key], rtol=2e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(four.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_split_microbatches_interleaves_rows():
    x = np.arange(12).reshape(12, 1)
    micro = step_lib.split_microbatches({"x": x}, 3)["x"]
    assert micro.shape == (3, 4, 1)
    np.testing.assert_array_equal(micro[1, :, 0], [1, 4, 7, 10])


@pytest.mark.slow
def test_nonfinite_step_is_skipped_and_counted(optimizer):
    state = fresh_state(optimizer)
    before = jax.tree.map(np.asarray, state.params)
    batch = random_batch()
    batch["masked_lm_weights"] = batch["masked_lm_weights"] * np.float32("nan")
    state, metrics = jitted_step(optimizer, 1)(state, batch, jax.random.key(1))
    assert metrics["nonfinite"] == 1.0 and metrics["update_norm"] == 0.0
    assert float(metrics["param_norm"]) == pytest.approx(f64_norm(before), rel=1e-6)
    assert int(state.consecutive_nonfinite) == 1 and int(state.total_nonfinite) == 1
    assert int(state.step) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(trainer.TrainingStopped, match=r"1 consecutive steps \(1\.\.1\)"):
        trainer.check_nonfinite(state, 1, limit=1)
    # A good step resets the streak.
    state, metrics = jitted_step(optimizer, 1)(state, random_batch(), jax.random.key(1))
    assert metrics["nonfinite"] == 0.0 and int(state.consecutive_nonfinite) == 0


def test_metrics_are_consistent(optimizer):
    _, metrics = jitted_step(optimizer, 1)(
        fresh_state(optimizer), random_batch(), jax.random.key(1)
    )
    assert 0 <= metrics["mlm_accuracy"] <= 1 and 0 <= metrics["nsp_accuracy"] <= 1
    np.testing.assert_allclose(
        metrics["loss"], metrics["mlm_loss"] + metrics["nsp_loss"], rtol=1e-6
    )
    # At initialisation the MLM loss is about log(vocab).
    assert abs(float(metrics["mlm_loss"]) - np.log(CONFIG.vocab_size)) < 1.0
    assert float(metrics["learning_rate"]) == pytest.approx(1e-3)
    assert jnp.isfinite(metrics["trust_ratio_mean"]) if "trust_ratio_mean" in metrics else True


def f64_norm(tree) -> float:
    return float(
        np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))
    )


def reference_gradient(params, batch):
    """The gradient of the global batch's loss, computed here without the train step."""
    mlm_total = np.sum(batch["masked_lm_weights"])

    def loss(params):
        stats = pretraining.pretraining_stats(CONFIG, params, batch)
        return stats["mlm_loss_sum"] / mlm_total + stats["nsp_loss_sum"] / BATCH

    return jax.grad(loss)(params)


# max_global_norm 0.5: below the gradient's norm at initialisation, so the clip acts.
NORM_CASES = {
    "lamb NVIDIA": ("lamb", {"max_global_norm": 0.5}),
    "lamb paper": (
        "lamb",
        {"max_global_norm": None, "exclude_norms_and_biases_from_trust_ratio": False},
    ),
    "lans": ("lans", {"max_global_norm": 0.5}),
    "adamw": ("adamw", {"max_global_norm": 0.5}),
}


def make_case_optimizer(name):
    kind, overrides = NORM_CASES[name]
    config = optimizer_config(kind)
    config.update(overrides)
    return make_optimizer(config, optax.constant_schedule(1e-3))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, accum, num_frozen_layers",
    [(name, 1, 0) for name in NORM_CASES] + [("lamb NVIDIA", 2, 1)],
)
def test_logged_norms_are_the_norms_of_the_step(name, accum, num_frozen_layers):
    """grad_norm (of the accumulated gradient the optimizer is given, before its clip),
    param_norm (of all parameters before the step, frozen ones included) and update_norm
    (of the update applied) against the same norms computed here in float64, whether the
    optimizer measured them (LAMB, LANS) or the step made a pass for them (AdamW).

    The update is checked on one gradient given to both `apply_if_finite` and the
    optimizer (LANS's update at step 1 is ~sign(g) / (|g| + eps) per element: the last bits
    of a gradient computed twice move it by 1e-4). The update applied is the optimizer's
    own on that gradient: the clip, given the step's gradient norm, still acts."""
    optimizer = make_case_optimizer(name)
    state, batch = fresh_state(optimizer, num_frozen_layers), random_batch()
    _, metrics = jitted_step(optimizer, accum, num_frozen_layers)(state, batch, jax.random.key(1))
    trainable, _ = layerwise.split(state.params, num_frozen_layers)
    grads, _ = layerwise.split(reference_gradient(state.params, batch), num_frozen_layers)
    if NORM_CASES[name][1]["max_global_norm"]:
        assert f64_norm(grads) > 0.5  # the clip acts
    assert float(metrics["grad_norm"]) == pytest.approx(f64_norm(grads), rel=1e-5)
    assert float(metrics["param_norm"]) == pytest.approx(f64_norm(state.params), rel=1e-6)

    apply = functools.partial(
        step_lib.apply_if_finite, optimizer=optimizer, num_frozen_layers=num_frozen_layers
    )
    new_state, metrics = jax.jit(apply)(state, grads, jnp.float32(1.0))
    updates, _ = jax.jit(optimizer.update)(grads, state.opt_state, trainable)
    assert metrics["nonfinite"] == 0.0
    assert float(metrics["grad_norm"]) == pytest.approx(f64_norm(grads), rel=1e-6)
    assert float(metrics["param_norm"]) == pytest.approx(f64_norm(state.params), rel=1e-6)
    assert float(metrics["update_norm"]) == pytest.approx(f64_norm(updates), rel=1e-6)
    applied, _ = layerwise.split(new_state.params, num_frozen_layers)
    expected = optax.apply_updates(trainable, updates)
    for got, want in zip(jax.tree.leaves(applied), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "name, optimizer_alone, step",
    [("adamw", 10, 20), ("lamb paper", 15, 16), ("lamb NVIDIA", 16, 16), ("lans", 22, 27)],
)
def test_logged_norms_cost_no_pass_where_the_optimizer_measures_them(name, optimizer_alone, step):
    """XLA's cost analysis of the compiled update (apply_if_finite and the step's metrics),
    in parameter-sized passes on XLA:CPU. Before the norms came from the optimizer the step
    made 20, 22, 23 and 30: a pass each for ||g||, ||x|| and ||update||, and the copies of
    the update's outputs. Now LAMB's norms cost nothing (NVIDIA's clip is given the norm of
    the finiteness test, the paper's LAMB pays that test's pass); LANS's update norm still
    takes its pass (it does not measure it) and AdamW's three."""
    if jax.default_backend() != "cpu":
        pytest.skip("counts XLA:CPU's fusions")
    params = {"kernel": jnp.ones((256, 1024)), "layers": {"kernel": jnp.ones((4, 128, 512))}}
    stacked = {"kernel": False, "layers": {"kernel": True}}
    lr = 1e-3
    tx = {
        "adamw": optax.adamw(lr, weight_decay=0.01),
        "lamb paper": optim.lamb(lr, weight_decay=0.01, stacked_layers=stacked),
        "lamb NVIDIA": optim.lamb(
            lr, weight_decay=0.01, max_global_norm=1.0, stacked_layers=stacked
        ),
        "lans": optim.lans(lr, weight_decay=0.01, stacked_layers=stacked),
    }[name]
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))

    def passes(fn, *args, donate):
        compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        return compiled.cost_analysis()["bytes accessed"] / param_bytes

    def update(state, grads):
        new_state, metrics = step_lib.apply_if_finite(state, grads, jnp.float32(1.0), tx, 0)
        schedule = optax.constant_schedule(lr)
        return new_state, step_lib.train_metrics(
            {}, 1.0, state, new_state, metrics, schedule=schedule
        )

    state = jax.eval_shape(lambda p: TrainState.create(p, tx), params)
    alone = passes(update_and_apply(tx), params, state.opt_state, params, donate=(0, 1))
    assert alone == pytest.approx(optimizer_alone, abs=0.01)
    assert passes(update, state, params, donate=(0,)) == pytest.approx(step, abs=0.01)


def test_the_steps_run_the_layer_options_they_are_given(optimizer):
    """`StepSettings.layer_options` (a step method's matmuls, e.g.) reach the train step's
    layer stack, and eval_step's `layer_options` its own."""
    from lambjax.models import matmul
    from lambjax.models.encoder import LayerOptions

    calls = {"train": 0, "eval": 0}

    def recording(name):
        def dot_general(*args, **kwargs):
            calls[name] += 1
            return matmul.dense_dot_general(*args, **kwargs)

        return dot_general

    settings = step_lib.StepSettings(
        model_config=CONFIG,
        optimizer=optimizer,
        schedule=optax.constant_schedule(1e-3),
        grad_accum_steps=1,
        layer_options=LayerOptions(dot_general=recording("train")),
    )
    state, batch = fresh_state(optimizer), random_batch()
    new_state, _ = jax.jit(functools.partial(step_lib.train_step, settings=settings))(
        state, batch, jax.random.key(1)
    )
    want, _ = jitted_step(optimizer, 1)(state, batch, jax.random.key(1))
    # The same matmul as the default: the same step; six Dense layers per traced layer.
    jax.tree.map(np.testing.assert_array_equal, new_state.params, want.params)
    assert calls["train"] >= 6
    options = LayerOptions(dot_general=recording("eval"))
    stats = step_lib.eval_step(state.params, batch, model_config=CONFIG, layer_options=options)
    assert calls["eval"] == 6  # the scanned layers, traced once
    np.testing.assert_array_equal(
        stats["mlm_loss_sum"],
        step_lib.eval_step(state.params, batch, model_config=CONFIG)["mlm_loss_sum"],
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lamb", "lans"])
def test_grouped_layers_take_the_per_leaf_step(name):
    """`optimizer.group_layers` on a state held one tree per layer (an unrolled run's):
    the same step to float32 rounding, the state in the same layout."""
    config = dataclasses.replace(CONFIG, scan_layers=False)
    schedule = optax.constant_schedule(1e-3)
    results = {}
    for grouped in (False, True):
        optimizer = make_optimizer(
            ml_collections.ConfigDict({**optimizer_config(name), "group_layers": grouped}),
            schedule,
        )
        params = layer_layout.unstack_layers(init_params(config, jax.random.key(0)))
        state = TrainState.create(params, optimizer)
        settings = step_lib.StepSettings(
            model_config=config, optimizer=optimizer, schedule=schedule, grad_accum_steps=2
        )
        step = jax.jit(functools.partial(step_lib.train_step, settings=settings))
        for seed in range(2):
            state, metrics = step(state, random_batch(seed), jax.random.key(seed))
        results[grouped] = (state, metrics)
    (per_leaf, per_leaf_metrics), (grouped, grouped_metrics) = results[False], results[True]
    assert jax.tree.structure(grouped) == jax.tree.structure(per_leaf)
    for a, b in zip(jax.tree.leaves(grouped), jax.tree.leaves(per_leaf), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        grouped_metrics["update_norm"], per_leaf_metrics["update_norm"], rtol=1e-5
    )
