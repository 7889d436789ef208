"""The tools a fake TPU VM worker (see gcloud.py) finds on its PATH, and the lambjax
stand-in that its venv runs.

- `python3`: the image's interpreter. Cloud TPU VM images (tpu-ubuntu2204-base,
  v2-alpha-tpuv5*, v2-alpha-tpuv6e) are Ubuntu 22.04, whose python3 is 3.10; pip refuses a
  package whose Requires-Python excludes it ("ERROR: Package 'lambjax' requires a different
  Python: 3.10.12 not in '>=3.11'", pip's message).
- `curl -LsSf https://astral.sh/uv/install.sh`: uv's standalone installer ("Installing
  uv"), which puts `uv` into ~/.local/bin.
- `uv venv [--allow-existing] --python 3.11 DIR` makes a venv with a Python 3.11 that uv
  finds or downloads itself ("Python versions": uv downloads managed Pythons when none is
  installed); `uv pip install --python PY ...` installs into that interpreter's environment
  and needs it to exist ("uv pip install --python").
- The venv's `python -m lambjax.main --workdir=W [--config.phases.phase1.num_steps=N]`: a
  stand-in for lambjax's trainer with its contract (README, "Checkpoints"): every worker
  runs the same command, checkpoints are shared in W, a run resumes from the last one, and
  SIGTERM saves (FAKE_SAVE_SECONDS) and exits 0 after "Stopped in phase ...". It records
  every argument list it got in W/argv-worker<N>.jsonl. Under (fake) srun it is task
  SLURM_PROCID and records its SLURM_* environment in W/env-worker<N>.jsonl.
"""

import json
import os
import signal
import sys
import time

HERE = os.path.abspath(__file__)


def python3(argv):
    if argv[:1] == ["--version"]:
        print("Python 3.10.12")
        return 0
    if argv[:3] == ["-m", "pip", "install"]:
        print(
            "ERROR: Package 'lambjax' requires a different Python: 3.10.12 not in '>=3.11'",
            file=sys.stderr,
        )
        return 1
    print(f"python3 (fake 3.10): cannot run {argv}", file=sys.stderr)
    return 1


def curl(argv):
    if argv[-1] != "https://astral.sh/uv/install.sh":
        print(f"curl: (6) Could not resolve host for {argv[-1]}", file=sys.stderr)
        return 6
    print(
        'mkdir -p "$HOME/.local/bin"\n'
        f'printf \'#!/bin/sh\\nexec "{sys.executable}" "{HERE}" uv "$@"\\n\''
        ' > "$HOME/.local/bin/uv"\n'
        'chmod +x "$HOME/.local/bin/uv"\n'
        'echo "installing to $HOME/.local/bin"\n'
    )
    return 0


def record(name, argv):
    with open(os.path.join(os.environ["HOME"], f"{name}-calls.jsonl"), "a") as f:
        f.write(json.dumps(argv) + "\n")


def uv(argv):
    record("uv", argv)
    if argv[:1] == ["venv"]:
        directory = [
            a for a in argv[1:] if not a.startswith("-") and a != argv[argv.index("--python") + 1]
        ][0]
        version = argv[argv.index("--python") + 1]
        if tuple(map(int, version.split("."))) < (3, 11):
            print(f"uv: lambjax needs 3.11, not {version}", file=sys.stderr)
        if os.path.exists(directory) and "--allow-existing" not in argv:
            print(f"error: A directory already exists at: {directory}", file=sys.stderr)
            return 2
        os.makedirs(os.path.join(directory, "bin"), exist_ok=True)
        python = os.path.join(directory, "bin", "python")
        with open(python, "w") as f:
            f.write(f'#!/bin/sh\nexec "{sys.executable}" "{HERE}" venv-python "$@"\n')
        os.chmod(python, 0o755)
        print(f"Using CPython {version}.9\nCreating virtual environment at: {directory}")
        return 0
    if argv[:2] == ["pip", "install"]:
        python = argv[argv.index("--python") + 1]
        if not os.path.exists(python):
            print(f"error: Failed to inspect Python interpreter {python}", file=sys.stderr)
            return 2
        if not os.path.exists("setup.py"):
            print("error: no setup.py here: the checkout is not where uv runs", file=sys.stderr)
            return 2
        print(f"Installed {len(argv) - 4} packages")
        return 0
    print(f"uv (fake): cannot run {argv}", file=sys.stderr)
    return 2


def venv_python(argv):
    if argv[:1] == ["--version"]:
        print("Python 3.11.9")
        return 0
    if argv[:2] != ["-m", "lambjax.main"]:
        print(f"python (fake venv): cannot run {argv}", file=sys.stderr)
        return 1
    return trainer(argv[2:])


def trainer(flags):
    values = dict(f[2:].split("=", 1) for f in flags if f.startswith("--") and "=" in f)
    workdir = values["workdir"]
    worker = int(os.environ.get("FAKE_TPU_WORKER", os.environ.get("SLURM_PROCID", "0")))
    num_steps = int(values.get("config.phases.phase1.num_steps", 10))
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, f"argv-worker{worker}.jsonl"), "a") as f:
        f.write(json.dumps(flags) + "\n")
    if "SLURM_JOB_ID" in os.environ:
        slurm = {k: v for k, v in os.environ.items() if k.startswith("SLURM_")}
        with open(os.path.join(workdir, f"env-worker{worker}.jsonl"), "a") as f:
            f.write(json.dumps(slurm) + "\n")
    checkpoint = os.path.join(workdir, "checkpoint")
    step = int(open(checkpoint).read()) if os.path.exists(checkpoint) else 0
    join_the_other_tasks(workdir, worker)
    if step:
        print(f"Phase phase1: resuming from its checkpoint at step {step}", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))

    def save(step):
        if worker == 0:
            with open(checkpoint + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(checkpoint + ".tmp", checkpoint)

    while step < num_steps:
        if stop:
            time.sleep(float(os.environ.get("FAKE_SAVE_SECONDS", "0.5")))
            save(step)
            print("Stopped in phase phase1; rerun the same command to continue.", flush=True)
            return 0
        time.sleep(float(os.environ.get("FAKE_STEP_SECONDS", "0.1")))
        step += 1
        print(f"phase1 step {step}/{num_steps}", flush=True)
        save(step)
    print("Summary: phase1 finished", flush=True)
    return 0


def join_the_other_tasks(workdir: str, worker: int) -> None:
    """The real trainer's tasks take no step before every task has joined JAX's distributed
    runtime (`jax.distributed.initialize` blocks until all processes connect), so each
    task's resume step is read before any task moves on; under SLURM the stand-ins wait for
    each other the same way, through files (one set per restart of the job)."""
    tasks = int(os.environ.get("SLURM_NTASKS", "1"))
    if tasks == 1:
        return
    prefix = os.path.join(workdir, f"joined-{os.environ.get('SLURM_RESTART_COUNT', '0')}-")
    open(f"{prefix}{worker}", "w").close()
    deadline = time.time() + 120
    while not all(os.path.exists(f"{prefix}{i}") for i in range(tasks)):
        if time.time() > deadline:
            print("python (fake venv): the other tasks never joined", file=sys.stderr)
            sys.exit(1)
        time.sleep(0.01)


TOOLS = {"python3": python3, "curl": curl, "uv": uv, "venv-python": venv_python}

if __name__ == "__main__":
    sys.exit(TOOLS[sys.argv[1]](sys.argv[2:]))
