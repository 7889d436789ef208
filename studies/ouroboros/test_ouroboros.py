"""The Ouroboros study (studies/ouroboros/config.py, studies.ouroboros.report): its trials
are the arms the accuracy claim needs on one set of devices, its report applies the
tolerance rule it states, and its smallest form runs through `python -m lambjax.sweep` and
`report`."""

import math
import os

import pytest

from lambjax import cli
from lambjax.sweep import report as sweep_report
from lambjax.sweep import spec
from lambjax.train import plan
from studies.ouroboros import report as ouroboros
from studies.testing import curve_records, write_sweep
from tests.helpers import REPO

CONFIG = "studies/ouroboros/config.py"


def study_module():
    return cli.load_module(os.path.join(REPO, CONFIG))[0]


@pytest.mark.parametrize("size", ["cpu", "base"])
def test_the_trials_are_k1_twice_and_k4_with_each_replay_with_and_without_warmup(size):
    module = study_module()
    study = module.SIZES[size]
    config = module.get_config(size)
    trials = spec.trials(config, module.get_sweep(size))
    warm = study["warmup_steps"]
    assert 0 < warm < study["num_steps"]
    expected = {(1, "none", 0, 0), (1, "none", 0, study["noise_seed"])}
    expected |= {(4, r, w, 0) for r in ("stale", "current") for w in (0, warm)}
    seen = set()
    phases = []
    for trial in trials:
        labels = trial.labels
        seen.add((labels["modules"], labels["replay"], labels["warmup"], labels["seed"]))
        trial_config = config.copy_and_resolve_references()
        trial_config.update_from_flattened_dict(trial.overrides)
        run_plan = plan.resolve(trial_config, vocab_size=2048, num_devices=study["devices"])
        phase = run_plan.phases[0]
        phases.append(phase)
        assert run_plan.seed == labels["seed"]
        if labels["modules"] == 1:
            assert phase.step_method is None
            assert dict(phase.mesh) == {
                "data": study["devices"],
                "fsdp": 1,
                "tensor": 1,
                "stage": 1,
            }
        else:
            assert phase.step_method.num_modules == 4
            assert phase.step_method.replay == labels["replay"]
            assert phase.step_method.synchronous_steps == labels["warmup"]
            assert phase.mesh["stage"] == 3
            assert phase.mesh["data"] * 3 == study["devices"]
    assert seen == expected
    # One schedule, decayed to 0 at the last step; the same batch, model and optimizer.
    assert len({(p.schedule, p.batch.global_batch_size, p.model, p.num_steps) for p in phases}) == 1
    assert phases[0].optimizer.name == "lamb"
    assert phases[0].schedule.schedule == "poly_warmup" and phases[0].model.num_layers % 3 == 0


def point(modules, replay, warmup, seed, curve):
    return dict(
        modules=modules,
        replay=replay,
        warmup=warmup,
        seed=seed,
        name="",
        curve=curve,
        best=min(loss for _, loss in curve),
        final=curve[-1][1],
        step_time=0.5,
        status="finished",
    )


def test_the_report_reads_each_arm_against_the_k1_seed_gap():
    grid = [
        point(1, "none", 0, 0, [(10, 6.0), (20, 5.50), (30, 5.52)]),
        # The second seed: 0.02 above in final loss, 0.01 above in best: the tolerances.
        point(1, "none", 0, 1, [(10, 6.1), (20, 5.51), (30, 5.54)]),
        # Within both tolerances, below by more than both, above by more than both.
        point(4, "stale", 0, 0, [(10, 6.2), (20, 5.51), (30, 5.535)]),
        point(4, "current", 0, 0, [(10, 6.2), (20, 5.45), (30, 5.45)]),
        point(4, "stale", 3, 0, [(10, 6.2), (20, 5.60), (30, 5.60)]),
    ]
    base, noise = ouroboros.baselines(grid, 1)
    assert (base["seed"], noise["seed"]) == (0, 1)
    synchronous = ouroboros.synchronous_seeds(grid)
    tolerance = ouroboros.tolerances(synchronous)
    assert tolerance == {"final": pytest.approx(0.02), "best": pytest.approx(0.01)}
    # Two seeds are one sample of the seed's effect: every gap is inconclusive, with its
    # size in tolerances and its sign.
    table = ouroboros.comparison_table(grid, base, tolerance, len(synchronous))
    assert "| K = 1, seed 0 | 5.5200 | +0.0000 | baseline | 5.5000 | +0.0000 | baseline |" in table
    assert (
        "| K = 4, stale | 5.5350 | +0.0150 | inconclusive (0.8x the seed gap) | 5.5100 | "
        "+0.0100 | inconclusive (1.0x the seed gap) |"
    ) in table
    assert (
        "| K = 4, current | 5.4500 | -0.0700 | inconclusive (3.5x the seed gap, lower) | "
        "5.4500 | -0.0500 | inconclusive (5.0x the seed gap, lower) |"
    ) in table
    assert "+0.0800 | inconclusive (4.0x the seed gap, higher) |" in table
    # A third seed inside the same spread: now the rule fixed first reads each arm.
    grid.append(point(1, "none", 0, 2, [(10, 6.1), (20, 5.505), (30, 5.53)]))
    synchronous = ouroboros.synchronous_seeds(grid)
    assert ouroboros.tolerances(synchronous) == tolerance
    table = ouroboros.comparison_table(grid, base, tolerance, len(synchronous))
    assert "| K = 4, stale | 5.5350 | +0.0150 | comparable | 5.5100 | +0.0100 | comparable |" in (
        table
    )
    assert "| K = 4, current | 5.4500 | -0.0700 | better | 5.4500 | -0.0500 | better |" in table
    assert (
        "| K = 4, stale, 3 synchronous steps first | 5.6000 | +0.0800 | worse | 5.6000 | "
        "+0.1000 | worse |"
    ) in table
    # Without the second seed there is no tolerance, so no verdict.
    assert all(math.isnan(v) for v in ouroboros.tolerances([base]).values())
    assert ouroboros.verdict(0.01, math.nan, 1) == "-"
    assert ouroboros.verdict(math.nan, 0.1, 3) == "-"


def test_the_report_answers_from_the_smallest_forms_trials(tmp_path):
    # The smallest form's sweep with made-up curves (no training), reported as `report DIR`
    # reports it: through the module the study names.
    warm = "modules=4,replay=current,warmup=2,seed=0"
    finals = {
        "modules=1,replay=none,warmup=0,seed=0": 6.5,
        warm: 6.6,
        "modules=1,replay=none,warmup=0,seed=1": 6.52,
    }
    state = write_sweep(
        tmp_path, CONFIG, "smoke", lambda t: curve_records([(2, 7.0), (4, finals[t.name])])
    )
    assert sorted(state["trials"]) == sorted(finals)
    report = sweep_report.write_report(str(tmp_path))
    assert "## Ouroboros against ordinary backpropagation" in report
    assert (tmp_path / "ouroboros_loss_vs_steps.png").stat().st_size > 1000
    # The tolerance is the two K = 1 seeds' gap; K = 4 ends 0.1 above the baseline, five
    # times it, which two seeds cannot call worse.
    assert "Tolerance (the spread of the 2 K = 1 seeds): 0.0200 in final" in report
    verdict = ouroboros.verdict(0.1, 0.02, 2)
    assert verdict == "inconclusive (5.0x the seed gap, higher)"
    assert f"| K = 4, current, 2 synchronous steps first | 6.6000 | +0.1000 | {verdict} |" in report
