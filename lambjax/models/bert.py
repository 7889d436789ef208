"""BERT for pretraining (MLM + NSP), PostLN or PreLN, in Flax Linen.

Parameters are a plain pytree:

  embeddings/{word, position, token_type}/embedding, embeddings/layer_norm/{scale, bias}
  encoder/layers/...           every leaf stacked: leading axis = num_layers
  encoder/final_layer_norm     PreLN only
  heads/{pooler, mlm_transform, mlm_layer_norm, mlm_bias, nsp}

The encoder layers are stored stacked and run with `lax.scan` (compile time independent of
depth) or, with `scan_layers=False`, a Python loop over the same stacked tree. The forward
takes a per-layer keep mask (a dropped layer is skipped with `lax.cond`, its compute never
runs) and a number of bottom layers that run without gradient; `grow_layers` deepens a model
by copying layers. Every parameter carries logical axis names (lambjax.sharding maps them).
"""

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from lambjax.models import matmul

PRESETS = {
    "tiny": dict(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=512),
    "mini": dict(num_layers=4, hidden_size=256, num_heads=4, intermediate_size=1024),
    "base": dict(num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072),
    "large": dict(num_layers=24, hidden_size=1024, num_heads=16, intermediate_size=4096),
}


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm: str = "post"  # "post" (original BERT) or "pre" (PreLN, as in PLD)
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    dtype: str = "bfloat16"  # compute
    param_dtype: str = "float32"
    scan_layers: bool = True
    remat: bool = False  # recompute each layer's activations in the backward pass

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BertConfig.{name}={value!r} must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"BertConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}"
            )
        if self.layer_norm not in ("post", "pre"):
            raise ValueError(f"BertConfig.layer_norm={self.layer_norm!r}; valid: 'post', 'pre'")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"BertConfig.{name}={getattr(self, name)} must lie in [0, 1)")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(
                    f"BertConfig.{name}={getattr(self, name)!r}; valid: float32, bfloat16, float16"
                )

    @classmethod
    def preset(cls, name: str, **overrides) -> "BertConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown BERT preset {name!r}; valid: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _init(config: BertConfig):
    return nn.initializers.truncated_normal(config.initializer_range)


def _dense(config, features, names, name, axis=-1):
    return nn.DenseGeneral(
        features,
        axis=axis,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        kernel_init=nn.with_logical_partitioning(_init(config), names),
        bias_init=nn.with_logical_partitioning(
            nn.initializers.zeros, names[-(len(features) if isinstance(features, tuple) else 1) :]
        ),
        dot_general=matmul.dense_dot_general,
        name=name,
    )


def _layer_norm(config, name):
    return nn.LayerNorm(
        epsilon=config.layer_norm_eps,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
        name=name,
    )


class Embeddings(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, input_ids, segment_ids, deterministic: bool):
        c = self.config

        def embed(num, names, name):
            # Looked up in the parameters' dtype: the backward pass is then a float32
            # scatter-add (in bfloat16 it is a compare-and-swap loop on GPUs, 20% of a
            # BERT-large step on an H100), and no bfloat16 copy of the table is made.
            return nn.Embed(
                num,
                c.hidden_size,
                dtype=c.param_dtype,
                param_dtype=c.param_dtype,
                embedding_init=nn.with_logical_partitioning(_init(c), names),
                name=name,
            )

        positions = jnp.arange(input_ids.shape[1])[None]
        h = (
            embed(c.vocab_size, ("vocab", "embed"), "word")(input_ids)
            + embed(c.max_position_embeddings, ("position", "embed"), "position")(positions)
            + embed(c.type_vocab_size, ("token_type", "embed"), "token_type")(segment_ids)
        )
        h = _layer_norm(c, "layer_norm")(h)
        return nn.Dropout(c.hidden_dropout)(h, deterministic=deterministic)


class Attention(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, x, attention_bias, deterministic: bool):
        c = self.config
        heads = (c.num_heads, c.head_dim)
        q = _dense(c, heads, ("embed", "heads", "kv"), "query")(x)
        k = _dense(c, heads, ("embed", "heads", "kv"), "key")(x)
        v = _dense(c, heads, ("embed", "heads", "kv"), "value")(x)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        logits = logits / jnp.sqrt(jnp.float32(c.head_dim)) + attention_bias
        weights = jax.nn.softmax(logits, axis=-1)
        weights = nn.Dropout(c.attention_dropout)(weights, deterministic=deterministic)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)
        out = _dense(c, c.hidden_size, ("heads", "kv", "embed"), "output", axis=(-2, -1))(out)
        return nn.Dropout(c.hidden_dropout)(out, deterministic=deterministic)


class Mlp(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, x, deterministic: bool):
        c = self.config
        x = _dense(c, c.intermediate_size, ("embed", "mlp"), "intermediate")(x)
        x = nn.gelu(x, approximate=False)
        x = _dense(c, c.hidden_size, ("mlp", "embed"), "output")(x)
        return nn.Dropout(c.hidden_dropout)(x, deterministic=deterministic)


class Layer(nn.Module):
    """One transformer block. `scale` multiplies each sub-layer's output (PLD's 1/p)."""

    config: BertConfig

    @nn.compact
    def __call__(self, h, attention_bias, scale, deterministic: bool):
        c = self.config
        attention = Attention(c, name="attention")
        mlp = Mlp(c, name="mlp")
        attention_norm = _layer_norm(c, "attention_layer_norm")
        mlp_norm = _layer_norm(c, "mlp_layer_norm")
        if c.layer_norm == "pre":  # normalise each sub-layer's input, never the residual
            h = h + scale * attention(attention_norm(h), attention_bias, deterministic)
            return h + scale * mlp(mlp_norm(h), deterministic)
        h = attention_norm(h + scale * attention(h, attention_bias, deterministic))
        return mlp_norm(h + scale * mlp(h, deterministic))


class Heads(nn.Module):
    """Pooler + NSP classifier, and the MLM head on the gathered masked positions."""

    config: BertConfig

    @nn.compact
    def __call__(self, h, masked_lm_positions, word_embeddings):
        c = self.config
        pooled = jnp.tanh(_dense(c, c.hidden_size, ("embed", "mlp"), "pooler")(h[:, 0]))
        nsp_logits = _dense(c, 2, ("embed", "classes"), "nsp")(pooled)
        # Gather first: the MLM head runs on P masked positions, not all S tokens.
        x = jnp.take_along_axis(h, masked_lm_positions[..., None], axis=1)
        x = _dense(c, c.hidden_size, ("embed", "mlp"), "mlm_transform")(x)
        x = nn.gelu(x, approximate=False)
        x = _layer_norm(c, "mlm_layer_norm")(x)
        bias = self.param(
            "mlm_bias",
            nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
            (c.vocab_size,),
            c.param_dtype,
        )
        # Vocabulary-major [V, B * P]: the tied embedding's gradient (dlogits x) then needs no
        # transpose of the logits gradient, and the bias gradient reduces the minor axis.
        x = x.reshape(-1, x.shape[-1])
        mlm_logits = matmul.matmul_nt(word_embeddings.astype(x.dtype), x)
        return mlm_logits.astype(jnp.float32) + bias[:, None], nsp_logits.astype(jnp.float32)


class FinalNorm(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, h):
        return _layer_norm(self.config, "layer_norm")(h)


# ----------------------------------------------------------------------------------------
# Parameters


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
    bias = jnp.zeros((1, 1, 1, ids.shape[1]), jnp.float32)
    parts = {
        "embeddings": Embeddings(config).init(keys[0], ids, ids, True)["params"],
        "heads": Heads(config).init(keys[2], h, positions, word)["params"],
    }
    layer_keys = jax.random.split(keys[1], config.num_layers)
    layer_init = lambda k: Layer(config).init(k, h, bias, 1.0, True)["params"]  # noqa: E731
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


def grow_layers(config: BertConfig, params: dict, num_layers: int) -> tuple[BertConfig, dict]:
    """Deepens the encoder to `num_layers` by copying the current top layers on top.

    With n current layers and k = num_layers - n new ones (k <= n), new layer n + i is a
    copy of layer n - k + i: the top k layers are repeated in order (3 -> 6 stacks layers
    0..2 again; 6 -> 8 copies layers 4, 5). For k > n the rule repeats.
    """
    current = config.num_layers
    if num_layers < current:
        raise ValueError(f"grow_layers: num_layers={num_layers} < current depth {current}")
    sources = list(range(current))
    while len(sources) < num_layers:
        k = min(num_layers - len(sources), len(sources))
        sources += sources[len(sources) - k :]
    index = jnp.asarray(sources)
    grown = jax.tree.map(lambda x: x[index], params["encoder"]["layers"])
    params = {**params, "encoder": {**params["encoder"], "layers": grown}}
    return dataclasses.replace(config, num_layers=num_layers), params


# ----------------------------------------------------------------------------------------
# Forward


def _attention_bias(input_mask):
    return jnp.where(input_mask[:, None, None, :] > 0, 0.0, -1e9).astype(jnp.float32)


def _run_layers(config, layers, h, attention_bias, *, rng, keep, scale, first_index):
    """Runs a stack of layers (scan or loop); layer i uses rng fold_in(rng, first_index+i)."""
    deterministic = rng is None
    count = jax.tree.leaves(layers)[0].shape[0]
    indices = jnp.arange(first_index, first_index + count)
    skip_dropped = keep is not None
    keep = jnp.ones((count,), bool) if keep is None else keep
    scale = jnp.ones((count,), jnp.float32) if scale is None else scale

    def apply_layer(h, xs):
        layer_params, index, keep_layer, scale_layer = xs
        rngs = {} if deterministic else {"dropout": jax.random.fold_in(rng, index)}

        def run(h):
            return Layer(config).apply(
                {"params": layer_params},
                h,
                attention_bias,
                scale_layer.astype(h.dtype),
                deterministic,
                rngs=rngs,
            )

        if skip_dropped:
            return jax.lax.cond(keep_layer, run, lambda h: h, h), None
        return run(h), None

    if config.remat:
        apply_layer = jax.checkpoint(apply_layer, prevent_cse=not config.scan_layers)
    xs = (layers, indices, keep, scale)
    if config.scan_layers:
        h, _ = jax.lax.scan(apply_layer, h, xs)
        return h
    for i in range(count):
        h, _ = apply_layer(h, jax.tree.map(lambda x, i=i: x[i], xs))
    return h


def encoder_outputs(
    config: BertConfig,
    params: dict,
    input_ids,
    segment_ids,
    input_mask,
    *,
    dropout_rng=None,
    layer_keep=None,
    layer_scale=None,
    num_frozen_layers: int = 0,
):
    """Last hidden states [B, S, H] (after PreLN's final LayerNorm)."""
    deterministic = dropout_rng is None
    if not deterministic:
        embeddings_rng, dropout_rng = jax.random.split(dropout_rng)
    rngs = {} if deterministic else {"dropout": embeddings_rng}
    h = Embeddings(config).apply(
        {"params": params["embeddings"]}, input_ids, segment_ids, deterministic, rngs=rngs
    )
    bias = _attention_bias(input_mask)
    layers = params["encoder"]["layers"]
    n = num_frozen_layers
    if not 0 <= n <= config.num_layers:
        raise ValueError(f"num_frozen_layers={n} must lie in [0, {config.num_layers}]")

    def part(x, lo, hi):
        return None if x is None else x[lo:hi]

    if n:
        frozen = jax.tree.map(lambda x: jax.lax.stop_gradient(x[:n]), layers)
        h = _run_layers(
            config,
            frozen,
            jax.lax.stop_gradient(h),
            bias,
            rng=dropout_rng,
            keep=part(layer_keep, 0, n),
            scale=part(layer_scale, 0, n),
            first_index=0,
        )
        h = jax.lax.stop_gradient(h)
    if n < config.num_layers:
        top = jax.tree.map(lambda x: x[n:], layers)
        h = _run_layers(
            config,
            top,
            h,
            bias,
            rng=dropout_rng,
            keep=part(layer_keep, n, None),
            scale=part(layer_scale, n, None),
            first_index=n,
        )
    if config.layer_norm == "pre":
        h = FinalNorm(config).apply({"params": params["encoder"]["final_layer_norm"]}, h)
    return h


def encode(config: BertConfig, params: dict, input_ids, segment_ids, input_mask):
    """The last hidden states, deterministically: for use outside training."""
    return encoder_outputs(config, params, input_ids, segment_ids, input_mask)


def _vocab_major_logits(config: BertConfig, params: dict, batch: dict, **encoder_kwargs):
    """(MLM logits [V, B * P] at the masked positions, NSP logits [B, 2]), float32."""
    h = encoder_outputs(
        config,
        params,
        batch["input_ids"],
        batch["segment_ids"],
        batch["input_mask"],
        **encoder_kwargs,
    )
    return Heads(config).apply(
        {"params": params["heads"]},
        h,
        batch["masked_lm_positions"],
        params["embeddings"]["word"]["embedding"],
    )


def pretraining_logits(config: BertConfig, params: dict, batch: dict, **encoder_kwargs):
    """(MLM logits [B, P, V] at the masked positions, NSP logits [B, 2]), float32."""
    mlm_logits, nsp_logits = _vocab_major_logits(config, params, batch, **encoder_kwargs)
    shape = batch["masked_lm_positions"].shape + (config.vocab_size,)
    return mlm_logits.T.reshape(shape), nsp_logits


def _cross_entropy(logits, labels, axis: int):
    """(negative log-likelihood, hit) of integer `labels` under `logits` along `axis`.

    The label's logit is picked with a one-hot compare, not a gather: its gradient is then
    part of the one elementwise pass softmax - one_hot, where a gather's is a scatter into
    a zero tensor as large as the logits. A hit is a label whose logit is the largest.
    """
    classes = jax.lax.broadcasted_iota(labels.dtype, logits.shape, axis % logits.ndim)
    one_hot = classes == jnp.expand_dims(labels, axis)
    label_logits = jnp.sum(jnp.where(one_hot, logits, 0.0), axis=axis)
    nll = jax.nn.logsumexp(logits, axis=axis) - label_logits
    hits = label_logits >= jnp.max(logits, axis=axis)
    return nll, hits.astype(jnp.float32)


def pretraining_stats(
    config: BertConfig,
    params: dict,
    batch: dict,
    *,
    dropout_rng=None,
    layer_keep=None,
    layer_scale=None,
    num_frozen_layers: int = 0,
) -> dict[str, Any]:
    """Sums (not means) of the MLM and NSP losses and hits over the batch, float32.

    Sums let a caller add micro-batches up exactly and normalise by global counts.
    """
    mlm_logits, nsp_logits = _vocab_major_logits(
        config,
        params,
        batch,
        dropout_rng=dropout_rng,
        layer_keep=layer_keep,
        layer_scale=layer_scale,
        num_frozen_layers=num_frozen_layers,
    )
    weights = batch["masked_lm_weights"].astype(jnp.float32).reshape(-1)
    mlm_nll, mlm_hits = _cross_entropy(mlm_logits, batch["masked_lm_ids"].reshape(-1), axis=0)
    nsp_nll, nsp_hits = _cross_entropy(
        nsp_logits, batch["next_sentence_labels"].reshape(-1), axis=-1
    )
    return {
        "mlm_loss_sum": jnp.sum(mlm_nll * weights),
        "mlm_weight_sum": jnp.sum(weights),
        "mlm_correct_sum": jnp.sum(mlm_hits * weights),
        "nsp_loss_sum": jnp.sum(nsp_nll),
        "nsp_correct_sum": jnp.sum(nsp_hits),
        "nsp_count": jnp.float32(nsp_nll.shape[0]),
    }


# ----------------------------------------------------------------------------------------
# FLOPs


def forward_flops(
    config: BertConfig, batch_size: int, seq_len: int, predictions: int, *, num_layers=None
) -> int:
    """Matmul FLOPs (2 per multiply-add) of one forward pass, MLM head on gathered positions.

    Per sequence and layer: Q, K, V and output projections 4 * 2*S*H^2; attention scores and
    their product with V 2 * 2*S^2*H (bidirectional: every query sees every key); the MLP
    2 * 2*S*H*I. Heads: pooler 2*H^2, NSP 2*H*2, and per masked position the transform
    2*H^2 plus the tied decoder 2*H*V. `num_layers` counts only that many encoder layers.
    """
    h, m, s, v = config.hidden_size, config.intermediate_size, seq_len, config.vocab_size
    layers = config.num_layers if num_layers is None else num_layers
    per_layer = 8 * s * h * h + 4 * s * s * h + 4 * s * h * m
    heads = 2 * h * h + 4 * h + predictions * (2 * h * h + 2 * h * v)
    return batch_size * (layers * per_layer + heads)


def train_step_flops(
    config: BertConfig,
    batch_size: int,
    seq_len: int,
    max_predictions_per_seq: int,
    *,
    num_frozen_layers: int = 0,
) -> int:
    """Forward + backward (twice the forward: gradients of activations and of weights).

    Frozen bottom layers (a stage of multi-stage layerwise training) run forward only.
    """
    args = (config, batch_size, seq_len, max_predictions_per_seq)
    frozen = forward_flops(*args, num_layers=num_frozen_layers) - forward_flops(*args, num_layers=0)
    return 3 * forward_flops(*args) - 2 * frozen
