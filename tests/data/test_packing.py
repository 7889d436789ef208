"""Packed training rows: the plan holds every example once within a row's room, the rows are
the examples an unpacked epoch reads (masked alike), and the iterator resumes and splits over
processes as the unpacked one does."""

import numpy as np
import pytest

from lambjax import data
from lambjax.data import masking, packing

SEQ, PRED, MAX_EXAMPLES = 128, 20, 3


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    config = data.default_config()
    config.data_dir = str(tmp_path_factory.mktemp("datasets"))
    config.vocab_size = 1024
    return data.prepare(config, SEQ)


def iterator(prepared, *, batch=8, packed=True, seed=0, state=None, **kwargs):
    batches = data.make_iterator(
        prepared,
        split="train",
        global_batch_size=batch,
        max_predictions_per_seq=PRED,
        seed=seed,
        packing=packing.Packing(MAX_EXAMPLES) if packed else None,
        **kwargs,
    )
    if state is not None:
        batches.set_state(state)
    return batches


def options(max_predictions=PRED):
    return masking.MaskingOptions(
        vocab_size=100,
        mask_id=4,
        special_ids=(0, 1, 2, 3, 4),
        max_predictions_per_seq=max_predictions,
    )


def test_the_plan_holds_every_example_once_within_each_rows_room():
    lengths = np.random.default_rng(0).integers(8, SEQ + 1, 500)
    predictions = packing.most_predictions(lengths, options())
    table = packing.plan_rows(
        lengths,
        predictions,
        max_seq_length=SEQ,
        max_predictions=PRED,
        max_examples_per_row=MAX_EXAMPLES,
        seed=0,
    )
    filled = table >= 0
    np.testing.assert_array_equal(np.sort(table[filled]), np.arange(500))
    assert np.all(filled[:, 0]) and np.all(np.diff(filled.astype(int), axis=1) <= 0)
    assert np.all(np.where(filled, lengths[table], 0).sum(1) <= SEQ)
    assert np.all(np.where(filled, predictions[table], 0).sum(1) <= PRED)
    # Fewer rows than examples, and never more than first-fit in the given order needs.
    assert len(table) < 500
    assert len(table) <= first_fit_rows(lengths, predictions)
    again = packing.plan_rows(
        lengths,
        predictions,
        max_seq_length=SEQ,
        max_predictions=PRED,
        max_examples_per_row=MAX_EXAMPLES,
        seed=0,
    )
    np.testing.assert_array_equal(again, table)


def first_fit_rows(lengths, predictions) -> int:
    """Rows that first-fit (in the given order, no sorting) packs the examples into."""
    rows = []  # [tokens, predictions, examples]
    for length, predicted in zip(lengths, predictions, strict=True):
        for row in rows:
            if row[0] + length <= SEQ and row[1] + predicted <= PRED and row[2] < MAX_EXAMPLES:
                row[0], row[1], row[2] = row[0] + length, row[1] + predicted, row[2] + 1
                break
        else:
            rows.append([length, predicted, 1])
    return len(rows)


def test_a_row_is_bounded_by_masked_tokens_too():
    lengths = np.full(6, 40)  # three fit in 128 tokens, but 6 + 6 + 6 > 15 predictions
    table = packing.plan_rows(
        lengths,
        packing.most_predictions(lengths, options(15)),
        max_seq_length=SEQ,
        max_predictions=15,
        max_examples_per_row=MAX_EXAMPLES,
        seed=0,
    )
    assert table.shape == (3, MAX_EXAMPLES) and np.all((table >= 0).sum(1) == 2)


def examples_of(batch, packed: bool):
    """Each example of a batch as a hashable tuple: tokens, token types, masked positions
    (within the example), their labels, NSP label."""
    found = []
    for row in range(len(batch["input_ids"])):
        if not packed:
            n = int(batch["input_mask"][row].sum())
            spans = [(0, n, int(batch["next_sentence_labels"][row]))]
        else:
            spans = []
            for slot in np.flatnonzero(batch["nsp_weights"][row]):
                start = int(batch["cls_positions"][row, slot])
                n = int((batch["example_ids"][row] == slot + 1).sum())
                spans.append((start, n, int(batch["next_sentence_labels"][row, slot])))
        weights = batch["masked_lm_weights"][row] > 0
        positions = batch["masked_lm_positions"][row][weights]
        ids = batch["masked_lm_ids"][row][weights]
        for start, n, label in spans:
            mine = (positions >= start) & (positions < start + n)
            found.append(
                (
                    tuple(batch["input_ids"][row, start : start + n]),
                    tuple(batch["segment_ids"][row, start : start + n]),
                    tuple(positions[mine] - start),
                    tuple(ids[mine]),
                    label,
                )
            )
    return found


def test_packed_rows_hold_the_examples_of_an_unpacked_epoch_masked_alike(prepared):
    # Batches of one row read every example of epoch 0, one per row.
    everything = iterator(prepared, batch=1, packed=False)
    unpacked = set()
    for _ in range(everything.batches_per_epoch):
        unpacked.update(examples_of(next(everything), packed=False))
    packed_batches = iterator(prepared, batch=4)
    seen, rows = [], 0
    for _ in range(packed_batches.batches_per_epoch):
        batch = next(packed_batches)
        rows += len(batch["input_ids"])
        seen += examples_of(batch, packed=True)
        for row in range(len(batch["input_ids"])):
            example = batch["example_ids"][row]
            real = example > 0
            np.testing.assert_array_equal(real, batch["input_mask"][row] > 0)
            assert np.all(np.diff(example[real]) >= 0)  # examples one after another
            for slot in np.flatnonzero(batch["nsp_weights"][row]):
                span = np.flatnonzero(example == slot + 1)
                np.testing.assert_array_equal(batch["positions"][row, span], np.arange(len(span)))
                cls = batch["input_ids"][row, batch["cls_positions"][row, slot]]
                assert span[0] == batch["cls_positions"][row, slot]
                assert cls == prepared.special_ids["cls"]
    assert len(seen) == len(set(seen)) and set(seen) <= unpacked
    # The rows read (the remainder of the last batch dropped) hold more than one example each.
    assert len(seen) > 1.02 * rows and len(seen) >= 0.95 * len(unpacked)


def test_packed_state_restore_continues_exactly_on_any_topology(prepared):
    full = iterator(prepared)
    steps = full.batches_per_epoch + 2  # past an epoch boundary
    expected = [next(full) for _ in range(steps)]
    partial = iterator(prepared)
    for _ in range(3):
        next(partial)
    state = partial.get_state()
    resumed = iterator(prepared, state=state)
    for step in range(3, steps):
        got = next(resumed)
        for key in expected[step]:
            np.testing.assert_array_equal(got[key], expected[step][key], err_msg=key)
    parts = [iterator(prepared, state=state, process_index=p, process_count=2) for p in range(2)]
    for step in range(3, steps):
        halves = [next(part) for part in parts]
        for key in expected[step]:
            merged = np.concatenate([half[key] for half in halves])
            np.testing.assert_array_equal(merged, expected[step][key], err_msg=key)


def test_packing_settings_name_the_bad_value():
    assert packing.resolve(False, 1, SEQ) is None
    assert packing.resolve(True, 3, SEQ) == packing.Packing(3)
    with pytest.raises(ValueError, match=r"packing_max_examples=1 must be an integer in \[2, 64\]"):
        packing.resolve(True, 1, SEQ)
    with pytest.raises(ValueError, match="config.data.packing='yes' must be True or False"):
        packing.resolve("yes", 3, SEQ)
