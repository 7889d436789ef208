"""A fake `srun` that starts a job step's tasks as local processes.

Simulated, each from srun(1) (https://slurm.schedmd.com/srun.html):
- Inside a batch job the step takes the job's tasks (SLURM_NTASKS, SLURM_NTASKS_PER_NODE)
  unless -n/--ntasks says otherwise.
- Its OUTPUT ENVIRONMENT VARIABLES, per task: SLURM_PROCID (the task's rank), SLURM_LOCALID
  (its index on its node), SLURM_NODEID, SLURM_NTASKS, SLURM_STEP_NODELIST,
  SLURM_STEP_NUM_NODES, SLURM_STEP_NUM_TASKS, and the job's SLURM_JOB_ID. These are what
  JAX's SLURM detection reads (jax/_src/clusters/slurm_cluster.py: SLURM_JOB_ID,
  SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID). All the simulated nodes
  are this machine, so the node list is `localhost`.
- SIGNALS: "Signals sent to the srun command are automatically forwarded to the tasks it is
  controlling" (SIGTERM here).
- `--kill-on-bad-exit=1`: when any task exits non-zero, the step's other tasks are killed.
- Its exit status is the highest of its tasks' exit codes.
"""

import os
import signal
import subprocess
import sys
import time

import common


def main(argv):
    common.record("srun", argv)
    options, command = [], list(argv)
    while command and command[0].startswith("-"):
        options.append(command.pop(0))
    kill_on_bad_exit = "--kill-on-bad-exit=1" in options or "-K" in options
    ntasks = int(os.environ.get("SLURM_NTASKS", "1"))
    for option in options:
        if option.startswith("--ntasks="):
            ntasks = int(option.split("=", 1)[1])
    per_node = int(os.environ.get("SLURM_NTASKS_PER_NODE", str(ntasks)))
    nodes = -(-ntasks // per_node)
    tasks = []
    for rank in range(ntasks):
        env = dict(
            os.environ,
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank % per_node),
            SLURM_NODEID=str(rank // per_node),
            SLURM_NTASKS=str(ntasks),
            SLURM_STEP_NUM_TASKS=str(ntasks),
            SLURM_STEP_NUM_NODES=str(nodes),
            SLURM_STEP_NODELIST="localhost",
        )
        tasks.append(subprocess.Popen(command, env=env))

    def forward(signum, frame):
        for task in tasks:
            if task.poll() is None:
                task.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while any(task.poll() is None for task in tasks):
        if kill_on_bad_exit and any(task.poll() not in (None, 0) for task in tasks):
            for task in tasks:
                if task.poll() is None:
                    task.kill()
        time.sleep(0.1)
    codes = [task.returncode for task in tasks]
    return max(abs(code) for code in codes) if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
