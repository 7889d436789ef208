"""Steps/s of SQuAD fine-tuning (span head: forward, backward, AdamW with BERT's decay mask
and clipping), lambjax against Hugging Face's `FlaxBertForQuestionAnswering`, in one run.

  python benchmarks/finetune_squad.py [--models tiny,base] [--batch 8] [--steps 10] [--rounds 5]
      [--sides "hf float32,lambjax float32"]

SQuAD-shaped batches: sequence 384 (run_squad.py's), a 64-token question segment, random
tokens and answer positions. Both sides run the same optimizer (lambjax's AdamW as
`python -m lambjax.finetune` builds it), dropout, and jit with the state donated; lambjax
runs `lambjax.finetune.step.train_step` as the fine-tuning loop compiles it. Each side runs
in float32 and with bfloat16 compute (float32 parameters), the malloc settings lambjax uses
on CPU (lambjax.host_memory) for all. The baseline is transformers 4.57.6 (the last release
with Flax BERT), installed on first use into .venv-hf/ by benchmarks/train_step.py's
`install_hf`.

Each side compiles and warms up in its own worker process; the sides then take turns,
`--rounds` rounds of `--steps / --rounds` steps each (the order rotating), so the VM's speed
drift hits every side alike. The median step time is reported with lambjax's speed-up over
HF at the same precision.
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from lambjax import host_memory

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step as pretraining_benchmark  # noqa: E402 - its HF install and step timer

SEQUENCE, QUERY = 384, 64
VOCAB = 30522
PRESETS = {"tiny": (2, 128, 2, 512), "base": (12, 768, 12, 3072)}  # layers, hidden, heads, mlp
SCAN_LAYERS = {"tiny": False, "base": True}  # as benchmarks/train_step.py runs them
SIDES = ("hf float32", "hf bfloat16", "lambjax float32", "lambjax bfloat16")


def squad_batch(batch_size, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    starts = rng.integers(QUERY + 2, SEQUENCE - 10, batch_size)
    return {
        "input_ids": rng.integers(5, VOCAB, (batch_size, SEQUENCE)).astype(np.int32),
        "input_mask": np.ones((batch_size, SEQUENCE), np.int32),
        "segment_ids": (np.arange(SEQUENCE)[None] > QUERY + 1)
        .repeat(batch_size, 0)
        .astype(np.int32),
        "start_positions": starts.astype(np.int32),
        "end_positions": (starts + rng.integers(0, 8, batch_size)).astype(np.int32),
    }


def optimizer():
    import optax

    from lambjax.finetune import config as finetune_config
    from lambjax.train.optimizer import make_optimizer

    return make_optimizer(finetune_config.base_config().optimizer, optax.constant_schedule(3e-5))


def lambjax_step(model, dtype, batch_size):
    """(step, state): the fine-tuning loop's train step, on a fixed batch."""
    import jax
    import optax

    from lambjax.finetune import step as step_lib
    from lambjax.models import heads
    from lambjax.models.config import BertConfig
    from lambjax.train.state import TrainState

    layers, hidden, num_heads, mlp = PRESETS[model]
    config = BertConfig(
        vocab_size=VOCAB, num_layers=layers, hidden_size=hidden, num_heads=num_heads,
        intermediate_size=mlp, dtype=dtype, scan_layers=SCAN_LAYERS[model],
    )  # fmt: skip
    tx = optimizer()
    train = jax.jit(
        functools.partial(
            step_lib.train_step, model_config=config, kind="span", num_labels=2, optimizer=tx,
            schedule=optax.constant_schedule(3e-5),
        ),
        donate_argnums=(0,),
    )  # fmt: skip
    state = jax.jit(lambda k: TrainState.create(heads.init_params(config, "span", 2, k), tx))(
        jax.random.key(0)
    )
    batch, rng = squad_batch(batch_size), jax.random.key(1)
    return lambda state: train(state, batch, rng)[0], state


def hf_step(model, dtype, batch_size):
    """(step, state): FlaxBertForQuestionAnswering with the same loss and optimizer."""
    import jax
    import jax.numpy as jnp
    import optax
    from transformers import BertConfig, FlaxBertForQuestionAnswering

    from lambjax.finetune.step import span_loss

    layers, hidden, num_heads, mlp = PRESETS[model]
    config = BertConfig(
        vocab_size=VOCAB, num_hidden_layers=layers, hidden_size=hidden,
        num_attention_heads=num_heads, intermediate_size=mlp,
    )  # fmt: skip
    hf_model = FlaxBertForQuestionAnswering(config, seed=0, dtype=jnp.dtype(dtype))
    tx = optimizer()
    batch, rng = squad_batch(batch_size), jax.random.key(1)

    def loss_fn(params, batch, rng):
        out = hf_model(
            batch["input_ids"], attention_mask=batch["input_mask"],
            token_type_ids=batch["segment_ids"], params=params, dropout_rng=rng, train=True,
        )  # fmt: skip
        return span_loss(
            out.start_logits.astype(jnp.float32), out.end_logits.astype(jnp.float32),
            batch["start_positions"], batch["end_positions"],
        )  # fmt: skip

    @functools.partial(jax.jit, donate_argnums=(0,))
    def train(state, batch, rng):
        params, opt_state = state
        grads = jax.grad(loss_fn)(params, batch, rng)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = (hf_model.params, tx.init(hf_model.params))
    return lambda state: train(state, batch, rng), state


def worker(side, model, batch_size):
    """One side: compiles, warms up, prints `ready`, then times the steps asked on stdin."""
    host_memory.retain_freed_memory()  # before JAX starts, as lambjax.main does on CPU
    kind, dtype = side.split()
    build = hf_step if kind == "hf" else lambjax_step
    step, state = build(model, dtype, batch_size)
    state, _ = pretraining_benchmark.timed_steps(step, state, 2)
    print("ready", flush=True)
    for line in sys.stdin:
        state, times = pretraining_benchmark.timed_steps(step, state, int(line))
        print(json.dumps(times), flush=True)


def start_worker(side, model, batch_size):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if side.startswith("hf"):
        env["PYTHONPATH"] = pretraining_benchmark.HF_DIR
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(
        [sys.executable, __file__, "--worker", side, "--models", model, "--batch",
         str(batch_size)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    return process, log


def ask(process, log, side, line=None):
    if line is not None:
        process.stdin.write(line + "\n")
        process.stdin.flush()
    answer = process.stdout.readline()
    if not answer:
        code = process.wait()
        why = " (SIGKILL: out of memory? run fewer --sides)" if code == -9 else ""
        log.seek(0)
        raise RuntimeError(
            f"the {side!r} worker died with exit code {code}{why}:\n{log.read()[-3000:]}"
        )
    return answer


def median_seconds(model, batch_size, steps, rounds, sides) -> dict[str, float]:
    workers = {side: start_worker(side, model, batch_size) for side in sides}
    try:
        for side, (process, log) in workers.items():
            ask(process, log, side)
        times = {side: [] for side in sides}
        per_round = -(-steps // rounds)
        for round_index in range(rounds):
            shift = round_index % len(sides)
            order = sides[shift:] + sides[:shift]
            for side in order:
                times[side] += json.loads(ask(*workers[side], side, str(per_round)))
    finally:
        for process, log in workers.values():
            process.stdin.close()
            process.wait()
            log.close()
    return {side: statistics.median(t) for side, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--sides",
        default=",".join(SIDES),
        help="the sides to run, at least one HF and one lambjax (four BERT-base workers at "
        "sequence 384 may not fit in 24 GB)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.models, args.batch)
    for model in args.models.split(","):
        if model not in PRESETS:
            parser.error(f"--models={args.models!r}: {model!r} is not one of {sorted(PRESETS)}")
    for flag, value in (
        ("--batch", args.batch),
        ("--steps", args.steps),
        ("--rounds", args.rounds),
    ):
        if value < 1:
            parser.error(f"{flag}={value} must be >= 1")
    sides = tuple(args.sides.split(","))
    unknown = [side for side in sides if side not in SIDES]
    if (
        unknown
        or not any(s.startswith("hf") for s in sides)
        or not any(s.startswith("lambjax") for s in sides)
    ):
        parser.error(f"--sides={args.sides!r}: name HF and lambjax sides among {list(SIDES)}")
    pretraining_benchmark.install_hf()
    print("| model | batch x seq | HF f32 ms | HF bf16 ms | lambjax f32 ms | lambjax bf16 ms | "
          "lambjax steps/s f32 / bf16 | speed-up vs HF: f32 / bf16 |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for model in args.models.split(","):
        seconds = median_seconds(model, args.batch, args.steps, args.rounds, sides)
        cells = " | ".join(
            f"{seconds[side] * 1e3:,.0f}" if side in seconds else "-" for side in SIDES
        )
        rates = " / ".join(
            f"{1 / seconds[f'lambjax {d}']:.2f}" if f"lambjax {d}" in seconds else "-"
            for d in ("float32", "bfloat16")
        )
        ratios = " / ".join(
            f"{seconds[f'hf {d}'] / seconds[f'lambjax {d}']:.2f}x"
            if {f"hf {d}", f"lambjax {d}"} <= set(seconds)
            else "-"
            for d in ("float32", "bfloat16")
        )
        print(f"| {model} | {args.batch} x {SEQUENCE} | {cells} | {rates} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
