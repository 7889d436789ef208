"""Small gradient transformations that LAMB and LANS are chained from.

Every transform works per tensor: per parameter leaf, or per layer slice of a leaf whose
leading axis stacks layers (declared by the caller through `stacked_layers`, a pytree of
bools or a callable on params, like optax masks). Norms of zero never produce NaN. The
per-tensor norms and masks are in lambjax.optim.per_tensor; what reads a state back
(step counters, last trust ratios and norms) in lambjax.optim.state.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import optax.tree_utils as otu

from lambjax.optim.hyperparameters import check_max_norm, is_python_zero
from lambjax.optim.per_tensor import (
    MaskOrFn,
    broadcast_per_tensor,
    check_bounds,
    clip_param_norm,
    concat_per_tensor,
    flatten_alike,
    global_norm_of_sq_norms,
    ones_per_tensor,
    resolve_mask,
    resolve_per_tensor_masks,
    safe_ratio,
    tensor_sq_norms,
    unit_ratios,
)

# ----------------------------------------------------------------------------------------
# Global gradient-norm clipping


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """g -> g * min(1, max_norm / ||g||), ||g|| the norm of all leaves together.

    What `optax.clip_by_global_norm` computes, as one multiplication by a scalar: XLA then
    fuses the clipped gradient into each consumer (the two Adam moments) instead of
    writing it out (optax divides every element, which XLA:CPU materialises).

    A caller that has ||g|| already passes it as `update(..., grad_norm=...)` (an optax
    extra argument, handed on by `optax.chain`; lambjax's train step has, for its
    finiteness test), and it is not computed again. It must be the norm of the updates
    this transform receives: the gradient, where the clip comes first in its chain.
    """
    check_max_norm(max_norm, "max_norm")

    def update_fn(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        norm = otu.tree_norm(updates) if grad_norm is None else grad_norm
        scale = jnp.minimum(1.0, max_norm / norm)  # 1 for a zero norm
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def optional_clip_by_global_norm(max_norm: float | None) -> optax.GradientTransformation:
    """clip_by_global_norm(max_norm), or the identity for None."""
    return optax.identity() if max_norm is None else clip_by_global_norm(max_norm)


# ----------------------------------------------------------------------------------------
# Per-tensor gradient normalisation (LANS)


def normalize_per_tensor(stacked_layers: MaskOrFn = None) -> optax.GradientTransformation:
    """g -> g / ||g|| per tensor (per layer slice for stacked leaves); g = 0 stays 0.

    References:
      Zheng et al., 2020: https://arxiv.org/abs/2006.13484 (LANS, Algorithm 2)
    """

    def init_fn(params):
        resolve_mask(stacked_layers, params, argument="stacked_layers", default=False)
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        stacked = resolve_mask(
            stacked_layers,
            params if params is not None else updates,
            argument="stacked_layers",
            default=False,
        )

        def normalize(g, is_stacked):
            norm = jnp.sqrt(tensor_sq_norms(g, is_stacked))
            scale = safe_ratio(jnp.ones_like(norm), norm, norm == 0.0)
            return (g * broadcast_per_tensor(scale, g)).astype(g.dtype)

        return jax.tree.map(normalize, updates, stacked), state

    return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------------------
# Adam moments with optional bias correction


def init_moments(params) -> optax.ScaleByAdamState:
    """Step 0 and zero moments. mu and nu are separate buffers: a state passed to a
    jitted step with `donate_argnums` may not hold one buffer twice."""
    return optax.ScaleByAdamState(
        count=jnp.zeros([], jnp.int32),
        mu=otu.tree_zeros_like(params),
        nu=otu.tree_zeros_like(params),
    )


def update_moments(updates, state, b1: float, b2: float) -> optax.ScaleByAdamState:
    """The step count and Adam's moving averages of g and g*g, from any state with
    `count`, `mu` and `nu` fields."""
    return optax.ScaleByAdamState(
        count=optax.safe_increment(state.count),
        mu=otu.tree_update_moment(updates, state.mu, b1, 1),
        nu=otu.tree_update_moment_per_elem_norm(updates, state.nu, b2, 2),
    )


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6, *, bias_correction: bool = True
) -> optax.GradientTransformation:
    """optax.scale_by_adam, or the same without bias correction (torch-optimizer style)."""
    if bias_correction:
        return optax.scale_by_adam(b1=b1, b2=b2, eps=eps)

    def update_fn(updates, state, params=None):
        del params
        state = update_moments(updates, state, b1, b2)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), state.mu, state.nu)
        return updates, state

    return optax.GradientTransformation(init_moments, update_fn)


# ----------------------------------------------------------------------------------------
# Layer-wise trust ratio (LAMB)


class TrustRatioState(NamedTuple):
    """What the last update measured, kept for logging (none of it affects the update)."""

    trust_ratios: jax.Array  # each tensor's ratio (1 where masked off), see concat_per_tensor
    param_norm: jax.Array  # global ||x||, from the per-tensor norms
    update_norm: jax.Array  # global norm of the block's output (the trust-scaled updates)


def scale_by_trust_ratio(
    *,
    mask: MaskOrFn = None,
    stacked_layers: MaskOrFn = None,
    param_norm_bounds: tuple[float, float] | None = None,
) -> optax.GradientTransformation:
    """u -> phi(||x||) / ||u|| * u per tensor, 1 where ||x|| = 0 or ||u|| = 0.

    Args:
      mask: which leaves get a ratio (True) and which keep theirs at 1 (False); None = all.
      stacked_layers: which leaves stack layers on their leading axis (one ratio per layer).
      param_norm_bounds: optional (lower, upper) clip of ||x|| (the paper's phi).

    References:
      You et al., 2020: https://arxiv.org/abs/1904.00962 (LAMB, Algorithm 2)
    """
    check_bounds(param_norm_bounds, "param_norm_bounds")

    def init_fn(params):
        _, stacked = resolve_per_tensor_masks(params, mask, "mask", stacked_layers)
        zero = jnp.zeros([], jnp.float32)
        return TrustRatioState(unit_ratios(params, stacked), zero, zero)

    def measure(u, x, applies_here, is_stacked):
        """(ratio, ||x||^2, ||ratio * u||^2) per tensor; the norms also where masked off,
        for the logged global norms."""
        param_sq = tensor_sq_norms(x, is_stacked)
        update_sq = tensor_sq_norms(u, is_stacked)
        if not applies_here:
            return ones_per_tensor(x, is_stacked), param_sq, update_sq
        param_norm, update_norm = jnp.sqrt(param_sq), jnp.sqrt(update_sq)
        guard = (param_norm == 0.0) | (update_norm == 0.0)
        ratio = safe_ratio(clip_param_norm(param_norm, param_norm_bounds), update_norm, guard)
        return ratio, param_sq, jnp.square(ratio) * update_sq

    def update_fn(updates, state, params=None):
        del state
        applies, stacked = resolve_per_tensor_masks(params, mask, "mask", stacked_layers)
        per_leaf = flatten_alike(updates, params, applies, stacked)
        measured = [measure(*leaf) for leaf in zip(*per_leaf, strict=True)]
        ratios, param_sq, scaled_sq = ([m[i] for m in measured] for i in range(3))
        scaled = [
            (u * broadcast_per_tensor(r, u)).astype(u.dtype)
            for u, r in zip(per_leaf[0], ratios, strict=True)
        ]
        state = TrustRatioState(
            concat_per_tensor(ratios),
            global_norm_of_sq_norms(param_sq),
            global_norm_of_sq_norms(scaled_sq),
        )
        return jax.tree.structure(updates).unflatten(scaled), state

    return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------------------
# The LANS step: two trust-scaled directions


class ScaleByLansState(NamedTuple):
    count: jax.Array  # steps taken, for bias correction
    mu: Any  # first moment of the normalised gradient
    nu: Any  # second moment of the normalised gradient
    adam_trust_ratios: jax.Array  # last update's phi/||r|| per tensor (for logging)
    gradient_trust_ratios: jax.Array  # last update's phi/||c|| per tensor (for logging)
    param_norm: jax.Array  # last update's global ||x|| (for logging)


def scale_by_lans(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    *,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    weight_decay_mask: MaskOrFn = None,
    stacked_layers: MaskOrFn = None,
    param_norm_bounds: tuple[float, float] | None = None,
    bias_correction: bool = True,
) -> optax.GradientTransformation:
    """The LANS direction from (already normalised) gradients ĝ:

        m, v = Adam moments of ĝ;  d = sqrt(v̂) + eps
        r = m̂/d + λx;  c = ĝ/d + λx
        out = b1 * phi/||r|| * r + (1 - b1) * phi/||c|| * c   (each ratio 1 on a zero norm)

    Chain after `normalize_per_tensor` and before a (negative) learning-rate scaling. A
    schedule for λ is evaluated at the step count before the update (as
    `optax.add_decayed_weights` does).

    References:
      Zheng et al., 2020: https://arxiv.org/abs/2006.13484 (LANS, Algorithm 2)
    """
    check_bounds(param_norm_bounds, "param_norm_bounds")

    def masks(params):
        return resolve_per_tensor_masks(
            params, weight_decay_mask, "weight_decay_mask", stacked_layers
        )

    def init_fn(params):
        _, stacked = masks(params)
        count, mu, nu = init_moments(params)
        zero = jnp.zeros([], jnp.float32)
        return ScaleByLansState(
            count, mu, nu, unit_ratios(params, stacked), unit_ratios(params, stacked), zero
        )

    def update_fn(updates, state, params=None):
        decays, stacked = masks(params)
        decay_rate = weight_decay(state.count) if callable(weight_decay) else weight_decay
        count, mu, nu = update_moments(updates, state, b1, b2)
        if bias_correction:
            mu_hat = otu.tree_bias_correction(mu, b1, count)
            nu_hat = otu.tree_bias_correction(nu, b2, count)
            nu_rescale = 1 / (1 - b2 ** count.astype(jnp.float32))  # lans_direction's c
        else:
            mu_hat, nu_hat, nu_rescale = mu, nu, jnp.float32(1.0)

        step = functools.partial(
            lans_direction,
            nu_rescale=nu_rescale,
            b1=b1,
            eps=eps,
            weight_decay=decay_rate,
            param_norm_bounds=param_norm_bounds,
        )
        per_leaf = flatten_alike(updates, mu_hat, nu_hat, nu, params, decays, stacked)
        results = [step(*leaf) for leaf in zip(*per_leaf, strict=True)]
        out, adam_ratios, gradient_ratios, param_sq = ([r[i] for r in results] for i in range(4))
        state = ScaleByLansState(
            count,
            mu,
            nu,
            concat_per_tensor(adam_ratios),
            concat_per_tensor(gradient_ratios),
            global_norm_of_sq_norms(param_sq),
        )
        return jax.tree.structure(updates).unflatten(out), state

    return optax.GradientTransformation(init_fn, update_fn)


def lans_direction(
    g, m_hat, v_hat, v, x, decays, stacked, *, nu_rescale, b1, eps, weight_decay, param_norm_bounds
):
    """One tensor's LANS step (see `scale_by_lans`): (out, phi/||r||, phi/||c||, ||x||^2)."""
    decay = 0.0 if is_python_zero(weight_decay) or not decays else weight_decay * x
    # d = sqrt(v̂) + eps, written two ways on purpose: v̂ = v / (1 - b2^t) for r,
    # v * (1 / (1 - b2^t)) for c. One shared d would be a tensor that XLA writes
    # out and reads back (two of 24 parameter-sized passes, XLA's cost analysis);
    # two different expressions are not merged, and each fuses into the one
    # direction that reads it (22 passes).
    r = m_hat / (jnp.sqrt(v_hat) + eps) + decay
    c = g / (jnp.sqrt(v * nu_rescale) + eps) + decay
    param_sq = tensor_sq_norms(x, stacked)
    param_norm = jnp.sqrt(param_sq)
    phi = clip_param_norm(param_norm, param_norm_bounds)
    r_norm = jnp.sqrt(tensor_sq_norms(r, stacked))
    c_norm = jnp.sqrt(tensor_sq_norms(c, stacked))
    r_ratio = safe_ratio(phi, r_norm, (param_norm == 0.0) | (r_norm == 0.0))
    c_ratio = safe_ratio(phi, c_norm, (param_norm == 0.0) | (c_norm == 0.0))
    out = (
        b1 * broadcast_per_tensor(r_ratio, r) * r + (1 - b1) * broadcast_per_tensor(c_ratio, c) * c
    )
    return out.astype(x.dtype), r_ratio, c_ratio, param_sq


# ----------------------------------------------------------------------------------------
# Learning rate


class LearningRateState(NamedTuple):
    """Named apart from optax's fields: under `optax.inject_hyperparams`,
    `optax.tree.get(state, "learning_rate")` finds the injected rate alone, and
    `optax.tree.get(state, "count")` Adam's step count alone."""

    schedule_count: jax.Array  # updates taken: the schedule's argument
    last_learning_rate: jax.Array  # the rate of the last update (for logging)


def scale_by_learning_rate(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    """u -> -learning_rate * u, as `optax.scale_by_learning_rate`; the state keeps the rate
    it applied, so that the norm of the final update follows from the norm of u."""

    def rate(count):
        value = learning_rate(count) if callable(learning_rate) else learning_rate
        return jnp.asarray(jnp.real(value), jnp.float32)

    def init_fn(params):
        del params
        return LearningRateState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.float32))

    def update_fn(updates, state, params=None):
        del params
        step_size = rate(state.schedule_count)
        updates = jax.tree.map(lambda u: (-step_size).astype(u.dtype) * u, updates)
        return updates, LearningRateState(optax.safe_increment(state.schedule_count), step_size)

    return optax.GradientTransformation(init_fn, update_fn)
