"""The Ouroboros study: does training with delayed gradients (K modules on K - 1 pipeline
stages) end as well as ordinary backpropagation once the learning rate has decayed?

  XLA_FLAGS=--xla_force_host_platform_device_count=3 python -m lambjax.sweep \
      --config=studies/ouroboros/config.py --workdir=workdir/ouroboros --parallel=2
  python -m lambjax.sweep report workdir/ouroboros    # the study's table and plot
  python -m lambjax.sweep --config=studies/ouroboros/config.py:base \
      --workdir=gs://BUCKET/ouroboros --launcher=tpu  # (or slurm) BERT-base, 96 devices

The claim (Yang et al. 2019, arXiv 1909.06695): Ouroboros gives "a much faster speedup
beyond data parallelism, with comparable or better accuracy" (Transformer-XL on enwik8,
text8 and WikiText-103). This study reads the accuracy half; the speed half is
studies/ouroboros/benchmark.py. Every trial runs the same steps, schedule (LAMB, a linear
warm-up, then NVIDIA's polynomial decay to zero), data order and initial weights:

  K = 1          ordinary backpropagation (the baseline), data parallel over the devices;
  K = 1, seed 1  the baseline again with another seed (initial weights, data order,
                 dropout): the noise the tolerance is read from;
  K = 4          4 modules on 3 stages (the paper's Figure-2 layout), once per replay form:
                 `stale` (the exact delayed gradient) and `current` (Features Replay);
  K = 4, warm    the same after `warmup_steps` steps of ordinary backpropagation.

The rule, fixed before the runs: the tolerance is the gap between the two K = 1 seeds, in
final held-out MLM loss for the final loss and in best held-out MLM loss for the best. An
arm is *comparable* where its gap to K = 1 (seed 0) is within the tolerance, *better* where
it is lower by more, *worse* where it is higher by more.

Every trial of a size runs on the same devices: at `cpu` size 3 fake CPU devices (the
XLA_FLAGS above), K = 4 on mesh stage 3, K = 1 on mesh data 3 (batch 48: 16 rows a device).
`arg` is the size: `cpu` (the default: a 6-layer tiny BERT on the embedded corpus, 300
steps), `base` (BERT-base on Wikipedia, phase 1 at sequence 128, for a pod whose device
count divides by 3), `smoke` (a few steps, for the tests).

The arms, seeds, steps, schedule and rule below were fixed before the runs.
"""

from lambjax.contrib import ouroboros
from lambjax.sweep import spec
from lambjax.train import config as config_lib
from studies import common

MODULES = 4  # the paper's Figure 2: 4 modules on 3 devices
REPLAYS = ("stale", "current")

SIZES = {
    # The demo's tiny BERT (H128, 2 heads, MLP 512) at 6 layers (3 stages of 2: module 1
    # and module 4 one layer each on stage 0), float32, on CPython's embedded corpus at
    # sequence 32. LAMB at batch 48 with the batch-scaling study's rate for batch 32 (1e-2);
    # 300 steps, warm-up 5% (15 steps), the rate then decays to 0 at step 300. (A probe of
    # K = 4 outside the study: held-out loss 6.54 at step 40, below the unigram plateau.)
    "cpu": dict(
        model="tiny",
        num_layers=6,
        dtype="float32",
        max_seq_length=32,
        max_predictions_per_seq=5,
        batch_size=48,
        micro_batch_per_device=None,
        num_steps=300,
        learning_rate=1e-2,
        warmup_fraction=0.05,
        # The synchronous warm-up: the learning-rate warm-up's 15 steps twice over.
        warmup_steps=30,
        devices=3,
        noise_seed=1,
        evals_per_trial=10,
        log_every_steps=10,
    ),
    # BERT-base, phase 1 (sequence 128) on Wikipedia at batch 3,072 on 96 devices (data 32 x
    # stage 3 for K = 4, data 96 for K = 1), 32 rows a device per micro-batch; LAMB at
    # NVIDIA's phase-1 rate scaled by the square root of the batch (6e-3 x sqrt(3K / 64K)).
    "base": dict(
        model="base",
        num_layers=12,
        dtype="bfloat16",
        max_seq_length=128,
        max_predictions_per_seq=20,
        batch_size=3072,
        micro_batch_per_device=32,
        num_steps=20_000,
        learning_rate=1.3e-3,
        warmup_fraction=0.05,
        warmup_steps=2_000,
        devices=96,
        noise_seed=1,
        evals_per_trial=40,
        log_every_steps=100,
    ),
}
# The study's smallest form, for the tests: 3 layers (module 4 empty), a few steps, the
# warm-up arm with one replay form, beside the two K = 1 seeds.
SIZES["smoke"] = dict(
    SIZES["cpu"],
    num_layers=3,
    num_steps=4,
    warmup_steps=2,
    evals_per_trial=2,
    log_every_steps=1,
)
SMOKE_ARMS = (("current", True),)


def parse(arg) -> tuple[str, dict]:
    return spec.study_size(arg, SIZES)


def get_config(arg=None):
    size, study = parse(arg)
    if size == "base":
        config = config_lib.pod_config(study["model"])
        config.checkpoint_every_steps = 2000
    else:
        config = common.cpu_study_config(study["model"])
    config.model.overrides.num_layers = study["num_layers"]
    config.model.overrides.dtype = study["dtype"]
    config.optimizer = config_lib.optimizer_config("lamb")
    config_lib.with_phases(
        config,
        phase1=config_lib.phase_config(
            max_seq_length=study["max_seq_length"],
            max_predictions_per_seq=study["max_predictions_per_seq"],
            global_batch_size=study["batch_size"],
            micro_batch_per_device=study["micro_batch_per_device"],
            num_steps=study["num_steps"],
            learning_rate=study["learning_rate"],
            warmup_fraction=study["warmup_fraction"],
        ),
    )
    config.mesh.data = -1
    # K = 1 shards the held-out batches over every device too: one batch of the training size.
    config.eval_batch_size = study["batch_size"]
    config.log_every_steps = study["log_every_steps"]
    config.eval_every_steps = study["num_steps"] // study["evals_per_trial"]
    return ouroboros.configure(config)


def trial(modules: int, replay: str, warmup: int, seed: int) -> dict:
    """One trial, labelled with what the report groups by (modules, replay, warmup, seed)."""
    overrides = {
        "seed": seed,
        "ouroboros.num_modules": modules,
        "mesh.stage": max(modules - 1, 1),
    }
    if modules > 1:
        overrides["ouroboros.replay"] = replay
        overrides["ouroboros.synchronous_steps"] = warmup
    return spec.labelled(overrides, modules=modules, replay=replay, warmup=warmup, seed=seed)


def arms(size: str) -> tuple[tuple[str, bool], ...]:
    """(replay, with the synchronous warm-up) of each K = 4 arm."""
    if size == "smoke":
        return SMOKE_ARMS
    return tuple((replay, warm) for warm in (False, True) for replay in REPLAYS)


def get_sweep(arg=None):
    size, study = parse(arg)
    # The baseline first, then the K = 4 arms, the second baseline seed last: a sweep
    # stopped early has the comparisons before the noise estimate.
    trials = [trial(1, "none", 0, 0)]
    for replay, warm in arms(size):
        trials.append(trial(MODULES, replay, study["warmup_steps"] if warm else 0, 0))
    trials.append(trial(1, "none", 0, study["noise_seed"]))
    return trials


def get_study(arg=None):
    """What the report answers the question with (studies.ouroboros.report)."""
    _, study = parse(arg)
    return {
        "kind": "ouroboros",
        "report": "studies.ouroboros.report",
        "modules": MODULES,
        "num_steps": study["num_steps"],
        "warmup_steps": study["warmup_steps"],
        "noise_seed": study["noise_seed"],
        "devices": study["devices"],
    }
