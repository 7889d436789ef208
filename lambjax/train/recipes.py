"""The recipes (NVIDIA's LAMB, LANS) and the variants every config accepts.

A config file picks a recipe and passes its argument to `apply_variant`:

  --config=configs/bert_base_lamb.py                  the recipe as published
  --config=configs/bert_base_lamb.py:pld              + progressive layer dropping
  --config=configs/bert_base_lamb.py:mslt             + multi-stage layerwise training
  --config=configs/bert_base_lamb.py:runlocal         shrunk to run on a CPU in minutes
  --config=configs/bert_base_lamb.py:pld,runlocal     both (runlocal is applied first)
"""

import copy

import ml_collections

from lambjax.train.config import (
    ConfigError,
    base_config,
    model_config,
    optimizer_config,
    phase_config,
    with_phases,
)


def runlocal(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The same recipe (optimizer, schedules, phases) shrunk to run on a CPU in minutes."""
    config.model.preset = "tiny"
    # float32: runs on 1, 2 or 4 devices (and processes) then agree to 1e-5, which the tests
    # check; bfloat16 products round differently with each sharding.
    config.model.overrides = ml_collections.ConfigDict({"dtype": "float32"})
    config.data.source = "embedded"
    config.data.vocab = "train"
    config.data.vocab_size = 2048
    for name in config.phase_order:
        phase = config.phases[name]
        long = phase.max_seq_length > 128
        phase.global_batch_size = 16 if long else 32
        phase.grad_accum_steps = 2
        phase.num_steps = 6
    config.log_every_steps = 2
    config.eval_every_steps = 6
    config.eval_batch_size = 8
    config.eval_steps = 2
    config.checkpoint_every_steps = 3
    return config


def nvidia_lamb_recipe(preset: str) -> ml_collections.ConfigDict:
    """NVIDIA's BERT pretraining with LAMB (DeepLearningExamples): 65,536 then 32,768.

    Gradient accumulation here suits 256 devices (micro-batches of 64 x 128 tokens and
    8 x 512 tokens per device); set grad_accum_steps for your pod.
    """
    config = base_config()
    config.model.preset = preset
    config.data.source = "tfds:wikipedia/20230601.en"
    config.data.vocab_size = 30522
    config.optimizer = optimizer_config("lamb")
    with_phases(
        config,
        phase1=phase_config(
            max_seq_length=128,
            max_predictions_per_seq=20,
            global_batch_size=65536,
            grad_accum_steps=4,
            num_steps=7038,
            learning_rate=6e-3,
            warmup_fraction=0.2843,
        ),
        phase2=phase_config(
            max_seq_length=512,
            max_predictions_per_seq=80,
            global_batch_size=32768,
            grad_accum_steps=16,
            num_steps=1563,
            learning_rate=4e-3,
            warmup_fraction=0.128,
        ),
    )
    config.log_every_steps = 10
    config.eval_every_steps = 500
    config.eval_batch_size = 1024
    config.eval_steps = 10
    config.checkpoint_every_steps = 200
    return config


def lans_recipe(preset: str) -> ml_collections.ConfigDict:
    """LANS (Zheng et al.): batch 96K (98,304) then 33K (32,768), warmup-constant-decay.

    From the paper: the batch sizes and the schedule's shape. The learning rate, warmup and
    constant fractions are those of the authors' later GluonNLP LANS script (5e-3, 0.05,
    0.25); the step counts keep NVIDIA's number of samples per phase. Neither is published
    for the 54-minute run.
    """
    config = nvidia_lamb_recipe(preset)
    config.optimizer = optimizer_config("lans")
    with_phases(
        config,
        phase1=phase_config(
            max_seq_length=128,
            max_predictions_per_seq=20,
            global_batch_size=98304,
            grad_accum_steps=6,
            num_steps=4692,
            learning_rate=5e-3,
            schedule="warmup_constant_decay",
            warmup_fraction=0.05,
            constant_fraction=0.25,
        ),
        phase2=phase_config(
            max_seq_length=512,
            max_predictions_per_seq=80,
            global_batch_size=32768,
            grad_accum_steps=16,
            num_steps=1563,
            learning_rate=5e-3,
            schedule="warmup_constant_decay",
            warmup_fraction=0.05,
            constant_fraction=0.25,
        ),
    )
    return config


def layer_drop(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Progressive layer dropping on PreLN blocks, the paper's settings.

    theta_bar = 0.5 (the authors' default); gamma = 100 / T for the run's T optimizer steps
    (the paper's heuristic; the authors' 0.001 was for T = 200,000).
    """
    config.model.overrides.layer_norm = "pre"
    total_steps = sum(config.phases[name].num_steps for name in config.phase_order)
    config.layer_drop.enabled = True
    config.layer_drop.theta_bar = 0.5
    config.layer_drop.gamma = 100.0 / total_steps
    return config


# Encoder depth of each stage, by the model's full depth.
STAGE_DEPTHS = {12: (3, 6, 12), 24: (6, 12, 18, 24)}


def stage_depths(num_layers: int) -> tuple[int, ...]:
    """The recipe's stages: base 3 -> 6 -> 12, large 6 -> 12 -> 18 -> 24, else up to two
    halvings (8 -> 2, 4, 8; 2 -> 1, 2)."""
    if num_layers in STAGE_DEPTHS:
        return STAGE_DEPTHS[num_layers]
    depths = [num_layers]
    while len(depths) < 3 and depths[0] % 2 == 0:
        depths.insert(0, depths[0] // 2)
    return tuple(depths)


def multi_stage(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Multi-stage layerwise training: the first phase becomes one phase per stage.

    Stage i has depth `stage_depths(L)[i]` and trains only the layers it adds (the layers of
    the stages before it are frozen); each stage gets an equal share of the phase's steps,
    re-warms its learning rate and starts a fresh optimizer state (the new layers have none).
    The later phases (phase 2 at sequence 512) train every layer: the final all-layer stage.
    The paper's per-stage step counts and its final stage are not published; these are
    choices (see README).
    """
    depths = stage_depths(model_config(config, vocab_size=1).num_layers)
    first, *later = config.phase_order
    template = config.phases[first]
    share, extra = divmod(template.num_steps, len(depths))
    if share == 0:
        raise ConfigError(
            f"config.phases.{first}.num_steps={template.num_steps} is too few for "
            f"{len(depths)} stages {depths}"
        )
    phases = {}
    for index, depth in enumerate(depths):
        stage = copy.deepcopy(template)
        stage.num_layers = depth
        stage.frozen_layers = depths[index - 1] if index else 0
        stage.num_steps = share + (extra if index == len(depths) - 1 else 0)
        if index:
            stage.optimizer_state = "reset"
        phases[f"{first}_stage{index + 1}"] = stage
    for name in later:
        phases[name] = config.phases[name]
        phases[name].optimizer_state = "reset"  # every layer trains again
    return with_phases(config, **phases)


VARIANTS = {"runlocal": runlocal, "pld": layer_drop, "mslt": multi_stage}


def apply_variant(config: ml_collections.ConfigDict, arg: str | None):
    """The variants every recipe config accepts (`--config=configs/X.py:VARIANT[,VARIANT]`).

    `runlocal` is applied first, so the others see the shrunk model and step counts.
    """
    names = [name.strip() for name in (arg or "").split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise ConfigError(
            f"unknown config variant(s) {unknown} in {arg!r}; valid: {sorted(VARIANTS)}, "
            f"comma-separated"
        )
    for name in sorted(names, key=lambda name: name != "runlocal"):
        config = VARIANTS[name](config)
    return config
