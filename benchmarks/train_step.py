"""Tokens/s of a full BERT pretraining step (MLM + NSP forward, backward, LAMB update),
lambjax against Hugging Face's Flax BERT with optax.lamb, measured in one run.

  python benchmarks/train_step.py [--models tiny,base] [--steps 10]

The baseline is `FlaxBertForPreTraining` from transformers 4.57.6 (the last release with
Flax BERT), installed on first use into .venv-hf/ (a --target directory layered over this
environment's jax/flax) and run in a subprocess, twice: with glibc's default malloc (as it
runs out of the box) and with the malloc settings lambjax uses on CPU
(lambjax.host_memory), under which XLA:CPU no longer faults its temporaries in at every
step. lambjax runs as `lambjax.main` runs it on CPU. Both sides use float32, dropout on,
batch shapes as below, and jit with donation; the median step time is reported. lambjax's
tiny model runs its 2 layers unrolled (`scan_layers=False`, as the demo does), base scans
its 12. Achieved FLOP/s (lambjax's exact matmul count) is printed as a fraction of this
machine's measured float32 matmul peak.
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from lambjax import host_memory

SHAPES = {  # model preset, batch, sequence, masked predictions
    "tiny": ("tiny", 32, 128, 20),
    "base": ("base", 8, 128, 20),
}
SCAN_LAYERS = {"tiny": False, "base": True}
VOCAB = 30522
HF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".venv-hf")
HF_PACKAGES = ["transformers==4.57.6", "tokenizers==0.22.1", "huggingface-hub>=0.34,<1.0"]


def random_batch(batch, seq, predictions, seed=0):
    rng = np.random.default_rng(seed)
    positions = np.sort(
        np.stack([rng.choice(np.arange(1, seq), predictions, replace=False) for _ in range(batch)]),
        1,
    )
    return {
        "input_ids": rng.integers(5, VOCAB, (batch, seq)).astype(np.int32),
        "input_mask": np.ones((batch, seq), np.int32),
        "segment_ids": (np.arange(seq)[None] >= seq // 2).repeat(batch, 0).astype(np.int32),
        "masked_lm_positions": positions.astype(np.int32),
        "masked_lm_ids": rng.integers(5, VOCAB, (batch, predictions)).astype(np.int32),
        "masked_lm_weights": np.ones((batch, predictions), np.float32),
        "next_sentence_labels": rng.integers(0, 2, (batch,)).astype(np.int32),
    }


def median_step_seconds(step, state, batch, rng, steps):
    import jax

    for _ in range(2):
        state = step(state, batch, rng)
    jax.block_until_ready(state)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state = step(state, batch, rng)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def lambjax_step_seconds(model, steps):
    import jax
    import optax

    from lambjax.models import bert
    from lambjax.train import step as step_lib
    from lambjax.train.config import optimizer_config
    from lambjax.train.optimizer import make_optimizer

    preset, batch_size, seq, predictions = SHAPES[model]
    config = bert.BertConfig.preset(
        preset, vocab_size=VOCAB, dtype="float32", scan_layers=SCAN_LAYERS[model]
    )
    optimizer = make_optimizer(optimizer_config("lamb"), optax.constant_schedule(1e-3))
    train_step = jax.jit(
        functools.partial(
            step_lib.train_step,
            model_config=config,
            optimizer=optimizer,
            schedule=optax.constant_schedule(1e-3),
            grad_accum_steps=1,
        ),
        donate_argnums=(0,),
    )
    state = jax.jit(lambda k: step_lib.TrainState.create(bert.init_params(config, k), optimizer))(
        jax.random.key(0)
    )
    batch = random_batch(batch_size, seq, predictions)
    seconds = median_step_seconds(
        lambda s, b, r: train_step(s, b, r)[0], state, batch, jax.random.key(1), steps
    )
    return seconds, bert.train_step_flops(config, batch_size, seq, predictions)


def hf_worker(model, steps, memory):
    """Runs in the .venv-hf subprocess: HF Flax BERT + optax.lamb, prints JSON."""
    if memory == "retain":
        host_memory.retain_freed_memory()
    import jax
    import jax.numpy as jnp
    import optax
    from transformers import BertConfig, FlaxBertForPreTraining

    preset, batch_size, seq, predictions = SHAPES[model]
    sizes = {"tiny": (2, 128, 2, 512), "base": (12, 768, 12, 3072)}[preset]
    config = BertConfig(
        vocab_size=VOCAB,
        num_hidden_layers=sizes[0],
        hidden_size=sizes[1],
        num_attention_heads=sizes[2],
        intermediate_size=sizes[3],
    )
    hf_model = FlaxBertForPreTraining(config, seed=0)
    optimizer = optax.lamb(1e-3, weight_decay=0.01)
    batch = random_batch(batch_size, seq, predictions)

    def loss_fn(params, batch, rng):
        out = hf_model(
            batch["input_ids"],
            attention_mask=batch["input_mask"],
            token_type_ids=batch["segment_ids"],
            params=params,
            dropout_rng=rng,
            train=True,
        )
        logits = jnp.take_along_axis(
            out.prediction_logits, batch["masked_lm_positions"][..., None], axis=1
        )
        mlm = optax.softmax_cross_entropy_with_integer_labels(logits, batch["masked_lm_ids"])
        nsp = optax.softmax_cross_entropy_with_integer_labels(
            out.seq_relationship_logits, batch["next_sentence_labels"]
        )
        return jnp.mean(mlm) + jnp.mean(nsp)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(state, batch, rng):
        params, opt_state = state
        grads = jax.grad(loss_fn)(params, batch, rng)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = (hf_model.params, optimizer.init(hf_model.params))
    seconds = median_step_seconds(step, state, batch, jax.random.key(1), steps)
    print(json.dumps({"seconds": seconds}))


def hf_step_seconds(model, steps, memory):
    if not os.path.isdir(os.path.join(HF_DIR, "transformers")):
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", HF_DIR]
            + HF_PACKAGES,
            check=True,
        )
    env = dict(os.environ, PYTHONPATH=HF_DIR, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(
        [sys.executable, __file__, "--hf-worker", model, "--steps", str(steps)]
        + ["--host-memory", memory],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def matmul_peak_flops():
    """float32 matmul FLOP/s of this machine through XLA (the best of a few sizes)."""
    import jax
    import jax.numpy as jnp

    best = 0.0
    for n in (1024, 2048, 3072):
        a = jnp.ones((n, n), jnp.float32)
        f = jax.jit(lambda a, b: a @ b)
        f(a, a).block_until_ready()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            f(a, a).block_until_ready()
            times.append(time.perf_counter() - start)
        best = max(best, 2 * n**3 / min(times))
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,base")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--host-memory", default="retain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_worker:
        return hf_worker(args.hf_worker, args.steps, args.host_memory)
    host_memory.retain_freed_memory()  # before JAX starts: as lambjax.main does on CPU
    peak = matmul_peak_flops()
    print(f"CPU float32 matmul peak (measured): {peak / 1e9:.1f} GFLOP/s")
    print(
        "| model | batch x seq | HF, default malloc (ms/step) | HF, lambjax's malloc "
        "(ms/step) | lambjax (ms/step) | lambjax tokens/s | speed-up (vs default / vs same "
        "malloc) | lambjax FLOP/s / peak |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for model in args.models.split(","):
        _, batch_size, seq, _ = SHAPES[model]
        ours, flops = lambjax_step_seconds(model, args.steps)
        theirs = {m: hf_step_seconds(model, args.steps, m) for m in ("default", "retain")}
        print(
            f"| {model} | {batch_size} x {seq} | {theirs['default'] * 1e3:,.0f} | "
            f"{theirs['retain'] * 1e3:,.0f} | {ours * 1e3:,.0f} | "
            f"{batch_size * seq / ours:,.0f} | {theirs['default'] / ours:.2f}x / "
            f"{theirs['retain'] / ours:.2f}x | {flops / ours / peak:.0%} |"
        )


if __name__ == "__main__":
    main()
