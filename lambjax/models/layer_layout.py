"""The encoder's layers in a params-shaped tree: stacked, or one tree per layer.

Stacked (`encoder/layers/...`, every leaf's leading axis the layers) is how parameters are
stored, converted and grown. Held one tree per layer (`encoder/layers_0 ... layers_{L-1}`),
an unrolled forward reads each layer's own tree, so its gradient is that tree's and not a
slice's (lambjax.train.layout holds an unrolled run's train state this way). The functions
here convert any params-shaped tree (parameters, their optimizer moments or trust ratios,
logical axis names) between the two.
"""

import re

import jax
import jax.numpy as jnp

_PER_LAYER_KEY = re.compile(r"layers_(\d+)")


def layer_name(index: int) -> str:
    """The encoder's key of layer `index` held on its own: `layers_{index}`."""
    return f"layers_{index}"


def layer_index(key: str) -> int | None:
    """`index` for a key `layers_{index}`, else None."""
    match = _PER_LAYER_KEY.fullmatch(key)
    return int(match.group(1)) if match else None


def is_per_layer(tree: dict) -> bool:
    """Whether a params-shaped tree holds its encoder layers one tree per layer."""
    return "layers" not in tree["encoder"]


def unstack_layers(tree: dict, *, count=None, first_index=0, take=None, is_leaf=None) -> dict:
    """A params-shaped tree (parameters, their moments or ratios, logical axes) with its
    stacked `encoder/layers` as `encoder/layers_{first_index + i}`, the i-th slice of each
    leaf (`take(leaf, i)`, by default `leaf[i]`); `count` where the leaves have no shape."""
    take = take or (lambda x, i: x[i])
    encoder = dict(tree["encoder"])
    stacked = encoder.pop("layers")
    if count is None:
        count = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(count):
        encoder[layer_name(first_index + i)] = jax.tree.map(
            lambda x, i=i: take(x, i), stacked, is_leaf=is_leaf
        )
    return {**tree, "encoder": encoder}


def stack_layers(tree: dict, *, stack=None) -> dict:
    """The inverse of `unstack_layers`: `encoder/layers_{i}` (in index order) stacked into
    `encoder/layers` (`stack(list of leaves)`, by default `jnp.stack`)."""
    stack = stack or jnp.stack
    encoder = {k: v for k, v in tree["encoder"].items() if layer_index(k) is None}
    layers = per_layer_trees(tree["encoder"])
    encoder["layers"] = jax.tree.map(lambda *xs: stack(list(xs)), *layers)
    return {**tree, "encoder": encoder}


def per_layer_trees(encoder: dict) -> list:
    """The per-layer trees of an encoder held one tree per layer, bottom layer first."""
    indexed = sorted((layer_index(k), v) for k, v in encoder.items() if layer_index(k) is not None)
    return [layer for _, layer in indexed]


def encoder_layers(encoder: dict):
    """The encoder's layers as `encoder.run_layers` takes them: the stacked tree, or the list of
    per-layer trees."""
    return encoder["layers"] if "layers" in encoder else per_layer_trees(encoder)


def cut_layers(layers, lo, hi):
    """Layers lo..hi-1 of a stacked tree or a list of per-layer trees."""
    if isinstance(layers, list):
        return layers[lo:hi]
    return jax.tree.map(lambda x: x[lo:hi], layers)
