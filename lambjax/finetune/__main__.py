r"""Fine-tune and evaluate on SQuAD or GLUE.

  python -m lambjax.finetune --config=configs/finetune/squad.py[:v2] --workdir=DIR \
      --config.init=workdir:PRETRAIN_DIR \
      --config.data.train=train-v1.1.json --config.data.eval=dev-v1.1.json
  python -m lambjax.finetune --config=configs/finetune/glue.py:TASK --workdir=DIR ...

Rerunning a command continues its run from the last checkpoint in --workdir. On a pod every
host runs the same command (see lambjax.main for the distributed flags). Bad input (a missing
file, malformed data, an unknown task) ends with one line on stderr and exit status 2.
"""

import logging as std_logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow 2.21 logs a oneDNN notice at import whatever the level; its oneDNN kernels
# serve no computation of lambjax (event files, TFDS decoding).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from absl import app, flags, logging
from ml_collections import config_flags

from lambjax import cli, distributed, host_memory, storage  # storage: before any gs:// access

_CONFIG = config_flags.DEFINE_config_file("config", None, "Fine-tuning config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics, results.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for multi-process runs."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
flags.mark_flags_as_required(["config", "workdir"])


def _quiet_libraries(record) -> bool:
    """Keeps Orbax's per-save INFO chatter out of the log (warnings stay)."""
    return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.get_absl_logger().addFilter(_quiet_libraries)
    if distributed.platform() == "cpu":
        host_memory.retain_freed_memory()
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)

    from lambjax.data import DataError
    from lambjax.finetune import loop
    from lambjax.train.checkpointing import CheckpointMismatch

    try:
        loop.finetune(_CONFIG.value, _WORKDIR.value)
    except (DataError, CheckpointMismatch, storage.StorageError) as error:  # incl. FinetuneError
        cli.fail("lambjax.finetune", str(error))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.flags_parser("lambjax.finetune"))
