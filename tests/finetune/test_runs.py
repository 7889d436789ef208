"""`python -m lambjax.finetune` as users run it, on generated SQuAD and SST-2 files: it learns
(far above the trivial baselines), writes its results and predictions, resumes a killed run,
starts from a pretraining workdir or a transformers directory, and rejects bad input in one
line."""

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from etils import epath

from lambjax.finetune import glue_metrics, squad_metrics
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params
from lambjax.train import checkpointing
from lambjax.train import config as train_config
from lambjax.train.metrics import read_jsonl
from lambjax.train.state import TrainState
from tests import helpers
from tests.finetune import generate

pytestmark = pytest.mark.slow  # end-to-end runs, each over ~10 s

# A tiny BERT from scratch: sequence 64, batch 16, a high learning rate, 100 steps.
SMALL = (
    "--config.max_seq_length=64",
    "--config.max_query_length=16",
    "--config.doc_stride=32",
    "--config.global_batch_size=16",
    "--config.eval_batch_size=32",
    "--config.learning_rate=2e-3",
    "--config.vocab_size=1000",
    "--config.model.dtype=float32",
    "--config.model.scan_layers=False",
    "--config.log_every_steps=20",
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune-data")
    return {
        "squad_train": generate.write_squad(root / "train.json", 400, 0),
        "squad_dev": generate.write_squad(root / "dev.json", 80, 1),
        "squad2_train": generate.write_squad(root / "train2.json", 400, 2, version_2=True),
        "squad2_dev": generate.write_squad(root / "dev2.json", 90, 3, version_2=True),
        "sst2_train": generate.write_sst2(root / "train.tsv", 400, 0),
        "sst2_dev": generate.write_sst2(root / "dev.tsv", 100, 1),
    }


def finetune(config: str, workdir, train, dev, *flags) -> list[str]:
    return [
        sys.executable, "-m", "lambjax.finetune", f"--config={config}", f"--workdir={workdir}",
        f"--config.data.train={train}", f"--config.data.eval={dev}", *SMALL, *flags,
    ]  # fmt: skip


def read(workdir, name):
    return json.loads(epath.Path(workdir, name).read_text())


def test_squad_v1_learns_then_v2_from_its_transformers_export(tmp_path, data):
    v1 = tmp_path / "v1"
    helpers.run(
        finetune("configs/finetune/squad.py", v1, data["squad_train"], data["squad_dev"],
                 "--config.num_steps=100"),
        devices=2,
    )  # fmt: skip
    results = read(v1, "results.json")
    predictions = read(v1, "predictions.json")
    with open(data["squad_dev"], encoding="utf-8") as f:
        dev = json.load(f)["data"]
    questions = squad_metrics.questions(dev)
    assert set(predictions) == {qa["id"] for qa in questions}  # every question scored
    # Trivial baseline: the most frequent answer, for every question.
    golds = collections.Counter(qa["answers"][0]["text"] for qa in questions)
    majority = dict.fromkeys(predictions, golds.most_common(1)[0][0])
    baseline = squad_metrics.evaluate_v1(dev, majority)["f1"]
    assert results["task"] == "squad_v1.1" and results["step"] == 100
    assert results["eval"]["f1"] > 80 > baseline + 50, (results, baseline)
    # The scorer command reads the run's predictions the same way.
    scored = helpers.run(
        [sys.executable, "-m", "lambjax.finetune.squad_eval", data["squad_dev"],
         str(v1 / "predictions.json")], devices=1
    )  # fmt: skip
    assert json.loads(scored.stdout) == pytest.approx(results["eval"])
    logged = read_jsonl(str(v1 / "metrics.jsonl"))
    assert logged[100]["eval/f1"] == pytest.approx(results["eval"]["f1"])
    assert logged[20]["train/loss"] > logged[100]["train/loss"]
    assert read(v1 / "transformers", "config.json")["architectures"] == ["BertForQuestionAnswering"]

    # v2.0 from the v1.1 model's transformers directory (encoder kept, span head new).
    v2 = tmp_path / "v2"
    run = helpers.run(
        finetune("configs/finetune/squad.py:v2", v2, data["squad2_train"], data["squad2_dev"],
                 f"--config.init=hf:{v1 / 'transformers'}", "--config.num_steps=60"),
        devices=1,
    )  # fmt: skip
    assert "from transformers checkpoint" in run.stderr
    results = read(v2, "results.json")["eval"]
    null_odds = read(v2, "null_odds.json")
    assert set(null_odds) == set(read(v2, "predictions.json"))
    # Trivial baseline: "" for every question scores the NoAns third.
    assert results["NoAns_total"] == 30 and results["HasAns_total"] == 60
    assert results["f1"] > 80 and results["best_f1"] >= results["f1"] - 1e-9, results


def test_sst2_learns_and_a_killed_run_resumes(tmp_path, data):
    workdir = tmp_path / "sst2"
    command = finetune("configs/finetune/glue.py:sst2", workdir, data["sst2_train"],
                       data["sst2_dev"], "--config.num_steps=120",
                       "--config.checkpoint_every_steps=20")  # fmt: skip
    process = subprocess.Popen(
        command, cwd=helpers.REPO, env=helpers.environment(2), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        helpers.wait_for_checkpoint(str(workdir), "finetune", 20, process)
        process.send_signal(signal.SIGKILL)
        process.wait()
    finally:
        process.kill()
    assert process.returncode == -signal.SIGKILL and not (workdir / "results.json").exists()
    rerun = helpers.run(command, devices=2)
    assert "Resuming from the checkpoint at step" in rerun.stderr
    results = read(workdir, "results.json")
    assert results["step"] == 120 and results["eval"]["accuracy"] > 0.9
    with open(workdir / "predictions.tsv", encoding="utf-8") as f:
        rows = f.read().splitlines()
    with open(data["sst2_dev"], encoding="utf-8") as f:
        labels = [int(line.split("\t")[1]) for line in f.read().splitlines()[1:]]
    assert rows[0] == "index\tprediction" and len(rows) == len(labels) + 1 == 101
    predicted = [int(row.split("\t")[1]) for row in rows[1:]]
    assert glue_metrics.accuracy(predicted, labels) == pytest.approx(results["eval"]["accuracy"])
    majority = max(np.mean(labels), 1 - np.mean(labels))
    assert results["eval"]["accuracy"] > majority + 0.3
    assert max(read_jsonl(str(workdir / "metrics.jsonl"))) == 120


def pretraining_workdir(root, vocab_file: str) -> str:
    """A pretraining run's layout, written by its own checkpoint class: phase1 finished
    (step 4 of 4), phase2 stopped early (step 1 of 3) with other parameters."""
    config = train_config.base_config()
    train_config.with_phases(
        config,
        **{name: train_config.phase_config(max_seq_length=64, max_predictions_per_seq=4,
                                           global_batch_size=8, num_steps=steps,
                                           learning_rate=1e-3)
           for name, steps in (("phase1", 4), ("phase2", 3))},
    )  # fmt: skip
    vocab_size = len(epath.Path(vocab_file).read_text().splitlines())
    model = BertConfig.preset("tiny", vocab_size=vocab_size, dtype="float32")
    init = jax.jit(init_params, static_argnums=0)
    for phase, step, seed in (("phase1", 4, 0), ("phase2", 1, 1)):
        state = TrainState.create(init(model, jax.random.key(seed)), optax.sgd(0.1))
        meta = {
            "config": config.to_json_best_effort(),
            "model_config": dataclasses.asdict(model),
            "phase": phase,
            "vocab_file": vocab_file,
        }
        ckpt = checkpointing.PhaseCheckpoints(str(root), phase, max_to_keep=2, async_save=False)
        ckpt.save(step, state, {}, meta)
        ckpt.close()
    return str(root)


def test_from_a_pretraining_workdir_and_bad_input(tmp_path, data):
    vocab = tmp_path / "vocab.txt"
    words = sorted({w.lower() for w in generate.corpus_words()})[:900]
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    pretrained = pretraining_workdir(tmp_path / "pretrain", str(vocab))
    workdir = tmp_path / "from-workdir"
    relative = os.path.relpath(pretrained, helpers.REPO)  # as users type it
    run = helpers.run(
        finetune("configs/finetune/glue.py:sst2", workdir, data["sst2_train"], data["sst2_dev"],
                 f"--config.init=workdir:{relative}", "--config.num_steps=2",
                 "--config.lower_case=False", "--config.export_transformers=False"),
        devices=1,
    )  # fmt: skip
    # The last *finished* phase, and the case mismatch reported.
    assert read(workdir, "results.json")["init"] == f"phase phase1 (step 4) of {pretrained}"
    assert "lower_case=False but the checkpoint was trained with lower_case=True" in run.stderr
    assert "is uncased (it has no upper-case tokens)" in run.stderr

    # Bad input ends in one line and exit status 2 (the readers' messages for missing and
    # malformed files are in test_features.py).
    for config, train, expected in (
        ("glue.py:sst", data["sst2_train"], "config.task='sst'; valid: squad_v1.1 squad_v2.0 cola"),
        ("glue.py:sst2", tmp_path / "missing.tsv", "missing.tsv': no such file"),
    ):
        result = helpers.run(
            finetune(f"configs/finetune/{config}", tmp_path / "bad", train, data["sst2_dev"]),
            devices=1, check=False,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr[-2000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("lambjax.finetune: error: ") and expected in last, last


def test_every_path_in_a_bucket(tmp_path, data, gcs_bucket):
    """The pretraining workdir, its vocabulary, the data files and the fine-tuning workdir
    (results and transformers export) all on gs:// (a local GCS emulator)."""
    from lambjax import storage

    root = epath.Path(f"{gcs_bucket}/finetune")
    words = sorted({w.lower() for w in generate.corpus_words()})[:900]
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    pretrained = pretraining_workdir(root / "pretrain", os.fspath(vocab))
    for name in ("sst2_train", "sst2_dev"):
        (root / name).write_bytes(epath.Path(data[name]).read_bytes())
    workdir = root / "run"
    helpers.run(
        finetune("configs/finetune/glue.py:sst2", workdir, root / "sst2_train", root / "sst2_dev",
                 f"--config.init=workdir:{pretrained}", "--config.num_steps=2"),
        devices=1,
    )  # fmt: skip
    assert read(workdir, "results.json")["init"] == f"phase phase1 (step 4) of {pretrained}"
    exported = storage.local_copy(os.fspath(workdir / "transformers"), str(tmp_path))
    assert {"config.json", "model.safetensors", "vocab.txt"} <= set(os.listdir(exported))
