"""Task heads on the BERT encoder: a span head (SQuAD) and a sequence classifier (GLUE).

A fine-tuning model's parameters are the encoder's (`embeddings`, `encoder`, as in
lambjax.models.params) and the head's under `heads`:

  span:        heads/qa_outputs/{kernel [H, 2], bias [2]}      start and end logits per token
  classifier:  heads/pooler/{kernel, bias}                     tanh(W h[CLS] + b), as pretrained
               heads/classifier/{kernel [H, N], bias [N]}       N labels (1: regression)

These are the layouts of transformers' BertForQuestionAnswering and
BertForSequenceClassification (lambjax.models.hf converts both ways). Every parameter carries
logical axis names, so a head is sharded by the same rules table as the encoder.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from lambjax.models import params as bert_params
from lambjax.models.bert import dense
from lambjax.models.config import BertConfig
from lambjax.models.encoder import encoder_outputs

KINDS = ("span", "classifier")


class SpanHead(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, h, deterministic: bool = True):
        logits = dense(self.config, 2, ("embed", "classes"), "qa_outputs")(h)
        logits = logits.astype(jnp.float32)
        return logits[..., 0], logits[..., 1]  # [B, S] start, [B, S] end


class ClassifierHead(nn.Module):
    config: BertConfig
    num_labels: int

    @nn.compact
    def __call__(self, h, deterministic: bool = True):
        c = self.config
        pooled = jnp.tanh(dense(c, c.hidden_size, ("embed", "mlp"), "pooler")(h[:, 0]))
        pooled = nn.Dropout(c.hidden_dropout)(pooled, deterministic=deterministic)
        logits = dense(c, self.num_labels, ("embed", "classes"), "classifier")(pooled)
        return logits.astype(jnp.float32)  # [B, N]


def head_module(config: BertConfig, kind: str, num_labels: int = 2) -> nn.Module:
    if kind == "span":
        return SpanHead(config)
    if kind == "classifier":
        if num_labels < 1:
            raise ValueError(f"num_labels={num_labels} must be >= 1 (1: regression)")
        return ClassifierHead(config, num_labels)
    raise ValueError(f"head kind {kind!r}; valid: {KINDS}")


def _boxed_head(config, kind, num_labels, rng):
    h = jnp.zeros((1, 4, config.hidden_size), config.dtype)
    return head_module(config, kind, num_labels).init(rng, h)["params"]


def init_head(config: BertConfig, kind: str, num_labels: int, rng: jax.Array) -> dict:
    """A freshly initialised head (BERT's truncated normal, zero biases)."""
    return nn.meta.unbox(_boxed_head(config, kind, num_labels, rng))


def init_params(config: BertConfig, kind: str, num_labels: int, rng: jax.Array) -> dict:
    """Random encoder and head (fine-tuning from scratch)."""
    encoder_rng, head_rng = jax.random.split(rng)
    params = bert_params.init_params(config, encoder_rng)
    return with_head(params, init_head(config, kind, num_labels, head_rng))


def with_head(encoder_params: dict, head: dict) -> dict:
    """The encoder's `embeddings` and `encoder` (any pretraining heads dropped) + `head`."""
    return {
        "embeddings": encoder_params["embeddings"],
        "encoder": encoder_params["encoder"],
        "heads": head,
    }


def param_logical_axes(config: BertConfig, kind: str, num_labels: int) -> dict:
    """Logical axis names of every parameter of encoder + head (no real init)."""
    encoder_axes = bert_params.param_logical_axes(config)
    boxed = jax.eval_shape(
        functools.partial(_boxed_head, config, kind, num_labels), jax.random.key(0)
    )
    return with_head(encoder_axes, nn.get_partition_spec(boxed))


def apply(
    config: BertConfig,
    kind: str,
    num_labels: int,
    params: dict,
    batch: dict,
    *,
    dropout_rng=None,
):
    """The head's outputs on `batch` (input_ids, segment_ids, input_mask): (start, end)
    logits [B, S] for `span`, logits [B, N] for `classifier`. Dropout iff `dropout_rng`."""
    deterministic = dropout_rng is None
    if not deterministic:
        dropout_rng, head_rng = jax.random.split(dropout_rng)
    h, _ = encoder_outputs(
        config,
        params,
        batch["input_ids"],
        batch["segment_ids"],
        batch["input_mask"],
        dropout_rng=dropout_rng,
    )
    rngs = {} if deterministic else {"dropout": head_rng}
    return head_module(config, kind, num_labels).apply(
        {"params": params["heads"]}, h, deterministic, rngs=rngs
    )
