"""What a person reads on the console, and metrics.jsonl read back."""

import json

from lambjax.train import metrics


def test_progress_line_shows_what_is_known():
    train = {"loss": 5.54773, "mlm_accuracy": 0.1761, "tokens_per_s": 15216.9, "mfu": 0.2391}
    line = metrics.progress_line("phase1", 300, 7038, train, eta_phase=3725.0, eta_run=5000.0)
    assert line == (
        "phase1 step 300/7038 | loss 5.5477 | mlm acc 17.6% | 15.2k tok/s | MFU 23.9% "
        "| ETA 1h02m (run ~1h23m)"
    )
    # The first interval of a phase has no throughput yet; a CPU has no peak, so no MFU.
    first = metrics.progress_line("phase2", 20, 40, {"loss": 5.767, "mlm_accuracy": 0.167})
    assert first == "phase2 step 20/40 | loss 5.7670 | mlm acc 16.7%"
    last_phase = metrics.progress_line("phase2", 39, 40, train | {"mfu": 0.5}, 7.2, 7.2)
    assert last_phase.endswith("| MFU 50.0% | ETA 7s")


def test_run_summary_names_each_phase_and_where_to_look():
    eval_metrics = {"mlm_loss": 5.0734, "mlm_accuracy": 0.1445, "nsp_accuracy": 0.5625}
    summary = metrics.run_summary(
        [("phase1", 300, 129.4, eval_metrics), ("phase2", 40, 0.0, {})], "/w", "/w/checkpoints"
    )
    assert summary.splitlines() == [
        "Summary:",
        "  phase1: step 300, 2m09s in this run; eval mlm loss 5.0734, mlm acc 14.4%, nsp acc 56.2%",
        "  phase2: step 40, 0s in this run",
        "  checkpoints: /w/checkpoints",
        "  TensorBoard: tensorboard --logdir /w (every scalar: metrics.jsonl)",
    ]


def test_read_jsonl_merges_a_steps_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": 1, "train/loss": 2.0}, {"step": 1, "eval/mlm_loss": 3.0}]
    records.append({"step": 1, "train/loss": 1.5})  # a resumed run logs the step again
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    merged = {"step": 1, "train/loss": 1.5, "eval/mlm_loss": 3.0}
    assert metrics.read_jsonl(str(path)) == {1: merged}


def test_the_eta_follows_the_phases_mean_step_time_not_one_window():
    """Windows of 1 s per step, then one of 5 s (a checkpoint, a busy machine): the mean over
    the phase moves by the window's share of the steps, not to the window's rate."""
    mean = metrics.MeanStepTime()
    assert mean.update(20, None) is None  # the first window holds the compilation
    assert mean.update(40, 1.0) == 1.0
    assert mean.update(60, 1.0) == 1.0
    assert mean.update(80, 5.0) == (20 * 1.0 + 20 * 1.0 + 20 * 5.0) / 60
    assert mean.update(100, None) == (20 * 1.0 + 20 * 1.0 + 20 * 5.0) / 60  # not measured


def test_a_finished_phase_finds_its_eval_metrics_in_metrics_jsonl(tmp_path):
    records = [
        {"step": 300, "train/loss": 6.0},
        {"step": 300, "eval/mlm_loss": 5.07, "eval/mlm_accuracy": 0.144, "eval/nsp_accuracy": 0.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert metrics.eval_metrics_at(str(tmp_path), 300) == {
        "mlm_loss": 5.07,
        "mlm_accuracy": 0.144,
        "nsp_accuracy": 0.5,
    }
    assert metrics.eval_metrics_at(str(tmp_path), 340) == {}
    assert metrics.eval_metrics_at(str(tmp_path / "nowhere"), 300) == {}


def test_a_resumed_run_logs_each_step_once_in_metrics_jsonl_and_tensorboard(tmp_path):
    """A run logged steps 1..7, was killed and resumes from its checkpoint at step 4: its
    steps 5..7 are logged again (other numbers here, to tell them apart), once."""
    import time

    from lambjax.sweep import report
    from tests.helpers import tensorboard_scalars

    workdir = str(tmp_path)
    first = metrics.create_writer(workdir)
    first.resume_from(0)
    for step in range(1, 8):
        first.write_scalars(step, {"train/loss": 10.0 - step})
    first.write_scalars(7, {"eval/mlm_accuracy": 0.9, "eval/mlm_loss": 1.0})  # orphaned
    first.flush()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "train/lo')  # a row cut short by the kill
    time.sleep(1.1)  # the resumed run's event file is named by a later second
    second = metrics.create_writer(workdir)
    second.resume_from(4)
    for step in range(5, 11):
        second.write_scalars(step, {"train/loss": 100.0 + step})
    second.write_scalars(10, {"eval/mlm_accuracy": 0.5, "eval/mlm_loss": 2.0})
    second.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [*range(1, 11), 10]  # each step's rows once
    expected = {s: 10.0 - s for s in range(1, 5)} | {s: 100.0 + s for s in range(5, 11)}
    assert {row["step"]: row["train/loss"] for row in rows if "train/loss" in row} == expected
    assert tensorboard_scalars(workdir, "train/loss") == expected
    assert tensorboard_scalars(workdir, "eval/mlm_accuracy") == {10: 0.5}
    # The sweep report reads the same rows: the orphaned evaluation is not its best.
    summary = report.summary(workdir)
    assert summary["steps"] == 10
    assert (
        summary["best"]
        == summary["final"]
        == {
            "eval/mlm_accuracy": 0.5,
            "eval/mlm_loss": 2.0,
        }
    )


def test_tensorboard_reads_the_scalars_and_texts_that_a_run_writes_without_tensorflow(tmp_path):
    """A run's modules and its event files need no TensorFlow (its import would add seconds
    to every run's start); TensorBoard's own loader reads what they write."""
    import subprocess
    import sys

    from tensorboard.backend.event_processing import plugin_event_accumulator as loader
    from tensorboard.util import tensor_util

    code = (
        "import sys\n"
        "import lambjax.finetune.loop, lambjax.main, lambjax.sweep.runner\n"
        "from lambjax.train import metrics, trainer\n"
        "writer = metrics.create_writer(sys.argv[1])\n"
        "writer.write_scalars(3, {'train/loss': 2.5, 'train/grad_norm': 0.25})\n"
        "writer.write_texts(0, {'parameters': '    name | shape'})\n"
        "writer.close()\n"
        "assert 'tensorflow' not in sys.modules, 'TensorFlow was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=120)
    accumulator = loader.EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert set(accumulator.PluginTagToContent("scalars")) == {"train/loss", "train/grad_norm"}
    assert list(accumulator.PluginTagToContent("text")) == ["parameters"]
    [loss] = accumulator.Tensors("train/loss")
    assert (loss.step, float(tensor_util.make_ndarray(loss.tensor_proto))) == (3, 2.5)
    [text] = accumulator.Tensors("parameters")
    assert tensor_util.make_ndarray(text.tensor_proto).item() == b"    name | shape"


def test_the_profile_hook_traces_the_steps_after_its_first(tmp_path):
    import glob

    import jax
    import jax.numpy as jnp

    from lambjax.train.trainer import Profile

    hook, x = Profile(str(tmp_path), first=2, num_steps=2), jnp.ones(4)
    running = []
    for step in range(1, 7):
        x = jax.jit(lambda v: v * 2)(x)
        hook(step)
        running.append(hook.running)
    hook.stop()
    assert running == [False, True, True, False, False, False]
    assert len(glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))) == 1
