"""The batch-scaling study (studies/batch_scaling/config.py, studies.batch_scaling.report):
its grid keeps the sample budget and the square-root rule, its report picks the arms by the
rule it states, the `report` command answers from its smallest form's trials, and that
form runs end to end through `python -m lambjax.sweep` and `report` (the one study that
does: the others check their reports on made-up trials)."""

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
def test_every_trial_sees_the_same_samples_and_the_sqrt_rule(size):
    module = study_module()
    study = module.SIZES[size]
    config = module.get_config(size)
    trials = spec.trials(config, module.get_sweep(size))
    b0 = study["batch_sizes"][0]
    # cpu: the three grids at B0, AdamW's at the five larger sizes, LAMB's and LANS's rule
    # there, one more seed each; base and large: every grid everywhere, two more seeds each.
    assert len(trials) == {"cpu": 9 + 15 + 10 + 3, "base": 54 + 6, "large": 54 + 6}[size]
    for trial in trials:
        o, labels = trial.overrides, trial.labels
        batch = o["phases.phase1.global_batch_size"]
        assert batch == labels["batch"]
        assert batch * o["phases.phase1.num_steps"] == study["samples"]
        base = study["base_learning_rates"][labels["optimizer"]]
        rule = base * math.sqrt(batch / b0) * labels["lr_x"]
        assert o["phases.phase1.learning_rate"] == pytest.approx(rule, rel=1e-3)
        # The LAMB paper's warmup: the same number of warmup steps at every batch size.
        warmup_steps = o["phases.phase1.warmup_fraction"] * o["phases.phase1.num_steps"]
        assert warmup_steps == pytest.approx(
            module.WARMUP_AT_MAX * study["samples"] / max(study["batch_sizes"])
        )
        if size != "cpu":  # the pod sizes fit 256 devices as they are
            trial_config = config.copy_and_resolve_references()
            trial_config.update_from_flattened_dict(o)
            plan.resolve(trial_config, vocab_size=trial_config.data.vocab_size, num_devices=256)


def point(optimizer, batch, lr_x, steps, final, seed=0):
    return dict(
        optimizer=optimizer,
        batch=batch,
        lr_x=lr_x,
        seed=seed,
        steps=steps,
        final=final,
        done=True,
        status="finished",
        learning_rate=1e-3 * lr_x,
        name="",
        curve=[],
    )


def test_the_arms_follow_the_rule_fixed_before_the_runs():
    grid = [
        # At the smallest batch lr_x 1 reaches the target first: the sqrt rule keeps 1.
        point("lamb", 32, 0.5, 40, 5.0),
        point("lamb", 32, 1.0, 30, 5.1),
        point("lamb", 32, 2.0, None, 5.9),
        # At 64, 2 is fastest (tuned), 0.5 and 1 tie on steps: the lower final loss wins.
        point("lamb", 64, 0.5, 20, 5.2),
        point("lamb", 64, 1.0, 20, 5.3),
        point("lamb", 64, 2.0, 16, 5.4),
        # At 128 nothing reaches the target: the lowest final loss.
        point("lamb", 128, 0.5, None, 5.7),
        point("lamb", 128, 1.0, None, 5.6),
        point("lamb", 128, 2.0, None, 5.8),
    ]
    chosen = batch_scaling.arms(grid, [32, 64, 128])
    sqrt_rule = chosen[("lamb", "sqrt rule")]
    tuned = chosen[("lamb", "tuned")]
    assert [sqrt_rule[b]["lr_x"] for b in (32, 64, 128)] == [1.0, 1.0, 1.0]
    assert [tuned[b]["lr_x"] for b in (32, 64, 128)] == [1.0, 2.0, 1.0]
    # A declared base is kept whatever the grid at B0 says, and the report says so.
    study = {"tuned": [], "rule_multipliers": {"lamb": 0.5}}
    chosen = batch_scaling.arms(grid, [32, 64, 128], study)
    assert list(chosen) == [("lamb", "sqrt rule")]
    assert [chosen[("lamb", "sqrt rule")][b]["lr_x"] for b in (32, 64, 128)] == [0.5] * 3
    check = batch_scaling.base_check(grid, [32, 64, 128], study)
    assert check.endswith("best lr_x 1.0 (NOT the declared base, lr_x 0.5)"), check


def test_a_speed_up_carries_the_range_its_evaluation_intervals_allow():
    # The CPU run's LAMB: 192 steps read every 32 at batch 32, 144 every 16 at 64, 120
    # every 8 at 128: 1.33 may be anything from 160 / 144 to 192 / 128.
    by_batch = {
        32: dict(point("lamb", 32, 1.0, 192, 5.16), bracket=(160, 192)),
        64: dict(point("lamb", 64, 1.0, 144, 5.33), bracket=(128, 144)),
        128: dict(point("lamb", 128, 1.0, 120, 5.57), bracket=(112, 120)),
        256: point("lamb", 256, 1.0, None, 5.66),
    }
    table = batch_scaling.speedup_table({("lamb", "sqrt rule"): by_batch}, [32, 64, 128, 256])
    assert "| lamb | sqrt rule | 1.33 (1.11-1.50) | 1.20 (1.07-1.29) |  |" in table


def test_the_report_answers_from_the_smallest_forms_trials(tmp_path):
    # The smallest form's sweep with made-up curves (no training), reported as `report DIR`
    # reports it: through the module the study names. Batch 8 evaluates at steps 1 and 2,
    # batch 16 at step 1; the target is 7.65.
    curves = {
        ("lamb", 8): [(1, 7.7), (2, 7.6)],
        ("lamb", 16): [(1, 7.7)],
        ("adamw", 8): [(1, 7.6), (2, 7.5)],
        ("adamw", 16): [(1, 7.62)],
    }
    state = write_sweep(
        tmp_path,
        CONFIG,
        "smoke",
        lambda t: curve_records(curves[t.labels["optimizer"], t.labels["batch"]]),
    )
    assert sorted(state["trials"]) == sorted(
        f"optimizer={o},batch={b},lr_x=1.0,seed=0" for o in ("lamb", "adamw") for b in (8, 16)
    )
    report = sweep_report.write_report(str(tmp_path))
    assert "## Batch scaling: steps to the target against batch size" in report
    for name in ("steps_to_target.png", "final_loss.png", "learning_rates.png"):
        assert (tmp_path / name).stat().st_size > 1000
    # Each cell is that trial's first eval at or below the target, and its last eval loss.
    target = study_module().SIZES["smoke"]["target_loss"]
    for optimizer in ("lamb", "adamw"):
        cells = []
        for batch in (8, 16):
            evals = curves[optimizer, batch]
            name = f"optimizer={optimizer},batch={batch},lr_x=1.0,seed=0"
            reached = next((str(s) for s, loss in evals if loss <= target), "-")
            learning_rate = state["trials"][name]["overrides"]["phases.phase1.learning_rate"]
            cells.append(f"{reached} / {evals[-1][1]:.3f} / lr {learning_rate:.3g}")
        for arm in ("sqrt rule", "tuned") if optimizer == "adamw" else ("sqrt rule",):
            assert f"| {optimizer} | {arm} | {' | '.join(cells)} |" in report
    assert "| lamb | tuned |" not in report  # the smoke study tunes AdamW only
    assert "| lamb | sqrt rule | 2 / 7.600 / lr 0.01 | - / 7.700 / lr 0.0141 |" in report


@pytest.mark.slow  # the dataset's build and four trials' training
def test_the_smallest_study_runs_through_the_sweep_and_report(tmp_path, study_data_dir):
    # The studies' one run end to end: its README's commands, shortened.
    workdir = tmp_path / "study"
    state, report = run_study(CONFIG, workdir, study_data_dir)
    assert sorted(state["trials"]) == sorted(
        f"optimizer={o},batch={b},lr_x=1.0,seed=0" for o in ("lamb", "adamw") for b in (8, 16)
    )
    assert "## Batch scaling: steps to the target against batch size" in report
    for name in ("steps_to_target.png", "final_loss.png", "learning_rates.png"):
        assert (workdir / name).stat().st_size > 1000
    # Each cell is that trial's first eval at or below the target, and its last eval loss.
    target = study_module().SIZES["smoke"]["target_loss"]
    for optimizer in ("lamb", "adamw"):
        cells = []
        for batch in (8, 16):
            name = f"optimizer={optimizer},batch={batch},lr_x=1.0,seed=0"
            records = read_jsonl(str(workdir / name / "metrics.jsonl"))
            evals = [(s, r[LOSS]) for s, r in sorted(records.items()) if LOSS in r]
            assert [s for s, _ in evals] == list(range(1, 16 // batch + 1))
            reached = next((str(s) for s, loss in evals if loss <= target), "-")
            learning_rate = state["trials"][name]["overrides"]["phases.phase1.learning_rate"]
            cells.append(f"{reached} / {evals[-1][1]:.3f} / lr {learning_rate:.3g}")
        for arm in ("sqrt rule", "tuned") if optimizer == "adamw" else ("sqrt rule",):
            assert f"| {optimizer} | {arm} | {' | '.join(cells)} |" in report
    assert "| lamb | tuned |" not in report  # the smoke study tunes AdamW only
