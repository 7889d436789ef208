"""A fake `scontrol` for `scontrol requeue <job_id>` (scontrol(1),
https://slurm.schedmd.com/scontrol.html): "Requeue a running, suspended or finished Slurm
batch job into pending state"; a job may be requeued only if it allows it (sbatch's
--requeue, or JobRequeue=1 in slurm.conf, which the fake cluster does not set), else
scontrol reports that the operation is disabled for the job and exits non-zero."""

import sys

import common


def main(argv):
    common.record("scontrol", argv)
    if argv[:1] != ["requeue"] or len(argv) != 2:
        common.fail("scontrol", f"the fake knows only `requeue <job_id>`, not {argv}")
    job = common.load("job", None)
    if job is None or job["id"] != argv[1]:
        common.fail("scontrol", f"Invalid job id specified: {argv[1]}")
    if job.get("cancelled") or job.get("ended"):
        common.fail("scontrol", f"Job/step already completing or completed: {argv[1]}")
    if not job["options"].get("requeue"):
        common.fail("scontrol", f"Requested operation is presently disabled for job {argv[1]}")
    common.save("job", {**job, "requeue": True})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
