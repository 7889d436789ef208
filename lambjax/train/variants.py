"""The variants every config accepts, and the parsing of a config's argument.

A config file's `get_config(arg)` takes a comma-separated argument: the model size where the
config has several, and any of the variants below (`runlocal` is applied first):

  --config=configs/bert_lamb.py:large                 the recipe as published, BERT-large
  --config=configs/bert_lamb.py:base,pld              + progressive layer dropping
  --config=configs/bert_lamb.py:large,mslt            + multi-stage layerwise training
  --config=configs/bert_lamb.py:base,runlocal         shrunk to run on a CPU in minutes
  --config=configs/bert_lamb.py:large,pld,runlocal    both
  --config=configs/bert_lamb.py:base,standardization_loss,runlocal
                                                      no LayerNorm; the standardization loss
  --config=configs/bert_lamb.py:base,chunked_accumulation,runlocal
                                                      float16 chunk-64 accumulation (emulated)
  --config=configs/bert_lamb.py:large,ouroboros       Ouroboros: 4 modules on 3 stages
  --config=configs/bert_lamb.py:large,fast            no attention dropout: fused attention
"""

import copy

import ml_collections

from lambjax.train import method
from lambjax.train.config import ConfigError, model_depth, with_phases


def runlocal(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The same recipe (optimizer, schedules, phases) shrunk to run on a CPU in minutes."""
    config.model.preset = "tiny"
    # float32: runs on 1, 2 or 4 devices (and processes) then agree to 1e-5, which the tests
    # check; bfloat16 products round differently with each sharding.
    config.model.overrides = ml_collections.ConfigDict(
        {"dtype": "float32", "attention": "auto", "gelu_approximate": False}
    )
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


def layer_drop(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Progressive layer dropping on PreLN blocks, the paper's settings.

    theta_bar = 0.5 (the authors' default), DeepSpeed's depth rule (`layer_drop.depth_rule`'s
    default); gamma = 100 / T for the run's T optimizer steps, the paper's heuristic, which
    scales with the run. theta comes within 0.05 of theta_bar after ln(10) / gamma steps: with
    the authors' fixed 0.001 that is 1.2% of their 200,000 steps but 27% of the 8,601 of
    configs/bert_lamb.py, and `runlocal`'s 12 steps end at theta 0.994; with 100 / T it is
    2.3% of any run. The PLD study (studies/pld/README.md) runs both; at its
    CPU size it could not tell them apart. `--config.layer_drop.gamma=0.001` sets
    DeepSpeed's.
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
    choices. A stage's `continue_schedule` and `train_decoder` change the other two (one
    schedule across stages; the tied decoder trained); studies/mslt/README.md compares them.
    """
    depths = stage_depths(model_depth(config))
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


def standardization_loss(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The embeddings' and the encoder's LayerNorms replaced by the standardization loss
    (Collins, Balle, Shlens 2019, arXiv 1903.00925; lambjax.models.standardization).

    The weight: the paper's lambda for its one network trained with no normalization layer
    at all, MobileNet-v1 (1e-4; its other nets: 1.0 for the MNIST nets, 1e-3 PointNet, 1e-5
    Inception-v2, 1e-6 ResNet-50). L_std sums over channels and layers, so a wide, deep
    model wants a smaller lambda: `--config.standardization_loss.weight`.
    """
    config.model.overrides.normalization = "none"
    config.standardization_loss.weight = 1e-4
    return config


def fast(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """No dropout on the attention probabilities, as MosaicBERT, Cramming and MaxText
    pretrain: the fused attention kernels (cuDNN on GPU, splash on TPU) have none, so with it
    off `attention='auto'` picks them (lambjax.models.attention). Hidden dropout stays 0.1, as
    in MosaicBERT. Its cost in held-out MLM loss on CPU: docs/fast_path.md."""
    config.model.overrides.attention_dropout = 0.0
    return config


VARIANTS = {
    "runlocal": runlocal,
    "pld": layer_drop,
    "mslt": multi_stage,
    # float16 accumulation in chunks of 64 in the encoder's matmuls, emulated (Wang et al.,
    # NeurIPS 2018, arXiv 1812.08011), a step method of its own.
    "chunked_accumulation": method.variant("lambjax.contrib.chunked_accumulation"),
    "standardization_loss": standardization_loss,
    # Ouroboros (Yang et al., NeurIPS 2019, arXiv 1909.06695), a step method of its own:
    # 4 modules on 3 stages where the depth divides by 3, else 3 on 2.
    "ouroboros": method.variant("lambjax.contrib.ouroboros"),
    "fast": fast,
}


def parse_arg(arg: str | None, sizes: tuple[str, ...] = ()) -> tuple[str | None, list[str]]:
    """`arg` as (size or None, variant names): `'large,mslt'` -> ('large', ['mslt'])."""
    names = [name.strip() for name in (arg or "").split(",") if name.strip()]
    chosen = [name for name in names if name in sizes]
    unknown = [name for name in names if name not in sizes and name not in VARIANTS]
    if unknown or len(chosen) > 1:
        valid = f"sizes {list(sizes)} (one), " if sizes else ""
        raise ConfigError(
            f"config argument {arg!r}: {unknown or chosen} not understood; valid: "
            f"{valid}variants {sorted(VARIANTS)}, comma-separated"
        )
    return (chosen[0] if chosen else None), [name for name in names if name in VARIANTS]


def apply(config: ml_collections.ConfigDict, names: list[str]) -> ml_collections.ConfigDict:
    """Applies the named variants; `runlocal` first, so the others see the shrunk model and
    step counts."""
    for name in sorted(names, key=lambda name: name != "runlocal"):
        config = VARIANTS[name](config)
    return config
