"""The standardization-loss study (studies/standardization_loss/config.py,
studies.standardization_loss.report): its trials are the arms the question needs, its report
picks each site's weight and reads the targets by the rule it states, and its smallest form
runs through `python -m lambjax.sweep` and `report`."""

import math
import os

import pytest

from lambjax import cli
from lambjax.sweep import report as sweep_report
from lambjax.sweep import spec
from lambjax.train import plan
from studies.standardization_loss import report as report_lib
from studies.testing import curve_records, write_sweep
from tests.helpers import REPO

CONFIG = "studies/standardization_loss/config.py"


def study_module():
    return cli.load_module(os.path.join(REPO, CONFIG))[0]


@pytest.mark.parametrize("size", ["cpu", "base"])
def test_the_trials_are_the_arms_per_optimizer_at_its_rate(size):
    module = study_module()
    study = module.SIZES[size]
    config = module.get_config(size)
    trials = spec.trials(config, module.get_sweep(size))
    weights = study["weights"]
    assert len(weights) == 3 and max(weights) / min(weights) == pytest.approx(100)
    expected = set()
    for optimizer in ("adamw", "lamb"):
        expected |= {(optimizer, "layer_norm", 0.0), (optimizer, "none", 0.0)}
        expected |= {
            (optimizer, site, w) for site in ("residual", "preactivation") for w in weights
        }
    seen = set()
    for trial in trials:
        labels = trial.labels
        seen.add((labels["optimizer"], labels["arm"], labels["weight"]))
        trial_config = config.copy_and_resolve_references()
        trial_config.update_from_flattened_dict(trial.overrides)
        devices = 256 if size == "base" else 1
        phase = plan.resolve(trial_config, vocab_size=2048, num_devices=devices).phases[0]
        assert phase.optimizer.name == labels["optimizer"]
        assert phase.schedule.learning_rate == study["learning_rates"][labels["optimizer"]]
        assert phase.schedule.num_steps == study["num_steps"]
        normalization = "layer_norm" if labels["arm"] == "layer_norm" else "none"
        assert phase.model.normalization == normalization
        assert phase.step.standardization_loss_weight == labels["weight"]
        if labels["weight"] > 0:
            assert phase.step.standardization_loss_site == labels["arm"]
    assert seen == expected
    if size == "cpu":  # the batch-scaling study's batch-32 trials: 16,384 sequences
        assert study["learning_rates"] == {"adamw": 1e-3, "lamb": 1e-2}
        assert phase.batch.global_batch_size * phase.schedule.num_steps == 16384
        assert (phase.model.num_layers, phase.model.hidden_size) == (2, 128)
    else:
        assert (phase.batch.global_batch_size, phase.batch.max_seq_length) == (2048, 128)
        assert phase.model.num_layers == 12 and phase.model.hidden_size == 768


def point(arm, weight, curve, step_time=0.1, optimizer="adamw", std_loss=None):
    finite = [loss for _, loss in curve if math.isfinite(loss)]
    return dict(
        optimizer=optimizer,
        arm=arm,
        weight=weight,
        seed=0,
        name="",
        curve=curve,
        times={step: step * step_time for step, _ in curve},
        best=min(finite) if finite else math.inf,
        final=curve[-1][1],
        step_time=step_time,
        std_loss=std_loss,
        status="finished",
    )


def test_the_report_takes_the_targets_and_each_sites_weight_by_its_rule():
    grid = [
        # LayerNorm's best, 5.0 at step 40, is the target; no normalization's, 5.3, the second.
        point("layer_norm", 0.0, [(10, 5.8), (20, 5.4), (30, 5.1), (40, 5.0)]),
        point("none", 0.0, [(10, 5.9), (20, 5.6), (30, 5.4), (40, 5.3)]),
        # Residual: 1e-3 reaches 5.0 at step 30, 1e-4 at 40: 1e-3 is the site's arm.
        point("residual", 1e-4, [(10, 5.8), (20, 5.5), (30, 5.2), (40, 5.0)], 0.2),
        point(
            "residual", 1e-3, [(10, 5.7), (20, 5.3), (30, 4.9), (40, 4.8)], 0.2, "adamw", (900, 300)
        ),
        point("residual", 1e-2, [(10, 6.0), (20, math.nan), (30, math.nan), (40, math.nan)]),
        # Pre-activations: none reaches 5.0; the lower best loss (1e-2's 5.1) wins.
        point("preactivation", 1e-4, [(10, 5.9), (20, 5.6), (30, 5.4), (40, 5.3)]),
        point("preactivation", 1e-2, [(10, 5.9), (20, 5.5), (30, 5.2), (40, 5.1)]),
    ]
    target, second, rows = report_lib.arms(grid, ["residual", "preactivation"])
    assert (target, second) == (5.0, 5.3)
    assert [(arm, p["weight"]) for arm, p in rows] == [
        ("layer_norm", 0.0),
        ("none", 0.0),
        ("residual", 1e-3),
        ("preactivation", 1e-2),
    ]
    paper = study_module().PAPER_STEPS
    table = report_lib.comparison_table(rows, target, second, paper)
    # LayerNorm: 40 steps, 4.0 s; residual: 30 steps at 0.2 s = 6.0 s, 0.75x the steps and
    # 1.5x the time; it reaches no-norm's 5.3 at step 20. The paper: 40.0 / 39.5 = 1.01.
    assert "| LayerNorm |  | 40 | 1.00 | 1.00 | 4.0 s | 1.00 | 30 | 5.0000 |" in table
    assert "| std loss, residual sums | 0.001 | 30 | 0.75 | 1.01 | 6.0 s | 1.50 | 20 |" in table
    assert "| 200 ms | 900 -> 300 |" in table
    assert "| no normalization |  | - |  | 2.26 | - |  | 40 | 5.3000 |" in table
    assert "| std loss, pre-activations | 0.01 | - |  | 1.01 | - |  | 30 | 5.1000 |" in table
    every = report_lib.grid_table(grid, target, [1e-4, 1e-3, 1e-2], ["residual", "preactivation"])
    assert "| residual | 40 / 5.000 | 30 / 4.800 | - / 6.000 |" in every
    assert "| preactivation | - / 5.300 |  | - / 5.100 |" in every


def test_the_report_answers_from_the_smallest_forms_trials(tmp_path):
    # The smallest form's sweep with made-up curves (no training), reported as `report DIR`
    # reports it: through the module the study names. The standardization-loss arms log
    # their unweighted loss, falling from 90 to 60.
    curves = {
        "layer_norm": [(2, 7.0), (4, 6.5)],
        "none": [(2, 7.2), (4, 6.8)],
        "residual": [(2, 7.1), (4, 6.6)],
        "preactivation": [(2, 6.5), (4, 6.4)],
    }

    def metrics(trial):
        records = curve_records(curves[trial.labels["arm"]])
        if trial.labels["arm"] in ("residual", "preactivation"):
            for record in records:
                record[report_lib.STD_LOSS] = 100.0 - 10 * record["step"]
        return records

    state = write_sweep(tmp_path, CONFIG, "smoke", metrics)
    assert sorted(state["trials"]) == sorted(
        f"optimizer=adamw,arm={arm},weight={weight},seed=0"
        for arm, weight in [
            ("layer_norm", "0.0"),
            ("none", "0.0"),
            ("residual", "0.01"),
            ("preactivation", "0.01"),
        ]
    )
    report = sweep_report.write_report(str(tmp_path))
    assert "## The standardization loss against LayerNorm" in report
    for name in ("loss_vs_steps", "loss_vs_time"):
        assert (tmp_path / f"standardization_loss_{name}.png").stat().st_size > 1000
    # The target is the LayerNorm trial's best held-out loss; pre-activations reach it at 2.
    assert "Target: the LayerNorm trial's best held-out MLM loss, 6.5000" in report
    assert "| std loss, pre-activations | 0.01 | 2 | 0.50 |" in report
    assert "| 90 -> 60 |" in report
    # Every reading says how fine its steps are and that one seed gives no verdict.
    assert (
        "Steps to a target are exact to the evaluation interval (every 2 steps). One seed per "
        "arm: a gap between arms is a direction, not a verdict" in report
    )
