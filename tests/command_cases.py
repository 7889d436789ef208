"""Runs `python -m MODULE ARGS` for many commands at the cost of one interpreter start.

  python tests/command_cases.py CASES.json OUT_DIR

CASES.json is a list of [MODULE, [ARG, ...]]. The process imports what lambjax's commands
import (JAX, Orbax, TFDS, grain, ...) once, then forks a child per case that runs
MODULE as `__main__` with `sys.argv` set to the case's arguments, its stdout and stderr in
OUT_DIR/INDEX.out and .err; an exception that escapes is printed as Python prints it.
Prints the children's exit statuses as a JSON list.
"""

import json
import os
import runpy
import sys
import traceback

PRELOAD = (
    "jax",
    "tensorflow_datasets",
    "orbax.checkpoint",
    "grain",
    "lambjax.cli",
    "lambjax.storage",
    "lambjax.data",
    "lambjax.train.trainer",
    "lambjax.finetune.loop",
    "lambjax.sweep.runner",
)


def run_case(module: str, args: list[str], out: str, err: str) -> None:
    """In the child: MODULE as `python -m` runs it; never returns."""
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
    except BaseException:  # noqa: BLE001 - what the interpreter would print
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    cases_file, out_dir = sys.argv[1:3]
    for name in PRELOAD:
        __import__(name)
    with open(cases_file, encoding="utf-8") as f:
        cases = json.load(f)
    codes = []
    for index, (module, args) in enumerate(cases):
        out, err = (os.path.join(out_dir, f"{index}.{kind}") for kind in ("out", "err"))
        pid = os.fork()
        if pid == 0:
            run_case(module, args, out, err)
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
    print(json.dumps(codes))


if __name__ == "__main__":
    main()
