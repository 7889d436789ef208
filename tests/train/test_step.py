"""The pure train step: accumulation, non-finite skipping, metrics."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lambjax.models import bert
from lambjax.train import step as step_lib
from lambjax.train import trainer
from lambjax.train.state import TrainState
from tests import helpers

CONFIG = bert.BertConfig.preset(
    "tiny", vocab_size=128, num_layers=2, dtype="float32", hidden_dropout=0.0, attention_dropout=0.0
)
BATCH, SEQ, PRED = 8, 16, 4


def random_batch(seed=0):
    return helpers.random_batch(seed, batch=BATCH, seq=SEQ, predictions=PRED, vocab_size=128)


@pytest.fixture(scope="module")
def optimizer():
    from lambjax.train.config import optimizer_config
    from lambjax.train.optimizer import make_optimizer

    return make_optimizer(optimizer_config("lamb"), optax.constant_schedule(1e-3))


@functools.cache
def jitted_step(optimizer, accum):
    return jax.jit(
        functools.partial(
            step_lib.train_step,
            model_config=CONFIG,
            optimizer=optimizer,
            schedule=optax.constant_schedule(1e-3),
            grad_accum_steps=accum,
        )
    )


def fresh_state(optimizer):
    return TrainState.create(bert.init_params(CONFIG, jax.random.key(0)), optimizer)


def test_accumulation_gives_the_global_batch_gradient(optimizer):
    batch = random_batch()
    one, metrics_one = jitted_step(optimizer, 1)(fresh_state(optimizer), batch, jax.random.key(1))
    four, metrics_four = jitted_step(optimizer, 4)(fresh_state(optimizer), batch, jax.random.key(1))
    for key in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "grad_norm", "update_norm"):
        np.testing.assert_allclose(metrics_four[key], metrics_one[key], rtol=2e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(four.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_split_microbatches_interleaves_rows():
    x = np.arange(12).reshape(12, 1)
    micro = step_lib.split_microbatches({"x": x}, 3)["x"]
    assert micro.shape == (3, 4, 1)
    np.testing.assert_array_equal(micro[1, :, 0], [1, 4, 7, 10])


def test_nonfinite_step_is_skipped_and_counted(optimizer):
    state = fresh_state(optimizer)
    before = jax.tree.map(np.asarray, state.params)
    batch = random_batch()
    batch["masked_lm_weights"] = batch["masked_lm_weights"] * np.float32("nan")
    state, metrics = jitted_step(optimizer, 1)(state, batch, jax.random.key(1))
    assert metrics["nonfinite"] == 1.0
    assert int(state.consecutive_nonfinite) == 1 and int(state.total_nonfinite) == 1
    assert int(state.step) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(trainer.TrainingStopped, match=r"1 consecutive steps \(1\.\.1\)"):
        trainer.check_nonfinite(state, 1, limit=1)
    # A good step resets the streak.
    state, metrics = jitted_step(optimizer, 1)(state, random_batch(), jax.random.key(1))
    assert metrics["nonfinite"] == 0.0 and int(state.consecutive_nonfinite) == 0


def test_metrics_are_consistent(optimizer):
    _, metrics = jitted_step(optimizer, 1)(
        fresh_state(optimizer), random_batch(), jax.random.key(1)
    )
    assert 0 <= metrics["mlm_accuracy"] <= 1 and 0 <= metrics["nsp_accuracy"] <= 1
    np.testing.assert_allclose(
        metrics["loss"], metrics["mlm_loss"] + metrics["nsp_loss"], rtol=1e-6
    )
    # At initialisation the MLM loss is about log(vocab).
    assert abs(float(metrics["mlm_loss"]) - np.log(CONFIG.vocab_size)) < 1.0
    assert float(metrics["learning_rate"]) == pytest.approx(1e-3)
    assert jnp.isfinite(metrics["trust_ratio_mean"]) if "trust_ratio_mean" in metrics else True
