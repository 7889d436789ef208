"""The encoder's forward: the embeddings, the layer stack, PreLN's final norm.

The layers are stored stacked and run with `lax.scan` (compile time independent of depth) or,
with `scan_layers=False`, a Python loop. The loop also runs the layers held one tree per
layer, `encoder/layers_0 ... layers_{L-1}` (lambjax.models.layer_layout): an unrolled train
step then differentiates each layer's own tree and never assembles a stacked gradient
(lambjax.train.layout).

What a training method changes in the layer stack reaches it as one value, `LayerOptions`:
which layers a micro-batch runs and their output scale (progressive layer dropping), the
bottom layers that run without gradient (multi-stage layerwise training), where the
standardization loss attaches, and the matmuls. Its defaults are plain BERT.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lambjax.models import attention, layer_layout, standardization
from lambjax.models.bert import Embeddings, FinalNorm, Layer
from lambjax.models.config import BertConfig


@dataclasses.dataclass(frozen=True)
class LayerOptions:
    """What training methods change in the layer stack; the defaults are plain BERT."""

    # [L] bools, progressive layer dropping: the layers this micro-batch runs (a dropped
    # layer is skipped with `lax.cond`, its compute never runs). None: every layer.
    keep: jax.Array | None = None
    # [L] multipliers of each layer's sub-layer outputs (PLD's 1/p). None: 1.
    scale: jax.Array | None = None
    # Multi-stage layerwise training: the bottom layers that run without gradient.
    num_frozen_layers: int = 0
    # Where the standardization loss attaches (lambjax.models.standardization.SITES):
    # "residual" (each AffineNorm's input) or "preactivation" (the MLP's intermediate output
    # before GELU); None: off. It is computed only for a model with normalization 'none'.
    standardization_site: str | None = None
    # The encoder layers' matmuls, e.g. a training method's emulated arithmetic: the Dense
    # layers' (Attention's and the MLP's; None: `matmul.dense_dot_general`) and the einsum
    # attention's two contractions (`einsum(spec, x, y)`; None: `jnp.einsum`; the fused
    # attention kernels refuse one). The embeddings and the heads keep the platform's dot.
    dot_general: Callable | None = None
    attention_einsum: Callable | None = None

    def layers(self, lo: int, hi: int | None) -> "LayerOptions":
        """These options for the layers lo, ..., hi - 1 of the stack (keep and scale cut)."""

        def cut(x):
            return None if x is None else x[lo:hi]

        return dataclasses.replace(self, keep=cut(self.keep), scale=cut(self.scale))


class EncoderOutputs(NamedTuple):
    hidden_states: jax.Array  # [B, S, H], after PreLN's final norm
    # The summed standardization loss over the unpadded tokens of every tensor at the
    # options' site; 0 when it is off or the model has LayerNorms.
    standardization_loss: jax.Array


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
    options: LayerOptions = LayerOptions(),
    first_index=0,
    token_mask=None,
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
      options: keep and scale, one entry per layer run here; the first
        `num_frozen_layers` of them run without gradient (their input, parameters and
        output cut off).
      first_index: the global index of the first layer (may be traced).
      token_mask: given (normalization 'none', in training), each layer sows the
        standardization loss of its tensors at `options.standardization_site`.

    Returns:
      (the hidden states after the last layer, the layers' summed standardization losses;
      0 without a token mask).
    """
    count = len(layers) if isinstance(layers, list) else jax.tree.leaves(layers)[0].shape[0]
    n = options.num_frozen_layers
    if not 0 <= n <= count:
        raise ValueError(f"num_frozen_layers={n} must lie in [0, {count}]")
    total = jnp.zeros((), jnp.float32)
    if n:
        frozen = jax.lax.stop_gradient(layer_layout.cut_layers(layers, 0, n))
        h, loss = _run_block(
            config,
            frozen,
            jax.lax.stop_gradient(h),
            attention_bias,
            rng,
            options.layers(0, n),
            first_index,
            token_mask,
        )
        h, total = jax.lax.stop_gradient(h), total + loss
    if n < count:
        top = layer_layout.cut_layers(layers, n, None)
        h, loss = _run_block(
            config,
            top,
            h,
            attention_bias,
            rng,
            options.layers(n, None),
            first_index + n,
            token_mask,
        )
        total = total + loss
    return h, total


def _run_block(config, layers, h, attention_bias, rng, options, first_index, token_mask):
    """`run_layers` on layers that all take gradients."""
    deterministic = rng is None
    per_layer = isinstance(layers, list)
    if per_layer and config.scan_layers:
        raise ValueError(
            "run_layers: lax.scan runs a stacked tree; per-layer trees run with scan_layers=False"
        )
    count = len(layers) if per_layer else jax.tree.leaves(layers)[0].shape[0]
    indices = first_index + jnp.arange(count)  # first_index may be traced
    skip_dropped = options.keep is not None
    keep = jnp.ones((count,), bool) if options.keep is None else options.keep
    scale = jnp.ones((count,), jnp.float32) if options.scale is None else options.scale
    layer = Layer(
        config, options.standardization_site, options.dot_general, options.attention_einsum
    )

    def apply_layer(h, xs):
        layer_params, index, keep_layer, scale_layer = xs
        rngs = {} if deterministic else {"dropout": jax.random.fold_in(rng, index)}

        def run(h):
            out, variables = layer.apply(
                {"params": layer_params},
                h,
                attention_bias,
                scale_layer.astype(h.dtype),
                deterministic,
                token_mask,
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
        layer_params = layers[i] if per_layer else jax.tree.map(lambda x, i=i: x[i], layers)
        h, loss = apply_layer(h, (layer_params, indices[i], keep[i], scale[i]))
        total = total + loss
    return h, total


def encoder_outputs(
    config: BertConfig,
    params: dict,
    input_ids,
    segment_ids,
    input_mask,
    *,
    dropout_rng=None,
    options: LayerOptions = LayerOptions(),
    positions=None,
    example_ids=None,
) -> EncoderOutputs:
    """The encoder's last hidden states and standardization loss (`EncoderOutputs`).

    Dropout iff `dropout_rng`. Packed rows (lambjax.data.packing) give each token's
    `positions` in its example and its `example_ids`; a token then attends only to its own
    example's tokens.
    """
    deterministic = dropout_rng is None
    if not deterministic:
        embeddings_rng, dropout_rng = jax.random.split(dropout_rng)
    rngs = {} if deterministic else {"dropout": embeddings_rng}
    site = options.standardization_site
    token_mask = input_mask if site is not None and config.normalization == "none" else None
    # The embeddings' and PreLN's final norm: sites of the residual placement only.
    norm_mask = token_mask if site == "residual" else None
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
    layers = layer_layout.encoder_layers(params["encoder"])
    bias = attention_bias(input_mask, example_ids)
    h, loss = run_layers(
        config, layers, h, bias, rng=dropout_rng, options=options, token_mask=token_mask
    )
    total = total + loss
    if config.layer_norm == "pre":
        h, variables = FinalNorm(config).apply(
            {"params": params["encoder"]["final_layer_norm"]}, h, norm_mask, mutable=["losses"]
        )
        total = total + standardization.sown_total(variables)
    return EncoderOutputs(h, total)


def encode(config: BertConfig, params: dict, input_ids, segment_ids, input_mask):
    """The last hidden states [B, S, H], deterministically: for use outside training."""
    return encoder_outputs(config, params, input_ids, segment_ids, input_mask).hidden_states
