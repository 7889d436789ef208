"""Dynamic masking: a pure, vectorised function of (seed, epoch, example index).

For each example, round(masked_lm_prob * length) tokens (at least 1, at most
max_predictions_per_seq) are chosen among those that are not [CLS], [SEP] or padding; of
those, 80% become [MASK], 10% a random non-special token and 10% stay unchanged. With whole
word masking, the pieces of a word ("##" continuations) are chosen together.

The random numbers come from a counter-based hash (SplitMix64) of (seed, epoch, example
index, position), so any example's mask is reproducible on any host in any order.
"""

import dataclasses

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclasses.dataclass(frozen=True)
class MaskingOptions:
    vocab_size: int
    mask_id: int
    special_ids: tuple[int, ...]  # never masked, never drawn as random replacements
    max_predictions_per_seq: int
    masked_lm_prob: float = 0.15
    continuation_ids: tuple[int, ...] = ()  # "##" pieces, for whole word masking
    whole_word_masking: bool = False


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _uniform(seed: int, epoch: np.ndarray, index: np.ndarray, width: int, stream: int):
    """[b, width] floats in [0, 1), a pure function of its arguments."""
    with np.errstate(over="ignore"):
        row = _mix(
            np.uint64(seed) * _GOLDEN
            ^ _mix(epoch.astype(np.uint64) + np.uint64(stream) * _GOLDEN)
            ^ _mix(index.astype(np.uint64) * np.uint64(0xD1B54A32D192ED03))
        )
        cells = row[:, None] + np.arange(width, dtype=np.uint64)[None] * _GOLDEN
        bits = _mix(cells)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def mask_batch(
    input_ids: np.ndarray,
    lengths: np.ndarray,
    epoch: np.ndarray,
    index: np.ndarray,
    seed: int,
    options: MaskingOptions,
) -> dict[str, np.ndarray]:
    """Masks a padded batch [b, S] in place of a copy; returns the masked features."""
    batch, seq = input_ids.shape
    max_pred = options.max_predictions_per_seq
    positions = np.arange(seq)[None]
    special = np.isin(input_ids, np.asarray(options.special_ids))
    candidate = (positions < lengths[:, None]) & ~special
    num_to_predict = np.clip(np.rint(lengths * options.masked_lm_prob), 1, max_pred)
    num_to_predict = np.minimum(num_to_predict, candidate.sum(1)).astype(np.int64)

    score = _uniform(seed, epoch, index, seq, stream=1)
    if options.whole_word_masking:
        chosen = _choose_whole_words(input_ids, candidate, score, num_to_predict, options)
    else:
        score = np.where(candidate, score, 2.0)
        order = np.argsort(score, axis=1, kind="stable")[:, :max_pred]
        keep = np.arange(max_pred)[None] < num_to_predict[:, None]
        chosen = np.where(keep, order, seq)  # seq = "no position", sorts last
    chosen = np.sort(chosen, axis=1)[:, :max_pred]
    weights = (chosen < seq).astype(np.float32)
    masked_positions = np.where(chosen < seq, chosen, 0).astype(np.int32)

    rows = np.arange(batch)[:, None]
    original = input_ids[rows, masked_positions]
    action = _uniform(seed, epoch, index, max_pred, stream=2)
    replaceable = np.setdiff1d(np.arange(options.vocab_size), np.asarray(options.special_ids))
    random_pick = _uniform(seed, epoch, index, max_pred, stream=3)
    random_tokens = replaceable[(random_pick * len(replaceable)).astype(np.int64)]
    new_tokens = np.where(
        action < 0.8, options.mask_id, np.where(action < 0.9, random_tokens, original)
    )
    masked = input_ids.copy()
    valid = weights > 0
    masked[np.broadcast_to(rows, chosen.shape)[valid], masked_positions[valid]] = new_tokens[valid]
    return {
        "input_ids": masked.astype(np.int32),
        "masked_lm_positions": masked_positions,
        "masked_lm_ids": np.where(valid, original, 0).astype(np.int32),
        "masked_lm_weights": weights,
    }


def _choose_whole_words(input_ids, candidate, score, num_to_predict, options: MaskingOptions):
    """Per example: words in random order, each taken whole if it still fits."""
    batch, seq = input_ids.shape
    max_pred = options.max_predictions_per_seq
    continuation = np.isin(input_ids, np.asarray(options.continuation_ids)) & candidate
    chosen = np.full((batch, max_pred), seq, np.int64)
    for b in range(batch):
        starts = np.flatnonzero(candidate[b] & ~continuation[b])
        taken = []
        for start in starts[np.argsort(score[b, starts], kind="stable")]:
            end = start + 1
            while end < seq and continuation[b, end]:
                end += 1
            if len(taken) + (end - start) > num_to_predict[b]:
                continue
            taken += range(start, end)
            if len(taken) == num_to_predict[b]:
                break
        chosen[b, : len(taken)] = taken
    return chosen
