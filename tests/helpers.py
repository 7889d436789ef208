"""What several test modules share: a checkpoint whose values changed, a random pretraining
batch, a FLOP count of traced matmuls, and running lambjax's commands as subprocesses, as a
user starts them."""

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np

from lambjax.train.metrics import read_jsonl

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
COMPILATION_CACHE = os.path.join(REPO, ".pytest_cache", "jax-compilation-cache")


# ----------------------------------------------------------------------------------------
# Checkpoints


def flip_bytes_in_largest_array(state_dir: str, count: int = 64) -> None:
    """Inverts `count` bytes in the middle of the largest array of a checkpoint's state
    (`state_dir`), rewritten in place through tensorstore: the checkpoint still opens and
    decodes, to other numbers, which only the digests recorded at the save can catch. (Bytes
    flipped in a data file itself mostly make zstd's decoding fail: the weights compress.)"""
    import tensorstore as ts

    store = {"driver": "ocdbt", "base": f"file://{state_dir}/"}
    keys = [key.decode() for key in ts.KvStore.open(store).result().list().result()]
    drivers = {".zarray": "zarr", "zarr.json": "zarr3"}
    arrays = [
        ts.open({"driver": drivers[meta], "kvstore": {**store, "path": key[: -len(meta)]}}).result()
        for key in keys
        for meta in drivers
        if key.endswith("/" + meta)
    ]
    array = max(arrays, key=lambda array: array.size)
    values = np.array(array.read().result())
    flat = values.reshape(-1).view(np.uint8)
    middle = flat.size // 2
    flat[middle : middle + count] ^= 0xFF
    array.write(values).result()


# ----------------------------------------------------------------------------------------
# Batches and FLOPs


def random_batch(seed=0, *, batch=8, seq=16, predictions=4, vocab_size=128) -> dict:
    """A pretraining batch of numpy arrays: random tokens, two segments, ~80% of the
    masked positions weighted."""
    rng = np.random.default_rng(seed)
    positions = np.sort(
        np.stack([rng.choice(np.arange(1, seq), predictions, replace=False) for _ in range(batch)]),
        1,
    )
    return {
        "input_ids": rng.integers(5, vocab_size, (batch, seq), dtype=np.int32),
        "input_mask": np.ones((batch, seq), np.int32),
        "segment_ids": (np.arange(seq)[None] >= seq // 2).astype(np.int32).repeat(batch, 0),
        "masked_lm_positions": positions.astype(np.int32),
        "masked_lm_ids": rng.integers(5, vocab_size, (batch, predictions), dtype=np.int32),
        "masked_lm_weights": (rng.random((batch, predictions)) < 0.8).astype(np.float32),
        "next_sentence_labels": rng.integers(0, 2, (batch,), dtype=np.int32),
    }


def dot_flops(jaxpr) -> int:
    """Counts 2 * output size * contracted size over every dot_general, recursively."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2 * int(np.prod(out)) * int(np.prod([lhs[d] for d in contract]))
        for sub in jax.core.jaxprs_in_params(eqn.params):
            inner = dot_flops(sub)
            if eqn.primitive.name == "scan":
                inner *= eqn.params["length"]
            total += inner
    return total


# ----------------------------------------------------------------------------------------
# Commands as subprocesses


def environment(devices: int) -> dict:
    """A CPU process with `devices` fake devices; runs with the same shapes and device count
    reuse each other's compiled steps through the persistent compilation cache."""
    env = dict(os.environ)
    env["JAX_COMPILATION_CACHE_DIR"] = COMPILATION_CACHE
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["TF_ENABLE_ONEDNN_OPTS"] = "0"  # TensorFlow 2.21's import notice (lambjax.main)
    return env


def run(args: list[str], devices: int, *, check=True, timeout=600):
    """Runs `args` in the repository with `devices` fake devices; fails with the end of its
    output if it exits non-zero and `check`."""
    result = subprocess.run(
        args, cwd=REPO, env=environment(devices), capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(args[:4])} ... failed ({result.returncode}):\n"
            f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        )
    return result


def lambjax_main(*flags: str) -> list[str]:
    return [sys.executable, "-m", "lambjax.main", *flags]


# The demo's runlocal variant, shortened: what most end-to-end tests run.
PHASE1_STEPS, PHASE2_STEPS = 12, 6


def demo_command(workdir, data_dir, *overrides, config="configs/default.py:runlocal") -> list[str]:
    return lambjax_main(
        f"--config={config}",
        f"--workdir={workdir}",
        f"--config.data.data_dir={data_dir}",
        f"--config.phases.phase1.num_steps={PHASE1_STEPS}",
        f"--config.phases.phase2.num_steps={PHASE2_STEPS}",
        "--config.checkpoint_every_steps=4",
        "--config.log_every_steps=1",
        *overrides,
    )


def run_demo(workdir, data_dir, devices, *overrides, check=True):
    return run(demo_command(workdir, data_dir, *overrides), devices, check=check)


def losses(workdir: str) -> dict[int, float]:
    """The logged training loss of every step, from the run's metrics.jsonl."""
    records = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    return {step: r["train/loss"] for step, r in sorted(records.items()) if "train/loss" in r}


def tensorboard_scalars(logdir: str, tag: str) -> dict[int, float]:
    """{step: value} of a scalar as TensorBoard shows it (its Python loader, which discards
    the events that a restart orphaned)."""
    from tensorboard.backend.event_processing import plugin_event_accumulator as loader
    from tensorboard.util import tensor_util

    accumulator = loader.EventAccumulator(logdir, tensor_size_guidance={tag: 0})
    accumulator.Reload()
    return {
        event.step: float(tensor_util.make_ndarray(event.tensor_proto))
        for event in accumulator.Tensors(tag)
    }


def logged_steps(workdir: str) -> list[int]:
    """The steps of metrics.jsonl's train rows, in file order (a resumed run's included)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.endswith("\n")]
    return [row["step"] for row in rows if "train/loss" in row]


def wait_for_checkpoint(workdir, phase, step, process, timeout=300):
    path = os.path.join(workdir, "checkpoints", phase, str(step))
    wait_until(lambda: os.path.exists(path), process, timeout, f"no checkpoint {path}")


def wait_until(condition, process, timeout=300, what="condition"):
    """Polls `condition` while `process` runs; fails if it ends first or after `timeout` s."""
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, f"run ended early: {process.stderr.read()[-3000:]}"
        assert time.time() < deadline, f"{what} not met after {timeout}s"
        time.sleep(0.05)


def run_command_cases(folder, cases) -> tuple[list[int], list[str]]:
    """(exit statuses, stderr texts) of `python -m MODULE ARGS` for each case (MODULE, ARGS),
    all in one interpreter (tests/command_cases.py); its files go to `folder`."""
    cases_file, out_dir = folder / "cases.json", folder / "output"
    cases_file.write_text(json.dumps(cases))
    out_dir.mkdir()
    result = subprocess.run(
        [sys.executable, "tests/command_cases.py", str(cases_file), str(out_dir)],
        cwd=REPO,
        env=environment(1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    codes = json.loads(result.stdout.strip().splitlines()[-1])
    return codes, [(out_dir / f"{i}.err").read_text() for i in range(len(cases))]
