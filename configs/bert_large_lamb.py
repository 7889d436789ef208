"""BERT-large with NVIDIA's LAMB recipe (see lambjax.train.recipes.nvidia_lamb_recipe).

python -m lambjax.main --config=configs/bert_large_lamb.py --workdir=gs://BUCKET/run
python -m lambjax.main --config=configs/bert_large_lamb.py:runlocal --workdir=/tmp/run
"""

from lambjax.train import recipes


def get_config(arg=None):
    return recipes.apply_variant(recipes.nvidia_lamb_recipe("large"), arg)
