"""BERT-base with the LANS recipe (see lambjax.train.config.lans_recipe).

python -m lambjax.main --config=configs/bert_base_lans.py --workdir=gs://BUCKET/run
python -m lambjax.main --config=configs/bert_base_lans.py:runlocal --workdir=/tmp/run
"""

from lambjax.train import config as config_lib


def get_config(arg=None):
    return config_lib.apply_variant(config_lib.lans_recipe("base"), arg)
