"""The equal-compute study: progressive layer dropping (PLD) and multi-stage layerwise
training (MSLT) against a PostLN BERT, each arm given the baseline's FLOPs.

  python -m studies.corpus linux-doc-6.1_*.deb data/linux-doc   # the corpus (studies/corpus.py)
  python -m lambjax.sweep --config=studies/equal_compute/config.py --workdir=workdir/ec \
      --parallel=2                                   # stage 1: every arm's learning-rate grid
  python -m lambjax.sweep --config=studies/equal_compute/config.py:cpu,stage2 \
      --workdir=workdir/ec --parallel=2              # stage 2: extensions and seeds (same DIR)
  python -m lambjax.sweep report workdir/ec
  python -m lambjax.sweep --config=studies/equal_compute/config.py:base \
      --workdir=gs://BUCKET/ec --launcher=tpu        # (or slurm) BERT-base at batch 4K

The claims: PLD (Zhang & He 2020, arXiv 2010.13369) pretrains BERT 2.5x faster than a
PostLN BERT, in part because each step runs fewer layers, in part because PreLN switchable
blocks train at a higher learning rate than PostLN tolerates; MSLT (Yang et al. 2020, arXiv
2011.13635) is "more than 110%" faster by training stacked stages that update only their new
layers. Both are claims about compute to a quality, so every arm here gets the same FLOPs:

  postln  the baseline: PostLN BERT;
  preln   PreLN alone (what PLD's blocks are without dropping);
  pld     PreLN + PLD: theta_bar 0.5, DeepSpeed's depth rule, gamma 100 / T (T the
          baseline's step cap), more steps than the baseline where fewer layers run;
  mslt    PostLN in lambjax's `mslt` stages (depths 3, 6, 12, each training only the layers
          it adds, for half the baseline's cap), then every layer to the end of the budget.

Every trial warms up over `warmup_steps`, holds its learning rate, and ends at the first
evaluation at or below the target (config.target): the target is one the baseline reaches
well before its cap, from a pilot, never a loss at the end of a decayed schedule. An arm's
cap is the baseline's FLOPs (`budget_steps` steps of the full model) in its own steps. The
report reads each arm at its best learning rate (stage 1: `learning_rates[arm]`, 4 points),
its FLOPs, steps and logged time to the target, and the 3 seeds' spread (stage 2). Where a
seed misses the target at an arm's best rate, the rate below it in the arm's grid is run
with the other seeds too (`fallback`), and the arm is also read at its fastest rate that
every seed reached.

`arg` is `SIZE[,stage2]`: `cpu` (the default: 12 layers of the tiny width on the Linux
kernel's documentation, 2 CPU cores), `base` (BERT-base at batch 4K, for a pod), `smoke`
(a few steps, for the tests). The grids, seeds, caps and target below were fixed before
the measured runs, from the pilot described at SIZES["cpu"].
"""

import math

from lambjax.models import config as model_config
from lambjax.sweep import spec
from lambjax.train import config as config_lib
from lambjax.train import throughput, variants
from studies import common

ARMS = ("postln", "preln", "pld", "mslt")
THETA_BAR = 0.5  # DeepSpeed's default and recommendation
PLD_GAMMA_TIMES_T = 100.0  # gamma = 100 / T, the heuristic lambjax's `pld` variant uses
MSLT_STAGE_SHARE = 0.5  # of the baseline's cap, in steps, split equally over the stages
# Every arm's 4 rates, x2 apart, at both sizes: PostLN's (and MSLT's, PostLN in stages)
# around the pilot's 1e-3, PreLN's (alone and with PLD) one step higher, where the paper
# says PreLN trains.
LEARNING_RATES = dict(
    postln=(2.5e-4, 5e-4, 1e-3, 2e-3),
    preln=(5e-4, 1e-3, 2e-3, 4e-3),
    pld=(5e-4, 1e-3, 2e-3, 4e-3),
    mslt=(2.5e-4, 5e-4, 1e-3, 2e-3),
)

SIZES = {
    # BERT L12 H128 A2 I512 (layers unrolled, bfloat16 compute), PostLN or PreLN, on the
    # batch-scaling study's data (studies/batch_scaling/config.py: linux-doc 6.1.176-1,
    # sequence 32, 5 predictions, WordPiece 8,192, the same 2,048 held-out sequences at
    # every evaluation: standard error 0.024). Adam with bias correction (studies/pld's
    # README: without it a run of a few thousand steps sits on the unigram plateau).
    "cpu": dict(
        model="tiny",
        num_layers=12,
        corpus="text:data/linux-doc/*.txt",
        vocab_size=8192,
        max_seq_length=32,
        max_predictions_per_seq=5,
        eval_batch_size=256,
        eval_steps=8,
        batch_size=64,
        micro_batch_per_device=None,
        bias_correction=True,
        # The pilot (PostLN, lr 1e-3, warmup 50 then constant, seed 99, stopped at step
        # 750): held-out MLM loss 6.76 at step 100 (the unigram level: 6.67), 6.36 at 300,
        # 6.14 at 500, 6.00 at 700, 5.95 at 750; 0.6-0.8 s a step on the shared 2 cores.
        # The target 6.0 (0.67 below the unigram level, 28 standard errors) is reached at
        # step 700 at the grid's centre rate; the cap, 1,500 steps, is twice that.
        target_loss=6.0,
        other_targets=(6.2, 6.1),
        budget_steps=1500,
        warmup_steps=50,
        # A resolution of 25 steps: 3.6% of the pilot's 700.
        eval_every_steps=25,
        log_every_steps=25,
        learning_rates=LEARNING_RATES,
        seeds=(1, 2),
        # Stage 2, fixed from stage 1's report before it runs: arm -> further rates where
        # the best sat at an edge, and arm -> its best rate (rerun with `seeds`). Each arm's
        # entry is the report's rule on its own finished grid, committed as the grid ended.
        extensions={},
        best={"postln": 1e-3, "preln": 1e-3, "pld": 1e-3, "mslt": 1e-3},
        # arm -> the rate below its best, rerun with `seeds`: where a seed missed the target
        # at the best rate (the report's rule, committed once that seed had ended). PostLN's
        # seed 1 stayed on the unigram plateau at 1e-3 for its whole budget.
        fallback={"postln": 5e-4},
    ),
    # BERT-base at DeepSpeed's PLD batch (4,096; 16 sequences per device and micro-batch on
    # 256 devices), sequence 128, Wikipedia, DeepSpeed's Adam (no bias correction). The cap
    # is 100K steps (4.1e8 sequences, about NVIDIA's phase-1 sample count); the target 2.2
    # is the batch-scaling study's for BERT-base. Its first trial, the baseline at its
    # centre rate, checks the target: it must reach it before half its cap, or the target
    # moves (in a commit) before the rest of the grid runs.
    "base": dict(
        model="base",
        num_layers=12,
        corpus="tfds:wikipedia/20230601.en",
        vocab_size=30522,
        max_seq_length=128,
        max_predictions_per_seq=20,
        eval_batch_size=1024,
        eval_steps=8,
        batch_size=4096,
        micro_batch_per_device=16,
        bias_correction=False,
        target_loss=2.2,
        other_targets=(2.4,),
        budget_steps=100_000,
        warmup_steps=2000,
        eval_every_steps=1000,
        log_every_steps=100,
        learning_rates=LEARNING_RATES,
        seeds=(1, 2),
        extensions={},
        best={},
        fallback={},
    ),
}
SIZES["smoke"] = dict(
    SIZES["cpu"],
    num_layers=2,
    corpus="embedded",
    vocab_size=2048,
    eval_batch_size=32,
    eval_steps=2,
    batch_size=8,
    target_loss=7.65,
    budget_steps=6,
    warmup_steps=1,
    eval_every_steps=1,
    log_every_steps=1,
    learning_rates=dict(postln=(1e-3,), pld=(2e-3,), mslt=(1e-3,)),
    seeds=(1,),
    extensions={"pld": (4e-3,)},
    best={"postln": 1e-3},
    fallback={"mslt": 5e-4},
)


def parse(arg) -> tuple[str, dict, bool]:
    return common.staged_size(arg, SIZES)


def bert(study: dict) -> model_config.BertConfig:
    sizes = dict(model_config.PRESETS[study["model"]], num_layers=study["num_layers"])
    return model_config.BertConfig(vocab_size=study["vocab_size"], **sizes)


def step_flops(study: dict, num_layers: float, frozen: int = 0) -> float:
    """Model FLOPs of one step running `num_layers` encoder layers (an expected count for
    PLD), the bottom `frozen` of them forward only (an MSLT stage): lambjax's own count
    (lambjax.train.throughput), forward and backward."""
    model = bert(study)
    args = (study["batch_size"], study["max_seq_length"], study["max_predictions_per_seq"])
    heads = throughput.forward_flops(model, *args, num_layers=0)
    layer = throughput.forward_flops(model, *args, num_layers=1) - heads
    return 3 * (heads + num_layers * layer) - 2 * frozen * layer


def pld_layers(study: dict, step: int) -> float:
    """PLD's expected encoder layers at `step`: DeepSpeed's rule keeps layer i = 0..L-1 with
    probability 1 - i (1 - theta) / L, so L - (1 - theta)(L - 1) / 2 run on average."""
    depth = study["num_layers"]
    gamma = PLD_GAMMA_TIMES_T / study["budget_steps"]
    theta = (1 - THETA_BAR) * math.exp(-gamma * step) + THETA_BAR
    return depth - (1 - theta) * (depth - 1) / 2


def budget_flops(study: dict) -> float:
    return study["budget_steps"] * step_flops(study, study["num_layers"])


def pld_cap(study: dict) -> int:
    """PLD's steps within the baseline's FLOPs (its layers run as expected)."""
    heads = step_flops(study, 0)
    layer = step_flops(study, 1) - heads
    budget, spent, steps = budget_flops(study), 0.0, 0
    while True:
        cost = heads + pld_layers(study, steps) * layer
        if spent + cost > budget:
            return steps
        spent, steps = spent + cost, steps + 1


def mslt_steps(study: dict) -> tuple[int, int]:
    """(steps of the stages, steps of the final all-layer phase) within the budget: the
    stages take MSLT_STAGE_SHARE of the baseline's cap in steps, each stage an equal share
    (as `variants.multi_stage` splits them), and the final phase the FLOPs left."""
    depths = variants.stage_depths(study["num_layers"])
    stage_steps = round(MSLT_STAGE_SHARE * study["budget_steps"]) // len(depths) * len(depths)
    each = stage_steps // len(depths)
    spent = sum(
        each * step_flops(study, depth, frozen=depths[i - 1] if i else 0)
        for i, depth in enumerate(depths)
    )
    final = int((budget_flops(study) - spent) // step_flops(study, study["num_layers"]))
    return stage_steps, final


def get_config(arg=None):
    """The baseline's run; the arms' overrides make the others (`arm_overrides`). The config
    holds the MSLT stages' phases too, which only the `mslt` arm's phase_order runs."""
    size, study, _ = parse(arg)
    if size == "base":
        config = config_lib.pod_config(study["model"])
        config.checkpoint_every_steps = 2000
    else:
        config = common.cpu_study_config(study["model"])
        config.data.source = study["corpus"]
        config.data.vocab_size = study["vocab_size"]
        config.checkpoint_every_steps = 5000
    config.model.overrides.num_layers = study["num_layers"]
    config.model.overrides.dtype = "bfloat16"
    config.model.overrides.layer_norm = "post"
    config.eval_batch_size = study["eval_batch_size"]
    config.eval_steps = study["eval_steps"]
    config.optimizer = config_lib.optimizer_config("adamw")
    config.optimizer.bias_correction = study["bias_correction"]
    config.layer_drop.theta_bar = THETA_BAR
    config.layer_drop.depth_rule = "deepspeed"
    config.target.metric = "mlm_loss"
    config.target.value = study["target_loss"]

    def phase(num_steps):
        warmup = min(1.0, study["warmup_steps"] / num_steps)
        return config_lib.phase_config(
            max_seq_length=study["max_seq_length"],
            max_predictions_per_seq=study["max_predictions_per_seq"],
            global_batch_size=study["batch_size"],
            micro_batch_per_device=study["micro_batch_per_device"],
            num_steps=num_steps,
            learning_rate=study["learning_rates"]["postln"][0],
            schedule="warmup_constant_decay",
            warmup_fraction=warmup,
            constant_fraction=1.0 - warmup,
        )

    stages, final = mslt_steps(study)
    config_lib.with_phases(config, phase1=phase(stages), phase2=phase(final))
    config = variants.apply(config, ["mslt"])
    for stage in config.phase_order:  # each stage warms up over warmup_steps of its own
        warmup = min(1.0, study["warmup_steps"] / config.phases[stage].num_steps)
        config.phases[stage].warmup_fraction = warmup
        config.phases[stage].constant_fraction = 1.0 - warmup
    config.phases["baseline"] = phase(study["budget_steps"])
    config.phases["pld"] = phase(pld_cap(study))
    config.phase_order = ("baseline",)
    config.log_every_steps = study["log_every_steps"]
    config.eval_every_steps = study["eval_every_steps"]
    return config


def arm_overrides(arm: str, learning_rate: float, config) -> dict:
    """The config fields that make `arm` out of the baseline's run."""
    if arm in ("postln", "preln"):
        return {
            "model.overrides.layer_norm": "post" if arm == "postln" else "pre",
            "phases.baseline.learning_rate": learning_rate,
        }
    if arm == "pld":
        return {
            "model.overrides.layer_norm": "pre",
            "layer_drop.enabled": True,
            "layer_drop.gamma": PLD_GAMMA_TIMES_T / config.phases.baseline.num_steps,
            "phase_order": ("pld",),
            "phases.pld.learning_rate": learning_rate,
        }
    stages = [name for name in config.phases if name.startswith("phase1_stage")]
    return {
        "phase_order": (*sorted(stages), "phase2"),
        **{f"phases.{name}.learning_rate": learning_rate for name in (*stages, "phase2")},
    }


def trial(arm: str, learning_rate: float, seed: int, config) -> dict:
    overrides = {"seed": seed, **arm_overrides(arm, learning_rate, config)}
    return spec.labelled(overrides, arm=arm, lr=learning_rate, seed=seed)


def get_sweep(arg=None):
    _, study, with_stage2 = parse(arg)
    config = get_config(arg)
    rates = study["learning_rates"]
    # The centre of every arm's grid first, then outwards, the baseline first at each step:
    # a sweep stopped early has every arm.
    order = max(len(r) for r in rates.values())
    trials = []
    for index in sorted(range(order), key=lambda i: (abs(i - (order - 1) / 2), i)):
        trials += [trial(arm, r[index], 0, config) for arm, r in rates.items() if index < len(r)]
    if with_stage2:
        trials += [
            trial(arm, lr, 0, config) for arm, extra in study["extensions"].items() for lr in extra
        ]
        rerun = [*study["best"].items(), *study["fallback"].items()]
        trials += [trial(arm, lr, seed, config) for arm, lr in rerun for seed in study["seeds"]]
    return trials


def get_study(arg=None):
    """What the report answers the question with (studies.equal_compute.report)."""
    _, study, _ = parse(arg)
    stages, final = mslt_steps(study)
    depths = variants.stage_depths(study["num_layers"])
    return {
        "kind": "equal_compute",
        "report": "studies.equal_compute.report",
        "target_loss": study["target_loss"],
        "other_targets": list(study["other_targets"]),
        "budget_flops": budget_flops(study),
        "caps": {
            "postln": study["budget_steps"],
            "preln": study["budget_steps"],
            "pld": pld_cap(study),
            "mslt": stages + final,
        },
        "flops": {
            "num_layers": study["num_layers"],
            "full": step_flops(study, study["num_layers"]),
            "layer": step_flops(study, 1) - step_flops(study, 0),
            "stages": [
                step_flops(study, d, frozen=depths[i - 1] if i else 0) for i, d in enumerate(depths)
            ],
            "stage_steps": stages // len(depths),
        },
        "learning_rates": {arm: list(r) for arm, r in study["learning_rates"].items()},
        "paper_speedups": {"pld": 2.5, "mslt": 2.1},
    }
