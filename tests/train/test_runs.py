"""End-to-end runs of `python -m lambjax.main` on 1, 2 and 4 fake CPU devices.

One uninterrupted reference run (4 devices, both phases of the demo's runlocal variant) is
compared with: runs on 1 and 2 devices, a run killed with SIGKILL and rerun, a run stopped
by SIGTERM and rerun, a resume onto another device count, and a resume past a corrupt
checkpoint. Each run is a real subprocess, as a user would start it.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from lambjax import cli
from lambjax.sweep import runner, spec
from lambjax.train import target as target_lib
from lambjax.train.metrics import read_jsonl
from tests.helpers import (
    PHASE1_STEPS,
    PHASE2_STEPS,
    REPO,
    environment,
    flip_bytes_in_largest_array,
    logged_steps,
    losses,
    tensorboard_scalars,
    wait_for_checkpoint,
    wait_until,
)
from tests.helpers import demo_command as command
from tests.helpers import (
    run_demo as run,
)


def start(workdir, data_dir, devices, *overrides):
    return subprocess.Popen(
        command(workdir, data_dir, *overrides),
        cwd=REPO,
        env=environment(devices),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, data_dir):
    """(workdir, console output) of the reference run."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    return workdir, run(workdir, data_dir, 4).stderr


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run[0]


def test_the_console_shows_lambjax_lines_and_the_workdir_the_full_log(reference_run):
    workdir, console = reference_run
    lines = console.strip().splitlines()
    assert not [line for line in lines if re.match(r"[IWEF]\d{4} ", line)]  # no absl prefix
    assert f"phase1 step {PHASE1_STEPS}/{PHASE1_STEPS} | loss " in console
    model = [line for line in lines if line.startswith("Model: ")]
    assert len(model) == 1 and "parameters.txt" in model[0] and "| Name" not in console
    assert "| embeddings/word/embedding" in open(os.path.join(workdir, "parameters.txt")).read()
    assert "differ on disk" not in console and "Unable to initialize backend" not in console
    with open(os.path.join(workdir, "train.log"), encoding="utf-8") as f:
        full_log = f.read()
    assert re.search(r"^I\d{4} [\d:.]+ +\d+ trainer.py:\d+\] phase1 step 1/", full_log, re.M)
    assert lines[-5] == "Summary:"  # the console ends with the summary


def test_two_phases_run_and_learn(reference):
    logged = losses(reference)
    assert sorted(logged) == list(range(1, PHASE1_STEPS + PHASE2_STEPS + 1))
    assert all(loss == loss for loss in logged.values())  # finite, not NaN
    assert logged[PHASE1_STEPS] < logged[1]  # phase 1 lowers the loss
    for phase, last in (("phase1", PHASE1_STEPS), ("phase2", PHASE2_STEPS)):
        assert os.path.isdir(os.path.join(reference, "checkpoints", phase, str(last)))
    records = read_jsonl(os.path.join(reference, "metrics.jsonl"))
    final = records[PHASE1_STEPS + PHASE2_STEPS]
    for key in ("train/mlm_accuracy", "train/learning_rate", "train/grad_norm"):
        assert key in final
    assert any(k.startswith("train/trust_ratio") for k in final)
    assert any("eval/mlm_accuracy" in r for r in records.values())
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(reference))


PHASE1_ONLY = "--config.phase_order=('phase1',)"
OTHER_PRNGS = ["rbg", "unsafe_rbg"]  # config.prng_impl; the reference run's is threefry


def prng_flags(impl: str) -> tuple[str, ...]:
    """A run with `impl` draws its dropout: phase 1 only (the default's runs cover phase 2)."""
    return () if impl == "threefry" else (PHASE1_ONLY, f"--config.prng_impl={impl}")


@pytest.fixture(scope="module")
def prng_reference(reference, tmp_path_factory, data_dir):
    """impl -> the workdir of an uninterrupted 4-device run that draws with it (made once)."""
    workdirs = {"threefry": reference}

    def reference_for(impl):
        if impl not in workdirs:
            workdirs[impl] = str(tmp_path_factory.mktemp(impl))
            run(workdirs[impl], data_dir, 4, *prng_flags(impl))
        return workdirs[impl]

    return reference_for


@pytest.mark.slow
@pytest.mark.parametrize("impl, devices", [("threefry", 1), ("threefry", 2), ("rbg", 2)])
def test_same_losses_on_fewer_devices(prng_reference, data_dir, tmp_path, impl, devices):
    """The topology guarantee holds for every PRNG: on XLA:CPU, rbg's and unsafe_rbg's
    RngBitGenerator is partitioned by computing the whole draw and slicing it. (unsafe_rbg:
    2 processes x 2 devices against 1 x 4 in tests/launch/test_local_pod.py.)"""
    run(str(tmp_path), data_dir, devices, PHASE1_ONLY, *prng_flags(impl))
    expected = losses(prng_reference(impl))
    got = losses(str(tmp_path))
    assert sorted(got) == list(range(1, PHASE1_STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step


@pytest.mark.slow
@pytest.mark.parametrize("impl", OTHER_PRNGS)
def test_each_prng_draws_its_own_dropout(reference, prng_reference, impl):
    """The same data and initial parameters; other dropout masks from the first step on."""
    expected, got = losses(reference), losses(prng_reference(impl))
    for step, loss in got.items():
        assert loss != expected[step], step
        assert loss == pytest.approx(expected[step], rel=0.05), step


@pytest.mark.parametrize(
    "impl", ["threefry", *(pytest.param(i, marks=pytest.mark.slow) for i in OTHER_PRNGS)]
)
def test_kill_and_rerun_gives_bitwise_the_same_losses(prng_reference, data_dir, tmp_path, impl):
    """Killed after it logged steps past its checkpoint: the rerun logs them again, and
    metrics.jsonl and TensorBoard hold each step once, the rerun's."""
    workdir = str(tmp_path)
    process = start(workdir, data_dir, 4, *prng_flags(impl))
    wait_for_checkpoint(workdir, "phase1", 4, process)
    wait_until(lambda: max(logged_steps(workdir), default=0) >= 6, process)
    process.kill()
    process.wait()
    assert not os.path.exists(os.path.join(workdir, "checkpoints", "phase2", str(PHASE2_STEPS)))
    run(workdir, data_dir, 4, *prng_flags(impl))
    assert losses(workdir) == losses(prng_reference(impl))
    steps = logged_steps(workdir)
    assert steps == sorted(set(steps))  # each step once, in order
    assert tensorboard_scalars(workdir, "train/loss") == pytest.approx(losses(workdir), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, said", [(signal.SIGTERM, "SIGTERM received"), (signal.SIGINT, "Ctrl-C (SIGINT)")]
)
def test_sigterm_saves_exits_zero_and_resumes(reference, data_dir, tmp_path, signum, said):
    """SIGTERM, and Ctrl-C as a SIGTERM: the run saves at its next step, exits 0 with one
    line, and the same command continues it bitwise."""
    workdir = str(tmp_path)
    process = start(workdir, data_dir, 4)
    wait_for_checkpoint(workdir, "phase1", 4, process)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
    assert said in stderr and "Traceback" not in stderr
    logged = losses(workdir)
    stopped_at = max(logged)
    assert stopped_at < PHASE1_STEPS + PHASE2_STEPS
    phase, step = (
        ("phase1", stopped_at)
        if stopped_at <= PHASE1_STEPS
        else (
            "phase2",
            stopped_at - PHASE1_STEPS,
        )
    )
    assert os.path.isdir(os.path.join(workdir, "checkpoints", phase, str(step)))
    run(workdir, data_dir, 4)
    assert losses(workdir) == losses(reference)


@pytest.mark.slow
def test_saves_by_time_and_a_run_killed_without_notice_resumes_bitwise(
    reference, data_dir, tmp_path
):
    """With step checkpoints out of reach, config.checkpoint_every_minutes is what a run
    killed without notice (a Cloud TPU preemption) resumes from; the losses are bitwise
    those of the uninterrupted run."""
    workdir = str(tmp_path)
    by_time = (
        "--config.phase_order=('phase1',)",
        "--config.checkpoint_every_steps=1000",
        "--config.checkpoint_every_minutes=0.002",  # 0.12 s
    )
    phase1 = os.path.join(workdir, "checkpoints", "phase1")

    def saved_steps() -> list[int]:
        names = os.listdir(phase1) if os.path.isdir(phase1) else []
        return sorted(int(name) for name in names if name.isdigit())

    process = start(workdir, data_dir, 4, *by_time)
    wait_until(lambda: any(step < PHASE1_STEPS for step in saved_steps()), process)
    process.kill()
    process.wait()
    killed_with = saved_steps()
    assert killed_with and max(killed_with) < PHASE1_STEPS  # saves by time alone
    result = run(workdir, data_dir, 4, *by_time)
    assert f"resuming from its checkpoint at step {max(killed_with)}" in result.stderr
    expected = losses(reference)
    assert losses(workdir) == {step: expected[step] for step in range(1, PHASE1_STEPS + 1)}


@pytest.mark.slow
def test_phase_two_restores_onto_another_device_count(reference, data_dir, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(reference, workdir)
    shutil.rmtree(os.path.join(workdir, "checkpoints", "phase2"))
    os.remove(os.path.join(workdir, "metrics.jsonl"))
    result = run(workdir, data_dir, 2)
    expected, got = losses(reference), losses(workdir)
    assert sorted(got) == list(range(PHASE1_STEPS + 1, PHASE1_STEPS + PHASE2_STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step
    # The console: one line per interval, and the run's summary (phase 1 already finished).
    final_loss = got[PHASE1_STEPS + PHASE2_STEPS]
    assert f"phase2 step {PHASE2_STEPS}/{PHASE2_STEPS} | loss {final_loss:.4f}" in result.stderr
    assert "Summary:\n  phase1: step 12, 0s in this run\n  phase2: step 6," in result.stderr


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back_to_the_previous(reference, data_dir, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(reference, workdir)
    phase1 = os.path.join(workdir, "checkpoints", "phase1")
    shutil.rmtree(os.path.join(workdir, "checkpoints", "phase2"))
    # Truncate every data file of phase 1's final checkpoint's train state.
    state_dir = os.path.join(phase1, str(PHASE1_STEPS), "state")
    for root, _, files in os.walk(state_dir):
        for name in files:
            if not name.endswith(".json") and "metadata" not in name:
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(0)
    os.remove(os.path.join(workdir, "metrics.jsonl"))
    result = run(workdir, data_dir, 4)
    assert "cannot be restored" in result.stderr
    kept = os.path.join(workdir, "checkpoints", "phase1.unreadable", str(PHASE1_STEPS))
    assert os.path.isdir(kept)  # moved aside, never deleted
    logged = losses(workdir)
    assert min(logged) == 9  # resumed after the step-8 checkpoint
    expected = losses(reference)
    assert {s: logged[s] for s in logged} == {s: expected[s] for s in logged}


@pytest.mark.slow
def test_flipped_bytes_in_the_final_checkpoint_are_refused_by_export_and_resume(
    reference, data_dir, tmp_path
):
    """The digests recorded at the save catch what Orbax reads without an error: the export
    takes the checkpoint before, the rerun sets the final one aside and trains its last
    steps again, to bitwise the same losses."""
    workdir = str(tmp_path / "run")
    shutil.copytree(reference, workdir)
    final = os.path.join(workdir, "checkpoints", "phase2", str(PHASE2_STEPS))
    flip_bytes_in_largest_array(os.path.join(final, "state"))
    export = [sys.executable, "-m", "lambjax.export", f"--workdir={workdir}", "--out=exported"]
    result = subprocess.run(
        export, cwd=tmp_path, env=environment(1), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (refused,) = [line for line in result.stderr.splitlines() if final in line]
    assert refused.startswith("warning: skipping unreadable checkpoint")
    assert "differ from what was saved" in refused or "differs from what was saved" in refused
    assert "phase2 (step 4) of" in result.stdout

    result = run(workdir, data_dir, 4)
    (line,) = [line for line in result.stderr.splitlines() if "cannot be restored" in line]
    assert f"Checkpoint {final} cannot be restored (IntegrityError: " in line
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "phase2.unreadable", "6"))
    assert "resuming from its checkpoint at step 4" in result.stderr
    assert losses(workdir) == losses(reference)
    steps = logged_steps(workdir)
    assert steps == sorted(set(steps))


@pytest.fixture
def small_disk(tmp_path):
    """A 20 MB tmpfs (two of the demo's checkpoints fit, not three), as root; the test is
    skipped where mounting is not permitted (tests/train/test_checkpoint_faults.py injects
    the same fault without it)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount_point)]
    mounted = subprocess.run(mount, capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.slow
def test_a_full_disk_ends_the_run_in_one_line_and_a_rerun_with_room_resumes(
    reference, data_dir, small_disk
):
    workdir = str(small_disk / "run")
    phase1 = os.path.join(workdir, "checkpoints", "phase1")
    result = run(workdir, data_dir, 4, PHASE1_ONLY, check=False)
    assert result.returncode == 75, result.stderr[-3000:]
    complete = sorted(int(name) for name in os.listdir(phase1) if name.isdigit())
    assert complete and max(complete) < PHASE1_STEPS
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"lambjax: error: a checkpoint could not be written to {phase1} (no space left on device); "
    )
    assert last.endswith(f"continues from the last complete checkpoint, {phase1}/{complete[-1]}")
    assert "Traceback" not in result.stderr
    unfinished = [name for name in os.listdir(phase1) if ".orbax-checkpoint-tmp" in name]

    subprocess.run(["mount", "-o", "remount,size=200m", str(small_disk)], check=True)
    result = run(workdir, data_dir, 4, PHASE1_ONLY)
    for name in unfinished:
        assert f"Removing {phase1}/{name}, the unfinished save of an earlier run." in result.stderr
    assert f"resuming from its checkpoint at step {complete[-1]}" in result.stderr
    expected = losses(reference)
    assert losses(workdir) == {step: expected[step] for step in range(1, PHASE1_STEPS + 1)}
    steps = logged_steps(workdir)
    assert steps == sorted(set(steps))


def test_bad_config_ends_with_one_line(tmp_path, data_dir):
    result = run(
        str(tmp_path), data_dir, 1, "--config.phases.phase1.global_batch_size=33", check=False
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("lambjax: error: config.phases.phase1.global_batch_size=33")
    assert "Traceback" not in result.stderr


def listing(root) -> dict:
    """{relative path: size} of every file under `root`."""
    return {
        os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(root)
        for f in files
    }


@pytest.mark.slow
def test_a_changed_config_leaves_the_run_as_it_was(reference, data_dir, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(reference, workdir)
    before = listing(workdir)
    result = run(workdir, data_dir, 4, "--config.model.preset=mini", "--config.seed=1", check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-4:] == [
        f"lambjax: error: --workdir={workdir} holds a run with another config:",
        '  model.preset: "tiny" in the workdir, "mini" now',
        "  seed: 0 in the workdir, 1 now",
        "Continue the run with the values in the workdir, or start a new run in another --workdir.",
    ]
    assert listing(workdir) == before  # nothing moved aside, written or deleted


@pytest.mark.slow
def test_a_run_resumes_with_more_steps_and_other_intervals(reference, data_dir, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(reference, workdir)
    more = PHASE2_STEPS + 2
    result = run(
        workdir,
        data_dir,
        2,
        f"--config.phases.phase2.num_steps={more}",
        "--config.log_every_steps=2",
    )
    assert "changed setting: phases.phase2.num_steps: 6 in the workdir, 8 now" in result.stderr
    assert f"training steps {PHASE2_STEPS + 1}..{more}" in result.stderr
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "phase2", str(more)))


@pytest.mark.slow
def test_a_run_ends_at_its_target_and_a_rerun_does_nothing_more(reference, data_dir, tmp_path):
    # The target is the reference's held-out MLM loss at its first evaluation: reached there.
    evals = {
        s: r["eval/mlm_loss"]
        for s, r in read_jsonl(f"{reference}/metrics.jsonl").items()
        if "eval/mlm_loss" in r
    }
    first = min(evals)
    workdir = tmp_path / "run"
    reach = ("--config.target.metric=mlm_loss", f"--config.target.value={evals[first]!r}")
    run(str(workdir), data_dir, 4, *reach)
    record = json.loads((workdir / target_lib.FILE).read_text())
    assert (record["phase"], record["step"], record["global_step"]) == ("phase1", first, first)
    assert record["eval"]["mlm_loss"] == evals[first]
    assert os.listdir(workdir / "checkpoints") == ["phase1"]
    assert str(first) in os.listdir(workdir / "checkpoints" / "phase1")
    reference_losses = losses(reference)
    assert losses(str(workdir)) == {s: v for s, v in reference_losses.items() if s <= first}
    metrics = (workdir / "metrics.jsonl").read_text()

    again = run(str(workdir), data_dir, 4, *reach)
    assert "nothing more to do" in again.stderr
    assert (workdir / "metrics.jsonl").read_text() == metrics
    overrides = {"target.metric": "mlm_loss", "target.value": evals[first]}
    trial = spec.Trial("run", overrides, {})
    config = cli.load_config(os.path.join(REPO, "configs/default.py:runlocal"))
    assert not runner.is_complete(runner.final_checkpoint(config, str(tmp_path), trial))
    assert runner.Sweep(config, "configs/default.py:runlocal", str(tmp_path), [trial]).finished(
        trial
    )


@pytest.mark.slow
def test_export_from_a_relative_workdir_predicts_as_lambjax(reference, tmp_path):
    """transformers' fill-mask pipeline on the export gives lambjax's own top predictions,
    with the run's tokenizer (its casing and special tokens)."""
    import jax.numpy as jnp
    import numpy as np
    import transformers

    from lambjax.data import tokenization
    from lambjax.models import pretraining
    from lambjax.models.config import BertConfig
    from lambjax.train import checkpointing

    shutil.copytree(reference, tmp_path / "run")
    export = [sys.executable, "-m", "lambjax.export", "--workdir=run", "--out=exported"]
    result = subprocess.run(
        export, cwd=tmp_path, env=environment(1), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "phase2" in result.stdout and "with its tokenizer" in result.stdout
    again = subprocess.run(export, cwd=tmp_path, env=environment(1), capture_output=True, text=True)
    assert again.returncode == 2
    assert again.stderr.endswith(
        "holds files; give an empty or new directory, or add --overwrite\n"
    )

    meta, params = checkpointing.latest_params(str(tmp_path / "run"))
    config = BertConfig(**{**meta["model_config"], "dtype": "float32"})
    ours = tokenization.load(meta["vocab_file"], lower_case=True)
    fill = transformers.pipeline("fill-mask", model=str(tmp_path / "exported"), top_k=3)
    for sentence in (
        "Return the [MASK] of the list.",
        "The Module Imports [MASK] Functions from the library.",
        "If the value is [MASK], raise an error.",
    ):
        ids = ours.encode(sentence).ids
        assert fill.tokenizer(sentence)["input_ids"] == ids  # the same tokenization
        batch = {
            "input_ids": jnp.asarray([ids]),
            "segment_ids": jnp.zeros((1, len(ids)), jnp.int32),
            "input_mask": jnp.ones((1, len(ids)), jnp.int32),
            "masked_lm_positions": jnp.asarray([[ids.index(ours.token_to_id("[MASK]"))]]),
        }
        logits, _ = pretraining.pretraining_logits(config, params, batch)
        top = list(np.argsort(-np.asarray(logits[0, 0]))[:3])
        assert [p["token"] for p in fill(sentence)] == top, sentence


@pytest.mark.slow
def test_phase_two_with_a_fresh_optimizer_of_another_kind(reference, data_dir, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(reference, workdir)
    shutil.rmtree(os.path.join(workdir, "checkpoints", "phase2"))
    os.remove(os.path.join(workdir, "metrics.jsonl"))
    result = run(
        workdir,
        data_dir,
        4,
        "--config.phases.phase2.optimizer_state=reset",
        "--config.phases.phase2.optimizer.name=lans",
    )
    assert "optimizer state: reset" in result.stderr
    records = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    final = records[PHASE1_STEPS + PHASE2_STEPS]
    assert "train/trust_ratio_adam_mean" in final  # LANS's ratios are logged
    # Phase 2 starts from phase 1's parameters: its first loss is near phase 1's last.
    assert abs(losses(workdir)[PHASE1_STEPS + 1] - losses(reference)[PHASE1_STEPS + 1]) < 0.5
