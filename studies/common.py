"""What the CPU studies share: their set-up (model preset, data, evaluation)."""

import ml_collections

from lambjax.sweep import spec
from lambjax.train import config as config_lib

STAGE2 = "stage2"  # the config argument's flag of a two-stage study: SIZE,stage2


def staged_size(arg, sizes: dict) -> tuple[str, dict, bool]:
    """(size, its settings, whether stage 2 is asked for) of a two-stage study's config
    argument `SIZE[,stage2]` (spec.study_size for the size)."""
    parts = [p for p in (arg or "").split(",") if p]
    size, study = spec.study_size(",".join(p for p in parts if p != STAGE2), sizes)
    return size, study, STAGE2 in parts


def cpu_study_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    """The CPU studies' shared set-up: `preset` (layers unrolled, faster on XLA:CPU) on
    CPython's embedded corpus with a WordPiece vocabulary of 2,048 trained on it and 10% of
    the documents held out, every evaluation over every whole batch of the held-out split
    (the reader drops the remainder; studies.held_out counts what is scored). Studies that
    use it with the same sequence length share one dataset in a data_dir."""
    config = config_lib.base_config()
    config.model.preset = preset
    config.model.overrides.scan_layers = False
    config.data.source = "embedded"
    config.data.vocab = "train"
    config.data.vocab_size = 2048
    config.data.validation_fraction = 0.1
    config.eval_batch_size = 32
    config.eval_steps = 0  # every whole held-out batch, the same for every trial
    config.checkpoint_every_steps = 1000
    return config
