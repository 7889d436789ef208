"""Runs on gs:// through a proxy that fails requests as real buckets do (tests/fault_proxy.py,
in front of the GCS emulator of tests/gcs_emulator.py): transient 429s, 503s and reset
connections during the data build, the metrics mirror and the checkpoint saves leave the
losses as they were; a bucket that keeps refusing writes ends the run in one line, exit
status 75, with the checkpoint before intact, and the same command continues once the bucket
answers again. The retry behaviour these rely on: docs/guide/reliability.md."""

import os
import subprocess

import pytest
from etils import epath

from tests import helpers
from tests.fault_proxy import FaultProxy, gcsfs_uploads
from tests.helpers import demo_command, losses

pytestmark = pytest.mark.slow

DEVICES = 4
PHASE1_ONLY = "--config.phase_order=('phase1',)"


@pytest.fixture(scope="module")
def proxy(gcs_bucket):
    proxy = FaultProxy(os.environ["STORAGE_EMULATOR_HOST"])
    yield proxy
    proxy.stop()


def start(proxy, workdir: str, data_dir: str) -> subprocess.Popen:
    return subprocess.Popen(
        demo_command(workdir, data_dir, PHASE1_ONLY),
        cwd=helpers.REPO,
        env=proxy.environment(helpers.environment(DEVICES)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def run(proxy, workdir: str, data_dir: str) -> tuple[int, str]:
    process = start(proxy, workdir, data_dir)
    _, stderr = process.communicate(timeout=1200)
    return process.returncode, stderr


@pytest.fixture(scope="module")
def clean_run(proxy, gcs_bucket):
    """A run through the proxy with no faults: the losses to compare with."""
    workdir = f"{gcs_bucket}/faults/clean"
    status, stderr = run(proxy, workdir, f"{gcs_bucket}/faults/clean-data")
    assert status == 0, stderr[-3000:]
    return workdir


def test_transient_faults_leave_the_losses_as_they_were(proxy, gcs_bucket, clean_run):
    """One request in 25, any client (gcsfs, tensorstore, google-cloud-cpp), from the data
    build to the last checkpoint, is answered 429 or 503 or has its connection reset."""
    workdir = f"{gcs_bucket}/faults/transient"
    proxy.counts.clear()
    proxy.inject(share=0.04, kinds=("429", "503", "reset"))
    try:
        status, stderr = run(proxy, workdir, f"{gcs_bucket}/faults/transient-data")
    finally:
        proxy.inject(share=0.0)
    assert status == 0, stderr[-3000:]
    print(dict(proxy.counts))  # the measurement in docs/guide/reliability.md
    assert all(proxy.counts[kind] > 0 for kind in ("429", "503", "reset"))
    assert losses(workdir) == losses(clean_run)


def test_a_bucket_that_keeps_refusing_writes_ends_the_run_in_one_line(proxy, gcs_bucket, clean_run):
    """From the first checkpoint on, every upload by gcsfs (the metrics mirror, Orbax's own
    files) is refused with 403, as when the run's write access is revoked: the next save
    fails. (A persistent 503 ends the same way once the clients' retries are spent, which
    takes minutes per request: docs/guide/reliability.md.)"""
    workdir = f"{gcs_bucket}/faults/persistent"
    process = start(proxy, workdir, f"{gcs_bucket}/faults/clean-data")
    phase1 = epath.Path(workdir) / "checkpoints" / "phase1"
    helpers.wait_until((phase1 / "4" / "commit_success.txt").exists, process, timeout=600)
    proxy.inject(share=1.0, kinds=("403",), match=gcsfs_uploads)
    try:
        _, stderr = process.communicate(timeout=1200)
    finally:
        proxy.inject(share=0.0)
    assert process.returncode == 75, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"lambjax: error: a checkpoint could not be written to {phase1} (")
    assert last.endswith(f"continues from the last complete checkpoint, {phase1}/4")
    assert "Traceback" not in stderr
    assert (phase1 / "4" / "commit_success.txt").exists()  # the checkpoint before, intact
    status, stderr = run(proxy, workdir, f"{gcs_bucket}/faults/clean-data")  # answers again
    assert status == 0, stderr[-3000:]
    assert losses(workdir) == losses(clean_run)
