"""The MSLT study: multi-stage layerwise training's design choices against the alternatives.

  python -m lambjax.sweep --config=studies/mslt/config.py --workdir=workdir/mslt --parallel=2
  python -m lambjax.sweep report workdir/mslt         # the study's tables and plots
  python -m lambjax.sweep --config=studies/mslt/config.py:base \
      --workdir=gs://BUCKET/mslt --launcher=tpu       # (or slurm) BERT-base at batch 4K

The claim (Yang et al. 2020, arXiv 2011.13635, "Progressively Stacking 2.0"): training
BERT in stages, each stacking new layers on top and training only those, gives "more than
110%" training speed-up "without significant performance degradation". lambjax's `mslt`
variant makes three choices the paper's available parts do not settle: each stage re-warms
and decays its learning rate to zero, the bottom layers *and* the embeddings are frozen,
and the tied MLM decoder (the word embeddings) is frozen with them. The arms:

  baseline        no MSLT: the full-depth model, one phase of `num_steps`; its best held-out
                  MLM loss is the target;
  as_implemented  the `mslt` variant as it is: `num_steps` split into stages (depths by
                  variants.stage_depths), each training only its new layers, then a final
                  all-layer phase of `final_steps`;
  nothing_frozen  the same growth and steps, every stage training every layer;
  one_schedule    one warm-up and decay across all the stages and the final phase
                  (`phases.NAME.continue_schedule`) instead of one per stage;
  decoder         the tied MLM decoder trained in the frozen stages through the output
                  projection only (`phases.NAME.train_decoder`); the input lookup stays frozen.

The MSLT arms run `num_steps + final_steps` steps (as studies/pld/benchmark.py does), so
that an arm whose steps are cheaper can show whether it reaches the target sooner. The
report (studies.mslt.report) gives each arm's steps and training time (its logged step
times) to the target and the ratio against the baseline's.

Learning rate, by a rule fixed before the runs: every arm runs the same grid, the baseline
is its rate with the lowest best held-out loss, and every MSLT arm is taken at its rate
that reaches the target in the fewest steps (misses: the lower best loss). At `cpu` size
the grid is one rate, LAMB's 1e-2 (the best of the batch-scaling study's grid at batch 32
on the same data): five trials fit the CPU budget, fifteen do not. At `base` size each arm
gets three rates around NVIDIA's phase-1 rate moved to batch 4K by the square-root rule.

`arg` is the size: `cpu` (the default: a 4-layer H128 BERT on the embedded corpus, stages of
1, 2 and 4 layers), `base` (BERT-base, stages of 3, 6 and 12 layers, for a pod), `smoke` (a
few steps of two arms, for the tests). The grids, steps and the rule were fixed before the
runs.
"""

from lambjax.sweep import spec
from lambjax.train import config as config_lib
from lambjax.train import variants
from studies import common

ARMS = ("baseline", "as_implemented", "nothing_frozen", "one_schedule", "decoder")
BASELINE_PHASE = "baseline"

SIZES = {
    # A 4-layer BERT (H128, 2 heads, MLP 512; layers unrolled, bfloat16 compute) on
    # CPython's embedded corpus at sequence 32 (common.cpu_study_config): stages of 1, 2 and 4
    # layers, 120 steps each, then 180 steps of all four. In a 200-step probe of the
    # baseline, LAMB at 1e-2 sat on the unigram plateau (held-out loss 5.68-5.70) from step
    # 75 to 150 and left it after; 360 steps take it past that.
    "cpu": dict(
        model="tiny",
        num_layers=4,
        dtype="bfloat16",
        max_seq_length=32,
        max_predictions_per_seq=5,
        batch_size=32,
        micro_batch_per_device=None,
        num_steps=360,
        final_steps=180,
        learning_rates=(1e-2,),
        warmup_fraction=0.05,
        seeds=(0,),
        eval_every_steps=20,
        log_every_steps=5,
        arms=ARMS,
    ),
    # BERT-base at batch 4,096 (16 sequences per device and micro-batch) and sequence 128:
    # stages of 3, 6 and 12 layers. NVIDIA's phase-1 LAMB rate, 6e-3 at batch 65,536, is
    # 1.5e-3 at 4,096 by the square-root rule; the grid brackets it.
    "base": dict(
        model="base",
        num_layers=12,
        dtype="bfloat16",
        max_seq_length=128,
        max_predictions_per_seq=20,
        batch_size=4096,
        micro_batch_per_device=16,
        num_steps=30_000,
        final_steps=15_000,
        learning_rates=(7.5e-4, 1.5e-3, 3e-3),
        warmup_fraction=0.05,
        seeds=(0,),
        eval_every_steps=1000,
        log_every_steps=100,
        arms=ARMS,
    ),
}
# The study's smallest form, for the tests: 2 layers (stages of 1 and 2), a few steps, the
# baseline and the arm that needs the most of the new code.
SIZES["smoke"] = dict(
    SIZES["cpu"],
    num_layers=2,
    num_steps=4,
    final_steps=2,
    eval_every_steps=2,
    log_every_steps=1,
    arms=("baseline", "decoder"),
)


def parse(arg) -> tuple[str, dict]:
    return spec.study_size(arg, SIZES)


def get_config(arg=None):
    """The MSLT run (the `mslt` variant's stages, then the final all-layer phase); the
    baseline arm runs the phase `baseline` alone (`phase_order`)."""
    size, study = parse(arg)
    if size == "base":
        config = config_lib.pod_config(study["model"])
        config.checkpoint_every_steps = 2000
    else:
        config = common.cpu_study_config(study["model"])
    config.model.overrides.num_layers = study["num_layers"]
    config.model.overrides.dtype = study["dtype"]
    config.optimizer = config_lib.optimizer_config("lamb")

    def phase(num_steps):
        return config_lib.phase_config(
            max_seq_length=study["max_seq_length"],
            max_predictions_per_seq=study["max_predictions_per_seq"],
            global_batch_size=study["batch_size"],
            micro_batch_per_device=study["micro_batch_per_device"],
            num_steps=num_steps,
            learning_rate=study["learning_rates"][0],
            warmup_fraction=study["warmup_fraction"],
        )

    config_lib.with_phases(
        config, phase1=phase(study["num_steps"]), phase2=phase(study["final_steps"])
    )
    config = variants.apply(config, ["mslt"])
    config.phases[BASELINE_PHASE] = phase(study["num_steps"])
    config.log_every_steps = study["log_every_steps"]
    config.eval_every_steps = study["eval_every_steps"]
    return config


def arm_overrides(arm: str, learning_rate: float, config) -> dict:
    """The config fields that make `arm` out of the MSLT run of `get_config`."""
    if arm == "baseline":
        return {
            "phase_order": (BASELINE_PHASE,),
            f"phases.{BASELINE_PHASE}.learning_rate": learning_rate,
        }
    phases = list(config.phase_order)
    overrides = {f"phases.{name}.learning_rate": learning_rate for name in phases}
    frozen = [name for name in phases if config.phases[name].frozen_layers]
    if arm == "nothing_frozen":
        overrides |= {f"phases.{name}.frozen_layers": 0 for name in frozen}
    elif arm == "one_schedule":
        overrides |= {f"phases.{name}.continue_schedule": True for name in phases[1:]}
    elif arm == "decoder":
        overrides |= {f"phases.{name}.train_decoder": True for name in frozen}
    return overrides


def get_sweep(arg=None):
    _, study = parse(arg)
    config = get_config(arg)
    return [
        spec.labelled({"seed": seed, **arm_overrides(arm, lr, config)}, arm=arm, lr=lr, seed=seed)
        for seed in study["seeds"]
        for arm in study["arms"]  # the baseline first: a sweep stopped early has the target
        for lr in study["learning_rates"]
    ]


def get_study(arg=None):
    """What the report answers the question with (studies.mslt.report)."""
    _, study = parse(arg)
    return {
        "kind": "mslt",
        "report": "studies.mslt.report",
        "num_steps": study["num_steps"],
        "final_steps": study["final_steps"],
        "stage_depths": list(variants.stage_depths(study["num_layers"])),
        "learning_rates": list(study["learning_rates"]),
        "arms": list(study["arms"]),
        "paper_speedup": 2.1,  # "more than 110%" faster
    }
