"""A workdir belongs to one run.

  WORKDIR/config.json       the run's defining config (written with each phase's first
                            checkpoint)
  WORKDIR/checkpoints/      one folder per phase (lambjax.train.checkpointing)
  WORKDIR/metrics.jsonl     every logged scalar; TensorBoard event files beside it

Every start checks, before any data is built or anything compiled or written, that the
workdir is a directory lambjax can write, and, when it already holds a run, that the new
config continues that run. A config may differ from the run's in the fields of `RESUMABLE`
(how long, how often, on how many devices: never what is computed), and in the fields of
phases that have not written a checkpoint yet; those differences are logged. Any other
difference ends the start with one line per field: a mistyped flag on resume must never
quietly turn a run that cost days of a pod into a new one.
"""

import fnmatch
import json

import jax
from absl import logging
from etils import epath

from lambjax import storage

CONFIG_FILE = "config.json"

# Fields that may change when a run resumes (fnmatch patterns of dotted names).
RESUMABLE = (
    # Step counts: a run may be extended (its schedules then follow the new count).
    "phases.*.num_steps",
    # Devices, mesh and accumulation: the same global batch, computed another way.
    "mesh.*",
    "phases.*.mesh.*",
    "phases.*.grad_accum_steps",
    "phases.*.micro_batch_per_device",
    # The layers scanned or unrolled: checkpoints hold them stacked either way
    # (lambjax.train.layout).
    "model.overrides.scan_layers",
    "optimizer.group_layers",
    "phases.*.optimizer.group_layers",
    # Logging, evaluation, checkpoints, profiling.
    "noise_scale.*",
    "log_every_steps",
    "eval_every_steps",
    "eval_batch_size",
    "eval_steps",
    "eval_at_start",
    "checkpoint_every_steps",
    "checkpoint_every_minutes",
    "max_checkpoints_to_keep",
    "async_checkpointing",
    "max_consecutive_nonfinite_steps",
    "peak_flops_per_device",
    "profile",
    "tracking.*",
    # Where the (same) built datasets are read from.
    "data.data_dir",
    "data.tfds_data_dir",
)


class WorkdirError(ValueError):
    """The workdir cannot hold this run; the message names the path and what to do."""


def check(config_json: str, workdir: str) -> None:
    """Raises WorkdirError unless `workdir` can hold a run of the config (given as its JSON,
    `ConfigDict.to_json_best_effort()`; see the module doc)."""
    ensure_writable(workdir)
    if (epath.Path(workdir) / "checkpoints" / "finetune").exists():
        raise WorkdirError(
            f"--workdir={workdir} holds a fine-tuning run (lambjax.finetune's); pretraining "
            f"needs a workdir of its own (a new one, or a pretraining run's)"
        )
    saved = saved_config(workdir)
    if saved is None:
        return
    started = started_phases(workdir)
    differences, accepted = compare(saved, json.loads(config_json), started)
    for line in accepted:
        logging.info("Resuming with a changed setting: %s", line)
    if differences:
        raise WorkdirError(
            f"--workdir={workdir} holds a run with another config:\n  "
            + "\n  ".join(differences)
            + "\nContinue the run with the values in the workdir, or start a new run in "
            "another --workdir."
        )


def ensure_writable(workdir: str) -> None:
    try:
        storage.check_reachable(workdir, "--workdir")
    except storage.StorageError as error:
        raise WorkdirError(str(error)) from error
    path = epath.Path(workdir)
    if path.exists() and not path.is_dir():
        raise WorkdirError(f"--workdir={workdir} is a file; give a directory (new or a run's)")
    probe = path / f".lambjax-write-test-{jax.process_index()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        list(path.iterdir())  # while the probe is there: on GCS an empty folder does not exist
        probe.unlink()
    except OSError as error:
        raise WorkdirError(
            f"--workdir={workdir} cannot be created or written: {storage.reason(error)}"
        ) from error


def started_phases(workdir: str) -> list[str]:
    """Names of the phases that have at least one checkpoint in the workdir."""
    root = epath.Path(workdir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(
        phase.name
        for phase in root.iterdir()
        if "." not in phase.name and any(step.name.isdigit() for step in phase.iterdir())
    )


def saved_config(workdir: str) -> dict | None:
    """The run's config as saved in the workdir (or in its newest checkpoint), or None."""
    path = epath.Path(workdir) / CONFIG_FILE
    if path.exists():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise WorkdirError(
                f"{path} cannot be read ({error}); it is the run's config: restore it, or "
                f"move it aside and the config in the newest checkpoint is used"
            ) from error
    metas = sorted(
        (int(step.name), step / "meta" / "metadata")
        for phase in started_phases(workdir)
        for step in (epath.Path(workdir) / "checkpoints" / phase).iterdir()
        if step.name.isdigit() and (step / "meta" / "metadata").exists()
    )
    for _, meta in reversed(metas):
        try:
            return json.loads(json.loads(meta.read_text())["config"])
        except (OSError, ValueError, KeyError):
            continue  # an unreadable checkpoint: the restore moves it aside
    return None


def save_config(config_json: str, workdir: str) -> None:
    """Writes the run's defining config, given as its JSON (process 0; with a phase's first
    checkpoint)."""
    if jax.process_index() != 0:
        return
    text = json.dumps(json.loads(config_json), indent=2) + "\n"
    storage.write_text(epath.Path(workdir) / CONFIG_FILE, text)


def compare(saved: dict, new: dict, started: list[str]) -> tuple[list[str], list[str]]:
    """(differences that end the start, accepted differences), one line each."""
    old_fields, new_fields = flatten(saved), flatten(new)
    differences, accepted = [], []
    for name in sorted(old_fields.keys() | new_fields.keys()):
        old, now = old_fields.get(name, _MISSING), new_fields.get(name, _MISSING)
        if old == now:
            continue
        line = f"{name}: {_show(old)} in the workdir, {_show(now)} now"
        if name == "phase_order":  # the started phases keep their places
            kept = list(now[: len(started)]) == list(old[: len(started)])
            (accepted if kept else differences).append(line)
        elif _is_resumable(name) or _of_unstarted_phase(name, started):
            accepted.append(line)
        elif old is _MISSING or now is _MISSING:
            accepted.append(f"{line} (a field of another lambjax version)")
        else:
            differences.append(line)
    return differences, accepted


def flatten(tree: dict, prefix: str = "") -> dict:
    fields = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            fields.update(flatten(value, f"{prefix}{key}."))
        else:
            fields[f"{prefix}{key}"] = value
    return fields


_MISSING = object()


def _show(value) -> str:
    return "(absent)" if value is _MISSING else json.dumps(value)


def _is_resumable(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in RESUMABLE)


def _of_unstarted_phase(name: str, started: list[str]) -> bool:
    parts = name.split(".")
    return parts[0] == "phases" and len(parts) > 2 and parts[1] not in started
