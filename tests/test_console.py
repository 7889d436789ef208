"""The console a person watches, and the full log beside the run (lambjax.console)."""

import logging
import os
import re
import sys

import pytest
from absl import logging as absl_logging

from lambjax import console

LAMBJAX = os.path.join(os.path.dirname(console.__file__), "train", "trainer.py")
SITE = os.path.join("/venv", "lib", "python3.11", "site-packages")


def record(message, level=logging.INFO, pathname=LAMBJAX, name="absl"):
    return logging.LogRecord(name, level, pathname, 1, message, (), None)


@pytest.mark.parametrize(
    ("entry", "shown"),
    [
        (record("phase1 step 20/300 | loss 8.6126"), True),
        (record("warning from lambjax", logging.WARNING), True),
        (record("Load dataset info from /d", pathname=f"{SITE}/tensorflow_datasets/x.py"), False),
        (record("Unable to initialize backend 'tpu'", pathname=f"{SITE}/jax/_src/x.py"), False),
        (record("a library's real warning", logging.WARNING, f"{SITE}/orbax/x.py"), True),
        (record("a Beam notice", logging.WARNING, f"{SITE}/apache_beam/io/x.py", "root"), False),
        (record("w", logging.WARNING, f"{SITE}/x.py", "apache_beam.runners"), False),
        (
            record(
                "For 'pretraining_examples/1.0.0': fields info.[module_name] differ on disk and "
                "in the code. Keeping the one from code.",
                logging.WARNING,
                f"{SITE}/tensorflow_datasets/core/dataset_info.py",
            ),
            False,
        ),
        (record("AdaptiveReadaheadCache enabled", logging.WARNING, f"{SITE}/fsspec/c.py"), False),
        (record("DeprecationWarning: x", logging.WARNING, f"{SITE}/w.py", "py.warnings"), False),
    ],
)
def test_the_console_shows_lambjax_and_real_warnings(entry, shown):
    assert console.console_filter(entry) is shown


def raised_in(filename):
    """The exc_info of an error raised by code that `filename` holds."""
    namespace = {}
    exec(
        compile("def fail():\n    raise ValueError('RESOURCE_EXHAUSTED')\n", filename, "exec"),
        namespace,
    )
    try:
        namespace["fail"]()
    except ValueError:
        return sys.exc_info()


@pytest.mark.parametrize(("filename", "shown"), [(f"{SITE}/orbax/x.py", False), (LAMBJAX, True)])
def test_an_error_that_orbax_raised_and_asyncio_logs_stays_off_the_console(filename, shown):
    """A failed save's writes still pending as asyncio tasks: asyncio logs each one's error
    as the task is collected, after lambjax's line said the save failed."""
    entry = record("Task exception was never retrieved", logging.ERROR, f"{SITE}/asyncio/b.py")
    entry.name, entry.exc_info = "asyncio", raised_in(filename)
    assert console.console_filter(entry) is shown


def test_console_lines_have_no_prefix_and_warnings_say_so():
    formatter = console.ConsoleFormatter()
    assert formatter.format(record("phase1 step 20/300")) == "phase1 step 20/300"
    assert formatter.format(record("disk full", logging.WARNING)) == "warning: disk full"
    assert formatter.format(record("no", logging.ERROR)) == "error: no"


@pytest.fixture
def info_level():
    """Root and absl loggers at INFO (absl's default verbosity), restored afterwards."""
    loggers = (logging.getLogger(), absl_logging.get_absl_logger())
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
    yield
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(level)


def test_the_log_file_holds_everything_from_the_start_in_absl_format(
    tmp_path, monkeypatch, info_level
):
    root = logging.getLogger()
    monkeypatch.setattr(console._Setup, "buffer", None)
    monkeypatch.setattr(console._Setup, "file_handler", None)
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # restored after the test
    absl_handler = absl_logging.get_absl_handler()  # setup() gives it a filter and format
    monkeypatch.setattr(absl_handler, "filters", list(absl_handler.filters))
    python_handler = absl_handler.python_handler
    monkeypatch.setattr(python_handler, "formatter", python_handler.formatter)
    console.setup()
    absl_logging.info("before the workdir was accepted")
    assert not os.listdir(tmp_path)  # a refused command leaves nothing behind
    path = console.log_to_file(str(tmp_path / "run"), console.process_log_name("train", 0))
    absl_logging.info("after")
    console._Setup.file_handler.flush()
    assert path == str(tmp_path / "run" / "train.log")
    lines = open(path, encoding="utf-8").read().splitlines()
    assert len(lines) == 2
    assert re.match(r"I\d{4} [\d:.]+ +\d+ test_console.py:\d+\] before the workdir", lines[0])
    assert lines[1].endswith("] after")
    assert console.process_log_name("train", 3) == "train.3.log"
    console._Setup.file_handler.close()
    logging.captureWarnings(False)
