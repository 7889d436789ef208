"""The embedded demo: a tiny BERT, both phases, on the corpus every Python ships.

  python -m lambjax.main --config=configs/default.py --workdir=workdir/demo

A few minutes on 2 CPU cores. LAMB with NVIDIA's settings and schedule shape; the learning
rates suit this small batch (the paper's are for batch 65,536).
"""

from lambjax.sweep import spec
from lambjax.train import config as config_lib
from lambjax.train import variants


def get_config(arg=None):
    _, names = variants.parse_arg(arg)
    config = config_lib.base_config()
    config.model.preset = "tiny"
    # Why bfloat16 (the default) and unrolled layers: docs/performance.md, the demo's settings.
    config.model.overrides.scan_layers = False
    config.data.source = "embedded"
    config.data.vocab = "train"
    config.data.vocab_size = 4096
    config_lib.with_phases(
        config,
        phase1=config_lib.phase_config(
            max_seq_length=128,
            max_predictions_per_seq=20,
            global_batch_size=32,
            num_steps=300,
            learning_rate=1e-2,
            warmup_fraction=0.1,
        ),
        phase2=config_lib.phase_config(
            max_seq_length=512,
            max_predictions_per_seq=80,
            global_batch_size=8,
            num_steps=40,
            learning_rate=5e-3,
            warmup_fraction=0.1,
        ),
    )
    config.log_every_steps = 20
    config.eval_every_steps = 100
    config.eval_batch_size = 16
    config.checkpoint_every_steps = 100
    return variants.apply(config, names)


def get_sweep(arg=None):
    """The demo's phase-1 learning rate by warmup (6 trials of a few minutes each):
    `python -m lambjax.sweep --config=configs/default.py --workdir=workdir/sweep --parallel=2`."""
    return spec.product(
        {"phases.phase1.learning_rate": [5e-3, 1e-2, 2e-2]},
        {"phases.phase1.warmup_fraction": [0.05, 0.1]},
    )
