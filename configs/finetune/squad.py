r"""SQuAD v1.1 (or v2.0 with `:v2`), Google BERT's recipe (run_squad.py and its README).

  python -m lambjax.finetune --config=configs/finetune/squad.py --workdir=DIR \
      --config.init=workdir:PRETRAIN_DIR \
      --config.data.train=train-v1.1.json --config.data.eval=dev-v1.1.json

Published dev F1 of the recipe: BERT-base 88.5, BERT-large 90.9 (v1.1); the LAMB paper's
bar for BERT-large pretrained in 76 minutes is F1 >= 90.5 (it reports 91.3).
"""

from lambjax.finetune import config as config_lib


def get_config(arg=None):
    config = config_lib.base_config()
    versions = {None: "squad_v1.1", "": "squad_v1.1", "v1": "squad_v1.1", "v2": "squad_v2.0"}
    config.task = versions.get(arg, f"squad:{arg}")  # anything else: rejected at the start
    config.max_seq_length = 384
    config.doc_stride = 128
    config.max_query_length = 64
    config.n_best_size = 20
    config.max_answer_length = 30
    config.global_batch_size = 24  # the README's TPU setting
    config.learning_rate = 3e-5
    config.num_epochs = 2.0
    config.warmup_fraction = 0.1
    return config
