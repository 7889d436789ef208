"""GLUE's metrics, by their published definitions, and which of them each task reports.

accuracy; F1 of the positive class (label 1: MRPC's paraphrase, QQP's duplicate); Matthews
correlation (CoLA); Pearson and Spearman correlation (STS-B; Spearman on average ranks of
ties). MNLI reports its matched and mismatched accuracy (two evaluation sets).

References:
  Wang et al., "GLUE: A Multi-Task Benchmark and Analysis Platform for Natural Language
  Understanding", 2019.
"""

import numpy as np


def accuracy(predictions, labels) -> float:
    return float(np.mean(np.asarray(predictions) == np.asarray(labels)))


def f1_binary(predictions, labels) -> float:
    """F1 of class 1; 0 when there is no true positive."""
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    true_positive = float(np.sum((predictions == 1) & (labels == 1)))
    if true_positive == 0:
        return 0.0
    precision = true_positive / np.sum(predictions == 1)
    recall = true_positive / np.sum(labels == 1)
    return float(2 * precision * recall / (precision + recall))


def matthews_corrcoef(predictions, labels) -> float:
    """(TP TN - FP FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)), 0 where undefined."""
    predictions, labels = np.asarray(predictions) == 1, np.asarray(labels) == 1
    tp = float(np.sum(predictions & labels))
    tn = float(np.sum(~predictions & ~labels))
    fp = float(np.sum(predictions & ~labels))
    fn = float(np.sum(~predictions & labels))
    denominator = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return float((tp * tn - fp * fn) / denominator) if denominator else 0.0


def pearson(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    x, y = x - x.mean(), y - y.mean()
    denominator = np.sqrt(np.sum(x * x) * np.sum(y * y))
    return float(np.sum(x * y) / denominator) if denominator else 0.0


def average_ranks(values) -> np.ndarray:
    """Ranks from 1, tied values sharing the mean of their ranks."""
    values = np.asarray(values)
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values), np.float64)
    sorted_values = values[order]
    start = 0
    while start < len(values):
        end = start
        while end + 1 < len(values) and sorted_values[end + 1] == sorted_values[start]:
            end += 1
        ranks[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(x, y) -> float:
    return pearson(average_ranks(x), average_ranks(y))


# Task -> the metrics it reports (GLUE's leaderboard).
TASK_METRICS = {
    "cola": ("matthews_corrcoef",),
    "sst2": ("accuracy",),
    "mrpc": ("accuracy", "f1"),
    "stsb": ("pearson", "spearman"),
    "qqp": ("accuracy", "f1"),
    "mnli": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
}
_FUNCTIONS = {
    "accuracy": accuracy,
    "f1": f1_binary,
    "matthews_corrcoef": matthews_corrcoef,
    "pearson": pearson,
    "spearman": spearman,
}


def task_metrics(task: str, predictions, labels) -> dict[str, float]:
    """The task's metrics of `predictions` (class ids, or scores for STS-B) against labels."""
    return {name: _FUNCTIONS[name](predictions, labels) for name in TASK_METRICS[task]}
