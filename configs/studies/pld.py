"""The PLD study: progressive layer dropping measured as its paper claims it, against a
PostLN baseline at the baseline's best learning rate.

  python -m lambjax.sweep --config=configs/studies/pld.py --workdir=workdir/pld --parallel=2
  python -m lambjax.sweep report workdir/pld          # the study's tables and plots
  python -m lambjax.sweep --config=configs/studies/pld.py:base \
      --workdir=gs://BUCKET/pld --launcher=tpu        # (or slurm) BERT-base at batch 4K

The claim (Zhang & He 2020, arXiv 2010.13369): PreLN switchable blocks with progressive
layer dropping reach the downstream accuracy of a PostLN BERT 2.5x faster, in part because
each step is cheaper (fewer layers run) and in part because PreLN with layer dropping trains
at a higher learning rate than the PostLN baseline tolerates. So the arms are:

  postln  the baseline: PostLN BERT, no dropping, over its learning-rate grid; the one whose
          best held-out MLM loss is lowest is *the* baseline, and that loss is the target;
  pld     PreLN + PLD (DeepSpeed's depth rule, theta_bar 0.5) over a grid that reaches
          higher, once with gamma = 0.001 (DeepSpeed's) and once with gamma = 100 / T
          (the paper's heuristic, lambjax's `pld` variant so far);
  preln   PreLN alone over the same grid, so that PreLN without dropping is there at
          whichever rate PLD turns out best at (and the rate's effect can be told from the
          dropping's).

The report (lambjax.sweep.pld) takes for each PreLN arm the learning rate that reaches the
target in the fewest steps (ties and misses: the lower best held-out loss), and gives steps
and training time to the target (the time from the trials' own logged step times: compiling
and evaluating are not counted) against the baseline's, and the ratio of step times.

The optimizer is DeepSpeed's recipe for PLD: Adam without bias correction, weight decay
0.01 (not on biases and LayerNorm), the global gradient norm clipped to 1.0, a linear
warmup over 2% of the steps; every arm runs the same number of steps and the same schedule,
so the learning rate at a step is the same fraction of each arm's peak. (DeepSpeed then
decays by 0.99 every 1,000 of 200K steps; here NVIDIA's polynomial decay, power 0.5.)

`arg` is the size: `cpu` (the default: a 4-layer H128 BERT on the embedded corpus, 2 CPU
cores in under 20 minutes at load 1), `base` (BERT-base at DeepSpeed's batch 4,096 and
sequence 128, phase 1 on Wikipedia, for a pod), `smoke` (a few steps, for the tests).

The grids, seeds, step counts and the rule for the target below were fixed before the runs.
"""

from lambjax.sweep import spec
from lambjax.train import config as config_lib

SIZES = {
    # A 4-layer PreLN/PostLN BERT (H128, 2 heads, MLP 512; layers unrolled, bfloat16
    # compute) on CPython's embedded corpus: sequences of 32 tokens, a WordPiece vocabulary
    # of 2,048 trained on it, 10% of documents held out (the batch-scaling study's data).
    "cpu": dict(
        model="tiny",
        num_layers=4,
        dtype="bfloat16",
        max_seq_length=32,
        max_predictions_per_seq=5,
        batch_size=32,
        micro_batch_per_device=None,
        num_steps=200,
        # The batch-scaling study's AdamW at batch 32 did best at 1e-3 (with bias
        # correction); the PostLN grid brackets it, the PreLN grid starts there and goes two
        # doublings higher.
        postln_learning_rates=(5e-4, 1e-3, 2e-3),
        preln_learning_rates=(1e-3, 2e-3, 4e-3),
        seeds=(0,),
        evals_per_trial=20,
        log_every_steps=5,
    ),
    # BERT-base at DeepSpeed's PLD recipe: batch 4,096 (16 sequences per device and
    # micro-batch: one micro-batch on 256 devices), sequence 128, 200K steps as DeepSpeed's
    # runs; PLD at its published 1e-3, the PostLN grid below and around it.
    "base": dict(
        model="base",
        num_layers=12,
        dtype="bfloat16",
        max_seq_length=128,
        max_predictions_per_seq=20,
        batch_size=4096,
        micro_batch_per_device=16,
        num_steps=200_000,
        postln_learning_rates=(2.5e-4, 5e-4, 1e-3),
        preln_learning_rates=(5e-4, 1e-3, 2e-3),
        seeds=(0,),
        evals_per_trial=50,
        log_every_steps=100,
    ),
}
# The study's smallest form, for the tests: one rate per arm, a few steps.
SIZES["smoke"] = dict(
    SIZES["cpu"],
    num_layers=2,
    max_seq_length=32,
    max_predictions_per_seq=5,
    num_steps=4,
    postln_learning_rates=(1e-3,),
    preln_learning_rates=(2e-3,),
    evals_per_trial=2,
    log_every_steps=1,
)
THETA_BAR = 0.5  # DeepSpeed's default and recommendation
DEEPSPEED_GAMMA = 0.001
WARMUP_FRACTION = 0.02


def parse(arg) -> tuple[str, dict]:
    return spec.study_size(arg, SIZES)


def get_config(arg=None):
    size, study = parse(arg)
    if size == "base":
        config = config_lib.pod_config(study["model"])
        config.checkpoint_every_steps = 2000
    else:
        # Layers unrolled: faster on XLA:CPU, and lax.cond skips a dropped layer.
        config = spec.cpu_study_config(study["model"])
    config.model.overrides.num_layers = study["num_layers"]
    config.model.overrides.dtype = study["dtype"]
    config.model.overrides.layer_norm = "post"
    config.optimizer = config_lib.optimizer_config("adamw")
    config.optimizer.bias_correction = False  # DeepSpeed's Adam
    config.layer_drop.theta_bar = THETA_BAR
    config.layer_drop.depth_rule = "deepspeed"
    config_lib.with_phases(
        config,
        phase1=config_lib.phase_config(
            max_seq_length=study["max_seq_length"],
            max_predictions_per_seq=study["max_predictions_per_seq"],
            global_batch_size=study["batch_size"],
            micro_batch_per_device=study["micro_batch_per_device"],
            num_steps=study["num_steps"],
            learning_rate=study["postln_learning_rates"][0],
            warmup_fraction=WARMUP_FRACTION,
        ),
    )
    config.log_every_steps = study["log_every_steps"]
    config.eval_every_steps = study["num_steps"] // study["evals_per_trial"]
    return config


def gammas(study: dict) -> dict[str, float]:
    """The two settings of gamma the study compares, by the label the report shows."""
    return {"0.001": DEEPSPEED_GAMMA, "100/T": 100.0 / study["num_steps"]}


def trial(arm: str, learning_rate: float, seed: int, gamma: str | None, study: dict) -> dict:
    """One trial, labelled with what the report groups by (arm, gamma, lr, seed)."""
    overrides = {
        "seed": seed,
        "model.overrides.layer_norm": "post" if arm == "postln" else "pre",
        "layer_drop.enabled": arm == "pld",
        "phases.phase1.learning_rate": learning_rate,
    }
    labels = {"arm": arm}
    if arm == "pld":
        overrides["layer_drop.gamma"] = gammas(study)[gamma]
        labels["gamma"] = gamma
    return spec.labelled(overrides, **labels, lr=learning_rate, seed=seed)


def get_sweep(arg=None):
    _, study = parse(arg)
    trials = []
    # The baseline first, then DeepSpeed's PLD, PreLN alone, the other gamma: a sweep
    # stopped early has the comparisons in the order the question needs them.
    for seed in study["seeds"]:
        preln = study["preln_learning_rates"]
        trials += [trial("postln", lr, seed, None, study) for lr in study["postln_learning_rates"]]
        trials += [trial("pld", lr, seed, "0.001", study) for lr in preln]
        trials += [trial("preln", lr, seed, None, study) for lr in preln]
        trials += [trial("pld", lr, seed, "100/T", study) for lr in preln]
    return trials


def get_study(arg=None):
    """What the report answers the question with (lambjax.sweep.pld)."""
    _, study = parse(arg)
    return {
        "kind": "pld",
        "num_steps": study["num_steps"],
        "postln_learning_rates": list(study["postln_learning_rates"]),
        "preln_learning_rates": list(study["preln_learning_rates"]),
        "gammas": gammas(study),
        "theta_bar": THETA_BAR,
        "paper_speedup": 2.5,
    }
