"""Parameter masks for BERT-style trees, by path, for any Flax parameter tree."""

import re

import jax

_NO_DECAY_LEAF_NAMES = {"bias", "scale", "gamma", "beta"}
_LAYER_NORM = re.compile(r"layer_?norm|(^|_)ln(_|\d|$)", re.IGNORECASE)


def _key_name(key) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _is_bias_or_norm(path) -> bool:
    names = [_key_name(k) for k in path]
    if not names:  # a bare array: decayed, as optax decays every leaf by default
        return False
    return names[-1] in _NO_DECAY_LEAF_NAMES or any(_LAYER_NORM.search(n) for n in names)


def bert_weight_decay_mask(params):
    """True for weights that take weight decay (and, in NVIDIA's LAMB, a trust ratio);
    False for biases and LayerNorm parameters (`bias`, `scale`, `gamma`, `beta`, or any leaf
    under a module named like `LayerNorm`, `layer_norm`, `ln_1`)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: not _is_bias_or_norm(path), params)


def stacked_layers_mask(params, key: str = "layers"):
    """True for leaves under a subtree named `key`: their leading axis stacks layers."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(_key_name(k) == key for k in path), params
    )
