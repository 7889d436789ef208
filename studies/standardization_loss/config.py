"""The standardization-loss study: a BERT without LayerNorm, trained with the loss at the
residual sums or at the pre-activations, against LayerNorm and against no normalization,
with AdamW and with LAMB.

  python -m lambjax.sweep --config=studies/standardization_loss/config.py \
      --workdir=workdir/std --parallel=2
  python -m lambjax.sweep report workdir/std         # the study's tables and plots
  python -m lambjax.sweep --config=studies/standardization_loss/config.py:base \
      --workdir=gs://BUCKET/std --launcher=tpu       # (or slurm) BERT-base at batch 2,048

The claim (Collins, Balle, Shlens 2019, arXiv 1903.00925): with the standardization loss in
place of normalization, training is nearly as fast as with normalization and much faster
than with neither (ResNet-50, steps to the batch-norm baseline's accuracy: 39.5K with batch
norm, 40.0K with the loss, 89.4K with neither). The arms, per optimizer:

  layer_norm     the normal model: the baseline;
  none           no normalization (the LayerNorms' scale and bias only), weight 0;
  residual       no normalization, the loss on the tensors the LayerNorms normalized (the
                 embeddings' and each residual sum: 5 sites of 128 channels at `cpu`);
  preactivation  no normalization, the loss on each FFN's intermediate output before GELU,
                 the paper's placement (2 sites of 512 channels at `cpu`).

Each loss site at three weights, a decade apart. At `cpu` the unweighted L_std early in
training is of order 10^3 at either site (residual sums: 1,926 at step 20 of the demo;
pre-activations: 3,442 at step 16 of a probe run, seed 99, weight 1e-3), so 1e-4, 1e-3 and
1e-2 make the weighted term about 0.03-0.05x, 0.3-0.5x and 3-5x the MLM loss then (~7.6):
from a nudge to a term larger than the objective; the paper's
own lambdas (1e-6 to 1) were tuned per network, 1e-4 for its one net without any
normalization layer (MobileNet-v1).

The learning rate per optimizer, fixed by a rule before the runs: the batch-scaling
study's rate for that optimizer at this model, data and batch (studies/batch_scaling/
README.md): at `cpu` the best of its 0.5x/1x/2x grid at batch 32, AdamW 1e-3 and
LAMB 1e-2 (the LayerNorm model); at `base` its declared base at batch 2,048. Every arm of an
optimizer runs at that rate, with that study's schedule (NVIDIA's polynomial decay, power
0.5; the warmup of its batch-32 trials) and its 16,384 sequences at `cpu` (512 steps).

The report (studies.standardization_loss.report), by a rule fixed before the runs, per
optimizer: the target is the LayerNorm arm's best held-out MLM loss (the paper's "baseline
accuracy"); a second target, the no-normalization arm's best. For each loss site the weight
that reaches the first target in the fewest steps (a miss counts as never; ties and misses
go to the lower best held-out loss) is that site's arm. Steps and training time to each
target, and the steps' ratios to LayerNorm's beside the paper's (40.0 / 39.5 = 1.01 for the
loss, 89.4 / 39.5 = 2.26 for neither).

`arg` is the size: `cpu` (the default: L2 H128 BERT on the embedded corpus, 16 trials),
`base` (BERT-base, sequence 128, for a pod), `smoke` (4 trials of 4 steps, for the tests).

The sizes, weights, learning rates, seeds and the rule were fixed before the runs.
"""

from lambjax.sweep import spec
from lambjax.train import config as config_lib
from studies import common

SIZES = {
    # The batch-scaling study's smallest batch: a 2-layer BERT (H128, 2 heads, MLP 512) on
    # CPython's embedded corpus, sequences of 32 tokens, 2,048-word vocabulary, batch 32.
    "cpu": dict(
        model="tiny",
        max_seq_length=32,
        max_predictions_per_seq=5,
        batch_size=32,
        micro_batch_per_device=None,
        num_steps=512,
        warmup_fraction=0.00625,  # the batch-scaling study's at batch 32: 3.2 steps
        learning_rates=dict(adamw=1e-3, lamb=1e-2),
        weights=(1e-4, 1e-3, 1e-2),
        seeds=(0,),
        evals_per_trial=32,
        log_every_steps=16,
    ),
    # BERT-base, phase 1 (sequence 128) at the batch-scaling study's base batch 2,048 and
    # its base learning rates there (each optimizer's published setting moved to 2K by the
    # square-root rule); 2^26 sequences. L_std sums over 12 x 3,072 pre-activation channels
    # or 25 x 768 residual channels, about 30x and 20x the `cpu` model's: the weights one
    # decade lower.
    "base": dict(
        model="base",
        max_seq_length=128,
        max_predictions_per_seq=20,
        batch_size=2048,
        micro_batch_per_device=8,
        num_steps=32_768,
        warmup_fraction=0.00625,
        learning_rates=dict(adamw=2.8e-4, lamb=1.25e-3),
        weights=(1e-5, 1e-4, 1e-3),
        seeds=(0,),
        evals_per_trial=32,
        log_every_steps=100,
    ),
}
# The study's smallest form, for the tests: one optimizer, one weight, a few steps.
SIZES["smoke"] = dict(
    SIZES["cpu"],
    num_steps=4,
    learning_rates=dict(adamw=1e-3),
    weights=(1e-2,),
    evals_per_trial=2,
    log_every_steps=1,
)
SITES = ("residual", "preactivation")
# The paper's ResNet-50 steps to its batch-norm baseline's accuracy (thousands).
PAPER_STEPS = {"batch_norm": 39.5, "standardization_loss": 40.0, "none": 89.4}


def parse(arg) -> tuple[str, dict]:
    return spec.study_size(arg, SIZES)


def get_config(arg=None):
    size, study = parse(arg)
    if size == "base":
        config = config_lib.pod_config(study["model"])
        config.checkpoint_every_steps = 2000
    else:
        config = common.cpu_study_config(study["model"])
    config.model.overrides.normalization = "layer_norm"  # a field each trial sets
    config.optimizer = config_lib.optimizer_config("adamw")
    config_lib.with_phases(
        config,
        phase1=config_lib.phase_config(
            max_seq_length=study["max_seq_length"],
            max_predictions_per_seq=study["max_predictions_per_seq"],
            global_batch_size=study["batch_size"],
            micro_batch_per_device=study["micro_batch_per_device"],
            num_steps=study["num_steps"],
            learning_rate=study["learning_rates"]["adamw"],
            warmup_fraction=study["warmup_fraction"],
        ),
    )
    config.log_every_steps = study["log_every_steps"]
    config.eval_every_steps = study["num_steps"] // study["evals_per_trial"]
    return config


def trial(optimizer: str, arm: str, weight: float, seed: int, study: dict) -> dict:
    """One trial, labelled with what the report groups by (optimizer, arm, weight, seed)."""
    overrides = {
        "seed": seed,
        "optimizer.name": optimizer,
        "phases.phase1.learning_rate": study["learning_rates"][optimizer],
        "model.overrides.normalization": "layer_norm" if arm == "layer_norm" else "none",
        "standardization_loss.weight": weight,
        "standardization_loss.site": "preactivation" if arm == "preactivation" else "residual",
    }
    return spec.labelled(overrides, optimizer=optimizer, arm=arm, weight=weight, seed=seed)


def get_sweep(arg=None):
    _, study = parse(arg)
    trials = []
    # Optimizer by optimizer, the two references first: a sweep stopped early has whole
    # comparisons.
    for seed in study["seeds"]:
        for optimizer in study["learning_rates"]:
            trials += [trial(optimizer, arm, 0.0, seed, study) for arm in ("layer_norm", "none")]
            trials += [
                trial(optimizer, site, weight, seed, study)
                for weight in study["weights"]
                for site in SITES
            ]
    return trials


def get_study(arg=None):
    """What the report answers the question with (studies.standardization_loss.report)."""
    _, study = parse(arg)
    return {
        "kind": "standardization_loss",
        "report": "studies.standardization_loss.report",
        "num_steps": study["num_steps"],
        "learning_rates": study["learning_rates"],
        "weights": list(study["weights"]),
        "sites": list(SITES),
        "paper_steps": PAPER_STEPS,
    }
