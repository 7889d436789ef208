r"""Run a config's sweep, or report on one.

  python -m lambjax.sweep --config=configs/bert_lamb.py:base,runlocal --workdir=DIR \
      [--parallel=N] [--launcher=local|tpu|slurm] [--sbatch='OPTIONS'] [--dry-run] \
      [--trial=NAME_OR_INDEX] [--config.FIELD=VALUE ...]
  python -m lambjax.sweep report DIR

The config file's `get_sweep(arg)` gives the trials (lambjax.sweep.spec); each runs as
`lambjax.main` in DIR/<trial name> with its overrides after the `--config.FIELD=VALUE` flags
given here (those apply to every trial), here (`local`), on TPU VMs through
launch/tpu/tpu_vm.sh (`tpu`, its settings from the environment), or as a SLURM job array of
launch/slurm/train.sbatch (`slurm`). Finished trials are skipped; interrupted ones resume.
`--trial` runs one trial in the foreground (what a SLURM array task runs); `--dry-run`
prints the trials' commands. The sweep's state is DIR/sweep.json; `report`
writes DIR/report.md and plots (lambjax.sweep.report).
"""

import json
import os
import shlex
import sys

from absl import flags
from ml_collections import config_flags

from lambjax import cli, console, storage  # storage: before any gs:// access

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file that defines get_sweep().")
_WORKDIR = flags.DEFINE_string("workdir", None, "The sweep's directory: one workdir per trial.")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Trials to run at a time on this machine.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the trials' commands; run nothing.")
_TRIAL = flags.DEFINE_string("trial", None, "Run only this trial (name or index), here.")
_LAUNCHER = flags.DEFINE_enum(
    "launcher", "local", ["local", "tpu", "slurm"], "Where trials run (lambjax.sweep.runner)."
)
_SBATCH = flags.DEFINE_string(
    "sbatch", "", "Options for sbatch (--launcher=slurm), e.g. '--nodes=2'."
)

PROGRAM = "lambjax.sweep"


def main(argv):
    console.setup()
    if argv[1:2] == ["report"]:
        return report(argv[2:])
    if len(argv) > 1:
        cli.fail(PROGRAM, f"unexpected arguments {argv[1:]}; did you mean `report DIR`?")
    if _CONFIG.value is None or _WORKDIR.value is None:
        cli.fail(PROGRAM, "give --config=FILE[:ARG] and --workdir=DIR (or: report DIR)")
    if _PARALLEL.value < 1:
        cli.fail(PROGRAM, f"--parallel={_PARALLEL.value} must be at least 1")

    from lambjax.sweep import runner, spec

    config_spec = cli.config_spec(sys.argv[1:])
    module, _ = cli.load_module(config_spec)
    if not hasattr(module, "get_sweep"):
        cli.fail(PROGRAM, f"--config={config_spec}: the file defines no get_sweep()")
    try:
        given = cli.call_config_function(module, "get_sweep", config_spec)
        study = None
        if hasattr(module, "get_study"):
            study = cli.call_config_function(module, "get_study", config_spec)
    except cli.ConfigCodeError as error:
        cli.fail_config_code(PROGRAM, error, flags.FLAGS.verbosity >= 1)
    except ValueError as error:  # its message names the config file
        cli.fail(PROGRAM, str(error))
    try:
        trials = spec.trials(_CONFIG.value, given)
    except (spec.SweepError, ValueError) as error:
        cli.fail(PROGRAM, f"--config={config_spec}: {error}")
    base_flags = cli.config_overrides(sys.argv[1:])
    try:
        storage.check_reachable(_WORKDIR.value, "--workdir")
    except storage.StorageError as error:
        cli.fail(PROGRAM, str(error))
    sweep = runner.Sweep(_CONFIG.value, config_spec, _WORKDIR.value, trials, base_flags, study)
    if _TRIAL.value is not None:
        trial = pick(trials, _TRIAL.value)
        os.execv(sys.executable, sweep.command(trial))
    launcher = _LAUNCHER.value
    if _DRY_RUN.value:
        for index, trial in enumerate(trials):
            done = "  # finished" if sweep.records[trial.name]["status"] == "finished" else ""
            slot = index % _PARALLEL.value if _PARALLEL.value > 1 else None
            command = sweep.command(trial, "local" if launcher == "slurm" else launcher, slot)
            print(shlex.join(command) + done)
        return
    if launcher == "slurm":
        try:
            print(sweep.submit_slurm(shlex.split(_SBATCH.value)))
        except (OSError, RuntimeError) as error:
            cli.fail(PROGRAM, f"--launcher=slurm: {error}")
        print(f"then: python -m lambjax.sweep report {sweep.dir}")
        return
    if launcher == "tpu" and not os.environ.get("TPU_NAME"):
        cli.fail(PROGRAM, "--launcher=tpu: set TPU_NAME (and PROJECT, ZONE) as for tpu_vm.sh")
    try:
        console.log_to_file(sweep.dir, "sweep.log")
    except OSError as error:
        cli.fail(PROGRAM, f"--workdir={_WORKDIR.value}: {storage.reason(error)}")
    try:
        failed = sweep.run(_PARALLEL.value, launcher)
    except spec.SweepError as error:
        cli.fail(PROGRAM, str(error))
    print(report_text(sweep.dir))
    if failed:
        cli.fail(PROGRAM, f"{failed} trial(s) failed; sweep.json names their logs")


def pick(trials, key: str):
    by_name = {t.name: t for t in trials}
    if key in by_name:
        return by_name[key]
    if key.isdigit() and int(key) < len(trials):
        return trials[int(key)]
    cli.fail(PROGRAM, f"--trial={key}: no such trial; give an index below {len(trials)} or a name")


def report(args: list[str]) -> None:
    if len(args) != 1:
        cli.fail(PROGRAM, "report takes one directory: python -m lambjax.sweep report DIR")
    try:
        print(report_text(args[0]))
    except json.JSONDecodeError as error:  # before ValueError, its base class
        cli.fail(PROGRAM, f"{args[0]}: a file of the sweep is not valid JSON ({error})")
    except (FileNotFoundError, ValueError) as error:  # no sweep there; an unknown study
        cli.fail(PROGRAM, str(error))


def report_text(directory: str) -> str:
    from lambjax.sweep import report as report_lib

    table = report_lib.write_report(directory)
    return f"{table}\n\nreport: {os.path.join(directory, 'report.md')} (plots beside it)"


def parse_flags(argv: list[str]) -> list[str]:
    argv = [
        arg.replace("--dry-run", "--dry_run", 1) if arg.startswith("--dry-run") else arg
        for arg in argv
    ]
    return cli.flags_parser(PROGRAM)(argv)


def run() -> None:
    """The `lambjax-sweep` command (setup.py's console script)."""
    cli.run(main, "lambjax.sweep.__main__", PROGRAM, parser=parse_flags)


if __name__ == "__main__":
    run()
