"""The batch-scaling study: steps to a target held-out MLM loss against the batch size, for
LAMB, LANS and AdamW, each tuned at every batch size (Shallue et al. 2018; Nado et al. 2021).

  python -m studies.corpus linux-doc-6.1_*.deb data/linux-doc   # the corpus (studies/corpus.py)
  python -m lambjax.sweep --config=studies/batch_scaling/config.py --workdir=workdir/bs \
      --parallel=2                                   # stage 1: the learning-rate grid
  python -m lambjax.sweep --config=studies/batch_scaling/config.py:cpu,stage2 \
      --workdir=workdir/bs --parallel=2              # stage 2: warmups and seeds (same DIR)
  python -m lambjax.sweep report workdir/bs          # the study's table and plots
  python -m lambjax.sweep --config=studies/batch_scaling/config.py:large \
      --workdir=gs://BUCKET/bs --launcher=tpu        # (or slurm) at BERT size

The question: as the batch grows, how do the steps to a fixed held-out MLM loss fall for
LAMB, LANS and AdamW when each has its learning rate (and warmup) tuned at every batch
size, and where does the fall stop (the critical batch size, against the gradient noise
scale measured during the runs)? Perfect scaling halves the steps per doubling.

`arg` is `SIZE[,stage2]`: SIZE `cpu` (the default: a tiny BERT on the Linux kernel's
documentation, 2 CPU cores, several hours), `base` or `large` (BERT on Wikipedia, phase 1
only, sequence 128, for a pod), `smoke` (a few steps, for the tests).

Every trial warms up linearly over `warmup_steps`, then holds its learning rate, and ends
at the first evaluation that reaches the target (config.target): its steps to the target do
not depend on a budget or on a decay tied to one, and it costs only the steps it needs.
`budgets` caps each batch size's steps; at CPU size it is at most one pass over the training
split. The learning rate is base x sqrt(B / B0) x m for m in `multipliers`, at every batch
size and for every optimizer (stage 1). Stage 2, named after stage 1's results and fixed in
a commit before it runs: the grid extended where the best m sits at an edge
(`extensions`), the best point rerun with the other warmups (`warmups`), and the best point
of each (optimizer, batch) rerun with `seeds`.

The grids, seeds, budgets and target below were fixed before the measured runs, from the
pilot described at SIZES["cpu"].
"""

import math

from lambjax.sweep import spec
from lambjax.train import config as config_lib
from studies import common

OPTIMIZERS = ("lamb", "lans", "adamw")

SIZES = {
    # A tiny BERT (L2 H128) on the Linux kernel's documentation (linux-doc-6.1 6.1.176-1:
    # 22.3M characters, 3,184 documents; studies/corpus.py), WordPiece 8,192 trained on it,
    # 10% of documents held out: 102,095 training sequences of 32 tokens (BERT's recipe,
    # NSP), 9,760 held out, of which every evaluation scores the same 2,048 (10,191 masked
    # tokens: a unigram model scores 6.670 on them, per-token sd 2.38, standard error 0.024;
    # python -m studies.held_out --config=studies/batch_scaling/config.py --data_dir=DIR).
    "cpu": dict(
        model="tiny",
        corpus="text:data/linux-doc/*.txt",
        vocab_size=8192,
        max_seq_length=32,
        max_predictions_per_seq=5,
        train_sequences=102_095,
        eval_batch_size=256,
        eval_steps=8,
        batch_sizes=(32, 64, 128, 256, 512),
        # The pilot (LAMB, batch 64, lr 1.4e-2, warmup 75 then constant, seed 99, noise scale
        # on): eval MLM loss 6.82 at step 100 (the unigram plateau, 6.67), 6.11 at 375, 6.04
        # at 500, 5.90 at 750, 5.81 at 1,000; the measured noise scale B_simple fluctuated
        # between 90 and 320 from step 100 to 1,175, mean ~150. The target 6.1 is 0.57 nats
        # below the unigram level (24 standard errors), reached at step ~400 at batch 64.
        # Expected steps from McCandlish et al.'s S(B) = S_min (1 + B_crit / B) through that
        # point with B_crit = 150: 681, 400, 260, 190, 155 at 32 .. 512.
        target_loss=6.1,
        other_targets=(6.3, 6.2),  # read off the same curves (they end at 6.1)
        pilot=dict(batch=64, steps=400, noise_scale=150),
        # Three times the expected steps, capped at one pass over the training split.
        budget_factor=3.0,
        # The sqrt rule's centre at B0 = 32: LAMB's is the demo's (configs/default.py, batch
        # 32; x sqrt 2 = the pilot's at 64), LANS takes LAMB's, AdamW a tenth of it (BERT's
        # 1e-4 to LAMB's 1e-3 range at batch 256).
        base_learning_rates=dict(lamb=1e-2, lans=1e-2, adamw=1e-3),
        multipliers=(0.5, 1.0, 2.0, 4.0),
        warmup_steps=25,
        warmups=(10, 60),
        seeds=(1, 2),
        # Stage 2, as stage 1's report printed it on 2026-11-27 at 16:00 UTC with 48 of its
        # 60 trials finished. The 12 left (the lr_x 4 column) can change it only by reaching
        # the target, which no trial at lr_x 2 did; the README records the check made when
        # they end. Grid extensions: (optimizer, batch) -> further multipliers, where stage
        # 1's best sat at an edge.
        extensions={
            **{("lamb", b): (0.25,) for b in (32, 128, 256, 512)},
            **{("lans", b): (0.25,) for b in (32, 64, 128, 256, 512)},
            **{("adamw", b): (0.25,) for b in (128, 256, 512)},
        },
        # Best points: (optimizer, batch) -> the multiplier stage 1 chose.
        best={
            **{("lamb", b): 0.5 for b in (32, 128, 256, 512)},
            ("lamb", 64): 1.0,
            **{("lans", b): 0.5 for b in (32, 64, 128, 256, 512)},
            **{("adamw", b): 1.0 for b in (32, 64)},
            **{("adamw", b): 0.5 for b in (128, 256, 512)},
        },
    ),
    # BERT on Wikipedia, phase 1 (sequence 128) only, 2K .. 64K sequences per step. Each
    # batch size's budget is NVIDIA's phase-1 sample count (65,536 x 7,038, which takes
    # BERT-large to an MLM loss of ~1.7, past these targets) in steps of that batch; the
    # trials end at the target. Base learning rates at B0 = 2,048, each optimizer's
    # published setting moved to 2K by the square-root rule: LAMB 5e-3 at 32K (the LAMB
    # paper's Table 4) -> 1.25e-3; LANS 5e-3 at 96K (configs/bert_lans.py) -> 7.2e-4; AdamW
    # BERT's 1e-4 at 256 -> 2.8e-4.
    "base": dict(
        model="base",
        corpus="tfds:wikipedia/20230601.en",
        vocab_size=30522,
        max_seq_length=128,
        max_predictions_per_seq=20,
        train_sequences=None,  # Wikipedia's ~1.6e8: no trial makes a pass
        eval_batch_size=1024,
        eval_steps=8,
        batch_sizes=(2048, 4096, 8192, 16384, 32768, 65536),
        target_loss=2.2,
        other_targets=(2.4, 2.0),
        budget_samples=65536 * 7038,
        base_learning_rates=dict(
            lamb=5e-3 * math.sqrt(2048 / 32768),
            lans=5e-3 * math.sqrt(2048 / 98304),
            adamw=1e-4 * math.sqrt(2048 / 256),
        ),
        multipliers=(0.5, 1.0, 2.0, 4.0),
        warmup_steps=500,
        warmups=(200, 2000),
        seeds=(1, 2),
        extensions={},
        best={},
    ),
}
SIZES["large"] = dict(SIZES["base"], model="large", target_loss=2.0, other_targets=(2.2, 1.8))
# The study's smallest form, for the tests: one encoder layer on the embedded corpus, two
# batch sizes, a target the first evaluation reaches.
SIZES["smoke"] = dict(
    SIZES["cpu"],
    corpus="embedded",
    vocab_size=2048,
    num_layers=1,
    train_sequences=2417,
    eval_batch_size=32,
    eval_steps=2,
    batch_sizes=(8, 16),
    pilot=dict(batch=8, steps=2, noise_scale=8),
    budget_factor=2.0,
    base_learning_rates=dict(lamb=1e-2, adamw=1e-3),
    multipliers=(1.0,),
    warmup_steps=1,
    warmups=(2,),
    seeds=(1,),
    target_loss=7.65,
    other_targets=(),
    extensions={("adamw", 16): (4.0,)},
    best={("lamb", 8): 1.0},
)


def parse(arg) -> tuple[str, dict, bool]:
    return common.staged_size(arg, SIZES)


def expected_steps(study: dict, batch_size: int) -> float:
    """The pilot's steps to the target moved to `batch_size` by S(B) = S_min (1 + B_crit/B),
    with the pilot's noise scale for B_crit; None at a pod size (no pilot)."""
    pilot = study.get("pilot")
    if pilot is None:
        return None
    b_crit = pilot["noise_scale"]
    return pilot["steps"] * (1 + b_crit / batch_size) / (1 + b_crit / pilot["batch"])


def budget(study: dict, batch_size: int) -> int:
    """The step cap of `batch_size`: budget_factor x the expected steps, at most one pass
    (CPU); NVIDIA's phase-1 samples in steps of the batch (pod)."""
    if "budget_samples" in study:
        return study["budget_samples"] // batch_size
    steps = math.ceil(study["budget_factor"] * expected_steps(study, batch_size))
    return min(steps, study["train_sequences"] // batch_size)


def eval_every(study: dict, batch_size: int) -> int:
    """About 20 evaluations before the expected crossing (a resolution of ~5%); at a pod
    size, 50 over the budget of the largest batch."""
    expected = expected_steps(study, batch_size)
    if expected is None:
        return max(1, budget(study, max(study["batch_sizes"])) // 50)
    return max(1, round(expected / 20))


def learning_rate(study: dict, optimizer: str, batch_size: int, multiplier: float) -> float:
    base = study["base_learning_rates"][optimizer]
    rate = base * math.sqrt(batch_size / study["batch_sizes"][0]) * multiplier
    return float(f"{rate:.4g}")


def get_config(arg=None):
    size, study, _ = parse(arg)
    if size in ("base", "large"):
        config = config_lib.pod_config(study["model"])
        # 4 sequences per device and micro-batch: B0 = 2,048 is two micro-batches on 256
        # devices (the noise scale needs two at least); 64K is 64.
        micro_batch = 4
        config.checkpoint_every_steps = 500
    else:
        config = common.cpu_study_config(study["model"])
        config.data.source = study["corpus"]
        config.data.vocab_size = study["vocab_size"]
        if "num_layers" in study:
            config.model.overrides.num_layers = study["num_layers"]
        micro_batch = None
        config.checkpoint_every_steps = 2000
    config.eval_batch_size = study["eval_batch_size"]
    config.eval_steps = study["eval_steps"]
    config.optimizer = config_lib.optimizer_config("lamb")
    config.target.metric = "mlm_loss"
    config.target.value = study["target_loss"]
    b0 = study["batch_sizes"][0]
    config_lib.with_phases(
        config,
        phase1=config_lib.phase_config(
            max_seq_length=study["max_seq_length"],
            max_predictions_per_seq=study["max_predictions_per_seq"],
            global_batch_size=b0,
            micro_batch_per_device=micro_batch,
            # Two micro-batches at least: the gradient noise scale needs them.
            grad_accum_steps=None if micro_batch else 2,
            num_steps=budget(study, b0),
            learning_rate=study["base_learning_rates"]["lamb"],
            schedule="warmup_constant_decay",
        ),
    )
    config.noise_scale.enabled = True
    return config


def trial(
    study: dict,
    optimizer: str,
    batch_size: int,
    multiplier: float,
    seed: int = 0,
    warmup: int | None = None,
) -> dict:
    """One point of the grid, labelled with what the report groups by."""
    steps = budget(study, batch_size)
    warmup = study["warmup_steps"] if warmup is None else warmup
    warmup_fraction = min(1.0, warmup / steps)
    every = eval_every(study, batch_size)
    overrides = {
        "seed": seed,
        "optimizer.name": optimizer,
        "phases.phase1.global_batch_size": batch_size,
        "phases.phase1.num_steps": steps,
        "phases.phase1.learning_rate": learning_rate(study, optimizer, batch_size, multiplier),
        "phases.phase1.warmup_fraction": warmup_fraction,
        "phases.phase1.constant_fraction": 1.0 - warmup_fraction,
        "eval_every_steps": every,
        "log_every_steps": every,
    }
    return spec.labelled(
        overrides,
        optimizer=optimizer,
        batch=batch_size,
        lr_x=multiplier,
        seed=seed,
        warmup=warmup,
    )


def stage1(study: dict) -> list[dict]:
    """Every optimizer's grid at every batch size, the centre of the grid first, so that a
    sweep stopped early has the same points for every optimizer and batch size."""
    order = sorted(study["multipliers"], key=lambda m: (abs(math.log(m)), -m))
    return [
        trial(study, optimizer, batch_size, multiplier)
        for multiplier in order
        for batch_size in study["batch_sizes"]
        for optimizer in study["base_learning_rates"]
    ]


def stage2(study: dict) -> list[dict]:
    """The extensions, then each best point's other warmups and seeds."""
    trials = [
        trial(study, optimizer, batch_size, multiplier)
        for (optimizer, batch_size), extra in study["extensions"].items()
        for multiplier in extra
    ]
    for (optimizer, batch_size), multiplier in study["best"].items():
        trials += [
            trial(study, optimizer, batch_size, multiplier, warmup=w) for w in study["warmups"]
        ]
        trials += [trial(study, optimizer, batch_size, multiplier, seed=s) for s in study["seeds"]]
    return trials


def get_sweep(arg=None):
    _, study, with_stage2 = parse(arg)
    return stage1(study) + (stage2(study) if with_stage2 else [])


def get_study(arg=None):
    """What the report answers the question with (studies.batch_scaling.report)."""
    _, study, _ = parse(arg)
    return {
        "kind": "batch_scaling",
        "report": "studies.batch_scaling.report",
        "target_loss": study["target_loss"],
        "other_targets": list(study["other_targets"]),
        "batch_sizes": list(study["batch_sizes"]),
        "budgets": {str(b): budget(study, b) for b in study["batch_sizes"]},
        "expected_steps": {str(b): expected_steps(study, b) for b in study["batch_sizes"]},
        "multipliers": list(study["multipliers"]),
        "warmup_steps": study["warmup_steps"],
        "base_learning_rates": study["base_learning_rates"],
        "train_sequences": study["train_sequences"],
    }
