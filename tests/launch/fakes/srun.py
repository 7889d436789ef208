"""A fake `srun` that starts a job step's tasks as local processes.

Simulated, each from srun(1) (https://slurm.schedmd.com/srun.html) or Slurm's source:
- Inside a batch job the step takes the job's tasks (SLURM_NTASKS, SLURM_NTASKS_PER_NODE)
  unless -n/--ntasks says otherwise.
- Its OUTPUT ENVIRONMENT VARIABLES, per task: SLURM_PROCID (the task's rank), SLURM_LOCALID
  (its index on its node), SLURM_NODEID, SLURM_NTASKS, SLURM_STEP_NODELIST,
  SLURM_STEP_NUM_NODES, SLURM_STEP_NUM_TASKS, SLURM_STEP_ID, and the job's SLURM_JOB_ID.
  These are what JAX's SLURM detection reads (jax/_src/clusters/slurm_cluster.py:
  SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID). All the
  simulated nodes are this machine, so the node list is `localhost`.
- CPUs per task: `-c/--cpus-per-task`, else an environment variable: from Slurm 22.05 to
  23.02 SRUN_CPUS_PER_TASK only, not the job's SLURM_CPUS_PER_TASK (RELEASE_NOTES of 22.05:
  "srun will no longer read in SLURM_CPUS_PER_TASK ... set the new SRUN_CPUS_PER_TASK env
  var"); from 23.11 SLURM_CPUS_PER_TASK again (RELEASE_NOTES of 23.11: "Replace
  SRUN_CPUS_PER_TASK with SLURM_CPUS_PER_TASK"). Without one, a task gets 1 CPU. The task
  sees its count as SLURM_CPUS_PER_TASK.
- Signals to srun itself, as src/srun/srun_job.c `_srun_signal_mgr` (23.02, 24.05) and
  src/srun/signals.c `_forward_signal` (HEAD) handle them: SIGTERM, SIGHUP and SIGQUIT log
  "forcing job termination" and SIGKILL every task (launch_fwd_signal(SIGKILL)): nothing is
  passed on for the tasks to save on. SIGINT prints the tasks' status; a second one within a
  second sends SIGINT and then SIGKILL (`_handle_intr`). SIGCONT is logged; every other
  signal (SIGUSR1, SIGUSR2, ...) is forwarded to the tasks as it is. Signals listed in
  `--ignore-signals` (Slurm 26.05 and later; an unknown option before) are ignored.
- `--kill-on-bad-exit=1`: when any task exits non-zero, the step's other tasks are killed.
- Its exit status is the highest of its tasks' exit codes; a task killed by signal N
  counts as 128 + N.
- `srun --version` prints `slurm VERSION` (FAKE_SLURM_VERSION, default 24.05.4).
The step's processes are recorded in $FAKE_STATE/steps.json, where the fake scancel and the
fake cluster's preemption (fakes/slurmctld.py) find them.
"""

import os
import signal
import subprocess
import sys
import time

import common

FORWARDED_AS_IS = (signal.SIGUSR1, signal.SIGUSR2)


def version() -> tuple[int, int]:
    major, minor, *_ = common.slurm_version().split(".")
    return int(major), int(minor)


def parse(argv):
    options, command = {}, list(argv)
    while command and command[0].startswith("-"):
        key, _, value = command.pop(0).lstrip("-").partition("=")
        options[key] = value or True
    return options, command


def main(argv):
    common.record("srun", argv)
    if argv[:1] == ["--version"]:
        print(f"slurm {common.slurm_version()}")
        return 0
    options, command = parse(argv)
    if "ignore-signals" in options and version() < (26, 5):
        common.fail("srun", f"unrecognized option '--ignore-signals={options['ignore-signals']}'")
    ignored = {
        getattr(signal, name if name.startswith("SIG") else f"SIG{name}")
        for name in str(options.get("ignore-signals", "")).split(",")
        if name
    }
    kill_on_bad_exit = options.get("kill-on-bad-exit") == "1" or "K" in options
    ntasks = int(options.get("ntasks", os.environ.get("SLURM_NTASKS", "1")))
    per_node = int(os.environ.get("SLURM_NTASKS_PER_NODE", str(ntasks)))
    inherited = "SLURM_CPUS_PER_TASK" if version() >= (23, 11) else "SRUN_CPUS_PER_TASK"
    cpus = options.get("cpus-per-task") or os.environ.get(inherited) or "1"
    nodes = -(-ntasks // per_node)
    job_id = os.environ.get("SLURM_JOB_ID", "0")
    with common.locked():
        steps = common.load("steps.json", [])
        step_id = sum(1 for s in steps if s["job"] == job_id)
        tasks = []
        for rank in range(ntasks):
            env = dict(
                os.environ,
                SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(rank % per_node),
                SLURM_NODEID=str(rank // per_node),
                SLURM_NTASKS=str(ntasks),
                SLURM_STEP_ID=str(step_id),
                SLURM_STEP_NUM_TASKS=str(ntasks),
                SLURM_STEP_NUM_NODES=str(nodes),
                SLURM_STEP_NODELIST="localhost",
                SLURM_CPUS_PER_TASK=str(cpus),
            )
            tasks.append(subprocess.Popen(command, env=env))
        steps.append(
            {
                "job": job_id,
                "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
                "step": step_id,
                "srun": os.getpid(),
                "tasks": [t.pid for t in tasks],
            }
        )
        common.save("steps.json", steps)

    def alive():
        return [task for task in tasks if task.poll() is None]

    def send(signum):
        for task in alive():
            task.send_signal(signum)

    last_interrupt = [0.0]

    def on_signal(signum, frame):
        if signum in ignored:
            return
        if signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            print("srun: forcing job termination", file=sys.stderr, flush=True)
            send(signal.SIGKILL)
        elif signum == signal.SIGINT:
            if time.monotonic() - last_interrupt[0] < 1.0:
                print(f"srun: sending Ctrl-C to StepId={job_id}.{step_id}", file=sys.stderr)
                send(signal.SIGINT)
                print("srun: forcing job termination", file=sys.stderr, flush=True)
                send(signal.SIGKILL)
            else:
                print("srun: interrupt (one more within 1 sec to abort)", file=sys.stderr)
                last_interrupt[0] = time.monotonic()
        elif signum == signal.SIGCONT:
            print("srun: got SIGCONT", file=sys.stderr)
        else:
            send(signum)

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGINT, signal.SIGCONT):
        signal.signal(signum, on_signal)
    for signum in FORWARDED_AS_IS:
        signal.signal(signum, on_signal)
    while alive():
        if kill_on_bad_exit and any(task.poll() not in (None, 0) for task in tasks):
            send(signal.SIGKILL)
        time.sleep(0.05)
    codes = [128 - code if code < 0 else code for code in (task.returncode for task in tasks)]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
