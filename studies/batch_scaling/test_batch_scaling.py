"""The batch-scaling study (studies/batch_scaling/config.py, studies.batch_scaling.report):
its grid gives every batch size its own step budget (one pass at most at CPU size), every
optimizer the same 4-point grid on the square-root rule, and a target that ends each trial;
its report picks the arms by the rule it states and fits S(B); its smallest form runs end to
end through `python -m lambjax.sweep` and `report`."""

import math
import os

import pytest

from lambjax import cli
from lambjax.sweep import report as sweep_report
from lambjax.sweep import spec
from lambjax.train import plan
from lambjax.train.metrics import read_jsonl
from studies.batch_scaling import report as batch_scaling
from studies.testing import curve_records, run_study, write_sweep
from tests.helpers import REPO

CONFIG = "studies/batch_scaling/config.py"
LOSS = "eval/mlm_loss"


def study_module():
    return cli.load_module(os.path.join(REPO, CONFIG))[0]


@pytest.mark.parametrize("size", ["cpu", "base", "large"])
def test_every_batch_size_has_its_own_budget_and_every_optimizer_the_full_grid(size):
    module = study_module()
    study = module.SIZES[size]
    config = module.get_config(size)
    assert (config.target.metric, config.target.value) == ("mlm_loss", study["target_loss"])
    assert config.noise_scale.enabled
    trials = spec.trials(config, module.get_sweep(size))
    grid = len(study["base_learning_rates"]) * len(study["batch_sizes"])
    assert len(trials) == grid * len(study["multipliers"]) and len(study["multipliers"]) >= 4
    b0 = study["batch_sizes"][0]
    for trial in trials:
        o, labels = trial.overrides, trial.labels
        batch, steps = o["phases.phase1.global_batch_size"], o["phases.phase1.num_steps"]
        assert batch == labels["batch"] and steps == module.budget(study, batch)
        if size == "cpu":  # at most one pass, and room for three times the expected steps
            assert batch * steps <= study["train_sequences"]
            assert steps >= min(
                3 * module.expected_steps(study, batch), study["train_sequences"] // batch
            )
        base = study["base_learning_rates"][labels["optimizer"]]
        rule = base * math.sqrt(batch / b0) * labels["lr_x"]
        assert o["phases.phase1.learning_rate"] == pytest.approx(rule, rel=1e-3)
        warmup = o["phases.phase1.warmup_fraction"] * steps
        assert warmup == pytest.approx(study["warmup_steps"]) == labels["warmup"]
        assert o["phases.phase1.constant_fraction"] == pytest.approx(
            1 - o["phases.phase1.warmup_fraction"]
        )
        if size != "cpu":  # the pod sizes fit 256 devices as they are
            trial_config = config.copy_and_resolve_references()
            trial_config.update_from_flattened_dict(o)
            plan.resolve(trial_config, vocab_size=trial_config.data.vocab_size, num_devices=256)


def test_stage_two_adds_the_extensions_then_each_best_points_warmups_and_seeds():
    module = study_module()
    stage1 = spec.trials(module.get_config("smoke"), module.get_sweep("smoke"))
    both = spec.trials(module.get_config("smoke,stage2"), module.get_sweep("smoke,stage2"))
    assert [t.name for t in both[: len(stage1)]] == [t.name for t in stage1]
    assert [t.name for t in both[len(stage1) :]] == [
        "optimizer=adamw,batch=16,lr_x=4.0,seed=0,warmup=1",
        "optimizer=lamb,batch=8,lr_x=1.0,seed=0,warmup=2",
        "optimizer=lamb,batch=8,lr_x=1.0,seed=1,warmup=1",
    ]


def point(optimizer, batch, lr_x, steps, best, seed=0, warmup=25):
    return dict(
        optimizer=optimizer,
        batch=batch,
        lr_x=lr_x,
        seed=seed,
        warmup=warmup,
        steps=steps,
        best=best,
        done=True,
        status="finished",
        learning_rate=1e-3 * lr_x,
        name="",
        curve=[],
        noise=[],
        bracket=None,
    )


def test_the_arms_follow_the_rule_fixed_before_the_runs():
    grid = [
        # At the smallest batch lr_x 1 reaches the target first: the sqrt rule keeps 1.
        point("lamb", 32, 0.5, 40, 5.0),
        point("lamb", 32, 1.0, 30, 5.1),
        point("lamb", 32, 2.0, None, 5.9),
        # At 64, 2 is fastest (tuned), 0.5 and 1 tie on steps: the lower best loss wins;
        # a longer warmup at lr_x 2 is faster still, but only the tuned arm takes it.
        point("lamb", 64, 0.5, 20, 5.2),
        point("lamb", 64, 1.0, 20, 5.3),
        point("lamb", 64, 2.0, 16, 5.4),
        point("lamb", 64, 2.0, 14, 5.4, warmup=60),
        # At 128 nothing reaches the target: the lowest best loss.
        point("lamb", 128, 0.5, None, 5.7),
        point("lamb", 128, 1.0, None, 5.6),
        point("lamb", 128, 2.0, None, 5.8),
    ]
    chosen = batch_scaling.arms(grid, [32, 64, 128], warmup=25)
    sqrt_rule, tuned = chosen[("lamb", "sqrt rule")], chosen[("lamb", "tuned")]
    assert [sqrt_rule[b]["lr_x"] for b in (32, 64, 128)] == [1.0, 1.0, 1.0]
    assert [sqrt_rule[b]["warmup"] for b in (32, 64, 128)] == [25, 25, 25]
    assert [(tuned[b]["lr_x"], tuned[b]["warmup"]) for b in (32, 64, 128)] == [
        (1.0, 25),
        (2.0, 60),
        (1.0, 25),
    ]
    assert batch_scaling.at_edge(tuned[64], grid) and not batch_scaling.at_edge(tuned[32], grid)
    table = batch_scaling.arm_table(chosen, [32, 64, 128], grid)
    assert "| lamb | tuned | 30 / lr 0.001, warmup 25 | 14 / lr 0.002, warmup 60 (edge) |" in table


def test_stage_two_follows_the_rule_from_stage_ones_grid():
    grid = [
        point("lamb", 32, 0.5, 40, 5.0),  # the lowest edge is best: extend below
        point("lamb", 32, 1.0, 50, 5.0),
        point("lamb", 64, 0.5, 30, 5.0),
        point("lamb", 64, 1.0, 20, 5.0),  # inside the grid: no extension
        point("lamb", 64, 2.0, 25, 5.0),
        point("lamb", 128, 0.5, None, 6.0),  # nothing reached: extend both ways, no seeds
        point("lamb", 128, 1.0, None, 6.0),
    ]
    chosen = batch_scaling.arms(grid, [32, 64, 128], warmup=25)
    extensions, best = batch_scaling.stage2_settings(grid, chosen)
    assert extensions == {("lamb", 32): (0.25,), ("lamb", 128): (0.25, 2.0)}
    assert best == {("lamb", 32): 0.5, ("lamb", 64): 1.0}


def test_seeds_and_warmups_are_read_at_each_tuned_point():
    every = [
        point("lamb", 32, 1.0, 30, 5.0),
        point("lamb", 32, 1.0, 34, 5.0, seed=1),
        point("lamb", 32, 1.0, 28, 5.0, seed=2),
        point("lamb", 32, 1.0, 40, 5.0, warmup=60),
        point("lamb", 32, 1.0, 26, 5.0, warmup=10),
        point("lamb", 32, 2.0, 50, 5.0),  # another rate, no seeds: not the stage-2 point
        point("lamb", 64, 1.0, 20, 5.0),  # no repeats: no row
    ]
    chosen = batch_scaling.arms([p for p in every if p["seed"] == 0], [32, 64], warmup=25)
    sets = batch_scaling.seeded(every, warmup=25)
    assert list(sets) == [("lamb", 32)]
    assert [(q["seed"], q["lr_x"], q["warmup"]) for q in sets[("lamb", 32)]] == [
        (0, 1.0, 25),
        (1, 1.0, 25),
        (2, 1.0, 25),
    ]
    # Seed 0's choice moved to the shorter warmup: the row says so beside the seeds' spread.
    seeds = batch_scaling.seed_table(sets, chosen)
    assert seeds.splitlines()[2:] == [
        "| lamb | 32 | 1 | 0: 30, 1: 34, 2: 28 | 31 (28-34) | lr_x 1, warmup 10: 26 |"
    ]
    warmups = batch_scaling.warmup_table(every, chosen)
    assert warmups.splitlines()[2:] == ["| lamb | 32 | 10: 26, 25: 30, 60: 40 |"]


def three_seeds(optimizer, steps_by_batch, lr_x=1.0):
    """Seeds 0, 1, 2 of one stage-2 point per batch size: {batch: (steps, steps, steps)}."""
    return [
        point(optimizer, b, lr_x, s, 5.0, seed=seed)
        for b, steps in steps_by_batch.items()
        for seed, s in enumerate(steps)
    ]


def test_three_seeds_give_the_speed_ups_fits_and_order_with_their_ranges():
    # LAMB follows S = 100 (1 + 256 / B) on every seed, the seeds 10% apart; AdamW is slower
    # at 32 with the ranges apart, overlaps LAMB at 64, and one seed misses at 128.
    exact = {32: 900, 64: 500, 128: 300}
    every = three_seeds("lamb", {b: (s, s * 9 // 10, s * 11 // 10) for b, s in exact.items()})
    every += three_seeds(
        "adamw", {32: (1000, 1050, 1100), 64: (480, 500, 560), 128: (300, 310, None)}
    )
    sets = batch_scaling.seeded(every, warmup=25)
    assert list(sets) == [(o, b) for o in ("lamb", "adamw") for b in (32, 64, 128)]

    speedups = batch_scaling.seed_speedup_table(sets, [32, 64, 128]).splitlines()
    # LAMB: 900 / 500 and 500 / 300 on the means; the seeds allow 810 / 550 to 990 / 450,
    # and 450 / 330 to 550 / 270. AdamW: 1050 / 513.3, from 1000 / 560 to 1100 / 480.
    assert speedups[2:] == [
        "| lamb | 1.80 (1.47-2.20) | 1.67 (1.36-2.04) |",
        "| adamw | 2.05 (1.79-2.29) |  |",
    ]
    fits = batch_scaling.seed_fit_table(sets).splitlines()
    assert fits[2] == "| lamb | 100 | 256 | 0: 256, 1: 256, 2: 256 | - |"
    # Two batch sizes complete: no fit of the means, nor of seed 2 alone.
    assert fits[3].startswith("| adamw | - | - | 0: ") and fits[3].endswith(", 2: - | - |")

    order = batch_scaling.optimizer_comparison(sets, [32, 64, 128]).splitlines()
    assert order[2:] == [
        "| 32 | lamb 900 (810-990), adamw 1050 (1000-1100) | lamb / adamw separate |",
        "| 64 | lamb 500 (450-550), adamw 513 (480-560) | lamb / adamw overlap |",
    ]


def test_the_fit_recovers_a_known_critical_batch():
    by_batch = {
        b: point("lamb", b, 1.0, round(100 * (1 + 200 / b)), 5.0) for b in (32, 64, 128, 256)
    }
    s_min, b_crit, count = batch_scaling.fit(by_batch)
    assert (s_min, b_crit, count) == (pytest.approx(100, rel=0.01), pytest.approx(200, rel=0.01), 4)
    by_batch[256] = point("lamb", 256, 1.0, None, 6.0)
    by_batch[128] = point("lamb", 128, 1.0, None, 6.0)
    assert batch_scaling.fit(by_batch) is None  # two points reached: no fit


def test_the_noise_scale_is_read_over_the_second_half_to_the_target():
    p = point("lamb", 64, 1.0, 100, 5.0)
    p["noise"] = [(25, 1000.0), (50, 100.0), (75, 200.0), (100, 300.0), (125, 5000.0)]
    assert batch_scaling.measured_noise(p) == 200.0


def test_a_speed_up_carries_the_range_its_evaluation_intervals_allow():
    # 192 steps read every 32 at batch 32, 144 every 16 at 64, 120 every 8 at 128: 1.33 may
    # be anything from 160 / 144 to 192 / 128.
    by_batch = {
        32: dict(point("lamb", 32, 1.0, 192, 5.16), bracket=(160, 192)),
        64: dict(point("lamb", 64, 1.0, 144, 5.33), bracket=(128, 144)),
        128: dict(point("lamb", 128, 1.0, 120, 5.57), bracket=(112, 120)),
        256: point("lamb", 256, 1.0, None, 5.66),
    }
    table = batch_scaling.speedup_table({("lamb", "sqrt rule"): by_batch}, [32, 64, 128, 256])
    assert "| lamb | sqrt rule | 1.33 (1.11-1.50) | 1.20 (1.07-1.29) |  |" in table


def cells(state, curves, optimizer, target):
    """The arm table's cells of `optimizer` as the report must write them."""
    result = []
    for batch in (8, 16):
        name = f"optimizer={optimizer},batch={batch},lr_x=1.0,seed=0,warmup=1"
        reached = next((str(s) for s, loss in curves[batch] if loss <= target), "-")
        learning_rate = state["trials"][name]["overrides"]["phases.phase1.learning_rate"]
        result.append(f"{reached} / lr {learning_rate:.3g}")
    return result


def test_the_report_answers_from_the_smallest_forms_trials(tmp_path):
    # The smallest form's sweep with made-up curves (no training), reported as `report DIR`
    # reports it: through the module the study names. The target is 7.65.
    curves = {
        ("lamb", 8): [(1, 7.7), (2, 7.6)],
        ("lamb", 16): [(1, 7.7)],
        ("adamw", 8): [(1, 7.6)],
        ("adamw", 16): [(1, 7.62)],
    }
    state = write_sweep(
        tmp_path,
        CONFIG,
        "smoke",
        lambda t: curve_records(
            curves[t.labels["optimizer"], t.labels["batch"]], **{"train/noise_scale": 12.0}
        ),
    )
    report = sweep_report.write_report(str(tmp_path))
    assert "## Batch scaling: steps to the target against batch size" in report
    for name in ("steps_to_target.png", "learning_rates.png", "noise_scale.png"):
        assert (tmp_path / name).stat().st_size > 1000
    target = study_module().SIZES["smoke"]["target_loss"]
    lamb = cells(state, {b: curves["lamb", b] for b in (8, 16)}, "lamb", target)
    assert lamb == ["2 / lr 0.01", "- / lr 0.0141"]
    assert f"| lamb | sqrt rule | {' | '.join(lamb)} |" in report
    adamw = cells(state, {b: curves["adamw", b] for b in (8, 16)}, "adamw", target)
    assert "| adamw | tuned | 1 / lr 0.001, warmup 1 | 1 / lr 0.00141, warmup 1 |" in report
    assert f"| adamw | sqrt rule | {' | '.join(adamw)} |" in report
    assert "| adamw | 1.00 (0.00-inf) |" not in report
    assert "| lamb | - | - | fewer than 3 reached | 12 |" in report


@pytest.mark.slow  # the dataset's build and four trials' training
def test_the_smallest_study_runs_through_the_sweep_and_report(tmp_path, study_data_dir):
    # The studies' one run end to end: its README's commands, shortened. Each trial ends at
    # its first evaluation at or below the target, or at its budget.
    workdir = tmp_path / "study"
    state, report = run_study(CONFIG, workdir, study_data_dir)
    module = study_module()
    study = module.SIZES["smoke"]
    assert sorted(state["trials"]) == sorted(
        f"optimizer={o},batch={b},lr_x=1.0,seed=0,warmup=1"
        for o in ("lamb", "adamw")
        for b in (8, 16)
    )
    assert "## Batch scaling: steps to the target against batch size" in report
    for optimizer in ("lamb", "adamw"):
        curves = {}
        for batch in (8, 16):
            name = f"optimizer={optimizer},batch={batch},lr_x=1.0,seed=0,warmup=1"
            records = read_jsonl(str(workdir / name / "metrics.jsonl"))
            curves[batch] = [(s, r[LOSS]) for s, r in sorted(records.items()) if LOSS in r]
            steps = [s for s, _ in curves[batch]]
            reached = [s for s, loss in curves[batch] if loss <= study["target_loss"]]
            # Every step evaluated, up to the target or the budget, and no further.
            assert steps == list(
                range(1, (reached[0] if reached else module.budget(study, batch)) + 1)
            )
            assert (workdir / name / "target_reached.json").exists() == bool(reached)
        expected = cells(state, curves, optimizer, study["target_loss"])
        assert f"| {optimizer} | sqrt rule | {' | '.join(expected)} |" in report
