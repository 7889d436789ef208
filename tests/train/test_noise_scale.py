"""The gradient noise scale (lambjax.train.noise_scale): on a problem whose gradient noise
is known, the estimate from the micro-batch loop recovers B_simple = tr(Sigma) / |G|^2;
a run with `config.noise_scale.enabled` logs it beside the loss; a phase without
accumulation is refused in one line."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from lambjax.train import noise_scale, plan
from lambjax.train import step as step_lib
from lambjax.train.config import ConfigError
from lambjax.train.metrics import read_jsonl
from tests.helpers import run_demo

DIM, BIG_BATCH = 32, 64


def mean_estimation_step(grad_accum_steps: int):
    """One step of the micro-batch loop on L(w) = sum_j |w - z_j|^2 / (2 B), z_j ~ N(mu,
    Sigma): each example's gradient is w - z_j, so G = w - mu and the noise is Sigma. As in
    the train step, every micro-batch's loss divides by the global batch's size."""

    def grad_fn(w, microbatch, rng):
        del rng
        grads = jax.grad(lambda w: 0.5 * jnp.sum((w - microbatch["z"]) ** 2) / BIG_BATCH)(w)
        return grads, {}

    @jax.jit
    def step(w, batch):
        grads, stats = step_lib.accumulate_gradients(
            noise_scale.with_sq_norm(grad_fn),
            w,
            batch,
            jax.random.key(0),
            grad_accum_steps,
            (noise_scale.MICROBATCH_SQ_NORM,),
        )
        grad_norm = jnp.linalg.norm(grads)
        return noise_scale.step_estimates(stats, grad_norm, BIG_BATCH, grad_accum_steps)

    return step


@pytest.mark.parametrize("grad_accum_steps", [2, 8])
def test_recovers_a_known_noise_scale(grad_accum_steps):
    rng = np.random.default_rng(0)
    variances = rng.uniform(0.5, 3.0, DIM)  # Sigma = diag(variances)
    true_gradient = rng.standard_normal(DIM)
    true_gradient *= 0.25 * np.sqrt(variances.sum()) / np.linalg.norm(true_gradient)
    expected = variances.sum() / np.sum(true_gradient**2)  # B_simple = 16 by construction
    mu = rng.standard_normal(DIM)
    w = jnp.asarray(mu + true_gradient, jnp.float32)  # G = w - mu
    step = mean_estimation_step(grad_accum_steps)
    meter = noise_scale.NoiseScaleMeter(decay=0.99)
    logged, means = [], {}
    for index in range(1, 1001):
        z = mu + rng.standard_normal((BIG_BATCH, DIM)) * np.sqrt(variances)
        estimates = step(w, {"z": jnp.asarray(z, jnp.float32)})
        means = {k: float(v) for k, v in estimates.items()}
        if index % 10 == 0:  # logged every 10 steps: the means of the ten
            logged.append(meter.update(index, means)["noise_scale"])
    assert expected == pytest.approx(16.0)
    # The smoothed ratio over the last stretch: within 10% of the truth.
    assert np.mean(logged[-20:]) == pytest.approx(expected, rel=0.1)
    assert min(logged[-20:]) > 0.7 * expected and max(logged[-20:]) < 1.3 * expected


def test_estimates_are_exact_on_expected_norms():
    """Fed the expected squared norms |G|^2 + tr(Sigma) / B, the estimates return |G|^2
    and tr(Sigma) exactly."""
    grad_sq, trace = 2.0, 300.0
    got = noise_scale.estimates(grad_sq + trace / 8, grad_sq + trace / 32, 8, 32)
    assert float(got["noise_scale_grad_sq"]) == pytest.approx(grad_sq)
    assert float(got["noise_scale_trace"]) == pytest.approx(trace)


def test_meter_smooths_numerator_and_denominator_apart():
    """The ratio of the averages, not the average of the ratios: an interval whose |G|^2
    estimate is near zero does not blow the value up."""
    meter = noise_scale.NoiseScaleMeter(decay=0.5)
    meter.update(1, {"noise_scale_grad_sq": 1.0, "noise_scale_trace": 10.0})
    value = meter.update(2, {"noise_scale_grad_sq": 1e-9, "noise_scale_trace": 10.0})
    # Weights 1/4 and 1/2 on the two intervals: (2.5 + 5) / (0.25 + 0), where the mean of
    # the two ratios would be ~5e9.
    assert value["noise_scale"] == pytest.approx(7.5 / 0.25, rel=1e-6)
    assert noise_scale.NoiseScaleMeter(0.9).update(1, {"loss": 1.0}) == {}


@pytest.mark.slow
def test_a_run_logs_the_noise_scale_beside_the_loss(tmp_path, data_dir):
    workdir = str(tmp_path / "run")
    run_demo(
        workdir,
        data_dir,
        1,
        "--config.noise_scale.enabled=True",
        "--config.phases.phase1.grad_accum_steps=2",
        "--config.phases.phase2.grad_accum_steps=2",
    )
    records = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    train = [r for r in records.values() if "train/loss" in r]
    assert all("train/noise_scale_grad_sq" in r and "train/noise_scale_trace" in r for r in train)
    assert any(np.isfinite(r.get("train/noise_scale", np.nan)) for r in train)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"phases.phase1.grad_accum_steps": 1}, "phase 'phase1' has grad_accum_steps=1"),
        ({"noise_scale.ema_decay": 1.0}, "config.noise_scale.ema_decay=1.0 must lie in [0, 1)"),
        (
            {"gradient_reduction": "once", "phases.phase1.grad_accum_steps": 2},
            "gradient_reduction='once' and mesh data=2",
        ),
    ],
)
def test_the_plan_refuses_what_it_cannot_measure(overrides, message):
    config = default.get_config("runlocal")
    config.noise_scale.enabled = True
    config.phases.phase2.grad_accum_steps = 2
    config.update_from_flattened_dict(overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan.resolve(config, vocab_size=4096, num_devices=2)


@pytest.mark.slow
def test_a_phase_without_accumulation_is_refused_in_one_line(tmp_path, data_dir):
    result = run_demo(
        str(tmp_path),
        data_dir,
        1,
        "--config.noise_scale.enabled=True",
        "--config.phases.phase1.grad_accum_steps=1",
        check=False,
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("lambjax: error: config.noise_scale.enabled=True needs gradient")
    assert "grad_accum_steps=1" in last and "Traceback" not in result.stderr
