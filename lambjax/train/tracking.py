"""Experiment tracking: a run's scalars, config and name sent to Weights & Biases or MLflow.

`config.tracking.backends` ("" by default; the fields: lambjax.train.config) names the
services, comma-separated: `wandb`, `mlflow`. Each is one more `metrics.Writer` beside
TensorBoard and `metrics.jsonl` (lambjax.train.metrics.create_writer), so it receives every
scalar the run logs, at the same steps. At the start of the run it gets the resolved config
and the run's name (`tracking.run_name`, else the workdir's last folder) and group
(`tracking.group`; a sweep sets both: lambjax.sweep.runner); `tracking.project` is the W&B
project or MLflow experiment.

Where they write is theirs to say, through their own settings: `WANDB_MODE=offline` and
`WANDB_DIR` (else the workdir, if local), `MLFLOW_TRACKING_URI` (e.g. `file:/path/mlruns`).
The packages are the `tracking` extra (`pip install 'lambjax[tracking]'`); a run that asks
for one that is not installed stops before anything is written (`check`).
"""

import importlib
import json
import os
import time

import numpy as np

from lambjax import storage
from lambjax.train import metrics
from lambjax.train import workdir as workdir_lib
from lambjax.train.config import ConfigError

BACKENDS = {"wandb": "wandb", "mlflow": "mlflow"}  # backend -> the module it imports


def backends(tracking) -> list[str]:
    """The backends `tracking.backends` names; ConfigError for an unknown one."""
    names = [name.strip() for name in tracking.backends.split(",") if name.strip()]
    for name in names:
        if name not in BACKENDS:
            raise ConfigError(
                f"config.tracking.backends={tracking.backends!r}: unknown {name!r}; valid: "
                f"a comma-separated list of {sorted(BACKENDS)}, or '' for none"
            )
    return names


def check(tracking) -> None:
    """Raises ConfigError if a backend asked for is unknown or its package is not installed."""
    for name in backends(tracking):
        try:
            importlib.import_module(BACKENDS[name])
        except ImportError:
            raise ConfigError(
                f"config.tracking.backends={tracking.backends!r}: the {name} package is not "
                f"installed; pip install 'lambjax[tracking]' (or {BACKENDS[name]}), or leave "
                f"tracking.backends empty"
            ) from None


def run_name(tracking, workdir: str) -> str:
    return tracking.run_name or os.path.basename(workdir.rstrip("/")) or "lambjax"


def create_writers(tracking, config_dict: dict, workdir: str) -> list[metrics.Writer]:
    """A writer per backend that `tracking.backends` names (none by default)."""
    name = run_name(tracking, workdir)
    makers = {"wandb": WandbWriter, "mlflow": MlflowWriter}
    writers = []
    for backend in backends(tracking):
        try:
            writers.append(
                makers[backend](tracking.project, name, tracking.group, config_dict, workdir)
            )
        except Exception as error:  # each service raises its own errors (no server, no login)
            reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            raise ConfigError(
                f"config.tracking.backends={tracking.backends!r}: {backend} could not start a "
                f"run ({reason})"
            ) from None
    return writers


def _floats(scalars) -> dict[str, float]:
    return {key: float(np.asarray(value)) for key, value in scalars.items()}


class WandbWriter(metrics.Writer):
    """A W&B run. The run's step is a logged value (`step`), not W&B's own counter, so a
    resumed run, which logs from its last checkpoint's step again, is accepted."""

    def __init__(self, project: str, name: str, group: str, config: dict, workdir: str):
        import wandb

        directory = os.environ.get("WANDB_DIR")
        if not directory and not storage.is_remote(workdir):
            directory = workdir
        self.run = wandb.init(
            project=project,
            name=name,
            group=group or None,
            config=config,
            dir=directory,
            reinit="create_new",
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write_scalars(self, step, scalars):
        self.run.log({"step": int(step), **_floats(scalars)})

    def close(self):
        self.run.finish()


class MlflowWriter(metrics.Writer):
    """An MLflow run in the experiment `project`, in the tracking store MLflow is pointed
    at (MLFLOW_TRACKING_URI); the config's fields are its parameters, and the config itself
    an artifact (config.json)."""

    # MLflow takes at most this many parameters and metrics in one call.
    BATCH = 100

    def __init__(self, project: str, name: str, group: str, config: dict, workdir: str):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(project)
        )
        tags = {"lambjax.workdir": workdir, **({"lambjax.group": group} if group else {})}
        self.run_id = self.client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
        self._log_config(config)

    def _log_config(self, config: dict) -> None:
        from mlflow.entities import Param

        fields = sorted(workdir_lib.flatten(config).items())
        params = [Param(key, json.dumps(value)) for key, value in fields]
        for start in range(0, len(params), self.BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + self.BATCH])
        self.client.log_text(self.run_id, json.dumps(config, indent=2), "config.json")

    def write_scalars(self, step, scalars):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, int(step)) for k, v in _floats(scalars).items()]
        for start in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + self.BATCH])

    def close(self):
        self.client.set_terminated(self.run_id)
