"""BERT pretraining with LANS (Zheng et al., "Accelerated Large Batch Optimization of BERT
Pretraining in 54 minutes", 2020, arXiv 2006.13484): batch 96K (98,304) at sequence 128,
then 33K (33,792) at 512, with a warmup-constant-decay learning rate.

  python -m lambjax.main --config=configs/bert_lans.py:large --workdir=gs://BUCKET/run
  python -m lambjax.main --config=configs/bert_lans.py:base,runlocal --workdir=/tmp/run

`arg`: the size (`base`, the default, or `large`) and any variants of
lambjax.train.variants (`runlocal`, `pld`, `mslt`, `chunked_accumulation`, `ouroboros`,
`standardization_loss`), comma-separated.

From the paper: the batch sizes and the schedule's shape. The paper gives them as "96K" and
"33K", K = 1,024 as in LAMB's "32K" and "64K": 98,304 and 33,792, which are 64 and 22
sequences on each of its 1,536 GPUs (192 p3dn.24xlarge x 8); 32,768 would be "32K" and is not
a whole number per GPU there. The learning rate 5e-3 and the
warmup and constant fractions 0.05 and 0.25 come from a later GluonNLP script of the authors
that uses LANS (a QuickThought BERT variant, not the paper's run); the step counts keep
NVIDIA's number of samples per phase (phase 1: 7,038 x 65,536 / 98,304 = 4,692; phase 2:
1,563 x 32,768 / 33,792 = 1,516). Neither is
published for the 54-minute run. Betas, eps and weight decay are the authors' code defaults
(0.9, 0.999, 1e-6, 0.01), the gradient clip 1.0 that script's.
"""

from lambjax.sweep import spec
from lambjax.train import config as config_lib
from lambjax.train import variants

SCHEDULE = dict(
    learning_rate=5e-3,
    schedule="warmup_constant_decay",
    warmup_fraction=0.05,
    constant_fraction=0.25,
)


def get_config(arg=None):
    size, names = variants.parse_arg(arg, sizes=("base", "large"))
    config = config_lib.pod_config(size or "base")
    config.optimizer = config_lib.optimizer_config("lans")
    # Evaluation batches of 1,536 divide over the paper's 1,536 GPUs and every power-of-two
    # pod up to 512 devices (the pods' default, 1,024, does not divide over 1,536).
    config.eval_batch_size = 1536
    # Each device computes micro-batches of 64 sequences of 128 tokens (phase 1) and 11 of 512
    # (phase 2); the gradient accumulation follows from the device count: on 256 devices 6
    # and 12 micro-batches per step, on the paper's 1,536 GPUs 1 and 2.
    # --config.phases.phaseN.grad_accum_steps=K fixes it.
    config_lib.with_phases(
        config,
        phase1=config_lib.phase_config(
            max_seq_length=128,
            max_predictions_per_seq=20,
            global_batch_size=98304,
            micro_batch_per_device=64,
            num_steps=4692,
            **SCHEDULE,
        ),
        phase2=config_lib.phase_config(
            max_seq_length=512,
            max_predictions_per_seq=80,
            global_batch_size=33792,
            micro_batch_per_device=11,
            num_steps=1516,
            optimizer_state="keep",
            **SCHEDULE,
        ),
    )
    return variants.apply(config, names)


def get_sweep(arg=None):
    """Both phases' peak learning rate by the warmup, around the recipe's (5e-3, 0.05):
    `python -m lambjax.sweep --config=configs/bert_lans.py:large --workdir=DIR`."""
    return spec.product(
        {
            "phases.phase1.learning_rate": [3e-3, 5e-3, 7e-3],
            "phases.phase2.learning_rate": [3e-3, 5e-3, 7e-3],
        },
        {
            "phases.phase1.warmup_fraction": [0.025, 0.05],
            "phases.phase2.warmup_fraction": [0.025, 0.05],
        },
    )
