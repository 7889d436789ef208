"""SQuAD and GLUE metrics against hand-worked cases from their published definitions, and
the squad_eval command as a user runs it."""

import json
import sys

import numpy as np
import pytest
import scipy.stats

from lambjax.finetune import glue_metrics, squad_metrics
from tests import helpers


def squad_file(questions, version="1.1"):
    paragraphs = [
        {"context": "unused", "qas": [{"id": qid, "question": "?", "answers": answers}]}
        for qid, answers in questions
    ]
    return {"version": version, "data": [{"title": "t", "paragraphs": paragraphs}]}


def answers(*texts):
    return [{"text": t, "answer_start": 0} for t in texts]


V1 = squad_file(
    [
        ("q1", answers("Denver Broncos", "The Denver Broncos")),
        ("q2", answers("cat sat down")),
        ("q3", answers("anything")),
    ]
)
V1_PREDICTIONS = {"q1": "denver  broncos!", "q2": "the cat sat"}  # q3 unanswered
V2 = squad_file(
    [
        ("q1", answers("cat sat down")),
        ("q2", []),
        ("q3", []),
        ("q4", answers("Paris")),
    ],
    version="v2.0",
)
V2_PREDICTIONS = {"q1": "cat sat", "q2": "", "q3": "dog", "q4": "paris."}
V2_ODDS = {"q1": 0.2, "q2": 0.9, "q3": 0.6, "q4": 0.1}


def test_normalisation_and_token_f1():
    assert squad_metrics.normalize_answer("The  Cat's, hat!") == "cats hat"
    assert squad_metrics.normalize_answer("an apple a day") == "apple day"
    # pred {cat, sat} against gold {cat, sat, down}: precision 1, recall 2/3.
    assert squad_metrics.f1_score("a cat sat", "the cat sat down") == pytest.approx(0.8)
    assert squad_metrics.f1_score("", "") == 1.0  # v2.0: both empty match
    assert squad_metrics.f1_score("", "cat") == 0.0


def test_v1_exact_and_f1_max_over_gold_unanswered_zero():
    result = squad_metrics.evaluate_v1(V1["data"], V1_PREDICTIONS)
    # q1 matches its first gold after normalisation; q2 F1 0.8, EM 0; q3 scores 0.
    assert result == pytest.approx({"exact_match": 100 / 3, "f1": 100 * 1.8 / 3})


def test_v2_splits_and_best_thresholds():
    result = squad_metrics.evaluate_v2(V2["data"], V2_PREDICTIONS, V2_ODDS)
    # Per question (exact, f1): q1 (0, 0.8), q2 (1, 1), q3 (0, 0), q4 (1, 1).
    # Best thresholds, all-null start = 2 (the two NoAns), odds ascending q4 q1 q3 q2:
    # exact 2+1 = 3 at q4 (0.1); f1 2+1+0.8 = 3.8 at q1 (0.2), then q3 costs 1.
    assert list(result) == [
        "exact", "f1", "total", "HasAns_exact", "HasAns_f1", "HasAns_total",
        "NoAns_exact", "NoAns_f1", "NoAns_total",
        "best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh",
    ]  # fmt: skip
    assert result == pytest.approx(
        {
            "exact": 50.0, "f1": 70.0, "total": 4,
            "HasAns_exact": 50.0, "HasAns_f1": 90.0, "HasAns_total": 2,
            "NoAns_exact": 50.0, "NoAns_f1": 50.0, "NoAns_total": 2,
            "best_exact": 75.0, "best_exact_thresh": 0.1,
            "best_f1": 95.0, "best_f1_thresh": 0.2,
        }
    )  # fmt: skip
    # Above a 0.5 threshold q2 and q3 count as answered "": both right.
    at_half = squad_metrics.evaluate_v2(V2["data"], V2_PREDICTIONS, V2_ODDS, 0.5)
    assert (at_half["exact"], at_half["f1"]) == pytest.approx((75.0, 95.0))


def test_glue_metrics_by_hand_and_against_scipy():
    predictions, labels = [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]  # TP 2, FP 1, FN 1, TN 1
    assert glue_metrics.accuracy(predictions, labels) == pytest.approx(0.6)
    assert glue_metrics.f1_binary(predictions, labels) == pytest.approx(2 / 3)
    assert glue_metrics.matthews_corrcoef(predictions, labels) == pytest.approx(1 / 6)
    assert glue_metrics.matthews_corrcoef([1, 1, 1], [1, 0, 1]) == 0.0  # undefined -> 0
    assert glue_metrics.pearson([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    # Ties share their mean rank: x ranks 1, 2.5, 2.5, 4.
    assert glue_metrics.spearman([1, 2, 2, 3], [10, 20, 30, 40]) == pytest.approx(
        4.5 / np.sqrt(22.5)
    )
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 5, 50), rng.normal(size=50)
    assert glue_metrics.spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x, y).statistic)
    assert glue_metrics.pearson(x, y) == pytest.approx(scipy.stats.pearsonr(x, y).statistic)
    assert glue_metrics.task_metrics("stsb", x, y).keys() == {"pearson", "spearman"}
    assert glue_metrics.task_metrics("mrpc", predictions, labels) == pytest.approx(
        {"accuracy": 0.6, "f1": 2 / 3}
    )


def squad_eval(*args):
    return helpers.run(
        [sys.executable, "-m", "lambjax.finetune.squad_eval", *map(str, args)], 1, check=False
    )


def write(path, value):
    path.write_text(json.dumps(value))
    return path


def test_squad_eval_command(tmp_path):
    v1 = squad_eval(write(tmp_path / "v1.json", V1), write(tmp_path / "p1.json", V1_PREDICTIONS))
    assert v1.returncode == 0, v1.stderr
    assert json.loads(v1.stdout) == pytest.approx({"exact_match": 100 / 3, "f1": 60.0})
    assert "Unanswered question q3 will receive score 0." in v1.stderr
    v2 = squad_eval(
        write(tmp_path / "v2.json", V2),
        write(tmp_path / "p2.json", V2_PREDICTIONS),
        "--na-prob-file",
        write(tmp_path / "odds.json", V2_ODDS),
    )
    assert v2.returncode == 0, v2.stderr
    assert json.loads(v2.stdout)["best_f1"] == pytest.approx(95.0)
    (tmp_path / "broken.json").write_text('{"data": [')
    for args, expected in (
        ((tmp_path / "missing.json", tmp_path / "p1.json"), "no such file"),
        ((tmp_path / "broken.json", tmp_path / "p1.json"), "is not valid JSON"),
        ((tmp_path / "v1.json", write(tmp_path / "list.json", [1])), "one JSON object"),
    ):
        result = squad_eval(*args)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr
