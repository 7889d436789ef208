"""lambjax.finetune.init: fine-tuning reads `config.init` through pretraining's reader
(lambjax.train.published), so both commands start from the same weights, vocabulary and
casing of a checkpoint; fine-tuning's own scratch:PRESET; its errors are one-line
FinetuneErrors that name the value. The runs themselves: tests/finetune/test_runs.py.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lambjax.finetune import init
from lambjax.finetune.errors import FinetuneError
from lambjax.models import hf
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params
from lambjax.train import checkpointing, published
from lambjax.train.config import ConfigError

MODEL = BertConfig.preset("tiny", vocab_size=64, dtype="float32")
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def assert_same_leaves(ours, theirs) -> None:
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(leaves(ours), leaves(theirs), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def params() -> dict:
    return jax.tree.map(np.asarray, init_params(MODEL, jax.random.key(1)))


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> str:
    """A cased vocabulary of the model's 64 tokens."""
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    words = [f"W{i}" if i % 2 else f"w{i}" for i in range(59)]
    path.write_text("\n".join([*SPECIALS, *words]) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, params, vocab) -> dict[str, str]:
    """transformers directories of one tiny BERT: a BertForPreTraining, a BertModel (no
    heads, no `bert.` prefix) and a BertForSequenceClassification (with the tokenizer's
    files, whose do_lower_case=True overrides the cased vocabulary)."""
    root = tmp_path_factory.mktemp("exports")
    pretraining = root / "pretraining"
    hf.to_transformers(MODEL, params, str(pretraining), vocab_file=vocab)

    bert_model = root / "bert_model"
    bert_model.mkdir()
    state = load_file(str(pretraining / "model.safetensors"))
    save_file(
        {k.removeprefix("bert."): v for k, v in state.items() if not k.startswith("cls.")},
        str(bert_model / "model.safetensors"),
    )
    for name in ("config.json", "vocab.txt"):
        (bert_model / name).write_bytes((pretraining / name).read_bytes())

    classifier = root / "classifier"
    rng = np.random.default_rng(0)
    head = {
        "pooler": params["heads"]["pooler"],
        "classifier": {
            "kernel": rng.standard_normal((MODEL.hidden_size, 2)).astype(np.float32),
            "bias": np.zeros(2, np.float32),
        },
    }
    hf.to_transformers_task(
        MODEL,
        {**params, "heads": head},
        str(classifier),
        labels=["negative", "positive"],
        vocab_file=vocab,
        lower_case=True,
    )
    return {
        "pretraining": str(pretraining),
        "bert_model": str(bert_model),
        "classifier": str(classifier),
    }


@pytest.mark.parametrize("name", ["pretraining", "bert_model", "classifier"])
def test_both_commands_read_an_hf_directory_alike(exports, params, name):
    path = exports[name]
    pretraining = published.load(f"hf:{path}")
    finetuning = init.load(f"hf:{path}")

    assert_same_leaves(finetuning.params, pretraining.params)
    # As fine-tuning read it before it shared pretraining's reader.
    assert_same_leaves(finetuning.params, hf.from_transformers(path)[1])
    for part in ("embeddings", "encoder"):
        assert_same_leaves(finetuning.params[part], params[part])
    assert finetuning.model_config == pretraining.model_config
    assert finetuning.vocab_file == pretraining.local_vocab_file == f"{path}/vocab.txt"
    assert pretraining.vocab_file == f"{path}/vocab.txt"
    assert finetuning.lower_case is pretraining.lower_case is (name == "classifier")
    assert finetuning.description == pretraining.description == f"transformers checkpoint {path}"


def test_a_fine_tuned_classifier_gives_its_pooler_and_no_pretraining_heads(exports, params):
    start = published.load(f"hf:{exports['classifier']}")

    assert start.heads == "MLM and NSP heads initialised"
    assert "bert.pooler.dense.weight" not in start.initialised
    assert_same_leaves(start.params["heads"]["pooler"], params["heads"]["pooler"])
    assert_same_leaves(init.load(f"hf:{exports['classifier']}").params, start.params)


def test_both_commands_read_a_pretraining_workdir_alike(tmp_path, params, vocab):
    run_config = {
        "phase_order": ["phase1", "phase2"],
        "phases": {"phase1": {"num_steps": 2}, "phase2": {"num_steps": 3}},
        "data": {"lower_case": False},
    }
    meta = {
        "config": json.dumps(run_config),
        "model_config": dataclasses.asdict(MODEL),
        "vocab_file": vocab,
    }
    for phase, step, seed in (("phase1", 2, 2), ("phase2", 1, 3)):  # phase2 unfinished
        saved = {"params": jax.tree.map(np.asarray, init_params(MODEL, jax.random.key(seed)))}
        ckpt = checkpointing.PhaseCheckpoints(str(tmp_path), phase, max_to_keep=1, async_save=False)
        ckpt.save(step, saved, {}, {**meta, "phase": phase})
        ckpt.close()

    pretraining = published.load(f"workdir:{tmp_path}")
    finetuning = init.load(f"workdir:{tmp_path}")

    assert_same_leaves(finetuning.params, pretraining.params)
    assert_same_leaves(pretraining.params, init_params(MODEL, jax.random.key(2)))
    assert finetuning.model_config == pretraining.model_config == MODEL
    assert pretraining.vocab_file == finetuning.vocab_file == vocab  # local: not copied
    assert finetuning.lower_case is pretraining.lower_case is False
    assert (
        finetuning.description == pretraining.description == f"phase phase1 (step 2) of {tmp_path}"
    )
    assert pretraining.heads == "MLM and NSP heads from the run"


def test_scratch_is_fine_tunings_own():
    start = init.load("scratch:tiny")
    assert (start.params, start.vocab_file, start.lower_case) == (None, None, None)
    assert start.model_config == BertConfig.preset("tiny")
    with pytest.raises(ConfigError, match="valid: '' \\(random\\), hf:DIR"):
        published.load("scratch:tiny")  # pretraining has no scratch:


def test_bad_starts_are_one_line_errors_naming_the_value(exports, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text('{"hidden_size": 128, "num_hidden_lay')
    headless = tmp_path / "headless"  # a BERT directory without its encoder's weights
    headless.mkdir()
    (headless / "config.json").write_text(open(f"{exports['pretraining']}/config.json").read())
    state = load_file(f"{exports['pretraining']}/model.safetensors")
    save_file(
        {k: v for k, v in state.items() if ".layer.1." not in k},
        str(headless / "model.safetensors"),
    )
    cases = {
        f"hf:{tmp_path}/missing": f"config.init='hf:{tmp_path}/missing': {tmp_path}/missing is not",
        f"hf:{empty}": f"no config.json in {empty}; neither a transformers (config.json) nor",
        f"tf:{exports['pretraining']}": f"; it looks like hf:{exports['pretraining']}",
        f"hf:{truncated}": "config.json is not valid JSON (Unterminated string",
        f"hf:{headless}": "lacks encoder weights, e.g. bert.encoder.layer.1.",
        f"workdir:{empty}": "no checkpoints/ there; is it a lambjax pretraining workdir?",
        "scratch:huge": "unknown preset; valid: ['tiny'",
        "hf:": "; valid: workdir:PATH, hf:PATH, tf:PATH, scratch:PRESET",
        "bert:base": "; valid: workdir:PATH, hf:PATH, tf:PATH, scratch:PRESET",
    }
    for value, expected in cases.items():
        with pytest.raises(FinetuneError) as refused:
            init.load(value)
        message = str(refused.value)
        assert expected in message and "\n" not in message, (value, message)
        assert message.startswith("config.init="), message
        if value.partition(":")[0] in published.KINDS and value.partition(":")[2]:
            with pytest.raises(ConfigError) as pretraining:
                published.load(value)
            assert str(pretraining.value) == message  # the same words in both commands
