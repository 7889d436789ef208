r"""A simulated pod on one machine: N processes joined by jax.distributed on 127.0.0.1.

  python launch/local.py --processes 2 --devices-per-process 2 -- \
      --config=configs/default.py:runlocal --workdir=/tmp/pod

Each process gets D fake CPU devices and the flags --coordinator_address, --num_processes
and --process_id, then the flags after `--`. Output is forwarded line by line with a [pN]
prefix. When one process fails, the others are stopped (SIGTERM, then SIGKILL after a grace
period) and the launcher exits non-zero. SIGTERM or Ctrl-C (SIGINT) to the launcher reaches
every process as SIGTERM, a pod-wide preemption: they save at the same step and exit 0, and
so does the launcher. A second Ctrl-C kills them (SIGKILL) without saving.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_SECONDS = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forward(prefix: str, stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix} {line}")
        out.flush()


def start(args, port: int) -> list[subprocess.Popen]:
    processes = []
    for index in range(args.processes):
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices_per_process}"
        ).strip()
        env["JAX_PLATFORMS"] = "cpu"
        command = [
            sys.executable,
            "-m",
            args.module,
            f"--coordinator_address=127.0.0.1:{port}",
            f"--num_processes={args.processes}",
            f"--process_id={index}",
            *args.flags,
        ]
        process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(
            target=forward, args=(f"[p{index}]", process.stdout, sys.stdout), daemon=True
        ).start()
        processes.append(process)
    return processes


def stop(processes, sig=signal.SIGTERM) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, sig)


def supervise(processes) -> int:
    """Waits for all; if one fails, stops the rest. Returns the launcher's exit code."""
    while True:
        codes = [p.poll() for p in processes]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            print(f"[launch] process {failed[0]} exited with {codes[failed[0]]}; stopping all")
            stop(processes)
            deadline = time.time() + GRACE_SECONDS
            while time.time() < deadline and any(p.poll() is None for p in processes):
                time.sleep(0.1)
            stop(processes, signal.SIGKILL)
            for p in processes:
                p.wait()
            return 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=1)
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    parser.add_argument("--module", default="lambjax.main", help="python -m MODULE per process")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- flags for every process")
    args = parser.parse_args(argv)
    if args.processes < 1 or args.devices_per_process < 1:
        parser.error("--processes and --devices-per-process must be >= 1")
    args.flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    processes = start(args, args.port or free_port())

    signals = []

    def forward_signal(signum, frame):
        # The trainer saves on SIGTERM (a preemption), whichever signal stopped the launcher.
        signals.append(signum)
        if len(signals) == 1:
            print(f"[launch] signal {signum}: SIGTERM to every process (they save and exit)")
            stop(processes, signal.SIGTERM)
        elif signum == signal.SIGINT:
            print("[launch] second Ctrl-C: killing every process without saving")
            stop(processes, signal.SIGKILL)

    signal.signal(signal.SIGTERM, forward_signal)
    signal.signal(signal.SIGINT, forward_signal)
    return supervise(processes)


if __name__ == "__main__":
    sys.exit(main())
