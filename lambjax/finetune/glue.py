"""GLUE tasks: their files, labels and features.

Files are GLUE's own TSVs as its download script writes them (CoLA without a header row, the
others with one; no quoting), read by column name, or `tfds:glue/TASK:SPLIT` from a prepared
TFDS directory. A sentence pair is `[CLS] a [SEP] b [SEP]`, the longer of the two cut a token
at a time until the pair fits (run_classifier.py's _truncate_seq_pair). STS-B is regression
(one output, mean squared error); the others are classification.
"""

import csv
import dataclasses

import numpy as np

from lambjax.finetune import sources
from lambjax.finetune.errors import FinetuneError


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    text_columns: tuple  # TSV column names (or indices, for CoLA's headerless files)
    label_column: str | int
    labels: tuple | None  # the TSV's label strings in class-id order; None: regression
    tfds_text: tuple  # the same texts' TFDS feature names
    header: bool = True

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)


_BINARY = ("0", "1")
_ENTAILMENT = ("entailment", "not_entailment")
TASKS = {
    t.name: t
    for t in (
        Task("cola", (3,), 1, _BINARY, ("sentence",), header=False),
        Task("sst2", ("sentence",), "label", _BINARY, ("sentence",)),
        Task("mrpc", ("#1 String", "#2 String"), "Quality", _BINARY, ("sentence1", "sentence2")),
        Task("stsb", ("sentence1", "sentence2"), "score", None, ("sentence1", "sentence2")),
        Task(
            "qqp", ("question1", "question2"), "is_duplicate", _BINARY, ("question1", "question2")
        ),
        Task(
            "mnli",
            ("sentence1", "sentence2"),
            "gold_label",
            ("contradiction", "entailment", "neutral"),
            ("premise", "hypothesis"),
        ),
        Task("qnli", ("question", "sentence"), "label", _ENTAILMENT, ("question", "sentence")),
        Task("rte", ("sentence1", "sentence2"), "label", _ENTAILMENT, ("sentence1", "sentence2")),
        Task("wnli", ("sentence1", "sentence2"), "label", _BINARY, ("sentence1", "sentence2")),
    )
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise FinetuneError(f"GLUE task {name!r} is unknown; valid: {' '.join(TASKS)}")
    return TASKS[name]


@dataclasses.dataclass
class Examples:
    texts: list  # per example, a tuple of one or two strings
    labels: np.ndarray  # int32 class ids, or float32 scores (STS-B)


def read(task: Task, source: str, tfds_data_dir=None) -> Examples:
    if source.startswith("tfds:"):
        return _read_tfds(task, source, tfds_data_dir)
    return _read_tsv(task, source)


def _label(task: Task, value: str, where: str):
    if task.labels is None:
        try:
            return float(value)
        except ValueError as e:
            raise FinetuneError(f"{where}: score {value!r} is not a number") from e
    if value not in task.labels:
        raise FinetuneError(f"{where}: label {value!r} is not one of {list(task.labels)}")
    return task.labels.index(value)


def _read_tsv(task: Task, path: str) -> Examples:
    from etils import epath

    if not epath.Path(path).exists():
        raise FinetuneError(f"{task.name} file {path!r}: no such file")
    try:
        lines = epath.Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise FinetuneError(f"{task.name} file {path!r} is not UTF-8 text: {e}") from e
    rows = list(csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE))
    columns = list(task.text_columns) + [task.label_column]
    if task.header:
        if not rows:
            raise FinetuneError(f"{task.name} file {path!r} is empty")
        header, rows = rows[0], rows[1:]
        missing = [c for c in columns if c not in header]
        if missing:
            raise FinetuneError(
                f"{task.name} file {path!r}: the header row lacks the columns {missing} "
                f"(it has {header}); is this GLUE's {task.name.upper()} TSV?"
            )
        columns = [header.index(c) for c in columns]
    texts, labels = [], []
    for number, row in enumerate(rows, start=2 if task.header else 1):
        where = f"{task.name} file {path!r} line {number}"
        if len(row) <= max(columns):
            raise FinetuneError(
                f"{where}: {len(row)} tab-separated fields, expected at least {max(columns) + 1}"
            )
        texts.append(tuple(row[c] for c in columns[:-1]))
        labels.append(_label(task, row[columns[-1]], where))
    if not texts:
        raise FinetuneError(f"{task.name} file {path!r} holds no examples")
    return Examples(texts, np.asarray(labels, np.float32 if task.labels is None else np.int32))


def _read_tfds(task: Task, source: str, data_dir) -> Examples:
    builder, rows = sources.tfds_rows(source, data_dir, "tfds:glue/sst2:validation")
    label_feature = builder.info.features["label"]
    texts, labels = [], []
    for row in rows:
        texts.append(tuple(row[k].decode() for k in task.tfds_text))
        value = row["label"]
        if task.labels is None:
            labels.append(float(value))
            continue
        if value < 0:
            raise FinetuneError(f"{source}: unlabelled examples (a test split?)")
        # TFDS's class names are GLUE's label strings, or name GLUE's 0/1 in that order.
        label_name = label_feature.names[int(value)]
        labels.append(task.labels.index(label_name) if label_name in task.labels else int(value))
    return Examples(texts, np.asarray(labels, np.float32 if task.labels is None else np.int32))


def featurize(examples: Examples, tokenizer, special: dict, max_seq_length: int) -> dict:
    """input_ids, segment_ids, input_mask [N, S] and labels [N]."""
    firsts = tokenizer.encode_batch([t[0] for t in examples.texts], add_special_tokens=False)
    seconds = (
        tokenizer.encode_batch([t[1] for t in examples.texts], add_special_tokens=False)
        if len(examples.texts[0]) > 1
        else [None] * len(firsts)
    )
    n = len(firsts)
    input_ids = np.full((n, max_seq_length), special["pad"], np.int32)
    segment_ids = np.zeros((n, max_seq_length), np.int32)
    input_mask = np.zeros((n, max_seq_length), np.int32)
    for i, (first, second) in enumerate(zip(firsts, seconds, strict=True)):
        a, b = list(first.ids), list(second.ids) if second is not None else []
        budget = max_seq_length - (3 if second is not None else 2)
        while len(a) + len(b) > budget:
            (a if len(a) > len(b) else b).pop()
        ids = [special["cls"], *a, special["sep"]]
        segments = [0] * len(ids)
        if second is not None:
            ids += [*b, special["sep"]]
            segments += [1] * (len(b) + 1)
        input_ids[i, : len(ids)] = ids
        segment_ids[i, : len(ids)] = segments
        input_mask[i, : len(ids)] = 1
    return {
        "input_ids": input_ids,
        "segment_ids": segment_ids,
        "input_mask": input_mask,
        "labels": examples.labels,
    }


def prediction_rows(task: Task, outputs: np.ndarray) -> list[str]:
    """The TSV of eval predictions, GLUE's submission layout: `index<TAB>prediction`."""
    if task.labels is None:
        values = [f"{float(v):.3f}" for v in outputs]
    else:
        values = [task.labels[int(v)] for v in outputs]
    return ["index\tprediction"] + [f"{i}\t{v}" for i, v in enumerate(values)]
