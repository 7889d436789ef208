"""Experiment tracking (lambjax.train.tracking): W&B in its offline mode and MLflow with a
local file store receive what the run's writer is given, read back from what they wrote; a
sweep names and groups its trials' runs; a backend that is not installed stops the run in one
line before anything is written. (A whole run, tracked: tests/train/test_published_runs.py.)
"""

import os
import subprocess
import sys

import ml_collections
import pytest

from lambjax import cli
from lambjax.sweep import runner, spec
from lambjax.train import metrics, tracking
from lambjax.train.config import ConfigError, base_config
from tests.helpers import REPO, environment
from tests.train.test_published_runs import mlflow_metric, wandb_history


def settings(backends: str, **fields) -> ml_collections.ConfigDict:
    config = base_config().tracking
    config.backends = backends
    config.update(fields)
    return config


def test_both_backends_receive_every_scalar_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it
    os.makedirs(tmp_path / "wandb")
    workdir = str(tmp_path / "run")
    config = {"seed": 3, "phases": {"phase1": {"learning_rate": 0.01}}}
    trackers = tracking.create_writers(settings("wandb,mlflow", group="g"), config, workdir)
    writer = metrics.create_writer(workdir, extra=trackers)
    writer.write_scalars(10, {"train/loss": 7.5, "train/phase": 1})
    writer.write_scalars(10, {"eval/mlm_loss": 7.25})
    writer.write_scalars(20, {"train/loss": 6.5, "train/phase": 1})
    writer.close()

    run, rows = wandb_history(str(tmp_path / "wandb"))
    assert (run.display_name, run.run_group, run.project) == ("run", "g", "lambjax")
    logged = [(r["step"], r.get("train/loss"), r.get("eval/mlm_loss")) for r in rows]
    assert logged == [(10, 7.5, None), (10, None, 7.25), (20, 6.5, None)]
    assert {u.key: u.value_json for u in run.config.update}["seed"] == "3"

    mlflow_run, losses = mlflow_metric(str(tmp_path / "mlruns"), "train/loss")
    assert losses == {10: 7.5, 20: 6.5}
    assert mlflow_run.info.run_name == "run"
    assert mlflow_run.data.tags["lambjax.group"] == "g"
    assert mlflow_run.data.params["phases.phase1.learning_rate"] == "0.01"


def test_an_unknown_backend_is_named():
    with pytest.raises(ConfigError, match="unknown 'neptune'; valid: a comma-separated"):
        tracking.check(settings("wandb,neptune"))


def test_sweep_trials_are_named_after_their_overrides_and_grouped(tmp_path):
    config = cli.load_config(os.path.join(REPO, "configs/default.py"))
    untracked_config = config.copy_and_resolve_references()
    config.tracking.backends = "mlflow"
    trials = spec.trials(config, [{"seed": 1}, {"seed": 2}])
    sweep = runner.Sweep(config, "configs/default.py", str(tmp_path / "lr-sweep"), trials)
    command = sweep.command(trials[1])
    assert "--config.tracking.run_name=seed=2" in command
    assert "--config.tracking.group=lr-sweep" in command

    untracked = runner.Sweep(untracked_config, "configs/default.py", str(tmp_path / "s"), trials)
    assert not any("tracking" in flag for flag in untracked.command(trials[1]))


@pytest.mark.slow  # a subprocess
@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_a_backend_not_installed_stops_in_one_line_writing_nothing(tmp_path, backend):
    workdir = tmp_path / "run"
    # The package missing: its import fails, as it does where it is not installed.
    program = (
        f"import runpy, sys; sys.modules[{backend!r}] = None; "
        "sys.argv = ['lambjax.main', *sys.argv[1:]]; "
        "runpy.run_module('lambjax.main', run_name='__main__')"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            program,
            "--config=configs/default.py:runlocal",
            f"--workdir={workdir}",
            f"--config.tracking.backends={backend}",
        ],
        cwd=REPO,
        env=environment(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"lambjax: error: config.tracking.backends='{backend}': the {backend}")
    assert "pip install 'lambjax[tracking]'" in last
    assert "Traceback" not in result.stderr
    assert not workdir.exists()
