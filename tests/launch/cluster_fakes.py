"""Fake cluster tools on PATH for the launch scripts' tests: each tool in fakes/ runs with
this interpreter, records its calls and keeps the simulated cluster's state in a directory."""

import json
import os
import sys

FAKES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakes")
TOOLS = ("gcloud", "sbatch", "scancel", "scontrol", "srun")


def environment(tmp_path, base: dict | None = None) -> dict:
    """`base` (default: this process's environment) with the fakes first on PATH."""
    bin_dir, state = tmp_path / "fake-bin", tmp_path / "fake-state"
    bin_dir.mkdir(exist_ok=True)
    state.mkdir(exist_ok=True)
    for tool in TOOLS:
        wrapper = bin_dir / tool
        wrapper.write_text(
            f'#!/bin/sh\nexec "{sys.executable}" "{os.path.join(FAKES, tool)}.py" "$@"\n'
        )
        wrapper.chmod(0o755)
    env = dict(os.environ if base is None else base)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    env["FAKE_STATE"] = str(state)
    return env


def calls(env: dict, tool: str | None = None) -> list[list[str]]:
    """The recorded calls, each [tool, *arguments], of `tool` or of every tool."""
    path = os.path.join(env["FAKE_STATE"], "calls.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        recorded = [json.loads(line) for line in f]
    return [c for c in recorded if tool is None or c[0] == tool]


def state_file(env: dict, name: str) -> str:
    return os.path.join(env["FAKE_STATE"], name)


def preempt(env: dict, name: str) -> None:
    """Preempts the fake Cloud TPU's spot node `name` (fakes/gcloud.py, `preempt`)."""
    import subprocess

    subprocess.run(
        [sys.executable, os.path.join(FAKES, "gcloud.py"), "--fake-preempt", name],
        env=env,
        check=True,
    )


def slurm_preempt(env: dict, job_id: str, grace_time: float, mode: str = "REQUEUE") -> None:
    """Preempts the fake SLURM job (fakes/slurmctld.py, `preempt`): the partition's
    GraceTime in seconds, PreemptMode REQUEUE or CANCEL."""
    import subprocess

    subprocess.run(
        [sys.executable, os.path.join(FAKES, "slurmctld.py"), "preempt", job_id,
         str(grace_time), mode],
        env=env,
        check=True,
    )  # fmt: skip


def tpu_state(env: dict) -> dict:
    path = state_file(env, "tpu.json")
    if not os.path.exists(path):
        return {"nodes": {}, "queued": {}}
    with open(path) as f:
        return json.load(f)


def worker_home(env: dict, name: str, worker: int) -> str:
    node = tpu_state(env)["nodes"][name]
    return state_file(
        env, os.path.join("tpus", f"{name}.{node['incarnation']}", f"worker-{worker}")
    )
