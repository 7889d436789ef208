"""Running a sweep's trials on this machine, N at a time, and keeping track of them.

  DIR/sweep.json   the sweep: its config, and per trial its overrides, status, wall time and
                   final and best evaluation metrics (rewritten as trials start and end)
  DIR/NAME/        trial NAME's workdir (lambjax.main's), with its output in log.txt

Each trial is `python -m lambjax.main --config=CONFIG --workdir=DIR/NAME --config.F=V ...`,
so a trial is an ordinary run: rerunning the sweep skips trials whose last phase has its
final checkpoint and resumes the others from their checkpoints (bitwise, as any run). A
trial's process dies with the sweep's (`kill -9` included); SIGTERM or Ctrl-C to the sweep
asks every running trial to save and stop.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

from etils import epath

from lambjax.sweep.spec import Trial

SWEEP_FILE = "sweep.json"


def trial_command(config_spec: str, sweep_dir: str, trial: Trial, base_flags=()) -> list[str]:
    """`lambjax.main` for the trial: the sweep's own flags, then the trial's overrides."""
    return [
        sys.executable,
        "-m",
        "lambjax.main",
        f"--config={config_spec}",
        f"--workdir={os.path.join(sweep_dir, trial.name)}",
        *base_flags,
        *trial.flags(),
    ]


def final_checkpoint(config, sweep_dir: str, trial: Trial) -> epath.Path:
    """The checkpoint that exists once the trial has finished."""
    trial_config = config.copy_and_resolve_references()
    trial_config.update_from_flattened_dict(trial.overrides)
    last = trial_config.phase_order[-1]
    steps = trial_config.phases[last].num_steps
    return epath.Path(sweep_dir) / trial.name / "checkpoints" / last / str(steps)


class Sweep:
    """The trials of one sweep directory and their bookkeeping in sweep.json."""

    def __init__(
        self, config, config_spec: str, sweep_dir: str, trials: list[Trial], base_flags=()
    ):
        """`config` has the sweep's own `base_flags` (`--config.F=V`) applied already."""
        self.config, self.config_spec, self.base_flags = config, config_spec, list(base_flags)
        self.dir, self.trials = os.path.abspath(sweep_dir), trials
        self.records = {
            t.name: {"overrides": t.overrides, "status": "pending", "wall_time_s": 0.0}
            for t in trials
        }
        previous = self.read()
        for name, record in previous.get("trials", {}).items():
            if name in self.records:
                self.records[name]["wall_time_s"] = record.get("wall_time_s", 0.0)
        for trial in trials:
            if self.finished(trial):
                self.records[trial.name]["status"] = "finished"

    def read(self) -> dict:
        path = os.path.join(self.dir, SWEEP_FILE)
        if not os.path.exists(path):
            return {}
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def write(self) -> None:
        from lambjax.sweep import report

        for trial in self.trials:
            self.records[trial.name].update(report.summary(os.path.join(self.dir, trial.name)))
        content = {"config": self.config_spec, "flags": self.base_flags, "trials": self.records}
        os.makedirs(self.dir, exist_ok=True)
        temporary = os.path.join(self.dir, SWEEP_FILE + ".tmp")
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
        os.replace(temporary, os.path.join(self.dir, SWEEP_FILE))

    def finished(self, trial: Trial) -> bool:
        return final_checkpoint(self.config, self.dir, trial).exists()

    def pending(self) -> list[Trial]:
        return [t for t in self.trials if self.records[t.name]["status"] != "finished"]

    def command(self, trial: Trial) -> list[str]:
        return trial_command(self.config_spec, self.dir, trial, self.base_flags)

    def run_local(self, parallel: int, env: dict | None = None) -> int:
        """Runs the unfinished trials, `parallel` at a time; returns how many failed."""
        queue, running, failed = list(self.pending()), {}, 0
        stop = _StopSignal()
        self.write()
        while queue or running:
            while queue and len(running) < parallel and not stop.requested:
                trial = queue.pop(0)
                running[trial.name] = (trial, self.start(trial, env), time.time())
            time.sleep(0.5)
            if stop.requested:
                for _, process, _ in running.values():
                    if process.poll() is None:
                        process.send_signal(signal.SIGTERM)
                queue = []
            for name, (trial, process, started) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[name]
                record = self.records[name]
                record["wall_time_s"] += time.time() - started
                if self.finished(trial):
                    record["status"] = "finished"
                elif process.returncode == 0:
                    record["status"] = "stopped"
                else:
                    record["status"] = f"failed (exit {process.returncode}; see {name}/log.txt)"
                    failed += 1
                self.write()
        return failed

    def start(self, trial: Trial, env: dict | None) -> subprocess.Popen:
        workdir = os.path.join(self.dir, trial.name)
        os.makedirs(workdir, exist_ok=True)
        log = open(os.path.join(workdir, "log.txt"), "a", encoding="utf-8")  # noqa: SIM115
        self.records[trial.name]["status"] = "running"
        self.write()
        return subprocess.Popen(
            self.command(trial),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )


class _StopSignal:
    """SIGTERM and Ctrl-C to the sweep: running trials save and stop, none starts."""

    def __init__(self):
        self.requested = False
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.requested = True


def _die_with_parent() -> None:
    """Linux: the trial gets SIGKILL when the sweep process dies (even by kill -9)."""
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
