"""A stand-in for lambjax.main under launch/local.py: records the signal that stops it.

SIGTERM is what the trainer saves on (it records it and exits 0, as the trainer does after
its save); SIGINT keeps Python's default (KeyboardInterrupt, exit 1, nothing saved)."""

import os
import signal
import sys
import time


def main(argv):
    index = next(a.split("=")[1] for a in argv if a.startswith("--process_id="))
    directory = next(a.split("=", 1)[1] for a in argv if a.startswith("--workdir="))
    record = os.path.join(directory, f"process-{index}")

    def on_sigterm(signum, frame):
        with open(record, "a") as f:
            f.write("SIGTERM\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    with open(record, "a") as f:
        f.write("ready\n")
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1:])
