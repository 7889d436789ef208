"""An optimizer applied to the stacked layers of a tree held one tree per layer.

Held one tree per layer (`encoder/layers_0 ... layers_{L-1}`, lambjax.models.layer_layout)
BERT-large's parameters are ~400 leaves instead of ~30, and an optimizer that works leaf by
leaf emits its elementwise updates and its per-tensor norms once per leaf: the compiled
update's kernels grow with the number of layers (docs/results.md has the counts). Wrapped
in `on_stacked_layers`, the optimizer sees the same layers stacked: each role's leaves are
one array with a leading layer axis, the per-tensor norms are one batched reduction per
role (one trust ratio per layer slice, as before), and the elementwise update is one per
role; the result and the state are handed back one tree per layer. The update is the
per-leaf update to float32 rounding; what it costs is the stacking (a copy of the
gradients, the parameters and the moments, which XLA may fuse into their consumers) and
the unstacking of the outputs.

The wrapped optimizer must treat the stacked leaves as stacked (`stacked_layers`, e.g.
`lambjax.optim.stacked_layers_mask`), and its masks must be written for the stacked tree
(the masks by path in lambjax.optim.masks are). Trees with stacked layers pass straight
through.
"""

import jax
import numpy as np
import optax

from lambjax.models import layer_layout
from lambjax.optim.per_tensor import per_tensor_count
from lambjax.optim.state import map_states, per_tensor_tree
from lambjax.optim.transforms import ScaleByLansState, TrustRatioState


def is_held_per_layer(tree) -> bool:
    """Whether a params-shaped tree holds encoder layers one tree per layer."""
    if not isinstance(tree, dict) or not isinstance(tree.get("encoder"), dict):
        return False
    encoder = tree["encoder"]
    return "layers" not in encoder and any(layer_layout.layer_index(k) is not None for k in encoder)


def first_layer_index(tree) -> int:
    """The lowest `layers_{i}` index of a tree held one tree per layer (a trainable view
    without its frozen bottom layers starts above 0)."""
    indices = (layer_layout.layer_index(k) for k in tree["encoder"])
    return min(i for i in indices if i is not None)


def map_param_trees(fn, tree, params_structure):
    """`fn` applied to every subtree of an optimizer state with the structure of the
    parameters (the moments); everything else kept."""
    if isinstance(tree, dict) and jax.tree.structure(tree) == params_structure:
        return fn(tree)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(map_param_trees(fn, f, params_structure) for f in tree))
    if isinstance(tree, tuple | list):
        return type(tree)(map_param_trees(fn, v, params_structure) for v in tree)
    if isinstance(tree, dict):
        return {k: map_param_trees(fn, v, params_structure) for k, v in tree.items()}
    return tree


def per_layer_order(per_layer_params) -> np.ndarray:
    """For each per-tensor value in the stacked tree's order (`concat_per_tensor`'s, every
    stacked leaf one value per layer), its position in the per-layer tree's order."""
    unstacked = jax.tree.map(lambda _: False, per_layer_params)
    positions = per_tensor_tree(
        np.arange(per_tensor_count(per_layer_params, unstacked)), per_layer_params
    )
    stacked = layer_layout.stack_layers(positions, stack=np.stack)
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(stacked)])


def reorder_per_tensor_vectors(state, order: np.ndarray):
    """The per-tensor vectors that LAMB's and LANS's states keep for logging, from the
    stacked tree's order into the per-layer tree's (what `last_trust_ratios` reads)."""
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)

    def reorder(vector):
        if vector.shape != order.shape:
            raise ValueError(
                f"on_stacked_layers: the optimizer logged {vector.shape[0]} per-tensor values "
                f"for {order.size} layer slices and tensors; build it with "
                "stacked_layers=lambjax.optim.stacked_layers_mask"
            )
        return vector[inverse]

    def reorder_state(s):
        if isinstance(s, TrustRatioState):
            return s._replace(trust_ratios=reorder(s.trust_ratios))
        if isinstance(s, ScaleByLansState):
            return s._replace(
                adam_trust_ratios=reorder(s.adam_trust_ratios),
                gradient_trust_ratios=reorder(s.gradient_trust_ratios),
            )
        return s

    return map_states(reorder_state, state)


def on_stacked_layers(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` applied to the layers stacked when the parameters hold them one tree per layer.

    `tx` must take one trust ratio per layer slice of every stacked leaf
    (`stacked_layers=lambjax.optim.stacked_layers_mask`); its state is handed back with the
    moments one tree per layer and the logged per-tensor vectors in the per-layer tree's
    order, as the unwrapped optimizer's would be.
    """

    tx = optax.with_extra_args_support(tx)

    def stacked_view(params):
        first = first_layer_index(params)

        def unstack(tree):
            return layer_layout.unstack_layers(tree, first_index=first)

        return (
            jax.tree.structure(params),
            layer_layout.stack_layers,
            unstack,
            per_layer_order(params),
        )

    def init_fn(params):
        if not is_held_per_layer(params):
            return tx.init(params)
        structure, stack, unstack, order = stacked_view(params)
        stacked_params = stack(params)
        state = tx.init(stacked_params)
        state = map_param_trees(unstack, state, jax.tree.structure(stacked_params))
        return reorder_per_tensor_vectors(state, order)

    def update_fn(updates, state, params=None, **extra_args):
        if params is None or not is_held_per_layer(params):
            return tx.update(updates, state, params, **extra_args)
        structure, stack, unstack, order = stacked_view(params)
        stacked_params = stack(params)
        state = map_param_trees(stack, state, structure)
        updates, state = tx.update(stack(updates), state, stacked_params, **extra_args)
        state = map_param_trees(unstack, state, jax.tree.structure(stacked_params))
        return unstack(updates), reorder_per_tensor_vectors(state, order)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
