"""The train state's layer layouts (lambjax.train.layout): stacked at rest, one tree per
layer in an unrolled run's steps. The conversions are exact, the steps compute the same
numbers in either layout, checkpoints cross layouts, and the unrolled step built on
per-layer trees assembles no stacked gradient."""

import functools
import os
import re
import shutil

import jax
import numpy as np
import optax
import pytest
from jax._src.cudnn import fused_attention_stablehlo

from lambjax.models import layer_layout
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params, param_logical_axes
from lambjax.train import checkpointing, layerwise, layout
from lambjax.train import step as step_lib
from lambjax.train.config import optimizer_config
from lambjax.train.optimizer import make_optimizer
from lambjax.train.state import TrainState
from tests import helpers
from tests.helpers import random_batch

# Three layers: no other array of the model has a leading axis of 3, so a stacked layer leaf
# is recognised by its shape in the compiled text.
LAYERS = 3
CONFIG = BertConfig.preset("tiny", vocab_size=128, num_layers=LAYERS, dtype="float32")
UNROLLED = BertConfig.preset(
    "tiny", vocab_size=128, num_layers=LAYERS, dtype="float32", scan_layers=False
)


@functools.cache
def optimizer(name):
    return make_optimizer(optimizer_config(name), optax.constant_schedule(1e-2))


def stacked_state(name, num_frozen_layers=0, config=CONFIG):
    params = init_params(config, jax.random.key(0))
    return TrainState.create(params, optimizer(name), num_frozen_layers)


@functools.cache
def jitted_step(config, name, num_frozen_layers=0):
    return jax.jit(
        functools.partial(
            step_lib.train_step,
            settings=step_lib.StepSettings(
                model_config=config,
                optimizer=optimizer(name),
                schedule=optax.constant_schedule(1e-2),
                grad_accum_steps=1,
                options=step_lib.StepOptions(num_frozen_layers=num_frozen_layers),
            ),
        )
    )


def run(config, name, state, steps, first=0, num_frozen_layers=0):
    step = jitted_step(config, name, num_frozen_layers)
    metrics = []
    for index in range(first, first + steps):
        state, m = step(state, random_batch(index), jax.random.key(7))
        metrics.append(m)
    return state, metrics


def is_ratio_vector(path) -> bool:
    """Whether a state leaf is one of the optimizer's vectors of per-tensor trust ratios."""
    return "trust_ratios" in jax.tree_util.keystr(path)


def in_any_layout(path, leaf):
    """A state leaf as both layouts hold it: a vector of per-tensor ratios follows the
    order of its layout's leaves (lambjax.optim), so it compares as sorted values."""
    return np.sort(leaf) if is_ratio_vector(path) else leaf


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------------------
# The conversions


@pytest.mark.parametrize(
    "name, num_frozen_layers", [("lamb", 0), ("lans", 0), ("adamw", 0), ("lans", 2)]
)
def test_to_running_and_to_rest_are_exact_inverses(name, num_frozen_layers):
    stacked = stacked_state(name, num_frozen_layers)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(stacked))))
    stacked = jax.tree.map(  # every leaf its own values, so a misplaced one shows
        lambda x: jax.random.normal(next(keys), x.shape).astype(x.dtype), stacked
    )
    running = layout.to_running(stacked, num_frozen_layers)
    encoder = running.params["encoder"]
    assert "layers" not in encoder
    assert [layer_layout.layer_index(k) for k in encoder if k.startswith("layers")] == [0, 1, 2]
    np.testing.assert_array_equal(
        encoder["layers_1"]["mlp"]["intermediate"]["kernel"],
        stacked.params["encoder"]["layers"]["mlp"]["intermediate"]["kernel"][1],
    )
    # The optimizer state converted is the one the optimizer builds for per-layer params.
    trainable, _ = layerwise.split(running.params, num_frozen_layers)
    fresh = optimizer(name).init(trainable)
    assert jax.tree.structure(running.opt_state) == jax.tree.structure(fresh)
    assert [x.shape for x in jax.tree.leaves(running.opt_state)] == [
        x.shape for x in jax.tree.leaves(fresh)
    ]
    assert_trees_equal(layout.to_rest(running), stacked)
    with pytest.raises(ValueError, match="already stacked"):
        layout.to_rest(stacked)


def test_running_logical_axes_drop_the_layers_axis():
    axes = layout.running_param_axes(param_logical_axes(CONFIG), LAYERS)
    stacked = param_logical_axes(CONFIG)["encoder"]["layers"]["mlp"]["intermediate"]
    assert stacked["kernel"] == jax.sharding.PartitionSpec("layers", "embed", "mlp")
    assert axes["encoder"]["layers_2"]["mlp"]["intermediate"]["kernel"] == (
        jax.sharding.PartitionSpec("embed", "mlp")
    )


# ----------------------------------------------------------------------------------------
# The same numbers in either layout


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, num_frozen_layers", [("lamb", 0), ("lans", 0), ("lamb", 1)], ids=["lamb", "lans", "mslt"]
)
def test_unrolled_per_layer_steps_match_scanned_stacked_steps(name, num_frozen_layers):
    """LAMB and LANS take one trust ratio per layer slice of a stacked leaf, which is the
    ratio of that layer's own tree: the parameters agree after a few steps (float32)."""
    start = stacked_state(name, num_frozen_layers)
    scanned, scanned_metrics = run(CONFIG, name, start, 4, num_frozen_layers=num_frozen_layers)
    running = layout.to_running(stacked_state(name, num_frozen_layers), num_frozen_layers)
    per_layer, metrics = run(UNROLLED, name, running, 4, num_frozen_layers=num_frozen_layers)
    back = layout.to_rest(per_layer)
    assert jax.tree.structure(back) == jax.tree.structure(scanned)
    skipped = 0
    for (path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(back), jax.tree.leaves(scanned), strict=True
    ):
        # The key projection's bias has a gradient of 0 (softmax does not see a shift of
        # every score) up to rounding; LANS normalises each gradient to unit norm, so its
        # update is that rounding noise, scaled up: it differs between any two programs.
        # Left out: the bias, its two moments and the two ratio vectors (they hold its ratios).
        key_bias = "'key'" in jax.tree_util.keystr(path) and "bias" in str(path[-1])
        if name == "lans" and (key_bias or is_ratio_vector(path)):
            skipped += 1
            continue
        got, want = in_any_layout(path, got), in_any_layout(path, want)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=str(path))
    assert skipped == (5 if name == "lans" else 0)
    moved = [
        float(np.abs(a - b).max())
        for a, b in zip(*map(jax.tree.leaves, (start, scanned)), strict=True)
    ]
    assert max(moved) > 1e-3  # the steps did move the parameters
    # LANS's extreme ratios include the key bias's (above).
    keys = ("loss", "grad_norm") + (("trust_ratio",) if name == "lamb" else ())
    for key in metrics[-1]:
        if key.startswith(keys):
            np.testing.assert_allclose(metrics[-1][key], scanned_metrics[-1][key], rtol=2e-5)


@pytest.mark.slow
def test_a_checkpoint_restores_across_layouts_and_resumes_bitwise(tmp_path):
    """Saved at rest from per-layer steps: restored per layer, the next steps are bitwise
    those of the uninterrupted run; restored into scanned steps, they agree to float32."""
    name = "lamb"
    running = layout.to_running(stacked_state(name), 0)
    uninterrupted, _ = run(UNROLLED, name, running, 4)
    halfway, _ = run(UNROLLED, name, layout.to_running(stacked_state(name), 0), 2)
    ckpt = checkpointing.PhaseCheckpoints(str(tmp_path), "phase1", max_to_keep=2, async_save=False)
    ckpt.save(2, layout.to_rest(halfway), {"position": 2}, {"phase": "phase1"})
    ckpt.close()
    saved = checkpointing.read_state_on_host(tmp_path / "checkpoints" / "phase1" / "2" / "state")
    assert saved["params"]["encoder"]["layers"]["mlp"]["output"]["kernel"].shape[0] == LAYERS

    ckpt = checkpointing.PhaseCheckpoints(str(tmp_path), "phase1", max_to_keep=2, async_save=False)
    abstract = jax.eval_shape(lambda: stacked_state(name))
    restored = ckpt.restore_latest(abstract).state
    ckpt.close()
    resumed, _ = run(UNROLLED, name, layout.to_running(restored, 0), 2, first=2)
    assert_trees_equal(resumed, uninterrupted)
    scanned, _ = run(CONFIG, name, restored, 2, first=2)
    expected = layout.to_rest(uninterrupted)
    for (path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(scanned), jax.tree.leaves(expected), strict=True
    ):
        got, want = in_any_layout(path, got), in_any_layout(path, want)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


# ----------------------------------------------------------------------------------------
# No stacked gradient in the unrolled step


@pytest.fixture
def cudnn_version_check_passes(monkeypatch):
    """The cuDNN version check asks the GPU runtime; this host has none."""
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda *a, **k: 91000)


def stacked_leaf_shapes() -> set[tuple]:
    params = jax.eval_shape(lambda: init_params(CONFIG, jax.random.key(0)))
    return {x.shape for x in jax.tree.leaves(params["encoder"]["layers"])}


def assembling_ops(cuda_text: str, cpu_text: str) -> tuple[int, int]:
    """(StableHLO ops, optimized CPU HLO ops) that build an array of a stacked layer leaf's
    shape from pieces: pad, concatenate, dynamic-update-slice."""
    shapes = stacked_leaf_shapes()
    cuda = [
        m
        for m in re.findall(
            r"stablehlo\.(?:pad|concatenate|dynamic_update_slice)\b[^\n]*-> tensor<([\dx]+)xf32>",
            cuda_text,
        )
        if tuple(map(int, m.split("x"))) in shapes
    ]
    cpu = [
        m
        for m in re.findall(
            r"= f32\[([\d,]+)\]\S* (?:pad|concatenate|dynamic-update-slice)\(", cpu_text
        )
        if tuple(map(int, m.split(","))) in shapes
    ]
    return len(cuda), len(cpu)


def lowered_and_compiled(config, per_layer: bool) -> tuple[str, str]:
    name = "lamb"
    state = jax.eval_shape(lambda: stacked_state(name, config=config))
    if per_layer:
        state = jax.eval_shape(lambda s: layout.to_running(s, 0), state)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), random_batch(0))
    step = functools.partial(
        step_lib.train_step,
        settings=step_lib.StepSettings(
            model_config=config,
            optimizer=optimizer(name),
            schedule=optax.constant_schedule(1e-2),
            grad_accum_steps=1,
        ),
    )
    traced = jax.jit(step, donate_argnums=(0,)).trace(state, batch, jax.random.key(1))
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    return cuda, traced.lower().compile().as_text()


@pytest.mark.slow
def test_the_unrolled_step_assembles_no_stacked_gradient(cudnn_version_check_passes):
    """Reading layer i as a slice of the stacked tree makes the gradient of every stacked
    leaf one pad per layer, summed: XLA keeps them (CPU) or turns them into concatenations
    and dynamic-update-slices (GPU), a copy of every layer's gradient each step. Held one
    tree per layer, nothing of a stacked shape is built in the step at all."""
    params = jax.eval_shape(lambda: init_params(CONFIG, jax.random.key(0)))
    per_leaf = len(jax.tree.leaves(params["encoder"]["layers"]))
    cuda, cpu = assembling_ops(*lowered_and_compiled(UNROLLED, per_layer=False))
    assert cuda >= per_leaf * LAYERS and cpu >= per_leaf * LAYERS, (cuda, cpu)
    assert assembling_ops(*lowered_and_compiled(UNROLLED, per_layer=True)) == (0, 0)


# ----------------------------------------------------------------------------------------
# The trainer: an unrolled run saves stacked and continues scanned


@pytest.mark.slow
def test_an_unrolled_run_saves_stacked_and_continues_scanned(data_dir, tmp_path):
    """The demo (layers unrolled), float32, phase 1 only, 8 steps: its step-4 checkpoint is
    saved stacked, and continued from there with the layers scanned the run logs the
    unrolled run's losses to float32 rounding. (Continued unrolled after a kill it resumes
    bitwise: tests/train/test_runs.py's kill-and-rerun test, the demo runs unrolled.)"""
    steps = 8
    flags = (
        "--config.model.overrides.dtype=float32",
        "--config.phase_order=('phase1',)",
        f"--config.phases.phase1.num_steps={steps}",
    )
    config = "configs/default.py"
    reference = str(tmp_path / "reference")
    helpers.run(helpers.demo_command(reference, data_dir, *flags, config=config), 4)
    saved = checkpointing.read_state_on_host(
        os.path.join(reference, "checkpoints", "phase1", "4", "state")
    )
    assert "layers" in saved["params"]["encoder"] and "layers_0" not in saved["params"]["encoder"]

    # The reference's workdir as a run stopped after its step-4 checkpoint would leave it.
    scanned = str(tmp_path / "scanned")
    shutil.copytree(reference, scanned)
    shutil.rmtree(os.path.join(scanned, "checkpoints", "phase1", str(steps)))
    os.remove(os.path.join(scanned, "metrics.jsonl"))
    result = helpers.run(
        helpers.demo_command(
            scanned, data_dir, *flags, "--config.model.overrides.scan_layers=True", config=config
        ),
        4,
    )
    assert "resuming from its checkpoint at step 4" in result.stderr
    expected, got = helpers.losses(reference), helpers.losses(scanned)
    assert sorted(got) == list(range(5, steps + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step
