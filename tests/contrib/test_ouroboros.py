"""Ouroboros (lambjax.contrib.ouroboros) against its update rule.

The reference is the rule itself, written without stages: every step takes the whole
model's gradient of its batch by ordinary backpropagation (with the tied word embedding's
input and output uses kept apart), and module k applies the one of K - k steps ago. The
delayed step, on 1, 2 and 4 stages of fake CPU devices, must reproduce it. (The variant
run end to end, as a subprocess: tests/contrib/test_ouroboros_runs.py.)
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lambjax import sharding
from lambjax.contrib.ouroboros import stages
from lambjax.contrib.ouroboros import step as ouroboros
from lambjax.models import bert, encoder, pretraining
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params, param_logical_axes
from lambjax.train import state as state_lib
from lambjax.train import step as step_lib
from lambjax.train.state import TrainState
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
BATCH, SEQ, MICROBATCHES = 8, 8, 2
RNG = jax.random.key(1)


def batches(count):
    return [
        random_batch(seed, batch=BATCH, seq=SEQ, predictions=2, vocab_size=64)
        for seed in range(count)
    ]


def delayed(split, optimizer, *, data=1, replay="stale", config=CONFIG, **settings):
    """(The jitted step, its initial state), sharded as the trainer shards them: layers and
    buffers over the stage axis, batches over data."""
    mesh = sharding.make_mesh(
        {"stage": split.stages, "data": data}, jax.devices()[: split.stages * data]
    )
    params = init_params(config, jax.random.key(0))
    buffers = ouroboros.init_buffers(
        split, params, global_batch_size=BATCH, seq_len=SEQ, dtype=jnp.float32, replay=replay
    )
    state = TrainState.create(params, optimizer).replace(method_state=buffers)
    abstract = jax.eval_shape(lambda: state)
    shardings = state_lib.shardings(
        abstract,
        param_axes=param_logical_axes(config),
        mesh=mesh,
        optimizer=optimizer,
        num_frozen_layers=0,
    )
    shardings = shardings.replace(
        method_state=ouroboros.buffer_shardings(abstract.method_state, shardings.params, mesh)
    )
    replicated = sharding.replicated(mesh)
    step = jax.jit(
        functools.partial(
            ouroboros.train_step,
            settings=ouroboros.OuroborosStep(
                split=split,
                replay=replay,
                mesh=mesh,
                model_config=config,
                optimizer=optimizer,
                schedule=optax.constant_schedule(0.0),
                grad_accum_steps=MICROBATCHES,
                **settings,
            ),
        ),
        in_shardings=(shardings, sharding.batch_sharding(mesh), replicated),
        out_shardings=(shardings, replicated),
    )
    return step, jax.device_put(state, shardings)


@functools.partial(jax.jit, static_argnames="config")
def backprop_gradients(params, batch, step, config=CONFIG):
    """(Gradient of every parameter, gradient of the word embedding as the output projection)
    of `batch` by ordinary backpropagation, with the train step's keys and micro-batches; the
    word embedding's entry in the first is its input lookup's share only."""
    mlm_total = jnp.sum(jnp.asarray(batch["masked_lm_weights"]))
    nsp_total = jnp.float32(BATCH)

    def loss(params, word_out, microbatch, rng):
        h, _ = encoder.encoder_outputs(
            config,
            params,
            microbatch["input_ids"],
            microbatch["segment_ids"],
            microbatch["input_mask"],
            dropout_rng=rng,
        )
        logits = bert.Heads(config).apply(
            {"params": params["heads"]}, h, microbatch["masked_lm_positions"], word_out
        )
        stats = pretraining.stats_from_logits(*logits, microbatch)
        return stats["mlm_loss_sum"] / mlm_total + stats["nsp_loss_sum"] / nsp_total

    step_rng = jax.random.fold_in(RNG, step)
    split_batch = step_lib.split_microbatches(batch, MICROBATCHES)
    total = None
    for index in range(MICROBATCHES):
        microbatch = jax.tree.map(lambda x, i=index: x[i], split_batch)
        grads = jax.grad(loss, argnums=(0, 1))(
            params,
            params["embeddings"]["word"]["embedding"],
            microbatch,
            jax.random.fold_in(step_rng, index),
        )
        total = grads if total is None else jax.tree.map(jnp.add, total, grads)
    return total


def delayed_gradients(split, history, step):
    """The update rule: module k's share of the gradient of step `step - (K - k)`; zero
    before that step exists."""

    def at(delay):
        if step - delay < 0:
            return jax.tree.map(jnp.zeros_like, history[0])
        return history[step - delay]

    modules = split.num_modules
    first, top = at(modules - 1), at(0)
    grads = {
        "embeddings": jax.tree.map(lambda x: x, first[0]["embeddings"]),
        "heads": top[0]["heads"],
        "encoder": {},
    }
    grads["embeddings"]["word"] = {
        "embedding": first[0]["embeddings"]["word"]["embedding"] + top[1]
    }
    delays = split.layer_delays()
    per_layer = [at(int(d))[0]["encoder"]["layers"] for d in delays]
    grads["encoder"]["layers"] = jax.tree.map(
        lambda *trees: jnp.stack([tree[i] for i, tree in enumerate(trees)]), *per_layer
    )
    return grads


def max_difference(a, b) -> float:
    a, b = jax.device_get((a, b))
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b)))


def test_the_split_places_the_first_and_last_module_on_stage_zero():
    split = stages.Split(4, 12)  # BERT-base, the paper's 4 modules on 3 devices
    assert (split.stages, split.per_stage, split.first, split.last) == (3, 4, 2, 2)
    modules = [split.module_of_layer(i) for i in range(12)]
    assert modules == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4]
    assert list(split.layer_delays()) == [3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0]
    assert [stages.Split(3, 2).module_of_layer(i) for i in range(2)] == [1, 2]
    with pytest.raises(
        ValueError, match=r"12 layers do not fill; valid num_modules: \[1, 2, 3, 4, 5, 7, 13\]"
    ):
        stages.Split(6, 12)


@pytest.mark.slow
@pytest.mark.parametrize("modules", [3, 5])  # stage 0 has a module-K layer, or none
def test_sgd_follows_the_delayed_update_rule(modules):
    """SGD at lr 0.1 with dropout: the delayed run (K - 1 stages: 2 or 4; the tied
    embedding's two
    gradients from batches t and t - K + 1; replays with the weights of their step) gives
    the rule's weights after every step."""
    split = stages.Split(modules, CONFIG.num_layers)
    rate = 0.1
    optimizer = optax.sgd(rate)
    step, state = delayed(split, optimizer)
    params = jax.device_get(state.params)
    history = []
    for t, batch in enumerate(batches(modules + 2)):
        state, metrics = step(state, batch, RNG)
        history.append(backprop_gradients(params, batch, t))
        grads = delayed_gradients(split, history, t)
        params = jax.tree.map(lambda w, g: w - rate * g, params, grads)
        assert max_difference(state.params, params) < 1e-6, t
        assert float(metrics["ouroboros_modules_updated"]) == min(t + 1, modules)


@pytest.mark.slow
def test_a_synchronous_warm_up_then_the_buffers_fill():
    """synchronous_steps=2: steps 0 and 1 update every module (backpropagation), then the
    buffers start empty and module k waits K - k steps again."""
    split = stages.Split(2, CONFIG.num_layers)  # layers 0, 1: delay 1; 2, 3: none
    step, state = delayed(split, optax.sgd(0.1), synchronous_steps=2)
    bottom = lambda s: np.asarray(s.params["encoder"]["layers"]["mlp"]["output"]["kernel"][0])  # noqa: E731
    for t, batch in enumerate(batches(4)):
        before = bottom(state)
        state, metrics = step(state, batch, RNG)
        assert float(metrics["ouroboros_modules_updated"]) == (2, 2, 1, 2)[t]
        assert (not np.array_equal(bottom(state), before)) == (t != 2), t


@pytest.mark.slow
def test_replaying_with_current_weights_is_features_replay():
    """replay='current' differs from the exact delayed gradient once weights have moved,
    and keeps no weight history."""
    split = stages.Split(2, CONFIG.num_layers)
    optimizer = optax.sgd(0.1)
    runs = {}
    for replay in ("stale", "current"):
        step, state = delayed(split, optimizer, replay=replay)
        for batch in batches(3):
            state, _ = step(state, batch, RNG)
        runs[replay] = state
    assert "weights" not in runs["current"].method_state
    layers = lambda s: s.params["encoder"]["layers"]  # noqa: E731
    assert max_difference(layers(runs["stale"]), layers(runs["current"])) > 1e-6


@pytest.mark.slow
def test_lamb_fill_and_data_parallel_stages():
    """With the recipe's LAMB: while the buffers fill a module's weights and moments stay as
    they were until its step K - k, while the top module and the heads update from the
    first step; and 2 stages x 2 data shards give what 2 stages x 1 give (no dropout: each
    shard draws its own masks)."""
    from lambjax.train import config as config_lib
    from lambjax.train import optimizer as optimizer_lib

    config = dataclasses.replace(CONFIG, hidden_dropout=0.0, attention_dropout=0.0)
    split = stages.Split(3, CONFIG.num_layers)  # layers 0 | 1, 2 | 3: delays 2, 1, 1, 0
    recipe = config_lib.optimizer_config("lamb")
    optimizer = optimizer_lib.make_optimizer(recipe, optax.constant_schedule(1e-2))
    kernel_shape = (CONFIG.num_layers, CONFIG.hidden_size, CONFIG.intermediate_size)

    def kernels(state):  # the MLP kernels and every moment of that shape
        leaves = [state.params["encoder"]["layers"]["mlp"]["intermediate"]["kernel"]]
        leaves += [x for x in jax.tree.leaves(state.opt_state) if x.shape == kernel_shape]
        return [np.asarray(x) for x in leaves]

    finals = []
    for data in (1, 2):
        step, state = delayed(split, optimizer, data=data, config=config)
        before = jax.device_get(state)
        for t, batch in enumerate(batches(4)):
            state, _ = step(state, batch, RNG)
            if data > 1:
                continue
            assert len(kernels(state)) == 3  # the kernel and LAMB's two moments
            for layer, delay in enumerate(split.layer_delays()):
                moved = [
                    not np.array_equal(a[layer], b[layer])
                    for a, b in zip(kernels(state), kernels(before), strict=True)
                ]
                assert moved == [t >= delay] * 3, (t, layer)
            position = lambda s: np.asarray(s.params["embeddings"]["position"]["embedding"])  # noqa: E731
            assert (not np.array_equal(position(state), position(before))) == (t >= 2)
            nsp = lambda s: np.asarray(s.params["heads"]["nsp"]["kernel"])  # noqa: E731
            assert not np.array_equal(nsp(state), nsp(before))
        finals.append(jax.device_get(state.params))
    assert max_difference(*finals) < 1e-5


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"ouroboros.num_modules": 5, "mesh.stage": 4},
            "2 layers do not fill; valid num_modules: [1, 2, 3]",
        ),
        ({"ouroboros.replay": "graph"}, "config.ouroboros.replay='graph'; valid:"),
        (
            {"ouroboros.num_modules": 1},
            "mesh stage=2 splits the encoder into stages, which Ouroboros",
        ),
        ({"mesh.fsdp": 2, "mesh.data": 1}, "and fsdp=tensor=1, but the mesh is"),
        ({"layer_drop.enabled": True, "model.overrides.layer_norm": "pre"}, "turn one of them off"),
        ({"data.packing": True}, "config.data.packing=True: Ouroboros' step reads one"),
        (
            {"phases.phase1.frozen_layers": 1, "phases.phase2.frozen_layers": 1},
            "trains every layer",
        ),
    ],
)
def test_bad_ouroboros_settings_name_the_field(settings, message):
    from configs import bert_lamb
    from lambjax.train import config as config_lib
    from lambjax.train import plan as plan_lib

    config = bert_lamb.get_config("ouroboros,runlocal")
    for field, value in settings.items():
        *parents, name = field.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[name] = value
    with pytest.raises(config_lib.ConfigError) as error:
        plan_lib.resolve(config, vocab_size=config.data.vocab_size, num_devices=4)
    assert message in str(error.value)
