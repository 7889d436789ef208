"""Tokens/s of a full BERT pretraining step (MLM + NSP forward, backward, LAMB update),
lambjax against Hugging Face's Flax BERT with optax.lamb, measured in one run.

  python benchmarks/train_step.py [--models tiny,base] [--steps 10] [--rounds 5] [--sides ...]

The baseline is `FlaxBertForPreTraining` from transformers 4.57.6 (the last release with
Flax BERT), installed on first use into .venv-hf/ (a --target directory layered over this
environment's jax/flax). It runs three ways: float32 with glibc's default malloc (as it runs
out of the box), float32 with the malloc settings lambjax uses on CPU (lambjax.host_memory),
under which XLA:CPU no longer faults its temporaries in at every step, and with its bfloat16
compute option (`dtype=jnp.bfloat16`) under the same malloc. lambjax runs as `lambjax.main`
runs it on CPU, in bfloat16 compute (its default; float32 parameters) and in float32. All
sides use dropout, the batch shapes below, and jit with donation. lambjax's tiny model runs
its 2 layers unrolled (`scan_layers=False`, as the demo does), base scans its 12.

Each side compiles and warms up in its own worker process; then the sides take turns,
`--rounds` rounds of `--steps / --rounds` steps each (rounded up; the order rotating), so
that this VM's speed drift (up to 30% between minutes) hits every side alike. The median
step time over all rounds is reported, and lambjax's bfloat16 step against HF as shipped and
against HF's fastest form. Achieved FLOP/s (lambjax's exact matmul count) is printed as a
fraction of this machine's matmul peak in the same precision (float32, or bfloat16 operands
with float32 accumulation), measured before the workers start.
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
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


def timed_steps(step, state, steps):
    """(the state after `steps` more steps, each step's seconds, waited for)."""
    import jax

    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state = step(state)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return state, times


def median_step_seconds(step, state, batch, rng, steps):
    """Median seconds of `step(state, batch, rng)` over `steps` steps, after two warm-up steps."""
    state, _ = timed_steps(lambda s: step(s, batch, rng), state, 2)
    _, times = timed_steps(lambda s: step(s, batch, rng), state, steps)
    return statistics.median(times)


def lambjax_config(model, dtype="bfloat16", scan_layers=None):
    """The lambjax BertConfig benchmarked for `model` (compute `dtype`; the model's layer
    form unless `scan_layers` is given)."""
    from lambjax.models.config import BertConfig

    scan = SCAN_LAYERS[model] if scan_layers is None else scan_layers
    return BertConfig.preset(SHAPES[model][0], vocab_size=VOCAB, dtype=dtype, scan_layers=scan)


def lambjax_step(model, dtype, scan_layers=None):
    """(step, initial state): lambjax's train step as the trainer jits it, on a fixed batch."""
    import jax
    import optax

    from lambjax.models.params import init_params
    from lambjax.train import step as step_lib
    from lambjax.train.config import optimizer_config
    from lambjax.train.optimizer import make_optimizer
    from lambjax.train.state import TrainState

    _, batch_size, seq, predictions = SHAPES[model]
    config = lambjax_config(model, dtype, scan_layers)
    optimizer = make_optimizer(optimizer_config("lamb"), optax.constant_schedule(1e-3))
    train_step = jax.jit(
        functools.partial(
            step_lib.train_step,
            settings=step_lib.StepSettings(
                model_config=config,
                optimizer=optimizer,
                schedule=optax.constant_schedule(1e-3),
                grad_accum_steps=1,
            ),
        ),
        donate_argnums=(0,),
    )
    state = jax.jit(lambda k: TrainState.create(init_params(config, k), optimizer))(
        jax.random.key(0)
    )
    batch = random_batch(batch_size, seq, predictions)
    rng = jax.random.key(1)
    return lambda state: train_step(state, batch, rng)[0], state


def hf_pretraining_step(hf_config, dtype):
    """(jitted step(state, batch, rng), initial state): transformers' FlaxBertForPreTraining
    of `hf_config` computing in `dtype`, MLM + NSP losses, optax.lamb; the state is donated."""
    import jax
    import jax.numpy as jnp
    import optax
    from transformers import FlaxBertForPreTraining

    hf_model = FlaxBertForPreTraining(hf_config, seed=0, dtype=jnp.dtype(dtype))
    optimizer = optax.lamb(1e-3, weight_decay=0.01)

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

    return step, (hf_model.params, optimizer.init(hf_model.params))


def hf_step(model, dtype):
    """(step, initial state): HF Flax BERT for pretraining with optax.lamb, on the same batch."""
    import jax
    from transformers import BertConfig

    preset, batch_size, seq, predictions = SHAPES[model]
    sizes = {"tiny": (2, 128, 2, 512), "base": (12, 768, 12, 3072)}[preset]
    config = BertConfig(
        vocab_size=VOCAB,
        num_hidden_layers=sizes[0],
        hidden_size=sizes[1],
        num_attention_heads=sizes[2],
        intermediate_size=sizes[3],
    )
    step, state = hf_pretraining_step(config, dtype)
    batch = random_batch(batch_size, seq, predictions)
    rng = jax.random.key(1)
    return lambda state: step(state, batch, rng), state


# name -> (step builder, compute dtype, malloc setting, needs the .venv-hf packages)
SIDES = {
    "hf float32 glibc malloc": (hf_step, "float32", "default", True),
    "hf float32": (hf_step, "float32", "retain", True),
    "hf bfloat16": (hf_step, "bfloat16", "retain", True),
    "lambjax float32": (lambjax_step, "float32", "retain", False),
    "lambjax bfloat16": (lambjax_step, "bfloat16", "retain", False),
    # Not run by default: base with its layers unrolled (`model.overrides.scan_layers=False`).
    "lambjax bfloat16 unrolled": (
        functools.partial(lambjax_step, scan_layers=False),
        "bfloat16",
        "retain",
        False,
    ),
}
DEFAULT_SIDES = [side for side in SIDES if side != "lambjax bfloat16 unrolled"]
HF_SIDES = ("hf float32 glibc malloc", "hf float32", "hf bfloat16")


def worker(side, model):
    """One side in its own process: compiles and warms up, prints `ready`, then answers each
    line of stdin (a number of steps) with those steps' seconds as a JSON list."""
    build, dtype, memory, _ = SIDES[side]
    if memory == "retain":
        host_memory.retain_freed_memory()  # before JAX starts
    step, state = build(model, dtype)
    state, _ = timed_steps(step, state, 2)  # compiles and warms up
    print("ready", flush=True)
    for line in sys.stdin:
        state, times = timed_steps(step, state, int(line))
        print(json.dumps(times), flush=True)


class Worker:
    """The parent's handle on a worker process."""

    def __init__(self, side, model):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        if SIDES[side][3]:
            env["PYTHONPATH"] = HF_DIR
        self.side = side
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", side, "--models", model],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    def _died(self) -> RuntimeError:
        code = self.process.wait()
        self.log.seek(0)
        why = " (SIGKILL: out of memory? see --sides)" if code == -9 else ""
        return RuntimeError(
            f"the {self.side!r} worker died with exit code {code}{why}:\n{self.log.read()[-3000:]}"
        )

    def _answer(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            raise self._died()
        return line

    def wait_ready(self):
        self._answer()

    def time_steps(self, steps: int) -> list[float]:
        try:
            self.process.stdin.write(f"{steps}\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None
        return json.loads(self._answer())

    def close(self):
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass  # already dead: its error was raised
        self.process.wait()
        self.log.close()


def install_hf():
    if not os.path.isdir(os.path.join(HF_DIR, "transformers")):
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", HF_DIR]
            + HF_PACKAGES,
            check=True,
        )


def interleaved_median_seconds(model, sides, steps, rounds) -> dict[str, float]:
    """Median step seconds of every side, the sides taking turns over `rounds` rounds."""
    workers = [Worker(side, model) for side in sides]
    try:
        for w in workers:
            w.wait_ready()
        per_round = -(-steps // rounds)
        times = {w.side: [] for w in workers}
        for round_index in range(rounds):
            shift = round_index % len(workers)
            for w in workers[shift:] + workers[:shift]:
                times[w.side] += w.time_steps(per_round)
    finally:
        for w in workers:
            w.close()
    return {side: statistics.median(t) for side, t in times.items()}


def ratio(hf_seconds, lambjax_seconds) -> str:
    """A speed-up against an HF side, or '-' where that side was not run."""
    return "-" if hf_seconds is None else f"{hf_seconds / lambjax_seconds:.2f}x"


def matmul_peak_flops(dtype):
    """Matmul FLOP/s of this machine through XLA (the best of a few sizes): float32, or
    bfloat16 operands accumulated into float32 (the form lambjax's bfloat16 model runs)."""
    import jax
    import jax.numpy as jnp

    best = 0.0
    for n in (1024, 2048, 3072):
        a = jnp.ones((n, n), dtype)
        f = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
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
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--sides",
        default=",".join(DEFAULT_SIDES),
        help="the sides to run (each worker holds a model; five BERT-base workers need more "
        "than 24 GB)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.models)
    for model in args.models.split(","):
        if model not in SHAPES:
            parser.error(f"--models={args.models!r}: {model!r} is not one of {sorted(SHAPES)}")
    for flag, value in (("--steps", args.steps), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{flag}={value} must be >= 1")
    sides = args.sides.split(",")
    for side in sides:
        if side not in SIDES:
            parser.error(f"--sides={args.sides!r}: {side!r} is not one of {list(SIDES)}")
    if "lambjax bfloat16" not in sides or not set(sides) & set(HF_SIDES):
        parser.error(f"--sides={args.sides!r} needs 'lambjax bfloat16' and an HF side")
    install_hf()
    host_memory.retain_freed_memory()  # before JAX starts: as lambjax.main does on CPU
    from lambjax.train.throughput import train_step_flops

    peaks = {dtype: matmul_peak_flops(dtype) for dtype in ("float32", "bfloat16")}
    print(
        f"CPU matmul peak (measured): float32 {peaks['float32'] / 1e9:.1f} GFLOP/s, "
        f"bfloat16 -> float32 {peaks['bfloat16'] / 1e9:.1f} GFLOP/s"
    )
    print(
        "| model | batch x seq | HF f32, glibc malloc | HF f32 | HF bf16 | lambjax f32 | "
        "lambjax bf16 | lambjax bf16 tokens/s | speed-up vs HF as shipped / vs HF's fastest "
        "| FLOP/s / peak: f32 / bf16 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model in args.models.split(","):
        _, batch_size, seq, predictions = SHAPES[model]
        flops = train_step_flops(lambjax_config(model), batch_size, seq, predictions)
        seconds = interleaved_median_seconds(model, sides, args.steps, args.rounds)
        ours = seconds["lambjax bfloat16"]
        hf_run = [side for side in HF_SIDES if side in seconds]
        as_shipped = seconds.get("hf float32 glibc malloc")
        fastest_hf = min(seconds[side] for side in hf_run)
        cells = " | ".join(
            f"{seconds[side] * 1e3:,.0f}" if side in seconds else "-" for side in DEFAULT_SIDES
        )
        utilisation = " / ".join(
            f"{flops / seconds[f'lambjax {dtype}'] / peaks[dtype]:.0%}"
            if f"lambjax {dtype}" in seconds
            else "-"
            for dtype in ("float32", "bfloat16")
        )
        print(
            f"| {model} | {batch_size} x {seq} | {cells} | {batch_size * seq / ours:,.0f} | "
            f"{ratio(as_shipped, ours)} / {ratio(fastest_hf, ours)} (of {len(hf_run)}) | "
            f"{utilisation} |",
            flush=True,
        )
        unrolled = seconds.get("lambjax bfloat16 unrolled")
        if unrolled:
            print(
                f"  {model}, lambjax bfloat16 with layers unrolled: {unrolled * 1e3:,.0f} ms; "
                f"{ratio(as_shipped, unrolled)} / {ratio(fastest_hf, unrolled)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
