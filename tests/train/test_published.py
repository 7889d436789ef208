"""lambjax.train.published: what `config.init` reads, and what the checkpoint decides (its
heads, vocabulary, casing, shape). The whole path as a run takes it, from an export:
tests/train/test_published_runs.py; the one-line errors of the command: tests/test_bad_inputs.py.
"""

import ast
import dataclasses
import pathlib
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lambjax.models import hf
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params
from lambjax.train import published
from lambjax.train.config import ConfigError, base_config

MODEL = BertConfig.preset("tiny", vocab_size=64, dtype="float32")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, dict]:
    """A transformers BertForPreTraining directory of a tiny BERT with a cased vocabulary."""
    params = jax.tree.map(np.asarray, init_params(MODEL, jax.random.key(1)))
    root = tmp_path_factory.mktemp("published")
    vocab = root / "vocab.txt"
    words = [f"W{i}" if i % 2 else f"w{i}" for i in range(59)]
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    hf.to_transformers(MODEL, params, str(root / "bert"), vocab_file=str(vocab))
    return str(root / "bert"), params


def test_a_pretraining_checkpoint_gives_its_weights_heads_and_vocabulary(checkpoint):
    path, params = checkpoint
    start = published.load(f"hf:{path}")

    assert start.model_config.hidden_size == 128 and start.model_config.vocab_size == 64
    assert start.heads == "MLM and NSP heads from it"
    assert start.vocab_file == f"{path}/vocab.txt"
    assert start.lower_case is False  # the vocabulary has upper-case tokens
    for ours, theirs in zip(jax.tree.leaves(start.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_a_bert_model_checkpoint_has_its_heads_initialised(checkpoint, tmp_path):
    path, _ = checkpoint
    encoder_only = tmp_path / "bert-model"
    encoder_only.mkdir()
    state = load_file(f"{path}/model.safetensors")
    save_file(
        {k.removeprefix("bert."): v for k, v in state.items() if not k.startswith("cls.")},
        str(encoder_only / "model.safetensors"),
    )
    for name in ("config.json", "vocab.txt"):
        (encoder_only / name).write_text(open(f"{path}/{name}").read())

    start = published.load(f"hf:{encoder_only}")

    assert start.heads == "MLM and NSP heads initialised"


def run_config(vocab="train", lower_case=False, preset="tiny"):
    config = base_config()
    config.model.preset = preset
    config.data.vocab, config.data.lower_case = vocab, lower_case
    return config


def test_the_vocabulary_and_casing_come_from_the_checkpoint(checkpoint, tmp_path):
    path, _ = checkpoint
    start = published.load(f"hf:{path}")
    config = run_config()
    assert published.vocabulary(start, config.data) == f"{path}/vocab.txt"

    with pytest.raises(ConfigError, match="trained with lower_case=False; give --config.data"):
        published.vocabulary(start, run_config(lower_case=True).data)
    other = tmp_path / "other_vocab.txt"
    other.write_text("[PAD]\n[UNK]\n")
    with pytest.raises(ConfigError, match="is not the vocabulary of config.init"):
        published.vocabulary(start, run_config(vocab=str(other)).data)


def test_a_model_of_another_shape_is_refused_naming_the_preset(checkpoint):
    start = published.load(f"hf:{checkpoint[0]}")
    published.check_model(start, dataclasses.replace(MODEL, dtype="bfloat16", hidden_dropout=0))
    mini = BertConfig.preset("mini", vocab_size=64)
    with pytest.raises(ConfigError, match=r"num_layers=4 \(the checkpoint: 2\).*preset=tiny"):
        published.check_model(start, mini)


def test_the_initial_parameters_take_the_phases_dtypes(checkpoint):
    start = published.load(f"hf:{checkpoint[0]}")
    abstract = jax.eval_shape(lambda key: init_params(MODEL, key), jax.random.key(0))
    params = published.initial_params(start, abstract)
    assert jax.tree.structure(params) == jax.tree.structure(abstract)

    wider_model = dataclasses.replace(MODEL, vocab_size=65)
    wider = jax.eval_shape(lambda key: init_params(wider_model, key), jax.random.key(0))
    with pytest.raises(ConfigError, match=r"shape \(64, 128\) where the config's model has"):
        published.initial_params(start, wider)


def test_train_imports_nothing_from_finetune(checkpoint, monkeypatch):
    """Fine-tuning builds on pretraining's reader, never the other way round."""
    package = pathlib.Path(published.__file__).parent
    upward = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            upward += [f"{path.name}: {n}" for n in names if n.startswith("lambjax.finetune")]
    assert not upward

    for name in [m for m in sys.modules if m.startswith("lambjax.finetune")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "lambjax.finetune", None)  # importing it fails
    assert published.load(f"hf:{checkpoint[0]}").heads == "MLM and NSP heads from it"
