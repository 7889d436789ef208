"""BERT's parameters: a random initialisation, and the logical axis names of every leaf.

Both come from the modules' own `init` (lambjax.models.bert): each part once (the encoder's
layer vmapped over the depth, so the layers are stored stacked), boxed with its logical axis
names, which `param_logical_axes` reads without a real init (`jax.eval_shape`).
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from lambjax.models import attention
from lambjax.models.bert import Embeddings, FinalNorm, Heads, Layer
from lambjax.models.config import BertConfig


def _example_inputs(config: BertConfig, batch=1, seq=8, predictions=2):
    ids = jnp.zeros((batch, seq), jnp.int32)
    h = jnp.zeros((batch, seq, config.hidden_size), config.dtype)
    word = jnp.zeros((config.vocab_size, config.hidden_size), config.param_dtype)
    positions = jnp.zeros((batch, predictions), jnp.int32)
    return ids, h, word, positions


def _boxed_parts(config: BertConfig, rng):
    """Each part's params with their logical-partitioning boxes (one layer unstacked)."""
    ids, h, word, positions = _example_inputs(config)
    keys = jax.random.split(rng, 4)
    bias = attention.AttentionMask.from_input_mask(jnp.ones(ids.shape, jnp.int32))
    parts = {
        "embeddings": Embeddings(config).init(keys[0], ids, ids, True)["params"],
        "heads": Heads(config).init(keys[2], h, positions, word)["params"],
    }
    layer_keys = jax.random.split(keys[1], config.num_layers)
    # The einsum form: the parameters do not depend on the kernel, and cuDNN's does not vmap.
    layer = Layer(dataclasses.replace(config, attention="xla"))
    layer_init = lambda k: layer.init(k, h, bias, 1.0, True)["params"]  # noqa: E731
    parts["layers"] = jax.vmap(layer_init)(layer_keys)
    if config.layer_norm == "pre":
        parts["final_layer_norm"] = FinalNorm(config).init(keys[3], h)["params"]
    return parts


def _assemble(parts):
    encoder = {"layers": parts["layers"]}
    if "final_layer_norm" in parts:
        encoder["final_layer_norm"] = parts["final_layer_norm"]
    return {"embeddings": parts["embeddings"], "encoder": encoder, "heads": parts["heads"]}


def init_params(config: BertConfig, rng: jax.Array) -> dict:
    """Randomly initialised parameters (BERT's truncated normal, std initializer_range)."""
    return _assemble(nn.meta.unbox(_boxed_parts(config, rng)))


def param_logical_axes(config: BertConfig) -> dict:
    """A PartitionSpec of logical axis names for every parameter (no real init)."""
    boxed = jax.eval_shape(functools.partial(_boxed_parts, config), jax.random.key(0))
    specs = nn.get_partition_spec(boxed)
    specs["layers"] = jax.tree.map(
        lambda spec: PartitionSpec("layers", *spec),
        specs["layers"],
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    return _assemble(specs)
