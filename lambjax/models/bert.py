"""BERT for pretraining (MLM + NSP), PostLN or PreLN, in Flax Linen.

Parameters are a plain pytree:

  embeddings/{word, position, token_type}/embedding, embeddings/layer_norm/{scale, bias}
  encoder/layers/...           every leaf stacked: leading axis = num_layers
  encoder/final_layer_norm     PreLN only
  heads/{pooler, mlm_transform, mlm_layer_norm, mlm_bias, nsp}

The encoder layers are stored stacked and run with `lax.scan` (compile time independent of
depth) or, with `scan_layers=False`, a Python loop. The loop also runs the layers held one
tree per layer, `encoder/layers_0 ... layers_{L-1}` (lambjax.models.layer_layout): an
unrolled train step then differentiates each layer's own tree and never assembles a stacked
gradient (lambjax.train.layout). The forward takes a per-layer keep mask (a dropped layer
is skipped with `lax.cond`, its compute never runs) and a number of bottom layers that run
without gradient. Every parameter carries logical axis names (lambjax.sharding maps them).
The pretraining losses on top of the encoder are in lambjax.models.pretraining.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from lambjax.models import attention, layer_layout, matmul, standardization
from lambjax.precision import parse_accumulation

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
    # "layer_norm", or "none": the embeddings' and the encoder's LayerNorms keep only their
    # scale and bias (lambjax.models.standardization), for training with the
    # standardization loss (Collins et al. 2019) in their place.
    normalization: str = "layer_norm"
    initializer_range: float = 0.02
    dtype: str = "bfloat16"  # compute
    param_dtype: str = "float32"
    scan_layers: bool = True
    remat: bool = False  # recompute each layer's activations in the backward pass
    # How the encoder's matmuls accumulate: "float32" (the platform's dot), or an emulation
    # of low-precision accumulation, "float16" (naive) or "float16:chunk=64" (chunk-based),
    # likewise bfloat16 or an eXmY format, of 8-bit operands with ":operands=float8_e5m2"
    # ("e6m9:chunk=64:operands=float8_e5m2": Wang et al.'s setting; lambjax.precision). The
    # embeddings and the heads keep the platform's dot, as Wang et al. keep the first and
    # last layers in higher precision.
    matmul_accumulation: str = "float32"
    # "auto", "xla", "cudnn" or "splash": the attention kernel (lambjax.models.attention).
    attention: str = "auto"
    # GELU in the MLPs and the MLM head's transform: False = exact (erf), as BERT; True = the
    # tanh approximation (transformers' "gelu_new"), cheaper where erf is a long polynomial.
    gelu_approximate: bool = False

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
        if self.normalization not in ("layer_norm", "none"):
            raise ValueError(
                f"BertConfig.normalization={self.normalization!r}; valid: 'layer_norm', 'none'"
            )
        if not isinstance(self.gelu_approximate, bool):
            raise ValueError(
                f"BertConfig.gelu_approximate={self.gelu_approximate!r}; valid: True (tanh), "
                "False (erf)"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"BertConfig.{name}={getattr(self, name)} must lie in [0, 1)")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(
                    f"BertConfig.{name}={getattr(self, name)!r}; valid: float32, bfloat16, float16"
                )
        try:
            attention.check(self.attention, self.attention_dropout, self.dtype, self.head_dim)
        except ValueError as e:
            raise ValueError(f"BertConfig.{e}") from None
        try:
            parse_accumulation(self.matmul_accumulation)
        except ValueError as e:
            raise ValueError(f"BertConfig.{e}") from None

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


def dense(config, features, names, name, axis=-1, dot_general=matmul.dense_dot_general):
    """A Flax `DenseGeneral` in the model's dtypes and initialiser, its kernel's logical axes
    `names` (input axes, then the output axes, which its bias takes).

    Args:
      config: the model's BertConfig (dtype, param_dtype, initializer_range).
      features: the output size, or a tuple of output sizes (e.g. heads, head_dim).
      names: the kernel's logical axis names, e.g. ("embed", "mlp").
      name: the submodule's name (the parameter tree's key).
      axis: the input axis or axes contracted.
      dot_general: the matmul (lambjax.models.matmul), e.g. an emulated accumulation.
    """
    return nn.DenseGeneral(
        features,
        axis=axis,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        kernel_init=nn.with_logical_partitioning(_init(config), names),
        bias_init=nn.with_logical_partitioning(
            nn.initializers.zeros, names[-(len(features) if isinstance(features, tuple) else 1) :]
        ),
        dot_general=dot_general,
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


def _encoder_norm(config, name):
    """A LayerNorm of the embeddings or the encoder, or its scale and bias alone."""
    if config.normalization == "none":
        return standardization.AffineNorm(
            config.hidden_size, config.dtype, config.param_dtype, name=name
        )
    return _layer_norm(config, name)


def _normalize(norm, x, token_mask):
    """`norm(x)`; given a token mask (normalization 'none', in training), an AffineNorm
    also sows its input's standardization loss."""
    return norm(x) if token_mask is None else norm(x, token_mask)


class Embeddings(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(
        self, input_ids, segment_ids, deterministic: bool, token_mask=None, positions=None
    ):
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

        if positions is None:  # one example per row; packed rows restart at each example
            positions = jnp.arange(input_ids.shape[1])[None]
        h = (
            embed(c.vocab_size, ("vocab", "embed"), "word")(input_ids)
            + embed(c.max_position_embeddings, ("position", "embed"), "position")(positions)
            + embed(c.type_vocab_size, ("token_type", "embed"), "token_type")(segment_ids)
        )
        h = _normalize(_encoder_norm(c, "layer_norm"), h, token_mask)
        return nn.Dropout(c.hidden_dropout)(h, deterministic=deterministic)


class Attention(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, x, mask: attention.AttentionMask, deterministic: bool):
        c = self.config
        heads = (c.num_heads, c.head_dim)
        dot_general = matmul.encoder_dot_general(c.matmul_accumulation)
        q = dense(c, heads, ("embed", "heads", "kv"), "query", dot_general=dot_general)(x)
        k = dense(c, heads, ("embed", "heads", "kv"), "key", dot_general=dot_general)(x)
        v = dense(c, heads, ("embed", "heads", "kv"), "value", dot_general=dot_general)(x)
        dropout = nn.Dropout(c.attention_dropout)
        out = attention.attend(
            c, q, k, v, mask, dropout=lambda w: dropout(w, deterministic=deterministic)
        )
        out = dense(
            c,
            c.hidden_size,
            ("heads", "kv", "embed"),
            "output",
            axis=(-2, -1),
            dot_general=dot_general,
        )(out)
        return nn.Dropout(c.hidden_dropout)(out, deterministic=deterministic)


class Mlp(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, x, deterministic: bool, token_mask=None):
        """Given a token mask, sows the standardization loss of the pre-activations (the
        intermediate output before GELU)."""
        c = self.config
        dot_general = matmul.encoder_dot_general(c.matmul_accumulation)
        x = dense(
            c, c.intermediate_size, ("embed", "mlp"), "intermediate", dot_general=dot_general
        )(x)
        if token_mask is not None:
            self.sow(
                "losses", "standardization", standardization.standardization_loss(x, token_mask)
            )
        x = nn.gelu(x, approximate=c.gelu_approximate)
        x = dense(c, c.hidden_size, ("mlp", "embed"), "output", dot_general=dot_general)(x)
        return nn.Dropout(c.hidden_dropout)(x, deterministic=deterministic)


class Layer(nn.Module):
    """One transformer block. `scale` multiplies each sub-layer's output (PLD's 1/p). Given
    a token mask, the standardization loss attaches at `standardization_site`: the norms'
    inputs ("residual") or the MLP's pre-activations ("preactivation")."""

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        h,
        attention_bias,
        scale,
        deterministic: bool,
        token_mask=None,
        standardization_site="residual",
    ):
        c = self.config
        norm_mask = token_mask if standardization_site == "residual" else None
        mlp_mask = token_mask if standardization_site == "preactivation" else None
        attention = Attention(c, name="attention")
        mlp = functools.partial(Mlp(c, name="mlp"), token_mask=mlp_mask)
        attention_norm = functools.partial(
            _normalize, _encoder_norm(c, "attention_layer_norm"), token_mask=norm_mask
        )
        mlp_norm = functools.partial(
            _normalize, _encoder_norm(c, "mlp_layer_norm"), token_mask=norm_mask
        )
        if c.layer_norm == "pre":  # normalise each sub-layer's input, never the residual
            h = h + scale * attention(attention_norm(h), attention_bias, deterministic)
            return h + scale * mlp(mlp_norm(h), deterministic)
        h = attention_norm(h + scale * attention(h, attention_bias, deterministic))
        return mlp_norm(h + scale * mlp(h, deterministic))


class Heads(nn.Module):
    """Pooler + NSP classifier, and the MLM head on the gathered masked positions.

    The NSP logits are [B, 2] from each row's first token, or, given `cls_positions`
    [B, M] (packed rows, lambjax.data.packing), [B * M, 2] from each example's [CLS].
    """

    config: BertConfig

    @nn.compact
    def __call__(self, h, masked_lm_positions, word_embeddings, cls_positions=None):
        c = self.config
        if cls_positions is None:
            first = h[:, 0]
        else:
            first = jnp.take_along_axis(h, cls_positions[..., None], axis=1)
            first = first.reshape(-1, h.shape[-1])
        pooled = jnp.tanh(dense(c, c.hidden_size, ("embed", "mlp"), "pooler")(first))
        nsp_logits = dense(c, 2, ("embed", "classes"), "nsp")(pooled)
        # Gather first: the MLM head runs on P masked positions, not all S tokens.
        x = jnp.take_along_axis(h, masked_lm_positions[..., None], axis=1)
        x = dense(c, c.hidden_size, ("embed", "mlp"), "mlm_transform")(x)
        x = nn.gelu(x, approximate=c.gelu_approximate)
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
    def __call__(self, h, token_mask=None):
        return _normalize(_encoder_norm(self.config, "layer_norm"), h, token_mask)


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


# ----------------------------------------------------------------------------------------
# Forward


def attention_bias(input_mask, example_ids=None) -> attention.AttentionMask:
    """Which keys each query attends to: every token (`input_mask` > 0) and no padded key,
    or, given `example_ids` (packed rows), the tokens of its own example
    (lambjax.models.attention.AttentionMask, which each attention form reads its own way)."""
    if example_ids is not None:
        return attention.AttentionMask(segment_ids=example_ids, packed=True)
    return attention.AttentionMask.from_input_mask(input_mask)


def run_layers(
    config: BertConfig,
    layers: dict,
    h,
    attention_bias,
    *,
    rng=None,
    keep=None,
    scale=None,
    first_index=0,
    token_mask=None,
    standardization_site="residual",
):
    """Runs a stack of encoder layers on hidden states `h` [B, S, H]: `lax.scan` over the
    stacked tree, or a Python loop with `config.scan_layers=False`; `jax.checkpoint` per
    layer with `config.remat`.

    Args:
      config: the model's BertConfig.
      layers: the parameters of the layers to run: stacked (every leaf's leading axis: the
        layers), e.g. a slice of `params["encoder"]["layers"]`, or, run unrolled only, a list
        of per-layer trees (`layer_layout.encoder_layers`).
      h: the hidden states entering the first of them.
      attention_bias: `attention_bias(input_mask)`.
      rng: the dropout key; layer i draws from fold_in(rng, first_index + i), so a slice of
        the stack run on its own draws what it draws inside the whole. None: no dropout.
      keep: optional [count] bools; a layer with False is skipped (`lax.cond`, its compute
        never runs). None: every layer runs.
      scale: optional [count] multipliers of each sub-layer's output (PLD's 1/p).
      first_index: the global index of the first layer (may be traced).
      token_mask: given (normalization 'none', in training), each layer sows the
        standardization loss of its tensors at `standardization_site`.
      standardization_site: "residual" (each AffineNorm's input) or "preactivation" (the
        MLP's intermediate output before GELU); lambjax.models.standardization.

    Returns:
      (the hidden states after the last layer, the layers' summed standardization losses;
      0 without a token mask).
    """
    deterministic = rng is None
    per_layer = isinstance(layers, list)
    if per_layer and config.scan_layers:
        raise ValueError(
            "run_layers: lax.scan runs a stacked tree; per-layer trees run with scan_layers=False"
        )
    count = len(layers) if per_layer else jax.tree.leaves(layers)[0].shape[0]
    indices = first_index + jnp.arange(count)  # first_index may be traced
    skip_dropped = keep is not None
    keep = jnp.ones((count,), bool) if keep is None else keep
    scale = jnp.ones((count,), jnp.float32) if scale is None else scale

    def apply_layer(h, xs):
        layer_params, index, keep_layer, scale_layer = xs
        rngs = {} if deterministic else {"dropout": jax.random.fold_in(rng, index)}

        def run(h):
            out, variables = Layer(config).apply(
                {"params": layer_params},
                h,
                attention_bias,
                scale_layer.astype(h.dtype),
                deterministic,
                token_mask,
                standardization_site,
                rngs=rngs,
                mutable=["losses"],
            )
            return out, standardization.sown_total(variables)

        def skip(h):
            return h, jnp.zeros((), jnp.float32)

        if skip_dropped:
            return jax.lax.cond(keep_layer, run, skip, h)
        return run(h)

    if config.remat:
        apply_layer = jax.checkpoint(apply_layer, prevent_cse=not config.scan_layers)
    xs = (layers, indices, keep, scale)
    if config.scan_layers:
        h, losses = jax.lax.scan(apply_layer, h, xs)
        return h, jnp.sum(losses)
    total = jnp.zeros((), jnp.float32)
    for i in range(count):
        # A per-layer tree is passed whole: its gradient is its own, not a slice's.
        layer = layers[i] if per_layer else jax.tree.map(lambda x, i=i: x[i], layers)
        h, loss = apply_layer(h, (layer, indices[i], keep[i], scale[i]))
        total = total + loss
    return h, total


def encoder_outputs_and_standardization_loss(
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
    standardization_loss: bool = False,
    standardization_site: str = "residual",
    positions=None,
    example_ids=None,
):
    """(Last hidden states [B, S, H] (after PreLN's final LayerNorm), the summed
    standardization loss over the unpadded tokens of every tensor at `standardization_site`
    (lambjax.models.standardization.SITES): each AffineNorm's input, or each layer's MLP
    pre-activations; 0 unless `standardization_loss` and the model has normalization='none').

    Packed rows (lambjax.data.packing) give each token's `positions` in its example and its
    `example_ids`; a token then attends only to its own example's tokens."""
    deterministic = dropout_rng is None
    if not deterministic:
        embeddings_rng, dropout_rng = jax.random.split(dropout_rng)
    rngs = {} if deterministic else {"dropout": embeddings_rng}
    token_mask = input_mask if standardization_loss and config.normalization == "none" else None
    # The embeddings' and PreLN's final norm: sites of the residual placement only.
    norm_mask = token_mask if standardization_site == "residual" else None
    h, variables = Embeddings(config).apply(
        {"params": params["embeddings"]},
        input_ids,
        segment_ids,
        deterministic,
        norm_mask,
        positions,
        rngs=rngs,
        mutable=["losses"],
    )
    total = standardization.sown_total(variables)
    bias = attention_bias(input_mask, example_ids)
    layers = layer_layout.encoder_layers(params["encoder"])
    n = num_frozen_layers
    if not 0 <= n <= config.num_layers:
        raise ValueError(f"num_frozen_layers={n} must lie in [0, {config.num_layers}]")

    def part(x, lo, hi):
        return None if x is None else x[lo:hi]

    if n:
        frozen = jax.lax.stop_gradient(layer_layout.cut_layers(layers, 0, n))
        h, loss = run_layers(
            config,
            frozen,
            jax.lax.stop_gradient(h),
            bias,
            rng=dropout_rng,
            keep=part(layer_keep, 0, n),
            scale=part(layer_scale, 0, n),
            first_index=0,
            token_mask=token_mask,
            standardization_site=standardization_site,
        )
        h, total = jax.lax.stop_gradient(h), total + loss
    if n < config.num_layers:
        top = layer_layout.cut_layers(layers, n, None)
        h, loss = run_layers(
            config,
            top,
            h,
            bias,
            rng=dropout_rng,
            keep=part(layer_keep, n, None),
            scale=part(layer_scale, n, None),
            first_index=n,
            token_mask=token_mask,
            standardization_site=standardization_site,
        )
        total = total + loss
    if config.layer_norm == "pre":
        h, variables = FinalNorm(config).apply(
            {"params": params["encoder"]["final_layer_norm"]}, h, norm_mask, mutable=["losses"]
        )
        total = total + standardization.sown_total(variables)
    return h, total


def encoder_outputs(config: BertConfig, params: dict, input_ids, segment_ids, input_mask, **kwargs):
    """Last hidden states [B, S, H] (after PreLN's final LayerNorm); the keyword arguments of
    `encoder_outputs_and_standardization_loss` but its last."""
    return encoder_outputs_and_standardization_loss(
        config, params, input_ids, segment_ids, input_mask, **kwargs
    )[0]


def encode(config: BertConfig, params: dict, input_ids, segment_ids, input_mask):
    """The last hidden states, deterministically: for use outside training."""
    return encoder_outputs(config, params, input_ids, segment_ids, input_mask)
