"""What lambjax's commands share: a user's mistake ends a command with exit status 2 and one
line, `PROGRAM: error: ...`, naming the value and what would be valid; never a traceback.

`flags_parser(program)` is the `flags_parser` of `absl.app.run` for commands that take an
ml_collections `--config=FILE[:ARG]` with `--config.FIELD=VALUE` overrides. Before absl
parses the flags it loads the config file itself and checks every override's field name and
value, so that a missing file, a config argument the file rejects, a mistyped field or a
value of the wrong type is reported as such (ml_collections would raise from inside flag
parsing, with a traceback).

`define_run_flags` and `start_run` are the start-up that the commands which train
(`lambjax.main`, `lambjax.finetune`) share: the config, the workdir and the distributed
flags; then the console (lambjax.console), CPU memory settings and JAX's distributed runtime.

Importing this module quiets TensorFlow's start-up logs, for the commands that import it
(reading Google's original TensorFlow checkpoints, `tf:DIR`, and TFDS's dataset builds); a
pretraining or fine-tuning run itself never does.
"""

import difflib
import importlib.util
import os
import signal
import sys
import traceback
from typing import NoReturn

import ml_collections
from absl import flags
from ml_collections import config_flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow 2.21 logs a oneDNN notice at import whatever the level.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def fail(program: str, message: str, status: int = 2) -> NoReturn:
    print(f"{program}: error: {message}", file=sys.stderr)
    sys.exit(status)


def define_run_flags(config_help: str, workdir_help: str):
    """--config, --workdir and the distributed flags (--coordinator_address,
    --num_processes, --process_id) of a command that trains; (config, workdir) holders."""
    config = config_flags.DEFINE_config_file("config", None, config_help)
    workdir = flags.DEFINE_string("workdir", None, workdir_help)
    flags.DEFINE_string(
        "coordinator_address", None, "host:port of process 0, for multi-process runs."
    )
    flags.DEFINE_integer("num_processes", None, "Number of processes.")
    flags.DEFINE_integer("process_id", None, "This process's index.")
    flags.mark_flags_as_required(["config", "workdir"])
    return config, workdir


def start_run(argv: list[str]) -> None:
    """What a command that trains does first: on a pod every host runs the same command, and
    JAX's distributed runtime starts from the environment (TPU VM, SLURM) or from the flags.
    JAX's backends must not start before this."""
    from absl import app

    from lambjax import console, distributed, host_memory, xla_flags

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    console.setup()
    if distributed.platform() == "cpu":
        # Before JAX starts its CPU client: XLA:CPU reallocates every temporary per step.
        host_memory.retain_freed_memory()
    xla_flags.apply(distributed.platform())  # before JAX's backend reads XLA_FLAGS
    values = flags.FLAGS
    distributed.initialize(values.coordinator_address, values.num_processes, values.process_id)


class ConfigCodeError(ValueError):
    """A config file's own code failed: importing it, or its get_config / get_sweep. The
    message names the file and the exception; `details` is the traceback."""

    def __init__(self, message: str, details: str):
        super().__init__(message)
        self.details = details


def fail_config_code(program: str, error: ConfigCodeError, verbose: bool) -> NoReturn:
    """The one line of a config file's failure; the traceback first where `verbose`."""
    if verbose:
        print(error.details, file=sys.stderr, end="")
        fail(program, str(error))
    fail(program, f"{error} (--verbosity=1 prints the traceback)")


def verbose_flag(args: list[str]) -> bool:
    """Whether absl's --verbosity (-v) in `args`, not yet parsed, asks for 1 or more."""
    value = None
    for index, arg in enumerate(args):
        name, has_value, given = arg.lstrip("-").partition("=")
        if arg.startswith("-") and name in ("v", "verbosity"):
            value = given if has_value else (args[index + 1] if index + 1 < len(args) else None)
    try:
        return value is not None and int(value) >= 1
    except ValueError:
        return False


# The commands setup.py installs, by the module each runs (`python -m MODULE` runs it too).
COMMANDS = {
    "lambjax.main": "lambjax-train",
    "lambjax.prepare": "lambjax-prepare",
    "lambjax.finetune": "lambjax-finetune",
    "lambjax.export": "lambjax-export",
    "lambjax.sweep": "lambjax-sweep",
}
HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "-helpshort")


def run(main, module: str, program: str, parser=None) -> None:
    """Runs a command's `main` (absl.app.run, its flags parsed by `parser`, default
    `flags_parser(program)`) whether it was started as `python -m MODULE` or as its installed
    command (COMMANDS). `--help` prints the command's own help (`command_help`) first."""
    from absl import app

    parse = parser or flags_parser(program)

    def parse_or_help(argv: list[str]) -> list[str]:
        if any(arg in HELP_FLAGS for arg in argv[1:]):
            print(command_help(module))
            sys.exit(0)
        return parse(argv)

    signal.signal(signal.SIGINT, interrupt_handler(program))
    app.run(main, flags_parser=parse_or_help)


# The exit status of a command that Ctrl-C stopped at once.
INTERRUPTED_STATUS = 130


def interrupt_handler(program: str):
    """Ctrl-C's handler from a command's start: one line, then the process ends at once, as
    a kill would (everything lambjax writes survives a kill: the same command continues).
    Not a KeyboardInterrupt, which Python drops where it lands in a garbage-collection
    callback (the command then went on as if no Ctrl-C came). A training loop takes the
    first Ctrl-C as a stop request instead (lambjax.distributed.StopRequest) and hands the
    next one back here."""
    line = f"{program}: interrupted (Ctrl-C); what was saved is kept: the same command continues\n"

    def interrupt(signum, frame):
        os.write(2, line.encode())  # no print: the handler may interrupt a write to stderr
        os._exit(INTERRUPTED_STATUS)

    return interrupt


def command_help(module: str) -> str:
    """The command's docstring (its usage and examples), then the flags it defines itself;
    absl's `--helpfull` lists the rest (JAX's, TensorFlow's, ...)."""
    # Run as `python -m`, the module is __main__, and absl files its flags under its path.
    module_object = sys.modules.get(module) or sys.modules["__main__"]
    path = module.replace(".", "/") + ".py"
    own = [
        line  # each module's help starts with a line naming it
        for name in flags.FLAGS.flags_by_module_dict()
        if name in (module, "lambjax.cli") or name.endswith(path)
        for line in flags.FLAGS.module_help(name).strip().splitlines()[1:]
    ]
    name = module.removesuffix(".__main__")
    lines = [
        f"usage: {COMMANDS.get(name, name)} [flags]   (or: python -m {name} [flags])",
        "",
        (module_object.__doc__ or "").strip(),
        "",
        "flags:",
        *own,
        "",
    ]
    if "config" in flags.FLAGS:
        lines.append("A config's fields are flags too: --config.FIELD=VALUE.")
    lines.append("--helpfull lists every flag (JAX's, TensorFlow's, ...).")
    return "\n".join(lines)


def flags_parser(program: str, config_flag: str = "config"):
    def parse(argv: list[str]) -> list[str]:
        try:
            check_config_flags(argv[1:], config_flag)
            return flags.FLAGS(argv)
        except ConfigCodeError as error:
            fail_config_code(program, error, verbose_flag(argv[1:]))
        except (flags.Error, ValueError) as error:
            fail(program, str(error).strip().splitlines()[0])

    return parse


def check_config_flags(args: list[str], name: str = "config") -> None:
    """Raises ValueError naming the first bad `--NAME` or `--NAME.FIELD` flag in `args`."""
    spec = config_spec(args, name)
    if spec is None:
        return  # absl reports the missing flag
    config = load_config(spec, name)
    for override in config_overrides(args, name):
        check_override(config, override, spec, name)


def config_spec(args: list[str], name: str = "config") -> str | None:
    """The `FILE[:ARG]` of `--NAME=FILE[:ARG]` (or `--NAME FILE[:ARG]`) in `args`."""
    spec = None
    for index, arg in enumerate(args):
        if arg == f"--{name}" and index + 1 < len(args):
            spec = args[index + 1]
        elif arg.startswith(f"--{name}="):
            spec = arg.split("=", 1)[1]
    return spec


def config_overrides(args: list[str], name: str = "config") -> list[str]:
    """The `--NAME.FIELD=VALUE` (and `--noNAME.FIELD`) flags in `args`, in order."""
    return [arg for arg in args if arg.startswith((f"--{name}.", f"--no{name}."))]


def load_config(spec: str, name: str = "config") -> ml_collections.ConfigDict:
    """`get_config(ARG)` of the file in `FILE[:ARG]`, as ml_collections' config flag calls it."""
    module, arg = load_module(spec, name)
    return call_config_function(module, "get_config", spec, name)


def call_config_function(module, function: str, spec: str, name: str = "config"):
    """`module.FUNCTION(ARG)` of `FILE[:ARG]` (FUNCTION() without ARG). Its ValueError is a
    message for the user (e.g. an unknown variant); any other exception is a fault in the
    file's code: ConfigCodeError naming the file, the call and the exception."""
    arg = spec.partition(":")[2]
    try:
        return getattr(module, function)(arg) if arg else getattr(module, function)()
    except ValueError as error:
        raise ValueError(f"--{name}={spec}: {error}") from error
    except Exception as error:  # noqa: BLE001 - whatever the user's code raises
        call = f"{function}({arg!r})" if arg else f"{function}()"
        raise ConfigCodeError(
            f"--{name}={spec}: {call} raised {_exception_line(error)}",
            traceback.format_exc(),
        ) from None


def _exception_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def load_module(spec: str, name: str = "config"):
    """(the config file's module, ARG or "") of `FILE[:ARG]`."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        folder = os.path.dirname(path) or "."
        known = (
            sorted(f for f in os.listdir(folder) if f.endswith(".py"))
            if os.path.isdir(folder)
            else []
        )
        hint = f" (config files in {folder}: {', '.join(known)})" if known else ""
        raise ValueError(f"--{name}={spec}: no such config file {path}{hint}")
    module_spec = importlib.util.spec_from_file_location("lambjax_config_file", path)
    if module_spec is None:
        raise ValueError(f"--{name}={spec}: {path} is not a Python file (a config is FILE.py)")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except (SyntaxError, ValueError, UnicodeDecodeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"--{name}={spec}: {path} is not a readable Python file ({reason})"
        ) from None
    except Exception as error:  # noqa: BLE001 - the file's code failed (e.g. an ImportError)
        raise ConfigCodeError(
            f"--{name}={spec}: importing {path} raised {_exception_line(error)}",
            traceback.format_exc(),
        ) from None
    if not hasattr(module, "get_config"):
        raise ValueError(f"--{name}={spec}: {path} defines no get_config()")
    return module, arg


def check_override(config, override: str, spec: str, name: str) -> None:
    flag, has_value, value = override.partition("=")
    negated = flag.startswith(f"--no{name}.")
    path = flag.split(".", 1)[1]
    node, parts = config, path.split(".")
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth])
        if not isinstance(node, ml_collections.ConfigDict):
            raise ValueError(f"{flag}: config.{where} is a value, not a group of fields")
        if part not in node:
            close = difflib.get_close_matches(part, list(node.keys()), n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; fields: {sorted(node.keys())}"
            prefix = f"config.{where}" if where else "the config"
            raise ValueError(f"{flag}: {prefix} ({spec}) has no field {part!r}{hint}")
        leaf_type = node.get_type(part)
        node = node[part]
    if not has_value or isinstance(node, ml_collections.ConfigDict):
        if negated or not has_value:
            if leaf_type is not bool:
                raise ValueError(f"{flag}: config.{path} is not a bool; give --{name}.{path}=VALUE")
        return
    check_type(f"{flag}={value}", f"config.{path}", leaf_type, node, value)


def check_type(flag: str, field: str, leaf_type, current, value: str) -> None:
    """Values of int, float and bool fields must parse as such (others: ml_collections)."""
    parsers = {int: int, float: float, bool: _parse_bool}
    if leaf_type not in parsers:
        return
    try:
        parsers[leaf_type](value)
    except ValueError:
        raise ValueError(
            f"{flag}: {field} takes {_TYPE_NAMES[leaf_type]} (the config gives {current!r})"
        ) from None


def _parse_bool(value: str) -> bool:
    if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(value)
    return value.lower() in ("true", "1")


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false"}
