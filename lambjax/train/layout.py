"""The encoder layers in the train state: stacked at rest, one tree per layer in an unrolled
run's steps.

At rest (checkpoints, the transformers export, MSLT's growth, a step method's stages, layer
dropping's indices) `encoder/layers` is one tree whose leaves stack the layers on their
leading axis. An unrolled step (`scan_layers=False`) that reads layer i as a slice of that
tree differentiates the slice: the gradient of every stacked leaf is then assembled from the
layers' gradients (one `pad` per layer and leaf, summed: a copy of every layer's gradient
each step), and the optimizer updates the stacked leaves. Held one tree per layer
(`encoder/layers_0 ... layers_{L-1}`, lambjax.models.layer_layout) each layer's gradient,
moments and update are buffers of their own, and nothing is assembled
(docs/fast_path.md has the operation counts).

The trainer converts at one boundary: the state a phase starts from (fresh, restored, or
the previous phase's) goes `to_running`, and the state it saves goes `to_rest`, so a
checkpoint written by an unrolled run restores into a scanned one and back. The numbers do
not depend on the layout: LAMB and LANS take one trust ratio per layer slice of a stacked
leaf (lambjax.optim, `stacked_layers`), which is the ratio of that layer's own tree.
"""

import jax
from jax.sharding import PartitionSpec

from lambjax.models import layer_layout
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params
from lambjax.train.state import TrainState


def per_layer(model_config: BertConfig) -> bool:
    """Whether the steps hold the layers one tree per layer: when they run unrolled (and the
    step method, where one runs, takes them so: lambjax.train.method)."""
    return not model_config.scan_layers


def to_running(state: TrainState, num_frozen_layers: int) -> TrainState:
    """A stacked state held one tree per layer: its parameters and every params-shaped tree
    of its optimizer state (moments, trust ratios; an MSLT stage's cover layers n and up)."""
    if layer_layout.is_per_layer(state.params):
        raise ValueError("to_running: the state's layers are already held one tree per layer")
    return state.replace(
        params=layer_layout.unstack_layers(state.params),
        opt_state=_map_param_trees(
            lambda tree: layer_layout.unstack_layers(tree, first_index=num_frozen_layers),
            state.opt_state,
        ),
    )


def fresh_state(model_config: BertConfig, optimizer, key: jax.Array, sharding) -> TrainState:
    """Random parameters and the optimizer's initial state, held as the steps hold them and
    placed with `sharding`: for a benchmark that steps without the trainer. The conversion
    to one tree per layer is a jit of its own, as the trainer's is (lambjax.train.loop):
    fused into the initialisation, XLA:GPU took 7 min 40 s to compile BERT-large's on an
    H200, against 7 s and 1 s apart (docs/performance.md)."""

    def init(key):
        return TrainState.create(init_params(model_config, key), optimizer)

    state = jax.jit(init, out_shardings=sharding)(key)
    if per_layer(model_config):
        state = jax.jit(lambda s: to_running(s, 0), out_shardings=sharding)(state)
    return state


def to_rest(state: TrainState) -> TrainState:
    """The inverse of `to_running`: the layers stacked again, as checkpoints hold them."""
    if not layer_layout.is_per_layer(state.params):
        raise ValueError("to_rest: the state's layers are already stacked")
    return state.replace(
        params=layer_layout.stack_layers(state.params),
        opt_state=_map_param_trees(layer_layout.stack_layers, state.opt_state),
    )


def running_param_axes(param_axes: dict, num_layers: int) -> dict:
    """The logical axes of the parameters held one tree per layer: each layer's tree has its
    stacked leaves' axes without the leading `layers`."""
    return layer_layout.unstack_layers(
        param_axes,
        count=num_layers,
        take=lambda spec, _: PartitionSpec(*spec[1:]),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def _map_param_trees(fn, tree):
    """`fn` applied to every params-shaped dict (one with an `encoder`) in an optimizer
    state: the chains, masks and NamedTuples around them kept."""
    if isinstance(tree, dict):
        if "encoder" in tree:
            return fn(tree)
        return {k: _map_param_trees(fn, v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_map_param_trees(fn, field) for field in tree))
    if isinstance(tree, tuple | list):
        return type(tree)(_map_param_trees(fn, v) for v in tree)
    return tree


def abstract_running(abstract: TrainState, num_frozen_layers: int) -> TrainState:
    """The running state's shapes from the resting state's (ShapeDtypeStructs)."""
    return jax.eval_shape(lambda s: to_running(s, num_frozen_layers), abstract)
