"""Non-finite and impossible settings are refused by the plan, before any data or vocabulary
work: one line naming the field, the value and what would be valid, exit status 2.

Most cases call the plan's check (`lambjax.train.plan.check`, what `lambjax.main` runs
first); a few run the commands as users do, in children of one process
(tests/command_cases.py), and find neither a workdir nor a data dir afterwards.
"""

import os

import pytest

from lambjax import cli, ranges
from lambjax.finetune import config as finetune_config
from lambjax.finetune.errors import FinetuneError
from lambjax.train import config as config_lib
from lambjax.train import plan as plan_lib
from tests import helpers

NAN, INF = float("nan"), float("inf")


def demo():
    return cli.load_config(os.path.join(helpers.REPO, "configs/default.py"))


def phase1(config):
    return config.phases.phase1


# (where the field is, its field name, the bad value, what the message says is valid)
CASES = [
    (phase1, "learning_rate", NAN, "must be positive and finite"),
    (phase1, "learning_rate", INF, "must be positive and finite"),
    (phase1, "learning_rate", 0.0, "must be positive and finite"),
    (phase1, "warmup_fraction", 1.5, r"must lie in \[0, 1\]"),
    (phase1, "warmup_fraction", NAN, r"must lie in \[0, 1\]"),
    (phase1, "constant_fraction", -0.1, r"must lie in \[0, 1\]"),
    (phase1, "decay_power", NAN, "must be a finite number >= 0"),
    (phase1, "num_steps", -5, "must be a positive integer"),
    (phase1, "frozen_layers", -1, "must be an integer >= 0"),
    (lambda c: c.data, "masked_lm_prob", 2.0, r"must lie in \(0, 1\]"),
    (lambda c: c.data, "masked_lm_prob", 0.0, r"must lie in \(0, 1\]"),
    (lambda c: c.data, "short_seq_prob", NAN, r"must lie in \[0, 1\]"),
    (lambda c: c.data, "validation_fraction", 1.0, r"must lie in \[0, 1\)"),
    (lambda c: c.data, "vocab_size", 0, "must be an integer >= 1"),
    (lambda c: c.data, "vocab_sample_mb", NAN, "must be a finite number >= 0"),
    (lambda c: c.data, "build_shard_mb", INF, "must be a finite number > 0"),
    (lambda c: c.optimizer, "b1", 1.0, r"must lie in \[0, 1\)"),
    (lambda c: c.optimizer, "b2", NAN, r"must lie in \[0, 1\)"),
    (lambda c: c.optimizer, "eps", 0.0, "must be a finite number > 0"),
    (lambda c: c.optimizer, "weight_decay", -0.01, "must be a finite number >= 0"),
    (lambda c: c.optimizer, "max_global_norm", NAN, "must be a finite number > 0"),
    (lambda c: c.phases.phase2.optimizer, "eps", INF, "must be a finite number > 0"),
    (lambda c: c, "seed", -1, "must be an integer >= 0"),
    (lambda c: c, "eval_steps", -1, "must be an integer >= 0"),
    (lambda c: c, "max_checkpoints_to_keep", 0, "must be an integer >= 1"),
    (lambda c: c, "max_consecutive_nonfinite_steps", 0, "must be an integer >= 1"),
    (lambda c: c, "peak_flops_per_device", NAN, "must be a finite number >= 0"),
    (lambda c: c, "checkpoint_every_minutes", NAN, "must be >= 0"),
    (lambda c: c.standardization_loss, "weight", INF, "must be a finite number >= 0"),
    (lambda c: c.model.overrides, "layer_norm_eps", 0.0, "must be a finite number > 0"),
]


@pytest.mark.parametrize("group, field, value, valid", CASES, ids=[f"{c[1]}={c[2]}" for c in CASES])
def test_the_plan_refuses_a_value_out_of_range(group, field, value, valid):
    config = demo()
    group(config)[field] = value
    with pytest.raises(config_lib.ConfigError, match=f"{field}={value!r} {valid}"):
        plan_lib.resolve(config, num_devices=1)


def test_layer_drop_settings_are_checked_when_enabled():
    config = demo()
    config.model.overrides.layer_norm = "pre"
    config.layer_drop.enabled = True
    config.layer_drop.gamma = NAN
    with pytest.raises(config_lib.ConfigError, match=r"gamma=nan must be a finite number >= 0"):
        plan_lib.resolve(config, num_devices=1)


def test_every_recipe_passes_the_early_check():
    for name in ("default.py", "bert_lamb.py:large", "bert_lans.py:large,runlocal"):
        plan_lib.resolve(
            cli.load_config(os.path.join(helpers.REPO, "configs", name)), num_devices=8
        )


FINETUNE_CASES = [
    ("learning_rate", NAN, "must be a finite number > 0"),
    ("warmup_fraction", 2.0, r"must lie in \[0, 1\]"),
    ("num_epochs", INF, "must be a finite number >= 0"),
    ("null_score_diff_threshold", NAN, "must be a finite number"),
]


@pytest.mark.parametrize("field, value, valid", FINETUNE_CASES)
def test_finetuning_refuses_a_value_out_of_range(field, value, valid):
    config = cli.load_config(os.path.join(helpers.REPO, "configs/finetune/squad.py"))
    config.data.train = config.data.eval = "x.json"
    config[field] = value
    with pytest.raises(FinetuneError, match=f"{field}={value!r} {valid}"):
        finetune_config.validate(config, 1, 1)


def test_finetuning_checks_its_optimizer_and_dropout():
    config = cli.load_config(os.path.join(helpers.REPO, "configs/finetune/squad.py"))
    config.data.train = config.data.eval = "x.json"
    config.optimizer.b2 = 1.5
    with pytest.raises(FinetuneError, match=r"optimizer.b2=1.5 must lie in \[0, 1\)"):
        finetune_config.validate(config, 1, 1)
    config.optimizer.b2 = 0.999
    config.model.hidden_dropout = 1.0
    with pytest.raises(FinetuneError, match=r"model.hidden_dropout=1.0 must lie in \[0, 1\)"):
        finetune_config.validate(config, 1, 1)


@pytest.mark.parametrize(
    "interval, good, bad",
    [
        ("(0, 1]", [1e-9, 1.0], [0.0, 1.5, NAN, INF, -INF]),
        ("[0, inf)", [0, 1e300], [-1e-9, NAN, INF]),
        ("[0, inf]", [0.0, INF], [NAN, -1.0]),
        ("(-inf, inf)", [-1e300, 0.0], [NAN, INF, -INF]),
    ],
)
def test_ranges_check_intervals(interval, good, bad):
    for value in good:
        ranges.check("x", value, interval)
    for value in bad:
        with pytest.raises(ValueError, match=f"x={value!r} must"):
            ranges.check("x", value, interval)
    with pytest.raises(ValueError, match="must be an integer"):
        ranges.check("n", 0.5, "[0, inf)", integer=True)
    with pytest.raises(ValueError):
        ranges.check("flag", True, "[0, inf)")  # a bool is not a number here


@pytest.mark.slow
def test_commands_refuse_bad_settings_before_any_work(tmp_path):
    """As users run them: exit 2, one line naming the field and value, nothing written."""
    workdir, data_dir = tmp_path / "run", tmp_path / "data"
    common = ["--config=configs/default.py", f"--workdir={workdir}"]
    cases = [
        ("lambjax.main", [*common, "--config.phases.phase1.learning_rate=nan"], "nan"),
        ("lambjax.main", [*common, "--config.data.masked_lm_prob=2.0"], "masked_lm_prob=2.0"),
        ("lambjax.main", [*common, "--config.phases.phase1.num_steps=-5"], "num_steps=-5"),
        ("lambjax.prepare", [*common, "--config.data.masked_lm_prob=2.0"], "masked_lm_prob"),
        (
            "lambjax.main",
            [*common, f"--config.data.data_dir={data_dir}", "--config.optimizer.b2=1.0"],
            "config.optimizer.b2=1.0 must lie in [0, 1)",
        ),
    ]
    commands = [(module, args) for module, args, _ in cases]
    codes, errors = helpers.run_command_cases(tmp_path, commands)
    for (module, args, expected), code, stderr in zip(cases, codes, errors, strict=True):
        lines = [line for line in stderr.splitlines() if ": error: " in line]
        assert code == 2 and "Traceback" not in stderr, (module, args[-1], stderr[-2000:])
        assert len(lines) == 1 and expected in lines[0], (args[-1], lines)
    assert not workdir.exists() and not data_dir.exists()
