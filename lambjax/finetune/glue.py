"""GLUE tasks: their files, labels and features.

Files are GLUE's own TSVs as its download script (GLUE-baselines' download_glue_data.py)
writes them, read by column name, or `tfds:glue/TASK:SPLIT` from a prepared TFDS directory.
What those files hold, as TFDS's glue builder (tensorflow_datasets/text/glue.py) reads them
too: CoLA's train and dev files have no header row; MRPC's header keeps the UTF-8 byte order
mark of the Microsoft corpus file it is copied from; fields are never quoted (a `"` is
text); a line ends at `\n` alone (a `\r` before it is dropped); a row with fewer fields
than the header (a text broken over two lines) is skipped with a warning, as TFDS skips rows
with missing fields, unless more than 1 row in 1000 is, which means the file is not the
task's; a row with more fields is read by the header's positions, as TFDS reads it.

A sentence pair is `[CLS] a [SEP] b [SEP]`, the longer of the two cut a token at a time
until the pair fits (run_classifier.py's _truncate_seq_pair). STS-B is regression (one
output, mean squared error); the others are classification.
"""

import dataclasses

import numpy as np
from absl import logging

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


# The most rows with missing fields that a file may have: 1 in 1000.
MALFORMED_ROWS_PER_1000 = 1

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
        # utf-8-sig: a leading byte order mark (MRPC's header) is not part of the first name.
        text = epath.Path(path).read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise FinetuneError(f"{task.name} file {path!r} is not UTF-8 text: {e}") from e
    # Fields are unquoted and a line ends at "\n" only: str.splitlines would also split at
    # characters that GLUE's texts contain (\x0b, \x1c, \x85, \u2028, ...).
    rows = [
        (number, line.removesuffix("\r").split("\t"))
        for number, line in enumerate(text.split("\n"), start=1)
        if line.strip("\r")
    ]
    columns = list(task.text_columns) + [task.label_column]
    width = 4  # CoLA: source, label, the author's mark, sentence
    if task.header:
        if not rows:
            raise FinetuneError(f"{task.name} file {path!r} is empty")
        (_, header), rows = rows[0], rows[1:]
        missing = [c for c in columns if c not in header]
        if missing:
            raise FinetuneError(
                f"{task.name} file {path!r}: the header row lacks the columns {missing} "
                f"(it has {header}); is this GLUE's {task.name.upper()} TSV?"
            )
        columns, width = [header.index(c) for c in columns], len(header)
    texts, labels, malformed = [], [], []
    for number, row in rows:
        where = f"{task.name} file {path!r} line {number}"
        if len(row) < width:
            malformed.append((number, len(row)))
            continue
        texts.append(tuple(row[c] for c in columns[:-1]))
        labels.append(_label(task, row[columns[-1]], where))
    _check_malformed(task, path, malformed, len(rows), width)
    if not texts:
        raise FinetuneError(f"{task.name} file {path!r} holds no examples")
    return Examples(texts, np.asarray(labels, np.float32 if task.labels is None else np.int32))


def _check_malformed(task: Task, path: str, malformed: list, num_rows: int, width: int) -> None:
    """Skipped rows are logged; too many of them end the run, naming the first."""
    if not malformed:
        return
    shown = ", ".join(f"line {n} ({k} fields)" for n, k in malformed[:3])
    summary = (
        f"{task.name} file {path!r}: {len(malformed)} of {num_rows} rows have fewer "
        f"tab-separated fields than {width}: {shown}"
    )
    if len(malformed) * 1000 > num_rows * MALFORMED_ROWS_PER_1000:
        raise FinetuneError(f"{summary}; is this GLUE's {task.name.upper()} TSV?")
    logging.warning("%s; skipping them, as TFDS's glue builder does", summary)


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
