"""The optimizers as optax users call them: `tx.init(params)` eagerly, then a jitted step
that donates params and state (`donate_argnums=(0, 1)`), on one device and with params
sharded over 8; the numbers against the same steps without donation, against the float64
references (tests/optim/references.py), and (inject_hyperparams, masked) against the plain
optimizer."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lambjax import optim
from tests.optim.references import (
    ALL_TRUE,
    DECAY_MASK,
    LR,
    make_grads,
    reference_lamb,
    reference_lans,
    update_and_apply,
)

STEPS = 3
NVIDIA = dict(
    weight_decay=0.01,
    weight_decay_mask=optim.bert_weight_decay_mask,
    trust_ratio_mask=optim.bert_weight_decay_mask,
    max_global_norm=1.0,
    stacked_layers=optim.stacked_layers_mask,
)
LANS = dict(
    weight_decay=0.01,
    weight_decay_mask=optim.bert_weight_decay_mask,
    stacked_layers=optim.stacked_layers_mask,
)
OPTIMIZERS = {"lamb NVIDIA": (optim.lamb, NVIDIA), "lans": (optim.lans, LANS)}
DENSE_ONLY = {"dense": True, "encoder": False, "layer_norm": False}  # for optax.masked


def injected(make, learning_rate, **kwargs):
    """optax.inject_hyperparams(make)(...): every numeric argument becomes an array in the
    state (traced in the step). Masks are static: a callable would be taken for a schedule."""
    masks = [k for k in kwargs if k.endswith("_mask") or k == "stacked_layers"]
    return optax.inject_hyperparams(make, static_args=masks)(learning_rate, **kwargs)


# The tree of test_optimizers (so its references apply: the masks above resolve to its
# DECAY_MASK and STACKED), sized so that each leaf splits 8 ways.
SHAPES = {
    "dense": {"kernel": (16, 3), "bias": (8,)},  # the bias starts at 0: ||x|| = 0
    "encoder": {"layers": {"kernel": (3, 8, 2)}},  # 3 stacked layers
    "layer_norm": {"scale": (8,)},
}
SPECS = {  # split on the leading axis, on a stacked leaf's layer axis; one leaf replicated
    "dense": {"kernel": P("x"), "bias": P("x")},
    "encoder": {"layers": {"kernel": P(None, "x")}},
    "layer_norm": {"scale": P()},
}


def make_params():
    rng = np.random.default_rng(0)
    params = jax.tree.map(rng.standard_normal, SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    params["dense"]["bias"] = np.zeros(8)
    params["layer_norm"]["scale"] = 1 + 0.1 * params["layer_norm"]["scale"]
    return params


def place(tree, mesh):
    """Fresh float32 device arrays: on the default device, or split over `mesh` by SPECS."""
    tree = jax.tree.map(lambda x: jnp.array(x, jnp.float32), tree)
    if mesh is None:
        return tree
    return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), tree, SPECS)


def run(tx, params, grads, *, donate, mesh=None):
    """STEPS jitted steps from an eagerly initialised state; params and state as numpy."""
    params = place(params, mesh)
    state = tx.init(params)
    step = jax.jit(update_and_apply(tx), donate_argnums=(0, 1) if donate else ())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*donated buffers were not usable")
        for g in grads:
            donated = params
            params, state = step(params, state, place(g, mesh))
            assert all(x.is_deleted() for x in jax.tree.leaves(donated)) == donate
    if mesh is not None:
        for x, spec in zip(jax.tree.leaves(params), jax.tree.leaves(SPECS), strict=True):
            assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)
    return jax.tree.map(np.asarray, (params, state))


def assert_trees_close(actual, expected, rtol, atol):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= 8, "conftest.py forces 8 CPU devices"
    return Mesh(np.array(jax.devices()[:8]), ("x",))


def transforms_with_state():
    return {
        "lamb paper": optim.lamb(LR, stacked_layers=optim.stacked_layers_mask),
        "lamb NVIDIA": optim.lamb(LR, **NVIDIA),
        "lamb without bias correction": optim.lamb(LR, bias_correction=False),
        "lans": optim.lans(LR, **LANS),
        "scale_by_adam": optim.scale_by_adam(),
        "scale_by_adam without bias correction": optim.scale_by_adam(bias_correction=False),
        "scale_by_trust_ratio": optim.scale_by_trust_ratio(
            mask=optim.bert_weight_decay_mask,
            stacked_layers=optim.stacked_layers_mask,
            param_norm_bounds=(0.0, 10.0),
        ),
        "scale_by_lans": optim.scale_by_lans(**LANS),
        "inject_hyperparams(lamb NVIDIA)": injected(
            optim.lamb, optim.poly_warmup_schedule(LR, 10, 0.5), **NVIDIA
        ),
        "inject_hyperparams(lans)": injected(
            optim.lans, optim.warmup_constant_decay_schedule(LR, 10, 0.2, 0.3), **LANS
        ),
        "masked(lamb NVIDIA)": optax.masked(optim.lamb(LR, **NVIDIA), DENSE_ONLY),
        "masked(lans)": optax.masked(optim.lans(LR, **LANS), DENSE_ONLY),
    }


@pytest.mark.parametrize("name", list(transforms_with_state()))
def test_donated_steps_equal_undonated_ones_on_1_and_8_devices(name, mesh):
    tx = transforms_with_state()[name]
    params = make_params()
    grads = make_grads(params, steps=STEPS)
    expected = run(tx, params, grads, donate=False)
    assert_trees_close(run(tx, params, grads, donate=True), expected, rtol=1e-6, atol=1e-7)
    # Sharded norms sum in another order.
    sharded = run(tx, params, grads, donate=True, mesh=mesh)
    assert_trees_close(sharded, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "name, reference",
    [
        ("lamb paper", dict(wd=0.0, decay_mask=ALL_TRUE, trust_mask=ALL_TRUE, max_norm=None)),
        ("lamb NVIDIA", dict(wd=0.01, decay_mask=DECAY_MASK, trust_mask=DECAY_MASK, max_norm=1)),
        ("lans", dict(wd=0.01, decay_mask=DECAY_MASK)),
    ],
)
def test_donated_sharded_steps_match_the_equations(name, reference, mesh):
    params = make_params()
    grads = make_grads(params, steps=STEPS)
    actual, _ = run(transforms_with_state()[name], params, grads, donate=True, mesh=mesh)
    if name.startswith("lamb"):
        expected = reference_lamb(params, grads, **reference, bias_correction=True)
    else:
        expected = reference_lans(params, grads, **reference)
    assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_inject_hyperparams_steps_equal_the_plain_optimizer(name, mesh):
    """Every numeric argument is injected (traced in the step); the same schedule given
    directly gives the same parameters."""
    make, kwargs = OPTIMIZERS[name]
    schedule = optim.poly_warmup_schedule(LR, 10, 0.5)
    params = make_params()
    grads = make_grads(params, steps=STEPS)
    actual, state = run(injected(make, schedule, **kwargs), params, grads, donate=True, mesh=mesh)
    expected, _ = run(make(schedule, **kwargs), params, grads, donate=False)
    assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert set(state.hyperparams) >= {"learning_rate", "b1", "b2", "eps", "weight_decay"}
    # The rate of the last step (step counts 0, 1, 2).
    assert state.hyperparams["learning_rate"] == pytest.approx(float(schedule(STEPS - 1)))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_masked_steps_update_the_masked_leaves_as_the_optimizer_alone(name, mesh):
    """optax.masked: the selected subtree steps as if the optimizer saw only it; the rest
    gets the raw gradient as its update (optax's convention)."""
    make, kwargs = OPTIMIZERS[name]
    params = make_params()
    grads = make_grads(params, steps=STEPS)
    masked = optax.masked(make(LR, **kwargs), DENSE_ONLY)
    actual, _ = run(masked, params, grads, donate=True, mesh=mesh)
    dense_only = [{"dense": tree["dense"]} for tree in [params, *grads]]
    alone, _ = run(make(LR, **kwargs), dense_only[0], dense_only[1:], donate=False)
    assert_trees_close(actual["dense"], alone["dense"], rtol=1e-5, atol=1e-6)
    for subtree in ("encoder", "layer_norm"):
        gradients = [g[subtree] for g in grads]
        summed = jax.tree.map(lambda x, *gs: x + sum(gs), params[subtree], *gradients)
        assert_trees_close(actual[subtree], summed, rtol=1e-6, atol=1e-6)
