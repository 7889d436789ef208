"""The chunked-accumulation study (studies/chunked_accumulation/config.py,
studies.chunked_accumulation.report): its arms are the papers' arithmetic, the plan checks
them, the report applies the rule it states, and its smallest form runs through
`python -m lambjax.sweep` and `report`."""

import json
import os

import pytest

from lambjax import cli
from lambjax.contrib import precision
from lambjax.sweep import report as sweep_report
from lambjax.sweep import spec
from lambjax.train import config as config_lib
from lambjax.train import plan
from studies.chunked_accumulation import report as chunked_accumulation
from studies.testing import curve_records, write_sweep
from tests.helpers import REPO

CONFIG = "studies/chunked_accumulation/config.py"


def study_module():
    return cli.load_module(os.path.join(REPO, CONFIG))[0]


@pytest.mark.parametrize("size", ["cpu", "pod"])
def test_the_arms_are_the_papers_arithmetic_and_the_plan_takes_them(size):
    module = study_module()
    config = module.get_config(size)
    trials = spec.trials(config, module.get_sweep(size))
    assert [t.name for t in trials] == [
        "accumulation=float32,seed=0",
        "accumulation=naive,seed=0",
        "accumulation=chunk64,seed=0",
        "accumulation=float32,seed=1",
        "accumulation=naive_e6m4,seed=0",
        "accumulation=chunk64_e6m4,seed=0",
    ]
    settings = {
        t.labels["accumulation"]: t.overrides["chunked_accumulation.setting"] for t in trials
    }
    assert precision.parse_accumulation(settings["naive"]) == ("e6m9", None, "float8_e5m2")
    assert precision.parse_accumulation(settings["chunk64"]) == ("e6m9", 64, "float8_e5m2")
    assert precision.parse_accumulation(settings["chunk64_e6m4"]) == ("e6m4", 64, "float8_e5m2")
    devices = 256 if size == "pod" else 1
    for trial in trials:
        trial_config = config.copy_and_resolve_references()
        trial_config.update_from_flattened_dict(trial.overrides)
        run_plan = plan.resolve(
            trial_config, vocab_size=trial_config.data.vocab_size, num_devices=devices
        )
        model, method = run_plan.phases[0].model, run_plan.phases[0].step_method
        setting = trial.overrides["chunked_accumulation.setting"]
        assert (method and method.setting) == (None if setting == "float32" else setting)
        assert model.dtype == "float32" and model.attention == "xla"
    study = module.get_study(size)
    assert study["tokens_per_weight_gradient"] == {"cpu": 4096, "pod": 8192}[size]


def test_the_plan_refuses_an_unknown_operand_format_in_one_line():
    config = study_module().get_config("cpu")
    config.chunked_accumulation.setting = "e6m9:operands=float8_e3m4"
    with pytest.raises(config_lib.ConfigError) as error:
        plan.resolve(config, vocab_size=2048, num_devices=1)
    message = str(error.value)
    assert "chunked_accumulation.setting='e6m9:operands=float8_e3m4'" in message
    assert "['float8_e5m2', 'float8_e4m3fn']" in message and "\n" not in message


def record(arm, seed, final):
    return dict(
        accumulation=arm,
        seed=seed,
        final=final,
        curve=[],
        status="finished",
        setting="",
        name="",
        wall_time_s=1.0,
    )


@pytest.mark.parametrize(
    "naive, chunked, expected",
    [
        (5.70, 5.61, "**The claim's pattern appears here**"),
        (5.61, 5.60, "**Cannot test the claim at this size**: naive accumulation ends within"),
        (5.70, 5.70, "**Not confirmed here**: chunks of 64 do not recover float32"),
    ],
)
def test_the_verdict_follows_the_rule_fixed_before_the_runs(naive, chunked, expected):
    study = {
        "baseline": "float32",
        "tolerance": 0.02,
        "arms": {"naive": "e6m9:operands=float8_e5m2"},
        "vrr": {"length": 8192},
        "tokens_per_weight_gradient": 4096,
    }
    records = [
        record("float32", 0, 5.60),
        record("naive", 0, naive),
        record("chunk64", 0, chunked),
        record("float32", 1, 5.90),
    ]
    rows = [
        {"mantissa_bits": m, "naive_measured": v}
        for m, v in ((4, 0.5), (6, 0.995), (7, 0.98), (8, 0.999), (9, 0.9993))
    ]
    retention = chunked_accumulation.naive_retention(rows, study)
    assert retention == 0.9993  # the naive arm's accumulator: 9 mantissa bits
    text = chunked_accumulation.verdict(records, study, retention)
    assert text.startswith(expected)
    if naive < 5.62:  # within the tolerance: why no outcome could differ, not "no"
        assert "keeps 0.9993 of its variance at 8,192 terms" in text
        # Where the accumulator does lose variance, a match is a finding: not confirmed.
        lossy = chunked_accumulation.verdict(records, study, 0.34)
        assert lossy.startswith("**Not confirmed here**: naive accumulation trains as well")
    else:  # one seed per arm: a direction only
        assert "One seed per arm" in text
    assert "spread 0.3000" in chunked_accumulation.noise(records, study)
    assert chunked_accumulation.needed_mantissa(rows, "naive_measured") == 8


def test_the_report_answers_from_the_smallest_forms_trials(tmp_path):
    # The smallest form's sweep with made-up curves (no training), reported as `report DIR`
    # reports it: through the module the study names. Its variance sweep is computed here.
    losses = {"float32": 6.5, "naive": 6.6, "chunk64": 6.51}
    state = write_sweep(
        tmp_path,
        CONFIG,
        "smoke",
        lambda t: curve_records([(1, 7.0), (2, losses[t.labels["accumulation"]])]),
    )
    assert sorted(state["trials"]) == sorted(f"accumulation={a},seed=0" for a in losses)
    report = sweep_report.write_report(str(tmp_path))
    assert "## Chunked accumulation" in report
    for name in ("training_curves.png", "variance_retention.png"):
        assert (tmp_path / name).stat().st_size > 1000
    # Every arm's row holds its last held-out loss, and the gap to float32 beside it.
    for arm, loss in losses.items():
        gap = f"{loss - losses['float32']:+.4f}"
        assert f"| {arm} | 0 | `{study_module().ARMS[arm]}` | {loss:.4f} | {gap} |" in report
    assert "**The claim's pattern appears here**" in report  # naive +0.1, chunk64 +0.01
    # The variance sweep: both widths, each with measured and predicted ratios; 9 mantissa
    # bits keep everything, 3 bits naive lose some of it over 256 terms.
    rows = json.loads((tmp_path / "variance_retention.json").read_text())["rows"]
    assert [r["mantissa_bits"] for r in rows] == [3, 9]
    assert rows[1]["naive_measured"] == pytest.approx(1.0, abs=0.01)
    assert rows[0]["naive_measured"] < rows[0]["chunked_measured"]


def test_the_report_reads_the_setting_under_either_key():
    # sweep.json files of earlier runs recorded the setting as a model override.
    assert chunked_accumulation.setting({"chunked_accumulation.setting": "e6m9"}) == "e6m9"
    assert chunked_accumulation.setting({"model.overrides.matmul_accumulation": "e6m9"}) == "e6m9"
