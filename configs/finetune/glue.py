r"""A GLUE task, Google BERT's recipe (run_classifier.py and its README): batch 32,
sequence 128, lr 2e-5, 3 epochs, warmup 10%.

  python -m lambjax.finetune --config=configs/finetune/glue.py:sst2 --workdir=DIR \
      --config.init=workdir:PRETRAIN_DIR \
      --config.data.train=SST-2/train.tsv --config.data.eval=SST-2/dev.tsv

TASK is one of cola sst2 mrpc stsb qqp mnli qnli rte wnli. MNLI also needs
--config.data.eval_mismatched=MNLI/dev_mismatched.tsv (with eval=MNLI/dev_matched.tsv).
"""

from lambjax.finetune import config as config_lib


def get_config(arg=None):
    config = config_lib.base_config()
    config.task = arg or ""  # checked when the run starts (one line naming the valid tasks)
    config.max_seq_length = 128
    config.global_batch_size = 32
    config.learning_rate = 2e-5
    config.num_epochs = 3.0
    config.warmup_fraction = 0.1
    return config
