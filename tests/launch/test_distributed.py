"""Joining a run's processes through JAX's own cluster detection (a Cloud TPU VM through a
fake GCE metadata server, SLURM through a fake srun); a dead process stopping the others;
finding TPU chips of every generation."""

import subprocess
import sys
import time

import jax
import pytest
from jax._src.clusters import cloud_tpu_cluster

from lambjax import distributed
from tests import helpers
from tests.helpers import REPO
from tests.launch import cluster_fakes
from tests.launch.fakes.metadata_server import MetadataServer, tpu_vm_worker


@pytest.fixture
def tpu_vm(monkeypatch):
    """Worker 2 of a 4-worker TPU VM slice, as far as JAX's detection can tell."""
    server = MetadataServer(
        tpu_vm_worker(2, ["10.130.0.5", "10.130.0.6", "10.130.0.7", "10.130.0.8"])
    )
    monkeypatch.setenv("GCE_METADATA_IP", server.address)
    # jax/_src/cloud_tpu_init.py sets these when it finds no TPU chip on the PCI bus, as on
    # this machine; on a TPU VM, running_in_cloud_tpu_vm is True and the variable unset.
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    monkeypatch.delenv("TPU_SKIP_MDS_QUERY", raising=False)
    for name in ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    yield
    server.close()


def test_a_tpu_vm_slice_is_joined_through_jax_detection(tpu_vm, monkeypatch):
    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: joined.append((a, k)))
    monkeypatch.setattr(jax, "process_index", lambda: 2)
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    assert distributed.detected_cluster().name == "gcetpu"
    distributed.initialize()
    # jax.distributed.initialize finds everything itself; what it finds from the metadata:
    assert joined == [((), {"heartbeat_timeout_seconds": 100})]
    from jax._src.clusters import ClusterEnv

    found = ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 10)
    assert found == ("10.130.0.5:8482", 4, 2, None)


def test_no_cluster_is_a_single_process(monkeypatch):
    for name in ("SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: pytest.fail("joined"))
    assert distributed.detected_cluster() is None
    distributed.initialize()


@pytest.fixture
def private_clusters_moved(monkeypatch):
    """A JAX whose private cluster registry is not where lambjax looks."""
    import jax._src

    monkeypatch.delattr(jax._src, "clusters")
    monkeypatch.setitem(sys.modules, "jax._src.clusters", None)  # import raises ImportError


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}, ("slurm", 16)),
        ({"OMPI_MCA_orte_hnp_uri": "1.2.3.4:5", "OMPI_COMM_WORLD_SIZE": "4"}, ("ompi", 4)),
        ({"TPU_WORKER_HOSTNAMES": "w-0,w-1,w-2,w-3"}, ("gke", 4)),
        ({}, None),
    ],
)
def test_without_jax_private_detection_the_environment_names_the_cluster(
    private_clusters_moved, monkeypatch, caplog, tmp_path, environ, expected
):
    for name in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert distributed.cluster_from_environment(environ, root=str(tmp_path)) == expected
    if distributed.tpu_chip_count() == 0:  # this machine: the same through detected_cluster
        with caplog.at_level("WARNING"):
            assert distributed.detected_cluster() == expected
        moved = [r.getMessage() for r in caplog.records if "jax._src.clusters" in r.getMessage()]
        assert len(moved) == 1 and "from their environment instead" in moved[0]


def test_without_jax_private_detection_a_tpu_host_lets_jax_find_its_workers(tmp_path):
    pci = tmp_path / "sys" / "bus" / "pci" / "devices" / "0000:00:04.0"
    pci.mkdir(parents=True)
    (pci / "vendor").write_text("0x1ae0\n")
    (pci / "device").write_text("0x005e\n")
    assert distributed.cluster_from_environment({}, root=str(tmp_path)) == ("gcetpu", None)


def test_without_jax_private_detection_a_slurm_job_is_joined(private_clusters_moved, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: joined.append((a, k)))
    distributed.initialize()
    assert joined == [((), {"heartbeat_timeout_seconds": 100})]
    monkeypatch.setenv("SLURM_NTASKS", "1")  # one task: nothing to join
    distributed.initialize()
    assert len(joined) == 1


def test_explicit_flags_go_together():
    with pytest.raises(ValueError, match="go together.*num_processes=2, process_id=None"):
        distributed.initialize("127.0.0.1:1234", 2, None)
    with pytest.raises(ValueError, match=r"--process_id=2 must lie in \[0, 2\)"):
        distributed.initialize("127.0.0.1:1234", 2, 2)


PROBE = """
import os, sys, time
from lambjax import distributed
distributed.initialize(heartbeat_timeout_seconds=5)
import jax
print(f"joined {jax.process_index()} of {jax.process_count()}", flush=True)
if jax.process_index() == 1:
    os._exit(3)
distributed.barrier("after-the-death")
print("process 0 passed the barrier alone", flush=True)
"""


def test_a_dead_process_stops_the_others(tmp_path):
    """Two tasks under (fake) srun without --kill-on-bad-exit: the second dies after joining;
    JAX's coordination service stops the first with an error instead of leaving it waiting."""
    env = cluster_fakes.environment(tmp_path, helpers.environment(1))
    job_id = str(int(time.time() * 1000) % 10**6)
    env.update(SLURM_JOB_ID=job_id, SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2")
    started = time.time()
    result = subprocess.run(
        ["srun", sys.executable, "-c", PROBE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "joined 0 of 2" in result.stdout and "joined 1 of 2" in result.stdout
    assert "passed the barrier" not in result.stdout
    assert result.returncode != 0
    assert "another task died" in result.stderr or "heartbeat" in result.stderr
    assert time.time() - started < 90


DECIDE = """
import os

from lambjax import distributed
distributed.initialize(heartbeat_timeout_seconds=10)
import jax
index = jax.process_index()
# Each process's own clock would say something else; process 0's answer holds everywhere.
first = distributed.process_zero_decides(index == 0)
second = distributed.process_zero_decides(index == 1)
# One write of the whole line: print writes its pieces apart, and the two tasks share stdout.
os.write(1, f"process {index}: {first} {second}\\n".encode())
"""


def test_process_zero_decides_for_every_process(tmp_path):
    """What the trainer's saves by time rest on: every process takes process 0's decision
    (two tasks under the fake srun, joined through JAX's SLURM detection)."""
    env = cluster_fakes.environment(tmp_path, helpers.environment(1))
    job_id = str(int(time.time() * 1000) % 10**6 + 1)
    env.update(SLURM_JOB_ID=job_id, SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2")
    result = subprocess.run(
        ["srun", "--kill-on-bad-exit=1", sys.executable, "-c", DECIDE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("process")) == [
        "process 0: True False",
        "process 1: True False",
    ]


@pytest.mark.parametrize(
    "generation, device_id",
    [("v4", "0x005e"), ("v5e", "0x0063"), ("v5p", "0x0062"), ("v6e", "0x006f")],
)
def test_tpu_chips_are_found_on_the_pci_bus(tmp_path, monkeypatch, generation, device_id):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    pci = tmp_path / "sys" / "bus" / "pci" / "devices"
    for slot, (vendor, device) in enumerate([("0x1ae0", "0x0042"), ("0x1ae0", device_id)]):
        (pci / f"0000:00:0{slot + 4}.0").mkdir(parents=True)
        (pci / f"0000:00:0{slot + 4}.0" / "vendor").write_text(vendor + "\n")
        (pci / f"0000:00:0{slot + 4}.0" / "device").write_text(device + "\n")
    (tmp_path / "dev" / "vfio").mkdir(parents=True)  # v5e and later: no /dev/accel*
    assert distributed.tpu_chip_count(str(tmp_path)) == 1, generation
    assert distributed.platform(str(tmp_path)) == "tpu"


def test_gvnic_alone_is_not_a_tpu(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    nic = tmp_path / "sys" / "bus" / "pci" / "devices" / "0000:00:04.0"
    nic.mkdir(parents=True)
    (nic / "vendor").write_text("0x1ae0\n")  # Google's vendor id, the gVNIC device id
    (nic / "device").write_text("0x0042\n")
    assert distributed.platform(str(tmp_path)) == "cpu"
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidiactl").write_text("")
    assert distributed.platform(str(tmp_path)) == "gpu"
