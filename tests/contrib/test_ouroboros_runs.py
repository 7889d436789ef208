"""The Ouroboros variant (configs/bert_lamb.py:ouroboros,runlocal) end to end, as
subprocesses: it trains both phases on 4 fake CPU devices, a run killed with batches in
flight resumes bitwise, and a bad setting ends the start in one line. The delayed step
against its update rule, in-process: tests/contrib/test_ouroboros.py."""

import os
import subprocess

import pytest

from lambjax.train.metrics import read_jsonl
from tests.helpers import (
    PHASE1_STEPS,
    PHASE2_STEPS,
    REPO,
    demo_command,
    environment,
    losses,
    run,
    wait_for_checkpoint,
)


def command(workdir, data_dir, *overrides):
    return demo_command(
        workdir, data_dir, *overrides, config="configs/bert_lamb.py:ouroboros,runlocal"
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    workdir = str(tmp_path_factory.mktemp("ouroboros"))
    run(command(workdir, data_dir), 4)
    return workdir


@pytest.mark.slow
def test_the_variant_trains_both_phases_on_four_devices(reference):
    """3 modules on 2 stages x 2 data shards; phase 2 (sequence 512) starts with empty buffers."""
    logged = losses(reference)
    assert sorted(logged) == list(range(1, PHASE1_STEPS + PHASE2_STEPS + 1))
    assert logged[PHASE1_STEPS] < logged[1]
    records = read_jsonl(os.path.join(reference, "metrics.jsonl"))
    updating = [records[s]["train/ouroboros_modules_updated"] for s in (1, 2, 3, PHASE1_STEPS + 1)]
    assert updating == [1, 2, 3, 1]
    for phase, last in (("phase1", PHASE1_STEPS), ("phase2", PHASE2_STEPS)):
        assert os.path.isdir(os.path.join(reference, "checkpoints", phase, str(last)))


@pytest.mark.slow
def test_kill_and_rerun_gives_bitwise_the_same_losses(reference, data_dir, tmp_path):
    """The buffers in flight are in the checkpoint: a run killed with batches in flight
    resumes as if never stopped."""
    workdir = str(tmp_path)
    process = subprocess.Popen(
        command(workdir, data_dir),
        cwd=REPO,
        env=environment(4),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_checkpoint(workdir, "phase1", 4, process)
    process.kill()
    process.wait()
    run(command(workdir, data_dir), 4)
    assert losses(workdir) == losses(reference)


def test_a_bad_ouroboros_setting_ends_with_one_line(tmp_path, data_dir):
    flags = ["--config.mesh.stage=1"]
    result = run(command(str(tmp_path), data_dir, *flags), 4, check=False)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    message = "config.ouroboros.num_modules=3 runs on a mesh data x stage with stage=2"
    assert last.startswith("lambjax: error: ") and message in last, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
