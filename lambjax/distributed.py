"""The processes of a run: joining JAX's multi-controller runtime, barriers, stop requests.

`initialize` must run before anything touches a JAX backend. Explicit arguments win; else
the cluster is detected from the environment (Cloud TPU VM pods, SLURM) by JAX itself; with
neither, the run is a single process. JAX is imported inside the functions: `lambjax.main`
imports this module before it sets up host memory, which must precede JAX's threads.
"""

import os
import signal

from absl import logging


def cluster_detected() -> bool:
    """True inside a multi-host Cloud TPU VM slice or a multi-task SLURM job."""
    tpu_hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if "," in tpu_hosts:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
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
        if platform() == "cpu":
            # Cross-process collectives on CPU go through gloo (TCP).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    elif cluster_detected():
        jax.distributed.initialize()
    else:
        return
    logging.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())


def platform() -> str:
    """The platform JAX will run on: JAX_PLATFORMS's first entry, else detected."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0]
    if os.path.exists("/dev/accel0"):
        return "tpu"
    return "gpu" if os.path.exists("/dev/nvidia0") else "cpu"


def barrier(name: str) -> None:
    """Returns once every process has reached the barrier `name`; at once with one process."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class StopRequest:
    """SIGTERM handling: the training loop asks `requested(step)` at every step boundary.

    With one process a Python signal handler sets a flag. With several, JAX's preemption
    sync point makes every process agree on the same step to stop at (the coordination
    service relays the SIGTERM any one of them received).
    """

    def __init__(self):
        import jax

        self._multi_process = jax.process_count() > 1
        self._signalled = False
        if not self._multi_process:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        logging.warning("SIGTERM received: saving at the next step boundary, then exiting.")
        self._signalled = True

    def requested(self, step: int) -> bool:
        if not self._multi_process:
            return self._signalled
        from jax.experimental import multihost_utils

        return multihost_utils.reached_preemption_sync_point(step)
