"""A run whose loss stays non-finite stops with one line and its own exit status, and keeps
its last finite checkpoint: no state saved after the loss went non-finite."""

import os

import jax.numpy as jnp
import pytest

from lambjax.train import target, trainer
from tests import helpers


@pytest.mark.slow
def test_a_diverging_phase_stops_and_keeps_the_last_finite_checkpoint(data_dir, tmp_path):
    # The demo's 4-device run (tests/train/test_runs.py's reference), phase 2 made to
    # diverge: phase 1 and the rerun's phase 2 are its compiled steps.
    workdir = tmp_path / "run"
    result = helpers.run_demo(
        workdir,
        data_dir,
        4,
        "--config.phases.phase2.learning_rate=1e30",  # the first update overflows
        "--config.phases.phase2.warmup_fraction=0",
        "--config.max_consecutive_nonfinite_steps=3",
        check=False,
    )
    assert result.returncode == trainer.DIVERGED_STATUS, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert result.stderr.strip().splitlines()[-1] == errors[0] and len(errors) == 1
    assert "3 consecutive steps (2..4) had a non-finite loss" in errors[0]
    assert "no checkpoint of phase phase2 was saved" in errors[0]
    # The run says it diverged in its workdir, for a sweep to count the trial ended.
    assert errors[0].endswith(target.divergence(str(workdir)))
    assert "Traceback" not in result.stderr
    checkpoints = workdir / "checkpoints"
    assert str(helpers.PHASE1_STEPS) in os.listdir(checkpoints / "phase1")
    # phase 2's step 4 is a checkpoint step, after the loss went non-finite: not saved.
    assert not [p for p in (checkpoints / "phase2").glob("*") if p.name.isdigit()]
    losses = helpers.losses(str(workdir))
    assert all(v == v for step, v in losses.items() if step <= helpers.PHASE1_STEPS + 1)
    assert all(v != v for step, v in losses.items() if step > helpers.PHASE1_STEPS + 1)

    # Phase 2 saved nothing, so its settings may change: the rerun, with the demo's, warns,
    # clears the record and trains on from phase 1's final checkpoint.
    rerun = helpers.run_demo(workdir, data_dir, 4, "--config.max_consecutive_nonfinite_steps=3")
    assert "This run diverged before (diverged.json): 3 consecutive steps" in rerun.stderr
    assert target.divergence(str(workdir)) is None
    assert (checkpoints / "phase2" / str(helpers.PHASE2_STEPS)).is_dir()


def test_params_finite_finds_one_bad_value_in_any_tensor():
    params = {"a": jnp.ones((3, 4)), "b": {"c": jnp.zeros(5, jnp.bfloat16)}}
    assert trainer.params_finite(params)
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        broken = {"a": params["a"], "b": {"c": params["b"]["c"].at[4].set(bad)}}
        assert not trainer.params_finite(broken)
