"""End-to-end runs with packed rows (config.data.packing), phase 2 of the demo's runlocal
variant (sequence 512, where packing matters) on its own: 2 processes x 2 devices train like
1 x 4, and a run killed after a checkpoint and rerun logs bitwise the same losses."""

import subprocess
import sys

import pytest

from tests import helpers
from tests.helpers import REPO, demo_command, environment, losses, run_demo, wait_for_checkpoint

pytestmark = pytest.mark.slow  # end-to-end runs, each over ~10 s

STEPS = 6
OVERRIDES = (
    "--config.phase_order=('phase2',)",
    f"--config.phases.phase2.num_steps={STEPS}",
    "--config.data.packing=True",
)


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """The losses of one process with 4 devices, and its console output."""
    workdir = str(tmp_path_factory.mktemp("packed"))
    result = run_demo(workdir, data_dir, 4, *OVERRIDES)
    return losses(workdir), result.stderr


def test_packed_run_trains(reference):
    logged, console = reference
    assert sorted(logged) == list(range(1, STEPS + 1))
    assert all(loss == loss for loss in logged.values())  # finite, not NaN
    assert f"phase2 step {STEPS}/{STEPS} | loss " in console


def test_two_processes_train_packed_rows_like_one(data_dir, reference, tmp_path):
    expected, _ = reference
    workdir = str(tmp_path)
    command = [
        sys.executable,
        "launch/local.py",
        "--processes=2",
        "--devices-per-process=2",
        "--",
        *demo_command(workdir, data_dir, *OVERRIDES)[3:],  # the lambjax.main flags
    ]
    helpers.run(command, 2)
    got = losses(workdir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step


def test_kill_and_rerun_gives_bitwise_the_same_packed_losses(data_dir, reference, tmp_path):
    workdir = str(tmp_path)
    process = subprocess.Popen(
        demo_command(workdir, data_dir, *OVERRIDES),
        cwd=REPO,
        env=environment(4),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_checkpoint(workdir, "phase2", 4, process)
    process.kill()
    process.wait()
    run_demo(workdir, data_dir, 4, *OVERRIDES)
    assert losses(workdir) == reference[0]
