"""Checkpoints under faults, through lambjax.train.checkpointing's public API on small states:
flipped bytes in an array's stored values (the digests recorded at the save catch them: the
restore falls back, the export and fine-tuning refuse the checkpoint), a checkpoint of an
earlier lambjax without digests, and a save that fails (a full disk: injected where Orbax
writes, and on a small tmpfs where the tests run as root). End-to-end runs:
tests/train/test_runs.py."""

import errno
import json
import logging
import os
import subprocess
import uuid

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lambjax.train import checkpointing, integrity
from tests.helpers import flip_bytes_in_largest_array


def mesh(devices: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:devices]), ("data",))


def state(seed: int, devices: int = 4, rows: int = 256) -> dict:
    """A small train-state-like tree: a sharded matrix, a replicated vector, a step count."""
    rng = np.random.default_rng(seed)
    sharded = NamedSharding(mesh(devices), P("data"))
    replicated = NamedSharding(mesh(devices), P())
    return {
        "params": {
            "w": jax.device_put(rng.standard_normal((rows, 128)).astype(np.float32), sharded),
            "b": jax.device_put(rng.standard_normal(128).astype(np.float32), replicated),
        },
        "step": jax.device_put(np.int32(seed), replicated),
    }


def abstract(tree) -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


META = {
    "phase": "phase1",
    "config": json.dumps({"phase_order": ["phase1"], "phases": {"phase1": {"num_steps": 2}}}),
    "model_config": {},
}


def save_two(workdir: str, async_save: bool = True) -> dict:
    """Checkpoints 1 and 2 of phase1 in `workdir`; {step: the state saved}."""
    saved = {step: state(step) for step in (1, 2)}
    ckpt = checkpointing.PhaseCheckpoints(workdir, "phase1", max_to_keep=5, async_save=async_save)
    for step, tree in saved.items():
        ckpt.save(step, tree, {"position": step}, META)
    ckpt.close()
    return saved


def flip_bytes(workdir: str, step: int) -> None:
    """Inverts bytes of the largest array of checkpoint `step`'s state, which still decodes."""
    flip_bytes_in_largest_array(os.path.join(workdir, "checkpoints", "phase1", str(step), "state"))


def lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# ----------------------------------------------------------------------------------------
# Digests


def test_a_digest_is_the_same_on_any_mesh_and_changes_with_any_element():
    tree = state(0, devices=4)
    expected = integrity.digests(tree)
    assert integrity.digests(jax.device_get(tree)) == expected  # numpy on the host
    assert integrity.digests(jax.device_put(tree, NamedSharding(mesh(2), P()))) == expected
    changed = np.asarray(tree["params"]["w"]).copy()
    changed[17, 3] = np.nextafter(changed[17, 3], np.inf)  # one bit of one element
    assert integrity.differing(expected, {**tree, "params": {**tree["params"], "w": changed}}) == [
        "params/w"
    ]
    swapped = np.asarray(tree["params"]["w"])[::-1]  # the same values, other positions
    assert integrity.differing(expected, {**tree, "params": {**tree["params"], "w": swapped}})
    other_types = {
        "half": np.ones(3, jax.numpy.bfloat16),
        "flag": np.array([True, False]),
        "key": jax.random.key(0),
        "byte": np.arange(4, dtype=np.int8),
    }
    assert set(integrity.digests(other_types)) == {"half", "flag", "key", "byte"}


# ----------------------------------------------------------------------------------------
# Flipped bytes


def test_flipped_bytes_fall_back_to_the_checkpoint_before(tmp_path, caplog):
    workdir = str(tmp_path)
    saved = save_two(workdir)
    flip_bytes(workdir, 2)
    ckpt = checkpointing.PhaseCheckpoints(workdir, "phase1", max_to_keep=5, async_save=True)
    with caplog.at_level(logging.INFO):
        restored = ckpt.restore_latest(abstract(state(0, devices=2)))  # onto another mesh
    ckpt.close()
    assert restored.step == 1
    np.testing.assert_array_equal(restored.state["params"]["w"], saved[1]["params"]["w"])
    (line,) = lines(caplog, "cannot be restored")
    assert "IntegrityError: params/w differs from what was saved" in line
    assert os.path.isdir(tmp_path / "checkpoints" / "phase1.unreadable" / "2")  # kept aside


def test_export_and_fine_tuning_refuse_a_checkpoint_whose_arrays_changed(tmp_path, caplog):
    from lambjax.finetune import init
    from lambjax.finetune.errors import FinetuneError

    workdir = str(tmp_path)
    saved = save_two(workdir)
    flip_bytes(workdir, 2)
    with caplog.at_level(logging.WARNING):
        meta, params = checkpointing.latest_params(workdir)  # what lambjax.export reads
    assert meta["step"] == 1
    np.testing.assert_array_equal(params["w"], saved[1]["params"]["w"])
    (line,) = lines(caplog, "skipping unreadable checkpoint")
    assert "phase1/2" in line and "params/w differs from what was saved" in line
    # Fine-tuning starts from the phase's final checkpoint (step 2) or not at all.
    with pytest.raises(FinetuneError) as refused:
        init.load(f"workdir:{workdir}")
    message = str(refused.value)
    assert "\n" not in message
    assert f"{tmp_path}/checkpoints/phase1/2 cannot be used (IntegrityError: " in message
    assert "rerun the pretraining command" in message
    flip_bytes(workdir, 1)
    with pytest.raises(FileNotFoundError, match="no readable checkpoint"):
        checkpointing.latest_params(workdir)


def test_a_checkpoint_saved_without_digests_restores_with_a_line(tmp_path, caplog):
    workdir = str(tmp_path)
    saved = save_two(workdir)
    meta_file = tmp_path / "checkpoints" / "phase1" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta[integrity.DIGESTS]  # as lambjax wrote checkpoints before digests
    meta_file.write_text(json.dumps(meta))
    ckpt = checkpointing.PhaseCheckpoints(workdir, "phase1", max_to_keep=5, async_save=True)
    with caplog.at_level(logging.INFO):
        restored = ckpt.restore_latest(abstract(saved[2]))
    ckpt.close()
    assert restored.step == 2
    (line,) = lines(caplog, "records no digests")
    assert "restored without an integrity check" in line


# ----------------------------------------------------------------------------------------
# Failed saves


class FailedWrite:
    """A write of Orbax's background save that ends as a full disk does."""

    def result(self, timeout=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_save_that_fails_ends_in_one_line_and_keeps_the_checkpoint_before(
    tmp_path, monkeypatch, caplog
):
    """The fault is injected where Orbax writes a state's arrays (its handler's writes fail
    in the background, as tensorstore's do on a full disk), so it runs anywhere."""
    workdir = str(tmp_path)
    saved = save_two(workdir)
    original = ocp.StandardCheckpointHandler.async_save

    async def fails_in_the_background(self, *args, **kwargs):
        writes = await original(self, *args, **kwargs)  # the writes start, as in a save
        return [*(writes or []), FailedWrite()]  # and the last of them fails

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", fails_in_the_background)
    ckpt = checkpointing.PhaseCheckpoints(workdir, "phase1", max_to_keep=5, async_save=True)
    with pytest.raises(checkpointing.SaveFailed) as failed:
        ckpt.save(3, state(3), {"position": 3}, META)
        ckpt.close()
    monkeypatch.undo()
    phase_dir = tmp_path / "checkpoints" / "phase1"
    assert str(failed.value) == (
        f"a checkpoint could not be written to {phase_dir} (no space left on device); "
        f"{_free_space(phase_dir)}. Make room there (or fix the bucket's access) and rerun the "
        f"same command: it continues from the last complete checkpoint, {phase_dir}/2"
    )
    assert checkpointing.SAVE_FAILED_STATUS not in (0, 1, 2)
    unfinished = [name for name in os.listdir(phase_dir) if ".orbax-checkpoint-tmp" in name]
    assert unfinished  # what the failed save left
    with caplog.at_level(logging.INFO):
        ckpt = checkpointing.PhaseCheckpoints(workdir, "phase1", max_to_keep=5, async_save=True)
        restored = ckpt.restore_latest(abstract(saved[2]))
    ckpt.close()
    assert [line.split(",")[0] for line in lines(caplog, "unfinished save")] == [
        f"Removing {phase_dir / name}" for name in unfinished
    ]
    assert sorted(os.listdir(phase_dir)) == ["1", "2"]
    assert restored.step == 2
    np.testing.assert_array_equal(restored.state["params"]["w"], saved[2]["params"]["w"])


def _free_space(path) -> str:
    from lambjax import storage

    return storage.free_space(path)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 3 MB tmpfs in tmp_path (as root; skipped where mounting is not permitted)."""
    mount_point = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_tmpfs_ends_the_save_in_one_line(small_tmpfs):
    """Each checkpoint of this state takes ~1 MB of the 3 MB: the third or fourth fails."""
    workdir = str(small_tmpfs / "run")
    ckpt = checkpointing.PhaseCheckpoints(workdir, "phase1", max_to_keep=10, async_save=True)
    with pytest.raises(checkpointing.SaveFailed) as failed:
        for step in range(1, 7):
            ckpt.save(step, state(step, rows=2048), {"position": step}, META)
        ckpt.close()
    phase_dir = small_tmpfs / "run" / "checkpoints" / "phase1"
    complete = sorted(int(name) for name in os.listdir(phase_dir) if name.isdigit())
    assert len(complete) >= 2
    message = str(failed.value)
    assert message.startswith(
        f"a checkpoint could not be written to {phase_dir} (no space left on device); "
    )
    assert " free on " in message and message.endswith(f"checkpoint, {phase_dir}/{complete[-1]}")
    ckpt = checkpointing.PhaseCheckpoints(workdir, "phase1", max_to_keep=10, async_save=True)
    restored = ckpt.restore_latest(abstract(state(0, rows=2048)))
    ckpt.close()
    assert restored.step == complete[-1]  # intact: what the rerun continues from
    np.testing.assert_array_equal(
        restored.state["params"]["w"], state(complete[-1], rows=2048)["params"]["w"]
    )
    assert sorted(os.listdir(phase_dir)) == [str(step) for step in complete]
