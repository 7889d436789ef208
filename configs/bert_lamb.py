"""BERT pretraining with LAMB, NVIDIA's recipe: batch 65,536 at sequence 128, then 32,768 at
512 (the "76 minutes" schedule of You et al., as NVIDIA's DeepLearningExamples run it).

  python -m lambjax.main --config=configs/bert_lamb.py:large --workdir=gs://BUCKET/run
  python -m lambjax.main --config=configs/bert_lamb.py:base,runlocal --workdir=/tmp/run

`arg`: the size (`base`, the default, or `large`) and any variants of
lambjax.train.variants (`runlocal`, `pld`, `mslt`, `chunked_accumulation`, `ouroboros`,
`standardization_loss`), comma-separated.

Sources: NVIDIA DeepLearningExamples, PyTorch BERT pretraining with LAMB (batch sizes,
learning rates, warmup proportions, step counts; betas 0.9/0.999, eps 1e-6, weight decay 0.01
except biases and LayerNorm, which also get no trust ratio; global gradient-norm clip 1.0;
PolyWarmUpScheduler with power 0.5). You et al., "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes", ICLR 2020 (arXiv 1904.00962).
"""

from lambjax.sweep import spec
from lambjax.train import config as config_lib
from lambjax.train import variants


def get_config(arg=None):
    size, names = variants.parse_arg(arg, sizes=("base", "large"))
    config = config_lib.pod_config(size or "base")
    config.optimizer = config_lib.optimizer_config("lamb")
    # Each device computes micro-batches of 64 sequences of 128 tokens (phase 1) and 8 of 512
    # (phase 2); the gradient accumulation follows from the device count (e.g. phase 1 on 256
    # devices: 4 micro-batches per step). --config.phases.phaseN.grad_accum_steps=K fixes it.
    config_lib.with_phases(
        config,
        phase1=config_lib.phase_config(
            max_seq_length=128,
            max_predictions_per_seq=20,
            global_batch_size=65536,
            micro_batch_per_device=64,
            num_steps=7038,
            learning_rate=6e-3,
            schedule="poly_warmup",
            warmup_fraction=0.2843,
        ),
        phase2=config_lib.phase_config(
            max_seq_length=512,
            max_predictions_per_seq=80,
            global_batch_size=32768,
            micro_batch_per_device=8,
            num_steps=1563,
            learning_rate=4e-3,
            schedule="poly_warmup",
            warmup_fraction=0.128,
            optimizer_state="keep",  # phase 2 continues phase 1's moments, step count reset
        ),
    )
    return variants.apply(config, names)


def get_sweep(arg=None):
    """Phase 1's peak learning rate by its warmup, around the recipe's (6e-3, 0.2843): the
    search the LAMB paper ran for its large-batch settings, to run again on new hardware or
    data. `python -m lambjax.sweep --config=configs/bert_lamb.py:large --workdir=DIR`."""
    return spec.product(
        {"phases.phase1.learning_rate": [4e-3, 6e-3, 8e-3]},
        {"phases.phase1.warmup_fraction": [0.2, 0.2843]},
    )
