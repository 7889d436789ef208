"""Weights from Google's original BERT checkpoints (TensorFlow 1: google-research/bert).

A directory as Google published them: `bert_config.json`, `bert_model.ckpt.{index,data-*}`
and `vocab.txt`; MLPerf's BERT starts from one too.

  config, params, missing = from_tf_checkpoint("uncased_L-12_H-768_A-12")

The checkpoint is read with TensorFlow's checkpoint reader (`tf.train.load_checkpoint`),
which needs no TF1 graph. Its variables are renamed to transformers' names, kernels
transposed to PyTorch's [out, in], as transformers' own converter did
(`convert_bert_original_tf_checkpoint_to_pytorch`), and then read by lambjax.models.hf:
`bert/encoder/layer_0/attention/self/query/kernel` is
`bert.encoder.layer.0.attention.self.query.weight`, LayerNorm `gamma`/`beta` are
`weight`/`bias`, and the heads' `cls/predictions/output_bias` and
`cls/seq_relationship/output_weights` are `cls.predictions.bias` and
`cls.seq_relationship.weight`. The optimizer's slots (`adam_m`, `adam_v`) and
`global_step` are not weights and are skipped.
"""

import json
import os
import re

import numpy as np

from lambjax.models import hf
from lambjax.models.config import BertConfig

CONFIG_FILE = "bert_config.json"

# The last part of a TensorFlow name -> transformers' leaf name.
_LEAVES = {
    "kernel": "weight",
    "gamma": "weight",
    "beta": "bias",
    "bias": "bias",
    "output_weights": "weight",
    "output_bias": "bias",
}
_SKIPPED = {"adam_m", "adam_v", "global_step", "AdamWeightDecayOptimizer"}


def checkpoint_prefix(directory: str) -> str:
    """The path prefix of the one checkpoint in `directory` (`bert_model.ckpt` in Google's
    releases); ValueError naming what is there otherwise."""
    indexes = sorted(name for name in os.listdir(directory) if name.endswith(".index"))
    if len(indexes) != 1:
        found = ", ".join(indexes) if indexes else "none"
        raise ValueError(
            f"{directory}: a TensorFlow BERT checkpoint directory holds one *.index file "
            f"(bert_model.ckpt.index) beside bert_config.json; found {found}"
        )
    return os.path.join(directory, indexes[0][: -len(".index")])


def transformers_name(name: str) -> str | None:
    """The transformers name of TensorFlow variable `name`, or None if it is no weight."""
    parts = name.split("/")
    if parts[0] not in ("bert", "cls") or _SKIPPED & set(parts):
        return None
    parts = [re.sub(r"^layer_(\d+)$", r"layer.\1", part) for part in parts]
    if parts[-1].endswith("_embeddings"):
        return ".".join(parts) + ".weight"
    if parts[-1] not in _LEAVES:
        return None
    return ".".join([*parts[:-1], _LEAVES[parts[-1]]])


def read_state(prefix: str) -> dict[str, np.ndarray]:
    """The checkpoint's weights under transformers' names, in PyTorch's layout."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(prefix)
    state = {}
    for name in reader.get_variable_to_shape_map():
        theirs = transformers_name(name)
        if theirs is None:
            continue
        value = np.asarray(reader.get_tensor(name), np.float32)
        state[theirs] = value.T if name.endswith("/kernel") else value
    return state


def from_tf_checkpoint(directory: str) -> tuple[BertConfig, dict, list[str]]:
    """(config, params, names of the weights it lacks, which were initialised) of a Google
    BERT checkpoint directory; ValueError (or FileNotFoundError) naming what is wrong."""
    config_path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{directory}: no {CONFIG_FILE}")
    with open(config_path, encoding="utf-8") as f:
        config = hf.config_from_hf(json.load(f))
    prefix = checkpoint_prefix(directory)
    try:
        state = read_state(prefix)
    except Exception as error:  # TensorFlow's reader raises its own errors for a bad file
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{prefix}: not a readable TensorFlow checkpoint ({reason})") from None
    if not state:
        raise ValueError(f"{prefix}: no BERT weights (bert/... or cls/... variables)")
    params, missing = hf.params_from_state(config, state, prefix)
    return config, params, missing
