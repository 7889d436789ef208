"""Ouroboros (lambjax.train.ouroboros): its critical path per step, and how it trains.

  python benchmarks/ouroboros.py critical_path [--preset base] [--rows 8] [--seq 128]
  python benchmarks/ouroboros.py training [--steps 200] [--layers 6] [--workdir DIR]

critical_path: a CPU cannot show a model-parallel speed-up, so this measures what the
schedule is made of, one module computation at a time, and adds it up along each schedule's
critical path. It times (jitted, median of 5) the forward and the backward of one encoder
layer, of the embeddings and of the heads with the loss, at `--preset` width on a micro-batch
of `--rows` x `--seq` tokens, and then, for K modules on S = K - 1 stages and M micro-batches
per step:

  one device        backpropagation of the whole model, no model parallelism
  GPipe             the same S devices, S equal stages, M micro-batches: (M + S - 1) forward
                    ticks, then (M + S - 1) backward ticks, each tick its slowest stage's
  Ouroboros         lambjax's schedule: per micro-batch the K module forwards in turn, each
                    stage replaying its module (forward again, then backward) right after
                    its own forward, beside the stages above it; the step's critical path
                    is the longest chain of module computations

It prints each schedule's sequential module computations per step and its critical path in
seconds, and the ratios to one device (the named baseline) and to GPipe.

training: trains the runlocal recipe (tiny BERT, embedded corpus, phase 1 only) with
`--layers` layers, synchronously (K = 1) and with Ouroboros at K = 2, 3, 4 (one process per
run, K - 1 fake devices), and prints the held-out MLM loss at the end beside the synchronous
run's (the gap) and the training loss every 50 steps.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


# ----------------------------------------------------------------------------------------
# Critical path


def timed(fn, *args, repeats=5) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_backward(fn, *args) -> tuple[float, float]:
    """(forward seconds, backward seconds = forward-and-backward minus forward)."""
    import jax
    import jax.numpy as jnp

    forward = jax.jit(fn)

    def both(*args):
        out, vjp = jax.vjp(fn, *args)
        return vjp(jax.tree.map(jnp.ones_like, out))

    f = timed(forward, *args)
    return f, max(timed(jax.jit(both), *args) - f, 0.0)


def measure_parts(preset: str, rows: int, seq: int) -> dict:
    import jax
    import jax.numpy as jnp

    from lambjax.models import bert, pretraining
    from tests.helpers import random_batch

    config = bert.BertConfig.preset(preset, dtype="float32")
    params = bert.init_params(config, jax.random.key(0))
    batch = random_batch(0, batch=rows, seq=seq, predictions=max(seq // 6, 1), vocab_size=1000)
    rng = jax.random.key(1)
    layer = jax.tree.map(lambda x: x[:1], params["encoder"]["layers"])
    h = jnp.ones((rows, seq, config.hidden_size), jnp.float32)
    bias = bert.attention_bias(jnp.asarray(batch["input_mask"]))

    def one_layer(layer, h):
        out, _ = bert.run_layers(
            config, layer, h, bias, rng=rng, keep=None, scale=None, first_index=0, token_mask=None
        )
        return out

    def embeddings(embeddings):
        return bert.Embeddings(config).apply(
            {"params": embeddings},
            batch["input_ids"],
            batch["segment_ids"],
            False,
            rngs={"dropout": rng},
        )

    def heads(heads, word, h):
        logits = bert.Heads(config).apply({"params": heads}, h, batch["masked_lm_positions"], word)
        return pretraining.stats_from_logits(*logits, batch)["mlm_loss_sum"]

    word = params["embeddings"]["word"]["embedding"]
    return {
        "layer": forward_backward(one_layer, layer, h),
        "embeddings": forward_backward(embeddings, params["embeddings"]),
        "heads": forward_backward(heads, params["heads"], word, h),
        "num_layers": config.num_layers,
    }


def schedules(parts: dict, modules: int, microbatches: int) -> dict:
    """{schedule: (sequential module computations per step, critical path seconds)} for K
    modules on K - 1 stages; every time is per micro-batch."""
    (fl, bl), (fe, be), (fh, bh) = parts["layer"], parts["embeddings"], parts["heads"]
    layers, stages, m = parts["num_layers"], modules - 1, microbatches
    per_stage = layers // stages
    first = (per_stage + 1) // 2
    last = per_stage - first
    whole = fe + be + layers * (fl + bl) + fh + bh
    result = {"one device": (2 * m, m * whole)}  # a forward and a backward per micro-batch
    # GPipe on S stages of equal depth; the embeddings on the first, the heads on the last.
    forward = [per_stage * fl for _ in range(stages)]
    backward = [per_stage * bl for _ in range(stages)]
    forward[0] += fe
    backward[0] += be
    forward[-1] += fh
    backward[-1] += bh
    ticks = m + stages - 1
    result["GPipe"] = (2 * ticks, ticks * (max(forward) + max(backward)))
    # Ouroboros, as lambjax schedules it: module 1 (embeddings + `first` layers) and module
    # K (`last` layers + heads) on stage 0, the middle modules `per_stage` layers each. The
    # forward hands over stage to stage (only the two stages take part); stage j replays
    # (forward again, then backward) right after its own forward; the backward ring at the
    # end waits for everyone. Per micro-batch, the longest chain of computations:
    forward = [fe + first * fl] + [per_stage * fl] * (modules - 2)  # stages 0 .. S - 1
    replay = [fe + first * (fl + bl) + be] + [per_stage * (fl + bl)] * (modules - 2)
    top = last * (fl + bl) + fh + bh  # module K's forward and backward
    ends = [sum(forward[: j + 1]) for j in range(stages)]  # each stage's forward done
    chains = [(ends[j] + replay[j], j + 2) for j in range(1, stages)]  # j+1 forwards, a replay
    if stages == 1:  # one device: everything in turn
        chains.append((forward[0] + top + replay[0], 4))
    else:  # stage 0 replays module 1 while the forward climbs, then runs module K
        start = max(ends[0] + replay[0], ends[-1])
        count = stages + 2 if ends[-1] >= ends[0] + replay[0] else 4
        chains.append((start + top, count))
    seconds, count = max(chains)
    result["Ouroboros"] = (m * count, m * seconds)
    return result


def critical_path(args) -> None:
    parts = measure_parts(args.preset, args.rows, args.seq)
    print(
        f"BERT-{args.preset} parts, micro-batch {args.rows} x {args.seq}, float32 on "
        f"{os.cpu_count()} CPU cores (forward / backward seconds):"
    )
    for name in ("layer", "embeddings", "heads"):
        f, b = parts[name]
        print(f"  {name:<11} {f:.4f} / {b:.4f}")
    layers = parts["num_layers"]
    print(
        "\n| K | stages | micro-batches | schedule | sequential computations | critical path "
        "| one device / this | GPipe / this |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for modules in (2, 3, 4, 5):
        if layers % (modules - 1):
            continue
        for m in (1, 4):
            result = schedules(parts, modules, m)
            base, gpipe = result["one device"][1], result["GPipe"][1]
            for name, (count, seconds) in result.items():
                print(
                    f"| {modules} | {modules - 1} | {m} | {name} | {count} | {seconds:.3f} s "
                    f"| {base / seconds:.2f}x | {gpipe / seconds:.2f}x |"
                )


# ----------------------------------------------------------------------------------------
# Training


def train(workdir: str, modules: int, steps: int, layers: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={max(modules - 1, 1)}"
    env["JAX_PLATFORMS"] = "cpu"
    command = [
        sys.executable,
        "-m",
        "lambjax.main",
        "--config=configs/bert_lamb.py:runlocal",
        f"--workdir={workdir}",
        "--config.phase_order=('phase1',)",
        f"--config.phases.phase1.num_steps={steps}",
        f"--config.phases.phase1.num_layers={layers}",
        f"--config.ouroboros.num_modules={modules}",
        f"--config.mesh.stage={max(modules - 1, 1)}",
        "--config.log_every_steps=10",
        f"--config.eval_every_steps={steps}",
        f"--config.checkpoint_every_steps={steps}",
        "--config.eval_steps=0",
    ]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"K={modules} failed:\n{result.stderr[-3000:]}")
    seconds = time.perf_counter() - start
    records = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            records.setdefault(record["step"], {}).update(record)
    return {"records": records, "seconds": seconds}


def training(args) -> None:
    results = {}
    for modules in (1, 2, 3, 4):
        if modules > 1 and args.layers % (modules - 1):
            continue
        workdir = os.path.join(args.workdir, f"k{modules}")
        results[modules] = train(workdir, modules, args.steps, args.layers)
        print(f"K={modules}: {results[modules]['seconds']:.0f} s", flush=True)
    final = {k: r["records"][args.steps]["eval/mlm_loss"] for k, r in results.items()}
    print(f"\n{args.layers}-layer tiny BERT, {args.steps} steps of phase 1 (runlocal, LAMB):")
    print("| K | held-out MLM loss | gap to K = 1 | held-out MLM accuracy |")
    print("|---|---|---|---|")
    for k, r in results.items():
        accuracy = r["records"][args.steps]["eval/mlm_accuracy"]
        print(f"| {k} | {final[k]:.4f} | {final[k] - final[1]:+.4f} | {accuracy:.1%} |")
    marks = [s for s in range(50, args.steps + 1, 50)]
    print("\ntraining loss (mean of the 10 steps logged at each mark):")
    print("| step | " + " | ".join(f"K = {k}" for k in results) + " |")
    print("|---|" + "---|" * len(results))
    for s in marks:
        row = [f"{r['records'][s]['train/loss']:.4f}" for r in results.values()]
        print(f"| {s} | " + " | ".join(row) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("critical_path", "training"))
    parser.add_argument("--preset", default="base")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--workdir", default="/tmp/lambjax-ouroboros")
    args = parser.parse_args()
    sys.path.insert(0, REPO)
    if args.part == "critical_path":
        critical_path(args)
    else:
        training(args)


if __name__ == "__main__":
    main()
