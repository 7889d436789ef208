"""Runs whose workdir and data_dir are gs:// URLs, against a local GCS emulator
(tests/gcs_emulator.py): both phases' checkpoints, TensorBoard events and metrics.jsonl land
in the bucket; a kill -9 and a rerun give bitwise the losses of an uninterrupted run; a
corrupt checkpoint is moved aside in the bucket; the export reads from and writes to the
bucket; bad storage ends the start with one line. (A 2-process pod's checkpoint in the bucket,
restored by one process: tests/launch/test_local_pod.py.)"""

import os
import signal
import subprocess
import sys

import pytest
from etils import epath

from tests import helpers
from tests.helpers import PHASE1_STEPS, PHASE2_STEPS, demo_command, losses, run_demo

DEVICES = 4


def files(url: str) -> set[str]:
    """Every object under `url`, relative to it."""
    from lambjax import storage

    root = epath.Path(url)
    return {os.fspath(p.relative_to(root)) for p in storage.files_under(root)}


@pytest.fixture(scope="module")
def gcs_data_dir(gcs_bucket):
    return f"{gcs_bucket}/datasets"


@pytest.fixture(scope="module")
def reference(gcs_bucket, gcs_data_dir):
    workdir = f"{gcs_bucket}/reference"
    run_demo(workdir, gcs_data_dir, DEVICES)
    return workdir


@pytest.mark.slow
def test_two_phases_write_everything_to_the_bucket(reference, gcs_data_dir):
    built = files(gcs_data_dir)  # the vocabulary and both phases' datasets, read from there
    assert any(name.endswith("vocab.txt") for name in built)
    assert sum(name.endswith("dataset_info.json") for name in built) == 2
    assert any("array_record" in name for name in built)
    stored = files(reference)
    for phase, last in (("phase1", PHASE1_STEPS), ("phase2", PHASE2_STEPS)):
        assert f"checkpoints/{phase}/{last}/commit_success.txt" in stored
    assert "config.json" in stored
    assert any(name.startswith("events.out.tfevents") for name in stored)
    logged = losses(reference)
    assert sorted(logged) == list(range(1, PHASE1_STEPS + PHASE2_STEPS + 1))
    assert logged[PHASE1_STEPS] < logged[1]
    assert not os.path.exists(os.path.join(helpers.REPO, "gs:"))  # nothing went to local disk


@pytest.mark.slow
def test_kill_and_rerun_gives_bitwise_the_same_losses(reference, gcs_bucket, gcs_data_dir):
    workdir = f"{gcs_bucket}/killed"
    process = subprocess.Popen(
        demo_command(workdir, gcs_data_dir),
        cwd=helpers.REPO,
        env=helpers.environment(DEVICES),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    marker = epath.Path(workdir) / "checkpoints" / "phase1" / "8" / "commit_success.txt"
    helpers.wait_until(marker.exists, process, timeout=300)
    process.send_signal(signal.SIGKILL)
    process.wait()
    run_demo(workdir, gcs_data_dir, DEVICES)
    assert losses(workdir) == losses(reference)


@pytest.mark.slow
def test_corrupt_latest_checkpoint_is_moved_aside_in_the_bucket(
    reference, gcs_bucket, gcs_data_dir
):
    from lambjax import storage

    workdir = epath.Path(f"{gcs_bucket}/corrupt")
    storage.copy_tree(reference, workdir)
    (workdir / "checkpoints" / "phase2").rmtree()
    (workdir / "metrics.jsonl").unlink()
    state = workdir / "checkpoints" / "phase1" / str(PHASE1_STEPS) / "state"
    for path in storage.files_under(state):
        if "metadata" not in path.name and not path.name.endswith(".json"):
            path.write_bytes(b"")  # every data file of the final train state truncated
    result = run_demo(os.fspath(workdir), gcs_data_dir, DEVICES)
    assert "cannot be restored" in result.stderr
    kept = files(os.fspath(workdir / "checkpoints" / "phase1.unreadable"))
    assert any(name.startswith(f"{PHASE1_STEPS}/state/") for name in kept)  # kept, not deleted
    logged = losses(os.fspath(workdir))
    assert min(logged) == 9  # resumed after the step-8 checkpoint
    expected = losses(reference)
    assert logged == {step: expected[step] for step in logged}


@pytest.mark.slow
def test_export_from_the_bucket_to_the_bucket(reference, gcs_bucket, tmp_path):
    """(A 2-process pod writing a checkpoint into the bucket that 1 process restores is in
    tests/launch/test_local_pod.py.)"""
    import numpy as np
    import transformers

    from lambjax import storage
    from lambjax.train import checkpointing

    out = f"{gcs_bucket}/reference-export"
    export = [sys.executable, "-m", "lambjax.export", f"--workdir={reference}", f"--out={out}"]
    result = helpers.run(export, 1)
    assert "with its tokenizer" in result.stdout
    assert {"config.json", "model.safetensors", "vocab.txt", "tokenizer.json"} <= files(out)
    exported = storage.local_copy(out, str(tmp_path))
    model = transformers.BertForPreTraining.from_pretrained(exported)
    _, params = checkpointing.latest_params(reference)
    embedding = model.bert.embeddings.word_embeddings.weight.detach().numpy()
    np.testing.assert_array_equal(embedding, np.asarray(params["embeddings"]["word"]["embedding"]))


@pytest.mark.slow
def test_bad_storage_ends_the_start_with_one_line(gcs_bucket, tmp_path):
    local_data = str(tmp_path / "data")
    missing = run_demo("gs://no-such-bucket/run", local_data, 1, check=False)
    assert missing.returncode == 2
    assert missing.stderr.splitlines()[-1] == (
        "lambjax: error: --workdir=gs://no-such-bucket/run: bucket 'no-such-bucket' does not "
        "exist (or is not visible)"
    )
    from configs import default
    from lambjax import data, storage

    config = default.get_config("runlocal")
    config.data.data_dir = "gs://no-data-bucket/d"
    ((flag, path),) = [p for p in data.paths(config.data) if p[1].startswith("gs://")]
    with pytest.raises(storage.StorageError, match="^--config.data.data_dir=gs://no-data-bucket"):
        storage.check_reachable(path, flag)

    env = helpers.environment(1)  # no emulator, no credentials anywhere Google's libraries look
    for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        env.pop(name, None)
    env.update(CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), NO_GCE_CHECK="True")
    command = demo_command(f"{gcs_bucket}/run", local_data)
    result = subprocess.run(command, cwd=helpers.REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 2
    last = result.stderr.splitlines()[-1]
    assert last.startswith(
        f"lambjax: error: --workdir={gcs_bucket}/run: no Google Cloud credentials"
    )
    assert not os.path.exists(local_data)  # ended before any data build
