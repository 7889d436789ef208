"""The one logging set-up of lambjax's commands: a console a person watches, and the full log
in a file beside the run.

  console (stderr)  lambjax's own lines as they are written (no absl prefix), and warnings
                    (`warning: ...`) from anyone except known noise; libraries' INFO
                    records (TFDS metadata, JAX's backend probing, Orbax, fsspec's readahead
                    notices, Beam) and Python warnings stay out of it
  log file          every record at the verbosity, in absl's format (level, time, thread,
                    file:line), in the run's directory: `log_to_file(directory, name)`

`--verbosity` (or `-v`) given on the command line turns the filtering off: the console then
shows what absl would, in absl's format. Until `log_to_file` is called, records are held in
memory, so a command refused before its first write (a bad flag, a workdir of another run)
leaves no file behind; the file then receives them all.
"""

import logging as std_logging
import logging.handlers
import os
import sys
import tempfile
import traceback

from absl import flags
from absl import logging as absl_logging

from lambjax import storage

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep

# Warnings that say nothing a user can act on (they stay in the log file).
_NOISY_LOGGERS = ("apache_beam", "py.warnings")
_NOISY_PATH = f"{os.sep}apache_beam{os.sep}"  # Beam also logs through the root logger
# Orbax logs a failed save or restore as errors with tracebacks; lambjax says what happened in
# a line of its own (a checkpoint set aside, a save that failed: exit status 75).
_EXPLAINED_PATH = f"{os.sep}orbax{os.sep}"
_NOISY_MESSAGES = (
    "differ on disk and in the code",  # TFDS: dataset_info of our own builder
    "AdaptiveReadaheadCache",  # fsspec/gcsfs, one per opened gs:// file
    # Orbax, on every read-only look at a run's checkpoints (export, fine-tuning's init):
    "CheckpointManagerOptions.read_only=True",
    "Given directory is read only",
    "Metadata file does not exist",
    # Orbax, as a checkpoint save fails (a full disk), which lambjax's own line
    # (lambjax.train.checkpointing.SaveFailed) replaces.
    "_SignalingThread.run() raised an exception",
    "Handler Commit operations or the Commit callback in background save thread",
    "Save Finalize thread (save_finalize) failed",
    "Failed to write metadata=",
    # gcsfs, when a bucket keeps failing a request (lambjax's own line says what failed).
    "out of retries on exception",
)


class ConsoleFormatter(std_logging.Formatter):
    """lambjax's INFO lines as written; warnings and errors with their level."""

    def format(self, record: std_logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        if record.levelno >= std_logging.ERROR:
            return f"error: {message}"
        if record.levelno >= std_logging.WARNING:
            return f"warning: {message}"
        return message


def is_lambjax(record: std_logging.LogRecord) -> bool:
    """Whether lambjax's own code wrote the record (absl logs every module under 'absl')."""
    return os.path.abspath(record.pathname).startswith(_PACKAGE)


# `logging.info(..., extra=FILE_ONLY)`: a record for the log file only (a traceback that a
# one-line message on the console already explains).
FILE_ONLY = {"file_only": True}


def console_filter(record: std_logging.LogRecord) -> bool:
    """What reaches the console: lambjax's lines, and warnings that are not known noise."""
    if getattr(record, "file_only", False):
        return False
    if is_lambjax(record):
        return True
    if record.levelno < std_logging.WARNING:
        return False
    if _NOISY_PATH in record.pathname:
        return False
    if record.exc_info and (
        _EXPLAINED_PATH in record.pathname or _raised_in(record.exc_info, _EXPLAINED_PATH)
    ):
        return False  # also asyncio's "Task exception was never retrieved" on Orbax's writes
    if any(record.name == n or record.name.startswith(n + ".") for n in _NOISY_LOGGERS):
        return False
    message = record.getMessage()
    return not any(noise in message for noise in _NOISY_MESSAGES)


def _raised_in(exc_info, path: str) -> bool:
    """Whether the exception (or one it was raised from) passed through code under `path`."""
    error, seen = exc_info[1], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any(path in frame.filename for frame in traceback.extract_tb(error.__traceback__)):
            return True
        error = error.__cause__ or error.__context__
    return False


class _Setup:
    buffer: logging.handlers.MemoryHandler | None = None
    file_handler: std_logging.Handler | None = None
    log_file: str | None = None


def setup() -> None:
    """Sets the console up for a command; call it first in `main` (after absl parsed flags)."""
    handler = absl_logging.get_absl_handler()
    verbose = flags.FLAGS.is_parsed() and flags.FLAGS["verbosity"].present
    if not verbose:
        handler.setFormatter(ConsoleFormatter())
        handler.addFilter(console_filter)
    std_logging.captureWarnings(True)  # Python warnings: to the log file, not the console
    if not verbose:
        sys.unraisablehook = log_unraisable
    if _Setup.buffer is None and _Setup.file_handler is None:
        _Setup.buffer = logging.handlers.MemoryHandler(
            capacity=100_000, flushLevel=std_logging.CRITICAL + 1, flushOnClose=False
        )
        std_logging.root.addHandler(_Setup.buffer)


class LogFileHandler(std_logging.FileHandler):
    def handleError(self, record: std_logging.LogRecord) -> None:
        """A record that cannot be written (the disk is full) is dropped, without the dozen
        lines of traceback `logging` would print: the console has the run's own lines,
        among them the one that says the disk is full."""


def log_unraisable(unraisable) -> None:
    """Exceptions that Python cannot raise (in a finaliser, or a library's callback: Orbax's
    writes still in flight when a failed save closed their event loop, one traceback each)
    go to the log file, not the console."""
    std_logging.getLogger("lambjax").warning(
        "Exception ignored in %r",
        unraisable.object,
        exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback),
        extra=FILE_ONLY,
    )


def log_to_file(directory: str, name: str) -> str:
    """Writes the full log (what was held so far, then everything) to `directory/name`;
    a gs:// directory's log goes to a local file instead (an object cannot be appended to),
    named on the console. Returns the file's path."""
    if _Setup.file_handler is not None:
        return _Setup.log_file
    if storage.is_remote(directory):
        folder = os.path.join(tempfile.gettempdir(), "lambjax-logs")
        flat = storage.resolve(directory).replace("://", "_").replace("/", "_")
        path = os.path.join(folder, f"{flat}.{name}")
    else:
        folder = directory
        path = os.path.join(directory, name)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    file_handler = LogFileHandler(path, encoding="utf-8")
    file_handler.setFormatter(absl_logging.PythonFormatter())
    if _Setup.buffer is not None:
        _Setup.buffer.setTarget(file_handler)
        _Setup.buffer.flush()
        std_logging.root.removeHandler(_Setup.buffer)
        _Setup.buffer = None
    std_logging.root.addHandler(file_handler)
    _Setup.file_handler, _Setup.log_file = file_handler, path
    if storage.is_remote(directory):
        absl_logging.info("Full log (gs:// objects cannot be appended to): %s", path)
    return path


def process_log_name(program: str, process_index: int) -> str:
    """`train.log` on process 0, `train.3.log` on process 3 of a pod sharing the workdir."""
    return f"{program}.log" if process_index == 0 else f"{program}.{process_index}.log"


def quiet_progress_bars() -> None:
    """TFDS's tqdm bars (and the blank lines they leave when output is not a terminal)."""
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        return
    tfds.disable_progress_bar()
