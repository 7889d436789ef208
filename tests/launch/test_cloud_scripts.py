"""launch/tpu/tpu_vm.sh against a fake Cloud TPU zone (tests/launch/fakes/gcloud.py: nodes,
queued resources, spot preemption, workers as directories with the images' Python 3.10),
launch/slurm/train.sbatch's settings, and launch/local.py's Ctrl-C."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.launch import cluster_fakes

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TPU_VM = os.path.join(REPO, "launch", "tpu", "tpu_vm.sh")
SETTINGS = dict(PROJECT="proj", ZONE="us-central2-b", TPU_NAME="bert", ACCELERATOR_TYPE="v4-32")
WHERE = ["--project=proj", "--zone=us-central2-b"]


@pytest.fixture
def cloud(tmp_path):
    """The environment of a user with the fake gcloud, and quick polls."""
    env = cluster_fakes.environment(tmp_path)
    env.update(SETTINGS, POLL_SECONDS="0.2", BUCKET=str(tmp_path / "bucket dir"), RUN="r1")
    env["LOGS_DIR"] = str(tmp_path / "logs")
    return env


def tpu_vm(env, *args, cwd=REPO, check=True, **extra):
    result = subprocess.run(
        ["bash", TPU_VM, *args],
        cwd=cwd,
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def gcloud_calls(env, *words):
    return [c for c in cluster_fakes.calls(env, "gcloud") if c[1 : 1 + len(words)] == list(words)]


def trainers(env) -> list[psutil.Process]:
    """The fake workers' trainer processes that are still alive."""
    found = []
    for process in psutil.process_iter():
        try:
            if "venv-python" in process.cmdline() and process.status() != psutil.STATUS_ZOMBIE:
                if process.environ().get("FAKE_STATE") == env["FAKE_STATE"]:
                    found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def wait_for(condition, timeout=60, what=""):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def checkpoint(env) -> int:
    path = os.path.join(env["BUCKET"], env["RUN"], "checkpoint")
    return int(open(path).read()) if os.path.exists(path) else 0


@pytest.fixture
def installed(cloud):
    """A created v4-32 with this checkout installed on its 2 workers."""
    tpu_vm(cloud, "create")
    tpu_vm(cloud, "install")
    yield cloud
    for process in trainers(cloud):
        process.kill()


# ----------------------------------------------------------------------------------------
# Creating: the runtime version, queued resources


@pytest.mark.parametrize(
    "accelerator, runtime",
    [
        ("v4-32", "tpu-ubuntu2204-base"),
        ("v5litepod-16", "v2-alpha-tpuv5-lite"),
        ("v5p-32", "v2-alpha-tpuv5"),
        ("v6e-16", "v2-alpha-tpuv6e"),
    ],
)
def test_the_runtime_version_follows_the_accelerator_type(cloud, accelerator, runtime):
    tpu_vm(cloud, "create", f"--accelerator-type={accelerator}")
    node = cluster_fakes.tpu_state(cloud)["nodes"]["bert"]
    assert (node["accelerator"], node["runtime"]) == (accelerator, runtime)


def test_a_runtime_version_can_be_given_and_an_unknown_type_needs_one(cloud):
    result = tpu_vm(cloud, "create", "--accelerator-type=v9-8", check=False)
    assert result.returncode == 2 and cluster_fakes.calls(cloud) == []
    assert result.stderr.strip() == (
        "tpu_vm.sh: no default runtime version for ACCELERATOR_TYPE=v9-8: set RUNTIME_VERSION"
    )
    tpu_vm(cloud, "create", "--runtime-version=v2-alpha-tpuv5", ACCELERATOR_TYPE="v5p-8")
    assert gcloud_calls(cloud, "compute", "tpus", "tpu-vm", "create")[0][-1] == (
        "--version=v2-alpha-tpuv5"
    )


def test_create_waits_until_the_queued_resource_is_active(cloud):
    result = tpu_vm(cloud, "create", QUEUED="1", SPOT="1")
    states = re.findall(r"bert: (\w+)", result.stdout)
    assert states[0] == "WAITING_FOR_RESOURCES" and states[-1] == "ACTIVE", states
    assert "PROVISIONING" in states
    state = cluster_fakes.tpu_state(cloud)
    assert state["queued"]["bert"]["state"] == "ACTIVE"
    assert state["nodes"]["bert"]["state"] == "READY" and state["nodes"]["bert"]["spot"]
    assert gcloud_calls(cloud, "compute", "tpus", "queued-resources", "create")[0][6:] == [
        *WHERE,
        "--node-id=bert",
        "--accelerator-type=v4-32",
        "--runtime-version=tpu-ubuntu2204-base",
        "--spot",
    ]


def test_a_queued_resource_that_stays_waiting_times_out(cloud):
    result = tpu_vm(
        cloud, "create", check=False, QUEUED="1", QUEUE_TIMEOUT="1", FAKE_QUEUE_TICKS="never"
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "tpu_vm.sh: bert still WAITING_FOR_RESOURCES after QUEUE_TIMEOUT=1s; it stays queued "
        "(tpu_vm.sh wait, or delete)"
    )
    assert "bert" not in cluster_fakes.tpu_state(cloud)["nodes"]


# ----------------------------------------------------------------------------------------
# Installing, training, stopping


def test_install_from_any_directory_into_a_python_311_venv(cloud, tmp_path):
    """The workers' own python3 is 3.10; the venv's Python is uv's 3.11; the whole
    checkout ships, whichever directory the script runs from."""
    tpu_vm(cloud, "create")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    result = tpu_vm(cloud, "install", cwd=str(outside))
    assert result.stdout.count("lambjax-worker: installed: Python 3.11.9") == 2
    for worker in range(2):
        home = cluster_fakes.worker_home(cloud, "bert", worker)
        for path in ("setup.py", "lambjax/main.py", "launch/tpu/worker.sh", ".venv/bin/python"):
            assert os.path.exists(os.path.join(home, "lambjax", path)), path
        with open(os.path.join(home, "uv-calls.jsonl")) as f:
            venv, pip = [json.loads(line) for line in f]
        assert venv == ["venv", "--allow-existing", "--python", "3.11", ".venv"]
        assert pip == [
            "pip", "install", "--python", ".venv/bin/python", "-e", ".[train]",
            "jax[tpu]>=0.10,<0.11",
        ]  # fmt: skip


def test_python_version_312_installs_jax_011_on_every_worker(cloud):
    """PYTHON_VERSION picks the workers' Python and with it the JAX that setup.py pairs with it."""
    tpu_vm(cloud, "create")
    tpu_vm(cloud, "install", "--python-version=3.12")
    for worker in range(2):
        home = cluster_fakes.worker_home(cloud, "bert", worker)
        with open(os.path.join(home, "uv-calls.jsonl")) as f:
            venv, pip = [json.loads(line) for line in f]
        assert venv == ["venv", "--allow-existing", "--python", "3.12", ".venv"]
        assert pip[-1] == "jax[tpu]>=0.11,<0.12"


def test_train_passes_flags_through_quoted_and_clears_leftovers(installed):
    env = installed
    homes = [cluster_fakes.worker_home(env, "bert", w) for w in range(2)]
    # A previous run's process and the libtpu lockfile it left behind.
    leftover = subprocess.Popen(["sleep", "600"])
    # Stray trainers: one in worker 0's checkout (killed), one elsewhere (not ours: kept).
    disguise = ["bash", "-c", 'exec -a "/venv/bin/python -m lambjax.main" sleep 600']
    stray = subprocess.Popen(disguise, cwd=os.path.join(homes[0], "lambjax"))
    bystander = subprocess.Popen(disguise, cwd=homes[0])
    for process in (leftover, stray, bystander):  # reaped at once when killed: no zombies
        threading.Thread(target=process.wait, daemon=True).start()
    for home in homes:
        with open(os.path.join(home, "lambjax", "train.pid"), "w") as f:
            f.write(str(leftover.pid))
        open(os.path.join(home, "tmp", "libtpu_lockfile"), "w").close()
    odd = "--config.data.note=a b;$(touch pwned)'\""
    config = "configs/bert_lamb.py:large,runlocal"
    tpu_vm(env, "train", f"--config={config}", "--", "--config.phases.phase1.num_steps=3", odd)
    wait_for(lambda: leftover.returncode is not None and stray.returncode is not None)
    assert bystander.poll() is None
    bystander.kill()
    workdir = os.path.join(env["BUCKET"], "r1")
    wait_for(lambda: checkpoint(env) == 3 and not trainers(env), what="the run's end")
    for worker, home in enumerate(homes):
        with open(os.path.join(workdir, f"argv-worker{worker}.jsonl")) as f:
            assert [json.loads(line) for line in f] == [
                [f"--config={config}", f"--workdir={workdir}",
                 "--config.phases.phase1.num_steps=3", odd]
            ]  # fmt: skip
        assert not os.path.exists(os.path.join(home, "tmp", "libtpu_lockfile"))
        assert not os.path.exists(os.path.join(home, "pwned"))
    assert tpu_vm(env, "status").stdout.split("\n")[:2] == ["lambjax-worker: exit 0"] * 2


def test_a_setting_flag_that_is_not_a_setting_ends_before_anything_runs(cloud):
    result = tpu_vm(cloud, "train", "--path=/nowhere", check=False)
    assert result.returncode == 2 and cluster_fakes.calls(cloud) == []
    assert len(result.stderr.strip().splitlines()) == 1
    assert "unknown setting --path=/nowhere" in result.stderr
    assert "lambjax.main flags after --" in result.stderr


def test_waits_must_be_seconds(cloud):
    result = tpu_vm(cloud, "run", "--retry-max-seconds=ten", check=False)
    assert result.returncode == 2 and cluster_fakes.calls(cloud) == []
    assert result.stderr.strip() == (
        "tpu_vm.sh: RETRY_MAX_SECONDS=ten must be a positive number of seconds"
    )


def test_stop_returns_once_every_worker_has_saved_and_exited(installed):
    env = installed
    tpu_vm(env, "train", "--", "--config.phases.phase1.num_steps=100000")
    wait_for(lambda: checkpoint(env) >= 2, what="training steps")
    started = time.time()
    result = tpu_vm(env, "stop", FAKE_SAVE_SECONDS="1")
    assert time.time() - started >= 1  # the save's duration
    assert result.stdout.count("lambjax-worker: stopped") == 2, result.stdout
    assert trainers(env) == []
    for worker in range(2):
        home = cluster_fakes.worker_home(env, "bert", worker)
        with open(os.path.join(home, "lambjax", "train.log")) as f:
            assert "Stopped in phase phase1" in f.read()


# ----------------------------------------------------------------------------------------
# Supervising a spot run: preempted, created again, resumed, finished


@pytest.mark.parametrize("queued", ["0", "1"])
def test_run_recreates_a_preempted_spot_tpu_and_resumes_to_the_end(cloud, queued):
    env = {**cloud, "SPOT": "1", "QUEUED": queued, "FAKE_QUEUE_TICKS": "1"}
    steps = 40
    run = subprocess.Popen(
        ["bash", TPU_VM, "run", "--", f"--config.phases.phase1.num_steps={steps}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: checkpoint(env) >= 5, what="training steps")
        cluster_fakes.preempt(env, "bert")
        preempted_at = checkpoint(env)
        out, _ = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 0, out
    assert checkpoint(env) == steps
    create = "queued-resources" if queued == "1" else "tpu-vm"
    assert len(gcloud_calls(env, "compute", "tpus", create, "create")) == 2
    assert "bert is " + ("SUSPENDED" if queued == "1" else "PREEMPTED") + " (preempted?)" in out
    assert "the run finished" in out
    logs = [os.path.join(env["LOGS_DIR"], f"worker-{w}.log") for w in range(2)]
    for log in logs:
        with open(log) as f:
            text = f.read()
        assert re.search(r"resuming from its checkpoint at step (\d+)", text)
        assert f"phase1 step {steps}/{steps}" in text
    resumed = int(re.search(r"at step (\d+)", open(logs[0]).read()).group(1))
    assert 1 <= resumed <= preempted_at


def start_run(env, steps):
    return subprocess.Popen(
        ["bash", TPU_VM, "run", "--", f"--config.phases.phase1.num_steps={steps}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(run, timeout=120) -> str:
    try:
        out, _ = run.communicate(timeout=timeout)
    finally:
        run.kill()
    assert run.returncode == 0, out
    return out


def set_faults(env, **faults):
    """The failures the fake gcloud's next calls of each verb meet (fakes/gcloud.py)."""
    with open(cluster_fakes.state_file(env, "faults.json"), "w") as f:
        json.dump(faults, f)


def trainer_starts(env) -> int:
    with open(os.path.join(env["BUCKET"], env["RUN"], "argv-worker0.jsonl")) as f:
        return len(f.readlines())


def test_run_rides_out_stderr_noise_and_failed_describes_without_touching_the_node(cloud):
    """gcloud's notices on stderr are not the node's state, and a describe that fails with
    a 503, a 429, a 500 or no network says nothing about the node: the run goes on, on the
    same node, with each retry logged."""
    env = {**cloud, "SPOT": "1", "FAKE_GCLOUD_NOISE": "1", "RETRY_MAX_SECONDS": "0.4"}
    run = start_run(env, 40)
    wait_for(lambda: checkpoint(env) >= 3, what="training steps")
    set_faults(env, describe=["503", "429", "network", "500"])
    out = finish(run)
    assert checkpoint(env) == 40 and "the run finished" in out
    assert gcloud_calls(env, "compute", "tpus", "tpu-vm", "delete") == []
    assert len(gcloud_calls(env, "compute", "tpus", "tpu-vm", "create")) == 1
    assert trainer_starts(env) == 1  # never restarted
    # Which describes meet the failures depends on timing (the run's status asks too);
    # those of the state are retried after a wait that doubles up to RETRY_MAX_SECONDS.
    retries = re.findall(r"describing bert failed \((.*)\): retry (\d+) in ([\d.]+)s", out)
    assert len(retries) >= 3, out
    assert [float(delay) for _, _, delay in retries][:3] == [0.2, 0.4, 0.4]
    reasons = " ".join(reason for reason, _, _ in retries)
    assert "ConnectionError" in reasons and "[HTTP 500] INTERNAL" in reasons


def test_run_waits_out_a_stockout_after_a_preemption_and_resumes(cloud):
    """After a spot preemption the create fails for capacity, twice: the supervisor waits
    and tries again instead of ending, and the run resumes from its checkpoint."""
    env = {**cloud, "SPOT": "1", "RETRY_MAX_SECONDS": "0.4"}
    run = start_run(env, 40)
    wait_for(lambda: checkpoint(env) >= 5, what="training steps")
    set_faults(env, create=["capacity", "capacity"])
    cluster_fakes.preempt(env, "bert")
    preempted_at = checkpoint(env)
    out = finish(run)
    assert checkpoint(env) == 40 and "the run finished" in out
    assert len(gcloud_calls(env, "compute", "tpus", "tpu-vm", "create")) == 4
    assert len(gcloud_calls(env, "compute", "tpus", "tpu-vm", "delete")) == 1  # the PREEMPTED
    assert out.count("There is no more capacity in the zone") >= 2
    assert re.search(r"creating bert failed \(.*no more capacity.*\): retry 2 in 0.4s", out)
    log = os.path.join(env["LOGS_DIR"], "worker-0.log")
    resumed = int(re.search(r"at step (\d+)", open(log).read()).group(1))
    assert 1 <= resumed <= preempted_at


def test_run_retries_install_over_a_dropped_ssh_connection(cloud):
    env = {**cloud, "RETRY_MAX_SECONDS": "0.4"}
    set_faults(env, ssh=["255", "255"])
    out = finish(start_run(env, 5))
    assert checkpoint(env) == 5 and "the run finished" in out
    assert "install on bert failed (SSH connection dropped, exit 255): retry 2 in 0.4s" in out


def test_run_ends_on_a_create_error_that_retrying_cannot_fix(cloud):
    result = tpu_vm(cloud, "run", "--runtime-version=v2-alpha-tpuv5", check=False)
    assert result.returncode == 1
    assert "tpu_vm.sh: creating bert failed: " in result.stderr
    assert "INVALID_ARGUMENT" in result.stderr.splitlines()[-1]


# ----------------------------------------------------------------------------------------
# DRY_RUN, missing settings


def test_dry_run_prints_and_runs_nothing(cloud):
    result = tpu_vm(cloud, "delete", "--queued=1", DRY_RUN="1")
    assert cluster_fakes.calls(cloud) == []
    assert result.stdout.strip() == (
        "gcloud compute tpus queued-resources delete bert --project=proj "
        "--zone=us-central2-b --force --quiet"
    )


def test_missing_setting_is_named(cloud):
    env = {k: v for k, v in cloud.items() if k != "ZONE"}
    result = tpu_vm(env, "create", check=False)
    assert result.returncode != 0 and "ZONE" in result.stderr
    assert cluster_fakes.calls(cloud) == []


# ----------------------------------------------------------------------------------------
# SLURM


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


def test_slurm_venv_has_cuda_jax_through_the_cuda_extra():
    with open(os.path.join(REPO, "setup.py")) as f:
        text = f.read()  # each Python's JAX with the CUDA wheels built for it
    assert "'jax[cuda12]>=0.10,<0.11; python_version < \"3.12\"'" in text
    assert "'jax[cuda13]>=0.11,<0.12; python_version >= \"3.12\"'" in text
    with open(os.path.join(REPO, "launch", "slurm", "train.sbatch")) as f:
        assert "pip install -e '.[train,cuda]'" in f.read()


def test_slurm_script_runs_the_project_venv_and_names_a_missing_one(tmp_path):
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
