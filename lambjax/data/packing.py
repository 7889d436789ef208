"""Packing: several pretraining examples in one row, so that a step computes little padding.

With `config.data.packing`, a training row of `max_seq_length` tokens holds up to
`packing_max_examples` whole examples, one after another, and padding only after the last.
Each example keeps what it has unpacked: its token types, positions that restart at 0, its
own attention (a token attends only to the tokens of its example: `example_ids`), its
masked tokens (masked exactly as the same example unpacked: the mask is a function of
(seed, epoch, example index)), and its next-sentence label, classified from its own [CLS].

The rows are planned once per iterator, from every example's length, by best-fit
decreasing (as MLPerf's BERT packs its data offline, here at read time): the examples,
longest first (ties in a seeded random order), each go to the open row with the least room
that still fits it, both in tokens (max_seq_length) and in masked tokens
(max_predictions_per_seq, counted by the most the masking can choose for its length), and
with fewer than `packing_max_examples` examples; else to a new row. An epoch then visits the
rows in a seeded permutation, as it visits examples unpacked, so the plan is the same on
every process and the iterator's state is still the number of batches consumed.

A packed batch has, beside the unpacked features (`input_ids`, `segment_ids` the token
types, `input_mask`, `masked_lm_*`):
  positions             [B, S] each token's position in its example
  example_ids           [B, S] k for the tokens of the row's k-th example (1, 2, ...), 0 on
                        padding
  cls_positions         [B, M] where each example's [CLS] is (0 for an empty slot)
  next_sentence_labels  [B, M] each example's label (0 for an empty slot)
  nsp_weights           [B, M] 1 for an example, 0 for an empty slot
with M = packing_max_examples.
"""

import dataclasses

import numpy as np

from lambjax.data import masking

# A stream of the iterator's seed for the plan, apart from the epochs' permutations.
_PLAN_STREAM = 0x5041434B
PACKED_KEYS = ("positions", "example_ids", "cls_positions", "nsp_weights")


@dataclasses.dataclass(frozen=True)
class Packing:
    """How a phase packs its training rows (None in a plan: one example per row)."""

    max_examples_per_row: int


def resolve(enabled: bool, max_examples_per_row: int, max_seq_length: int) -> Packing | None:
    """The packing of a phase from `config.data.packing` and `config.data.packing_max_examples`;
    raises ValueError naming the bad value."""
    if not isinstance(enabled, bool):
        raise ValueError(f"config.data.packing={enabled!r} must be True or False")
    if not enabled:
        return None
    # Every example has at least [CLS] and [SEP].
    most = max_seq_length // 2
    if not isinstance(max_examples_per_row, int) or not 2 <= max_examples_per_row <= most:
        raise ValueError(
            f"config.data.packing_max_examples={max_examples_per_row!r} must be an integer in "
            f"[2, {most}] (max_seq_length={max_seq_length} // 2)"
        )
    return Packing(max_examples_per_row)


def most_predictions(lengths: np.ndarray, options: masking.MaskingOptions) -> np.ndarray:
    """The most masked tokens `masking.mask_batch` chooses in an example of each length."""
    chosen = np.clip(np.rint(lengths * options.masked_lm_prob), 1, options.max_predictions_per_seq)
    return chosen.astype(np.int64)


def plan_rows(
    lengths: np.ndarray,
    predictions: np.ndarray,
    *,
    max_seq_length: int,
    max_predictions: int,
    max_examples_per_row: int,
    seed: int,
) -> np.ndarray:
    """[rows, max_examples_per_row] example indices (-1: an empty slot): every example in
    exactly one row, each row within `max_seq_length` tokens and `max_predictions` masked
    tokens (best-fit decreasing, see the module docstring)."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and (lengths.max() > max_seq_length or predictions.max() > max_predictions):
        raise ValueError(
            f"an example of {lengths.max()} tokens does not fit a row of {max_seq_length}"
        )
    shuffled = np.random.default_rng([seed, _PLAN_STREAM]).permutation(len(lengths))
    order = shuffled[np.argsort(-lengths[shuffled], kind="stable")]
    rows: list[list[int]] = []
    room = []  # per row: [tokens left, predictions left]
    # open_rows[r]: the rows with r tokens left that can take another example.
    open_rows = [[] for _ in range(max_seq_length + 1)]
    has_open = np.zeros(max_seq_length + 1, bool)
    for example in order.tolist():
        length, predicted = int(lengths[example]), int(predictions[example])
        row = _best_fit(open_rows, has_open, room, length, predicted)
        if row is None:
            row = len(rows)
            rows.append([])
            room.append([max_seq_length, max_predictions])
        else:
            open_rows[room[row][0]].remove(row)
            has_open[room[row][0]] = bool(open_rows[room[row][0]])
        rows[row].append(example)
        room[row][0] -= length
        room[row][1] -= predicted
        if len(rows[row]) < max_examples_per_row and room[row][0] > 0:
            open_rows[room[row][0]].append(row)
            has_open[room[row][0]] = True
    table = np.full((len(rows), max_examples_per_row), -1, np.int64)
    for index, members in enumerate(rows):
        table[index, : len(members)] = members
    return table


def _best_fit(open_rows, has_open, room, length: int, predicted: int) -> int | None:
    """The open row with the fewest tokens left that fits `length` tokens and `predicted`
    masked tokens, or None."""
    for tokens_left in np.flatnonzero(has_open[length:]) + length:
        for row in reversed(open_rows[tokens_left]):
            if room[row][1] >= predicted:
                return row
    return None


def assemble(examples: dict, table: np.ndarray, seq_len: int, max_predictions: int) -> dict:
    """Packed rows of `table`'s examples.

    Args:
      examples: the examples of `table` (its entries >= 0, in row-major order), unpacked
        and masked: input_ids, segment_ids [n, seq_len], lengths [n], next_sentence_labels
        [n], masked_lm_positions, masked_lm_ids, masked_lm_weights [n, P].
      table: [B, M] example slots of each row (-1: empty), as `plan_rows` returns.
      seq_len: the row length.
      max_predictions: the masked tokens a row holds (`plan_rows` kept each row within).
    """
    batch, slots = table.shape
    out = {
        "input_ids": np.zeros((batch, seq_len), np.int32),
        "segment_ids": np.zeros((batch, seq_len), np.int32),
        "input_mask": np.zeros((batch, seq_len), np.int32),
        "positions": np.zeros((batch, seq_len), np.int32),
        "example_ids": np.zeros((batch, seq_len), np.int32),
        "masked_lm_positions": np.zeros((batch, max_predictions), np.int32),
        "masked_lm_ids": np.zeros((batch, max_predictions), np.int32),
        "masked_lm_weights": np.zeros((batch, max_predictions), np.float32),
        "cls_positions": np.zeros((batch, slots), np.int32),
        "next_sentence_labels": np.zeros((batch, slots), np.int32),
        "nsp_weights": np.zeros((batch, slots), np.float32),
    }
    source = 0
    for row in range(batch):
        offset, predicted = 0, 0
        for slot in range(slots):
            if table[row, slot] < 0:
                continue
            length = int(examples["lengths"][source])
            span = slice(offset, offset + length)
            out["input_ids"][row, span] = examples["input_ids"][source, :length]
            out["segment_ids"][row, span] = examples["segment_ids"][source, :length]
            out["input_mask"][row, span] = 1
            out["positions"][row, span] = np.arange(length)
            out["example_ids"][row, span] = slot + 1
            out["cls_positions"][row, slot] = offset
            out["next_sentence_labels"][row, slot] = examples["next_sentence_labels"][source]
            out["nsp_weights"][row, slot] = 1.0
            chosen = examples["masked_lm_weights"][source] > 0
            count = int(chosen.sum())
            assert predicted + count <= max_predictions, "the plan keeps rows within P"
            to = slice(predicted, predicted + count)
            out["masked_lm_positions"][row, to] = examples["masked_lm_positions"][source, chosen]
            out["masked_lm_positions"][row, to] += offset
            out["masked_lm_ids"][row, to] = examples["masked_lm_ids"][source, chosen]
            out["masked_lm_weights"][row, to] = 1.0
            offset, predicted, source = offset + length, predicted + count, source + 1
    return out


def padding_fraction(lengths: np.ndarray, num_rows: int, seq_len: int) -> float:
    """The share of `num_rows` rows of `seq_len` tokens that is padding."""
    return 1.0 - float(np.sum(lengths)) / (num_rows * seq_len) if num_rows else 0.0
