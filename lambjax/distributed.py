"""The processes of a run: joining JAX's multi-controller runtime, barriers, stop requests.

`initialize` must run before anything touches a JAX backend. Explicit arguments win; else
JAX's own cluster detection (`jax._src.clusters`: Cloud TPU VMs through the GCE metadata
server, GKE, SLURM, Open MPI) finds the coordinator, the process count and this process's
index; with neither, the run is a single process. Once joined, JAX's coordination service
watches every process's heartbeat: a process that dies stops the others with an error (at
their next collective, or after the heartbeat timeout), and a SIGTERM that reaches any
process becomes a stop at a step every process agrees on (`StopRequest`).

JAX is imported inside the functions: `lambjax.main` imports this module before it sets up
host memory, which must precede JAX's threads.
"""

import glob
import os
import signal
from typing import NamedTuple

from absl import logging


class Cluster(NamedTuple):
    """A cluster environment: its name and its process count (None: JAX's initialize finds
    it, as on a Cloud TPU VM, whose workers only the metadata server lists)."""

    name: str
    process_count: int | None


def detected_cluster() -> Cluster | None:
    """The cluster environment JAX's own detection finds, or None.

    The same search `jax.distributed.initialize()` makes with no arguments: the first
    registered cluster environment (not opt-in only, e.g. mpi4py) that is present. JAX keeps
    that registry in a private module (`jax._src.clusters`); where a JAX release has moved
    it, `cluster_from_environment` reads the variables the launchers set instead.
    """
    try:
        from jax._src import clusters

        cluster_types = clusters.ClusterEnv._cluster_types
    except (ImportError, AttributeError) as e:
        logging.warning(
            "jax %s has no jax._src.clusters.ClusterEnv (%s): lambjax detects SLURM, Open MPI "
            "and TPU workers from their environment instead",
            _jax_version(),
            e,
        )
        return cluster_from_environment()
    for env in cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return Cluster(env.name, env.get_process_count())
    return None


def cluster_from_environment(environ=None, root: str = "/") -> Cluster | None:
    """The cluster the launchers' own variables name (SLURM, Open MPI, GKE's TPU workers),
    else a Cloud TPU VM where this host has TPU chips, else None."""
    environ = os.environ if environ is None else environ
    if "SLURM_JOB_ID" in environ:
        return Cluster("slurm", int(environ.get("SLURM_NTASKS", "1")))
    if "OMPI_MCA_orte_hnp_uri" in environ or "OMPI_COMM_WORLD_SIZE" in environ:
        return Cluster("ompi", int(environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    if environ.get("TPU_WORKER_HOSTNAMES"):
        return Cluster("gke", len(environ["TPU_WORKER_HOSTNAMES"].split(",")))
    if tpu_chip_count(root):
        return Cluster("gcetpu", None)
    return None


def _jax_version() -> str:
    import jax

    return jax.__version__


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_seconds: int = 100,
) -> None:
    """Joins the run's processes; a no-op for a single process.

    A process whose heartbeats stop for `heartbeat_timeout_seconds` (JAX's default: 100) is
    dead to the coordination service, which then stops every other process with an error.
    """
    import jax

    given = [coordinator_address, num_processes, process_id]
    if any(v is not None for v in given):
        if any(v is None for v in given):
            raise ValueError(
                "--coordinator_address, --num_processes and --process_id go together; got "
                f"coordinator_address={coordinator_address!r}, num_processes={num_processes}, "
                f"process_id={process_id}"
            )
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process_id={process_id} must lie in [0, {num_processes})")
        _use_gloo_on_cpu()
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        )
    else:
        cluster = detected_cluster()
        # One process needs no coordinator, and joining would cost something: under SLURM
        # JAX then restricts the process to GPU SLURM_LOCALID (one GPU of an `srun --pty`
        # shell's eight).
        if cluster is None or (cluster.process_count is not None and cluster.process_count <= 1):
            return
        logging.info("jax.distributed: %s cluster detected", cluster.name)
        _use_gloo_on_cpu()
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_seconds)
    logging.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())


def _use_gloo_on_cpu() -> None:
    if platform() == "cpu":
        import jax

        # Cross-process collectives on CPU go through gloo (TCP).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


# How JAX itself finds TPU chips (jax/_src/hardware_utils.py): PCI devices of Google's vendor
# id with a TPU device id (v3, v4, v5p, v5e, v6e, TPU7x). Only v4 VMs also have /dev/accel*
# (v5e and later use VFIO), and Google's gVNIC network card shares the vendor id.
_GOOGLE_PCI_VENDOR_ID = "0x1ae0"
_TPU_PCI_DEVICE_IDS = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}


def tpu_chip_count(root: str = "/") -> int:
    """The TPU chips attached to this host, from the PCI devices under `root`/sys."""
    count = 0
    for vendor in glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor")):
        device = os.path.join(os.path.dirname(vendor), "device")
        if _read(vendor) == _GOOGLE_PCI_VENDOR_ID and _read(device) in _TPU_PCI_DEVICE_IDS:
            count += 1
    return count


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def platform(root: str = "/") -> str:
    """The platform JAX will run on: JAX_PLATFORMS's first entry, else detected."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0]
    if tpu_chip_count(root):
        return "tpu"
    nvidia = ("dev/nvidia0", "dev/nvidiactl")
    return "gpu" if any(os.path.exists(os.path.join(root, d)) for d in nvidia) else "cpu"


def barrier(name: str) -> None:
    """Returns once every process has reached the barrier `name`; at once with one process."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def process_zero_decides(decision: bool) -> bool:
    """Process 0's `decision`, on every process (for choices made on a local clock)."""
    import jax

    if jax.process_count() == 1:
        return decision
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(decision, np.bool_)))


class StopRequest:
    """SIGTERM and Ctrl-C handling: the training loop asks `requested(step)` at every step
    boundary.

    With one process a Python signal handler sets a flag. With several, JAX's preemption
    sync point makes every process agree on the same step to stop at (the coordination
    service relays the SIGTERM any one of them received). Ctrl-C (SIGINT) is taken as a
    SIGTERM: the run saves at the next step and exits 0; a second Ctrl-C goes to the handler
    before it, which stops at once (a command's: one line, exit 130, lambjax.cli.run).
    """

    def __init__(self):
        import jax

        self._multi_process = jax.process_count() > 1
        self._signalled = None  # the signal's name, once one arrived
        self._announced = False
        if not self._multi_process:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._next_sigint = signal.getsignal(signal.SIGINT)  # the command's: at once
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigterm(self, signum, frame):
        # Only a flag. The handler runs between two bytecodes of the main thread, which may
        # be inside a write to the log file: logging from here writes to that file again
        # (a reentrant call, which fails). The loop says it, in `requested`.
        self._signalled = self._signalled or "SIGTERM"

    def _on_sigint(self, signum, frame):
        signal.signal(signal.SIGINT, self._next_sigint)  # the next one stops at once
        if self._multi_process:  # JAX's preemption notifier takes SIGTERM to every process
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self._signalled = self._signalled or "Ctrl-C (SIGINT)"

    def requested(self, step: int) -> bool:
        if not self._multi_process:
            if self._signalled and not self._announced:
                self._announced = True
                logging.warning(
                    "%s received: saving at step %d, then exiting%s.",
                    self._signalled,
                    step,
                    " (Ctrl-C again: at once)" if self._signalled.startswith("Ctrl-C") else "",
                )
            return self._signalled is not None
        from jax.experimental import multihost_utils

        return multihost_utils.reached_preemption_sync_point(step)
