"""studies/pld/benchmark.py --sweep: the arms of a study sweep are built as its trials'
`lambjax.main` builds them, and their round-robin step times land in the sweep's
step_times.json, which the study reports read (studies.curves.step_times)."""

import json
import os

from lambjax import cli
from lambjax.sweep import runner, spec
from studies import curves
from studies.pld import benchmark as pld_benchmark
from tests.helpers import REPO

CONFIG = "studies/pld/config.py:smoke"


def write_sweep(directory) -> None:
    """The smoke-size PLD study's sweep.json, as `python -m lambjax.sweep` writes it."""
    module, arg = cli.load_module(os.path.join(REPO, CONFIG))
    config = module.get_config(arg)
    trials = spec.trials(config, module.get_sweep(arg))
    sweep = runner.Sweep(config, CONFIG, str(directory), trials, study=module.get_study(arg))
    sweep.write()


def test_the_arms_of_a_sweep_are_its_trials_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # sweep.json names the config file as it was given
    write_sweep(tmp_path)
    arms = pld_benchmark.sweep_arms(str(tmp_path))
    assert list(arms) == ["arm=postln", "arm=pld,gamma=100/T", "arm=preln"]
    settings = {
        arm: (c.model.overrides.layer_norm, c.layer_drop.enabled, c.phases.phase1.learning_rate)
        for arm, c in arms.items()
    }
    assert settings == {
        "arm=postln": ("post", False, 1e-3),
        "arm=pld,gamma=100/T": ("pre", True, 2e-3),
        "arm=preln": ("pre", False, 2e-3),
    }
    assert arms["arm=pld,gamma=100/T"].layer_drop.gamma == 100 / 4
    # The sweep's own flags apply too: its trials' data lives with the sweep.
    assert {c.data.data_dir for c in arms.values()} == {f"{tmp_path}/data"}


def test_the_step_times_are_written_for_the_report(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    write_sweep(tmp_path)
    timed = {}

    def fake_step_seconds(configs, rounds):  # the round-robin timing has its own caller
        timed.update(configs=configs, rounds=rounds)
        seconds = {"arm=postln": 0.2, "arm=pld,gamma=100/T": 0.15, "arm=preln": 0.19}
        return {(arm, "phase1"): seconds[arm] for arm in configs}

    monkeypatch.setattr(pld_benchmark, "step_seconds", fake_step_seconds)
    pld_benchmark.time_sweep(str(tmp_path), rounds=3)
    assert timed["rounds"] == 3 and len(timed["configs"]) == 3
    written = curves.step_times(str(tmp_path))
    assert written["step_time_s"] == {
        "arm=postln": 0.2,
        "arm=pld,gamma=100/T": 0.15,
        "arm=preln": 0.19,
    }
    assert written["rounds"] == 3 and len(written["load_average"]) == 2
    assert "| arm=pld,gamma=100/T | 150.0 | 0.75x |" in capsys.readouterr().out
    assert json.loads((tmp_path / "step_times.json").read_text()) == written
