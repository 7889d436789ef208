"""Running a sweep's trials, and keeping track of them.

  DIR/sweep.json   the sweep: its config (and study, where the config file has one), and per
                   trial its overrides, labels, status, wall time and final and best
                   evaluation metrics (rewritten as trials start and end)
  DIR/NAME/        trial NAME's workdir (lambjax.main's), with its output in log.txt

Where trials run (`launcher`):
  local  `python -m lambjax.main --config=CONFIG --workdir=DIR/NAME --config.F=V ...` on this
         machine, N at a time;
  tpu    `launch/tpu/tpu_vm.sh run` per trial (workdir $BUCKET/$RUN = DIR/NAME), which
         creates, installs, trains and supervises until the trial finishes; N at a time on
         the nodes $TPU_NAME-0 .. $TPU_NAME-(N-1), or one after another on $TPU_NAME; the
         supervisor's output goes to tpu-logs/SWEEP/NAME.log here;
  slurm  one `sbatch --array` job of launch/slurm/train.sbatch, a task per unfinished trial
         (`lambjax.sweep --trial=INDEX` under srun); the command returns once submitted.
A trial is an ordinary run: rerunning the sweep skips trials whose last phase has its final
checkpoint (or that reached their config.target), and trials whose loss diverged (status
`diverged`: the run's diverged.json; delete it to run the trial again); it resumes the
others from their checkpoints (bitwise, as any run). A trial's process dies with the
sweep's (`kill -9` included); SIGTERM or Ctrl-C to the sweep asks every running trial to
save and stop.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

from absl import logging
from etils import epath

from lambjax import cli, distributed, storage
from lambjax.sweep.spec import SweepError, Trial
from lambjax.train import target as target_lib

SWEEP_FILE = "sweep.json"
# The statuses of a trial that has ended on its own: a rerun of the sweep skips it.
ENDED = ("finished", "diverged")
LAUNCHERS = ("local", "tpu", "slurm")
LAUNCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "launch")


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


def is_complete(checkpoint: epath.Path) -> bool:
    """Orbax renames a finished checkpoint into place on local disk; on GCS, which has no
    rename, it writes in place and marks the end with commit_success.txt."""
    if storage.is_remote(checkpoint):
        return (checkpoint / "commit_success.txt").exists()
    return checkpoint.exists()


class Sweep:
    """The trials of one sweep directory and their bookkeeping in sweep.json."""

    def __init__(
        self,
        config,
        config_spec: str,
        sweep_dir: str,
        trials: list[Trial],
        base_flags=(),
        study: dict | None = None,
    ):
        """`config` has the sweep's own `base_flags` (`--config.F=V`) applied already;
        `study` is the config file's `get_study(arg)`, kept in sweep.json for the report."""
        self.config, self.config_spec, self.base_flags = config, config_spec, list(base_flags)
        self.dir, self.trials, self.study = storage.resolve(sweep_dir), trials, study
        if "data" in config and not config.data.get("data_dir"):
            # The trials' data lives with the sweep, built once for all of them.
            self.base_flags.insert(0, f"--config.data.data_dir={self.dir}/data")
        self.records = {
            t.name: {
                "overrides": t.overrides,
                **({"labels": t.labels} if t.labels else {}),
                "status": "pending",
                "wall_time_s": 0.0,
            }
            for t in trials
        }
        previous = self.read()
        for name, record in previous.get("trials", {}).items():
            if name in self.records:
                self.records[name]["wall_time_s"] = record.get("wall_time_s", 0.0)
        for trial in trials:
            if self.finished(trial):
                self.records[trial.name]["status"] = "finished"
            elif self.diverged(trial):
                self.records[trial.name]["status"] = "diverged"

    def read(self) -> dict:
        path = epath.Path(self.dir) / SWEEP_FILE
        return json.loads(path.read_text()) if path.exists() else {}

    def write(self) -> None:
        from lambjax.sweep import report

        for trial in self.trials:
            self.records[trial.name].update(report.summary(self.workdir(trial)))
        content = {"config": self.config_spec, "flags": self.base_flags, "trials": self.records}
        if self.study is not None:
            content["study"] = self.study
        directory = epath.Path(self.dir)
        directory.mkdir(parents=True, exist_ok=True)
        storage.write_text(directory / SWEEP_FILE, json.dumps(content, indent=2))

    def workdir(self, trial: Trial) -> str:
        return f"{self.dir}/{trial.name}"

    def finished(self, trial: Trial) -> bool:
        """Its last phase's final checkpoint exists, or it reached its config.target."""
        if target_lib.read(self.workdir(trial)) is not None:
            return True
        return is_complete(final_checkpoint(self.config, self.dir, trial))

    def diverged(self, trial: Trial) -> bool:
        """Its loss diverged (lambjax.train.target.DIVERGED_FILE): an outcome, not rerun."""
        return target_lib.divergence(self.workdir(trial)) is not None

    def pending(self) -> list[Trial]:
        return [t for t in self.trials if self.records[t.name]["status"] not in ENDED]

    def command(self, trial: Trial, launcher: str = "local", slot: int | None = None):
        """The command that runs `trial`; `slot` picks the TPU node of a parallel sweep."""
        if launcher == "local":
            flags = [*self.base_flags, *self.tracking_flags(trial)]
            return trial_command(self.config_spec, self.dir, trial, flags)
        if launcher == "tpu":
            node = os.environ.get("TPU_NAME", "")
            return [
                os.path.join(LAUNCH_DIR, "tpu", "tpu_vm.sh"),
                "run",
                f"--tpu-name={node}-{slot}" if slot is not None else f"--tpu-name={node}",
                f"--bucket={self.dir}",
                f"--run={trial.name}",
                f"--config={self.config_spec}",
                "--",
                *self.base_flags,
                *self.tracking_flags(trial),
                *trial.flags(),
            ]
        raise ValueError(f"launcher {launcher!r}; valid: {LAUNCHERS}")

    def tracking_flags(self, trial: Trial) -> list[str]:
        """Where the config tracks runs (lambjax.train.tracking): each trial's run is named
        after its overrides (the trial's name) and grouped by the sweep's directory name."""
        tracking = self.config.get("tracking")
        if not tracking or not tracking.backends:
            return []
        group = os.path.basename(self.dir.rstrip("/"))
        return [f"--config.tracking.run_name={trial.name}", f"--config.tracking.group={group}"]

    def log_path(self, trial: Trial, launcher: str) -> str:
        if launcher == "tpu":  # the trial's workdir is in a bucket; the supervisor runs here
            return os.path.join("tpu-logs", os.path.basename(self.dir), f"{trial.name}.log")
        if storage.is_remote(self.dir):  # a log is appended to, which GCS objects are not
            return os.path.join("sweep-logs", os.path.basename(self.dir), f"{trial.name}.log")
        return os.path.join(self.workdir(trial), "log.txt")

    def run(self, parallel: int, launcher: str = "local", env: dict | None = None) -> int:
        """Runs the unfinished trials, `parallel` at a time; returns how many failed."""
        queue, running, failed, signalled = list(self.pending()), {}, 0, set()
        free_slots = list(range(parallel))
        base_env = dict(os.environ if env is None else env)
        slot_envs = slot_environments(parallel) if launcher == "local" else [{}] * parallel
        stop = _StopSignal()
        self.write()
        progress = Progress(len(self.trials), len(queue), parallel)
        while queue or running:
            while queue and free_slots and not stop.requested:
                trial, slot = queue.pop(0), free_slots.pop(0)
                command = self.command(trial, launcher, slot if parallel > 1 else None)
                slot_env = {**base_env, **slot_envs[slot]}
                log = self.log_path(trial, launcher)
                process = self.start(trial, command, log, slot_env)
                running[trial.name] = (trial, process, time.time(), slot)
                progress.started(trial.name, log)
            time.sleep(0.5)
            if stop.requested:
                # Once per trial: a second SIGTERM could land after the run has saved and
                # restored the default handler on its way out, and kill it there.
                for name, (_, process, _, _) in running.items():
                    if name not in signalled and process.poll() is None:
                        process.send_signal(signal.SIGTERM)
                        signalled.add(name)
                queue = []
            for name, (trial, process, started, slot) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[name]
                free_slots.append(slot)
                record = self.records[name]
                record["wall_time_s"] += time.time() - started
                # `tpu_vm.sh run` returns 0 only once the run has finished.
                if self.finished(trial) or (launcher == "tpu" and process.returncode == 0):
                    record["status"] = "finished"
                elif self.diverged(trial):
                    record["status"] = "diverged"
                elif process.returncode == 0 or (
                    stop.requested and process.returncode in INTERRUPTED_EXITS
                ):
                    # A trial still starting up when the sweep passed SIGTERM on (or the
                    # terminal's Ctrl-C reached it) has nothing to save yet: it is stopped,
                    # as one that saved and exited.
                    record["status"] = "stopped"
                else:
                    log = self.log_path(trial, launcher)
                    record["status"] = f"failed (exit {process.returncode}; see {log})"
                    failed += 1
                self.write()
                elapsed = [time.time() - t[2] for t in running.values()]
                progress.ended(name, record, time.time() - started, len(queue), elapsed)
        return failed

    def start(self, trial: Trial, command: list[str], log_path: str, env) -> subprocess.Popen:
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115
        self.records[trial.name]["status"] = "running"
        self.write()
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
        )

    def submit_slurm(self, sbatch_args: list[str]) -> str:
        """One array job, a task per unfinished trial; returns sbatch's output."""
        indices = [str(i) for i, t in enumerate(self.trials) if t in self.pending()]
        command = [
            "sbatch",
            f"--array={','.join(indices)}",
            f"--output={self.dir}/slurm-%A_%a.out",
            *sbatch_args,
            os.path.join(LAUNCH_DIR, "slurm", "train.sbatch"),
            *self.base_flags,
        ]
        env = {**os.environ, "CONFIG": self.config_spec, "WORKDIR": self.dir, "LAMBJAX_SWEEP": "1"}
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed ({result.returncode}): {result.stderr.strip()}")
        for trial in self.pending():
            self.records[trial.name]["status"] = f"submitted ({result.stdout.strip()})"
        self.write()
        return result.stdout.strip()


class Progress:
    """A line as each trial starts and ends (its name, final eval metric, time, log), with the
    sweep's ETA (`sweep_eta`, from the mean time of the trials finished so far)."""

    def __init__(self, num_trials: int, num_to_run: int, parallel: int):
        self.num_trials, self.num_to_run, self.parallel = num_trials, num_to_run, parallel
        self.durations: list[float] = []
        self.count = 0
        done = num_trials - num_to_run
        logging.info(
            "sweep: %d trials, %d to run (%d already finished), %d at a time",
            num_trials,
            num_to_run,
            done,
            parallel,
        )

    def started(self, name: str, log: str) -> None:
        self.count += 1
        logging.info("sweep: [%d/%d] %s started; log: %s", self.count, self.num_to_run, name, log)

    def ended(self, name: str, record: dict, seconds: float, queued: int, running: list):
        from lambjax.train.metrics import format_duration

        final = record.get("final", {})
        metric = ""
        if "eval/mlm_accuracy" in final:
            metric = f", eval mlm acc {100 * final['eval/mlm_accuracy']:.1f}%"
        if record["status"] == "finished":
            self.durations.append(seconds)
        line = f"sweep: {name} {record['status']} after {format_duration(seconds)}{metric}"
        left = queued + len(running)
        if left and self.durations:
            mean = sum(self.durations) / len(self.durations)
            eta = sweep_eta(mean, queued, running, self.parallel)
            line += f"; {left} left, sweep ETA ~{format_duration(eta)}"
        elif left:
            line += f"; {left} left"
        logging.info("%s", line)


def sweep_eta(mean: float, queued: int, running: list[float], parallel: int) -> float:
    """Seconds until the last trial ends, if each takes `mean`: the running ones (their
    elapsed seconds given) finish first, the queued ones take the slots as they free up."""
    slots = sorted([max(mean - elapsed, 0.0) for elapsed in running])
    slots += [0.0] * max(parallel - len(slots), 0)
    for _ in range(queued):
        slots.sort()
        slots[0] += mean
    return max(slots, default=0.0)


def slot_environments(parallel: int, root: str = "/") -> list[dict]:
    """Per parallel slot of a local sweep, what gives its trials devices of their own: on a
    GPU host an equal share of the GPUs (CUDA_VISIBLE_DEVICES); on CPU nothing (every trial
    has the host's CPU devices). A TPU host's chips belong to one process at a time."""
    kind = distributed.platform(root)
    if kind == "tpu" and parallel > 1:
        raise SweepError(
            f"--parallel={parallel} on a TPU host: libtpu gives every chip to one process; "
            f"run trials one at a time, or --launcher=tpu for a node per trial"
        )
    if kind != "gpu":
        return [{} for _ in range(parallel)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        gpus = visible.split(",")
    else:
        names = os.listdir(os.path.join(root, "dev"))
        gpus = sorted((n[6:] for n in names if n[6:].isdigit() and n.startswith("nvidia")), key=int)
    if not gpus or len(gpus) % parallel:
        raise SweepError(
            f"--parallel={parallel} does not divide this host's {len(gpus)} GPUs into equal "
            f"shares; valid: a divisor of {len(gpus)}"
        )
    share = len(gpus) // parallel
    return [
        {"CUDA_VISIBLE_DEVICES": ",".join(gpus[slot * share : (slot + 1) * share])}
        for slot in range(parallel)
    ]


# How a trial ends that a stop reached before it could save: SIGTERM, SIGINT, or the one
# line of a Ctrl-C (lambjax.cli.interrupt_handler).
INTERRUPTED_EXITS = (-signal.SIGTERM, -signal.SIGINT, cli.INTERRUPTED_STATUS)


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
