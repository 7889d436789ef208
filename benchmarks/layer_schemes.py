"""Progressive layer dropping and multi-stage layerwise training against the plain baseline.

  python benchmarks/layer_schemes.py [--steps 240] [--scheme-steps 360] [--layers 8]
      [--workdir DIR]

Trains one PreLN BERT (hidden 128, 2 heads, MLP 512, `--layers` layers, sequence 128,
batch 32) on the embedded corpus three ways, in this one run, with the same data, seed and
learning-rate schedule shape (LAMB, NVIDIA's settings):

  baseline  every layer, every step, `--steps` steps;
  pld       progressive layer dropping, theta_bar 0.5, gamma 100 / steps (the `pld` variant);
  mslt      the `mslt` variant: 3 stages over the first 3/4 of the steps (depth L/4, L/2, L,
            each training only its new layers), then every layer for the last quarter.

The two schemes train `--scheme-steps` steps: their steps are cheaper, and the question is
whether they reach the baseline's loss sooner in wall-clock time, which a scheme cut off at
the baseline's step count cannot show.

Reported: time per sample (the median logged train-step time, compilation excluded), per
MSLT stage too; the held-out MLM loss at the end; and the training time each scheme
needs to reach the baseline's final held-out MLM loss, and the other way round: the time
the baseline needed to reach each scheme's final loss (evaluations every `--eval-every` steps
on the same held-out batches; evaluation time is not counted). `--report-only` prints the
tables again from the runs in `--workdir`.
"""

import argparse
import os
import tempfile

import numpy as np

from lambjax import host_memory
from lambjax.train import config as config_lib
from lambjax.train import recipes, trainer
from lambjax.train.metrics import read_jsonl

LOG_EVERY = 5


def base(args, data_dir: str, steps: int):
    config = config_lib.base_config()
    config.model.preset = "tiny"
    config.model.overrides.update(
        {"dtype": "float32", "num_layers": args.layers, "layer_norm": "pre"}
    )
    config.data.source = "embedded"
    config.data.vocab_size = 4096
    config.data.data_dir = data_dir
    config_lib.with_phases(
        config,
        phase1=config_lib.phase_config(
            max_seq_length=128,
            max_predictions_per_seq=20,
            global_batch_size=32,
            num_steps=steps,
            learning_rate=1e-2,
            warmup_fraction=0.1,
        ),
    )
    config.log_every_steps = LOG_EVERY
    config.eval_every_steps = args.eval_every
    config.eval_batch_size = 32
    config.eval_steps = args.eval_batches
    config.checkpoint_every_steps = steps
    config.async_checkpointing = False
    return config


def schemes(args, data_dir: str) -> dict:
    steps = args.scheme_steps
    mslt = base(args, data_dir, steps)
    # The MSLT stages take the first 3/4 of the steps; the last quarter trains every layer.
    stage_steps = steps * 3 // 4
    config_lib.with_phases(
        mslt,
        phase1=mslt.phases.phase1,
        final=config_lib.phase_config(
            max_seq_length=128,
            max_predictions_per_seq=20,
            global_batch_size=32,
            num_steps=steps - stage_steps,
            learning_rate=1e-2,
            warmup_fraction=0.1,
        ),
    )
    mslt.phases.phase1.num_steps = stage_steps
    return {
        "baseline": base(args, data_dir, args.steps),
        "pld": recipes.layer_drop(base(args, data_dir, steps)),
        "mslt": recipes.multi_stage(mslt),
    }


def phase_times(records: dict, config) -> dict[str, tuple[int, float]]:
    """Phase -> (steps, seconds of training): steps x the median logged step time.

    The median over the log windows of a phase leaves out its first window (which holds
    the compilation) and is robust to other work on the machine slowing a few windows.
    """
    out, first = {}, 1
    for name in config.phase_order:
        steps = config.phases[name].num_steps
        windows = [
            records[s]["train/step_time_s"]
            for s in range(first + LOG_EVERY - 1, first + steps, LOG_EVERY)
            if "train/step_time_s" in records.get(s, {})
        ]
        out[name] = (steps, steps * float(np.median(windows)))
        first += steps
    return out


def time_to_loss(records: dict, config, target: float) -> float | None:
    """Training seconds until the first evaluation at or below `target` (None: never)."""
    boundaries, first = [], 1
    for name in config.phase_order:
        boundaries.append((first, first + config.phases[name].num_steps - 1))
        first += config.phases[name].num_steps
    per_step = []
    for (start, end), (steps, seconds) in zip(
        boundaries, phase_times(records, config).values(), strict=True
    ):
        per_step += [seconds / steps] * (end - start + 1)
    for step in sorted(records):
        loss = records[step].get("eval/mlm_loss")
        if loss is not None and loss <= target:
            return float(np.sum(per_step[:step]))
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--scheme-steps", type=int, default=360)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--workdir", default=None, help="default: a temporary directory")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="print the tables of the runs already in --workdir (same flags), train nothing",
    )
    args = parser.parse_args()
    host_memory.retain_freed_memory()  # before JAX starts, as lambjax.main does on CPU
    root = args.workdir or tempfile.mkdtemp(prefix="layer_schemes_")
    data_dir = os.path.join(root, "datasets")
    results = {}
    for name, config in schemes(args, data_dir).items():
        workdir = os.path.join(root, name)
        finished = os.path.exists(os.path.join(workdir, "metrics.jsonl"))
        if args.report_only != finished:
            raise SystemExit(
                f"{workdir}: "
                + (
                    "no run to report"
                    if args.report_only
                    else "holds an earlier "
                    "run; pass another --workdir, or --report-only to print its tables"
                )
            )
        if not args.report_only:
            trainer.train_and_evaluate(config, workdir)
        results[name] = (config, read_jsonl(os.path.join(workdir, "metrics.jsonl")))

    samples = 32
    baseline_config, baseline_records = results["baseline"]
    base_steps, base_seconds = phase_times(baseline_records, baseline_config)["phase1"]
    base_ms = base_seconds / (base_steps * samples) * 1e3
    final_eval = {
        name: [r["eval/mlm_loss"] for _, r in sorted(recs.items()) if "eval/mlm_loss" in r][-1]
        for name, (_, recs) in results.items()
    }
    target = final_eval["baseline"]
    print(f"\n{args.layers}-layer PreLN BERT (H128, A2, I512), sequence 128, batch {samples}")
    print(f"target: the baseline's final held-out MLM loss, {target:.3f}\n")
    print(
        "| scheme | steps | ms / sample | vs baseline | train time (s) | final held-out MLM "
        "loss | time to target (s) | speed-up to target | baseline time to this loss (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (config, records) in results.items():
        times = phase_times(records, config)
        steps = sum(s for s, _ in times.values())
        seconds = sum(t for _, t in times.values())
        ms = seconds / (steps * samples) * 1e3
        reach = time_to_loss(records, config, target)
        reach_text = f"{reach:.1f}" if reach is not None else "not reached"
        baseline_time = time_to_loss(baseline_records, baseline_config, final_eval[name])
        baseline_text = f"{baseline_time:.1f}" if baseline_time is not None else "not reached"
        speedup = (
            f"{time_to_loss(baseline_records, baseline_config, target) / reach:.2f}x"
            if reach
            else "-"
        )
        print(
            f"| {name} | {steps} | {ms:.2f} | {ms / base_ms:.2f}x | {seconds:.1f} | "
            f"{final_eval[name]:.3f} | {reach_text} | {speedup} | {baseline_text} |"
        )
    mslt_config, mslt_records = results["mslt"]
    print("\nMSLT stages:\n")
    print("| stage | layers (trained) | steps | ms / sample | vs baseline |")
    print("|---|---|---:|---:|---:|")
    for name, (steps, seconds) in phase_times(mslt_records, mslt_config).items():
        phase = mslt_config.phases[name]
        depth = phase.num_layers or args.layers
        ms = seconds / (steps * samples) * 1e3
        print(
            f"| {name} | {depth} ({depth - phase.frozen_layers}) | {steps} | {ms:.2f} | "
            f"{ms / base_ms:.2f}x |"
        )
    pld_records = results["pld"][1]
    run = [r["train/pld_layers_run"] for r in pld_records.values() if "train/pld_layers_run" in r]
    print(f"\nPLD: mean layers run per step {np.mean(run):.2f} of {args.layers}")


if __name__ == "__main__":
    main()
