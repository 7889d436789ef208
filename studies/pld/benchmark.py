"""Progressive layer dropping and multi-stage layerwise training against the plain baseline.

  python -m studies.pld.benchmark [--steps 240] [--scheme-steps 360] [--layers 8]
      [--dtype bfloat16|float32] [--timing-rounds 20] [--workdir DIR] [--report-only]
  python -m studies.pld.benchmark --sweep DIR [--timing-rounds 20]

Trains one PreLN BERT (hidden 128, 2 heads, MLP 512, `--layers` layers run unrolled,
computing in `--dtype` (the model's default, bfloat16) with float32 parameters, sequence
128, batch 32) on the embedded corpus three ways, in this one run, with the same
data, seed and learning-rate schedule shape (LAMB, NVIDIA's settings):

  baseline  every layer, every step, `--steps` steps;
  pld       progressive layer dropping, theta_bar 0.5, gamma 100 / steps (the `pld` variant);
  mslt      the `mslt` variant: 3 stages over the first 3/4 of the steps (depth L/4, L/2, L,
            each training only its new layers), then every layer for the last quarter.

The two schemes train `--scheme-steps` steps: their steps are cheaper, and the question is
whether they reach the baseline's loss sooner in wall-clock time, which a scheme cut off at
the baseline's step count cannot show.

Time per step is measured after the runs, round-robin: one step of every phase of every
scheme in turn, `--timing-rounds` times, each built as the trainer builds it, on a real
batch (PLD at theta_bar, where gamma = 100 / T puts it after the first 2% of steps). The
runs take minutes each, one after the other, and this VM's speed drifts by 10-20% over
such spans; interleaving lets the drift fall on every scheme alike.

Reported: time per sample, per MSLT stage too; the held-out MLM loss at the end; the
training time each scheme needs to reach the baseline's final held-out MLM loss (steps to
the first evaluation at or below it, times the step time of each phase), and the other way
round: the time the baseline needs to reach each scheme's final loss (evaluations every
`--eval-every` steps on the same held-out batches); and, for reference, each run's logged
wall-clock training time. `--report-only` prints the tables again from the runs in
`--workdir` (the step times are measured again).

`--sweep DIR` trains nothing: it times the arms of the study sweep in DIR (e.g.
studies/pld/config.py's PostLN, PreLN and PreLN + PLD) the same way, round-robin, each
built from its first trial's config as `lambjax.main` builds it, and writes
DIR/step_times.json for the study's report (studies.curves.step_times), so that the
step-time ratio does not depend on the load each trial happened to run at.
"""

import argparse
import datetime
import json
import os
import tempfile
import time

import jax
import numpy as np
from absl import flags
from etils import epath
from ml_collections import config_flags

from lambjax import data, host_memory, storage
from lambjax.models.params import init_params
from lambjax.sweep import runner, spec
from lambjax.train import config as config_lib
from lambjax.train import phases, plan, trainer, variants
from lambjax.train.metrics import read_jsonl
from lambjax.train.state import TrainState
from studies import curves

LOG_EVERY = 5


def base(args, data_dir: str, steps: int):
    config = config_lib.base_config()
    config.model.preset = "tiny"
    # Layers unrolled: on XLA:CPU an 8-layer H128 step takes 15% less time than under
    # lax.scan, and a dropped layer's lax.cond costs nothing there (in the scan it costs 7%).
    config.model.overrides.update(
        {"dtype": args.dtype, "num_layers": args.layers, "layer_norm": "pre", "scan_layers": False}
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
        "pld": variants.layer_drop(base(args, data_dir, steps)),
        "mslt": variants.multi_stage(mslt),
    }


def compiled_step(config, phase: phases.Phase):
    """(the phase's jitted train step, a fresh state, one real batch), warmed up."""
    step = jax.jit(phase.train_step(), donate_argnums=(0,))
    params = init_params(phase.model_config, jax.random.key(config.seed))
    state = TrainState.create(params, phase.optimizer, phase.num_frozen_layers)
    state = state.replace(step=state.step + phase.plan.num_steps)  # PLD: theta at theta_bar
    batch = next(
        data.make_iterator(
            phase.prepared,
            split="train",
            global_batch_size=phase.plan.batch.global_batch_size,
            max_predictions_per_seq=phase.plan.batch.max_predictions_per_seq,
            seed=config.seed,
        )
    )
    for _ in range(2):
        state, _ = step(state, batch, jax.random.key(0))
    return step, jax.block_until_ready(state), batch


def step_seconds(schemes: dict, rounds: int) -> dict[tuple[str, str], float]:
    """(scheme, phase) -> median seconds of one train step, timed round-robin."""
    steps = {}
    for scheme, config in schemes.items():
        vocab_size = phases.prepare_vocabulary(config.data).size
        run = plan.resolve(config, vocab_size=vocab_size, num_devices=jax.device_count())
        datasets = phases.prepare_data(run)
        for phase_plan in run.phases:
            phase = phases.build_phase(phase_plan, datasets[phase_plan.batch.max_seq_length])
            steps[scheme, phase.name] = compiled_step(config, phase)
    times = {key: [] for key in steps}
    for round_index in range(rounds):
        for key, (step, state, batch) in steps.items():
            start = time.perf_counter()
            state, _ = step(state, batch, jax.random.key(round_index))
            jax.block_until_ready(state)
            times[key].append(time.perf_counter() - start)
            steps[key] = (step, state, batch)
    return {key: float(np.median(seconds)) for key, seconds in times.items()}


def sweep_arms(directory: str) -> dict:
    """arm (curves.arm_of) -> the config of the arm's first trial in the sweep in
    `directory`: the sweep's config file and flags, then the trial's overrides."""
    state = json.loads((epath.Path(directory) / runner.SWEEP_FILE).read_text())
    arms = {}
    for name, trial in state["trials"].items():
        arm = curves.arm_of(trial["labels"]) if trial.get("labels") else name
        if arm not in arms:
            overrides = spec.Trial(name, trial["overrides"]).flags()
            arms[arm] = trial_config(state["config"], [*state["flags"], *overrides])
    return arms


def trial_config(config_spec: str, overrides: list[str]):
    """The config `lambjax.main --config=SPEC OVERRIDES...` trains."""
    argv = ["studies.pld.benchmark", f"--config={config_spec}", *overrides]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=values, sys_argv=argv)
    values(argv)
    return values.config


def time_sweep(directory: str, rounds: int) -> None:
    """Times the arms of the sweep in `directory` round-robin; writes step_times.json."""
    arms = sweep_arms(directory)
    load_before = os.getloadavg()
    seconds = step_seconds(arms, rounds)
    load_after = os.getloadavg()
    by_arm = {}
    for (arm, phase), value in seconds.items():
        single = len(arms[arm].phase_order) == 1
        by_arm[arm if single else f"{arm},phase={phase}"] = value
    result = {
        "step_time_s": by_arm,
        "rounds": rounds,
        "method": "one step of each arm in turn, in one process; the median of the rounds",
        "load_average": [load_before[0], load_after[0]],
        "date": datetime.date.today().isoformat(),
    }
    storage.write_text(epath.Path(directory) / curves.STEP_TIMES_FILE, json.dumps(result, indent=2))
    baseline = next(iter(by_arm.values()))
    print(
        f"\nstep times, {rounds} rounds round-robin; load average {load_before[0]:.1f} "
        f"before, {load_after[0]:.1f} after\n"
    )
    print("| arm | step time (ms) | vs the first arm |")
    print("|---|---:|---:|")
    for arm, value in by_arm.items():
        print(f"| {arm} | {1000 * value:.1f} | {value / baseline:.2f}x |")
    print(f"\nwritten: {directory}/{curves.STEP_TIMES_FILE}")


def seconds_per_step(config, phase_seconds: dict[str, float]) -> list[float]:
    """The step time of every optimizer step of a run, by the phase it belongs to."""
    return [
        phase_seconds[name]
        for name in config.phase_order
        for _ in range(config.phases[name].num_steps)
    ]


def time_to_loss(records: dict, per_step: list[float], target: float) -> float | None:
    """Training seconds until the first evaluation at or below `target` (None: never)."""
    for step in sorted(records):
        loss = records[step].get("eval/mlm_loss")
        if loss is not None and loss <= target:
            return float(np.sum(per_step[:step]))
    return None


def logged_seconds(records: dict) -> float:
    """Wall-clock training time of a run as logged (log windows x their mean step time)."""
    windows = [r["train/step_time_s"] for r in records.values() if "train/step_time_s" in r]
    return float(np.sum(windows) * LOG_EVERY)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--scheme-steps", type=int, default=360)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--timing-rounds", type=int, default=20)
    parser.add_argument("--workdir", default=None, help="default: a temporary directory")
    parser.add_argument(
        "--sweep",
        default=None,
        help="time the arms of the study sweep in this directory; train nothing",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="print the tables of the runs already in --workdir (same flags), train nothing",
    )
    args = parser.parse_args()
    host_memory.retain_freed_memory()  # before JAX starts, as lambjax.main does on CPU
    if args.sweep:
        return time_sweep(args.sweep, args.timing_rounds)
    root = args.workdir or tempfile.mkdtemp(prefix="pld_benchmark_")
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
    configs = {name: config for name, (config, _) in results.items()}
    phase_seconds = step_seconds(configs, args.timing_rounds)
    per_step = {
        name: seconds_per_step(config, {p: phase_seconds[name, p] for p in config.phase_order})
        for name, config in configs.items()
    }
    base_ms = np.mean(per_step["baseline"]) / samples * 1e3
    final_eval = {
        name: [r["eval/mlm_loss"] for _, r in sorted(recs.items()) if "eval/mlm_loss" in r][-1]
        for name, (_, recs) in results.items()
    }
    target = final_eval["baseline"]
    baseline_records = results["baseline"][1]
    baseline_to_target = time_to_loss(baseline_records, per_step["baseline"], target)
    print(
        f"\n{args.layers}-layer PreLN BERT (H128, A2, I512, {args.dtype} compute), sequence 128, "
        f"batch {samples}"
    )
    print(f"target: the baseline's final held-out MLM loss, {target:.3f}\n")
    print(
        "| scheme | steps | ms / sample | vs baseline | train time (s) | final held-out MLM "
        "loss | time to target (s) | speed-up to target | baseline time to this loss (s) "
        "| logged train time (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (_, records) in results.items():
        ms = np.mean(per_step[name]) / samples * 1e3
        reach = time_to_loss(records, per_step[name], target)
        baseline_time = time_to_loss(baseline_records, per_step["baseline"], final_eval[name])
        print(
            f"| {name} | {len(per_step[name])} | {ms:.2f} | {ms / base_ms:.2f}x | "
            f"{np.sum(per_step[name]):.1f} | {final_eval[name]:.3f} | "
            + (
                f"{reach:.1f} | {baseline_to_target / reach:.2f}x | "
                if reach
                else "not reached | - | "
            )
            + (f"{baseline_time:.1f}" if baseline_time is not None else "not reached")
            + f" | {logged_seconds(records):.1f} |"
        )
    mslt_config = configs["mslt"]
    print("\nMSLT stages:\n")
    print("| stage | layers (trained) | steps | ms / sample | vs baseline |")
    print("|---|---|---:|---:|---:|")
    for name in mslt_config.phase_order:
        phase = mslt_config.phases[name]
        depth = phase.num_layers or args.layers
        ms = phase_seconds["mslt", name] / samples * 1e3
        print(
            f"| {name} | {depth} ({depth - phase.frozen_layers}) | {phase.num_steps} | "
            f"{ms:.2f} | {ms / base_ms:.2f}x |"
        )
    pld_records = results["pld"][1]
    run = [r["train/pld_layers_run"] for r in pld_records.values() if "train/pld_layers_run" in r]
    print(f"\nPLD: mean layers run per step {np.mean(run):.2f} of {args.layers}")


if __name__ == "__main__":
    main()
