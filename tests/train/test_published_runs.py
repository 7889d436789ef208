"""Domain-adaptive pretraining end to end: a run exported to transformers, continued on
another text (`--config.init=hf:DIR`), tracked in W&B (offline) and MLflow (a local file
store), exported again.

The continued run's first held-out MLM loss is the exported model's on the new text,
computed by transformers (PyTorch) on the same held-out batches, not a fresh model's.
"""

import glob
import inspect
import json
import os
import struct
import subprocess
import sys
from unittest import mock

import ml_collections
import numpy as np
import pytest
import torch
import transformers

from lambjax import data as data_lib
from lambjax.train import trainer
from lambjax.train.metrics import read_jsonl
from tests.helpers import REPO, environment, lambjax_main, run

pytestmark = pytest.mark.slow

EVAL_STEPS, EVAL_BATCH = 2, 16


def other_text(path) -> str:
    """Another English corpus than the demo's: the docstrings of a few standard modules, one
    document each."""
    import argparse
    import collections
    import email
    import logging
    import pathlib
    import subprocess
    import typing
    import unittest

    documents = []
    for module in (argparse, collections, email, logging, pathlib, subprocess, typing, unittest):
        for _, member in inspect.getmembers(module):
            doc = inspect.getdoc(member)
            if doc and len(doc) > 200:
                documents.append("\n".join(line for line in doc.splitlines() if line.strip()))
    path.write_text("\n\n".join(dict.fromkeys(documents)))
    return str(path)


def phase1_only(*overrides) -> list[str]:
    return ["--config=configs/default.py:runlocal", "--config.phase_order=('phase1',)", *overrides]


def held_out_mlm_loss(model, workdir: str) -> float:
    """The MLM loss of a transformers model over the run's held-out batches, as the run
    evaluates them (the same masked positions, weights and batches)."""
    config = ml_collections.ConfigDict(json.load(open(os.path.join(workdir, "config.json"))))
    prepared = data_lib.prepare(config.data, 128, build=False)
    batches = data_lib.make_iterator(
        prepared,
        split="validation",
        global_batch_size=EVAL_BATCH,
        max_predictions_per_seq=config.phases.phase1.max_predictions_per_seq,
        seed=trainer.HELD_OUT_SEED,
        num_epochs=1,
        pad_last_batch=True,  # every held-out example, as the run scores them
    )
    total, weight = 0.0, 0.0
    for index, batch in enumerate(batches):
        if index == EVAL_STEPS:
            break
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor(np.asarray(batch["input_ids"], np.int64)),
                token_type_ids=torch.tensor(np.asarray(batch["segment_ids"], np.int64)),
                attention_mask=torch.tensor(np.asarray(batch["input_mask"], np.int64)),
            ).prediction_logits.double()
        positions = torch.tensor(np.asarray(batch["masked_lm_positions"], np.int64))
        picked = torch.take_along_dim(logits, positions[..., None], dim=1)
        nll = -torch.log_softmax(picked, -1).gather(
            -1, torch.tensor(np.asarray(batch["masked_lm_ids"], np.int64))[..., None]
        )[..., 0]
        weights = torch.tensor(np.asarray(batch["masked_lm_weights"], np.float64))
        total += float((nll * weights).sum())
        weight += float(weights.sum())
    return total / weight


def wandb_history(wandb_dir: str) -> list[dict]:
    """The history rows of the offline W&B run in `wandb_dir`, read from its .wandb file
    (a LevelDB-style log of protobuf records: 32 KiB blocks of [crc, length, type] chunks)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    content, block, position, records, pending = open(path, "rb").read(), 32768, 7, [], b""
    while position + 7 <= len(content):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", content[position : position + 7])
        if left < 7 or (kind == 0 and length == 0):
            position += left
            continue
        chunk = content[position + 7 : position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    rows, run = [], None
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = record.history.item  # a name with "/" is stored as its nested_key
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
        elif kind == "run":
            run = record.run
    return run, rows


def mlflow_metric(store: str, name: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    with mock.patch.dict(os.environ, {"MLFLOW_ALLOW_FILE_STORE": "true"}):  # MLflow 3 asks
        client = MlflowClient(tracking_uri=f"file:{store}")
        (run,) = client.search_runs([client.get_experiment_by_name("lambjax").experiment_id])
        return run, {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}


def test_continued_pretraining_starts_from_the_exported_model(tmp_path):
    source, export = str(tmp_path / "source"), str(tmp_path / "export")
    run(lambjax_main(*phase1_only(f"--workdir={source}", "--config.phases.phase1.num_steps=12")), 1)
    run(export_command(source, export), 1)

    continued = str(tmp_path / "continued")
    tracking_env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path / "wandb"),
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}",
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }
    os.makedirs(tracking_env["WANDB_DIR"])
    command = lambjax_main(
        *phase1_only(
            f"--workdir={continued}",
            f"--config.init=hf:{export}",
            f"--config.data.source=text:{other_text(tmp_path / 'other.txt')}",
            "--config.phases.phase1.num_steps=1",
            "--config.eval_at_start=true",  # the first evaluation: the start, at step 0
            f"--config.eval_steps={EVAL_STEPS}",
            f"--config.eval_batch_size={EVAL_BATCH}",
            "--config.tracking.backends=wandb,mlflow",
        )
    )
    result = run_with_env(command, tracking_env)
    assert "starting from transformers checkpoint" in result.stderr
    assert "MLM and NSP heads from it" in result.stderr

    records = read_jsonl(os.path.join(continued, "metrics.jsonl"))
    evaluations = [records[step] for step in sorted(records) if "eval/mlm_loss" in records[step]]
    assert [r["step"] for r in evaluations] == [0, 1]
    first = evaluations[0]["eval/mlm_loss"]
    exported = transformers.BertForPreTraining.from_pretrained(export).eval()
    expected = held_out_mlm_loss(exported, continued)
    torch.manual_seed(0)
    fresh = transformers.BertForPreTraining(exported.config).eval()
    assert first == pytest.approx(expected, abs=2e-4)
    assert held_out_mlm_loss(fresh, continued) - expected > 0.05, "no better than a fresh model"

    saved = json.load(open(os.path.join(continued, "config.json")))
    assert saved["init"] == f"hf:{export}"
    assert saved["data"]["vocab"] == os.path.join(export, "vocab.txt")

    run_record, rows = wandb_history(tracking_env["WANDB_DIR"])
    assert run_record.display_name == "continued"
    last = evaluations[1]["eval/mlm_loss"]
    assert [row["eval/mlm_loss"] for row in rows if "eval/mlm_loss" in row] == [
        pytest.approx(first),
        pytest.approx(last),
    ]
    mlflow_run, history = mlflow_metric(str(tmp_path / "mlruns"), "eval/mlm_loss")
    assert history == {0: pytest.approx(first), 1: pytest.approx(last)}
    assert mlflow_run.data.params["init"] == json.dumps(f"hf:{export}")

    again = str(tmp_path / "again")
    run(export_command(continued, again), 1)
    assert transformers.BertForPreTraining.from_pretrained(again).config.num_hidden_layers == 2


def export_command(workdir: str, out: str) -> list[str]:
    return [sys.executable, "-m", "lambjax.export", f"--workdir={workdir}", f"--out={out}"]


def run_with_env(command, extra_env):
    env = {**environment(1), **extra_env}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return result
