"""The equal-compute study (studies/equal_compute/config.py, studies.equal_compute.report):
every arm's cap is the baseline's FLOPs in its own steps, every arm runs a 4-point grid and
ends at the target; the report counts FLOPs as the arm spends them and reads a speed-up as a
verdict only with 3 seeds. (Its arms' runs are the core's: the target's end, PLD and the MSLT
stages each have their own end-to-end tests under tests/train.)"""

import math
import os

import pytest

from lambjax import cli
from lambjax.sweep import report as sweep_report
from lambjax.sweep import spec
from lambjax.train import plan, throughput
from lambjax.train.layer_drop import LayerDrop
from studies.equal_compute import report as equal_compute
from studies.testing import curve_records, write_sweep
from tests.helpers import REPO

CONFIG = "studies/equal_compute/config.py"


def study_module():
    return cli.load_module(os.path.join(REPO, CONFIG))[0]


def resolved(config, overrides):
    trial_config = config.copy_and_resolve_references()
    trial_config.update_from_flattened_dict(overrides)
    return plan.resolve(trial_config, vocab_size=trial_config.data.vocab_size, num_devices=1)


def run_flops(run_plan):
    """The FLOPs of a resolved run's every step, by lambjax's own count."""
    return sum(phase.num_steps * throughput.phase_step_flops(phase) for phase in run_plan.phases)


@pytest.mark.parametrize("size", ["cpu", "base"])
def test_every_arm_gets_the_baselines_flops_and_a_four_point_grid(size):
    module = study_module()
    study = module.SIZES[size]
    config = module.get_config(size)
    trials = spec.trials(config, module.get_sweep(size))
    assert {t.labels["arm"] for t in trials} == set(module.ARMS)
    for arm in module.ARMS:
        assert len([t for t in trials if t.labels["arm"] == arm]) == 4
    budget = module.budget_flops(study)
    for arm in module.ARMS:
        trial = next(t for t in trials if t.labels["arm"] == arm)
        run_plan = resolved(config, trial.overrides)
        assert run_plan.target.value == study["target_loss"]
        if arm == "pld":
            # Within one step's FLOPs of the budget, with the layers run as expected.
            steps = run_plan.phases[0].num_steps
            spent = sum(module.step_flops(study, module.pld_layers(study, t)) for t in range(steps))
            assert budget - module.step_flops(study, study["num_layers"]) < spent <= budget
            assert run_plan.phases[0].model.layer_norm == "pre" and steps > study["budget_steps"]
        else:
            spent = run_flops(run_plan)
            assert budget - throughput.phase_step_flops(run_plan.phases[-1]) < spent <= budget
        if arm == "mslt":
            assert [p.model.num_layers for p in run_plan.phases] == [3, 6, 12, 12]
            assert [p.step.num_frozen_layers for p in run_plan.phases] == [0, 3, 6, 0]
        for phase in run_plan.phases:  # warm up, then hold the rate
            assert phase.schedule.warmup_fraction * phase.num_steps == pytest.approx(
                study["warmup_steps"]
            )


def test_the_step_flops_are_lambjaxs_own_count():
    module = study_module()
    study = module.SIZES["cpu"]
    model = module.bert(study)
    args = (study["batch_size"], study["max_seq_length"], study["max_predictions_per_seq"])
    assert module.step_flops(study, 12) == throughput.train_step_flops(model, *args)
    assert module.step_flops(study, 12, frozen=6) == throughput.train_step_flops(
        model, *args, num_frozen_layers=6
    )
    # theta from 1 to theta_bar: all 12 layers at step 0, 12 - 0.5 * 11 / 2 at the end, and
    # at every step the sum of the train step's own keep probabilities (lambjax's LayerDrop).
    assert module.pld_layers(study, 0) == 12
    assert module.pld_layers(study, 10**6) == pytest.approx(12 - 0.5 * 11 / 2)
    gamma = module.PLD_GAMMA_TIMES_T / study["budget_steps"]
    drop = LayerDrop(theta_bar=module.THETA_BAR, gamma=gamma, depth_rule="deepspeed")
    for step in (1, 10, 100, 1000):
        expected = float(drop.keep_probabilities(step, study["num_layers"]).sum())
        assert module.pld_layers(study, step) == pytest.approx(expected, rel=1e-6)


def test_stage_two_adds_the_extensions_and_the_best_and_fallback_rates_seeds():
    module = study_module()
    stage1 = spec.trials(module.get_config("smoke"), module.get_sweep("smoke"))
    both = spec.trials(module.get_config("smoke"), module.get_sweep("smoke,stage2"))
    assert [t.name for t in both[len(stage1) :]] == [
        "arm=pld,lr=0.004,seed=0",
        "arm=postln,lr=0.001,seed=1",
        "arm=mslt,lr=0.0005,seed=1",
    ]


def test_flops_follow_what_each_arm_runs():
    flops = {
        "num_layers": 4,
        "full": 100.0,
        "layer": 20.0,
        "stages": [30.0, 50.0, 80.0],
        "stage_steps": 2,
    }
    rows = [(1, {}), (2, {}), (4, {}), (6, {}), (8, {})]
    assert equal_compute.cumulative_flops("postln", rows, flops)[8] == 800
    # Stages of 2 steps at 30, 50 and 80, then the full model.
    assert equal_compute.cumulative_flops("mslt", rows, flops) == {
        1: 30,
        2: 60,
        4: 160,
        6: 320,
        8: 520,
    }
    pld_rows = [(2, {"train/pld_layers_run": 4.0}), (4, {"train/pld_layers_run": 3.0})]
    assert equal_compute.cumulative_flops("pld", pld_rows, flops) == {2: 200, 4: 360}


def point(arm, lr, seed, flops, best=5.0):
    return dict(
        arm=arm,
        lr=lr,
        seed=seed,
        flops=flops,
        best=best,
        steps=None if math.isinf(flops) else 10,
        seconds=1.0,
        curve=[(10, best)],
        status="finished",
    )


def test_the_verdict_needs_three_seeds_and_a_gap_beyond_their_range():
    every = [
        point("postln", 1e-3, 0, 0.50),
        point("postln", 2e-3, 0, math.inf, 6.0),
        point("postln", 1e-3, 1, 0.52),
        point("postln", 1e-3, 2, 0.48),
        point("pld", 1e-3, 0, 0.45),
        point("pld", 2e-3, 0, 0.40),
        point("pld", 2e-3, 1, 0.41),
        point("pld", 2e-3, 2, 0.39),
        point("mslt", 1e-3, 0, 0.49),
    ]
    arms = equal_compute.chosen(every)
    assert [p["lr"] for p in arms["postln"]] == [1e-3] * 3 and arms["pld"][0]["lr"] == 2e-3
    table = equal_compute.comparison_table(arms)
    assert (
        "| PreLN + PLD | 0.002 | 3 | 0.400, 0.410, 0.390 (mean 0.400, range 0.020) "
        "| 1.25x | better |" in table
    )
    assert (
        "| PostLN, MSLT stages | 0.001 | 1 | 0.490 (mean 0.490, range 0.000) | 1.02x "
        "| none yet (1 seed)" in table
    )


def test_a_seed_that_misses_at_the_chosen_rate_sends_the_arm_to_the_rate_below():
    every = [
        point("postln", 5e-4, 0, 0.58),
        point("postln", 1e-3, 0, 0.47),  # seed 0's best
        point("postln", 1e-3, 1, math.inf),  # on the plateau to its cap
        point("postln", 1e-3, 2, 0.50),
        point("postln", 2e-3, 0, math.inf),
        point("pld", 1e-3, 0, 0.55),
        point("pld", 1e-3, 1, 0.57),
        point("pld", 1e-3, 2, 0.53),
    ]
    assert equal_compute.fallback_settings(every) == {"postln": 5e-4}
    assert "postln" not in equal_compute.reliable(every)  # 5e-4 has one seed so far
    assert "| none yet (no baseline rate) |" in equal_compute.comparison_table(
        equal_compute.reliable(every)
    )
    table = equal_compute.comparison_table(equal_compute.chosen(every))
    assert "| PostLN (baseline) | 0.001 | 3 | 0.470, -, 0.500 (mean -, range -) " in table
    assert "| - | 2 of 3 seeds reached the target |" in table
    assert "| PreLN + PLD | 0.001 | 3 | 0.550, 0.570, 0.530 (mean 0.550, range 0.040) " in table
    assert "| - | - (a baseline seed missed) |" in table
    # The rate below, once its seeds have run: every seed reaches, so it is the reading.
    every += [point("postln", 5e-4, 1, 0.60), point("postln", 5e-4, 2, 0.62)]
    arms = equal_compute.reliable(every)
    assert [p["lr"] for p in arms["postln"]] == [5e-4] * 3 and arms["pld"][0]["lr"] == 1e-3
    table = equal_compute.comparison_table(arms)
    # Baseline mean 0.600 (range 0.040), PLD 0.550 (range 0.040): 0.050 beyond the range.
    assert "| PreLN + PLD | 0.001 | 3 | 0.550, 0.570, 0.530 (mean 0.550, range 0.040) " in table
    assert "| 1.09x | better |" in table


def test_stage_two_follows_the_rule_from_stage_ones_grid():
    every = [
        point("postln", 1e-3, 0, 0.5),
        point("postln", 2e-3, 0, 0.4),  # top edge: extend up
        point("pld", 1e-3, 0, math.inf),
        point("pld", 2e-3, 0, math.inf),  # none: both ways
        point("mslt", 1e-3, 0, 0.6),
        point("mslt", 2e-3, 0, 0.7),
        point("mslt", 4e-3, 0, 0.8),
    ]
    every[3]["status"] = "diverged"  # ended: a miss, as one that never reached the target
    every[-1]["status"] = "running"  # an arm whose grid has not finished is left out
    extensions, best = equal_compute.stage2_settings(every)
    assert extensions == {"postln": (4e-3,), "pld": (5e-4, 4e-3)}
    assert best == {"postln": 2e-3}


def test_the_report_answers_from_the_smallest_forms_trials(tmp_path):
    curves = {
        "postln": [(1, 7.7), (2, 7.6)],
        "pld": [(1, 7.62)],
        "mslt": [(1, 7.8), (2, 7.7), (3, 7.64)],
    }
    write_sweep(
        tmp_path,
        CONFIG,
        "smoke",
        lambda t: curve_records(curves[t.labels["arm"]], **{"train/pld_layers_run": 1.5}),
    )
    report = sweep_report.write_report(str(tmp_path))
    assert "## Equal compute: PLD and MSLT against PostLN at the same FLOPs" in report
    for name in ("equal_compute_loss_vs_flops.png", "equal_compute_learning_rates.png"):
        assert (tmp_path / name).stat().st_size > 1000
    study = study_module().get_study("smoke")
    full = study["flops"]["full"]
    # PostLN reaches 7.65 at step 2: 2 full steps. PLD at step 1 with 1.5 of 2 layers.
    assert f"| PostLN (baseline) | 0.001 | 1 | {2 * full / study['budget_flops']:.3f}" in report
    pld = (full - 0.5 * study["flops"]["layer"]) / study["budget_flops"]
    assert f"| PreLN + PLD | 0.002 | 1 | {pld:.3f}" in report
