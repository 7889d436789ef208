"""A fake `sbatch` that runs the batch script at once, on this machine, as its batch shell.

Simulated, each from sbatch(1) (https://slurm.schedmd.com/sbatch.html):
- Options come from the command line and from `#SBATCH` lines at the top of the script,
  those on the command line taking precedence ("options on the command line override
  options specified in the batch script"); arguments after the script go to the script.
- Its INPUT/OUTPUT ENVIRONMENT VARIABLES: the batch shell sees SLURM_JOB_ID,
  SLURM_JOB_NUM_NODES and SLURM_NNODES, SLURM_NTASKS (nodes x --ntasks-per-node),
  SLURM_NTASKS_PER_NODE, SLURM_JOB_NODELIST, SLURM_SUBMIT_DIR (the directory sbatch ran in)
  and SLURM_RESTART_COUNT (how often the job was requeued).
- `--requeue`: a requeued job's batch script "will be restarted from its beginning" with
  the same job id (scontrol(1), requeue); the fake starts it again when the batch shell
  has ended and `scontrol requeue` was called for the job.
- `--cpus-per-task=N` sets SLURM_CPUS_PER_TASK in the batch shell ("Only set if the
  --cpus-per-task option is specified"); srun does not take it from there (fakes/srun.py).
- When the batch shell ends, the job ends: whatever of its steps still runs is killed
  (fakes/slurmctld.py).
- It prints "Submitted batch job <id>".
- `--array=<indexes>` ("a comma separated list and/or a range of values with a '-'
  separator", e.g. 0,6,16-32) submits a job array: one job per index, each with its own
  SLURM_JOB_ID and with SLURM_ARRAY_JOB_ID (the array's first job id), SLURM_ARRAY_TASK_ID,
  SLURM_ARRAY_TASK_COUNT, SLURM_ARRAY_TASK_MIN and SLURM_ARRAY_TASK_MAX; `--output` names
  with %A (the array's job id) and %a (the task id) are filled in. The fake runs the array's
  jobs one after another.
Unlike the real one it returns only when the job has ended (with the batch shell's exit
status), and the time limit's `--signal=B:<sig>@<secs>` is left to the test, which reads
the batch shell's pid from $FAKE_STATE/batch_pid; preemptions are the tests' too
(cluster_fakes.slurm_preempt).
"""

import os
import shlex
import signal
import subprocess
import sys

import common
import slurmctld

MAX_REQUEUES = 3


def script_options(path: str) -> list[str]:
    options = []
    with open(path) as f:
        for line in f:
            if line.startswith("#SBATCH"):
                options.extend(shlex.split(line[len("#SBATCH") :]))
    return options


def parse(options: list[str]) -> dict:
    parsed = {}
    for option in options:
        if option.startswith("--"):
            key, _, value = option[2:].partition("=")
            parsed[key] = value or True
    return parsed


def array_indices(spec: str) -> list[int]:
    indices = []
    for part in spec.split("%")[0].split(","):
        first, _, last = part.partition("-")
        indices.extend(range(int(first), int(last or first) + 1))
    return indices


def main(argv):
    common.record("sbatch", argv)
    index = next(i for i, a in enumerate(argv) if not a.startswith("-"))
    script, script_args = argv[index], argv[index + 1 :]
    options = {**parse(script_options(script)), **parse(argv[:index])}
    job_id = os.environ.get("FAKE_SLURM_JOB_ID", "4242")
    print(f"Submitted batch job {job_id}", flush=True)
    if "array" not in options:
        return run_job(job_id, options, script, script_args, {})
    indices = array_indices(options["array"])
    status = 0
    for offset, task in enumerate(indices):
        array_env = {
            "SLURM_ARRAY_JOB_ID": job_id,
            "SLURM_ARRAY_TASK_ID": str(task),
            "SLURM_ARRAY_TASK_COUNT": str(len(indices)),
            "SLURM_ARRAY_TASK_MIN": str(min(indices)),
            "SLURM_ARRAY_TASK_MAX": str(max(indices)),
        }
        output = options.get("output")
        if isinstance(output, str):
            output = output.replace("%A", job_id).replace("%a", str(task))
        task_id = str(int(job_id) + offset)
        status = max(status, run_job(task_id, options, script, script_args, array_env, output))
    return status


def run_job(job_id, options: dict, script: str, script_args: list, extra_env: dict, output=None):
    """Runs the batch script (again after each `scontrol requeue`); its exit status."""
    nodes = int(options.get("nodes", 1))
    per_node = int(options.get("ntasks-per-node", 1))
    common.save("job", {"id": job_id, "options": options, "requeue": False, "restart": 0})
    cpus = (
        {"SLURM_CPUS_PER_TASK": str(options["cpus-per-task"])} if "cpus-per-task" in options else {}
    )
    status = 0
    for restart in range(MAX_REQUEUES + 1):
        env = dict(
            os.environ,
            SLURM_JOB_ID=job_id,
            SLURM_JOB_NUM_NODES=str(nodes),
            SLURM_NNODES=str(nodes),
            SLURM_NTASKS=str(nodes * per_node),
            SLURM_NTASKS_PER_NODE=str(per_node),
            SLURM_JOB_NODELIST="localhost",
            SLURM_SUBMIT_DIR=os.getcwd(),
            SLURM_RESTART_COUNT=str(restart),
            **cpus,
            **extra_env,
        )
        # Without --error, sbatch writes both streams to the --output file.
        stdout = open(output, "a") if output else None  # noqa: SIM115
        stderr = subprocess.STDOUT if output else None
        shell = subprocess.Popen(
            ["bash", script, *script_args], env=env, stdout=stdout, stderr=stderr
        )
        with common.locked():
            with open(os.path.join(common.state_dir(), "batch_pid"), "w") as f:
                f.write(str(shell.pid))
            job = common.load("job", {})
            common.save("job", {**job, "batch_pid": shell.pid, "restart": restart})
        status = shell.wait()
        with common.locked():
            common.signal_pids(slurmctld.every_pid(job_id), signal.SIGKILL)
            job = common.load("job", {})
            common.save("job", {**job, "requeue": False, "ended": not job.get("requeue")})
        if not job.get("requeue"):
            break
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
