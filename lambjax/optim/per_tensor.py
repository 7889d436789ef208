"""Per-tensor helpers the transforms share: masks resolved against the parameters, and
per-tensor (per-layer for a stacked leaf) norms and ratios.

Norms are computed as dot products (`sum(x * x)` contracted by XLA's dot emitter) of
tensors that are already in memory: on XLA:CPU a reduction fused with the arithmetic that
produces its input runs scalar code and recomputes that arithmetic in the consumer, which
made the trust-ratio step several times slower than an Adam step (docs/performance.md).
A tensor whose type carries an explicit sharding (`jax.sharding.AxisType.Explicit`) is
reduced with a sum of squares instead: a dot over a sharded dimension would need its output
sharding spelled out. A complex tensor's norm is that of |x|.

What an update measured is kept for logging as one vector per kind (`concat_per_tensor`), so
optax's tree utilities see no second copy of the parameters' tree in a state
(docs/guide/optimizers.md).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

MaskOrFn = Any  # a pytree of bools matching params, a callable params -> such a tree, or None


def resolve_mask(mask: MaskOrFn, params, *, argument: str, default: bool):
    """A mask argument as a tree of bools matching `params` (None -> all `default`)."""
    if mask is None:
        return jax.tree.map(lambda _: default, params)
    tree = mask(params) if callable(mask) else mask
    params_structure = jax.tree.structure(params)
    mask_structure = jax.tree.structure(tree)
    if mask_structure != params_structure:
        raise ValueError(
            f"{argument}: its tree does not match the parameters' tree "
            f"(mask: {mask_structure}; params: {params_structure})"
        )
    return tree


def checked_mask(mask: MaskOrFn, argument: str) -> Callable:
    """A mask for optax blocks (e.g. `optax.masked`) that names `argument` on a mismatch."""
    return lambda params: resolve_mask(mask, params, argument=argument, default=True)


def resolve_per_tensor_masks(params, mask: MaskOrFn, argument: str, stacked_layers: MaskOrFn):
    """(mask, stacked) as trees of bools for `params`: `mask` (None = all True, named
    `argument` in errors) and which leaves stack layers (None = none)."""
    if params is None:
        raise ValueError(optax.NO_PARAMS_MSG)
    return (
        resolve_mask(mask, params, argument=argument, default=True),
        resolve_mask(stacked_layers, params, argument="stacked_layers", default=False),
    )


def norm_dtype(x: jax.Array):
    """The dtype a tensor's norm is taken in: float32, or complex64 for complex tensors."""
    return jnp.complex64 if jnp.iscomplexobj(x) else jnp.float32


def sharded_in_type(x: jax.Array) -> bool:
    """Whether a dimension of x is sharded over an explicit mesh axis (its sharding is part
    of its type): flattening it, or contracting it in a dot, would need an output sharding."""
    sharding = jax.typeof(x).sharding
    explicit = set(sharding.mesh.explicit_axes)
    for entry in sharding.spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        if explicit.intersection(names):
            return True
    return False


def tensor_sq_norms(x: jax.Array, stacked: bool) -> jax.Array:
    """Squared L2 norm of each tensor: a scalar, or one per layer slice ([L]) if stacked.
    A complex tensor's is sum(|x|^2). Always float32."""
    x = x.astype(norm_dtype(x))
    stacked = stacked and x.ndim >= 1
    if sharded_in_type(x):
        squares = jnp.real(x * jnp.conj(x)) if jnp.iscomplexobj(x) else jnp.square(x)
        return jnp.sum(squares, axis=tuple(range(1 if stacked else 0, x.ndim)))
    if stacked:
        flat = x.reshape(x.shape[0], -1)
        return jnp.real(jnp.einsum("ln,ln->l", jnp.conj(flat), flat))
    flat = x.reshape(-1)
    return jnp.real(jnp.dot(jnp.conj(flat), flat))


def global_norm_of_sq_norms(sq_norms) -> jax.Array:
    """sqrt of the sum of a tree of squared per-tensor (per-slice) norms: the global norm.

    The barrier keeps XLA from folding the sum over a stacked leaf's slices into their dot
    product: it would square the whole tensor into a written-out temporary and reduce that
    (1.5 parameter-sized passes more for LAMB on XLA:CPU).
    """
    sq_norms = jax.tree.leaves(sq_norms)
    if not sq_norms:
        return jnp.zeros([], jnp.float32)
    sq_norms = jax.lax.optimization_barrier(sq_norms)
    return jnp.sqrt(sum(jnp.sum(x) for x in sq_norms))


def broadcast_per_tensor(values: jax.Array, x: jax.Array) -> jax.Array:
    """[L] per-slice values -> broadcastable against the stacked tensor x."""
    if values.ndim == 0:
        return values
    return values.reshape(values.shape + (1,) * (x.ndim - 1))


def ones_per_tensor(x: jax.Array, stacked: bool) -> jax.Array:
    """A ratio of 1 for the tensor: a scalar, or one per layer slice if stacked."""
    return jnp.ones((x.shape[0],) if stacked and x.ndim else (), jnp.float32)


def per_tensor_count(params, stacked) -> int:
    """How many per-tensor values `params` has: one per leaf, one per layer slice of a
    stacked leaf."""
    return sum(
        x.shape[0] if is_stacked and x.ndim else 1
        for x, is_stacked in zip(*flatten_alike(params, stacked), strict=True)
    )


def flatten_alike(tree, *others) -> tuple[list, ...]:
    """The leaves of `tree`, and those of each tree in `others` that has its structure
    (masks), in the same order. Any number of leaves, none included."""
    leaves, treedef = jax.tree.flatten(tree)
    return (leaves, *(treedef.flatten_up_to(other) for other in others))


def concat_per_tensor(values: list) -> jax.Array:
    """Per-tensor values (scalars, [L] for stacked leaves) as one float32 vector, in the
    order of the parameters' leaves: what the states keep for logging. One array, whatever
    the parameters' tree: it is no parameter-shaped tree for optax's tree utilities
    (`optax.tree_map_params` maps it as a non-parameter), and its size does not change
    with how a tree holds its layers."""
    if not values:
        return jnp.zeros((0,), jnp.float32)
    # A stacked leaf's layer axis may be sharded in its type: replicate, as init's vector.
    values = [jax.sharding.reshard(v, PartitionSpec()) if sharded_in_type(v) else v for v in values]
    return jnp.concatenate([jnp.ravel(v).astype(jnp.float32) for v in values])


def unit_ratios(params, stacked) -> jax.Array:
    """A fresh vector of trust ratios 1, one per tensor (per layer slice if stacked)."""
    return jnp.ones((per_tensor_count(params, stacked),), jnp.float32)


def safe_ratio(numerator: jax.Array, denominator: jax.Array, guard: jax.Array) -> jax.Array:
    """numerator / denominator, or 1 where `guard` is true (a zero norm)."""
    safe_denominator = jnp.where(guard, 1.0, denominator)
    return jnp.where(guard, 1.0, numerator / safe_denominator)


def clip_param_norm(param_norm, bounds: tuple[float, float] | None):
    """phi(||x||): the identity, or clipped to [lower, upper]."""
    if bounds is None:
        return param_norm
    lower, upper = bounds
    return jnp.clip(param_norm, lower, upper)


def check_bounds(bounds, argument: str):
    if bounds is None:
        return
    if len(bounds) != 2 or not 0 <= bounds[0] <= bounds[1]:
        raise ValueError(f"{argument}={bounds!r} must be a pair with 0 <= lower <= upper")
