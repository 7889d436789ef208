"""BERT's pretraining objectives on top of the encoder: masked LM and next-sentence loss.

`pretraining_stats` returns sums (not means) over a batch, so a caller can add
micro-batches up exactly and normalise by counts over the global batch
(lambjax.train.step). A batch of packed rows (lambjax.data.packing) gives the same sums
as its examples unpacked: the MLM terms are per token, the NSP terms per example (its
`nsp_weights` leave the empty slots out).
"""

from typing import Any

import jax
import jax.numpy as jnp

from lambjax.models import bert
from lambjax.models.bert import BertConfig


def _vocab_major_logits_and_standardization_loss(
    config: BertConfig, params: dict, batch: dict, **encoder_kwargs
):
    """(MLM logits [V, B * P] at the masked positions, NSP logits [B, 2], or [B * M, 2]
    for packed rows), float32, and the encoder's standardization loss
    (bert.encoder_outputs_and_standardization_loss)."""
    h, standardization_loss = bert.encoder_outputs_and_standardization_loss(
        config,
        params,
        batch["input_ids"],
        batch["segment_ids"],
        batch["input_mask"],
        positions=batch.get("positions"),
        example_ids=batch.get("example_ids"),
        **encoder_kwargs,
    )
    logits = bert.Heads(config).apply(
        {"params": params["heads"]},
        h,
        batch["masked_lm_positions"],
        params["embeddings"]["word"]["embedding"],
        batch.get("cls_positions"),
    )
    return logits, standardization_loss


def _vocab_major_logits(config: BertConfig, params: dict, batch: dict, **encoder_kwargs):
    """(MLM logits [V, B * P] at the masked positions, NSP logits [B, 2]), float32."""
    return _vocab_major_logits_and_standardization_loss(config, params, batch, **encoder_kwargs)[0]


def pretraining_logits(config: BertConfig, params: dict, batch: dict, **encoder_kwargs):
    """(MLM logits [B, P, V] at the masked positions, NSP logits [B, 2], or [B * M, 2] for
    packed rows), float32."""
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
    standardization_loss: bool = False,
    standardization_site: str = "residual",
) -> dict[str, Any]:
    """Sums (not means) of the MLM and NSP losses and hits over the batch, float32.

    Sums let a caller add micro-batches up exactly and normalise by global counts. With
    `standardization_loss`, also the encoder's standardization loss of this batch at
    `standardization_site` (`standardization_loss`, lambjax.models.standardization; a model
    with normalization 'none' only).
    """
    (mlm_logits, nsp_logits), std_loss = _vocab_major_logits_and_standardization_loss(
        config,
        params,
        batch,
        dropout_rng=dropout_rng,
        layer_keep=layer_keep,
        layer_scale=layer_scale,
        num_frozen_layers=num_frozen_layers,
        standardization_loss=standardization_loss,
        standardization_site=standardization_site,
    )
    stats = {} if not standardization_loss else {"standardization_loss": std_loss}
    return stats | stats_from_logits(mlm_logits, nsp_logits, batch)


def stats_from_logits(mlm_logits, nsp_logits, batch: dict) -> dict[str, Any]:
    """`pretraining_stats` from the heads' outputs: vocabulary-major MLM logits [V, B * P]
    and NSP logits [B, 2] (packed rows: [B * M, 2], weighted by `nsp_weights`)."""
    weights = batch["masked_lm_weights"].astype(jnp.float32).reshape(-1)
    mlm_nll, mlm_hits = _cross_entropy(mlm_logits, batch["masked_lm_ids"].reshape(-1), axis=0)
    nsp_nll, nsp_hits = _cross_entropy(
        nsp_logits, batch["next_sentence_labels"].reshape(-1), axis=-1
    )
    nsp_weights = nsp_example_weights(batch).reshape(-1)
    return {
        "mlm_loss_sum": jnp.sum(mlm_nll * weights),
        "mlm_weight_sum": jnp.sum(weights),
        "mlm_correct_sum": jnp.sum(mlm_hits * weights),
        "nsp_loss_sum": jnp.sum(nsp_nll * nsp_weights),
        "nsp_correct_sum": jnp.sum(nsp_hits * nsp_weights),
        "nsp_count": jnp.sum(nsp_weights),
    }


def nsp_example_weights(batch: dict) -> jax.Array:
    """1 per example of `batch` (each row, or each filled slot of a packed row), float32."""
    if "nsp_weights" in batch:
        return batch["nsp_weights"].astype(jnp.float32)
    return jnp.ones(batch["next_sentence_labels"].shape, jnp.float32)
