import os
import subprocess
import sys

import numpy as np
import pytest

from lambjax import data
from lambjax.data import beam_build, masking, sources
from lambjax.data import builder as builder_lib

SEQ = 128
PRED = 20


def config(tmp, **fields):
    c = data.default_config()
    c.data_dir = str(tmp)
    c.vocab_size = 1024
    c.update(fields)
    return c


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return data.prepare(config(tmp_path_factory.mktemp("datasets")), SEQ)


def take(prepared, steps, *, process_index=0, process_count=1, seed=0, batch=16, state=None):
    iterator = data.make_iterator(
        prepared,
        split="train",
        global_batch_size=batch,
        max_predictions_per_seq=PRED,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
    )
    if state is not None:
        iterator.set_state(state)
    return [next(iterator) for _ in range(steps)], iterator


def concat(parts):
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def test_batches_have_bert_features(prepared):
    (b,), _ = take(prepared, 1)
    assert b["input_ids"].shape == (16, SEQ) and b["input_ids"].dtype == np.int32
    assert b["masked_lm_positions"].shape == (16, PRED)
    assert b["masked_lm_weights"].dtype == np.float32
    assert b["next_sentence_labels"].shape == (16,)
    cls, sep = prepared.special_ids["cls"], prepared.special_ids["sep"]
    assert np.all(b["input_ids"][:, 0] == cls)
    assert np.all((b["input_ids"] == sep).sum(1) == 2)  # [CLS] A [SEP] B [SEP]
    assert set(np.unique(b["next_sentence_labels"])) <= {0, 1}
    assert prepared.num_examples("validation") > 0


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_parts_are_disjoint_and_make_the_global_batch(prepared, process_count):
    # 8 steps of 16 cross an epoch boundary only if the corpus is small; either way the
    # global batches must match.
    steps = prepared.num_examples("train") // 16 + 2  # past the first epoch boundary
    global_batches, _ = take(prepared, steps)
    parts = [
        take(prepared, steps, process_index=p, process_count=process_count)[0]
        for p in range(process_count)
    ]
    for step in range(steps):
        rows = [parts[p][step] for p in range(process_count)]
        merged = concat(rows)
        for key in merged:
            np.testing.assert_array_equal(merged[key], global_batches[step][key], err_msg=key)


@pytest.mark.parametrize("process_count", [1, 2])
def test_a_padded_epoch_scores_every_example_once_at_one_batch_shape(prepared, process_count):
    """An evaluation's epoch (`pad_last_batch`): the remainder makes a last batch whose
    padding rows weigh 0, so the weighted rows are every example of the split once."""
    total, batch = prepared.num_examples("validation"), 8
    assert total % batch, "the split must leave a remainder for this test"
    parts = [
        list(
            data.make_iterator(
                prepared,
                split="validation",
                global_batch_size=batch,
                max_predictions_per_seq=PRED,
                seed=0,
                process_index=p,
                process_count=process_count,
                num_epochs=1,
                pad_last_batch=True,
            )
        )
        for p in range(process_count)
    ]
    batches = [concat([part[step] for part in parts]) for step in range(len(parts[0]))]
    assert len(batches) == -(-total // batch)
    assert {b["input_ids"].shape for b in batches} == {(batch, SEQ)}
    weights = np.concatenate([b["nsp_weights"] for b in batches])
    assert weights.sum() == total and set(weights[:total]) == {1.0} and not weights[total:].any()
    assert not batches[-1]["masked_lm_weights"][weights[-batch:] == 0].any()
    # The same examples as the epoch that drops the remainder, in the same order, then the rest.
    dropped = data.make_iterator(
        prepared,
        split="validation",
        global_batch_size=batch,
        max_predictions_per_seq=PRED,
        seed=0,
        num_epochs=1,
    )
    for full, padded in zip(dropped, batches, strict=False):
        np.testing.assert_array_equal(full["input_ids"], padded["input_ids"])
        np.testing.assert_array_equal(full["masked_lm_weights"], padded["masked_lm_weights"])


def test_same_seed_same_batches_other_seed_other_batches(prepared):
    a, _ = take(prepared, 2, seed=3)
    b, _ = take(prepared, 2, seed=3)
    c, _ = take(prepared, 2, seed=4)
    np.testing.assert_array_equal(a[1]["input_ids"], b[1]["input_ids"])
    assert not np.array_equal(a[1]["input_ids"], c[1]["input_ids"])


def test_state_restore_continues_exactly_on_any_topology(prepared):
    full, _ = take(prepared, 5)
    _, iterator = take(prepared, 3)
    state = iterator.get_state()
    rest, _ = take(prepared, 2, state=state)
    for a, b in zip(rest, full[3:], strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    parts = [take(prepared, 2, process_index=p, process_count=2, state=state)[0] for p in range(2)]
    for step in range(2):
        np.testing.assert_array_equal(
            concat([parts[0][step], parts[1][step]])["input_ids"], full[3 + step]["input_ids"]
        )


def test_masking_statistics(prepared):
    batches, _ = take(prepared, 40, batch=64)
    masked = replaced = kept = randomized = positions = tokens = 0
    special = set(prepared.special_ids.values())
    for b in batches:
        lengths = b["input_mask"].sum(1)
        tokens += lengths.sum()
        w = b["masked_lm_weights"] > 0
        positions += w.sum()
        rows = np.nonzero(w)[0]
        now = b["input_ids"][rows, b["masked_lm_positions"][w]]
        original = b["masked_lm_ids"][w]
        replaced += np.sum(now == prepared.special_ids["mask"])
        kept += np.sum(now == original)
        randomized += np.sum((now != original) & (now != prepared.special_ids["mask"]))
        masked += w.sum()
        assert not any(int(t) in special for t in original)  # never [CLS], [SEP], [PAD]
    assert abs(positions / tokens - 0.15) < 0.01
    assert abs(replaced / masked - 0.8) < 0.01
    assert abs(randomized / masked - 0.1) < 0.01 + 0.002  # a random token may equal the original
    assert abs(kept / masked - 0.1) < 0.01 + 0.002


def test_masking_is_a_pure_function_of_seed_epoch_index():
    ids = np.tile(np.arange(2, 34, dtype=np.int32), (3, 1))
    options = masking.MaskingOptions(
        vocab_size=50, mask_id=4, special_ids=(0, 1, 2, 3, 4), max_predictions_per_seq=5
    )
    args = (np.full(3, 32), np.zeros(3, np.int64), np.arange(3))
    a = masking.mask_batch(ids, *args, seed=1, options=options)
    b = masking.mask_batch(ids[::-1].copy(), args[0], args[1], args[2][::-1].copy(), 1, options)
    np.testing.assert_array_equal(a["masked_lm_positions"], b["masked_lm_positions"][::-1])


def test_whole_word_masking_masks_all_pieces():
    # ids 10..13: 11 and 13 are "##" continuations of 10 and 12.
    ids = np.asarray([[2, 10, 11, 12, 13, 14, 15, 3]], np.int32)
    options = masking.MaskingOptions(
        vocab_size=20,
        mask_id=4,
        special_ids=(0, 1, 2, 3, 4),
        max_predictions_per_seq=4,
        masked_lm_prob=0.5,
        continuation_ids=(11, 13),
        whole_word_masking=True,
    )
    for index in range(50):
        out = masking.mask_batch(ids, np.asarray([8]), np.zeros(1), np.asarray([index]), 0, options)
        chosen = set(out["masked_lm_positions"][0][out["masked_lm_weights"][0] > 0].tolist())
        assert (1 in chosen) == (2 in chosen) and (3 in chosen) == (4 in chosen)


def test_text_source_builds_a_tfds_dataset_and_reuses_it(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(_documents(40))
    c = config(tmp_path / "out", source=f"text:{corpus}/*.txt", vocab_size=200)
    prepared = data.prepare(c, 64)
    assert prepared.num_examples("train") > 10
    built = [p for p in (tmp_path / "out" / "pretraining_examples").iterdir()]
    assert len(built) == 1
    before = os.path.getmtime(built[0])
    data.prepare(c, 64)  # same inputs: reused, not rebuilt
    assert os.path.getmtime(built[0]) == before
    packed = data.prepare(
        config(tmp_path / "out", source=c.source, vocab_size=200, next_sentence_prediction=False),
        64,
    )
    (b,), _ = take(packed, 1, batch=4)
    assert np.all(b["segment_ids"] == 0) and np.all(b["next_sentence_labels"] == 0)


def test_byte_ranges_cover_every_document_once(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(_documents(60) + "\n\n\n\nLast one.\n")
    whole, _ = sources.read_unit(sources.list_units(f"text:{corpus}", unit_bytes=1 << 30)[0])
    units = sources.list_units(f"text:{corpus}", unit_bytes=500)
    assert len(units) > 5
    pieces = [d for unit in units for d in sources.read_unit(unit)[0]]
    assert pieces == whole and len(whole) == 61


@pytest.mark.slow
def test_one_and_two_workers_write_the_same_records(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index in range(3):
        (corpus / f"{index}.txt").write_text(_documents(40 + 10 * index, seed=index))
    built = []
    for workers in (1, 2):  # in-process, then two DirectRunner worker processes
        c = config(tmp_path / f"w{workers}", source=f"text:{corpus}/*.txt", vocab_size=200)
        c.build_shard_mb = 0.002  # several byte ranges per file
        data.prepare(c, 64, beam_options=f"direct_num_workers={workers}")
        (directory,) = (tmp_path / f"w{workers}" / "pretraining_examples").iterdir()
        files = sorted((directory / "1.0.0").glob("pretraining_examples-*"))
        built.append({f.name: f.read_bytes() for f in files})
    assert len(built[0]) > 10 and built[0] == built[1]


def test_interrupted_build_never_looks_complete_and_a_rerun_finishes(tmp_path, monkeypatch):
    corpus = tmp_path / "c.txt"
    corpus.write_text(_documents(40))
    c = config(tmp_path / "out", source=f"text:{corpus}", vocab_size=200)
    c.build_shard_mb = 0.002
    create_examples, calls = builder_lib.examples_lib.create_examples, []

    def crash_after_one_unit(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:  # a unit's two splits, then the crash
            raise RuntimeError("interrupted")
        return create_examples(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(beam_build.examples_lib, "create_examples", crash_after_one_unit)
        with pytest.raises(Exception, match="interrupted"):
            data.prepare(c, 64, beam_options="direct_num_workers=1")
    with pytest.raises(data.NotPrepared, match="max_seq_length 64 are not built"):
        data.prepare(c, 64, build=False)
    summaries = []
    prepared = data.prepare_all(
        c, [64], beam_options="direct_num_workers=1", on_summary=summaries.append
    )[64]
    assert summaries[0].reused_units == 1 and summaries[0].num_units > 2
    assert prepared.num_examples("train") > 0


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: dict(source=f"text:{d}/nothing/*.txt"), "matches no files"),
        (lambda d: dict(source="text:" + _write(d / "e.txt", "   \n\n  ")), "holds no text"),
        (lambda d: dict(source=f"text:{_write_bytes(d / 'b.txt', bytes([0xFF, 0xFE]))}"), "UTF-8"),
        (lambda d: dict(vocab=str(d / "missing.txt")), "no such vocabulary file"),
        (
            lambda d: dict(vocab=_write(d / "v.txt", "[PAD]\n[UNK]\nhello\n")),
            r"lacks the special tokens \['\[CLS\]'",
        ),
        (
            lambda d: dict(
                vocab=_write(d / "v.txt", "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\nof\nthe\n")
            ),
            r"holds the token 'the' twice \(lines 6 and 8\)",
        ),
        (lambda d: dict(source="ftp:corpus"), "not a known source"),
        (lambda d: dict(validation_fraction=1.5), "validation_fraction=1.5"),
    ],
)
def test_bad_inputs_give_one_line_errors(tmp_path, setup, message):
    with pytest.raises(data.DataError, match=message) as error:
        data.prepare(config(tmp_path / "out", **setup(tmp_path)), 64)
    assert "\n" not in str(error.value)


def test_undecodable_files_and_short_documents_are_counted_and_skipped(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text(_documents(30) + "\n\nTiny.\n\nx")
    (corpus / "bad.txt").write_bytes(b"\xff\xfe broken")
    summaries = []
    c = config(tmp_path / "out", source=f"text:{corpus}/*.txt", vocab_size=200)
    prepared = data.prepare_all(
        c, [64], beam_options="direct_num_workers=1", on_summary=summaries.append
    )[64]
    assert prepared.num_examples("train") > 0
    assert summaries[0].skipped["files not UTF-8"] == 1
    assert summaries[0].skipped["documents too short"] >= 1
    line = builder_lib.summary_line(summaries[0], c.data_dir)
    assert "1 files not UTF-8" in line and "\n" not in line


def _write(path, text):
    path.write_text(text)
    return str(path)


def _write_bytes(path, raw):
    path.write_bytes(raw)
    return str(path)


def _documents(n, seed=0):
    words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        sentences = [
            " ".join(rng.choice(words, rng.integers(4, 12))).capitalize() + "."
            for _ in range(rng.integers(3, 9))
        ]
        docs.append(" ".join(sentences))
    return "\n\n".join(docs)


@pytest.mark.slow
def test_a_trained_vocabulary_is_the_same_in_every_process(tmp_path):
    # `tokenizers` alone numbers its ##x symbols in a hash order that changes per process,
    # and three processes trained three different vocabularies on this corpus.
    program = (
        "import sys\n"
        "from lambjax.data import sources, tokenization\n"
        "docs, _ = sources.read_documents('embedded')\n"
        "tokenization.train_vocab(docs, 1024, True, sys.argv[1])\n"
    )
    paths = [tmp_path / f"vocab{i}.txt" for i in range(3)]
    for path in paths:
        subprocess.run([sys.executable, "-c", program, str(path)], check=True, capture_output=True)
    first, *others = (path.read_text(encoding="utf-8") for path in paths)
    assert len(first.splitlines()) == 1024
    assert all(other == first for other in others)
