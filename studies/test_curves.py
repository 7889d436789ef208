"""What the study reports read off a trial (studies.curves): steps and training time
to a target held-out loss, from metrics.jsonl as the training loop writes it."""

import json
import math

import pytest

from studies import curves


def test_training_time_adds_the_logged_windows():
    # Log every 5 steps; the first window (compilation) has no step time: the next one's.
    log_steps = [5, 10, 15, 20]
    step_times = [(10, 0.2), (15, 0.3), (20, 0.1)]
    times = curves.cumulative_times(log_steps, step_times)
    assert times == pytest.approx({5: 1.0, 10: 2.0, 15: 3.5, 20: 4.0})
    assert curves.time_at(times, 15) == pytest.approx(3.5)
    assert curves.time_at(times, 12) == pytest.approx(2.0 + 2 * 0.3)
    assert curves.steps_to_target([(10, 6.0), (20, 5.5), (30, 5.4)], 5.5) == 20
    assert curves.steps_to_target([(10, 6.0), (20, math.nan)], 5.5) is None


def test_a_labelled_trial_reads_as_its_curve_and_times(tmp_path):
    lines = [
        {"step": 5, "train/loss": 7.0},
        {"step": 10, "train/loss": 6.5, "train/step_time_s": 0.2, "eval/mlm_loss": 6.4},
        {"step": 15, "train/loss": 6.0, "train/step_time_s": 0.4},
        {"step": 20, "train/loss": 5.9, "train/step_time_s": 0.3, "eval/mlm_loss": 5.8},
    ]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    trials = {"a": {"labels": {"arm": "x"}}, "b": {"labels": {"arm": "y"}}, "c": {}}
    runs = {name: run for name, _, run in curves.labelled(str(tmp_path), trials)}
    assert sorted(runs) == ["a", "b"]  # "c" has no labels; "b" has not started
    a = runs["a"]
    assert a["curve"] == [(10, 6.4), (20, 5.8)]
    assert (a["best"], a["final"], a["step_time"]) == (5.8, 5.8, 0.3)
    assert a["times"] == pytest.approx({5: 1.0, 10: 2.0, 15: 4.0, 20: 5.5})
    assert runs["b"]["curve"] == [] and runs["b"]["best"] == math.inf


def test_a_steps_count_is_exact_to_its_evaluation_interval():
    curve = [(16, 6.0), (32, 5.7), (48, 5.5), (64, 5.4)]
    assert curves.target_bracket(curve, 5.6) == (32, 48)
    assert curves.target_bracket(curve, 6.5) == (0, 16)
    assert curves.target_bracket(curve, 5.0) is None
    # 192 read every 32 steps against 144 read every 16: 160/144 ... 192/128.
    assert curves.ratio_range((160, 192), (128, 144)) == pytest.approx((160 / 144, 1.5))
    assert curves.ratio_range((32, 48), (0, 16)) == (2.0, math.inf)


@pytest.mark.parametrize(
    "gap, band, seeds, expected",
    [
        (0.01, 0.02, 3, "comparable"),
        (-0.05, 0.02, 3, "better"),
        (0.05, 0.02, 5, "worse"),
        # Two seeds: one sample of the noise, so no verdict, only the gap against it.
        (0.15, 0.05, 2, "inconclusive (3.0x the seed spread, higher)"),
        (-0.15, 0.05, 2, "inconclusive (3.0x the seed spread, lower)"),
        (0.01, 0.05, 2, "inconclusive (0.2x the seed spread)"),
        (0.01, math.nan, 3, "-"),
        (math.nan, 0.1, 3, "-"),
    ],
)
def test_a_gap_is_a_verdict_only_against_a_spread_of_enough_seeds(gap, band, seeds, expected):
    assert curves.seed_verdict(gap, band, seeds) == expected


def test_a_report_says_what_its_steps_and_gaps_can_carry():
    points = [
        {"arm": "a", "seed": 0, "curve": [(20, 6.0), (40, 5.8), (60, 5.6)]},
        {"arm": "b", "seed": 0, "curve": [(20, 6.1), (40, 5.9), (50, 5.7)]},
    ]
    every = [*points, {"arm": "a", "seed": 1, "curve": []}]
    assert curves.fewest_seeds(points, every, ("arm",)) == 1  # b ran once
    assert curves.fewest_seeds(points[:1], every, ("arm",)) == 2
    note = curves.reading_note(points, 1)
    assert note.startswith("Steps to a target are exact to the evaluation interval (every 10, 20")
    assert "One seed per arm: a gap between arms is a direction, not a verdict, until 3" in note
    assert "seed" not in curves.reading_note(points, 3)
