"""Packed rows against the same examples one per row: every example's MLM and NSP losses,
and the gradients of their sums, agree in float32, with the einsum attention and with
splash attention (interpreted on this CPU host)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lambjax.data import packing
from lambjax.models import attention, pretraining
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params

SEQ, PRED, VOCAB = 128, 20, 96
# Four rows: a long example with a short one, three short ones, one alone, two of a kind.
ROWS = [[90, 30], [40, 35, 50], [128], [64, 64]]


def unpacked_examples(seed=0) -> dict:
    """The examples of ROWS, one per row: [CLS] A [SEP] B [SEP] with random tokens, two
    token types, a few masked positions (never a special token) and an NSP label."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray([n for row in ROWS for n in row])
    count = len(lengths)
    ids = np.zeros((count, SEQ), np.int32)
    types = np.zeros((count, SEQ), np.int32)
    positions = np.zeros((count, PRED), np.int32)
    labels = np.zeros((count, PRED), np.int32)
    weights = np.zeros((count, PRED), np.float32)
    for i, n in enumerate(lengths):
        middle = n // 2
        ids[i, :n] = rng.integers(5, VOCAB, n)
        ids[i, [0, middle, n - 1]] = [2, 3, 3]
        types[i, middle + 1 : n] = 1
        chosen = np.sort(rng.choice(np.setdiff1d(np.arange(1, n - 1), [middle]), 6, False))
        k = int(rng.integers(1, 7))  # 1 to 6 predictions
        positions[i, :k] = chosen[:k]
        labels[i, :k] = rng.integers(5, VOCAB, k)
        weights[i, :k] = 1.0
    return {
        "input_ids": ids,
        "segment_ids": types,
        "input_mask": (np.arange(SEQ)[None] < lengths[:, None]).astype(np.int32),
        "lengths": lengths,
        "masked_lm_positions": positions,
        "masked_lm_ids": labels,
        "masked_lm_weights": weights,
        "next_sentence_labels": rng.integers(0, 2, count).astype(np.int32),
    }


def packed_table() -> np.ndarray:
    slots = max(len(row) for row in ROWS)
    table = np.full((len(ROWS), slots), -1, np.int64)
    first = 0
    for r, row in enumerate(ROWS):
        table[r, : len(row)] = np.arange(first, first + len(row))
        first += len(row)
    return table


def per_example_losses(config, params, batch):
    """(MLM loss summed over each example's predictions, NSP loss of each example), in
    example order."""
    mlm_logits, nsp_logits = pretraining.pretraining_logits(config, params, batch)
    mlm_nll = -jnp.take_along_axis(
        jax.nn.log_softmax(mlm_logits), batch["masked_lm_ids"][..., None], axis=-1
    )[..., 0]
    mlm_nll = mlm_nll * batch["masked_lm_weights"]
    labels = batch["next_sentence_labels"].reshape(-1)
    nsp_nll = -jnp.take_along_axis(jax.nn.log_softmax(nsp_logits), labels[:, None], axis=-1)[:, 0]
    if "example_ids" not in batch:
        return jnp.sum(mlm_nll, axis=1), nsp_nll
    # Each prediction belongs to the example of the token it predicts.
    owner = jnp.take_along_axis(batch["example_ids"], batch["masked_lm_positions"], axis=1)
    filled = batch["nsp_weights"].reshape(-1) > 0
    slots = batch["cls_positions"].shape[1]
    per_slot = jnp.sum(
        (owner[:, :, None] == jnp.arange(1, slots + 1)[None, None]) * mlm_nll[:, :, None], axis=1
    )
    return per_slot.reshape(-1)[filled], nsp_nll[filled]


def total_loss(config, params, batch):
    stats = pretraining.pretraining_stats(config, params, batch)
    return stats["mlm_loss_sum"] + stats["nsp_loss_sum"]


splash_interpreted = functools.partial(attention.splash_attention, interpret=True)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["xla", "splash"])
def test_packed_rows_give_each_example_its_unpacked_losses_and_gradients(form, monkeypatch):
    if form == "splash":
        monkeypatch.setattr(attention, "splash_attention", splash_interpreted)
    config = BertConfig.preset(
        "tiny",
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        dtype="float32",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention=form,
        scan_layers=False,
    )
    params = init_params(config, jax.random.key(0))
    examples = unpacked_examples()
    unpacked = {k: jnp.asarray(v) for k, v in examples.items() if k != "lengths"}
    packed = packing.assemble(examples, packed_table(), SEQ, PRED)
    assert packed["input_mask"].sum() == examples["lengths"].sum()
    packed = {k: jnp.asarray(v) for k, v in packed.items()}

    mlm, nsp = jax.jit(functools.partial(per_example_losses, config))(params, unpacked)
    packed_mlm, packed_nsp = per_example_losses(config, params, packed)
    np.testing.assert_allclose(packed_mlm, mlm, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(packed_nsp, nsp, rtol=2e-5, atol=2e-6)

    grad = jax.jit(jax.grad(functools.partial(total_loss, config)))
    expected, got = grad(params, unpacked), grad(params, packed)
    # The attention's key bias has a zero gradient (softmax ignores a shift): rounding
    # noise there is measured against the largest gradient of all.
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(expected))
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        want = functools.reduce(lambda tree, key: tree[key.key], path, expected)
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6 * scale, err_msg=str(path))


def test_packed_statistics_count_examples_not_rows():
    config = BertConfig.preset(
        "tiny", vocab_size=VOCAB, max_position_embeddings=SEQ, dtype="float32", attention="xla"
    )
    params = init_params(config, jax.random.key(1))
    examples = unpacked_examples(seed=1)
    unpacked = {k: v for k, v in examples.items() if k != "lengths"}
    packed = packing.assemble(examples, packed_table(), SEQ, PRED)
    a = pretraining.pretraining_stats(config, params, unpacked)
    b = pretraining.pretraining_stats(config, params, packed)
    assert float(b["nsp_count"]) == len(examples["lengths"]) == float(a["nsp_count"])
    assert float(b["mlm_weight_sum"]) == float(a["mlm_weight_sum"])
    for key in ("mlm_loss_sum", "mlm_correct_sum", "nsp_loss_sum", "nsp_correct_sum"):
        np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=key)
