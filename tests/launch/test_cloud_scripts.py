"""The TPU VM and SLURM scripts against fake `gcloud`, `git` and `srun` that record calls."""

import json
import os
import subprocess

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FAKE = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps([os.path.basename(sys.argv[0])] + sys.argv[1:]) + "\\n")
"""


@pytest.fixture
def fake_path(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("gcloud", "srun", "git"):
        (bin_dir / tool).write_text(FAKE)
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def run(script, args, fake_path, tmp_path, **env):
    calls = tmp_path / "calls.jsonl"
    environment = dict(os.environ, PATH=f"{fake_path}:{os.environ['PATH']}", CALLS=str(calls))
    environment.update(env)
    result = subprocess.run(
        ["bash", script, *args], cwd=REPO, env=environment, capture_output=True, text=True
    )
    recorded = (
        [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    )
    return result, recorded


SETTINGS = dict(PROJECT="proj", ZONE="us-central2-b", TPU_NAME="bert", ACCELERATOR_TYPE="v4-32")
WHERE = ["--project=proj", "--zone=us-central2-b"]


def test_create_tpu_vm_and_queued_spot_resource(fake_path, tmp_path):
    _, calls = run("launch/tpu/tpu_vm.sh", ["create"], fake_path, tmp_path, **SETTINGS)
    assert calls == [
        [
            "gcloud",
            "compute",
            "tpus",
            "tpu-vm",
            "create",
            "bert",
            *WHERE,
            "--accelerator-type=v4-32",
            "--version=tpu-ubuntu2204-base",
        ]
    ]
    (tmp_path / "q").mkdir()
    _, calls = run(
        "launch/tpu/tpu_vm.sh",
        ["create"],
        fake_path,
        tmp_path / "q",
        **SETTINGS,
        QUEUED="1",
        SPOT="1",
    )
    assert calls == [
        [
            "gcloud",
            "compute",
            "tpus",
            "queued-resources",
            "create",
            "bert",
            *WHERE,
            "--node-id=bert",
            "--accelerator-type=v4-32",
            "--runtime-version=tpu-ubuntu2204-base",
            "--spot",
        ]
    ]


def test_install_train_stop_delete_run_on_every_worker(fake_path, tmp_path):
    env = dict(SETTINGS, BUCKET="gs://b", RUN="r1", CONFIG="configs/bert_lans.py:large")
    for command in ("install", "train", "logs", "stop", "delete"):
        result, _ = run("launch/tpu/tpu_vm.sh", [command], fake_path, tmp_path, **env)
        assert result.returncode == 0, result.stderr
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls[0][:3] == ["git", "archive", "--format=tar.gz"]
    assert calls[1][:4] == ["gcloud", "compute", "tpus", "tpu-vm"] and calls[1][4] == "scp"
    assert "--worker=all" in calls[1]
    install, train, logs, stop, delete = calls[2:]
    assert install[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "bert"]
    assert "--worker=all" in install and "pip install -q -e '.[train]'" in install[-1]
    assert "--worker=all" in train
    assert train[-1] == (
        "--command=cd ~/lambjax && nohup python3 -m lambjax.main "
        "--config=configs/bert_lans.py:large --workdir=gs://b/r1 > ~/lambjax-train.log 2>&1 &"
    )
    assert "--worker=0" in logs
    assert stop[-1] == "--command=pkill -TERM -f lambjax.main || true" and "--worker=all" in stop
    assert delete == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "bert", *WHERE, "--quiet"]


def test_dry_run_prints_and_runs_nothing(fake_path, tmp_path):
    result, calls = run(
        "launch/tpu/tpu_vm.sh",
        ["delete", "--queued=1"],
        fake_path,
        tmp_path,
        **SETTINGS,
        DRY_RUN="1",
    )
    assert calls == []
    assert result.stdout.strip() == (
        "gcloud compute tpus queued-resources delete bert --project=proj "
        "--zone=us-central2-b --force --quiet"
    )


def test_missing_setting_is_named(fake_path, tmp_path):
    result, calls = run("launch/tpu/tpu_vm.sh", ["create"], fake_path, tmp_path, PROJECT="p")
    assert result.returncode != 0 and "ZONE" in result.stderr and calls == []


def sbatch_directives(script: str) -> dict[str, str]:
    with open(os.path.join(REPO, script)) as f:
        lines = [line.split(None, 1)[1].strip() for line in f if line.startswith("#SBATCH")]
    return dict(line[2:].partition("=")[::2] for line in lines)


def test_slurm_tasks_see_every_gpu_of_their_node_and_requeue_at_the_time_limit():
    """JAX's SLURM detection gives task SLURM_LOCALID the GPU of that index, so each task
    must see all its node's GPUs (--gpus-per-task would bind it to one); a clean save at
    the time limit needs the batch shell's signal and a requeue-able job."""
    directives = sbatch_directives("launch/slurm/train.sbatch")
    assert "gpus-per-task" not in directives and "gpu-bind" not in directives
    assert directives["gpus-per-node"] == directives["ntasks-per-node"]
    assert directives["signal"].startswith("B:") and "requeue" in directives


def test_slurm_script_runs_the_project_venv_and_names_a_missing_one(tmp_path):
    from tests.launch import cluster_fakes

    env = cluster_fakes.environment(tmp_path)
    env.update(CONFIG="configs/bert_lamb.py:large", WORKDIR="/shared/run")
    script = os.path.join(REPO, "launch/slurm/train.sbatch")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    result = subprocess.run(["bash", script], cwd=checkout, env=env, capture_output=True, text=True)
    assert result.returncode == 2 and cluster_fakes.calls(env, "srun") == []
    assert f"no Python at {checkout}/.venv/bin/python" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_ctrl_c_on_the_local_launcher_stops_every_process_with_sigterm(tmp_path):
    """Ctrl-C sends SIGINT to the launcher (its processes run in their own sessions); they
    must get SIGTERM, on which the trainer saves and exits 0, and the launcher exits 0."""
    import signal
    import sys
    import time

    launcher = subprocess.Popen(
        [
            sys.executable,
            "launch/local.py",
            "--processes=2",
            "--module=tests.launch.signal_probe",
            "--",
            f"--workdir={tmp_path}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    records = [tmp_path / f"process-{i}" for i in range(2)]
    deadline = time.time() + 60
    while not all(r.exists() for r in records):
        assert launcher.poll() is None and time.time() < deadline
        time.sleep(0.05)
    launcher.send_signal(signal.SIGINT)
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, out
    assert [r.read_text().split() for r in records] == [["ready", "SIGTERM"]] * 2
