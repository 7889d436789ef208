"""Step time and MFU of BERT pretraining on this machine's accelerators.

  python benchmarks/accelerator_step.py [--preset large] [--batch-per-device 64]
      [--seq 128] [--predictions 20] [--optimizer lamb] [--layers scan,unrolled]
      [--remat off,on] [--steps 20]

One jitted step is what the trainer runs: MLM + NSP forward and backward in bfloat16 with
float32 parameters, and the optimizer update with NVIDIA's settings, data-parallel over
all local devices (the batch split over a `data` mesh axis, the state replicated). For each
layer form and remat setting it prints the median step time, sequences/s, the achieved
FLOP/s (lambjax's exact matmul count) and MFU against the device's data-sheet bf16 peak
(lambjax.train.throughput; `--peak-tflops` for a device not in its table).
"""

import argparse
import functools
import itertools

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from train_step import median_step_seconds, random_batch

from lambjax.models import bert
from lambjax.train import step as step_lib
from lambjax.train.config import optimizer_config
from lambjax.train.optimizer import make_optimizer
from lambjax.train.state import TrainState
from lambjax.train.throughput import peak_flops_per_device, train_step_flops


def step_seconds(args, scan_layers: bool, remat: bool) -> float:
    """Median seconds of one train step over `args.steps` steps, after two warm-up steps."""
    config = bert.BertConfig.preset(
        args.preset,
        scan_layers=scan_layers,
        remat=remat,
        hidden_dropout=args.dropout,
        attention_dropout=args.dropout,
    )
    schedule = optax.constant_schedule(1e-3)
    optimizer = make_optimizer(optimizer_config(args.optimizer), schedule)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    train_step = jax.jit(
        functools.partial(
            step_lib.train_step,
            model_config=config,
            optimizer=optimizer,
            schedule=schedule,
            grad_accum_steps=1,
        ),
        donate_argnums=(0,),
    )
    state = jax.jit(
        lambda key: TrainState.create(bert.init_params(config, key), optimizer),
        out_shardings=replicated,
    )(jax.random.key(0))
    batch = random_batch(args.batch_per_device * jax.device_count(), args.seq, args.predictions)
    batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
    return median_step_seconds(
        lambda s, b, r: train_step(s, b, r)[0], state, batch, jax.random.key(1), args.steps
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="large", choices=sorted(bert.PRESETS))
    parser.add_argument("--batch-per-device", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--predictions", type=int, default=20)
    parser.add_argument("--optimizer", default="lamb", choices=["lamb", "lans"])
    parser.add_argument("--layers", default="scan,unrolled")
    parser.add_argument("--remat", default="off")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--peak-tflops", type=float, default=0.0)
    args = parser.parse_args()
    layer_forms = {"scan": True, "unrolled": False}
    remats = {"off": False, "on": True}
    for flag, value, valid in (
        ("--layers", args.layers, layer_forms),
        ("--remat", args.remat, remats),
    ):
        for item in value.split(","):
            if item not in valid:
                parser.error(f"{flag}={value!r}: {item!r} is not one of {sorted(valid)}")

    devices = jax.device_count()
    peak = peak_flops_per_device(args.peak_tflops * 1e12)
    global_batch = args.batch_per_device * devices
    config = bert.BertConfig.preset(args.preset)
    flops = train_step_flops(config, global_batch, args.seq, args.predictions)
    peak_text = f"peak {peak / 1e12:.0f} TFLOP/s per device" if peak else "peak unknown"
    print(
        f"{args.preset}: {devices} x {jax.devices()[0].device_kind}, batch {global_batch} "
        f"x seq {args.seq} ({args.predictions} predictions), bfloat16 compute, "
        f"dropout {args.dropout}, {args.optimizer}; {flops / 1e12:.2f} TFLOP per step; {peak_text}"
    )
    print("| layers | remat | ms / step | sequences / s | TFLOP/s per device | MFU |")
    print("|---|---|---:|---:|---:|---:|")
    for form, remat in itertools.product(args.layers.split(","), args.remat.split(",")):
        seconds = step_seconds(args, layer_forms[form], remats[remat])
        achieved = flops / seconds / devices
        mfu = f"{achieved / peak:.1%}" if peak else "-"
        print(
            f"| {form} | {remat} | {seconds * 1e3:.1f} | {global_batch / seconds:,.0f} | "
            f"{achieved / 1e12:.1f} | {mfu} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
