"""The learning-rate schedules of the recipes, as optax schedules (functions of the step).

`count` is the number of optimizer steps taken (optax's convention: 0 for the first
update). `offset` shifts a schedule so that it starts at step `offset` (a later phase can
re-warm inside one joined schedule); before it the rate is 0.
"""

import jax.numpy as jnp
import optax


def _check(peak_value, total_steps, **fractions):
    if peak_value < 0:
        raise ValueError(f"peak_value={peak_value} must be >= 0")
    if total_steps <= 0:
        raise ValueError(f"total_steps={total_steps} must be a positive integer")
    for name, value in fractions.items():
        if not 0 <= value <= 1:
            raise ValueError(f"{name}={value} must lie in [0, 1]")
    if sum(fractions.values()) > 1:
        raise ValueError(f"{' + '.join(fractions)} = {sum(fractions.values())} exceeds 1")


def poly_warmup_schedule(
    peak_value: float,
    total_steps: int,
    warmup_fraction: float,
    *,
    power: float = 0.5,
    offset: int = 0,
) -> optax.Schedule:
    """NVIDIA BERT's PolyWarmUpScheduler: with t = count + 1 (steps counted from 1) and
    p = t / total_steps: lr = peak * p / w while p < w, else peak * (1 - p) ** power.

    Not renormalised after warmup (phase 1 of the recipe drops from 6.0e-3 to 5.08e-3 right
    after warmup), and 0 from the last step on.
    """
    _check(peak_value, total_steps, warmup_fraction=warmup_fraction)

    def schedule(count):
        t = jnp.asarray(count, jnp.float32) - offset + 1
        progress = jnp.clip(t / total_steps, 0.0, 1.0)
        warm = peak_value * progress / max(warmup_fraction, 1e-12)
        decay = peak_value * (1.0 - progress) ** power
        lr = jnp.where(progress < warmup_fraction, warm, decay)
        return jnp.where(t <= 0, 0.0, lr)

    return schedule


def warmup_constant_decay_schedule(
    peak_value: float,
    total_steps: int,
    warmup_fraction: float,
    constant_fraction: float,
    *,
    degree: float = 1.0,
    offset: int = 0,
) -> optax.Schedule:
    """LANS's schedule (the authors' GluonNLP code): with x = count / total_steps,
    lr = peak * x / w for x < w; peak for x < w + c; peak * ((1 - x) / (1 - w - c)) ** degree
    after, reaching 0 at total_steps.
    """
    _check(
        peak_value,
        total_steps,
        warmup_fraction=warmup_fraction,
        constant_fraction=constant_fraction,
    )

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) - offset
        x = jnp.clip(step / total_steps, 0.0, 1.0)
        warm = peak_value * x / max(warmup_fraction, 1e-12)
        decay_span = max(1.0 - warmup_fraction - constant_fraction, 1e-12)
        decay = peak_value * jnp.clip((1.0 - x) / decay_span, 0.0, 1.0) ** degree
        lr = jnp.where(
            x < warmup_fraction,
            warm,
            jnp.where(x < warmup_fraction + constant_fraction, peak_value, decay),
        )
        return jnp.where(step < 0, 0.0, lr)

    return schedule


def linear_warmup_decay_schedule(
    peak_value: float, total_steps: int, warmup_fraction: float
) -> optax.Schedule:
    """BERT's fine-tuning schedule: linear from 0 to `peak_value` over the first
    int(total_steps * warmup_fraction) steps, then linear to 0 at `total_steps`."""
    _check(peak_value, total_steps, warmup_fraction=warmup_fraction)
    warmup = int(total_steps * warmup_fraction)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, peak_value, max(warmup, 1)),
            optax.linear_schedule(peak_value, 0.0, max(total_steps - warmup, 1)),
        ],
        [warmup],
    )
