"""The fake Slurm cluster's side of ending a job: cancelling it, preempting it, and what
reaches which process (used by fakes/scancel.py, and by tests through cluster_fakes).

Simulated, each from Slurm's documentation or source:
- Terminating a job (`scancel JOBID`, a preemption without grace time, the end of a grace
  time or of the time limit: slurmd's `_rpc_terminate_job`, src/slurmd/slurmd/req.c) sends
  SIGCONT and SIGTERM to every step of the job, the batch step included, and SIGKILL
  KillWait seconds later (slurm.conf(5), KillWait: default 30 s; FAKE_KILL_WAIT here).
- Which processes of a step a signal reaches: with proctrack/cgroup, a signal other than
  SIGKILL goes only to the step's own processes, the children of its slurmstepd (the batch
  shell for the batch step, the tasks for an srun step); SIGKILL goes to every process in
  the step (src/plugins/proctrack/cgroup/proctrack_cgroup.c, `proctrack_p_signal`, unless
  cgroup.conf sets SignalChildrenProcesses=yes). So `srun`, a child of the batch shell,
  never receives the SIGTERM of a cancel or a preemption; the tasks and the shell do.
- Preemption (slurm.conf(5), GraceTime and PreemptMode): with GraceTime = 0 the job is
  terminated at once; with GraceTime > 0 "the job's tasks are immediately sent SIGCONT and
  SIGTERM", and the job is terminated when the grace time ends if it is still running.
  PreemptMode=REQUEUE puts the terminated job back in the queue (it then starts again from
  the beginning of its batch script); PreemptMode=CANCEL ends it.
- When its batch script ends, the job ends and whatever of its steps still runs is killed
  (src/slurmctld/job_mgr.c, `job_complete`, then the nodes' terminate; fakes/sbatch.py).
"""

import os
import signal
import subprocess
import sys
import time

import common


def _incarnation(job_id: str):
    job = common.load("job", {})
    return job.get("restart") if job.get("id") == job_id else None


def task_pids(job_id: str) -> list[int]:
    return [pid for step in common.job_steps(job_id) for pid in step["tasks"]]


def every_pid(job_id: str) -> list[int]:
    """The batch shell, and every process of every step (srun, the tasks, their children)."""
    import psutil

    job = common.load("job", {})
    roots = [job["batch_pid"]] if job.get("id") == job_id and "batch_pid" in job else []
    for step in common.job_steps(job_id):
        roots += [step["srun"], *step["tasks"]]
    pids = set(roots)
    for pid in roots:
        try:
            pids.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return sorted(pids)


def later(seconds: float, *action: str) -> None:
    """Runs `slurmctld.py ACTION...` in `seconds`, in the background (as slurmd's timers)."""
    subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--after", str(seconds), *action],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def terminate(job_id: str, then: str) -> None:
    """SIGCONT and SIGTERM to the batch shell and the tasks, SIGKILL after KillWait.

    then: "requeue" (PreemptMode=REQUEUE) or "cancel" (scancel, PreemptMode=CANCEL)."""
    with common.locked():
        job = common.load("job", {})
        if job.get("id") != job_id:
            return
        common.save("job", {**job, "requeue": then == "requeue", "cancelled": then == "cancel"})
        batch = [job["batch_pid"]] if "batch_pid" in job else []
        for signum in (signal.SIGCONT, signal.SIGTERM):
            common.signal_pids(batch + task_pids(job_id), signum)
    later(float(os.environ.get("FAKE_KILL_WAIT", "30")), "kill", job_id, str(job["restart"]))


def kill(job_id: str, restart: str) -> None:
    with common.locked():
        if str(_incarnation(job_id)) == restart:
            common.signal_pids(every_pid(job_id), signal.SIGKILL)


def preempt(job_id: str, grace_time: float, mode: str) -> None:
    then = {"REQUEUE": "requeue", "CANCEL": "cancel"}[mode]
    if grace_time <= 0:
        terminate(job_id, then)
        return
    with common.locked():
        for signum in (signal.SIGCONT, signal.SIGTERM):
            common.signal_pids(task_pids(job_id), signum)
        restart = str(_incarnation(job_id))
    later(grace_time, "grace-end", job_id, restart, then)


def grace_end(job_id: str, restart: str, then: str) -> None:
    job = common.load("job", {})
    if str(_incarnation(job_id)) == restart and not job.get("ended"):
        terminate(job_id, then)


def main(argv):
    if argv[:1] == ["--after"]:
        time.sleep(float(argv[1]))
        argv = argv[2:]
    action, args = argv[0], argv[1:]
    if action == "kill":
        kill(*args)
    elif action == "grace-end":
        grace_end(*args)
    elif action == "preempt":
        preempt(args[0], float(args[1]), args[2])
    else:
        raise SystemExit(f"slurmctld (fake): unknown action {argv}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
