"""The gradient noise scale B_simple = tr(Sigma) / |G|^2, measured from the micro-batches of
gradient accumulation (McCandlish et al., 2018, appendix A.1).

Sigma is the covariance of one example's gradient and G the true gradient. A step with
accumulation A sees each micro-batch's gradient (B_small = B_big / A rows) and their sum
(B_big rows), whose expected squared norms are |G|^2 + tr(Sigma) / B. Two batch sizes give
two equations and the unbiased estimates

    |G|^2    ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

with |G_small|^2 the mean over the A micro-batches. Each is noisy, and their ratio is
biased where the denominator is, so numerator and denominator are smoothed apart (an
exponential moving average of each) and the ratio taken after (`NoiseScaleMeter`).

The train step's loss divides by the global batch's counts, so micro-batch i's gradient
is g_i = G_small_i / A (to the extent the micro-batches hold equal shares of the masked
tokens) and the step's gradient is G_big = sum_i g_i: hence |G_small|^2 = A^2 mean |g_i|^2.
The sizes are rows of the batch (sequences; packed rows where the data are packed).

Cost: one squared norm of each micro-batch's gradient (a read of the gradient per
micro-batch); |G_big| is the norm the step takes anyway for its finiteness test.
docs/methods/noise_scale.md says how to read the number.

References:
  McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training", 2018
  (arXiv 1812.06162).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

MICROBATCH_SQ_NORM = "microbatch_grad_sq_norm_sum"  # the stat the micro-batch loop sums


def check_settings(settings) -> None:
    """`config.noise_scale`'s own fields."""
    if not isinstance(settings.enabled, bool):
        raise ValueError(f"config.noise_scale.enabled={settings.enabled!r}; valid: True or False")
    if not 0.0 <= settings.ema_decay < 1.0:
        raise ValueError(f"config.noise_scale.ema_decay={settings.ema_decay} must lie in [0, 1)")


def check(enabled: bool, phases) -> None:
    """The run's `config.noise_scale.enabled` against its phase plans: the estimate needs
    two batch sizes, so every phase accumulates at least two micro-batches."""
    if not enabled:
        return
    for phase in phases:
        if phase.step_method is not None:
            raise ValueError(
                "config.noise_scale.enabled=True measures the core train step's micro-batches; "
                f"the step method {type(phase.step_method).__name__} (config.step_method) runs "
                "its own: drop one of the two"
            )
        if phase.batch.grad_accum_steps < 2:
            raise ValueError(
                f"config.noise_scale.enabled=True needs gradient accumulation: phase "
                f"{phase.name!r} has grad_accum_steps={phase.batch.grad_accum_steps}; valid: "
                "2 or more (set config.phases.NAME.grad_accum_steps)"
            )
        if phase.step.gradient_reduction == "once" and phase.mesh["data"] > 1:
            raise ValueError(
                f"config.noise_scale.enabled=True with gradient_reduction='once' and mesh "
                f"data={phase.mesh['data']} (phase {phase.name!r}): each data shard's "
                "micro-batch gradient is a partial sum there; valid: "
                "gradient_reduction='each_microbatch' or mesh data=1"
            )


def with_sq_norm(grad_fn: Callable) -> Callable:
    """`grad_fn(params, batch, rng) -> (grads, stats)` that also returns its gradient's
    squared norm as `stats[MICROBATCH_SQ_NORM]` (summed over micro-batches by the loop)."""

    def wrapped(params, batch, rng):
        grads, stats = grad_fn(params, batch, rng)
        sq_norm = jnp.square(optax.global_norm(grads)).astype(jnp.float32)
        return grads, {**stats, MICROBATCH_SQ_NORM: sq_norm}

    return wrapped


def estimates(
    small_sq_norm: jax.Array, big_sq_norm: jax.Array, small_batch: int, big_batch: int
) -> dict[str, jax.Array]:
    """One step's unbiased estimates of |G|^2 (`noise_scale_grad_sq`) and tr(Sigma)
    (`noise_scale_trace`) from the squared norms of mean gradients over `small_batch` and
    `big_batch` examples (`small_sq_norm` the mean over the small batches)."""
    if not 0 < small_batch < big_batch:
        raise ValueError(f"estimates: need 0 < small_batch={small_batch} < big_batch={big_batch}")
    grad_sq = (big_batch * big_sq_norm - small_batch * small_sq_norm) / (big_batch - small_batch)
    trace = (small_sq_norm - big_sq_norm) / (1 / small_batch - 1 / big_batch)
    return {"noise_scale_grad_sq": grad_sq, "noise_scale_trace": trace}


def step_estimates(stats: dict, grad_norm: jax.Array, global_batch: int, grad_accum_steps: int):
    """`estimates` for a train step: the micro-batches' summed squared norms
    (`stats[MICROBATCH_SQ_NORM]`, of gradients of the global-batch loss) and the norm of
    their sum, the step's gradient."""
    accum = grad_accum_steps
    small_sq_norm = accum * stats[MICROBATCH_SQ_NORM]  # A^2 x the mean over A micro-batches
    return estimates(small_sq_norm, jnp.square(grad_norm), global_batch // accum, global_batch)


class NoiseScaleMeter:
    """B_simple from the steps' estimates, each smoothed by an exponential moving average
    (decay `decay` per step) before the ratio is taken.

    `update` takes the means of `estimates`' two values over the steps since the last call
    (what the run loop logs) and weighs them as that many steps of the average. The average
    starts at zero; both are biased alike, so the ratio is not.
    """

    def __init__(self, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"config.noise_scale.ema_decay={decay} must lie in [0, 1)")
        self.decay = decay
        self.grad_sq = self.trace = 0.0
        self.last_step = None

    def update(self, step: int, means: dict) -> dict[str, float]:
        """{'noise_scale': B_simple} after the steps up to `step`; {} without estimates, or
        while the smoothed |G|^2 is not yet positive (the noise dominates what was seen)."""
        if "noise_scale_grad_sq" not in means:
            return {}
        steps = 1 if self.last_step is None else max(step - self.last_step, 1)
        self.last_step = step
        keep = self.decay**steps
        self.grad_sq = keep * self.grad_sq + (1 - keep) * float(means["noise_scale_grad_sq"])
        self.trace = keep * self.trace + (1 - keep) * float(means["noise_scale_trace"])
        if self.grad_sq <= 0.0:
            return {}
        return {"noise_scale": self.trace / self.grad_sq}
