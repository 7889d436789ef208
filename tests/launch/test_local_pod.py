"""A simulated pod: 2 processes x 2 devices through launch/local.py train like 1 x 4."""

import os
import subprocess
import sys
import time

import pytest

from tests import helpers
from tests.helpers import REPO, demo_command, losses, run_demo

STEPS = 6


def pod(workdir, data_dir, processes, devices, *extra):
    return [
        sys.executable,
        "launch/local.py",
        f"--processes={processes}",
        f"--devices-per-process={devices}",
        "--",
        *demo_command(workdir, data_dir, *extra)[3:],  # the lambjax.main flags
    ]


def test_two_processes_train_like_one(data_dir, tmp_path):
    overrides = ("--config.phase_order=('phase1',)", f"--config.phases.phase1.num_steps={STEPS}")
    one = str(tmp_path / "one")
    run_demo(one, data_dir, 4, *overrides)
    two = str(tmp_path / "two")
    result = helpers.run(pod(two, data_dir, 2, 2, *overrides), 2)
    assert "[p0]" in result.stdout and "[p1]" in result.stdout
    expected, got = losses(one), losses(two)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step
    # A checkpoint written by 2 processes restores in 1, and one written by 1 in 2: both
    # restore the final step-6 state (and find the phase finished).
    resumed = run_demo(two, data_dir, 4, *overrides)
    assert "resuming from its checkpoint at step 6" in resumed.stderr
    result = helpers.run(pod(one, data_dir, 2, 2, *overrides), 2)
    assert "[p1]" in result.stdout and "resuming from its checkpoint at step 6" in result.stdout


def test_a_killed_process_stops_the_pod(data_dir, tmp_path):
    import psutil

    workdir = str(tmp_path / "pod")
    launcher = subprocess.Popen(
        pod(workdir, data_dir, 2, 1, "--config.phases.phase1.num_steps=1000"),
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
