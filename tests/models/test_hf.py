"""lambjax BERT against PyTorch transformers' BertForPreTraining (fp32)."""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from lambjax.models import encoder, hf, pretraining
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params

HF_CONFIG = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(transformers.BertConfig(**HF_CONFIG)).eval()
    # Non-zero biases and LayerNorms, so a swapped or transposed weight cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp("hf") / "bert")
    model.save_pretrained(path)
    return path


def inputs(seed=0, batch=3, seq=16, predictions=4):
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[1, 11:] = 0
    return {
        "input_ids": rng.integers(1, HF_CONFIG["vocab_size"], (batch, seq)),
        "segment_ids": (np.arange(seq)[None] >= seq // 2).repeat(batch, 0).astype(np.int64),
        "input_mask": mask,
        "masked_lm_positions": np.sort(rng.integers(1, 10, (batch, predictions)), 1),
    }


def hf_outputs(path, batch):
    return torch_outputs(transformers.BertForPreTraining.from_pretrained(path).eval(), batch)


def torch_outputs(model, batch):
    """transformers' last hidden states, MLM logits at the masked positions and NSP logits."""
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(batch["input_ids"]),
            token_type_ids=torch.tensor(batch["segment_ids"]),
            attention_mask=torch.tensor(batch["input_mask"]),
            output_hidden_states=True,
        )
    positions = batch["masked_lm_positions"]
    mlm = np.take_along_axis(out.prediction_logits.numpy(), positions[..., None], axis=1)
    return out.hidden_states[-1].numpy(), mlm, out.seq_relationship_logits.numpy()


def ours(config, params, batch):
    jbatch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}
    hidden = encoder.encode(
        config, params, jbatch["input_ids"], jbatch["segment_ids"], jbatch["input_mask"]
    )
    mlm, nsp = pretraining.pretraining_logits(config, params, jbatch)
    return np.asarray(hidden), np.asarray(mlm), np.asarray(nsp)


def assert_close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_import_matches_transformers(hf_dir):
    config, params = hf.from_transformers(hf_dir)
    assert config.num_layers == 2 and config.vocab_size == 99
    batch = inputs()
    valid = batch["input_mask"].astype(bool)
    hidden, mlm, nsp = ours(config, params, batch)
    hidden_hf, mlm_hf, nsp_hf = hf_outputs(hf_dir, batch)
    assert_close(hidden[valid], hidden_hf[valid])  # padded positions are undefined
    assert_close(mlm, mlm_hf)
    assert_close(nsp, nsp_hf)


def test_export_loads_in_transformers_and_round_trips_exactly(hf_dir, tmp_path):
    config, params = hf.from_transformers(hf_dir)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n")
    out = str(tmp_path / "exported")
    hf.to_transformers(config, params, out, vocab_file=str(vocab))
    assert os.path.exists(os.path.join(out, "vocab.txt"))
    batch = inputs(seed=1)
    for a, b in zip(hf_outputs(out, batch)[1:], ours(config, params, batch)[1:], strict=True):
        assert_close(a, b)
    _, again = hf.from_transformers(out)
    for a, b in zip(_leaves(again), _leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


def _leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_bert_model_checkpoint_gets_initialised_heads(tmp_path, caplog):
    torch.manual_seed(1)
    model = transformers.BertModel(transformers.BertConfig(**HF_CONFIG)).eval()
    model.save_pretrained(str(tmp_path))
    config, params = hf.from_transformers(str(tmp_path))
    assert "initialised" in caplog.text and "cls" in caplog.text
    batch = inputs()
    with torch.no_grad():
        expected = model(
            input_ids=torch.tensor(batch["input_ids"]),
            token_type_ids=torch.tensor(batch["segment_ids"]),
            attention_mask=torch.tensor(batch["input_mask"]),
        ).last_hidden_state.numpy()
    valid = batch["input_mask"].astype(bool)
    assert_close(ours(config, params, batch)[0][valid], expected[valid])


def test_preln_does_not_export(tmp_path):
    config = BertConfig.preset("tiny", vocab_size=50, layer_norm="pre")
    import jax

    with pytest.raises(ValueError, match="PostLN"):
        hf.to_transformers(config, init_params(config, jax.random.key(0)), str(tmp_path))


def test_tanh_gelu_exports_as_transformers_tanh_gelu(hf_dir, tmp_path):
    """gelu_approximate=True is transformers' `gelu_pytorch_tanh`: the exported model gives
    lambjax's outputs, and differs from the erf model's."""
    config, params = hf.from_transformers(hf_dir)
    tanh_config = dataclasses.replace(config, gelu_approximate=True)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n")
    out = str(tmp_path / "exported")
    hf.to_transformers(tanh_config, params, out, vocab_file=str(vocab))
    assert transformers.BertConfig.from_pretrained(out).hidden_act == "gelu_pytorch_tanh"
    assert hf.from_transformers(out)[0].gelu_approximate
    batch = inputs(seed=2)
    ours_tanh = ours(tanh_config, params, batch)
    for a, b in zip(hf_outputs(out, batch)[1:], ours_tanh[1:], strict=True):
        assert_close(a, b)
    assert not np.allclose(ours_tanh[1], ours(config, params, batch)[1], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        hf.config_from_hf({**HF_CONFIG, "hidden_act": "relu"})
