"""The train state, its abstract form (`jax.eval_shape`) and its shardings.

The shardings of every leaf come from the model's logical axis names and the one rules table
in lambjax.sharding: parameters by their axes, optimizer moments like the parameter they
mirror, everything else (step counters, per-layer trust ratios) replicated.
"""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from lambjax import sharding
from lambjax.train import layerwise


class TrainState(flax.struct.PyTreeNode):
    step: jax.Array  # optimizer steps taken in the current phase
    params: Any
    opt_state: Any  # covers the trainable view of params only (lambjax.train.layerwise)
    consecutive_nonfinite: jax.Array  # steps in a row whose update was skipped
    total_nonfinite: jax.Array
    # What a step method carries between steps (lambjax.train.method); None otherwise.
    method_state: Any = None

    @classmethod
    def create(
        cls,
        params,
        optimizer: optax.GradientTransformation,
        num_frozen_layers: int = 0,
        *,
        opt_state=None,
        train_decoder: bool = False,
    ) -> "TrainState":
        """A state at step 0. Its optimizer state is fresh, for the trainable view of
        `params` only (lambjax.train.layerwise), or `opt_state` where given (moments kept
        from an earlier phase)."""
        if opt_state is None:
            opt_state = init_optimizer_state(optimizer, params, num_frozen_layers, train_decoder)

        def zero():
            return jnp.zeros((), jnp.int32)

        return cls(zero(), params, opt_state, zero(), zero())


def init_optimizer_state(
    optimizer: optax.GradientTransformation, params, num_frozen_layers, train_decoder=False
):
    """A fresh optimizer state for the trainable view of `params` (all of it when no layer is
    frozen)."""
    return optimizer.init(
        layerwise.split(params, num_frozen_layers, train_decoder=train_decoder)[0]
    )


def shardings(
    abstract: TrainState,
    *,
    param_axes,
    mesh: jax.sharding.Mesh,
    optimizer: optax.GradientTransformation,
    num_frozen_layers: int,
    train_decoder: bool = False,
) -> TrainState:
    """A NamedSharding for every leaf of `abstract` (a TrainState of ShapeDtypeStructs)."""
    param_shardings = sharding.tree_shardings(abstract.params, param_axes, mesh)
    replicated = sharding.replicated(mesh)

    def like_param(leaf, param, param_sharding):
        # Moments mirror their parameter; anything else there (e.g. per-layer ratios) is small.
        return param_sharding if leaf.shape == param.shape else replicated

    # The optimizer state covers the trainable view only (all parameters, but in an MSLT
    # stage). Cutting layers off a stacked leaf keeps its sharding: `layers` is sharded
    # only over the mesh axis `stage`, whose step method (Ouroboros) runs no MSLT stage.
    n, decoder = num_frozen_layers, train_decoder
    trainable_params = jax.eval_shape(
        lambda p: layerwise.split(p, n, train_decoder=decoder)[0], abstract.params
    )
    trainable_shardings, _ = layerwise.split(
        param_shardings, n, take=lambda s, _: s, train_decoder=decoder
    )
    opt_shardings = optax.tree_map_params(
        optimizer,
        like_param,
        abstract.opt_state,
        trainable_params,
        trainable_shardings,
        transform_non_params=lambda _: replicated,
    )
    return TrainState(
        step=replicated,
        params=param_shardings,
        opt_state=opt_shardings,
        consecutive_nonfinite=replicated,
        total_nonfinite=replicated,
    )


def with_shardings(abstract_tree, shardings_tree):
    """ShapeDtypeStructs that carry their target sharding (what Orbax restores onto)."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract_tree,
        shardings_tree,
    )
