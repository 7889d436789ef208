"""A SIGTERM that arrives while the logger writes: the handler only sets a flag, and the
loop's next look at it (`StopRequest.requested`) logs the stop, once, to the run's log; a
Ctrl-C is taken as a SIGTERM, and a second one stops at once."""

import os
import signal
import subprocess
import sys
import time

from tests import helpers

# A process that logs lines in a tight loop to its train.log, as the training loop does, and
# asks for a stop at every "step". Warnings, which the file takes at any verbosity: a handler
# that logged itself fails here within a few of the signals below ("reentrant call").
PROBE = """
import os, sys, time
from absl import flags, logging
flags.FLAGS(["probe"])
from lambjax import console, distributed
console.setup()
console.log_to_file(sys.argv[1], "train.log")
stop = distributed.StopRequest()
print("ready", flush=True)
step, line, done = 0, "x" * 2000, os.path.join(sys.argv[1], "done")
while not os.path.exists(done):  # until the signals are sent
    step += 1
    logging.warning("step %d %s", step, line)
    stop.requested(step)
print("stop requested:", stop.requested(step), flush=True)
"""


def test_sigterm_while_logging_sets_a_flag_and_the_loop_logs_it(tmp_path):
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        probe = subprocess.Popen(
            [sys.executable, "-c", PROBE, str(tmp_path)],
            cwd=helpers.REPO,
            env=helpers.environment(1),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        assert probe.stdout.readline().strip() == "ready"
        for _ in range(200):  # many chances to land inside a write
            os.kill(probe.pid, signal.SIGTERM)
            time.sleep(0.01)
        (tmp_path / "done").touch()
        out, _ = probe.communicate(timeout=60)
    assert probe.returncode == 0, stderr_path.read_text()[-3000:]
    assert "stop requested: True" in out
    console = stderr_path.read_text()
    log = (tmp_path / "train.log").read_text()
    for text in (console, log):
        assert "Logging error" not in text and "reentrant call" not in text
    assert log.count("SIGTERM received") == 1


CTRL_C = """
import sys
from absl import flags, logging
flags.FLAGS(["probe"])
from lambjax import console, distributed
console.setup()
console.log_to_file(sys.argv[1], "train.log")
stop = distributed.StopRequest()
print("ready", flush=True)
sys.stdin.readline()  # the first Ctrl-C has arrived
print("stop requested:", stop.requested(7), flush=True)
sys.stdin.readline()  # the second too
"""


def test_ctrl_c_requests_a_stop_and_a_second_one_stops_at_once(tmp_path):
    probe = subprocess.Popen(
        [sys.executable, "-c", CTRL_C, str(tmp_path)],
        cwd=helpers.REPO,
        env=helpers.environment(1),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert probe.stdout.readline().strip() == "ready"
    probe.send_signal(signal.SIGINT)
    time.sleep(0.5)
    probe.stdin.write("\n")
    probe.stdin.flush()
    assert probe.stdout.readline().strip() == "stop requested: True"
    probe.send_signal(signal.SIGINT)  # the default handler again: KeyboardInterrupt
    _, stderr = probe.communicate(timeout=60)
    assert probe.returncode != 0 and "KeyboardInterrupt" in stderr
    log = (tmp_path / "train.log").read_text()
    assert "Ctrl-C (SIGINT) received: saving at step 7, then exiting (Ctrl-C again" in log
