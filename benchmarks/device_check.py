"""The fast path on this machine's accelerator, in one command that a bare JAX image can run.

  python -m benchmarks.device_check --out=/tmp/device_check     # GPU or TPU, ~7-9 minutes
  python -m benchmarks.device_check --preset=tiny --steps=2     # CPU smoke (the test suite's)

Imports nothing beyond JAX, Flax, optax, NumPy, absl and etils (lambjax's model, optimizer and
step; not its config, data pipeline or checkpoints), so it starts on an accelerator image as
shipped. Each result is one JSON line on stdout (and in OUT/results.jsonl as it comes):

  1. kernels: the platform's fused attention (cuDNN on GPU, splash on TPU; on CPU the cuDNN
     call's own XLA implementation) against the einsum form in float32, forward and
     backward, at BERT-large's heads (16 x 64) in bfloat16, S = 128 and 512, right-padded
     and packed rows: relative errors of the output and of dq, dk, dv.
  2. steps: pretraining steps of `--preset` (BERT-large), LAMB with NVIDIA's settings, phase
     1 (S = 128, 20 predictions, `--phase1-batch` sequences per device and micro-batch) and
     phase 2 (S = 512, 80 predictions, `--phase2-batch`, halved on out-of-memory), each with the
     fused form (attention dropout 0, the `fast` variant) and `xla` (dropout 0.1, the
     recipe), accumulation over 1 and 4 micro-batches, layers held per layer (unrolled; with
     accumulation 1 also `grouped`, the optimizer on stacked layers) and stacked (scanned):
     compile seconds, step time, sequences/s, MFU against the device's data-sheet peak,
     memory, XLA's cost analysis, and for the first configuration of each phase and form a
     profile of `--profile-steps` steps (benchmarks/trace_summary.py:
     time by kernel class, top kernels and ops, the device's idle share).

The most informative measurements come first, and none starts after `--time-budget` seconds,
so a lent machine's short slot still returns what was measured. A table closes the run.
"""

import argparse
import dataclasses
import functools
import itertools
import json
import os
import statistics
import tempfile
import time
import traceback
import types

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from benchmarks import kernel_check, trace_summary
from lambjax import distributed, xla_flags
from lambjax.models import attention
from lambjax.models.config import PRESETS, BertConfig
from lambjax.train import layout
from lambjax.train import step as step_lib
from lambjax.train.optimizer import make_optimizer
from lambjax.train.throughput import peak_flops_per_device, train_step_flops

PHASES = {1: (128, 20), 2: (512, 80)}  # sequence length, masked predictions per sequence
ACCUMULATION = (1, 4)
# scan_layers; "grouped" is unrolled with the optimizer on stacked layers (group_layers).
LAYERS = {"unrolled": False, "grouped": False, "scan": True}
# NVIDIA's LAMB: lambjax.train.config.optimizer_config('lamb'), which needs ml_collections.
NVIDIA_LAMB = types.SimpleNamespace(
    name="lamb",
    b1=0.9,
    b2=0.999,
    eps=1e-6,
    weight_decay=0.01,
    max_global_norm=1.0,
    exclude_norms_and_biases_from_trust_ratio=True,
    bias_correction=True,
    group_layers=False,
)
RECIPE_ATTENTION_DROPOUT = 0.1
DEFAULT_BATCHES = {"base": {1: 128, 2: 32}, "large": {1: 128, 2: 32}}
SMALL_BATCHES = {1: 8, 2: 2}  # tiny and mini: the CPU smoke


@dataclasses.dataclass(frozen=True)
class StepCase:
    phase: int
    attention: str  # the platform's fused form or "xla"
    grad_accum: int
    layers: str
    batch: int  # sequences per device and micro-batch


class Report:
    """JSON lines on stdout and, as they come, in OUT/results.jsonl."""

    def __init__(self, out_dir: str):
        self.start = time.perf_counter()
        self.path = os.path.join(out_dir, "results.jsonl") if out_dir else None
        self.steps = []  # the step records, for the closing table
        self.failures = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def emit(self, record: dict) -> None:
        self.failures += record.get("ok") is False
        line = json.dumps({**record, "t_s": round(self.elapsed(), 1)}, default=str)
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")

    def failed(self, record: dict, error: Exception) -> None:
        message = f"{type(error).__name__}: {error}"
        self.emit({**record, "ok": False, "error": message[:1500], "trace": _last_frames()})


def _last_frames() -> str:
    return traceback.format_exc()[-1200:]


# ---------------------------------------------------------------------------------------
# Timed pretraining steps


def random_batch(rng, batch: int, seq: int, predictions: int, vocab_size: int) -> dict:
    """A phase's batch of right-padded rows, as the data pipeline gives it."""
    mask = kernel_check.segment_ids(rng, batch, seq, packed=False)
    lengths = mask.sum(1)
    positions = np.stack(
        [
            np.sort(rng.choice(np.arange(1, n), min(predictions, n - 1), replace=False))
            for n in lengths
        ]
    )
    return {
        "input_ids": (rng.integers(5, vocab_size, (batch, seq)) * mask).astype(np.int32),
        "input_mask": mask,
        "segment_ids": ((np.arange(seq)[None] >= lengths[:, None] // 2) * mask).astype(np.int32),
        "masked_lm_positions": positions.astype(np.int32),
        "masked_lm_ids": rng.integers(5, vocab_size, positions.shape).astype(np.int32),
        "masked_lm_weights": np.ones(positions.shape, np.float32),
        "next_sentence_labels": rng.integers(0, 2, (batch,)).astype(np.int32),
    }


def model_config(args, case: StepCase) -> BertConfig:
    dropout = RECIPE_ATTENTION_DROPOUT if case.attention == "xla" else 0.0
    config = BertConfig.preset(
        args.preset,
        vocab_size=args.vocab_size,
        attention=case.attention,
        attention_dropout=dropout,
        scan_layers=LAYERS[case.layers],
    )
    return attention.resolve(config)


def compiled_costs(compiled) -> dict:
    """XLA's own estimate of the step (FLOPs, bytes) and its buffers, where the backend
    reports them."""
    out = {}
    try:
        costs = compiled.cost_analysis()
        costs = costs[0] if isinstance(costs, list | tuple) else costs
        out["xla_flops"] = float(costs.get("flops", 0.0))
        out["xla_bytes_accessed"] = float(costs.get("bytes accessed", 0.0))
    except Exception:  # noqa: BLE001 - not every backend implements it
        pass
    try:
        memory = compiled.memory_analysis()
        total = sum(
            getattr(memory, field, 0) or 0
            for field in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
        )
        out["compiled_memory_gb"] = round(total / 2**30, 3)
    except Exception:  # noqa: BLE001
        pass
    return out


def peak_memory_gb() -> float | None:
    """The device's peak use since the process started (JAX cannot reset it): the largest
    configuration so far, where `compiled_memory_gb` is this step's own."""
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return round(peak / 2**30, 2) if peak else None


def time_step(report: Report, args, case: StepCase, profile: bool) -> dict:
    """Compiles and times one step configuration; returns its record."""
    seq, predictions = PHASES[case.phase]
    config = model_config(args, case)
    schedule = optax.constant_schedule(1e-3)
    recipe = {**vars(NVIDIA_LAMB), "group_layers": case.layers == "grouped"}
    optimizer = make_optimizer(types.SimpleNamespace(**recipe), schedule)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    settings = step_lib.StepSettings(
        model_config=config,
        optimizer=optimizer,
        schedule=schedule,
        grad_accum_steps=case.grad_accum,
    )
    step = jax.jit(functools.partial(step_lib.train_step, settings=settings), donate_argnums=(0,))

    replicated = NamedSharding(mesh, PartitionSpec())
    state = layout.fresh_state(config, optimizer, jax.random.key(0), replicated)
    sequences = case.batch * jax.device_count() * case.grad_accum
    batch = random_batch(np.random.default_rng(0), sequences, seq, predictions, args.vocab_size)
    batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
    rng = jax.random.key(1)

    started = time.perf_counter()
    compiled = step.lower(state, batch, rng).compile()
    compile_s = time.perf_counter() - started
    for _ in range(2):  # warm-up
        state, metrics = compiled(state, batch, rng)
    jax.block_until_ready(state)
    blocked = []
    for _ in range(args.steps):
        started = time.perf_counter()
        state, metrics = compiled(state, batch, rng)
        jax.block_until_ready(state)
        blocked.append(time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(args.steps):  # as the trainer runs them: no wait between steps
        state, metrics = compiled(state, batch, rng)
    jax.block_until_ready(state)
    seconds = (time.perf_counter() - started) / args.steps

    flops = train_step_flops(config, sequences, seq, predictions)
    peak = peak_flops_per_device(args.peak_tflops * 1e12)
    loss = float(jax.device_get(metrics["loss"]))
    record = {
        "check": "step",
        "preset": args.preset,
        **dataclasses.asdict(case),
        "attention_ran": config.attention,
        "attention_dropout": config.attention_dropout,
        "sequences_per_step": sequences,
        "seq": seq,
        "compile_s": round(compile_s, 1),
        "ms_per_step": round(seconds * 1e3, 2),
        "ms_blocked_median": round(statistics.median(blocked) * 1e3, 2),
        "seq_per_s": round(sequences / seconds, 1),
        "mfu": round(flops / seconds / (peak * jax.device_count()), 4) if peak else None,
        "device_peak_gb_so_far": peak_memory_gb(),
        **compiled_costs(compiled),
        "loss": loss,
        "ok": bool(np.isfinite(loss)),
    }
    if profile and args.profile_steps:
        try:  # a profiler that cannot start (no CUPTI, say) leaves the timing standing
            record["profile"] = profile_steps(args, compiled, state, batch, rng)
        except Exception as e:  # noqa: BLE001
            record["profile"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return record


def profile_steps(args, compiled, state, batch, rng) -> dict:
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(args.profile_steps):
                state, _ = compiled(state, batch, rng)
            jax.block_until_ready(state)
        path = trace_summary.latest_xplane(trace_dir)
        if path is None:
            return {"profile": "jax.profiler wrote no .xplane.pb"}
        return trace_summary.summarize(path, args.profile_steps)


def out_of_memory(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def step_cases(args, forms: list[str]) -> list[StepCase]:
    """Every configuration, the most informative first: accumulation 1 per-layer for each
    phase and form, then the scanned layers, then accumulation 4."""
    cases = []
    order = ((1, "unrolled"), (1, "grouped"), (1, "scan"), (4, "unrolled"), (4, "scan"))
    for accum, layers in order:
        if accum not in args.grad_accum or layers not in args.layers:
            continue
        for phase, form in itertools.product(args.phases, forms):
            cases.append(StepCase(phase, form, accum, layers, args.batches[phase]))
    return cases


def run_steps(report: Report, args, forms: list[str]) -> None:
    profiled = set()
    for case in step_cases(args, forms):
        if report.elapsed() > args.time_budget:
            report.emit({"check": "step", **dataclasses.asdict(case), "skipped": "time budget"})
            continue
        first = (case.phase, case.attention) not in profiled
        profiled.add((case.phase, case.attention))
        while True:
            try:
                record = time_step(report, args, case, profile=first)
            except Exception as e:  # noqa: BLE001 - one failure must not end the check
                if out_of_memory(e) and case.batch > 1:
                    report.emit({"check": "step", **dataclasses.asdict(case), "oom": True})
                    case = dataclasses.replace(case, batch=case.batch // 2)
                    continue
                report.failed({"check": "step", **dataclasses.asdict(case)}, e)
                break
            report.emit(record)
            report.steps.append(record)
            break


# ---------------------------------------------------------------------------------------


def table(report: Report) -> str:
    """The step records as a Markdown table, then each profile's summary."""
    lines = [
        "| phase | attention | accum | layers | seq/step | compile s | ms/step | seq/s | MFU "
        "| step GB | idle share |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report.steps:
        idle = r.get("profile", {}).get("idle_share", "")
        lines.append(
            f"| {r['phase']} | {r['attention_ran']} | {r['grad_accum']} | {r['layers']} "
            f"| {r['sequences_per_step']} | {r['compile_s']} | {r['ms_per_step']} "
            f"| {r['seq_per_s']} | {r['mfu']} | {r.get('compiled_memory_gb')} | {idle} |"
        )
    for r in report.steps:
        profile = r.get("profile", {})
        if "ms_per_step_by_class" in profile:
            lines.append(
                f"\nProfile, phase {r['phase']} {r['attention_ran']}: "
                f"{profile['kernels_per_step']} kernels per step, "
                f"{profile['device_busy_ms_per_step']} ms busy of "
                f"{profile['window_ms_per_step']} ms (idle share {profile['idle_share']})"
            )
            by_class = profile["ms_per_step_by_class"]
            lines += [f"  {label}: {ms} ms" for label, ms in by_class.items()]
            lines += [f"  top op {name}: {ms} ms" for name, ms in profile["top_ops"][:5]]
    return "\n".join(lines)


def environment() -> dict:
    import flax
    import jaxlib

    return {
        "check": "environment",
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def positive_ints(parser, flag: str, value: str, valid=None) -> list[int]:
    try:
        items = [int(item) for item in value.split(",") if item.strip()]
    except ValueError:
        parser.error(f"{flag}={value!r}: expected comma-separated integers")
    if not items or any(i <= 0 or (valid and i not in valid) for i in items):
        parser.error(f"{flag}={value!r}: each must be {'one of ' + str(valid) if valid else '> 0'}")
    return items


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="large", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--phases", default="1,2")
    parser.add_argument("--grad-accum", default=",".join(map(str, ACCUMULATION)))
    parser.add_argument("--layers", default=",".join(LAYERS))
    by_preset = "per device; default: by preset"
    parser.add_argument("--phase1-batch", type=int, default=0, help=by_preset)
    parser.add_argument("--phase2-batch", type=int, default=0, help=by_preset)
    parser.add_argument("--kernel-batch", type=int, default=8)
    parser.add_argument("--profile-steps", type=int, default=3, help="0: no profiles")
    parser.add_argument("--time-budget", type=float, default=420.0, help="seconds; see above")
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="default: data sheet")
    parser.add_argument("--out", default="", help="a directory for results.jsonl")
    args = parser.parse_args(argv)
    for flag in ("steps", "kernel_batch", "vocab_size"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be > 0")
    if args.profile_steps < 0 or args.phase1_batch < 0 or args.phase2_batch < 0:
        parser.error("--profile-steps, --phase1-batch and --phase2-batch must be >= 0")
    args.phases = positive_ints(parser, "--phases", args.phases, valid=tuple(PHASES))
    args.grad_accum = positive_ints(parser, "--grad-accum", args.grad_accum)
    args.layers = [item for item in args.layers.split(",") if item]
    if not args.layers or set(args.layers) - set(LAYERS):
        parser.error(f"--layers={','.join(args.layers)!r}: each must be one of {list(LAYERS)}")
    defaults = DEFAULT_BATCHES.get(args.preset, SMALL_BATCHES)
    args.batches = {1: args.phase1_batch or defaults[1], 2: args.phase2_batch or defaults[2]}
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    report = Report(args.out)
    report.emit(environment())
    platform = jax.default_backend()
    form = kernel_check.fused_form(platform)
    for seq, packed in itertools.product((128, 512), (False, True)):
        record = {"check": "kernel", "seq": seq, "rows": "packed" if packed else "padded"}
        try:
            report.emit(record | kernel_check.check(form, seq, packed, args.kernel_batch))
        except Exception as e:  # noqa: BLE001 - one failure must not end the check
            report.failed(record, e)
    run_steps(report, args, [form, "xla"] if form else ["xla"])
    summary = table(report)
    print("\n" + summary, flush=True)
    if args.out:
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(summary + "\n")
    print(
        f"{len(report.steps)} step configurations measured, {report.failures} checks failed, "
        f"in {report.elapsed():.0f} s"
    )
    return 1 if report.failures else 0


if __name__ == "__main__":
    xla_flags.apply(distributed.platform())  # as lambjax.main does, before JAX's backend starts
    raise SystemExit(main())
