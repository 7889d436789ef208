"""Google's original TensorFlow BERT checkpoints (bert_model.ckpt + bert_config.json) load to
the same outputs as the transformers model they convert to.

The checkpoint is written by TensorFlow in the test from a transformers BertForPreTraining,
under the original's variable names and shapes (transformers' converter maps them the other
way: kernels are [in, out] in TensorFlow, LayerNorm weights `gamma`/`beta`, the heads'
`output_bias`/`output_weights`), with the optimizer slots Google's checkpoints carry.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf
import torch
import transformers

from lambjax.finetune import init as finetune_init
from lambjax.models import tf_checkpoint
from lambjax.train import published
from tests.models.test_hf import HF_CONFIG, assert_close, inputs, ours, torch_outputs


def tf_name(torch_name: str) -> str | None:
    """The original checkpoint's name of a transformers BertForPreTraining weight."""
    special = {
        "cls.predictions.bias": "cls/predictions/output_bias",
        "cls.seq_relationship.weight": "cls/seq_relationship/output_weights",
        "cls.seq_relationship.bias": "cls/seq_relationship/output_bias",
    }
    if torch_name in special:
        return special[torch_name]
    if torch_name.startswith("cls.predictions.decoder"):
        return None  # tied to the word embeddings; the original stores it once
    parts = torch_name.split(".")
    if "layer" in parts:  # encoder.layer.3 -> encoder/layer_3
        index = parts.index("layer")
        parts[index : index + 2] = [f"layer_{parts[index + 1]}"]
    leaf = parts.pop()
    if parts[-1].endswith("_embeddings"):
        return "/".join(parts)
    if parts[-1] == "LayerNorm":
        return "/".join([*parts, "gamma" if leaf == "weight" else "beta"])
    return "/".join([*parts, "kernel" if leaf == "weight" else "bias"])


def write_tf_checkpoint(model, directory: str) -> None:
    """bert_model.ckpt.{index,data} with the original's names, as TensorFlow writes them."""
    names, tensors = [], []
    for torch_name, value in model.state_dict().items():
        name = tf_name(torch_name)
        if name is None:
            continue
        value = value.numpy()
        if name.endswith("/kernel"):
            value = value.T  # TensorFlow's dense kernels are [in, out]
        names.append(name)
        tensors.append(tf.constant(value))
        if name.startswith("bert/encoder/layer_0/"):  # Adam's slots, as in Google's files
            for slot in ("adam_m", "adam_v"):
                names.append(f"{name}/{slot}")
                tensors.append(tf.constant(np.full_like(value, 7.0)))
    names.append("global_step")
    tensors.append(tf.constant(np.int64(1000000)))
    tf.raw_ops.SaveV2(
        prefix=os.path.join(directory, "bert_model.ckpt"),
        tensor_names=names,
        shape_and_slices=[""] * len(names),
        tensors=tensors,
    )
    config = {**HF_CONFIG, "hidden_act": "gelu", "type_vocab_size": 2, "initializer_range": 0.02}
    config.update(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    with open(os.path.join(directory, "bert_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def torch_model():
    torch.manual_seed(1)
    model = transformers.BertForPreTraining(transformers.BertConfig(**HF_CONFIG)).eval()
    with torch.no_grad():  # non-zero biases and LayerNorms: a swapped weight cannot hide
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.slow
def test_tf_checkpoint_loads_to_the_outputs_of_its_transformers_conversion(torch_model, tmp_path):
    write_tf_checkpoint(torch_model, str(tmp_path))
    names = {name for name, _ in tf.train.list_variables(str(tmp_path / "bert_model.ckpt"))}
    assert "bert/encoder/layer_1/attention/self/query/kernel" in names
    assert "cls/predictions/transform/LayerNorm/gamma" in names

    config, params, missing = tf_checkpoint.from_tf_checkpoint(str(tmp_path))

    assert missing == []
    batch = inputs()
    expected = torch_outputs(torch_model, batch)
    for actual, wanted in zip(ours(config, params, batch), expected, strict=True):
        assert_close(actual, wanted)


def test_a_bert_model_checkpoint_without_heads_reports_them_missing(torch_model, tmp_path):
    write_tf_checkpoint(torch_model, str(tmp_path))
    reader_names = tf.train.list_variables(str(tmp_path / "bert_model.ckpt"))
    kept = [n for n, _ in reader_names if n.startswith("bert/")]
    reader = tf.train.load_checkpoint(str(tmp_path / "bert_model.ckpt"))
    headless = tmp_path / "headless"
    headless.mkdir()
    tf.raw_ops.SaveV2(
        prefix=str(headless / "bert_model.ckpt"),
        tensor_names=kept,
        shape_and_slices=[""] * len(kept),
        tensors=[tf.constant(reader.get_tensor(n)) for n in kept],
    )
    (headless / "bert_config.json").write_text((tmp_path / "bert_config.json").read_text())

    _, _, missing = tf_checkpoint.from_tf_checkpoint(str(headless))

    assert {m.split(".")[0] + "." + m.split(".")[1] for m in missing} == {
        "cls.predictions",
        "cls.seq_relationship",
    }


def test_a_kernel_of_another_shape_is_named(torch_model, tmp_path):
    write_tf_checkpoint(torch_model, str(tmp_path))
    config = json.loads((tmp_path / "bert_config.json").read_text())
    config["intermediate_size"] += 1
    (tmp_path / "bert_config.json").write_text(json.dumps(config))

    with pytest.raises(
        ValueError, match=r"output\.dense\.weight has shape \(32, 37\).*gives \(32, 38\)"
    ):
        tf_checkpoint.from_tf_checkpoint(str(tmp_path))


def test_a_run_reads_it_as_tf_dir_with_its_vocabulary_and_casing(torch_model, tmp_path):
    write_tf_checkpoint(torch_model, str(tmp_path))
    words = [f"w{i}" for i in range(HF_CONFIG["vocab_size"] - 5)]
    (tmp_path / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])
    )

    start = published.load(f"tf:{tmp_path}")

    assert start.description == f"TensorFlow checkpoint {tmp_path}"
    assert start.heads == "MLM and NSP heads from it"
    assert (start.vocab_file, start.lower_case) == (str(tmp_path / "vocab.txt"), True)
    assert start.model_config.num_layers == HF_CONFIG["num_hidden_layers"]


def test_fine_tuning_starts_from_it_too(torch_model, tmp_path):
    write_tf_checkpoint(torch_model, str(tmp_path))
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nCase\n")

    start = finetune_init.load(f"tf:{tmp_path}")

    assert (start.vocab_file, start.lower_case) == (str(tmp_path / "vocab.txt"), False)
    assert start.model_config.hidden_size == HF_CONFIG["hidden_size"]
