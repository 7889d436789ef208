"""SQuAD windows, labels and answers read back; GLUE files and pairs; bad files."""

import json
import re
import sys

import numpy as np
import pytest

from lambjax.data import tokenization
from lambjax.finetune import glue, squad
from lambjax.finetune.errors import FinetuneError

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """Whole words only: one token per word, so positions can be worked out by hand."""
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    tokens = list(tokenization.SPECIAL_TOKENS) + WORDS + ["where", "is", "?", "."]
    path.write_text("\n".join(tokens) + "\n")
    return tokenization.load(str(path), lower_case=True)


def special(tokenizer):
    return tokenization.special_ids(tokenizer)


def example(answer_word=None, *, qid="q", question="where is kilo ?", context=None):
    context = context or " ".join(WORDS)
    if answer_word is None:
        return squad.Example(qid, question, context, -1, "")
    return squad.Example(qid, question, context, context.index(answer_word), answer_word)


def tokens(tokenizer, ids):
    return [tokenizer.id_to_token(int(i)) for i in ids]


def test_windows_as_run_squad_places_them():
    assert squad.windows(10, 4, 3) == [(0, 4), (3, 4), (6, 4)]
    assert squad.windows(10, 4, 8) == [(0, 4), (4, 4), (8, 2)]  # stride capped at the length
    assert squad.windows(3, 4, 2) == [(0, 3)]
    # Windows 0..5 and 3..8: token 4 has 1 token of context on its short side in both (a
    # tie: the first wins), token 5 has 0 in window 0 and 2 in window 1.
    assert list(squad.best_windows([(0, 6), (3, 6)], 9)) == [0, 0, 0, 0, 0, 1, 1, 1, 1]


def test_answer_across_a_window_edge(tokenizer):
    """13 context words in windows of 6 (seq 14 - question 4 - 3... = 6) every 3 tokens:
    "golf hotel" spans window 0's edge (words 0-5) and lies whole in window 1 (3-8)."""
    ex = example("golf hotel")
    features = squad.featurize(
        [ex], tokenizer, special(tokenizer), max_seq_length=13, doc_stride=3,
        max_query_length=8, training=True,
    )  # fmt: skip
    arrays = features.arrays
    assert len(features) == 4 and list(features.example_index) == [0, 0, 0, 0]
    assert tokens(tokenizer, arrays["input_ids"][1]) == (
        ["[CLS]", "where", "is", "kilo", "?", "[SEP]"]
        + ["delta", "echo", "foxtrot", "golf", "hotel", "india", "[SEP]"]
    )
    assert list(arrays["segment_ids"][1]) == [0] * 6 + [1] * 7
    # Window 0 holds "golf" but not "hotel": both labels point at [CLS].
    assert (arrays["start_positions"][0], arrays["end_positions"][0]) == (0, 0)
    start, end = arrays["start_positions"][1], arrays["end_positions"][1]
    assert tokens(tokenizer, arrays["input_ids"][1][start : end + 1]) == ["golf", "hotel"]
    # The offsets read the answer back from the context.
    assert ex.context[features.offsets[1, start, 0] : features.offsets[1, end, 1]] == "golf hotel"
    assert (features.offsets[1, :6] == -1).all()  # question and specials are not context


def test_predictions_from_logits_v1_and_v2(tokenizer):
    cased = "Alpha Bravo Charlie Delta Echo Foxtrot Golf Hotel India Juliet Kilo Lima Mike"
    examples = [example(qid="a", context=cased), example(qid="b", context=cased)]
    features = squad.featurize(
        examples, tokenizer, special(tokenizer), max_seq_length=13, doc_stride=3,
        max_query_length=8, training=False,
    )  # fmt: skip
    start = np.zeros((len(features), 13), np.float32)
    end = np.zeros_like(start)
    # Example a: "Golf Hotel" at positions 9, 10 of window 1 (context words 3..8 from 6).
    # A higher start at 11 pairs only with ends before it, or at tokens of lower logits, and
    # word 8 has more context in window 2: no span from it wins.
    start[1, 9], end[1, 10] = 5.0, 5.0
    start[1, 11], end[1, 8] = 9.0, 9.0
    # Example b: its [CLS] beats every span in every window.
    b_features = [i for i, e in enumerate(features.example_index) if e == 1]
    start[b_features, 0], end[b_features, 0] = 6.0, 6.0
    start[b_features[0], 7], end[b_features[0], 7] = 2.0, 2.0
    kwargs = dict(n_best_size=5, max_answer_length=3)
    v1, odds = squad.predict(examples, features, start, end, version_2=False, **kwargs)
    assert v1["a"] == "Golf Hotel" and odds == {}
    short, _ = squad.predict(
        examples, features, start, end, version_2=False, n_best_size=5, max_answer_length=1
    )
    # "Golf Hotel" is 2 tokens; no other pair of the 5 best starts and ends is valid.
    assert short["a"] == ""
    v2, odds = squad.predict(examples, features, start, end, version_2=True, **kwargs)
    assert v2["a"] == "Golf Hotel" and odds["a"] == pytest.approx(0.0 - 10.0)
    assert v2["b"] == "" and odds["b"] == pytest.approx(12.0 - 4.0)


def test_v2_no_answer_labels_cls_in_every_window(tokenizer):
    features = squad.featurize(
        [example(None)], tokenizer, special(tokenizer), max_seq_length=13, doc_stride=3,
        max_query_length=8, training=True,
    )  # fmt: skip
    assert not features.arrays["start_positions"].any()
    assert not features.arrays["end_positions"].any()


def squad_json(tmp_path, qas, name="f.json"):
    context = " ".join(WORDS)
    path = tmp_path / name
    path.write_text(json.dumps({"version": "1.1", "data": [
        {"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}))  # fmt: skip
    return str(path)


def test_bad_squad_files(tmp_path):
    def read(path, **kwargs):
        return squad.read(path, version_2=kwargs.get("v2", False), training=True)

    wrong = [{"id": "q7", "question": "?", "answers": [{"text": "golf", "answer_start": 3}]}]
    with pytest.raises(FinetuneError, match="'q7': answer 'golf' is not at its answer_start=3"):
        read(squad_json(tmp_path, wrong))
    with pytest.raises(FinetuneError, match="no such file"):
        read(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(FinetuneError, match="not valid JSON"):
        read(str(tmp_path / "bad.json"))
    no_answer = [{"id": "q8", "question": "?", "answers": []}]
    with pytest.raises(FinetuneError, match="only SQuAD v2.0 allows"):
        read(squad_json(tmp_path, no_answer))
    assert read(squad_json(tmp_path, no_answer), v2=True)[0][0].answer_start == -1
    with pytest.raises(FinetuneError, match="lacks a SQuAD field"):
        read(squad_json(tmp_path, [{"id": "q9", "question": "?"}]))


def test_glue_files_pairs_and_truncation(tmp_path, tokenizer):
    mnli = tmp_path / "dev_matched.tsv"
    header = "index\tpromptID\tpairID\tgenre\tsentence1\tsentence2\tlabel1\tgold_label"
    mnli.write_text(
        header + "\n0\t1\t1\tx\talpha bravo charlie delta echo\tgolf\tneutral\tneutral\n"
        "1\t2\t2\tx\tkilo\tlima mike\tentailment\tentailment\n"
    )
    task = glue.get_task("mnli")
    examples = glue.read(task, str(mnli))
    assert examples.texts[1] == ("kilo", "lima mike") and list(examples.labels) == [2, 1]
    arrays = glue.featurize(examples, tokenizer, special(tokenizer), max_seq_length=7)
    # 5 + 1 tokens into 7 - 3 = 4: the longer text loses its tail.
    assert tokens(tokenizer, arrays["input_ids"][0]) == [
        "[CLS]", "alpha", "bravo", "charlie", "[SEP]", "golf", "[SEP]"]  # fmt: skip
    assert list(arrays["segment_ids"][0]) == [0, 0, 0, 0, 0, 1, 1]
    assert list(arrays["input_mask"][1]) == [1] * 6 + [0]
    cola = tmp_path / "cola.tsv"  # CoLA's files have no header
    cola.write_text("gj04\t1\t\talpha bravo .\ngj04\t0\t*\tbravo alpha\n")
    assert glue.read(glue.get_task("cola"), str(cola)).texts == [
        ("alpha bravo .",),
        ("bravo alpha",),
    ]
    assert glue.prediction_rows(task, [2, 0]) == [
        "index\tprediction",
        "0\tneutral",
        "1\tcontradiction",
    ]


def test_bad_glue_files(tmp_path):
    sst2 = glue.get_task("sst2")
    cases = {
        "sentence\tlabel\nfine\t1\nbroken line\n": "fields than 2: line 3 (1 fields)",
        "sentence\tlabel\nfine\t7\n": "line 2: label '7' is not one of ['0', '1']",
        "text\tlabel\nfine\t1\n": "header row lacks the columns ['sentence']",
    }
    for text, expected in cases.items():
        (tmp_path / "x.tsv").write_text(text)
        with pytest.raises(FinetuneError, match=re.escape(expected)):
            glue.read(sst2, str(tmp_path / "x.tsv"))
    with pytest.raises(FinetuneError, match="GLUE task 'sst' is unknown; valid: cola sst2"):
        glue.get_task("sst")


class FakeTfds:
    """The part of `tensorflow_datasets` the readers use, holding prepared splits in memory.

    Rows are shaped as the installed TFDS builders write them: GLUE's in
    tensorflow_datasets/text/glue.py (MNLI's `premise`/`hypothesis` and its ClassLabel
    names entailment, neutral, contradiction; SST-2's names negative, positive, the TSV's
    0 and 1 in that order), SQuAD's in tensorflow_datasets/datasets/squad/
    squad_dataset_builder.py (`answers` a Sequence of text and answer_start, v2.0's
    `is_impossible`); text features come back from `as_numpy` as bytes.
    """

    def __init__(self, rows, label_names=None):
        self.rows, self.label_names = rows, label_names

    def builder(self, name, data_dir=None):
        fake = self

        class Builder:
            data_dir = "/fake"
            info = type(
                "Info", (), {"features": {"label": type("L", (), {"names": fake.label_names})}}
            )

            def is_prepared(self):
                return True

            def as_dataset(self, split):
                return fake.rows[split]

        return Builder()

    @staticmethod
    def as_numpy(dataset):
        return dataset


def test_tfds_sources_map_to_glue_and_squad(monkeypatch):
    mnli = FakeTfds(
        {"validation_matched": [
            {"premise": b"kilo", "hypothesis": b"lima", "label": 0, "idx": 0},
            {"premise": b"mike", "hypothesis": b"alpha", "label": 2, "idx": 1},
        ]},
        label_names=["entailment", "neutral", "contradiction"],
    )  # fmt: skip
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", mnli)
    examples = glue.read(glue.get_task("mnli"), "tfds:glue/mnli:validation_matched")
    assert examples.texts == [("kilo", "lima"), ("mike", "alpha")]
    # TFDS's order (entailment, neutral, contradiction) becomes GLUE's TSV order.
    assert [glue.TASKS["mnli"].labels[i] for i in examples.labels] == [
        "entailment", "contradiction"]  # fmt: skip
    sst2 = FakeTfds(
        {"train": [{"sentence": b"fine", "label": 1, "idx": 0}]}, ["negative", "positive"]
    )
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", sst2)
    assert list(glue.read(glue.get_task("sst2"), "tfds:glue/sst2:train").labels) == [1]
    with pytest.raises(FinetuneError, match="write tfds:NAME:SPLIT"):
        glue.read(glue.get_task("sst2"), "tfds:glue")

    context = "alpha bravo charlie"
    squad_rows = FakeTfds({"validation": [
        {"id": b"s1", "title": b"t", "context": context.encode(), "question": b"which?",
         "answers": {"text": [b"bravo"], "answer_start": [6]}, "is_impossible": False},
        {"id": b"s2", "title": b"t", "context": context.encode(), "question": b"none?",
         "answers": {"text": [], "answer_start": []}, "is_impossible": True},
    ]})  # fmt: skip
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", squad_rows)
    examples, data = squad.read("tfds:squad/v2.0:validation", version_2=True, training=True)
    assert [(e.qid, e.answer_text, e.answer_start) for e in examples] == [
        ("s1", "bravo", 6), ("s2", "", -1)]  # fmt: skip
    assert data[1]["paragraphs"][0]["qas"][0]["is_impossible"] is True
