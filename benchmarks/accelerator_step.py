"""Sequences/s and MFU of BERT pretraining steps on this machine's accelerators, one JSON
line per configuration, with the peer a JAX user would pick measured in the same run.

  python benchmarks/accelerator_step.py                       # BERT-large phase 1, LAMB
  python benchmarks/accelerator_step.py --presets base,large --phases 1,2 \\
      --optimizers lamb,lans,adamw --attention xla,auto --layers scan,unrolled --remat off \\
      --batch-per-device 64,128 --grad-accum 1,4 --peer --out steps.jsonl

Every combination of the comma-separated lists runs: one jitted step as the trainer runs
it (MLM + NSP forward and backward in bfloat16 with float32 parameters, the optimizer with
NVIDIA's settings, the batch split over all local devices, `--grad-accum` micro-batches per
update as the recipe accumulates). Phase 1 is sequence 128 with 20 predictions, phase 2
sequence 512 with 80; `--batch-per-device` is the micro-batch per device (default: the
recipe's, 64 and 8). Attention: `xla` is the einsum form with `--attention-dropout` (the
recipe's 0.1); `auto`, `cudnn` and `splash` run without attention dropout (the `fast`
variant), `auto` picking the platform's kernel (the JSON line names the one it ran).

Each line: the configuration, the median step time over `--steps` steps after two warm-up
steps, sequences/s, achieved TFLOP/s per device (lambjax's exact matmul count) and MFU
against the device's data-sheet bf16 peak (lambjax.train.throughput; `--peak-tflops` for a
device not in its table, null where unknown). `--peer` adds Hugging Face's Flax BERT for
pretraining with optax.lamb (as benchmarks/train_step.py runs it; installed on first use
into .venv-hf/) at each preset, phase and batch, and each lambjax line then carries its
ratio to it. `--profile DIR` writes a JAX profile of each configuration's timed steps.
"""

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import sys

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from train_step import (
    HF_DIR,
    hf_pretraining_step,
    install_hf,
    median_step_seconds,
    random_batch,
)

from lambjax import distributed, xla_flags
from lambjax.models import attention
from lambjax.models.config import PRESETS, BertConfig
from lambjax.train import layout
from lambjax.train import step as step_lib
from lambjax.train.config import OPTIMIZERS, optimizer_config
from lambjax.train.optimizer import make_optimizer
from lambjax.train.throughput import peak_flops_per_device, train_step_flops

PHASES = {"1": (128, 20, 64), "2": (512, 80, 8)}  # sequence, predictions, recipe micro-batch
LAYERS = {"scan": True, "unrolled": False}
REMAT = {"off": False, "on": True}


@dataclasses.dataclass(frozen=True)
class Case:
    preset: str
    phase: str
    optimizer: str
    attention: str
    layers: str
    remat: str
    batch_per_device: int
    grad_accum: int


def model_config(case: Case, args) -> BertConfig:
    dropout = args.attention_dropout if case.attention == "xla" else 0.0
    return BertConfig.preset(
        case.preset,
        vocab_size=args.vocab_size,
        scan_layers=LAYERS[case.layers],
        remat=REMAT[case.remat],
        hidden_dropout=args.hidden_dropout,
        attention_dropout=dropout,
        attention=case.attention,
    )


def profiled(args, name):
    if not args.profile:
        return contextlib.nullcontext()
    return jax.profiler.trace(os.path.join(args.profile, name))


def lambjax_seconds(case: Case, config: BertConfig, args) -> float:
    seq, predictions, _ = PHASES[case.phase]
    schedule = optax.constant_schedule(1e-3)
    optimizer = make_optimizer(optimizer_config(case.optimizer), schedule)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    train_step = jax.jit(
        functools.partial(
            step_lib.train_step,
            settings=step_lib.StepSettings(
                model_config=config,
                optimizer=optimizer,
                schedule=schedule,
                grad_accum_steps=case.grad_accum,
            ),
        ),
        donate_argnums=(0,),
    )

    replicated = NamedSharding(mesh, PartitionSpec())
    state = layout.fresh_state(config, optimizer, jax.random.key(0), replicated)
    global_batch = case.batch_per_device * jax.device_count() * case.grad_accum
    batch = random_batch(global_batch, seq, predictions)
    batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
    with profiled(args, "_".join(str(v) for v in dataclasses.astuple(case))):
        return median_step_seconds(
            lambda s, b, r: train_step(s, b, r)[0], state, batch, jax.random.key(1), args.steps
        )


def peer_seconds(preset: str, phase: str, batch_per_device: int, args) -> float:
    """HF's FlaxBertForPreTraining with optax.lamb, bfloat16 compute, on one device's batch
    (its step has no data parallelism); MLM and NSP losses as benchmarks/train_step.py."""
    if not os.path.isdir(os.path.join(HF_DIR, "transformers")):
        install_hf()
    sys.path.insert(0, HF_DIR)
    from transformers import BertConfig

    sizes = PRESETS[preset]
    seq, predictions, _ = PHASES[phase]
    config = BertConfig(
        vocab_size=args.vocab_size,
        num_hidden_layers=sizes["num_layers"],
        hidden_size=sizes["hidden_size"],
        num_attention_heads=sizes["num_heads"],
        intermediate_size=sizes["intermediate_size"],
        hidden_dropout_prob=args.hidden_dropout,
        attention_probs_dropout_prob=args.attention_dropout,
    )
    step, state = hf_pretraining_step(config, "bfloat16")
    batch = random_batch(batch_per_device, seq, predictions)
    with profiled(args, f"peer_{preset}_{phase}_{batch_per_device}"):
        return median_step_seconds(step, state, batch, jax.random.key(1), args.steps)


def measurement(config, case_fields: dict, sequences: int, flops: int, seconds: float, peak):
    devices = jax.device_count()
    achieved = flops / seconds / devices
    return {
        **case_fields,
        "device": f"{devices} x {jax.devices()[0].device_kind}",
        "global_batch": sequences,
        "ms_per_step": round(seconds * 1e3, 2),
        "sequences_per_s": round(sequences / seconds, 1),
        "tflops_per_device": round(achieved / 1e12, 2),
        "mfu": round(achieved / peak, 4) if peak else None,
        "attention_dropout": config.attention_dropout if config else None,
    }


def emit(record: dict, out) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        out.write(line + "\n")
        out.flush()


def parse_list(parser, flag, value, valid=None, kind=str):
    items = [item.strip() for item in value.split(",") if item.strip()]
    try:
        items = [kind(item) for item in items]
    except ValueError:
        parser.error(f"{flag}={value!r}: expected comma-separated {kind.__name__}s")
    for item in items:
        if (valid is not None and item not in valid) or (kind is int and item <= 0):
            valid_text = sorted(valid) if valid is not None else "positive integers"
            parser.error(f"{flag}={value!r}: {item!r} is not one of {valid_text}")
    if not items:
        parser.error(f"{flag}={value!r}: empty")
    return items


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="large")
    parser.add_argument("--phases", default="1")
    parser.add_argument("--optimizers", default="lamb")
    parser.add_argument("--attention", default="xla,auto")
    parser.add_argument("--layers", default="unrolled")
    parser.add_argument("--remat", default="off")
    parser.add_argument("--batch-per-device", default="", help="default: the recipe's")
    parser.add_argument("--grad-accum", default="1")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--hidden-dropout", type=float, default=0.1)
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    parser.add_argument("--peak-tflops", type=float, default=0.0)
    parser.add_argument("--peer", action="store_true", help="HF Flax BERT + optax.lamb too")
    parser.add_argument("--profile", default="", help="a directory for JAX profiles")
    parser.add_argument("--out", default="", help="also append the JSON lines to this file")
    args = parser.parse_args(argv)
    presets = parse_list(parser, "--presets", args.presets, PRESETS)
    phases = parse_list(parser, "--phases", args.phases, PHASES)
    optimizers = parse_list(parser, "--optimizers", args.optimizers, OPTIMIZERS)
    forms = parse_list(parser, "--attention", args.attention, attention.FORMS)
    layers = parse_list(parser, "--layers", args.layers, LAYERS)
    remats = parse_list(parser, "--remat", args.remat, REMAT)
    accums = parse_list(parser, "--grad-accum", args.grad_accum, kind=int)
    batches = (
        parse_list(parser, "--batch-per-device", args.batch_per_device, kind=int)
        if args.batch_per_device
        else [None]
    )
    if args.steps <= 0:
        parser.error(f"--steps={args.steps}: must be positive")
    platform = jax.default_backend()
    for form in forms:
        try:  # a kernel this platform cannot run is refused before anything runs
            attention.choose(
                form, 0.0 if form != "xla" else args.attention_dropout, "bfloat16", 64, platform
            )
        except ValueError as e:
            parser.error(f"--attention={args.attention!r}: {e}")
    peak = peak_flops_per_device(args.peak_tflops * 1e12)
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 (closed below)
    try:
        for preset, phase, batch in itertools.product(presets, phases, batches):
            seq, predictions, recipe_batch = PHASES[phase]
            batch = batch or recipe_batch
            peer = None
            if args.peer:
                seconds = peer_seconds(preset, phase, batch, args)
                flops = train_step_flops(
                    BertConfig.preset(preset, vocab_size=args.vocab_size),
                    batch,
                    seq,
                    predictions,
                )
                fields = dict(
                    side="peer: transformers FlaxBertForPreTraining + optax.lamb",
                    preset=preset,
                    phase=phase,
                    batch_per_device=batch,
                    optimizer="optax.lamb",
                    attention="xla",
                    layers="unrolled",
                    remat="off",
                    grad_accum=1,
                )
                record = measurement(None, fields, batch, flops, seconds, peak)
                record["device"] = f"1 x {jax.devices()[0].device_kind}"
                record["attention_dropout"] = args.attention_dropout
                emit(record, out)
                peer = record["sequences_per_s"]
            for optimizer, form, layer, remat, accum in itertools.product(
                optimizers, forms, layers, remats, accums
            ):
                case = Case(preset, phase, optimizer, form, layer, remat, batch, accum)
                config = attention.resolve(model_config(case, args), platform)
                seconds = lambjax_seconds(case, config, args)
                sequences = batch * jax.device_count() * accum
                flops = train_step_flops(config, sequences, seq, predictions)
                record = measurement(
                    config,
                    {
                        "side": "lambjax",
                        **dataclasses.asdict(case),
                        "attention_ran": config.attention,
                    },
                    sequences,
                    flops,
                    seconds,
                    peak,
                )
                if peer:  # per device, as the peer runs on one
                    record["vs_peer"] = round(
                        record["sequences_per_s"] / jax.device_count() / peer, 3
                    )
                emit(record, out)
    finally:
        if out:
            out.close()


if __name__ == "__main__":
    xla_flags.apply(distributed.platform())  # as lambjax.main, before JAX's backend starts
    main()
