"""Orbax checkpoints of a run, one CheckpointManager per phase.

Layout: WORKDIR/checkpoints/PHASE/STEP/{state,data,meta}, where `state` is the TrainState
(sharded arrays, written by every process), `data` the input iterator's position and `meta`
the run's config and model config (JSON).

Restore order, for the phase about to run:
  1. this phase's latest checkpoint (a preempted or killed run continues);
  2. else the previous phase's final checkpoint (parameters, and optimizer moments if the
     phase keeps them: the phase transition);
  3. else a fresh initialisation.
A checkpoint that cannot be read (corrupt or incomplete) is moved aside, never deleted, with a
warning, and the one before it is used.
"""

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath


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

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state, data_state: dict, meta: dict) -> None:
        if step in self._manager.all_steps():
            return  # already saved (e.g. the phase end right after a periodic save)
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta),
            ),
        )

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

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
            str(error).splitlines()[0][:300] if str(error) else "",
            target,
        )
        sync("quarantine-start")
        if jax.process_index() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                target = target.parent / f"{step}.{int(time.time())}"
            source.rename(target)
        sync("quarantine-done")
        self._manager.close()
        self._manager = self._open()


def sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def abstract_with_shardings(abstract_tree, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings
    )


def final_step_of(workdir: str, phase_name: str, num_steps: int) -> bool:
    """Whether `phase_name` finished: a checkpoint at its last step exists."""
    return (checkpoint_dir(workdir, phase_name) / str(num_steps)).exists()


def restore_params_for_export(
    workdir: str, make_abstract_params: Callable[[dict], Any]
) -> tuple[dict, Any]:
    """Latest parameters of a training workdir, for export (see lambjax.models.hf).

    Looks through the phases of the run's config (newest phase first) and returns
    (meta, params) of the newest readable checkpoint. `make_abstract_params(meta)` gives the
    abstract parameter tree for that checkpoint's model config.
    """
    root = epath.Path(workdir) / "checkpoints"
    if not root.exists():
        raise FileNotFoundError(f"no checkpoints under {root}: is {workdir} a training workdir?")
    phases = sorted(
        (p for p in root.iterdir() if p.is_dir() and "." not in p.name),
        key=lambda p: os.path.getmtime(p),
        reverse=True,
    )
    for phase_dir in phases:
        manager = ocp.CheckpointManager(
            phase_dir,
            options=ocp.CheckpointManagerOptions(read_only=True),
            item_names=("state", "data", "meta"),
        )
        for step in sorted(manager.all_steps(), reverse=True):
            try:
                meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
                meta = meta.meta
                abstract = make_abstract_params(meta)
                state = manager.restore(
                    step,
                    args=ocp.args.Composite(state=ocp.args.PyTreeRestore(partial_restore=True)),
                )
            except Exception as error:  # noqa: BLE001
                logging.warning("skipping unreadable checkpoint %s/%s: %s", phase_dir, step, error)
                continue
            del abstract
            return meta, state.state["params"]
    raise FileNotFoundError(f"no readable checkpoint under {root}")
