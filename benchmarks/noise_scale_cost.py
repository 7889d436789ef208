"""What measuring the gradient noise scale costs a train step: time per step with and
without `config.noise_scale.enabled`, in the same run, and the extra work in the compiled
step.

  python benchmarks/noise_scale_cost.py [--preset tiny] [--accum 2,4] [--steps 20] [--rounds 4]

The demo's phase-1 step (batch 32, sequence 128, 20 predictions, LAMB, per-layer trees,
bfloat16 compute) is jitted both ways; the two take turns for `--rounds`
rounds, so the machine's drift hits both alike, and the median step is reported with
their ratio. The extra work is counted in the compiled CPU step: its reductions (fusions
with a reduce, and dots: the micro-batch gradients' squared norms are one of either per
parameter leaf and micro-batch).
"""

import argparse
import functools
import json
import re
import statistics
import time

import jax
import numpy as np
import optax

from lambjax import host_memory
from lambjax.models import layer_layout
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params
from lambjax.train import step as step_lib
from lambjax.train.config import optimizer_config
from lambjax.train.optimizer import make_optimizer
from lambjax.train.state import TrainState

BATCH, SEQ, PREDICTIONS, VOCAB = 32, 128, 20, 4096


def batch(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    positions = np.sort(
        np.stack([rng.choice(np.arange(1, SEQ), PREDICTIONS, replace=False) for _ in range(BATCH)])
    )
    return {
        "input_ids": rng.integers(5, VOCAB, (BATCH, SEQ), dtype=np.int32),
        "input_mask": np.ones((BATCH, SEQ), np.int32),
        "segment_ids": (np.arange(SEQ)[None] >= SEQ // 2).astype(np.int32).repeat(BATCH, 0),
        "masked_lm_positions": positions.astype(np.int32),
        "masked_lm_ids": rng.integers(5, VOCAB, (BATCH, PREDICTIONS), dtype=np.int32),
        "masked_lm_weights": np.ones((BATCH, PREDICTIONS), np.float32),
        "next_sentence_labels": rng.integers(0, 2, (BATCH,), dtype=np.int32),
    }


def compiled_step(model_config, accum: int, noise_scale: bool, state, example):
    optimizer = make_optimizer(optimizer_config("lamb"), optax.constant_schedule(1e-3))
    settings = step_lib.StepSettings(
        model_config=model_config,
        optimizer=optimizer,
        schedule=optax.constant_schedule(1e-3),
        grad_accum_steps=accum,
        options=step_lib.StepOptions(noise_scale_ema_decay=0.95 if noise_scale else None),
    )
    step = jax.jit(functools.partial(step_lib.train_step, settings=settings))
    return step.lower(state, example, jax.random.key(0)).compile()


def reductions(compiled) -> int:
    """Fusions with a reduce, and dots, anywhere in the compiled step (loop bodies too)."""
    text = compiled.as_text()
    fused_reduces = re.findall(
        r"^\s*(?:ROOT )?%?[\w.-]*reduce[\w.-]* = [^\n]* fusion\(", text, re.M
    )
    dots = re.findall(r" = [^\n]* dot\(", text)
    return len(fused_reduces) + len(dots)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--accum", default="2,4")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    host_memory.retain_freed_memory()
    model_config = BertConfig.preset(args.preset, vocab_size=VOCAB, scan_layers=False)
    example = batch(0)
    print(f"device: {jax.devices()[0].device_kind}; BERT-{args.preset}, batch {BATCH} x {SEQ}")
    print(
        "| accumulation | step without (ms) | step with (ms) | with / without | extra reductions |"
    )
    print("|---:|---:|---:|---:|---:|")
    for accum in [int(a) for a in args.accum.split(",")]:
        params = layer_layout.unstack_layers(init_params(model_config, jax.random.key(0)))
        steps, states, counts = {}, {}, {}
        for enabled in (False, True):
            optimizer = make_optimizer(optimizer_config("lamb"), optax.constant_schedule(1e-3))
            states[enabled] = TrainState.create(jax.tree.map(jax.numpy.copy, params), optimizer)
            steps[enabled] = compiled_step(model_config, accum, enabled, states[enabled], example)
            counts[enabled] = reductions(steps[enabled])
        times = {False: [], True: []}
        per_round = max(1, -(-args.steps // args.rounds))
        for round_index in range(args.rounds + 1):  # round 0 warms up
            order = (False, True) if round_index % 2 else (True, False)
            for enabled in order:
                for _ in range(per_round):
                    start = time.perf_counter()
                    states[enabled], metrics = steps[enabled](
                        states[enabled], example, jax.random.key(round_index)
                    )
                    jax.block_until_ready(metrics)
                    if round_index:
                        times[enabled].append(time.perf_counter() - start)
        without, with_ = (statistics.median(times[e]) * 1e3 for e in (False, True))
        extra = counts[True] - counts[False]
        print(f"| {accum} | {without:.1f} | {with_:.1f} | {with_ / without:.3f} | {extra} |")
        print(
            json.dumps(
                {"accum": accum, "without_ms": without, "with_ms": with_, "extra_reductions": extra}
            )
        )


if __name__ == "__main__":
    main()
