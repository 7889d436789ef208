"""launch/slurm/train.sbatch against a fake SLURM cluster whose srun, scancel and signals
behave as Slurm's source and man pages say (tests/launch/fakes: srun.py, scancel.py,
slurmctld.py), with the trainer's stand-in (fakes/worker_tools.py: SIGTERM saves, a rerun
resumes). The time limit, a preemption with and without grace time, a cancel: every path
saves, and the job requeues where the run should go on. The same time limit with the real
trainer, resuming bitwise, is in tests/launch/test_local_pod.py."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.launch import cluster_fakes

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(REPO, "launch", "slurm", "train.sbatch")
FAKES = cluster_fakes.FAKES
STEPS = 40


@pytest.fixture
def cluster(tmp_path):
    """A user's environment with the fake SLURM tools, and PYTHON the trainer's stand-in."""
    env = cluster_fakes.environment(tmp_path)
    python = tmp_path / "venv-python"
    python.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" "{FAKES}/worker_tools.py" venv-python "$@"\n'
    )
    python.chmod(0o755)
    env.update(
        PYTHON=str(python),
        CONFIG="configs/bert_lamb.py:large",
        WORKDIR=str(tmp_path / "run"),
        FAKE_SLURM_JOB_ID="4242",
        FAKE_SLURM_VERSION="23.02.7",  # whose srun takes the CPUs per task from SRUN_*
        FAKE_KILL_WAIT="20",
        FAKE_STEP_SECONDS="0.05",
        FAKE_SAVE_SECONDS="0.5",
    )
    return env


class Job:
    """`sbatch --nodes=1 --ntasks-per-node=2 train.sbatch`, its output read as it comes."""

    def __init__(self, env, *flags):
        self.env = env
        self.process = subprocess.Popen(
            ["sbatch", "--nodes=1", "--ntasks-per-node=2", SCRIPT,
             f"--config.phases.phase1.num_steps={STEPS}", *flags],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_step(self, step: int):
        deadline = time.time() + 60
        while checkpoint(self.env) < step:
            assert self.process.poll() is None and time.time() < deadline, self.output
            time.sleep(0.02)

    def batch_shell(self) -> int:
        with open(cluster_fakes.state_file(self.env, "batch_pid")) as f:
            return int(f.read())

    def end(self) -> int:
        code = self.process.wait(timeout=120)
        self.reader.join(timeout=10)
        return code


def checkpoint(env) -> int:
    path = os.path.join(env["WORKDIR"], "checkpoint")
    return int(open(path).read()) if os.path.exists(path) else 0


def resumed_from(job: Job) -> list[int]:
    """The steps the requeued job's tasks resumed from. (Before, the stand-in's second task
    may start after the first has saved a step: the first job's output does not count.)"""
    requeued = job.output.partition("(restart 1)")[2]
    return [int(s) for s in re.findall(r"resuming from its checkpoint at step (\d+)", requeued)]


def task_environments(env) -> list[dict]:
    with open(os.path.join(env["WORKDIR"], "env-worker1.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_the_time_limit_signals_the_tasks_not_srun_and_the_job_requeues(cluster):
    job = Job(cluster)
    job.wait_for_step(5)
    os.kill(job.batch_shell(), signal.SIGUSR1)  # --signal=B:USR1@300
    assert job.end() == 0, job.output
    assert "forcing job termination" not in job.output
    assert cluster_fakes.calls(cluster, "scancel") == [["scancel", "--signal=TERM", "4242"]]
    assert cluster_fakes.calls(cluster, "scontrol") == [["scontrol", "requeue", "4242"]]
    assert len([c for c in cluster_fakes.calls(cluster, "srun") if "--version" not in c]) == 2
    assert job.output.count("Stopped in phase phase1") == 2  # both tasks saved
    (saved,) = resumed_from(job)[:1]
    assert saved >= 5 and checkpoint(cluster) == STEPS
    # The job's --cpus-per-task reaches srun's tasks (through SRUN_CPUS_PER_TASK on 23.02).
    assert [e["SLURM_CPUS_PER_TASK"] for e in task_environments(cluster)] == ["8", "8"]
    assert [e["SLURM_RESTART_COUNT"] for e in task_environments(cluster)] == ["0", "1"]


def test_srun_itself_answers_sigterm_by_killing_its_tasks(cluster):
    """What the script avoids: Slurm's srun SIGKILLs the tasks on SIGTERM, nothing saved."""
    workdir = cluster["WORKDIR"]
    srun = subprocess.Popen(
        ["srun", "--ntasks=2", cluster["PYTHON"], "-m", "lambjax.main", f"--workdir={workdir}",
         f"--config.phases.phase1.num_steps={STEPS}"],
        env={**cluster, "SLURM_JOB_ID": "7"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    deadline = time.time() + 60
    while checkpoint(cluster) < 3:
        assert time.time() < deadline
        time.sleep(0.02)
    srun.send_signal(signal.SIGTERM)
    out, _ = srun.communicate(timeout=60)
    assert srun.returncode == 128 + signal.SIGKILL
    assert "srun: forcing job termination" in out and "Stopped in phase" not in out


@pytest.mark.parametrize("grace_time", [0, 2])
def test_a_preemption_saves_and_the_job_runs_on_after_its_requeue(cluster, grace_time):
    """GraceTime 0: SIGTERM reaches the batch shell and the tasks at once (Slurm requeues
    the job: PreemptMode=REQUEUE); GraceTime > 0: the tasks alone, and the script requeues
    the job once they have saved."""
    job = Job(cluster)
    job.wait_for_step(5)
    cluster_fakes.slurm_preempt(cluster, "4242", grace_time, "REQUEUE")
    assert job.end() == 0, job.output
    assert "forcing job termination" not in job.output
    saved = sorted(set(resumed_from(job)))  # the step every task resumed from
    assert len(saved) == 1 and saved[0] >= 5 and checkpoint(cluster) == STEPS, job.output
    # The script requeues only when Slurm does not: with grace time.
    requeues = cluster_fakes.calls(cluster, "scontrol")
    assert requeues == ([] if grace_time == 0 else [["scontrol", "requeue", "4242"]])


@pytest.mark.parametrize("how", ["scancel", "preempted, PreemptMode=CANCEL"])
def test_a_cancelled_job_saves_and_ends(cluster, how):
    job = Job(cluster)
    job.wait_for_step(5)
    if how == "scancel":
        subprocess.run(["scancel", "4242"], env=cluster, check=True)
    else:
        cluster_fakes.slurm_preempt(cluster, "4242", 0, "CANCEL")
    assert job.end() == 0, job.output
    assert job.output.count("Stopped in phase phase1") == 2
    assert 5 <= checkpoint(cluster) < STEPS
    assert cluster_fakes.calls(cluster, "scontrol") == [] and resumed_from(job) == []


@pytest.mark.parametrize("version, ignores", [("24.05.4", False), ("26.05.1", True)])
def test_srun_ignores_sigterm_where_it_can(cluster, version, ignores):
    """From Slurm 26.05 srun can ignore SIGTERM (--ignore-signals); before, the option
    is unknown and must not be given."""
    job = Job({**cluster, "FAKE_SLURM_VERSION": version}, "--config.phases.phase1.num_steps=3")
    assert job.end() == 0, job.output
    runs = [c for c in cluster_fakes.calls(cluster, "srun") if "--version" not in c]
    assert ("--ignore-signals=TERM" in runs[0]) == ignores
