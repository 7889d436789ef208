"""Ouroboros (lambjax.contrib.ouroboros): its critical path per step, its wall-clock step on
two devices that run in parallel, and how it trains.

  python -m studies.ouroboros.benchmark critical_path [--preset base] [--rows 8] [--seq 128]
  python -m studies.ouroboros.benchmark overlap [--preset mini] [--layers 6] [--rows 16] [--seq 64]
      [--steps 30] [--warmup 5] [--repeats 3]
  python -m studies.ouroboros.benchmark training [--steps 200] [--layers 6] [--workdir DIR]

critical_path: measures what the schedule is made of, one module computation at a time, and
adds it up along each schedule's critical path. It times (jitted, median of 5) the forward
and the backward of one encoder layer, of the embeddings and of the heads with the loss, at
`--preset` width on a micro-batch of `--rows` x `--seq` tokens, and then, for K modules on
S = K - 1 stages and M micro-batches per step:

  one device        backpropagation of the whole model, no model parallelism
  GPipe             the same S devices, S equal stages, M micro-batches: (M + S - 1) forward
                    ticks, then (M + S - 1) backward ticks, each tick its slowest stage's
  Ouroboros         lambjax's schedule: per micro-batch the K module forwards in turn, each
                    stage replaying its module (forward again, then backward) right after
                    its own forward, beside the stages above it; the step's critical path
                    is the longest chain of module computations
  Ouroboros, no overlap   the same computations one after another

It prints each schedule's sequential module computations per step and its critical path in
seconds, and the ratios to one device (the named baseline) and to GPipe.

overlap: the same question measured. Two processes joined by jax.distributed (collectives
through gloo), each with one CPU device, each pinned to its own core and XLA:CPU
single-threaded, run lambjax's jitted train step (LAMB, float32) on one global batch of
`--rows` x `--seq` random tokens:

  K = 1, data parallel, 2 cores   ordinary backpropagation, the batch split over the two
  K = 3, 2 stages, 2 cores        Ouroboros, 3 modules on 2 stages (each stage the whole batch)
  K = 3, 2 stages, 1 core         the same with both processes on core 0: nothing overlaps

each `--repeats` times, interleaved. A run's time is the median of its `--steps` steps after
`--warmup` (compilation, the pipeline filling); the table gives every round's, their median,
and beside them the critical path `critical_path` predicts from module times measured in one
pinned, single-threaded process (forward and backward only: no optimizer, no transfers), with
the load average around each run. Meant for an idle machine with two free cores: another
process on a pinned core takes its time from the measurement.

training: trains the runlocal recipe (tiny BERT, embedded corpus, phase 1 only) with
`--layers` layers, synchronously (K = 1) and with Ouroboros at K = 2, 3, 4 (one process per
run, K - 1 fake devices), and prints the held-out MLM loss at the end beside the synchronous
run's (the gap) and the training loss every 50 steps.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


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


def measure_parts(preset: str, rows: int, seq: int, **overrides) -> dict:
    import jax
    import jax.numpy as jnp

    from lambjax.models import bert, encoder, pretraining
    from lambjax.models.config import BertConfig
    from lambjax.models.params import init_params
    from tests.helpers import random_batch

    config = BertConfig.preset(preset, dtype="float32", **overrides)
    params = init_params(config, jax.random.key(0))
    vocab = min(config.vocab_size, 1000)
    batch = random_batch(0, batch=rows, seq=seq, predictions=predictions(seq), vocab_size=vocab)
    rng = jax.random.key(1)
    layer = jax.tree.map(lambda x: x[:1], params["encoder"]["layers"])
    h = jnp.ones((rows, seq, config.hidden_size), jnp.float32)
    bias = encoder.attention_bias(jnp.asarray(batch["input_mask"]))

    def one_layer(layer, h):
        out, _ = encoder.run_layers(config, layer, h, bias, rng=rng)
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


def predictions(seq: int) -> int:
    """Masked positions per sequence in these measurements."""
    return max(seq // 6, 1)


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
    # The same computations one after another: what the stages would take sharing a core.
    serial = sum(forward) + sum(replay) + top
    result["Ouroboros, no overlap"] = (m * (2 * stages + 2), m * serial)
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
# Overlap: the step's wall-clock time on two devices that run in parallel

# XLA:CPU's matmuls on the calling thread, not an Eigen pool (parse-tested: jaxlib stops
# at start-up on a flag it does not know). With the process pinned to one core, XLA's own
# thread pool has that core only.
SINGLE_THREADED = "--xla_cpu_multi_thread_eigen=false"
OVERLAP_VOCAB = 2048
# (label, K, the cores of processes 0 and 1): K = 1 is plain data parallelism over the same
# global batch; K = 3 once on two cores and once with both processes on one core, where
# nothing can overlap (the same program, its stages taking turns).
OVERLAP_ARMS = (
    ("K = 1, data parallel, 2 cores", 1, (0, 1)),
    ("K = 3, 2 stages, 2 cores", 3, (0, 1)),
    ("K = 3, 2 stages, 1 core", 3, (0, 0)),
)


def overlap_config(args, modules: int):
    """lambjax's config of the timed run: `--preset` at `--layers` layers, float32, LAMB, one
    phase; K = 1 on mesh data 2, K > 1 on mesh stage K - 1 (data 1)."""
    from lambjax.contrib import ouroboros
    from lambjax.train import config as config_lib

    config = ouroboros.configure(config_lib.base_config())
    config.model.preset = args.preset
    config.model.overrides.num_layers = args.layers
    config.model.overrides.dtype = "float32"
    config.optimizer = config_lib.optimizer_config("lamb")
    config_lib.with_phases(
        config,
        phase1=config_lib.phase_config(
            max_seq_length=args.seq,
            max_predictions_per_seq=predictions(args.seq),
            global_batch_size=args.rows,
            num_steps=10_000,
            learning_rate=1e-3,
        ),
    )
    config.ouroboros.num_modules = modules
    config.mesh.stage = max(modules - 1, 1)
    config.mesh.data = 2 // config.mesh.stage
    return config


def overlap_worker(args) -> None:
    """One of the two processes: pinned to `--core`, joined by jax.distributed (gloo), it
    times `--steps` train steps after `--warmup` (compilation, the pipeline filling)."""
    os.sched_setaffinity(0, {args.core})
    import jax
    import numpy as np

    from lambjax import distributed, sharding
    from lambjax.train import phases, trainer
    from lambjax.train import plan as plan_lib
    from tests.helpers import random_batch

    distributed.initialize(args.coordinator, 2, args.process_id)
    config = overlap_config(args, args.modules)
    run = plan_lib.resolve(
        config, vocab_size=OVERLAP_VOCAB, num_devices=jax.device_count(), process_count=2
    )
    phase = phases.build_phase(run.phases[0], prepared=None)
    steps = trainer.compile_steps(phase)
    state = steps.to_running(steps.init_state(jax.random.key(0)))
    rows = random_batch(
        0,
        batch=args.rows,
        seq=args.seq,
        predictions=predictions(args.seq),
        vocab_size=OVERLAP_VOCAB,
    )
    batch_sharding = sharding.batch_sharding(phase.mesh)
    batch = {
        key: jax.make_array_from_callback(x.shape, batch_sharding, lambda index, x=x: x[index])
        for key, x in rows.items()
    }
    rng = jax.random.key(1)
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        state, metrics = steps.train(state, batch, rng)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    loss = float(np.asarray(metrics["loss"]))
    if args.process_id == 0:
        result = {
            "times": times[args.warmup :],
            "loss": loss,
            "threads": len(os.listdir("/proc/self/task")),
        }
        print("OVERLAP " + json.dumps(result), flush=True)


def run_pair(args, modules: int, cores: tuple[int, int]) -> dict:
    """Both processes of one timed run; process 0's result."""
    env = {**os.environ, "XLA_FLAGS": SINGLE_THREADED, "JAX_PLATFORMS": "cpu"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [
        sys.executable,
        __file__,
        "overlap_worker",
        f"--coordinator=127.0.0.1:{port}",
        f"--modules={modules}",
        *(f"--{k}={getattr(args, k)}" for k in ("preset", "layers", "rows", "seq", "steps")),
        f"--warmup={args.warmup}",
    ]
    processes = [
        subprocess.Popen(
            [*common, f"--process_id={i}", f"--core={core}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, core in enumerate(cores)
    ]
    outputs = [p.communicate()[0] for p in processes]
    for p, out in zip(processes, outputs, strict=True):
        if p.returncode:
            raise SystemExit(f"K={modules} on cores {cores} failed:\n{out[-3000:]}")
    line = next(x for x in outputs[0].splitlines() if x.startswith("OVERLAP "))
    return json.loads(line.removeprefix("OVERLAP "))


def overlap_parts(args) -> None:
    """The module times of the prediction, on one core, single-threaded: at the whole batch
    (each Ouroboros stage's micro-batch) and at half of it (each data-parallel shard's)."""
    os.sched_setaffinity(0, {0})
    parts = {}
    for rows in (args.rows, args.rows // 2):
        measured = measure_parts(
            args.preset, rows, args.seq, num_layers=args.layers, vocab_size=OVERLAP_VOCAB
        )
        parts[rows] = measured
    print("PARTS " + json.dumps(parts), flush=True)


def predicted(args) -> dict:
    """{arm label: critical-path seconds}, summed from module times measured in a pinned,
    single-threaded process (forward and backward only: no optimizer, no communication)."""
    env = {**os.environ, "XLA_FLAGS": SINGLE_THREADED, "JAX_PLATFORMS": "cpu"}
    flags = [f"--{k}={getattr(args, k)}" for k in ("preset", "layers", "rows", "seq")]
    result = subprocess.run(
        [sys.executable, __file__, "overlap_parts", *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise SystemExit(f"measuring the parts failed:\n{result.stderr[-3000:]}")
    line = next(x for x in result.stdout.splitlines() if x.startswith("PARTS "))
    parts = {int(rows): value for rows, value in json.loads(line.removeprefix("PARTS ")).items()}
    whole, half = schedules(parts[args.rows], 3, 1), schedules(parts[args.rows // 2], 3, 1)
    return {
        OVERLAP_ARMS[0][0]: half["one device"][1],
        OVERLAP_ARMS[1][0]: whole["Ouroboros"][1],
        OVERLAP_ARMS[2][0]: whole["Ouroboros, no overlap"][1],
    }


def overlap(args) -> None:
    prediction = predicted(args)
    runs = {label: [] for label, _, _ in OVERLAP_ARMS}
    for repeat in range(args.repeats):  # interleaved, the order reversed every other round
        order = OVERLAP_ARMS if repeat % 2 == 0 else OVERLAP_ARMS[::-1]
        for label, modules, cores in order:
            load = os.getloadavg()[0]
            result = run_pair(args, modules, cores)
            median = statistics.median(result["times"])
            runs[label].append((median, load, os.getloadavg()[0]))
            print(
                f"round {repeat + 1} | {label} | median step {1000 * median:.1f} ms over "
                f"{len(result['times'])} steps | loss {result['loss']:.4f} | "
                f"{result['threads']} threads | load {load:.2f} -> {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    print(
        f"\nBERT-{args.preset} at {args.layers} layers, batch {args.rows} x {args.seq}, "
        f"float32, LAMB; 2 processes (jax.distributed, gloo), one CPU device each, pinned, "
        f"single-threaded; {args.steps} timed steps per run after {args.warmup}:"
    )
    print("| arm | median step, each round | median of rounds | predicted | measured / predicted |")
    print("|---|---|---|---|---|")
    medians = {}
    for label, values in runs.items():
        medians[label] = statistics.median(v for v, _, _ in values)
        rounds = ", ".join(f"{1000 * v:.1f}" for v, _, _ in values)
        print(
            f"| {label} | {rounds} ms | {1000 * medians[label]:.1f} ms "
            f"| {1000 * prediction[label]:.1f} ms | {medians[label] / prediction[label]:.2f} |"
        )
    (dp, dp_label), (pipe, pipe_label), (alone, _) = [(medians[a], a) for a, _, _ in OVERLAP_ARMS]
    print(
        f"\nK = 1 / K = 3 (speed-up over data parallelism): measured {dp / pipe:.2f}x, "
        f"predicted {prediction[dp_label] / prediction[pipe_label]:.2f}x"
    )
    print(
        f"K = 3 on 1 core / on 2 cores (the overlap): measured {alone / pipe:.2f}x, predicted "
        f"{prediction[OVERLAP_ARMS[2][0]] / prediction[pipe_label]:.2f}x"
    )
    loads = [x for values in runs.values() for _, a, b in values for x in (a, b)]
    print(f"load average (1 min) around the runs: {min(loads):.2f} .. {max(loads):.2f}")


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
        "--config=configs/bert_lamb.py:ouroboros,runlocal",
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


# Each part's defaults for the flags they share; `overlap` passes its own to its processes.
DEFAULTS = {
    "critical_path": dict(preset="base", rows=8, seq=128, steps=0),
    "training": dict(preset="base", rows=8, seq=128, steps=200),
    "overlap": dict(preset="mini", rows=16, seq=64, steps=30),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "part", choices=("critical_path", "training", "overlap", "overlap_worker", "overlap_parts")
    )
    parser.add_argument("--preset")
    parser.add_argument("--rows", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--workdir", default="/tmp/lambjax-ouroboros")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    # Set by `overlap` for the processes it starts.
    parser.add_argument("--modules", type=int)
    parser.add_argument("--core", type=int)
    parser.add_argument("--process_id", type=int)
    parser.add_argument("--coordinator")
    args = parser.parse_args()
    for key, value in DEFAULTS[args.part.removesuffix("_worker").removesuffix("_parts")].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    sys.path.insert(0, REPO)
    parts = {
        "critical_path": critical_path,
        "training": training,
        "overlap": overlap,
        "overlap_worker": overlap_worker,
        "overlap_parts": overlap_parts,
    }
    parts[args.part](args)


if __name__ == "__main__":
    main()
