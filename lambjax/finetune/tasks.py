"""A task as the loop sees it: its head, its training arrays, and its evaluation sets, each
scoring the model's outputs into metrics and prediction files."""

import dataclasses
import json
from collections.abc import Callable

import numpy as np

from lambjax.finetune import glue, glue_metrics, squad, squad_metrics
from lambjax.finetune.config import SQUAD_TASKS


@dataclasses.dataclass
class EvalSet:
    name: str  # "" or a suffix ("mismatched") for the metrics and files of a second set
    arrays: dict  # the model's inputs [N, ...]
    # outputs (numpy, [N, ...] per head output) -> (metrics, {file name: text})
    score: Callable


@dataclasses.dataclass
class Task:
    name: str
    kind: str  # "span" | "classifier"
    num_labels: int
    train: dict  # arrays [N, ...], labels included
    eval_sets: list
    labels: tuple | None = None  # class names (GLUE's label strings); None: span or regression


def training_texts(config) -> list[str]:
    """The texts of the training set (a vocabulary trained for scratch: runs)."""
    if config.task in SQUAD_TASKS:
        examples, _ = squad.read(
            config.data.train,
            version_2=config.task == "squad_v2.0",
            training=False,
            tfds_data_dir=config.data.tfds_data_dir,
        )
        return sorted({e.context for e in examples}) + [e.question for e in examples]
    examples = glue.read(glue.get_task(config.task), config.data.train, config.data.tfds_data_dir)
    return [" ".join(t) for t in examples.texts]


def build(config, tokenizer, special: dict) -> Task:
    if config.task in SQUAD_TASKS:
        return _squad(config, tokenizer, special)
    return _glue(config, tokenizer, special)


def _squad(config, tokenizer, special) -> Task:
    version_2 = config.task == "squad_v2.0"
    sizes = dict(
        max_seq_length=config.max_seq_length,
        doc_stride=config.doc_stride,
        max_query_length=config.max_query_length,
    )
    train_examples, _ = squad.read(
        config.data.train,
        version_2=version_2,
        training=True,
        tfds_data_dir=config.data.tfds_data_dir,
    )
    eval_examples, eval_data = squad.read(
        config.data.eval,
        version_2=version_2,
        training=False,
        tfds_data_dir=config.data.tfds_data_dir,
    )
    train = squad.featurize(train_examples, tokenizer, special, training=True, **sizes).arrays
    features = squad.featurize(eval_examples, tokenizer, special, training=False, **sizes)

    def score(outputs):
        start_logits, end_logits = outputs
        predictions, null_odds = squad.predict(
            eval_examples,
            features,
            start_logits,
            end_logits,
            n_best_size=config.n_best_size,
            max_answer_length=config.max_answer_length,
            version_2=version_2,
            null_score_diff_threshold=config.null_score_diff_threshold,
        )
        files = {"predictions.json": json.dumps(predictions, indent=2)}
        if version_2:
            files["null_odds.json"] = json.dumps(null_odds, indent=2)
            metrics = squad_metrics.evaluate_v2(eval_data, predictions, null_odds)
        else:
            metrics = squad_metrics.evaluate_v1(eval_data, predictions)
        return metrics, files

    return Task(config.task, "span", 2, train, [EvalSet("", features.arrays, score)])


def _glue(config, tokenizer, special) -> Task:
    task = glue.get_task(config.task)
    read = lambda source: glue.read(task, source, config.data.tfds_data_dir)  # noqa: E731
    train = glue.featurize(read(config.data.train), tokenizer, special, config.max_seq_length)
    sources = [("", config.data.eval)]
    if task.name == "mnli":
        sources = [("matched", config.data.eval), ("mismatched", config.data.eval_mismatched)]
    eval_sets = []
    for name, source in sources:
        arrays = glue.featurize(read(source), tokenizer, special, config.max_seq_length)
        labels = arrays.pop("labels")
        eval_sets.append(EvalSet(name, arrays, _glue_scorer(task, name, labels)))
    return Task(task.name, "classifier", task.num_labels, train, eval_sets, task.labels)


def _glue_scorer(task: glue.Task, name: str, labels: np.ndarray) -> Callable:
    def score(logits):
        predicted = logits[:, 0] if task.labels is None else np.argmax(logits, axis=-1)
        metrics = glue_metrics.task_metrics(task.name, predicted, labels)
        file = f"predictions_{name}.tsv" if name else "predictions.tsv"
        return metrics, {file: "\n".join(glue.prediction_rows(task, predicted)) + "\n"}

    return score
