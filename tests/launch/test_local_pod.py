"""Simulated pods: 2 processes x 2 devices train like 1 x 4, whether joined through
launch/local.py's flags or through JAX's SLURM detection under a fake sbatch and srun."""

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests import helpers
from tests.helpers import REPO, demo_command, losses, run_demo
from tests.launch import cluster_fakes

pytestmark = pytest.mark.slow  # end-to-end runs, each over ~10 s

STEPS = 6
OVERRIDES = ("--config.phase_order=('phase1',)", f"--config.phases.phase1.num_steps={STEPS}")


def pod(workdir, data_dir, processes, devices, *extra):
    return [
        sys.executable,
        "launch/local.py",
        f"--processes={processes}",
        f"--devices-per-process={devices}",
        "--",
        *demo_command(workdir, data_dir, *extra)[3:],  # the lambjax.main flags
    ]


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """The losses of one process with 4 devices, and its workdir."""
    workdir = str(tmp_path_factory.mktemp("one"))
    run_demo(workdir, data_dir, 4, *OVERRIDES)
    return workdir, losses(workdir)


@pytest.fixture(scope="module")
def two_processes(data_dir, reference, gcs_bucket):
    """2 processes x 2 devices through launch/local.py, writing their checkpoints into a
    bucket (a local GCS emulator), as on a pod: their workdir, output and losses. (Runs on
    several processes do not build data: `reference`'s single process has built it.)"""
    two = f"{gcs_bucket}/two-processes"
    result = helpers.run(pod(two, data_dir, 2, 2, *OVERRIDES), 2)
    return two, result, losses(two)


def test_two_processes_train_like_one(data_dir, reference, two_processes):
    one, expected = reference
    two, result, got = two_processes
    assert "[p0]" in result.stdout and "[p1]" in result.stdout
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step
    # A checkpoint written by 2 processes restores in 1, and one written by 1 in 2: both
    # restore the final step-6 state (and find the phase finished).
    resumed = run_demo(two, data_dir, 4, *OVERRIDES)
    assert "resuming from its checkpoint at step 6" in resumed.stderr
    result = helpers.run(pod(one, data_dir, 2, 2, *OVERRIDES), 2)
    assert "[p1]" in result.stdout and "resuming from its checkpoint at step 6" in result.stdout


def test_two_processes_train_like_one_with_unsafe_rbg(data_dir, reference, tmp_path):
    """config.prng_impl keeps the topology guarantee across processes too: dropout drawn
    by unsafe_rbg gives 2 x 2 devices the losses of 1 x 4. (`reference`'s single process
    built the data; the default, threefry, is `two_processes`'s; rbg, whose bits come from
    the same RngBitGenerator, is tested on fewer devices in tests/train/test_runs.py.)"""
    flags = (*OVERRIDES, "--config.prng_impl=unsafe_rbg")
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run_demo(one, data_dir, 4, *flags)
    helpers.run(pod(two, data_dir, 2, 2, *flags), 2)
    expected, got = losses(one), losses(two)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert expected != reference[1]  # other dropout masks than threefry's
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step


def time_limit_signal(script: str) -> int:
    """The signal the script asks SLURM to send its batch shell (`--signal=B:SIG@secs`)."""
    with open(os.path.join(REPO, script)) as f:
        match = re.search(r"^#SBATCH --signal=B:(\w+)@\d+$", f.read(), re.MULTILINE)
    assert match, f"{script} asks for no signal to its batch shell before the time limit"
    return getattr(signal, f"SIG{match.group(1)}")


def test_slurm_job_saves_at_the_time_limit_requeues_and_resumes(data_dir, two_processes, tmp_path):
    """Two tasks that srun started join through JAX's SLURM detection; the time limit's
    signal to the batch shell has both tasks signalled (scancel, not srun: the fake srun,
    as Slurm's, kills its tasks on SIGTERM); both save (async checkpoints) and the job
    requeues itself; the requeued job resumes, and its losses are bitwise those of the same
    2 x 2 devices run without a stop."""
    script = "launch/slurm/train.sbatch"
    workdir = str(tmp_path / "slurm")
    env = cluster_fakes.environment(tmp_path, helpers.environment(2))
    job_id = str(random.randrange(10**5, 10**6))  # JAX's coordinator port: id % 4096 + 61440
    env.update(FAKE_SLURM_JOB_ID=job_id, CONFIG="configs/default.py:runlocal", WORKDIR=workdir)
    flags = demo_command(workdir, data_dir, *OVERRIDES)[5:]  # after --config and --workdir
    sbatch = subprocess.Popen(
        ["sbatch", "--nodes=1", "--ntasks-per-node=2", script, *flags],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = []

    def read():
        for line in sbatch.stdout:
            output.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.time() + 300
    while not any("Phase phase1: training steps 1.." in line for line in output):
        assert sbatch.poll() is None and time.time() < deadline, "".join(output)[-5000:]
        time.sleep(0.1)
    with open(cluster_fakes.state_file(env, "batch_pid")) as f:
        os.kill(int(f.read()), time_limit_signal(script))
    assert sbatch.wait(timeout=300) == 0, "".join(output)[-5000:]
    reader.join(timeout=10)
    text = "".join(output)
    assert "jax.distributed: slurm cluster detected" in text
    assert re.search(r"process 1 of 2, 2 local / 4 global devices", text)
    stopped = [int(s) for s in re.findall(r"Reached preemption sync point, step=(\d+)", text)]
    assert stopped and max(stopped) < STEPS, text[-5000:]
    assert "forcing job termination" not in text
    assert cluster_fakes.calls(env, "scancel") == [["scancel", "--signal=TERM", job_id]]
    assert cluster_fakes.calls(env, "scontrol") == [["scontrol", "requeue", job_id]]
    runs = [c for c in cluster_fakes.calls(env, "srun") if c[1:] != ["--version"]]
    assert len(runs) == 2  # the first job and its requeued rerun
    assert runs[0][2] == os.path.join(REPO, ".venv", "bin", "python")
    assert f"resuming from its checkpoint at step {max(stopped)}" in text, text[-5000:]
    assert losses(workdir) == two_processes[2]


def test_a_killed_process_stops_the_pod(data_dir, reference, tmp_path):
    """(`reference`'s single process built phase 1's data: a pod never builds.)"""
    import psutil

    workdir = str(tmp_path / "pod")
    launcher = subprocess.Popen(
        pod(workdir, data_dir, 2, 1, OVERRIDES[0], "--config.phases.phase1.num_steps=1000"),
        cwd=REPO,
        env=helpers.environment(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 300
    while not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        assert launcher.poll() is None and time.time() < deadline
        time.sleep(0.2)
    children = psutil.Process(launcher.pid).children()
    assert len(children) == 2
    children[1].kill()
    out, _ = launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    assert "stopping all" in out
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
