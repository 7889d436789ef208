"""Ending a run at a target held-out metric (`config.target`), as MLPerf's BERT benchmark
ends at a masked-LM accuracy of 0.720: the first evaluation whose metric reaches the
target saves a checkpoint there and ends the run, later phases included.

  --config.target.metric=mlm_loss --config.target.value=4.5      # reached at or below 4.5
  --config.target.metric=mlm_accuracy --config.target.value=0.72  # at or above 0.72

The run records where it got to in WORKDIR/target_reached.json (the phase, its step, the
global step, the evaluation); rerunning the same command finds it and does nothing more,
so a sweep counts the trial finished. The metrics are the held-out evaluation's
(lambjax.train.trainer.PhaseLoop.evaluation); the target is read at every evaluation, so
`eval_every_steps` is its resolution.

The other way a run ends on its own: its loss diverges (exit status 3). It records that in
WORKDIR/diverged.json, its one line of error, so that a sweep counts the trial ended and
does not run it again (a rerun resumes from the last finite checkpoint and, bitwise the
same, diverges again). Run by hand again, it warns, removes the file and tries.
"""

import dataclasses
import json
import math

from etils import epath

from lambjax import storage

FILE = "target_reached.json"
DIVERGED_FILE = "diverged.json"
# The metrics a target may name, and the side of the value on which each is reached.
METRICS = {"mlm_loss": "below", "mlm_accuracy": "above", "nsp_accuracy": "above"}


@dataclasses.dataclass(frozen=True)
class Target:
    metric: str
    value: float

    def reached(self, metrics: dict) -> bool:
        score = metrics.get(self.metric)
        if score is None or not math.isfinite(score):
            return False
        return score <= self.value if METRICS[self.metric] == "below" else score >= self.value

    def __str__(self) -> str:
        side = "<=" if METRICS[self.metric] == "below" else ">="
        return f"eval {self.metric} {side} {self.value:g}"


def from_config(target) -> Target | None:
    """config.target as a Target (None: off); ValueError naming the bad field."""
    if not target.metric:
        return None
    if target.metric not in METRICS:
        raise ValueError(
            f"config.target.metric={target.metric!r} is not a held-out metric with a target; "
            f"valid: {', '.join(METRICS)} (or '' for none)"
        )
    value = target.value
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"config.target.value={value!r} must be a finite number")
    if METRICS[target.metric] == "above" and not 0 < value <= 1:
        raise ValueError(
            f"config.target.value={value} must lie in (0, 1] for {target.metric}, an accuracy"
        )
    if target.metric == "mlm_loss" and value <= 0:
        raise ValueError(f"config.target.value={value} must be > 0 for mlm_loss")
    return Target(target.metric, float(value))


def record(workdir: str, target: Target, phase: str, step: int, global_step: int, metrics):
    """Writes WORKDIR/target_reached.json: where the run reached `target`."""
    content = {
        "target": {"metric": target.metric, "value": target.value},
        "phase": phase,
        "step": step,
        "global_step": global_step,
        "eval": metrics,
    }
    storage.write_text(epath.Path(workdir) / FILE, json.dumps(content, indent=2))


def read(workdir: str) -> dict | None:
    """The record of a run that reached its target, or None."""
    path = epath.Path(workdir) / FILE
    return json.loads(path.read_text()) if path.exists() else None


def record_divergence(workdir: str, error: str) -> None:
    """Writes WORKDIR/diverged.json: the run stopped because its loss diverged (`error`, its
    one line)."""
    content = json.dumps({"error": error}, indent=2)
    storage.write_text(epath.Path(workdir) / DIVERGED_FILE, content)


def divergence(workdir: str) -> str | None:
    """The error of a run that diverged, or None."""
    path = epath.Path(workdir) / DIVERGED_FILE
    return json.loads(path.read_text())["error"] if path.exists() else None


def clear_divergence(workdir: str) -> None:
    """Removes WORKDIR/diverged.json: the run is being tried again."""
    (epath.Path(workdir) / DIVERGED_FILE).unlink(missing_ok=True)
