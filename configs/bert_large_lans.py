"""BERT-large with the LANS recipe (see lambjax.train.recipes.lans_recipe).

python -m lambjax.main --config=configs/bert_large_lans.py --workdir=gs://BUCKET/run
python -m lambjax.main --config=configs/bert_large_lans.py:runlocal --workdir=/tmp/run
"""

from lambjax.train import recipes


def get_config(arg=None):
    return recipes.apply_variant(recipes.lans_recipe("large"), arg)
