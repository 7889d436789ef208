r"""Fine-tune and evaluate on SQuAD or GLUE.

  python -m lambjax.finetune --config=configs/finetune/squad.py[:v2] --workdir=DIR \
      --config.init=workdir:PRETRAIN_DIR \
      --config.data.train=train-v1.1.json --config.data.eval=dev-v1.1.json
  python -m lambjax.finetune --config=configs/finetune/glue.py:TASK --workdir=DIR ...

Rerunning a command continues its run from the last checkpoint in --workdir. On a pod every
host runs the same command (see lambjax.main for the distributed flags). Bad input (a missing
file, malformed data, an unknown task) ends with one line on stderr and exit status 2; a
checkpoint that cannot be written (a full disk), with one line and exit status 75.
"""

from lambjax import cli, storage  # cli: quiets TensorFlow; storage: before any gs:// access

_CONFIG, _WORKDIR = cli.define_run_flags(
    "Fine-tuning config file.", "Directory for checkpoints, metrics, results."
)


def main(argv):
    cli.start_run(argv)

    from lambjax.data import DataError
    from lambjax.finetune import loop
    from lambjax.train.checkpointing import SAVE_FAILED_STATUS, CheckpointMismatch, SaveFailed

    try:
        loop.finetune(_CONFIG.value, _WORKDIR.value)
    except (DataError, CheckpointMismatch, storage.StorageError) as error:  # incl. FinetuneError
        cli.fail("lambjax.finetune", str(error))
    except SaveFailed as error:  # a full disk, a bucket refusing writes: rerun once fixed
        cli.fail("lambjax.finetune", str(error), SAVE_FAILED_STATUS)


def run() -> None:
    """The `lambjax-finetune` command (setup.py's console script)."""
    cli.run(main, "lambjax.finetune.__main__", "lambjax.finetune")


if __name__ == "__main__":
    run()
