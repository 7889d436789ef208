"""The PLD study: progressive layer dropping measured as its paper claims it, against a
PostLN baseline at the baseline's best learning rate.

  python -m lambjax.sweep --config=studies/pld/config.py --workdir=workdir/pld --parallel=2
  python -m lambjax.sweep report workdir/pld          # the study's tables and plots
  python -m lambjax.sweep --config=studies/pld/config.py:base \
      --workdir=gs://BUCKET/pld --launcher=tpu        # (or slurm) BERT-base at batch 4K

The claim (Zhang & He 2020, arXiv 2010.13369): PreLN switchable blocks with progressive
layer dropping reach the downstream accuracy of a PostLN BERT 2.5x faster, in part because
each step is cheaper (fewer layers run) and in part because PreLN with layer dropping trains
at a higher learning rate than the PostLN baseline tolerates. So the arms are:

  postln  the baseline: PostLN BERT, no dropping, over its learning-rate grid; the one whose
          best held-out MLM loss is lowest is *the* baseline, and that loss is the target;
  pld     PreLN + PLD (DeepSpeed's depth rule, theta_bar 0.5) over a grid that reaches
          higher, once with gamma = 0.001 (DeepSpeed's) and once with gamma = 100 / T
          (the paper's heuristic, lambjax's `pld` variant so far); the `cpu` size, too
          short for gamma 0.001 to drop much, runs 100 / T only;
  preln   PreLN alone over the same grid, so that PreLN without dropping is there at
          whichever rate PLD turns out best at (and the rate's effect can be told from the
          dropping's).

The report (studies.pld.report) takes for each PreLN arm the learning rate that reaches the
target in the fewest steps (ties and misses: the lower best held-out loss), and gives steps
and training time to the target against the baseline's, and the ratio of step times (from
`studies/pld/benchmark.py --sweep DIR`, which times one step of each arm in turn in one
process, where it has run; else the trials' own logged step times). The `cpu` size also
repeats the baseline's and PLD's middle rates with a second seed.

The optimizer is DeepSpeed's recipe for PLD: Adam without bias correction (the `cpu` size
corrects it: see there), weight decay
0.01 (not on biases and LayerNorm), the global gradient norm clipped to 1.0, a linear
warmup over 2% of the steps; every arm runs the same number of steps and the same schedule,
so the learning rate at a step is the same fraction of each arm's peak. (DeepSpeed then
decays by 0.99 every 1,000 of 200K steps; here NVIDIA's polynomial decay, power 0.5.)

`arg` is the size: `cpu` (the default: a 4-layer H128 BERT on the embedded corpus, 11
trials of 400 steps), `base` (BERT-base at DeepSpeed's batch 4,096 and
sequence 128, phase 1 on Wikipedia, for a pod), `smoke` (a few steps, for the tests).

The grids, seeds, step counts and the rule for the target below were fixed before the runs.
"""

from lambjax.sweep import spec
from lambjax.train import config as config_lib
from studies import common

SIZES = {
    # A 4-layer PreLN/PostLN BERT (H128, 2 heads, MLP 512; layers unrolled, bfloat16
    # compute) on the CPU studies' data (common.cpu_study_config): sequences of 32 tokens,
    # 5 predictions each.
    "cpu": dict(
        model="tiny",
        num_layers=4,
        dtype="bfloat16",
        max_seq_length=32,
        max_predictions_per_seq=5,
        batch_size=32,
        micro_batch_per_device=None,
        # Probes outside the grid (PostLN, lr 1e-3, seed 0): with DeepSpeed's Adam, no bias
        # correction, the held-out loss stays on the unigram plateau (accuracy 7.15%) for
        # 600 steps, and with a 10% warmup for 400; with bias correction it leaves it after
        # step 200 (accuracy 14.2% at 400). Without the correction Adam's second moment is
        # underestimated by 1 - 0.999^t: the step is 3.2x larger at step 100 and 1.7x at
        # 400, the whole of a run this short (in DeepSpeed's 200K steps the bias is gone
        # within the 4,000-step warmup). So this size corrects the bias; 400 steps.
        bias_correction=True,
        num_steps=400,
        postln_learning_rates=(5e-4, 1e-3, 2e-3),
        preln_learning_rates=(1e-3, 2e-3, 4e-3),
        # gamma 0.001 runs theta only down to 0.84 in 400 steps (0.91 on average: about
        # 3.87 of 4 layers run): that arm is PreLN with a few skipped layers, and only the
        # pod size runs it; here gamma = 100 / T.
        gammas=("100/T",),
        seeds=(0,),
        # A second seed at the middle rate of the baseline's grid and of PLD's, chosen
        # before the runs: the noise band of the two trials the answer compares.
        second_seed=dict(seed=1, postln=1e-3, pld=2e-3),
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
        bias_correction=False,  # DeepSpeed's Adam
        num_steps=200_000,
        postln_learning_rates=(2.5e-4, 5e-4, 1e-3),
        preln_learning_rates=(5e-4, 1e-3, 2e-3),
        gammas=("0.001", "100/T"),
        seeds=(0,),
        second_seed=None,
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
    second_seed=None,
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
        config = common.cpu_study_config(study["model"])  # layers unrolled: lax.cond skips one
    config.model.overrides.num_layers = study["num_layers"]
    config.model.overrides.dtype = study["dtype"]
    config.model.overrides.layer_norm = "post"
    config.optimizer = config_lib.optimizer_config("adamw")
    config.optimizer.bias_correction = study["bias_correction"]
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
    """The settings of gamma the study compares, by the label the report shows: DeepSpeed's
    0.001 and the paper's heuristic 100 / T."""
    values = {"0.001": DEEPSPEED_GAMMA, "100/T": 100.0 / study["num_steps"]}
    return {label: values[label] for label in study["gammas"]}


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
    # The baseline first, then the first gamma's PLD, PreLN alone, the other gamma, the
    # second seed: a sweep stopped early has the comparisons in the order the question
    # needs them.
    first, *others = study["gammas"]
    for seed in study["seeds"]:
        preln = study["preln_learning_rates"]
        trials += [trial("postln", lr, seed, None, study) for lr in study["postln_learning_rates"]]
        trials += [trial("pld", lr, seed, first, study) for lr in preln]
        trials += [trial("preln", lr, seed, None, study) for lr in preln]
        for gamma in others:
            trials += [trial("pld", lr, seed, gamma, study) for lr in preln]
    if study["second_seed"]:
        again = study["second_seed"]
        trials.append(trial("postln", again["postln"], again["seed"], None, study))
        trials.append(trial("pld", again["pld"], again["seed"], first, study))
    return trials


def get_study(arg=None):
    """What the report answers the question with (studies.pld.report)."""
    _, study = parse(arg)
    return {
        "kind": "pld",
        "report": "studies.pld.report",
        "num_steps": study["num_steps"],
        "postln_learning_rates": list(study["postln_learning_rates"]),
        "preln_learning_rates": list(study["preln_learning_rates"]),
        "gammas": gammas(study),
        "theta_bar": THETA_BAR,
        "paper_speedup": 2.5,
    }
