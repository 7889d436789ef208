"""BERT's Flax modules, PostLN or PreLN: embeddings, attention, MLP, layer, heads, final norm.

Parameters are a plain pytree (lambjax.models.params builds it and its logical axes):

  embeddings/{word, position, token_type}/embedding, embeddings/layer_norm/{scale, bias}
  encoder/layers/...           every leaf stacked: leading axis = num_layers
  encoder/final_layer_norm     PreLN only
  heads/{pooler, mlm_transform, mlm_layer_norm, mlm_bias, nsp}

Every parameter carries logical axis names (lambjax.sharding maps them). The forward that
runs these modules is lambjax.models.encoder; the pretraining losses on top of it are in
lambjax.models.pretraining.
"""

from collections.abc import Callable

import flax.linen as nn
import jax.numpy as jnp

from lambjax.models import attention, matmul, standardization
from lambjax.models.config import BertConfig


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
      dot_general: the matmul (lambjax.models.matmul), e.g. a training method's emulation.
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
            # scatter-add (in bfloat16 it is a compare-and-swap loop on GPUs, a large part
            # of a step: docs/performance.md), and no bfloat16 copy of the table is made.
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
    dot_general: Callable | None = None  # None: matmul.dense_dot_general
    # The two attention contractions (lambjax.models.attention.xla_attention); None: jnp.einsum.
    attention_einsum: Callable | None = None

    @nn.compact
    def __call__(self, x, mask: attention.AttentionMask, deterministic: bool):
        c = self.config
        heads = (c.num_heads, c.head_dim)
        dot_general = self.dot_general or matmul.dense_dot_general
        q = dense(c, heads, ("embed", "heads", "kv"), "query", dot_general=dot_general)(x)
        k = dense(c, heads, ("embed", "heads", "kv"), "key", dot_general=dot_general)(x)
        v = dense(c, heads, ("embed", "heads", "kv"), "value", dot_general=dot_general)(x)
        dropout = nn.Dropout(c.attention_dropout)
        out = attention.attend(
            c,
            q,
            k,
            v,
            mask,
            dropout=lambda w: dropout(w, deterministic=deterministic),
            einsum=self.attention_einsum,
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
    dot_general: Callable | None = None  # None: matmul.dense_dot_general

    @nn.compact
    def __call__(self, x, deterministic: bool, token_mask=None):
        """Given a token mask, sows the standardization loss of the pre-activations (the
        intermediate output before GELU)."""
        c = self.config
        dot_general = self.dot_general or matmul.dense_dot_general
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
    inputs ("residual") or the MLP's pre-activations ("preactivation"); None: nowhere. The
    fields are lambjax.models.encoder.LayerOptions' that every layer shares."""

    config: BertConfig
    standardization_site: str | None = None
    dot_general: Callable | None = None  # None: matmul.dense_dot_general
    attention_einsum: Callable | None = None  # None: jnp.einsum

    @nn.compact
    def __call__(self, h, attention_bias, scale, deterministic: bool, token_mask=None):
        c = self.config
        site = self.standardization_site
        norm_mask = token_mask if site == "residual" else None
        mlp_mask = token_mask if site == "preactivation" else None
        self_attention = Attention(c, self.dot_general, self.attention_einsum, name="attention")
        mlp = Mlp(c, self.dot_general, name="mlp")
        attention_norm = _encoder_norm(c, "attention_layer_norm")
        mlp_norm = _encoder_norm(c, "mlp_layer_norm")

        def attend(x):
            return scale * self_attention(x, attention_bias, deterministic)

        def feed_forward(x):
            return scale * mlp(x, deterministic, mlp_mask)

        if c.layer_norm == "pre":  # normalise each sub-layer's input, never the residual
            h = h + attend(_normalize(attention_norm, h, norm_mask))
            return h + feed_forward(_normalize(mlp_norm, h, norm_mask))
        h = _normalize(attention_norm, h + attend(h), norm_mask)
        return _normalize(mlp_norm, h + feed_forward(h), norm_mask)


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
