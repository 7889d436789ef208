"""Sweeps (lambjax.sweep): trials from get_sweep(), run N at a time, resumed, reported.

The end-to-end tests run `python -m lambjax.sweep` as users do, over tests/sweep/
three_trials.py (the demo's runlocal config, 3 trials), shortened to a few steps.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from lambjax.sweep import report, spec
from lambjax.train.config import base_config
from lambjax.train.metrics import read_jsonl
from tests.helpers import REPO, environment, losses, run

CONFIG = "tests/sweep/three_trials.py"
SHORT = [  # phase 1 only, 6 steps
    "--config.phase_order=('phase1',)",
    "--config.phases.phase1.num_steps=6",
    "--config.checkpoint_every_steps=2",
    "--config.eval_every_steps=2",
    "--config.log_every_steps=1",
]
NAMES = [
    "seed=0,data.masked_lm_prob=0.15",
    "seed=1,data.masked_lm_prob=0.2",
    "seed=2,data.masked_lm_prob=0.1",
]


def sweep_command(workdir, data_dir, *flags, config=CONFIG):
    return [
        sys.executable,
        "-m",
        "lambjax.sweep",
        f"--config={config}",
        f"--workdir={workdir}",
        f"--config.data.data_dir={data_dir}",
        *SHORT,
        *flags,
    ]


def test_product_and_zipped_make_the_trials():
    grid = spec.product({"a": [1, 2]}, {"b": [3, 4], "c": [5, 6]})
    assert grid == [
        {"a": 1, "b": 3, "c": 5},
        {"a": 1, "b": 4, "c": 6},
        {"a": 2, "b": 3, "c": 5},
        {"a": 2, "b": 4, "c": 6},
    ]
    assert spec.product({"a": [1]}) + spec.zipped({"b": [2]}) == [{"a": 1}, {"b": 2}]
    with pytest.raises(spec.SweepError, match="one length"):
        spec.zipped({"a": [1, 2], "b": [3]})


def test_trials_are_named_by_their_overrides_and_checked():
    config = base_config()
    trials = spec.trials(config, [{"seed": 1, "optimizer.b2": 0.98}, {"profile": True}])
    assert [t.name for t in trials] == ["seed=1,optimizer.b2=0.98", "profile=true"]
    assert trials[1].flags() == ["--config.profile=true"]
    for sweep, message in (
        ([], "the sweep is empty"),
        ([{"sed": 1}], "trial 0: the config has no field 'sed'"),
        ([{"optimizer.b3": 0.9}], "trial 0: optimizer has no field 'b3'"),
        ([{"seed": 1.5}], "trial 0: seed=1.5 is a float; the field takes an int"),
        ([{"profile": "yes"}], "trial 0: profile='yes' is a str; the field takes a bool"),
        ([{"seed": 1}, {"seed": 1}], "trials 0 and 1 are the same"),
        ([{"optimizer": 1}], "trial 0: optimizer is a group of fields"),
    ):
        with pytest.raises(spec.SweepError) as error:
            spec.trials(config, sweep)
        assert str(error.value).startswith(message), str(error.value)
    assert spec.trials(config, [{"optimizer.b2": 1}])  # an int where a float goes


def test_a_labelled_trial_is_named_by_its_labels():
    config = base_config()
    trials = spec.trials(
        config,
        [spec.labelled({"seed": 3, "optimizer.b2": 0.98}, optimizer="lamb", batch=64), {"seed": 1}],
    )
    assert [t.name for t in trials] == ["optimizer=lamb,batch=64", "seed=1"]
    assert trials[0].labels == {"optimizer": "lamb", "batch": 64}
    assert trials[0].flags() == ["--config.seed=3", "--config.optimizer.b2=0.98"]
    with pytest.raises(spec.SweepError, match="needs at least one label"):
        spec.labelled({"seed": 1})


@pytest.mark.slow  # a subprocess per case
@pytest.mark.parametrize(
    "arg, message",
    [
        ("empty", "the sweep is empty"),
        ("typo", "trial 0: phases.phase1 has no field 'learning_rat'"),
        ("twice", "trials 0 and 1 are the same (seed=1)"),
    ],
)
def test_a_bad_sweep_ends_before_any_trial_with_one_line(tmp_path, data_dir, arg, message):
    workdir = tmp_path / "sweep"
    result = run(sweep_command(workdir, data_dir, config=f"{CONFIG}:{arg}"), 1, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"lambjax.sweep: error: --config={CONFIG}:{arg}: {message}")
    assert not workdir.exists()


@pytest.mark.slow  # a subprocess
def test_dry_run_prints_the_commands(tmp_path, data_dir):
    result = run(sweep_command(tmp_path, data_dir, "--dry-run"), 1)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3
    assert shlex.split(lines[1])[3:] == [
        f"--config={CONFIG}",
        f"--workdir={tmp_path}/{NAMES[1]}",
        f"--config.data.data_dir={data_dir}",
        *SHORT,
        "--config.seed=1",
        "--config.data.masked_lm_prob=0.2",
    ]
    assert not (tmp_path / "sweep.json").exists()


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory, data_dir):
    """The 3-trial sweep, 2 trials at a time, never interrupted."""
    workdir = tmp_path_factory.mktemp("sweep")
    result = run(sweep_command(workdir, data_dir, "--parallel=2"), 1)
    return workdir, result


@pytest.mark.slow  # three trials' training
def test_a_sweep_runs_every_trial_and_reports(finished_sweep):
    workdir, result = finished_sweep
    state = json.loads((workdir / "sweep.json").read_text())
    assert sorted(state["trials"]) == sorted(NAMES)
    assert {t["status"] for t in state["trials"].values()} == {"finished"}
    assert state["trials"][NAMES[1]]["overrides"] == {"seed": 1, "data.masked_lm_prob": 0.2}
    for name in NAMES:  # each trial is a run of its own overrides
        saved = json.loads((workdir / name / "config.json").read_text())
        assert saved["seed"] == NAMES.index(name)
        assert (workdir / name / "checkpoints" / "phase1" / "6").is_dir()
    # The report's figures are those of each trial's metrics.jsonl.
    table = (workdir / "report.md").read_text()
    assert table.split("\n", 2)[2].strip() in result.stdout
    for name in NAMES:
        records = read_jsonl(str(workdir / name / "metrics.jsonl"))
        evals = [r for _, r in sorted(records.items()) if "eval/mlm_accuracy" in r]
        final, best = evals[-1], min(r["eval/mlm_loss"] for r in evals)
        overrides = state["trials"][name]["overrides"]
        # Columns: the swept fields sorted (data.masked_lm_prob, seed), then the figures.
        row = next(
            line
            for line in table.splitlines()
            if line.startswith(f"| {overrides['data.masked_lm_prob']} | {overrides['seed']} |")
        )
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == f"{100 * final['eval/mlm_accuracy']:.2f}%"
        assert cells[4] == f"{final['eval/mlm_loss']:.4f}"
        assert cells[5] == f"{best:.4f}"
        assert cells[6] == "6"
    for png in ("eval_curves.png", "final_vs_data.masked_lm_prob.png", "final_vs_seed.png"):
        assert (workdir / png).read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow  # the finished sweep's three trials
def test_report_of_a_single_run(finished_sweep):
    workdir, _ = finished_sweep
    single = str(workdir / NAMES[0])
    text = report.write_report(single)
    rows = text.splitlines()[2:]
    assert len(rows) == 1 and "| 6 |" in rows[0]  # one run: no overrides, its figures
    assert (workdir / NAMES[0] / "report.md").exists()
    assert (workdir / NAMES[0] / "eval_curves.png").exists()


@pytest.mark.slow  # three trials' training, twice
def test_a_killed_sweep_skips_finished_trials_and_resumes_bitwise(
    finished_sweep, tmp_path, data_dir
):
    """The first two trials, one at a time: killed in the second, run again."""
    reference, _ = finished_sweep
    workdir = tmp_path / "sweep"
    command = sweep_command(workdir, data_dir, "--parallel=1", config=f"{CONFIG}:two")
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=environment(1),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    second = workdir / NAMES[1] / "checkpoints" / "phase1" / "2"
    deadline = time.time() + 300
    while not second.exists():
        assert process.poll() is None and time.time() < deadline, "the sweep ended early"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    time.sleep(1)  # the trial dies with the sweep (PR_SET_PDEATHSIG)
    first_log = (workdir / NAMES[0] / "log.txt").read_text()
    assert not (workdir / NAMES[1] / "checkpoints" / "phase1" / "6").exists()

    run(command, 1)
    assert (workdir / NAMES[0] / "log.txt").read_text() == first_log  # not run again
    assert "resuming from its checkpoint" in (workdir / NAMES[1] / "log.txt").read_text()
    for name in NAMES[:2]:
        assert losses(str(workdir / name)) == losses(str(reference / name)), name
    state = json.loads((workdir / "sweep.json").read_text())
    assert {t["status"] for t in state["trials"].values()} == {"finished"}


def test_summary_of_a_run_without_evaluations(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 3, "train/loss": 2.0}\n')
    assert report.summary(str(tmp_path)) == {"steps": 3, "final": {}, "best": {}}
    assert os.path.exists(tmp_path / "metrics.jsonl")


def test_a_study_report_comes_from_the_module_its_study_names(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text('{"step": 1, "train/loss": 7.0}\n')
    answer = tmp_path / "answer.py"
    answer.write_text(
        "def study_report(directory, trials, study):\n"
        "    return f'## The answer: {study[\"x\"]} over {sorted(trials)}'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    study = {"kind": "made_up", "report": "answer", "x": 42}
    trials = {"a": {"overrides": {"seed": 1}, "status": "finished", "wall_time_s": 1.0}}
    sweep_file = tmp_path / "sweep.json"
    sweep_file.write_text(json.dumps({"trials": trials, "study": study}))
    text = report.write_report(str(tmp_path))
    assert text.startswith("## The answer: 42 over ['a']\n\n## Every trial\n\n| seed |")
    study["report"] = "no_such_study.report"
    sweep_file.write_text(json.dumps({"trials": trials, "study": study}))
    with pytest.raises(ValueError) as error:  # `report` prints it as its one error line
        report.write_report(str(tmp_path))
    assert str(error.value) == (
        "cannot import the study's report module no_such_study.report (No module named "
        "'no_such_study'); run the command from the repository root"
    )


@pytest.mark.slow  # three trials' training through the fake TPU zone
def test_a_tpu_sweep_runs_a_trial_per_node_through_tpu_vm_sh(tmp_path, data_dir):
    """Against the fake Cloud TPU zone of the launch tests: 3 trials on 2 nodes."""
    from tests.launch import cluster_fakes

    env = cluster_fakes.environment(tmp_path, environment(1))
    env.update(PROJECT="proj", ZONE="us-central2-b", TPU_NAME="bert", POLL_SECONDS="0.2")
    env["PYTHONPATH"] = REPO  # the test's config file imports configs/
    workdir = tmp_path / "bucket" / "sweep"
    config = os.path.join(REPO, CONFIG)
    command = sweep_command(workdir, data_dir, "--launcher=tpu", "--parallel=2", config=config)
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    created = [
        call[5]
        for call in cluster_fakes.calls(env, "gcloud")
        if call[1:5] == ["compute", "tpus", "tpu-vm", "create"]
    ]
    assert sorted(created) == ["bert-0", "bert-1"]  # a node per parallel slot
    for index, name in enumerate(NAMES):
        with open(workdir / name / "argv-worker0.jsonl") as f:
            argv = json.loads(f.readline())  # what lambjax.main got on the trial's node
        assert argv[:2] == [f"--config={config}", f"--workdir={workdir}/{name}"]
        assert argv[2:-2] == [f"--config.data.data_dir={data_dir}", *SHORT]
        masked = [0.15, 0.2, 0.1][index]
        assert argv[-2:] == [f"--config.seed={index}", f"--config.data.masked_lm_prob={masked}"]
        assert "the run finished" in (tmp_path / "tpu-logs" / "sweep" / f"{name}.log").read_text()
    state = json.loads((workdir / "sweep.json").read_text())
    assert {t["status"] for t in state["trials"].values()} == {"finished"}


@pytest.mark.slow  # a trial's training, and the finished sweep's
def test_a_slurm_sweep_submits_an_array_task_per_unfinished_trial(
    finished_sweep, tmp_path, data_dir
):
    """Against the launch tests' fake sbatch/srun: trials 0 and 1 finished, 2 runs."""
    import shutil

    from tests.launch import cluster_fakes

    reference, _ = finished_sweep
    workdir = tmp_path / "sweep"
    for name in NAMES[:2]:
        shutil.copytree(reference / name, workdir / name)
    env = cluster_fakes.environment(tmp_path, environment(1))
    sbatch = "--sbatch=--nodes=1 --ntasks-per-node=1 --gpus-per-node=0"
    command = sweep_command(workdir, data_dir, "--launcher=slurm", sbatch)
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    [call] = cluster_fakes.calls(env, "sbatch")
    assert call[1:3] == ["--array=2", f"--output={workdir}/slurm-%A_%a.out"]
    assert call[-len(SHORT) :] == SHORT  # the sweep's own flags reach every trial
    output = (workdir / "slurm-4242_2.out").read_text()
    assert "Phase phase1: training steps 1..6" in output
    assert losses(str(workdir / NAMES[2])) == losses(str(reference / NAMES[2]))
    state = json.loads((workdir / "sweep.json").read_text())
    assert state["trials"][NAMES[2]]["status"] == "submitted (Submitted batch job 4242)"


def test_parallel_trials_share_out_the_gpus_and_not_a_tpu(tmp_path, monkeypatch):
    from lambjax.sweep import runner

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpu_host = tmp_path / "gpu"
    (gpu_host / "dev").mkdir(parents=True)
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm"):
        (gpu_host / "dev" / name).touch()
    assert runner.slot_environments(2, str(gpu_host)) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ]
    with pytest.raises(spec.SweepError, match="does not divide this host's 4 GPUs"):
        runner.slot_environments(3, str(gpu_host))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert runner.slot_environments(2, str(gpu_host))[1] == {"CUDA_VISIBLE_DEVICES": "6"}
    tpu_host = tmp_path / "tpu" / "sys" / "bus" / "pci" / "devices" / "0000:00:04.0"
    tpu_host.mkdir(parents=True)
    (tpu_host / "vendor").write_text("0x1ae0\n")
    (tpu_host / "device").write_text("0x005e\n")
    with pytest.raises(spec.SweepError, match="libtpu gives every chip to one process"):
        runner.slot_environments(2, str(tmp_path / "tpu"))
    assert runner.slot_environments(1, str(tmp_path / "tpu")) == [{}]
    assert runner.slot_environments(2, str(tmp_path / "cpu")) == [{}, {}]


def test_a_sweep_in_a_bucket_keeps_its_state_there(gcs_bucket, data_dir):
    """sweep.json in the bucket (a local GCS emulator); a trial counts as finished only once
    its final checkpoint is committed (GCS has no rename); logs stay on local disk."""
    from etils import epath

    from lambjax.sweep import runner, spec
    from tests.sweep import three_trials

    config = three_trials.get_config()
    trials = spec.trials(config, spec.product({"seed": [0, 1]}))
    directory = f"{gcs_bucket}/sweep"
    sweep = runner.Sweep(config, CONFIG, directory, trials)
    sweep.write()
    assert json.loads((epath.Path(directory) / "sweep.json").read_text())["trials"].keys() == {
        t.name for t in trials
    }
    assert f"--workdir={directory}/{trials[0].name}" in sweep.command(trials[0])
    assert sweep.log_path(trials[0], "local") == os.path.join(
        "sweep-logs", "sweep", f"{trials[0].name}.log"
    )
    final = runner.final_checkpoint(config, directory, trials[0])
    (final / "state" / "half-written").write_text("")
    assert not sweep.finished(trials[0])
    (final / "commit_success.txt").write_text("")
    assert sweep.finished(trials[0])


# These tests run a sweep in the test process, where JAX's threads exist: Python warns that
# the trial's fork may deadlock, but the child only calls exec (and prctl before it).
in_process_sweep = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")


def fake_trials(tmp_path, monkeypatch, script: str):
    """A two-trial sweep in tmp_path whose trials run `script` (python -c, argv[1] the
    trial's workdir) in place of lambjax.main."""
    from lambjax.sweep import runner
    from tests.sweep import three_trials

    config = three_trials.get_config()
    trials = spec.trials(config, spec.product({"seed": [0, 1]}))
    sweep = runner.Sweep(config, CONFIG, str(tmp_path), trials)
    monkeypatch.setattr(
        sweep, "command", lambda t, *_: [sys.executable, "-c", script, sweep.workdir(t)]
    )
    return sweep, trials


@in_process_sweep
def test_a_diverged_trial_is_an_outcome_that_a_rerun_skips(tmp_path, monkeypatch):
    from lambjax.sweep import runner

    # Seed 0 diverges as lambjax.main does (diverged.json, exit 3); seed 1 crashes.
    script = (
        "import json, os, sys\n"
        "if sys.argv[1].endswith('seed=0'):\n"
        "    path = os.path.join(sys.argv[1], 'diverged.json')\n"
        "    json.dump({'error': '3 consecutive steps had a non-finite loss'}, open(path, 'w'))\n"
        "    sys.exit(3)\n"
        "sys.exit(1)\n"
    )
    sweep, trials = fake_trials(tmp_path, monkeypatch, script)
    assert sweep.run(parallel=2) == 1  # the crash is a failure; the divergence is not
    state = json.loads((tmp_path / "sweep.json").read_text())
    assert state["trials"]["seed=0"]["status"] == "diverged"
    assert state["trials"]["seed=1"]["status"].startswith("failed (exit 1; see ")
    again = runner.Sweep(sweep.config, CONFIG, str(tmp_path), trials)
    assert again.records["seed=0"]["status"] == "diverged"
    assert [t.name for t in again.pending()] == ["seed=1"]  # the failed one runs again
    (tmp_path / "seed=0" / "diverged.json").unlink()  # how a user asks for it again
    assert len(runner.Sweep(sweep.config, CONFIG, str(tmp_path), trials).pending()) == 2


class StopAfterOneSecond:
    """The sweep's SIGTERM handler (runner._StopSignal), as if SIGTERM came a second in."""

    def __init__(self):
        self.start = time.time()

    @property
    def requested(self):
        return time.time() > self.start + 1


@in_process_sweep
def test_a_trial_that_sigterm_kills_while_starting_is_stopped_not_failed(tmp_path, monkeypatch):
    from lambjax.sweep import runner

    monkeypatch.setattr(runner, "_StopSignal", StopAfterOneSecond)
    # No SIGTERM handler yet (lambjax.main installs it once it trains): the signal kills.
    sweep, _ = fake_trials(tmp_path, monkeypatch, "import time; time.sleep(60)")
    started = time.time()
    assert sweep.run(parallel=2) == 0
    assert time.time() - started < 30
    state = json.loads((tmp_path / "sweep.json").read_text())
    assert {t["status"] for t in state["trials"].values()} == {"stopped"}


@in_process_sweep
def test_trials_that_the_terminals_ctrl_c_reached_while_starting_are_stopped(tmp_path, monkeypatch):
    """Ctrl-C in a terminal reaches the trials too: one killed by SIGINT before it could save,
    or ended by lambjax's one line for it (exit 130), is stopped, not failed."""
    from lambjax.sweep import runner

    monkeypatch.setattr(runner, "_StopSignal", StopAfterOneSecond)
    script = (
        "import os, signal, sys, time\n"
        "time.sleep(1.5)\n"
        "if sys.argv[1].endswith('seed=0'):\n"
        "    sys.exit(130)\n"
        "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
    )
    sweep, _ = fake_trials(tmp_path, monkeypatch, script)
    assert sweep.run(parallel=2) == 0
    state = json.loads((tmp_path / "sweep.json").read_text())
    assert {t["status"] for t in state["trials"].values()} == {"stopped"}


@in_process_sweep
def test_a_stopping_sweep_signals_each_trial_once(tmp_path, monkeypatch):
    from lambjax.sweep import runner

    monkeypatch.setattr(runner, "_StopSignal", StopAfterOneSecond)
    # A trial that takes 2 s to save and exit after SIGTERM, counting the signals it gets.
    script = (
        "import os, signal, sys, time\n"
        "count = []\n"
        "signal.signal(signal.SIGTERM, lambda *_: count.append(1))\n"
        "while not count:\n"
        "    time.sleep(0.05)\n"
        "time.sleep(2)\n"
        "open(os.path.join(sys.argv[1], 'signals'), 'w').write(str(len(count)))\n"
    )
    sweep, trials = fake_trials(tmp_path, monkeypatch, script)
    assert sweep.run(parallel=2) == 0
    for trial in trials:
        assert (tmp_path / trial.name / "signals").read_text() == "1"
        assert sweep.records[trial.name]["status"] == "stopped"


def test_the_sweeps_eta_fills_the_slots_with_the_mean_trial_time():
    from lambjax.sweep import runner

    # 2 slots, trials of 100 s: one running for 30 s and 3 queued -> the queued take the
    # free slot at 0 s and 100 s and the other at 70 s: the last ends at 200 s.
    assert runner.sweep_eta(100.0, 3, [30.0], 2) == 200.0
    assert runner.sweep_eta(100.0, 1, [], 2) == 100.0  # one trial left: not halved
    assert runner.sweep_eta(100.0, 0, [150.0], 1) == 0.0  # over its mean: due now
