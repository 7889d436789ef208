"""The MSLT study (studies/mslt/config.py, studies.mslt.report): its trials are the arms
its question names, its report picks the baseline and the arms by the rule it states, and
its smallest form runs through `python -m lambjax.sweep` and `report`."""

import math
import os

import pytest

from lambjax import cli
from lambjax.sweep import report as sweep_report
from lambjax.sweep import spec
from lambjax.train import plan
from studies.mslt import report as mslt
from studies.testing import curve_records, write_sweep
from tests.helpers import REPO

CONFIG = "studies/mslt/config.py"


def study_module():
    return cli.load_module(os.path.join(REPO, CONFIG))[0]


def resolved(config, overrides, num_devices):
    trial_config = config.copy_and_resolve_references()
    trial_config.update_from_flattened_dict(overrides)
    return plan.resolve(trial_config, vocab_size=2048, num_devices=num_devices).phases


@pytest.mark.parametrize("size", ["cpu", "base"])
def test_the_trials_are_the_arms_of_the_question(size):
    module = study_module()
    study = module.SIZES[size]
    config = module.get_config(size)
    trials = spec.trials(config, module.get_sweep(size))
    rates = study["learning_rates"]
    assert {(t.labels["arm"], t.labels["lr"]) for t in trials} == {
        (arm, lr) for arm in module.ARMS for lr in rates
    }
    assert trials[0].labels["arm"] == "baseline"
    depth, steps = study["num_layers"], study["num_steps"]
    stage_depths = (1, 2, 4) if size == "cpu" else (3, 6, 12)
    share = steps // 3
    devices = 256 if size == "base" else 1
    for trial in trials:
        arm, lr = trial.labels["arm"], trial.labels["lr"]
        phases = resolved(config, trial.overrides, devices)
        assert all(p.schedule.learning_rate == lr for p in phases)
        assert all(p.optimizer.name == "lamb" for p in phases)
        if arm == "baseline":  # the full model, one phase, one schedule
            [phase] = phases
            assert (phase.model.num_layers, phase.step.num_frozen_layers) == (depth, 0)
            assert (phase.num_steps, phase.schedule.num_steps) == (steps, steps)
            continue
        # The MSLT arms: the variant's growth and steps, then the final all-layer phase.
        assert [p.model.num_layers for p in phases] == [*stage_depths, depth]
        assert [p.num_steps for p in phases] == [share] * 3 + [study["final_steps"]]
        frozen = [p.step.num_frozen_layers for p in phases]
        assert frozen == ([0, 0, 0, 0] if arm == "nothing_frozen" else [0, *stage_depths[:2], 0])
        assert [p.step.train_decoder for p in phases] == (
            [False, True, True, False] if arm == "decoder" else [False] * 4
        )
        total = steps + study["final_steps"]
        spans = [(p.schedule.num_steps, p.schedule.start_step) for p in phases]
        if arm == "one_schedule":
            assert spans == [(total, 0), (total, share), (total, 2 * share), (total, steps)]
        else:
            assert spans == [(p.num_steps, 0) for p in phases]
        assert all(p.optimizer_state == "reset" for p in phases[1:])
    if size == "base":  # batch 4,096 at sequence 128 on 256 devices, one micro-batch
        assert (phases[0].batch.global_batch_size, phases[0].batch.max_seq_length) == (4096, 128)
        assert phases[0].batch.grad_accum_steps == 1


def point(arm, lr, curve, step_time=0.1):
    times = {step: step * step_time for step, _ in curve}
    finite = [loss for _, loss in curve if math.isfinite(loss)]
    return dict(
        arm=arm,
        lr=lr,
        seed=0,
        name="",
        curve=curve,
        times=times,
        best=min(finite) if finite else math.inf,
        final=curve[-1][1],
        step_time=step_time,
        step_times=[(step, step_time) for step, _ in curve],
        status="finished",
    )


def test_the_report_takes_the_baseline_and_the_arms_by_its_rule():
    grid = [
        # Baseline: 1e-2 has the lowest best loss (5.0 at step 30): the target.
        point("baseline", 5e-3, [(10, 6.0), (20, 5.5), (30, 5.2)]),
        point("baseline", 1e-2, [(10, 5.8), (20, 5.3), (30, 5.0)]),
        # As implemented: 5e-3 reaches 5.0 at step 40, 1e-2 at 50 with a lower best loss.
        point("as_implemented", 5e-3, [(10, 6.5), (30, 5.5), (40, 5.0), (50, 4.99)], 0.05),
        point("as_implemented", 1e-2, [(10, 6.4), (30, 5.4), (40, 5.1), (50, 4.9)], 0.05),
        # Decoder: neither reaches the target; the lower best loss wins.
        point("decoder", 5e-3, [(10, 6.5), (30, 5.6), (50, 5.2)], 0.04),
        point("decoder", 1e-2, [(10, 6.5), (30, 5.5), (50, 5.1)], 0.04),
    ]
    base = mslt.baseline(grid)
    assert base["lr"] == 1e-2 and base["best"] == 5.0
    rows = mslt.chosen_arms(grid, base["best"], ["baseline", "as_implemented", "decoder"])
    assert [(p["arm"], p["lr"]) for p in rows] == [("as_implemented", 5e-3), ("decoder", 1e-2)]
    study = dict(num_steps=30, final_steps=20, stage_depths=[1, 2, 4])
    table = mslt.comparison_table(base, rows, base["best"], study)
    # Baseline: 30 steps, 3.0 s; as implemented: 40 steps at 0.05 s = 2.0 s: 0.75x the
    # steps, 1.50x the speed; its loss at the baseline's last step, 30, is 5.5.
    assert (
        "| MSLT as implemented | 0.005 | 40 | 0.75x | 2.0 s | 1.50x | 50 ms | 4.9900 | 5.5000 "
        "| 4.9900 |"
    ) in table
    assert "| decoder trained | 0.01 | - |  | - |  | 40 ms | 5.1000 | 5.5000 | 5.1000 |" in table
    assert mslt.stages(study) == [
        ("1 layer (1 trained)", 1, 10),
        ("2 layers (1 trained)", 11, 20),
        ("4 layers (2 trained)", 21, 30),
        ("final: 4 layers (all trained)", 31, 50),
    ]
    stage_rows = mslt.stage_table(base, rows, study).splitlines()
    assert stage_rows[2] == (
        "| MSLT as implemented | 50 ms (0.50) | - (-) | 50 ms (0.50) | 50 ms (0.50) |"
    )


def test_the_report_answers_from_the_smallest_forms_trials(tmp_path):
    # The smallest form's sweep with made-up curves (no training), reported as `report DIR`
    # reports it: through the module the study names. The baseline runs 4 steps; the
    # decoder arm stages of 1 and 2 layers, then 2 steps of all, at half the step time.
    baseline, decoder = "arm=baseline,lr=0.01,seed=0", "arm=decoder,lr=0.01,seed=0"
    curves = {
        "baseline": ([(2, 7.0), (4, 6.5)], 0.1),
        "decoder": ([(2, 7.2), (4, 6.6), (6, 6.4)], 0.05),
    }
    state = write_sweep(
        tmp_path, CONFIG, "smoke", lambda t: curve_records(*curves[t.labels["arm"]])
    )
    assert sorted(state["trials"]) == [baseline, decoder]
    report = sweep_report.write_report(str(tmp_path))
    assert "## MSLT's design choices" in report
    for name in ("mslt_loss_vs_steps.png", "mslt_loss_vs_time.png"):
        assert (tmp_path / name).stat().st_size > 1000
    # The target is the baseline's best, 6.5: 4 steps, 0.4 s; the decoder arm reaches it
    # at step 6 (1.5x the steps) in 6 x 0.05 = 0.3 s.
    assert "Target: the baseline's best held-out MLM loss, 6.5000" in report
    assert (
        "| decoder trained | 0.01 | 6 | 0.67x | 0.3 s | 1.33x | 50 ms | 6.4000 | 6.6000 | 6.4000 |"
        in report
    )
    # Every reading says how fine its steps are and that one seed gives no verdict.
    assert (
        "Steps to a target are exact to the evaluation interval (every 2 steps). One seed per "
        "arm: a gap between arms is a direction, not a verdict" in report
    )
