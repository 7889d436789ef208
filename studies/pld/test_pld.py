"""The PLD study (studies/pld/config.py, studies.pld.report): its trials are the arms it
names with DeepSpeed's recipe, its report picks the baseline and the arms by the rule it
states (with round-robin step times where studies/pld/benchmark.py wrote them), and its
smallest form runs through `python -m lambjax.sweep` and `report`."""

import json
import math
import os

import pytest

from lambjax import cli
from lambjax.sweep import report as sweep_report
from lambjax.sweep import spec
from lambjax.train import plan
from studies.pld import report as pld
from studies.testing import curve_records, write_sweep
from tests.helpers import REPO

CONFIG = "studies/pld/config.py"


def study_module():
    return cli.load_module(os.path.join(REPO, CONFIG))[0]


@pytest.mark.parametrize("size", ["cpu", "base"])
def test_the_trials_are_the_arms_with_deepspeeds_recipe(size):
    module = study_module()
    study = module.SIZES[size]
    config = module.get_config(size)
    trials = spec.trials(config, module.get_sweep(size))
    post, pre = study["postln_learning_rates"], study["preln_learning_rates"]
    # At the pod size both gammas; at the CPU size, 400 steps, only 100/T drops layers.
    gammas = {"cpu": ("100/T",), "base": ("0.001", "100/T")}[size]
    assert tuple(module.get_study(size)["gammas"]) == gammas
    assert max(pre) > max(post)  # the PreLN grid reaches higher
    steps = study["num_steps"]
    expected = {("postln", None, lr, 0) for lr in post} | {("preln", None, lr, 0) for lr in pre}
    expected |= {("pld", gamma, lr, 0) for gamma in gammas for lr in pre}
    if size == "cpu":  # the second seed at the middle rates, fixed with the grid
        expected |= {("postln", None, 1e-3, 1), ("pld", "100/T", 2e-3, 1)}
    assert len(trials) == len(expected)
    seen = set()
    for trial in trials:
        o, labels = trial.overrides, trial.labels
        seen.add((labels["arm"], labels.get("gamma"), labels["lr"], labels["seed"]))
        assert o["seed"] == labels["seed"]
        assert o["model.overrides.layer_norm"] == ("post" if labels["arm"] == "postln" else "pre")
        assert o["layer_drop.enabled"] == (labels["arm"] == "pld")
        if labels["arm"] == "pld":
            gamma = {"0.001": 0.001, "100/T": 100 / steps}[labels["gamma"]]
            assert o["layer_drop.gamma"] == pytest.approx(gamma)
        trial_config = config.copy_and_resolve_references()
        trial_config.update_from_flattened_dict(o)
        devices = 256 if size == "base" else 1
        run_plan = plan.resolve(trial_config, vocab_size=2048, num_devices=devices)
        phase = run_plan.phases[0]
        assert phase.optimizer.name == "adamw"
        # DeepSpeed's Adam leaves the bias; 400 steps need it corrected (the config says why)
        assert phase.optimizer.bias_correction == (size == "cpu")
        assert phase.schedule.warmup_fraction == 0.02
        assert phase.schedule.learning_rate == labels["lr"]
        if labels["arm"] == "pld":
            assert phase.step.layer_drop.depth_rule == "deepspeed"
            assert phase.step.layer_drop.theta_bar == 0.5
    assert seen == expected
    if size == "base":  # DeepSpeed's batch, sequence and micro-batch on 256 devices
        assert (phase.batch.global_batch_size, phase.batch.max_seq_length) == (4096, 128)
        assert phase.model.num_layers == 12 and phase.model.hidden_size == 768


def point(arm, lr, curve, gamma=None, step_time=0.1):
    times = {step: step * step_time for step, _ in curve}
    finite = [loss for _, loss in curve if math.isfinite(loss)]
    return dict(
        arm=arm,
        gamma=gamma,
        lr=lr,
        seed=0,
        name="",
        curve=curve,
        times=times,
        best=min(finite) if finite else math.inf,
        final=curve[-1][1],
        step_time=step_time,
        layers_run=None,
        status="finished",
    )


def test_the_report_takes_the_baseline_and_the_arms_by_its_rule():
    grid = [
        # PostLN: 1e-3 has the lowest best loss (5.0 at step 30): the target.
        point("postln", 5e-4, [(10, 6.0), (20, 5.5), (30, 5.2)]),
        point("postln", 1e-3, [(10, 5.8), (20, 5.3), (30, 5.0)]),
        point("postln", 2e-3, [(10, 7.0), (20, math.nan), (30, math.nan)]),
        # PLD: 4e-3 reaches 5.0 first (step 20); 2e-3 also reaches it, later.
        point("pld", 2e-3, [(10, 5.6), (20, 5.1), (30, 4.9)], "0.001", 0.08),
        point("pld", 4e-3, [(10, 5.5), (20, 4.95), (30, 4.99)], "0.001", 0.08),
        # The other gamma: nothing reaches the target, the lower best loss wins.
        point("pld", 2e-3, [(10, 5.6), (20, 5.2), (30, 5.05)], "100/T", 0.07),
        point("pld", 4e-3, [(10, 5.6), (20, 5.3), (30, 5.1)], "100/T", 0.07),
        point("preln", 2e-3, [(10, 5.6), (20, 5.2), (30, 5.0)]),
        point("preln", 4e-3, [(10, 5.7), (20, 5.3), (30, 5.1)]),
    ]
    base = pld.baseline(grid)
    assert base["lr"] == 1e-3 and base["best"] == 5.0
    rows = pld.arms(grid, base["best"], ["0.001", "100/T"])
    assert [(label, p["arm"], p["lr"]) for label, p in rows] == [
        ("PreLN + PLD, gamma 0.001, best lr", "pld", 4e-3),
        ("PreLN alone at that lr (0.004)", "preln", 4e-3),
        ("PreLN + PLD, gamma 100/T, best lr", "pld", 2e-3),
        ("PreLN alone at that lr (0.002)", "preln", 2e-3),
        ("PreLN alone, best lr", "preln", 2e-3),
    ]
    table = pld.comparison_table(base, rows, base["best"])
    # Baseline: 30 steps, 3.0 s; PLD: 20 steps at 0.08 s = 1.6 s: 1.5x the steps, 1.88x the time.
    assert "| PreLN + PLD, gamma 0.001, best lr | 0.004 | 20 | 1.50x | 1.6 s | 1.88x | 80 ms |" in (
        table
    )
    assert "| PreLN + PLD, gamma 100/T, best lr | 0.002 | - |  | - |  | 70 ms | 0.70 |" in table


def write_trial(directory, name, labels, curve, step_time, layers_run=None):
    """A trial's metrics.jsonl: a log record every 5 steps, evaluations as `curve`."""
    (directory / name).mkdir()
    evals = dict(curve)
    lines = []
    for step in range(5, max(evals) + 1, 5):
        record = {"step": step, "train/loss": 6.0, "train/step_time_s": step_time}
        if layers_run is not None:
            record[pld.LAYERS_RUN] = layers_run
        if step in evals:
            record["eval/mlm_loss"] = evals[step]
        lines.append(json.dumps(record))
    (directory / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return name, {"labels": labels, "status": "finished", "wall_time_s": 1.0}


def test_the_report_times_the_arms_round_robin_where_they_were_timed_so(tmp_path):
    study = {"num_steps": 30, "gammas": {"100/T": 100 / 30}, "theta_bar": 0.5, "paper_speedup": 2.5}
    trials = dict(
        [
            write_trial(
                tmp_path,
                "b0",
                dict(arm="postln", lr=1e-3, seed=0),
                [(10, 6.0), (20, 5.5), (30, 5.0)],
                0.1,
            ),
            write_trial(
                tmp_path,
                "b1",
                dict(arm="postln", lr=1e-3, seed=1),
                [(10, 6.0), (20, 5.4), (30, 5.1)],
                0.1,
            ),
            # PLD logged slow steps (it ran while the machine was busier): 0.2 s.
            write_trial(
                tmp_path,
                "p0",
                dict(arm="pld", gamma="100/T", lr=2e-3, seed=0),
                [(10, 5.8), (20, 5.0), (30, 4.9)],
                0.2,
                layers_run=3.25,
            ),
            write_trial(
                tmp_path,
                "p1",
                dict(arm="pld", gamma="100/T", lr=2e-3, seed=1),
                [(10, 5.9), (20, 5.2), (30, 4.95)],
                0.2,
                layers_run=3.25,
            ),
            write_trial(
                tmp_path,
                "r0",
                dict(arm="preln", lr=2e-3, seed=0),
                [(10, 5.9), (20, 5.3), (30, 5.1)],
                0.1,
            ),
        ]
    )
    # From the logged step times: 20 steps x 0.2 s against the baseline's 30 x 0.1 s.
    logged = pld.study_report(str(tmp_path), trials, study)
    assert "the median logged step" in logged
    pld_row = "| PreLN + PLD, gamma 100/T, best lr | 0.002 | 20 | 1.50x |"
    assert f"{pld_row} 4.0 s | 0.75x | 200 ms | 2.00 | 3.25 |" in logged
    # Timed round-robin: 20 x 0.075 s = 1.5 s, 2x faster than the baseline's 3.0 s.
    timed = {"arm=postln": 0.1, "arm=pld,gamma=100/T": 0.075, "arm=preln": 0.1}
    (tmp_path / "step_times.json").write_text(
        json.dumps({"step_time_s": timed, "rounds": 7, "load_average": [3.5, 2.5]})
    )
    report = pld.study_report(str(tmp_path), trials, study)
    assert "7 rounds of one step of each arm in one process, the median; load average 2.5-3.5" in (
        report
    )
    assert (
        "| PostLN baseline, best lr | 0.001 | 30 | 1.00x | 3.0 s | 1.00x | 100 ms | 1.00 |"
        in report
    )
    assert f"{pld_row} 1.5 s | 2.00x | 75 ms | 0.75 | 3.25 |" in report
    # The second seed: best losses, and PLD's gap to PostLN within each seed.
    assert "| arm | lr | seed 0 | seed 1 |" in report
    assert "| PostLN | 0.001 | 5.0000 | 5.1000 |" in report
    assert "| PreLN + PLD, gamma 100/T | 0.002 | 4.9000 (-0.1000) | 4.9500 (-0.1500) |" in report


def test_the_report_answers_from_the_smallest_forms_trials(tmp_path):
    # The smallest form's sweep with made-up curves (no training), reported as `report DIR`
    # reports it: through the module the study names. PLD runs 3.5 of 4 layers a step.
    curves = {
        "postln": ([(2, 7.0), (4, 6.5)], 0.1),
        "pld": ([(2, 6.5), (4, 6.45)], 0.08),
        "preln": ([(2, 6.8), (4, 6.6)], 0.1),
    }

    def metrics(trial):
        arm = trial.labels["arm"]
        logged = {pld.LAYERS_RUN: 3.5} if arm == "pld" else {}
        return curve_records(*curves[arm], **logged)

    state = write_sweep(tmp_path, CONFIG, "smoke", metrics)
    assert sorted(state["trials"]) == sorted(
        [
            "arm=postln,lr=0.001,seed=0",
            "arm=pld,gamma=100_T,lr=0.002,seed=0",
            "arm=preln,lr=0.002,seed=0",
        ]
    )
    report = sweep_report.write_report(str(tmp_path))
    assert "## PLD against the PostLN baseline" in report
    for name in ("pld_loss_vs_steps.png", "pld_loss_vs_time.png", "pld_learning_rates.png"):
        assert (tmp_path / name).stat().st_size > 1000
    # The target is the PostLN trial's best, 6.5 at step 4 (0.4 s); PLD reaches it at step
    # 2 in 2 x 0.08 s.
    assert "Target: the PostLN baseline's best held-out MLM loss, 6.5000" in report
    assert "| PreLN + PLD, gamma 100/T, best lr | 0.002 | 2 | 2.00x | 0.2 s | 2.50x |" in report
    assert "the median logged step" in report  # no step_times.json here
    # Every reading says how fine its steps are and that one seed gives no verdict.
    assert (
        "Steps to a target are exact to the evaluation interval (every 2 steps). One seed per "
        "arm: a gap between arms is a direction, not a verdict" in report
    )
