"""A fake `scancel` (scancel(1), https://slurm.schedmd.com/scancel.html) for one job:

- `scancel JOBID`: the job is cancelled: SIGCONT and SIGTERM to its steps and its batch
  shell, SIGKILL after KillWait (fakes/slurmctld.py, `terminate`).
- `scancel --signal=SIG JOBID`: "When --batch is not used but --signal is used, then all
  job steps will be signaled, but the batch script itself will not be signaled"; within a
  step, what proctrack/cgroup signals: the tasks, not srun (fakes/slurmctld.py).
- `--batch`: "signals only the batch step, but not any other steps" (the batch shell, not
  its children). `--full`: "also signals the batch script and its children processes"
  (srun among them: "srun steps are also children of the batch step").
"""

import signal
import sys

import common
import slurmctld


def signal_number(name: str) -> int:
    if name.isdigit():
        return int(name)
    return getattr(signal, name if name.startswith("SIG") else f"SIG{name}")


def main(argv):
    common.record("scancel", argv)
    options = [a for a in argv if a.startswith("-")]
    jobs = [a for a in argv if not a.startswith("-")]
    if len(jobs) != 1:
        common.fail("scancel", f"the fake takes one job id, not {jobs}")
    job_id = jobs[0]
    job = common.load("job", {})
    if job.get("id") != job_id or job.get("ended"):
        common.fail("scancel", f"Kill job error on job id {job_id}: Invalid job id specified")
    signum = next(
        (signal_number(o.split("=", 1)[1]) for o in options if o.startswith("--signal=")), None
    )
    if signum is None:
        slurmctld.terminate(job_id, "cancel")
        return 0
    with common.locked():
        if "--full" in options or "-f" in options:
            pids = slurmctld.every_pid(job_id)
        elif "--batch" in options or "-b" in options:
            pids = [job["batch_pid"]]
        else:
            pids = slurmctld.task_pids(job_id)
        common.signal_pids(pids, signum)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
