"""Checkpoint save and restore of a BERT-large train state, to a bucket and to local disk.

  python benchmarks/checkpoint_storage.py [--model large|base] [--steps 4]

The bucket is a local GCS emulator (fake-gcs-server, tests/gcs_emulator.py) reached over
HTTP exactly as a Cloud TPU VM reaches GCS (gcsfs for folders, tensorstore for arrays);
local disk is a temporary folder. For each optimizer (LAMB, LANS) and each target, with the
checkpointing the trainer uses (`lambjax.train.checkpointing.PhaseCheckpoints`, async save):

  step       seconds per optimizer step (update + apply, jitted, state donated) with no save;
  blocking   how long `save` holds the training loop (the device-to-host copy);
  overlap    seconds per step for the steps run while the save is written in the background;
  written    seconds from `save` until the checkpoint is complete (committed);
  restore    seconds to restore the latest checkpoint onto the abstract state.

Async saving does not serialise the run when `blocking` is small against `written` and the
steps keep going meanwhile. On this 2-core VM the background write competes with the steps
for the same cores (the emulator, too, runs here), so `overlap` > `step` measures that
contention, not GCS.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import optax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]

from optimizer_step import bert_shaped_params, random_like  # noqa: E402

from lambjax import optim  # noqa: E402
from tests.gcs_emulator import Emulator  # noqa: E402


def optimizers():
    mask, stacked = optim.bert_weight_decay_mask, optim.stacked_layers_mask
    return {
        "lamb": optim.lamb(1e-3, weight_decay=0.01, weight_decay_mask=mask, stacked_layers=stacked),
        "lans": optim.lans(1e-3, weight_decay=0.01, weight_decay_mask=mask, stacked_layers=stacked),
    }


def measure(tx, params, grads, directory: str, steps: int) -> dict:
    from lambjax.train import checkpointing

    def update(state, grads):
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    step = jax.jit(update, donate_argnums=(0,))
    state = {"params": jax.tree.map(jnp.copy, params), "opt_state": tx.init(params)}
    state = jax.block_until_ready(step(state, grads))  # compiled and warm

    def run_steps(state):
        started = time.perf_counter()
        for _ in range(steps):
            state = step(state, grads)
        jax.block_until_ready(state)
        return state, (time.perf_counter() - started) / steps

    state, plain = run_steps(state)
    ckpt = checkpointing.PhaseCheckpoints(directory, "phase1", max_to_keep=2, async_save=True)
    started = time.perf_counter()
    ckpt.save(1, state, {"position": 0}, {"note": "benchmark"})
    blocking = time.perf_counter() - started
    state, overlapped = run_steps(state)
    ckpt._manager.wait_until_finished()
    written = time.perf_counter() - started
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    del state
    started = time.perf_counter()
    restored = ckpt.restore_latest(abstract)
    jax.block_until_ready(restored.state)
    restore = time.perf_counter() - started
    ckpt.close()
    size = sum(x.nbytes for x in jax.tree.leaves(restored.state))
    return dict(
        step=plain,
        blocking=blocking,
        overlap=overlapped,
        written=written,
        restore=restore,
        gb=size / 1e9,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="large", choices=["large", "base"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--optimizer", default="all", choices=["all", *optimizers()])
    args = parser.parse_args()
    if args.optimizer == "all":  # one process each: two BERT-large states at once need >24 GB
        print(f"BERT-{args.model}, {jax.device_count()} {jax.devices()[0].platform} device(s)")
        print(
            f"{'optimizer':10} {'target':6} {'state GB':>8} {'step s':>7} {'blocking s':>10} "
            f"{'overlap s/step':>14} {'written s':>9} {'restore s':>9}",
            flush=True,
        )
        for name in optimizers():
            command = [
                sys.executable,
                __file__,
                f"--model={args.model}",
                f"--steps={args.steps}",
                f"--optimizer={name}",
            ]
            subprocess.run(command, check=True)
        return
    scratch = tempfile.mkdtemp(prefix="lambjax-ckpt-bench-")
    emulator = Emulator(scratch)
    emulator.use()
    bucket = emulator.create_bucket("bench")
    params = bert_shaped_params(args.model)
    grads = random_like(params, 1)
    tx = optimizers()[args.optimizer]
    try:
        for target, directory in (
            ("local", os.path.join(scratch, "local")),
            ("bucket", f"{bucket}/{args.optimizer}"),
        ):
            r = measure(tx, params, grads, directory, args.steps)
            print(
                f"{args.optimizer:10} {target:6} {r['gb']:8.2f} {r['step']:7.2f} "
                f"{r['blocking']:10.2f} {r['overlap']:14.2f} {r['written']:9.2f} "
                f"{r['restore']:9.2f}",
                flush=True,
            )
    finally:
        emulator.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
