"""BERT split into K modules on K - 1 stages (Ouroboros), and what each stage computes.

The L encoder layers go to S = K - 1 stages of L / S layers each (`Split`). Stage 0 holds
module 1 (the embeddings and the first `Split.first` layers) and module K (the last
`Split.last` layers, PreLN's final LayerNorm, the MLM and NSP heads and the tied word
embedding); stage s >= 1 holds module s + 1. Stage 0 stores module K's layers first
(`stage_order`), so every stage's share of the stacked layers is one contiguous block that
the mesh axis `stage` splits evenly.

The functions below are one stage's computations on one micro-batch, as functions of that
stage's parameters, its inputs and a dropout key, under a `StageModel`. They draw the keys of
the unsplit model (lambjax.models.encoder: split(key) -> (embeddings, layers), layer i
fold_in(layers key, i)), so the modules chained reproduce the model's own forward:

  first_module     the embeddings and module 1's layers
  middle_module    the layers of stage s >= 1
  top_gradients    module K's layers, the heads and the loss, and their gradient
  replay_first, replay_middle
                   a module's forward again, its output gradient pulled back through it

When each stage runs, on which batch and with which weights is the training step's
(lambjax.contrib.ouroboros.delayed).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lambjax.models import bert, encoder, pretraining
from lambjax.models.config import BertConfig


@dataclasses.dataclass(frozen=True)
class Split:
    """K modules of an L-layer encoder on S = K - 1 stages of L / S layers each."""

    num_modules: int  # K >= 2
    num_layers: int  # L, a multiple of K - 1

    def __post_init__(self):
        k, n = self.num_modules, self.num_layers
        if not isinstance(k, int) or k < 2:
            raise ValueError(f"num_modules={k!r} must be an integer >= 2")
        if n % (k - 1):
            raise ValueError(
                f"{k} modules take {k - 1} stages of equal depth, which {n} layers do not "
                f"fill; valid num_modules: {valid_module_counts(n)}"
            )

    @property
    def stages(self) -> int:
        return self.num_modules - 1

    @property
    def per_stage(self) -> int:
        return self.num_layers // self.stages

    @property
    def first(self) -> int:
        """Layers of module 1 (on stage 0, below module K's)."""
        return (self.per_stage + 1) // 2

    @property
    def last(self) -> int:
        """Layers of module K (on stage 0)."""
        return self.per_stage - self.first

    def first_layer_of_stage(self, stage: int) -> int:
        """The model's index of the first layer of stage `stage` >= 1."""
        return self.first + (stage - 1) * self.per_stage

    def module_of_layer(self, index: int) -> int:
        if index < self.first:
            return 1
        if index >= self.num_layers - self.last:
            return self.num_modules
        return 2 + (index - self.first) // self.per_stage

    def layer_delays(self) -> np.ndarray:
        """[L]: K - k for each layer's module k."""
        return np.array(
            [self.num_modules - self.module_of_layer(i) for i in range(self.num_layers)],
            np.int32,
        )


def valid_module_counts(num_layers: int) -> list[int]:
    """The numbers of modules that split `num_layers` layers (1: one module, no stages)."""
    return [1] + [s + 1 for s in range(1, num_layers + 1) if num_layers % s == 0]


def check(num_modules: int, num_layers: int) -> None:
    """Raises ValueError where K modules cannot split `num_layers` layers (K = 1: off)."""
    if num_modules != 1:
        Split(num_modules, num_layers)


# ----------------------------------------------------------------------------------------
# The layers' layout on the stages


def stage_order(split: Split, layers, axis: int = 0):
    """The stacked layers in stage order: module K's last layers moved to the front, so
    stage 0's block holds them, then module 1's."""
    if not split.last:
        return layers
    return jax.tree.map(lambda x: jnp.roll(x, split.last, axis=axis), layers)


def model_order(split: Split, layers):
    """The inverse of `stage_order` (axis 0)."""
    if not split.last:
        return layers
    return jax.tree.map(lambda x: jnp.roll(x, -split.last, axis=0), layers)


def _block(layers, lo: int, hi: int):
    return jax.tree.map(lambda x: x[lo:hi], layers)


def first_module_layers(split: Split, layers):
    """Module 1's layers among stage 0's (in stage order)."""
    return _block(layers, split.last, split.per_stage)


def top_module_layers(split: Split, layers):
    """Module K's layers among stage 0's (in stage order)."""
    return _block(layers, 0, split.last)


def pad_block(split: Split, grads, lo: int):
    """The gradient of a stage's layers lo, lo + 1, ..., spread over all of its layers
    (zeros elsewhere)."""
    return jax.tree.map(
        lambda g: jnp.pad(g, [(lo, split.per_stage - lo - g.shape[0])] + [(0, 0)] * (g.ndim - 1)),
        grads,
    )


# ----------------------------------------------------------------------------------------
# A stage's computations


@dataclasses.dataclass(frozen=True)
class StageModel:
    """The model of the stages: BERT's configuration, its split, the NSP loss' weight."""

    config: BertConfig
    split: Split
    nsp_loss_weight: float = 1.0


def _run_layers(config: BertConfig, layers, h, input_mask, rng, first_index):
    """The model's layer loop on a block of layers, layer i's key fold_in(rng, global i)."""
    h, _ = encoder.run_layers(
        config, layers, h, encoder.attention_bias(input_mask), rng=rng, first_index=first_index
    )
    return h


def first_module(model: StageModel, embeddings, layers, tokens: dict, rng):
    """Module 1's output [B, T, H]: the embeddings and `layers` (module 1's) on `tokens`
    (input_ids, segment_ids, input_mask); the key split as the model splits it."""
    embeddings_rng, layers_rng = jax.random.split(rng)
    h = bert.Embeddings(model.config).apply(
        {"params": embeddings},
        tokens["input_ids"],
        tokens["segment_ids"],
        False,
        rngs={"dropout": embeddings_rng},
    )
    return _run_layers(model.config, layers, h, tokens["input_mask"], layers_rng, 0)


def middle_module(model: StageModel, stage: int, layers, h, input_mask, rng):
    """The output of stage `stage` >= 1's layers on its input `h`."""
    first_index = model.split.first_layer_of_stage(stage)
    return _run_layers(model.config, layers, h, input_mask, jax.random.split(rng)[1], first_index)


def _top_loss(model: StageModel, totals, layers, heads, final, word, h, microbatch, rng):
    """(Module K's loss on `microbatch`, its statistics): the last layers, PreLN's final
    LayerNorm, the heads. `totals` = (MLM weight, NSP count) of the global batch."""
    config, split = model.config, model.split
    if split.last:
        first_index = split.num_layers - split.last
        h = _run_layers(
            config, layers, h, microbatch["input_mask"], jax.random.split(rng)[1], first_index
        )
    if config.layer_norm == "pre":
        h = bert.FinalNorm(config).apply({"params": final}, h)
    logits = bert.Heads(config).apply({"params": heads}, h, microbatch["masked_lm_positions"], word)
    stats = pretraining.stats_from_logits(*logits, microbatch)
    mlm_total, nsp_total = totals
    loss = stats["mlm_loss_sum"] / mlm_total + model.nsp_loss_weight * (
        stats["nsp_loss_sum"] / nsp_total
    )
    return loss, stats


def top_gradients(model: StageModel, params: dict, h, microbatch: dict, rng, totals):
    """Module K on stage 0, forward and backward: (the loss statistics of `microbatch`,
    the gradients of (its layers, heads, final LayerNorm, word embedding as the output
    projection, its input `h`)). `params` is stage 0's (embeddings, layers in stage order,
    heads, final); `totals` = (MLM weight, NSP count) of the global batch."""

    def loss(layers, heads, final, word, h):
        return _top_loss(model, totals, layers, heads, final, word, h, microbatch, rng)

    word = params["embeddings"]["word"]["embedding"]
    layers = top_module_layers(model.split, params["layers"])
    primals = (layers, params["heads"], params["final"], word, h)
    value, vjp, stats = jax.vjp(loss, *primals, has_aux=True)
    return stats, vjp(jnp.ones_like(value))


def replay_first(model: StageModel, embeddings, layers, tokens: dict, rng, output_grad):
    """Module 1 replayed: (the gradient of the embeddings, that of stage 0's layers, zero on
    module K's) of <module 1's output, `output_grad`>. `layers` are stage 0's in stage
    order, `tokens` and `rng` those of the replayed batch."""
    split = model.split

    def forward(embeddings, layers):
        return first_module(model, embeddings, layers, tokens, rng)

    _, vjp = jax.vjp(forward, embeddings, first_module_layers(split, layers))
    g_embeddings, g_layers = vjp(output_grad)
    return g_embeddings, pad_block(split, g_layers, split.last)


def replay_middle(model: StageModel, stage: int, layers, h, input_mask, rng, output_grad):
    """Stage `stage` >= 1's module replayed from its stored input `h`: (the gradient of its
    layers, that of `h`) of <its output, `output_grad`>."""

    def forward(layers, h):
        return middle_module(model, stage, layers, h, input_mask, rng)

    _, vjp = jax.vjp(forward, layers, h)
    return vjp(output_grad)
