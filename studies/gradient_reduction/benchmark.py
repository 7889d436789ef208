"""Step time against grad_accum_steps on a simulated pod, the gradient reduced after every
micro-batch (XLA's placement) or once per step (config.gradient_reduction='once').

  python -m studies.gradient_reduction.benchmark [--processes 2] [--micro-batch 8]
      [--accums 1,2,4,8] [--rounds 6] [--steps 2] [--seq 64] [--vocab 30522]
  python -m studies.gradient_reduction.benchmark --model   (the interconnect model; no timing)

The pod is launch/local.py's: N processes of one CPU device each, joined by jax.distributed,
their collectives over gloo (TCP on 127.0.0.1), the mesh `data` = N. Every arm (A micro-batches
of `--micro-batch` sequences per device, each reduction) is compiled and warmed up first;
then the arms take turns, `--rounds` rounds of `--steps` steps each, the order rotating, so
that this machine's load drift hits every arm alike. Process 0 prints each arm's median step
time, its spread over the rounds (min, max), the time per sequence, and the least-squares fit
t_step(A) = A * t_micro + t_reduce of each reduction, with the step time of 'once' against
'each' at every A (the baseline: XLA's placement, measured in the same run).
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

# The interconnect model (--model). Modelled, not measured: ring all-reduce time
# 2 (n - 1) / n * bytes / bandwidth, no overlap with compute, no latency term.
# Link rates: the Ethernet / InfiniBand nominal rates (25 and 100 Gb/s), and NVLink 4's
# 900 GB/s per H100 (NVIDIA H100 data sheet; both directions together, so 450 GB/s each way).
BANDWIDTHS = {  # name -> bytes/s one way
    "25 Gb/s Ethernet": 25e9 / 8,
    "100 Gb/s Ethernet / IB": 100e9 / 8,
    "NVLink 4 (H100), 450 GB/s each way": 450e9,
}
# Compute of one micro-batch on one H100, measured by lambjax (docs/results.md, "Train step
# on the H100", 2026-11-23: bf16 compute, LAMB, dropout 0.1, 128 tokens per sequence).
MICRO_BATCH_SECONDS = {
    "base": (128, 0.0576),  # 128 sequences, 57.6 ms (layers scanned)
    "large": (64, 0.0844),  # 64 sequences, 84.4 ms (layers unrolled)
}

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FORMS = ("each_microbatch", "once")


def random_batch(rows, seq, predictions, vocab, seed):
    rng = np.random.default_rng(seed)
    positions = np.sort(
        np.stack([rng.choice(np.arange(1, seq), predictions, replace=False) for _ in range(rows)]),
        1,
    )
    return {
        "input_ids": rng.integers(5, vocab, (rows, seq)).astype(np.int32),
        "input_mask": np.ones((rows, seq), np.int32),
        "segment_ids": (np.arange(seq)[None] >= seq // 2).repeat(rows, 0).astype(np.int32),
        "masked_lm_positions": positions.astype(np.int32),
        "masked_lm_ids": rng.integers(5, vocab, (rows, predictions)).astype(np.int32),
        "masked_lm_weights": np.ones((rows, predictions), np.float32),
        "next_sentence_labels": rng.integers(0, 2, (rows,)).astype(np.int32),
    }


def worker(args) -> None:
    """One process of the pod: compiles every arm, times them in turns, process 0 prints."""
    from lambjax import distributed

    distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    import jax
    import optax

    from lambjax import sharding
    from lambjax.models.config import BertConfig
    from lambjax.models.params import init_params, param_logical_axes
    from lambjax.train import loop
    from lambjax.train import state as state_lib
    from lambjax.train import step as step_lib
    from lambjax.train.config import optimizer_config
    from lambjax.train.optimizer import make_optimizer
    from lambjax.train.state import TrainState

    model = BertConfig.preset("tiny", vocab_size=args.vocab, dtype="float32", scan_layers=False)
    mesh = sharding.make_mesh({"data": -1})
    schedule = optax.constant_schedule(1e-3)
    optimizer = make_optimizer(optimizer_config("lamb"), schedule)

    def init():
        return TrainState.create(init_params(model, jax.random.key(0)), optimizer)

    shardings = state_lib.shardings(
        jax.eval_shape(init),
        param_axes=param_logical_axes(model),
        mesh=mesh,
        optimizer=optimizer,
        num_frozen_layers=0,
    )
    local_devices = jax.local_device_count()
    arms = {}
    for accum in args.accums:
        rows = accum * args.micro_batch * local_devices
        local = random_batch(rows, args.seq, 5, args.vocab, seed=jax.process_index())
        batch = loop.to_global(local, sharding.batch_sharding(mesh))
        for form in FORMS:
            step = functools.partial(
                step_lib.train_step,
                settings=step_lib.StepSettings(
                    model_config=model,
                    optimizer=optimizer,
                    schedule=schedule,
                    grad_accum_steps=accum,
                    options=step_lib.StepOptions(
                        gradient_reduction="once" if form == "once" else "each_microbatch"
                    ),
                    mesh=mesh,
                ),
            )
            compiled = jax.jit(
                step,
                in_shardings=(shardings, sharding.batch_sharding(mesh), sharding.replicated(mesh)),
                out_shardings=(shardings, sharding.replicated(mesh)),
                donate_argnums=(0,),
            )
            state = jax.jit(init, out_shardings=shardings)()
            state, metrics = compiled(state, batch, jax.random.key(1))  # compile, warm up
            jax.block_until_ready(metrics)
            arms[(accum, form)] = [compiled, state, batch, []]
    names = list(arms)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            compiled, state, batch, times = arms[name]
            start = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = compiled(state, batch, jax.random.key(1))
            jax.block_until_ready(metrics)
            times.append((time.perf_counter() - start) / args.steps)
            arms[name][1] = state
    if jax.process_index() == 0:
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
        result = {
            "arms": [{"accum": a, "form": f, "times": arms[(a, f)][3]} for a, f in names],
            "processes": jax.process_count(),
            "devices": jax.device_count(),
            "micro_batch": args.micro_batch,
            "seq": args.seq,
            "vocab": args.vocab,
            "parameters": int(sum(x.size for x in jax.tree.leaves(jax.eval_shape(init).params))),
            "load_after": load,
        }
        print("RESULT " + json.dumps(result), flush=True)


def report(result: dict) -> None:
    """The table and the fits, from the workers' measurements."""
    devices = result["devices"]
    print(
        f"{result['processes']} processes, {devices} devices, BERT-tiny vocab {result['vocab']} "
        f"({result['parameters']:,} parameters, fp32 gradient "
        f"{4 * result['parameters'] / 1e6:.1f} MB), {result['micro_batch']} x {result['seq']} "
        f"tokens per device per micro-batch; load average after: {result['load_after']}"
    )
    print("| A | reduction | median step (s) | min..max (s) | ms per sequence | once / each |")
    print("|---|---|---|---|---|---|")
    medians = {(a["accum"], a["form"]): statistics.median(a["times"]) for a in result["arms"]}
    for arm in result["arms"]:
        accum, form, times = arm["accum"], arm["form"], arm["times"]
        median = medians[(accum, form)]
        sequences = accum * result["micro_batch"] * devices
        ratio = f"{median / medians[(accum, 'each_microbatch')]:.2f}" if form == "once" else ""
        print(
            f"| {accum} | {form} | {median:.3f} | {min(times):.3f}..{max(times):.3f} | "
            f"{1e3 * median / sequences:.2f} | {ratio} |"
        )
    for form in FORMS:
        accums = np.array([a for a, f in medians if f == form], float)
        times = np.array([medians[(a, f)] for a, f in medians if f == form])
        t_micro, t_reduce = np.polyfit(accums, times, 1)
        print(f"fit {form}: t_step(A) = A * {t_micro:.4f} s + {t_reduce:.4f} s")


def communication_model(nodes=(2, 16), accums=(8, 32)) -> None:
    """Modelled step time of BERT-base and -large data parallel over `nodes` nodes of one
    H100 each, the float32 gradient all-reduced A times per step (each) or once."""
    import jax

    from lambjax.models.config import BertConfig
    from lambjax.models.params import init_params

    heads = " | ".join(f"A={a}: comm share each / once, step once / each" for a in accums)
    print(f"| model | float32 gradient | link | nodes | all-reduce (ms) | {heads} |")
    print("|---|---|---|---|---|" + "---|" * len(accums))
    for preset, (sequences, seconds) in MICRO_BATCH_SECONDS.items():
        config = BertConfig.preset(preset, vocab_size=30522)
        abstract = jax.eval_shape(lambda c=config: init_params(c, jax.random.key(0)))
        gradient_bytes = 4 * sum(x.size for x in jax.tree.leaves(abstract))
        for link, bandwidth in BANDWIDTHS.items():
            for n in nodes:
                reduce = 2 * (n - 1) / n * gradient_bytes / bandwidth
                cells = []
                for accum in accums:
                    each = accum * (seconds + reduce)
                    once = accum * seconds + reduce
                    cells.append(
                        f"{accum * reduce / each:.0%} / {reduce / once:.0%}, {once / each:.2f}"
                    )
                print(
                    f"| {preset}, {sequences} x 128 in {1e3 * seconds:.1f} ms | "
                    f"{gradient_bytes / 1e6:.0f} MB | {link} | {n} | {1e3 * reduce:.1f} | "
                    + " | ".join(cells)
                    + " |"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument(
        "--accums", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8]
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--model", action="store_true", help="print the interconnect model")
    parser.add_argument("--coordinator_address")
    parser.add_argument("--num_processes", type=int)
    parser.add_argument("--process_id", type=int)
    args = parser.parse_args()
    if args.model:
        communication_model()
        return
    if args.process_id is not None:
        worker(args)
        return
    flags = [
        f"--micro-batch={args.micro_batch}",
        f"--accums={','.join(map(str, args.accums))}",
        f"--rounds={args.rounds}",
        f"--steps={args.steps}",
        f"--seq={args.seq}",
        f"--vocab={args.vocab}",
    ]
    env = dict(os.environ, PYTHONPATH=REPO)
    launcher = [sys.executable, os.path.join(REPO, "launch", "local.py")]
    command = launcher + [
        f"--processes={args.processes}",
        "--module=studies.gradient_reduction.benchmark",
        "--",
        *flags,
    ]
    output = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in output.stdout.splitlines() if "RESULT " in line]
    if output.returncode or not lines:
        sys.exit(f"the pod failed ({output.returncode}):\n{output.stdout[-3000:]}")
    report(json.loads(lines[0].split("RESULT ", 1)[1]))


if __name__ == "__main__":
    main()
