"""What the fake cluster tools share: a state directory ($FAKE_STATE) holding each tool's
recorded calls (calls.jsonl, one JSON list per call) and the simulated cluster's state."""

import json
import os
import sys


def state_dir() -> str:
    return os.environ["FAKE_STATE"]


def record(tool: str, argv: list[str]) -> None:
    with open(os.path.join(state_dir(), "calls.jsonl"), "a") as f:
        f.write(json.dumps([tool, *argv]) + "\n")


def load(name: str, default):
    path = os.path.join(state_dir(), name)
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


def save(name: str, value) -> None:
    path = os.path.join(state_dir(), name)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def fail(tool: str, message: str, code: int = 1):
    print(f"{tool}: error: {message}", file=sys.stderr)
    sys.exit(code)


class locked:
    """Holds the fake cluster's lock: one tool at a time reads and changes its state."""

    def __enter__(self):
        import fcntl

        self._file = open(os.path.join(state_dir(), "lock"), "w")
        fcntl.flock(self._file, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        self._file.close()


def slurm_version() -> str:
    return os.environ.get("FAKE_SLURM_VERSION", "24.05.4")


def signal_pids(pids, signum) -> None:
    """Sends `signum` to each process of `pids` that is still there and is one of this fake
    cluster's (a pid that ended may have been reused by another process since)."""
    import psutil

    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.environ().get("FAKE_STATE") == state_dir():
                process.send_signal(signum)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass


def job_steps(job_id: str) -> list[dict]:
    """The srun steps (fakes/srun.py records each: its pid and its tasks' pids) of the job's
    current run (a requeued job's batch script runs again: SLURM_RESTART_COUNT)."""
    restart = load("job", {}).get("restart", 0)
    steps = load("steps.json", [])
    return [s for s in steps if s["job"] == job_id and s["restart"] == restart]
