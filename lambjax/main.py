r"""Entry point: pretrain BERT with the config given on the command line.

  python -m lambjax.main --config=configs/default.py --workdir=/tmp/demo \
      [--config.phases.phase1.num_steps=100 ...]

On a pod every host runs the same command; JAX's distributed runtime is initialised from the
environment (TPU VM, SLURM) or from --coordinator_address/--num_processes/--process_id.
Rerunning a command continues its run from the last checkpoint in --workdir.
"""

import logging as std_logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow (metric writers, TFDS) is quiet
# TensorFlow 2.21 logs a oneDNN notice at import whatever the level; its oneDNN kernels
# serve no computation of lambjax (event files, TFDS decoding).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from absl import app, flags, logging
from ml_collections import config_flags

from lambjax import cli, distributed, host_memory, storage  # storage: before any gs:// access

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for multi-process runs."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
flags.mark_flags_as_required(["config", "workdir"])


def quiet_libraries(record) -> bool:
    """Keeps Orbax's per-save INFO chatter out of the training log (warnings stay)."""
    return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.get_absl_logger().addFilter(quiet_libraries)
    if distributed.platform() == "cpu":
        # Before JAX starts its CPU client: XLA:CPU reallocates every temporary per step.
        host_memory.retain_freed_memory()
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)

    # Imported after distributed initialisation: JAX must not start its backends before it.
    import jax

    from lambjax.data import DataError
    from lambjax.train import trainer
    from lambjax.train.checkpointing import CheckpointMismatch
    from lambjax.train.config import ConfigError
    from lambjax.train.phases import MissingPhaseCheckpoint
    from lambjax.train.workdir import WorkdirError

    user_errors = (
        CheckpointMismatch,
        ConfigError,
        DataError,
        MissingPhaseCheckpoint,
        storage.StorageError,
        trainer.TrainingStopped,
        WorkdirError,
    )

    logging.info(
        "lambjax: process %d of %d, %d local / %d global devices (%s)",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.devices()[0].device_kind,
    )
    try:
        trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except user_errors as error:  # one line (per differing field), not a traceback
        cli.fail("lambjax", str(error))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.flags_parser("lambjax"))
