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
