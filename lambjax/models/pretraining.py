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

from lambjax.models.bert import Heads
from lambjax.models.config import BertConfig
from lambjax.models.encoder import LayerOptions, encoder_outputs


def _vocab_major_logits(config: BertConfig, params: dict, batch: dict, dropout_rng, options):
    """(MLM logits [V, B * P] at the masked positions, NSP logits [B, 2], or [B * M, 2]
    for packed rows), float32, and the encoder's standardization loss."""
    h, standardization_loss = encoder_outputs(
        config,
        params,
        batch["input_ids"],
        batch["segment_ids"],
        batch["input_mask"],
        dropout_rng=dropout_rng,
        options=options,
        positions=batch.get("positions"),
        example_ids=batch.get("example_ids"),
    )
    logits = Heads(config).apply(
        {"params": params["heads"]},
        h,
        batch["masked_lm_positions"],
        params["embeddings"]["word"]["embedding"],
        batch.get("cls_positions"),
    )
    return logits, standardization_loss


def pretraining_logits(config: BertConfig, params: dict, batch: dict):
    """(MLM logits [B, P, V] at the masked positions, NSP logits [B, 2], or [B * M, 2] for
    packed rows), float32, without dropout."""
    (mlm_logits, nsp_logits), _ = _vocab_major_logits(config, params, batch, None, LayerOptions())
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
    options: LayerOptions | None = None,
) -> dict[str, Any]:
    """Sums (not means) of the MLM and NSP losses and hits over the batch, float32.

    Sums let a caller add micro-batches up exactly and normalise by global counts. Dropout
    iff `dropout_rng`; `options`: the training methods' settings of the layer stack (None:
    plain BERT). With a `standardization_site` in them, also the encoder's standardization
    loss of this batch (`standardization_loss`, lambjax.models.standardization; 0 unless the
    model has normalization 'none').
    """
    options = options or LayerOptions()
    (mlm_logits, nsp_logits), std_loss = _vocab_major_logits(
        config, params, batch, dropout_rng, options
    )
    stats = {} if options.standardization_site is None else {"standardization_loss": std_loss}
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
