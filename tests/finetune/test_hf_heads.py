"""The task heads exported to and imported from transformers' BertForQuestionAnswering and
BertForSequenceClassification (PyTorch, float32): same logits, same answers and labels."""

import jax
import numpy as np
import pytest
import torch
import transformers

from lambjax.models import heads, hf
from lambjax.models.config import BertConfig

CONFIG = BertConfig(
    vocab_size=99,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    intermediate_size=37,
    max_position_embeddings=64,
    dtype="float32",
)


def random_params(kind, num_labels, seed=0):
    """Every leaf perturbed (biases and LayerNorms too), so no swapped weight can hide."""
    params = heads.init_params(CONFIG, kind, num_labels, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(
        tree, [np.asarray(x) + 0.05 * rng.normal(size=x.shape).astype(np.float32) for x in leaves]
    )


def batch(seed=0, size=3, seq=16):
    rng = np.random.default_rng(seed)
    mask = np.ones((size, seq), np.int32)
    mask[1, 10:] = 0
    return {
        "input_ids": rng.integers(1, CONFIG.vocab_size, (size, seq)).astype(np.int32),
        "segment_ids": (np.arange(seq)[None] >= 6).repeat(size, 0).astype(np.int32),
        "input_mask": mask,
    }


def torch_inputs(inputs):
    return dict(
        input_ids=torch.tensor(inputs["input_ids"], dtype=torch.long),
        token_type_ids=torch.tensor(inputs["segment_ids"], dtype=torch.long),
        attention_mask=torch.tensor(inputs["input_mask"], dtype=torch.long),
    )


def load(model_class, path):
    model, info = model_class.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def assert_same_params(actual, expected):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-7), actual, expected)


@pytest.mark.slow
def test_span_head_round_trip(tmp_path):
    params = random_params("span", 2)
    path = str(tmp_path / "qa")
    hf.to_transformers_task(CONFIG, params, path)
    inputs = batch()
    start, end = heads.apply(CONFIG, "span", 2, params, inputs)
    with torch.no_grad():
        out = load(transformers.BertForQuestionAnswering, path)(**torch_inputs(inputs))
    np.testing.assert_allclose(out.start_logits.numpy(), start, atol=1e-4)
    np.testing.assert_allclose(out.end_logits.numpy(), end, atol=1e-4)
    np.testing.assert_array_equal(out.start_logits.numpy().argmax(-1), np.argmax(start, -1))
    config, imported, labels = hf.from_transformers_task(path)
    assert labels is None and config.num_layers == CONFIG.num_layers
    assert_same_params(imported, params)


@pytest.mark.parametrize("labels", [("contradiction", "entailment", "neutral"), None])
def test_classifier_head_round_trip(tmp_path, labels):
    num_labels = 3 if labels else 1  # None: regression (STS-B)
    params = random_params("classifier", num_labels, seed=1)
    path = str(tmp_path / "classifier")
    hf.to_transformers_task(CONFIG, params, path, labels=labels)
    inputs = batch(seed=1)
    logits = heads.apply(CONFIG, "classifier", num_labels, params, inputs)
    model = load(transformers.BertForSequenceClassification, path)
    with torch.no_grad():
        out = model(**torch_inputs(inputs)).logits.numpy()
    np.testing.assert_allclose(out, logits, atol=1e-4)
    if labels:
        predicted = [model.config.id2label[i] for i in out.argmax(-1)]
        assert predicted == [labels[i] for i in np.argmax(logits, -1)]
    else:
        assert model.config.problem_type == "regression"
    _, imported, imported_labels = hf.from_transformers_task(path)
    assert imported_labels == (list(labels) if labels else ["LABEL_0"])
    assert_same_params(imported, params)


def test_preln_and_headless_models_do_not_export(tmp_path):
    params = random_params("span", 2)
    with pytest.raises(ValueError, match="PostLN"):
        hf.to_transformers_task(
            BertConfig(**{**CONFIG.__dict__, "layer_norm": "pre"}), params, str(tmp_path)
        )
    with pytest.raises(ValueError, match="no span or classifier head"):
        hf.to_transformers_task(CONFIG, {**params, "heads": {}}, str(tmp_path))
