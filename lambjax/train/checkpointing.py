"""Orbax checkpoints of a run, one CheckpointManager per phase.

Layout: WORKDIR/checkpoints/PHASE/STEP/{state,data,meta}, where `state` is the TrainState
(sharded arrays, written by every process), `data` the input iterator's position and `meta`
the run's config and model config (JSON).

Restore order, for the phase about to run:
  1. this phase's latest checkpoint (a preempted or killed run continues);
  2. else the previous phase's final checkpoint (parameters, and optimizer moments if the
     phase keeps them: the phase transition);
  3. else a fresh initialisation.
A checkpoint that cannot be read (corrupt or incomplete), or whose arrays differ from the
digests its save recorded (lambjax.train.integrity), is moved aside, never deleted, with a
warning, and the one before it is used; one written before digests were recorded restores with
a line that says so. A checkpoint that reads but holds a state of other
shapes than the config builds (another model, another optimizer) is not unreadable: the run
stops with CheckpointMismatch and the checkpoint stays where it is.

A save that fails (a full disk, a bucket that refuses writes) raises SaveFailed, one line with
the folder, its free space and what to do; the commands exit with SAVE_FAILED_STATUS. The
checkpoints before it are untouched: Orbax writes each into a temporary folder
(`STEP.orbax-checkpoint-tmp*`) that becomes the checkpoint only once complete (on GCS, which
has no rename, into `STEP/` and marks it complete with `commit_success.txt`), and what a
failed or killed save left is removed when the phase's checkpoints are next opened.
"""

import dataclasses
import errno
import json
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from lambjax import console, distributed, storage
from lambjax.train import integrity

# The exit status of a command whose checkpoint could not be written (sysexits.h's
# EX_TEMPFAIL: rerunning once the cause is fixed continues the run); a bad config exits 2.
SAVE_FAILED_STATUS = 75

_UNFINISHED = ".orbax-checkpoint-tmp"  # in the name of the folder of a save in progress


class CheckpointMismatch(ValueError):
    """A readable checkpoint whose state does not fit the state the config builds."""


class SaveFailed(OSError):
    """A checkpoint could not be written; the message is one line for the user."""


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    data_state: Any
    meta: dict


def checkpoint_dir(workdir: str, phase_name: str) -> epath.Path:
    return epath.Path(workdir) / "checkpoints" / phase_name


class PhaseCheckpoints:
    """Saves and restores one phase's checkpoints."""

    def __init__(self, workdir: str, phase_name: str, *, max_to_keep: int, async_save: bool):
        self.directory = checkpoint_dir(workdir, phase_name)
        self._max_to_keep = max_to_keep
        self._async_save = async_save
        if jax.process_index() == 0:
            remove_unfinished_saves(self.directory)
        self._manager = self._open()

    def _open(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self._max_to_keep,
            enable_async_checkpointing=self._async_save,
            create=True,
        )
        return ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "data", "meta")
        )

    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state, data_state: dict, meta: dict) -> None:
        """Starts writing checkpoint `step` (in the background if asynchronous); raises
        SaveFailed if it, or the asynchronous save before it, cannot be written."""
        if step in self._manager.all_steps():
            return  # already saved (e.g. the phase end right after a periodic save)
        meta = {**meta, integrity.DIGESTS: integrity.digests(state)}
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=ocp.args.JsonSave(data_state),
                    meta=ocp.args.JsonSave(meta),
                ),
            )
        except Exception as error:  # noqa: BLE001 - every storage layer raises its own type
            raise self._save_failed(error) from error

    def close(self) -> None:
        """Waits for an asynchronous save to finish (SaveFailed if it could not)."""
        try:
            self._manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 - every storage layer raises its own type
            raise self._save_failed(error) from error
        finally:
            self._manager.close()

    def abandon(self) -> None:
        """Waits for an asynchronous save to end and closes, as the run ends on an error:
        a failure of that save goes to the log file only (the error that ends the run says
        what happened); never raises."""
        try:
            self._manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 - the run already ends on another error
            logging.info("A background save failed:", exc_info=error, extra=console.FILE_ONLY)
        try:
            self._manager.close()
        except Exception as error:  # noqa: BLE001
            logging.info("Closing the checkpoints failed:", exc_info=error, extra=console.FILE_ONLY)

    def _save_failed(self, error: Exception) -> SaveFailed:
        logging.info("The checkpoint save failed:", exc_info=error, extra=console.FILE_ONLY)
        kept = list(self._manager.all_steps())
        resume = (
            f"it continues from the last complete checkpoint, {self.directory / str(max(kept))}"
            if kept
            else "it starts the phase again (no checkpoint of it is complete)"
        )
        reason = save_failure_reason(error)
        return SaveFailed(
            f"a checkpoint could not be written to {self.directory} ({reason}); "
            f"{storage.free_space(self.directory)}. Make room there (or fix the bucket's "
            f"access) and rerun the same command: {resume}"
        )

    def restore_latest(self, abstract_state, *, step: int | None = None) -> Restored | None:
        """Restores the newest readable checkpoint (at most `step`) onto `abstract_state`.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` carrying the target shardings,
        so a checkpoint written on one mesh restores onto any other.
        """
        while True:
            steps = [s for s in self._manager.all_steps() if step is None or s <= step]
            if not steps:
                return None
            latest = max(steps)
            try:
                state_dir = self.directory / str(latest) / "state"
                saved_shapes = leaf_shapes(ocp.StandardCheckpointHandler().metadata(state_dir))
            except Exception as error:  # noqa: BLE001 - any unreadable checkpoint is skipped
                self._quarantine(latest, error)
                continue
            check_fits(self.directory / str(latest), saved_shapes, leaf_shapes(abstract_state))
            try:
                restored = self._manager.restore(
                    latest,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state),
                        data=ocp.args.JsonRestore(),
                        meta=ocp.args.JsonRestore(),
                    ),
                )
            except Exception as error:  # noqa: BLE001 - any unreadable checkpoint is skipped
                self._quarantine(latest, error)
                continue
            try:
                verify(self.directory / str(latest), restored.meta, restored.state)
            except integrity.IntegrityError as error:
                self._quarantine(latest, error)
                continue
            return Restored(latest, restored.state, restored.data, restored.meta)

    def _quarantine(self, step: int, error: Exception) -> None:
        """Moves an unreadable checkpoint aside (kept for inspection) and reopens."""
        source = self.directory / str(step)
        target = self.directory.parent / f"{self.directory.name}.unreadable" / f"{step}"
        logging.warning(
            "Checkpoint %s cannot be restored (%s: %s); moving it to %s and using the one "
            "before it.",
            source,
            type(error).__name__,
            _first_line(error),
            target,
        )
        distributed.barrier("quarantine-start")
        if jax.process_index() == 0:
            if target.exists():
                target = target.parent / f"{step}.{int(time.time())}"
            storage.move_tree(source, target)
        distributed.barrier("quarantine-done")
        self._manager.close()
        self._manager = self._open()


class SaveClock:
    """Checkpoints by wall time: due once `every_minutes` have passed since the last save.

    A preemption that gives no notice (Cloud TPU gives none; a node can fail at any time)
    loses the work since the last save, so saving by steps alone bounds the loss in steps,
    whose duration depends on the hardware; this bounds it in minutes. The clock is read
    only at steps that are multiples of `check_every_steps` (the log steps, where the loop
    waits for the device anyway), and process 0's reading decides for every process, so all
    of them save at the same step. `every_minutes=0` turns it off.
    """

    def __init__(self, every_minutes: float, check_every_steps: int, clock=time.monotonic):
        self._interval = 60.0 * every_minutes
        self._check_every = check_every_steps
        self._clock = clock
        self._last_save = clock()

    def due(self, step: int) -> bool:
        """Whether to save after `step` (the same answer on every process)."""
        if self._interval <= 0 or step % self._check_every:
            return False
        return distributed.process_zero_decides(self._clock() - self._last_save >= self._interval)

    def saved(self) -> None:
        """A checkpoint was written (for whatever reason): the interval starts again."""
        self._last_save = self._clock()


def leaf_shapes(tree) -> dict[str, tuple]:
    """{"params/encoder/...": shape} of a state, abstract state or checkpoint metadata."""
    return {
        integrity.leaf_name(path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def verify(path, meta: dict, state) -> None:
    """Raises IntegrityError unless the arrays of `state`, restored from checkpoint `path`,
    are those its save recorded in `meta`; a checkpoint written before digests were
    recorded passes, with a line that says so."""
    recorded = meta.get(integrity.DIGESTS)
    if recorded is None:
        logging.info(
            "Checkpoint %s records no digests (an earlier lambjax wrote it); "
            "restored without an integrity check.",
            path,
        )
        return
    differing = integrity.differing(recorded, state)
    if differing:
        raise integrity.IntegrityError(integrity.describe(differing))


def remove_unfinished_saves(directory: epath.Path) -> None:
    """Deletes what saves that never completed (failed or killed) left: a temporary folder
    on local disk, or on GCS (no rename there) a step folder without Orbax's
    `commit_success.txt`. No restore reads either."""
    if not directory.is_dir():
        return
    for path in sorted(directory.iterdir()):
        unfinished = _UNFINISHED in path.name or (
            storage.is_remote(path)
            and path.name.isdigit()
            and not (path / "commit_success.txt").exists()
        )
        if unfinished:
            logging.info("Removing %s, the unfinished save of an earlier run.", path)
            path.rmtree(missing_ok=True)


def save_failure_reason(error: BaseException) -> str:
    """Why a save failed, short: 'no space left on device', else the error's first line
    (tensorstore reports a full disk as RESOURCE_EXHAUSTED with os_error_code 28)."""
    causes = [error, error.__cause__, error.__context__]
    if any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in causes) or any(
        "No space left on device" in str(e) for e in causes if e is not None
    ):
        return "no space left on device"
    return _first_line(error)[:200] or type(error).__name__


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else ""


def check_fits(directory, saved: dict, target: dict) -> None:
    """Raises CheckpointMismatch, naming a few differing arrays, unless shapes agree."""
    differing = [
        f"{name} is {saved.get(name, 'absent')} there, {target.get(name, 'absent')} now"
        for name in sorted(saved.keys() | target.keys())
        if saved.get(name) != target.get(name)
    ]
    if differing:
        more = f" (and {len(differing) - 3} more)" if len(differing) > 3 else ""
        raise CheckpointMismatch(
            f"checkpoint {directory} holds another state than this config builds: "
            f"{'; '.join(differing[:3])}{more}. The config differs from the one that wrote "
            f"it: use that config, or another --workdir"
        )


def saved_checkpoints(workdir: str) -> list[tuple[epath.Path, int, dict]]:
    """(phase folder, step, meta) of every checkpoint of a training workdir (none: [])."""
    root = epath.Path(workdir) / "checkpoints"
    if not root.exists():
        return []
    found = []
    for phase_dir in sorted(p for p in root.iterdir() if p.is_dir() and "." not in p.name):
        manager = ocp.CheckpointManager(
            phase_dir,
            options=ocp.CheckpointManagerOptions(read_only=True),
            item_names=("state", "data", "meta"),
        )
        for step in manager.all_steps():
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            found.append((phase_dir, step, meta))
    return found


def latest_params(workdir: str) -> tuple[dict, dict]:
    """(meta, params as numpy) of the newest readable checkpoint of a training workdir.

    Phases are searched from the last of the run's `phase_order` backwards; the arrays are
    read onto the host, whatever mesh wrote them (for export: lambjax.export).
    """
    root = epath.Path(workdir) / "checkpoints"
    saved = saved_checkpoints(workdir)
    if not saved:
        raise FileNotFoundError(f"no checkpoints under {root}: is {workdir} a training workdir?")
    candidates = []
    for phase_dir, step, meta in saved:
        if "phase" not in meta:  # lambjax.finetune's checkpoints record their task instead
            raise ValueError(
                f"--workdir={workdir} holds a fine-tuning run (task {meta.get('task')!r}), not "
                f"a pretraining run; its transformers export is {workdir}/transformers"
            )
        order = json.loads(meta["config"]).get("phase_order", [])
        rank = order.index(meta["phase"]) if meta["phase"] in order else -1
        candidates.append((rank, step, phase_dir, meta))
    for _, step, phase_dir, meta in sorted(candidates, key=lambda c: c[:2], reverse=True):
        try:
            state = read_verified_state(phase_dir / str(step), meta)
        except Exception as error:  # noqa: BLE001 - an unreadable checkpoint is skipped
            logging.warning("skipping unreadable checkpoint %s: %s", phase_dir / str(step), error)
            continue
        return {**meta, "step": step}, state["params"]
    raise FileNotFoundError(f"no readable checkpoint under {root}")


def read_verified_state(path, meta: dict) -> dict:
    """The state of checkpoint `path` (`.../STEP`) on the host, checked against the digests
    in its `meta` (IntegrityError if they differ)."""
    state = read_state_on_host(epath.Path(path) / "state")
    verify(path, meta, state)
    return state


def read_state_on_host(path) -> dict:
    """A checkpoint's saved state (`.../STEP/state`) as numpy arrays, whatever mesh wrote it."""
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(path).item_metadata.tree
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
