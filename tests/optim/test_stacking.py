"""`optim.on_stacked_layers`: LAMB and LANS on a tree held one tree per layer, grouped by
role, give the per-leaf update (float32 rounding) and state, and the compiled update's
reductions do not grow with the depth where the per-leaf form's do."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lambjax import optim
from lambjax.models import layer_layout

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import optimizer_layout  # noqa: E402

NVIDIA_LAMB = dict(
    weight_decay=0.01,
    weight_decay_mask=optim.bert_weight_decay_mask,
    trust_ratio_mask=optim.bert_weight_decay_mask,
    max_global_norm=1.0,
    stacked_layers=optim.stacked_layers_mask,
)
LANS = dict(
    weight_decay=0.01,
    weight_decay_mask=optim.bert_weight_decay_mask,
    max_global_norm=1.0,
    stacked_layers=optim.stacked_layers_mask,
)
OPTIMIZERS = {"lamb": (optim.lamb, NVIDIA_LAMB), "lans": (optim.lans, LANS)}


def stacked_params(num_layers: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))

    layers = {
        "attention": {"kernel": w(num_layers, 4, 4), "bias": w(num_layers, 4)},
        "mlp_layer_norm": {"scale": w(num_layers, 4), "bias": jnp.zeros((num_layers, 4))},
    }
    return {
        "embeddings": {"word": {"embedding": w(10, 4)}},
        "encoder": {"layers": layers, "final_layer_norm": {"scale": w(4)}},
        "heads": {"bias": w(10)},
    }


def run(tx, params, steps=3):
    """`steps` donated updates on fixed random gradients (a new draw per step); the final
    params, state and last trust ratios as a tree like the params."""
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for seed in range(steps):
        rng = np.random.default_rng(100 + seed)
        grads = jax.tree.map(
            lambda x, rng=rng: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params
        )
        params, state = step(params, state, grads)
    return params, state


def assert_close(actual, expected):
    jax.tree.map(
        lambda a, e: np.testing.assert_allclose(a, e, rtol=2e-6, atol=1e-7), actual, expected
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("num_frozen", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_grouped_update_is_the_per_leaf_update(name, num_frozen):
    make, kwargs = OPTIMIZERS[name]
    tx = make(1e-2, **kwargs)
    per_layer = layer_layout.unstack_layers(stacked_params(3))
    if num_frozen:  # an MSLT stage's trainable view: layers 1 and 2 only
        del per_layer["encoder"]["layers_0"]
    per_leaf_params, per_leaf_state = run(tx, per_layer)
    grouped_params, grouped_state = run(optim.on_stacked_layers(tx), per_layer)
    assert jax.tree.structure(grouped_state) == jax.tree.structure(per_leaf_state)
    assert_close(grouped_params, per_leaf_params)
    assert_close(grouped_state, per_leaf_state)  # moments, counts and logged vectors
    ratios = optim.last_trust_ratios(grouped_state, grouped_params)
    assert ratios and ratios.keys() == optim.last_trust_ratios(per_leaf_state).keys()
    assert_close(ratios, optim.last_trust_ratios(per_leaf_state, per_leaf_params))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_stacked_trees_pass_through(name):
    make, kwargs = OPTIMIZERS[name]
    tx = make(1e-2, **kwargs)
    params = stacked_params(3)
    expected = run(tx, params)
    actual = run(optim.on_stacked_layers(tx), params)
    jax.tree.map(np.testing.assert_array_equal, actual, expected)


def test_an_optimizer_without_per_layer_ratios_is_refused():
    tx = optim.lamb(1e-2)  # no stacked_layers: one ratio per stacked leaf
    with pytest.raises(ValueError, match="stacked_layers=lambjax.optim.stacked_layers_mask"):
        optim.on_stacked_layers(tx).init(layer_layout.unstack_layers(stacked_params(2)))


def compiled_fusions(tx, params):
    grads = jax.tree.map(jnp.zeros_like, params)
    update = optimizer_layout.update_step(tx)
    state = jax.eval_shape(tx.init, params)
    compiled = jax.jit(update, donate_argnums=(0, 1)).lower(params, state, grads).compile()
    return optimizer_layout.fusion_kinds(compiled.as_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_grouped_reductions_do_not_grow_with_depth(name):
    """Per leaf, every layer adds its norms' reductions; grouped, the reductions (and the
    arithmetic beyond one copy per leaf) are those of the stacked tree at any depth."""
    make, kwargs = OPTIMIZERS[name]
    tx = make(1e-2, **kwargs)
    counts = {}
    for depth in (2, 6):
        per_layer = layer_layout.unstack_layers(stacked_params(depth))
        counts[depth] = (
            compiled_fusions(tx, per_layer),
            compiled_fusions(optim.on_stacked_layers(tx), per_layer),
        )
    (per_leaf_2, grouped_2), (per_leaf_6, grouped_6) = counts[2], counts[6]
    assert per_leaf_6["reduce"] > per_leaf_2["reduce"] + 4
    assert grouped_6["reduce"] == grouped_2["reduce"]
    # What grows grouped is data movement: one slice per moment leaf, one add per parameter.
    leaves_added = 4 * (6 - 2)
    assert grouped_6["other"] - grouped_2["other"] <= leaves_added
    assert grouped_6["slice"] - grouped_2["slice"] <= 2 * leaves_added
