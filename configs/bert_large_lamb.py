"""BERT-large with NVIDIA's LAMB recipe (see lambjax.train.config.nvidia_lamb_recipe).

python -m lambjax.main --config=configs/bert_large_lamb.py --workdir=gs://BUCKET/run
python -m lambjax.main --config=configs/bert_large_lamb.py:runlocal --workdir=/tmp/run
"""

from lambjax.train import config as config_lib


def get_config(arg=None):
    return config_lib.apply_variant(config_lib.nvidia_lamb_recipe("large"), arg)
