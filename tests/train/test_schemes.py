"""The schemes of the core train step (lambjax.train.schemes): which a phase's options turn
on, in the order the step calls them, and the hooks' defaults changing nothing."""

import jax
import jax.numpy as jnp

from lambjax import sharding
from lambjax.models.encoder import LayerOptions
from lambjax.train import schemes, step
from lambjax.train.layer_drop import LayerDrop


def on(options, mesh=None):
    return [
        type(s).__name__
        for s in schemes.of(options, num_layers=4, grad_accum_steps=2, mesh=mesh, sum_keys=())
    ]


def test_the_core_step_alone_runs_no_scheme():
    assert on(step.StepOptions()) == []
    assert on(step.StepOptions(num_frozen_layers=2, train_decoder=True)) == []  # part of the core


def test_each_option_turns_its_scheme_on_in_the_steps_order():
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    options = step.StepOptions(
        layer_drop=LayerDrop(),
        standardization_loss_weight=0.1,
        noise_scale_ema_decay=0.9,
        gradient_reduction="once",
    )
    assert on(options, mesh) == ["LayerDropping", "StandardizationLoss", "NoiseScale", "ReduceOnce"]
    assert on(options) == ["LayerDropping", "StandardizationLoss", "NoiseScale"]  # no mesh


def test_the_default_hooks_change_nothing():
    scheme, key, options = schemes.Scheme(), jax.random.key(0), LayerOptions()
    loss, stats = jnp.float32(1.5), {"mlm_loss_sum": jnp.float32(3.0)}
    assert scheme.layer_options(options, key, 0) is options
    assert scheme.microbatch(loss, stats, options) == (loss, stats)
    assert scheme.dropout_key(key) is key
    assert scheme.objective(loss, stats, stats) == (loss, stats)
    assert scheme.metrics(0, stats, {}, {}) == {}
    assert scheme.grad_fn(len) is len and scheme.accumulate(len) is len


def test_layer_dropping_draws_from_its_own_stream_and_counts_the_layers_run():
    scheme = schemes.LayerDropping(LayerDrop(theta_bar=0.5, gamma=10.0), 4, 2)
    options = scheme.layer_options(LayerOptions(), jax.random.key(3), 5)
    keep, scale = scheme.schedule.sample(jax.random.fold_in(jax.random.key(3), 0x504C44), 5, 4)
    assert (options.keep == keep).all() and (options.scale == scale).all()
    _, stats = scheme.microbatch(jnp.float32(0), {}, options)
    assert stats["layers_run_sum"] == keep.sum()
    assert scheme.metrics(5, {"layers_run_sum": 6.0}, {}, {})["pld_layers_run"] == 3.0
