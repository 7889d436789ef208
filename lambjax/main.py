r"""Entry point: pretrain BERT with the config given on the command line.

  python -m lambjax.main --config=configs/default.py --workdir=/tmp/demo \
      [--config.phases.phase1.num_steps=100 ...]

On a pod every host runs the same command; JAX's distributed runtime is initialised from the
environment (TPU VM, SLURM) or from --coordinator_address/--num_processes/--process_id.
Rerunning a command continues its run from the last checkpoint in --workdir.

Exit status: 0 when the run finished or stopped on request (SIGTERM, Ctrl-C, a preemption
notice); 2 for a mistake in the command (one line says which); 3 when the loss stayed
non-finite (one line names the checkpoint kept, the last finite state); 75 when a checkpoint
could not be written (a full disk, a bucket refusing writes: one line says where and what to
do; the same command continues the run once that is fixed); 130 after a second Ctrl-C.
"""

from absl import logging

from lambjax import cli, storage  # cli: quiets TensorFlow; storage: before any gs:// access

_CONFIG, _WORKDIR = cli.define_run_flags(
    "Experiment config file.", "Directory for checkpoints and metrics."
)


def main(argv):
    cli.start_run(argv)

    # Imported after distributed initialisation: JAX must not start its backends before it.
    import jax

    from lambjax.data import DataError
    from lambjax.train import trainer
    from lambjax.train.checkpointing import SAVE_FAILED_STATUS, CheckpointMismatch, SaveFailed
    from lambjax.train.config import ConfigError
    from lambjax.train.phases import MissingPhaseCheckpoint
    from lambjax.train.workdir import WorkdirError

    user_errors = (
        CheckpointMismatch,
        ConfigError,
        DataError,
        MissingPhaseCheckpoint,
        storage.StorageError,
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
    except trainer.TrainingStopped as error:  # the loss diverged: one line, its own status
        cli.fail("lambjax", str(error), trainer.DIVERGED_STATUS)
    except SaveFailed as error:  # a full disk, a bucket refusing writes: rerun once fixed
        cli.fail("lambjax", str(error), SAVE_FAILED_STATUS)


def run() -> None:
    """The `lambjax-train` command (setup.py's console script)."""
    cli.run(main, "lambjax.main", "lambjax")


if __name__ == "__main__":
    run()
