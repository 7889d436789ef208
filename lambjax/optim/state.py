"""Reading and resetting what LAMB's and LANS's states keep: the step counters (restarted at
a phase switch), the last trust ratios and the norms measured on the way (for logging)."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lambjax.optim.per_tensor import MaskOrFn, flatten_alike, resolve_mask
from lambjax.optim.transforms import LearningRateState, ScaleByLansState, TrustRatioState


def map_states(fn: Callable[[Any], Any], state):
    """Applies `fn` to every NamedTuple in an optimizer state (chains, masks, injections)."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        state = fn(state)
        return type(state)(*(map_states(fn, field) for field in state))
    if isinstance(state, tuple | list):
        return type(state)(map_states(fn, s) for s in state)
    if isinstance(state, dict):
        return {k: map_states(fn, v) for k, v in state.items()}
    return state


_STEP_COUNTERS = ("count", "schedule_count")


def restart_step_count(opt_state):
    """Every step counter (Adam's bias correction, schedules, ...) back to 0; moments kept.

    NVIDIA's BERT phase 2 starts this way from phase 1's optimizer state.
    """

    def restart(s):
        counters = [name for name in _STEP_COUNTERS if name in s._fields]
        return s._replace(**{name: jnp.zeros_like(getattr(s, name)) for name in counters})

    return map_states(restart, opt_state)


def last_trust_ratios(opt_state, params=None, stacked_layers: MaskOrFn = None) -> dict[str, Any]:
    """The trust ratios of the last update, by name: `trust_ratio` (LAMB), or
    `trust_ratio_adam` and `trust_ratio_gradient` (LANS). Empty for other optimizers.

    Each is one vector of per-tensor ratios (per layer slice of a stacked leaf), in the
    order of the parameters' leaves; given the parameters (and the optimizer's
    `stacked_layers`), a tree like them (`per_tensor_tree`).
    """
    found: dict[str, Any] = {}

    def collect(s):
        if isinstance(s, TrustRatioState):
            found["trust_ratio"] = s.trust_ratios
        elif isinstance(s, ScaleByLansState):
            found["trust_ratio_adam"] = s.adam_trust_ratios
            found["trust_ratio_gradient"] = s.gradient_trust_ratios
        return s

    map_states(collect, opt_state)
    if params is None:
        return found
    return {name: per_tensor_tree(v, params, stacked_layers) for name, v in found.items()}


def per_tensor_tree(values: jax.Array, params, stacked_layers: MaskOrFn = None):
    """A vector of per-tensor values (`concat_per_tensor`'s, e.g. trust ratios) as a tree
    like `params`: a scalar per leaf, [L] per stacked leaf."""
    stacked = resolve_mask(stacked_layers, params, argument="stacked_layers", default=False)
    leaves, stacked_leaves = flatten_alike(params, stacked)
    sizes = [
        x.shape[0] if s and x.ndim else None for x, s in zip(leaves, stacked_leaves, strict=True)
    ]
    expected = sum(1 if n is None else n for n in sizes)
    if values.shape != (expected,):
        raise ValueError(
            f"per_tensor_tree: {values.shape[0]} values for parameters with {expected} "
            "tensors (layer slices counted): pass the optimizer's params and stacked_layers"
        )
    out, start = [], 0
    for n in sizes:
        out.append(values[start] if n is None else values[start : start + n])
        start += 1 if n is None else n
    return jax.tree.structure(params).unflatten(out)


def last_norms(opt_state) -> dict[str, jax.Array]:
    """The global norms of the last update that the optimizer measured on its way, by name:
    `param_norm` (of the parameters given to `update`; LAMB and LANS) and `update_norm` (of
    the update returned; LAMB: the trust-ratio block's output norm times the rate that
    `scale_by_learning_rate` applied after it). Each global norm is the square root of the
    sum of the squared per-tensor norms the trust ratios are made of.

    A name is missing where the optimizer does not measure it: `lans` has no `update_norm`
    (its step sums two directions; the norm of the sum would cost another pass over both),
    optax's optimizers neither.
    """
    found: dict[str, Any] = {}

    def collect(s):
        if isinstance(s, TrustRatioState):
            found["param_norm"], found["direction_norm"] = s.param_norm, s.update_norm
        elif isinstance(s, ScaleByLansState):
            found["param_norm"] = s.param_norm
        elif isinstance(s, LearningRateState):
            found["learning_rate"] = s.last_learning_rate
        return s

    map_states(collect, opt_state)
    norms = {"param_norm": found["param_norm"]} if "param_norm" in found else {}
    if "direction_norm" in found and "learning_rate" in found:
        norms["update_norm"] = jnp.abs(found["learning_rate"]) * found["direction_norm"]
    return norms
