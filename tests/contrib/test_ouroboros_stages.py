"""lambjax.contrib.ouroboros.stages: BERT's modules on stages, chained by hand, are BERT.

The reference is the unsplit model (lambjax.models.pretraining) under the same dropout key:
the stages' forwards chained give its loss statistics, and the replays chained back from
module K's input gradient give its gradient of every parameter.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lambjax.contrib.ouroboros import stages
from lambjax.models import pretraining
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params
from tests.helpers import random_batch

CONFIG = BertConfig(
    vocab_size=64,
    hidden_size=16,
    num_layers=4,
    num_heads=2,
    intermediate_size=32,
    max_position_embeddings=16,
    dtype="float32",
)
BATCH, SEQ = 4, 8


def unsplit(config, params, batch, rng):
    """(Loss statistics, gradient of every parameter) of the whole model."""
    mlm_total = jnp.sum(batch["masked_lm_weights"].astype(jnp.float32))

    def loss(params):
        stats = pretraining.pretraining_stats(config, params, batch, dropout_rng=rng)
        return stats["mlm_loss_sum"] / mlm_total + stats["nsp_loss_sum"] / BATCH, stats

    grads, stats = jax.grad(loss, has_aux=True)(params)
    return stats, grads


def chained(model, params, batch, rng):
    """The same, stage by stage: forwards up, module K's gradient, replays down."""
    split = model.split
    layers = stages.stage_order(split, params["encoder"]["layers"])
    blocks = [
        jax.tree.map(lambda x, s=s: x[s * split.per_stage : (s + 1) * split.per_stage], layers)
        for s in range(split.stages)
    ]
    stage0 = {
        "embeddings": params["embeddings"],
        "layers": blocks[0],
        "heads": params["heads"],
        "final": params["encoder"].get("final_layer_norm", {}),
    }
    tokens = {k: batch[k] for k in ("input_ids", "segment_ids", "input_mask")}
    mask = batch["input_mask"]
    inputs = [None]  # each stage's input
    h = stages.first_module(
        model,
        params["embeddings"],
        stages.first_module_layers(split, blocks[0]),
        tokens,
        rng,
    )
    for s in range(1, split.stages):
        inputs.append(h)
        h = stages.middle_module(model, s, blocks[s], h, mask, rng)
    totals = (jnp.sum(batch["masked_lm_weights"].astype(jnp.float32)), jnp.float32(BATCH))
    stats, (g_last, g_heads, g_final, g_word, delta) = stages.top_gradients(
        model, stage0, h, batch, rng, totals
    )
    g_blocks = [None] * split.stages
    for s in reversed(range(1, split.stages)):
        g_blocks[s], delta = stages.replay_middle(model, s, blocks[s], inputs[s], mask, rng, delta)
    g_embeddings, g_blocks[0] = stages.replay_first(
        model, params["embeddings"], blocks[0], tokens, rng, delta
    )
    g_blocks[0] = jax.tree.map(jnp.add, g_blocks[0], stages.pad_block(split, g_last, 0))
    g_embeddings["word"]["embedding"] = g_embeddings["word"]["embedding"] + g_word
    g_layers = jax.tree.map(lambda *b: jnp.concatenate(b), *g_blocks)
    encoder = {"layers": stages.model_order(split, g_layers)}
    if "final_layer_norm" in params["encoder"]:
        encoder["final_layer_norm"] = g_final
    return stats, {"embeddings": g_embeddings, "encoder": encoder, "heads": g_heads}


@pytest.mark.slow
def test_the_stages_chained_are_the_model():
    """3 modules on 2 stages (4 layers: 1 | 2 | 1), PreLN, with dropout. Eager, and the
    layers in a Python loop: this small a model compiles for longer than it runs."""
    config = dataclasses.replace(CONFIG, layer_norm="pre", scan_layers=False)
    model = stages.StageModel(config, stages.Split(3, config.num_layers))
    params = init_params(config, jax.random.key(0))
    batch = jax.tree.map(
        jnp.asarray, random_batch(0, batch=BATCH, seq=SEQ, predictions=2, vocab_size=64)
    )
    rng = jax.random.key(3)
    want = unsplit(config, params, batch, rng)
    got = chained(model, params, batch, rng)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_split_that_does_not_fill_the_stages_names_the_valid_counts():
    assert stages.valid_module_counts(4) == [1, 2, 3, 5]
    stages.check(1, 4)  # off
    with pytest.raises(ValueError, match=r"4 modules take 3 stages .* \[1, 2, 3, 5\]"):
        stages.check(4, 4)
