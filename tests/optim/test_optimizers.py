"""LAMB and LANS against float64 numpy implementations of the equations
(tests/optim/references.py), over 24 steps whose gradient norms alternate above and
below 1, with a zero-initialised bias and a zero gradient, masks on and off."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lambjax import optim
from tests.optim.references import (
    ALL_TRUE,
    DECAY_MASK,
    LR,
    STACKED,
    STEPS,
    assert_trees_close,
    make_grads,
    make_params,
    reference_lamb,
    reference_lans,
    run,
    update_and_apply,
)


@pytest.mark.parametrize(
    "wd, decay_mask, trust_mask, max_norm, bias_correction",
    [
        (0.0, None, None, None, True),  # the paper's LAMB
        (0.01, DECAY_MASK, None, None, True),
        (0.01, DECAY_MASK, DECAY_MASK, 1.0, True),  # NVIDIA's recipe
        (0.01, None, DECAY_MASK, 1.0, False),
    ],
)
def test_lamb_matches_the_equations(wd, decay_mask, trust_mask, max_norm, bias_correction):
    params, grads = make_params(), make_grads(make_params())
    tx = optim.lamb(
        LR,
        weight_decay=wd,
        weight_decay_mask=decay_mask,
        trust_ratio_mask=trust_mask,
        max_global_norm=max_norm,
        bias_correction=bias_correction,
        stacked_layers=STACKED,
    )
    actual, _, _ = run(tx, params, grads)
    expected = reference_lamb(
        params,
        grads,
        wd=wd,
        decay_mask=decay_mask or ALL_TRUE,
        trust_mask=trust_mask or ALL_TRUE,
        max_norm=max_norm,
        bias_correction=bias_correction,
    )
    assert_trees_close(actual, expected)
    assert not np.allclose(actual["dense"]["bias"], 0)  # the zero-norm guard lets it move


def test_adamw_without_bias_correction_matches_the_equations():
    """DeepSpeed's Adam of the PLD recipe: m / (sqrt(v) + eps) with the raw moments, decoupled
    weight decay, the global gradient norm clipped to 1, as lambjax's `adamw` builds it."""
    from lambjax.train.config import optimizer_config
    from lambjax.train.optimizer import make_optimizer

    settings = optimizer_config("adamw")
    settings.bias_correction = False
    params = {"dense": {"kernel": np.linspace(-1, 1, 6).reshape(2, 3), "bias": np.zeros(3)}}
    grads = [
        jax.tree.map(lambda p, t=t: np.cos(p + t) * (3 if t % 2 else 0.2), params)
        for t in range(STEPS)
    ]
    actual, _, _ = run(make_optimizer(settings, optax.constant_schedule(LR)), params, grads)
    x = jax.tree.map(np.float64, params)
    m = jax.tree.map(np.zeros_like, x)
    v = jax.tree.map(np.zeros_like, x)
    for g in grads:
        norm = np.sqrt(sum(np.sum(leaf**2) for leaf in jax.tree.leaves(g)))
        g = jax.tree.map(lambda leaf, norm=norm: leaf / max(norm, 1.0), g)
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, g)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, g)
        update = jax.tree.map(lambda m, v: m / (np.sqrt(v) + 1e-6), m, v)
        update["dense"]["kernel"] = update["dense"]["kernel"] + 0.01 * x["dense"]["kernel"]
        x = jax.tree.map(lambda x, u: x - LR * u, x, update)  # biases are not decayed
    assert_trees_close(actual, x)


@pytest.mark.parametrize("wd, decay_mask", [(0.0, None), (0.01, DECAY_MASK)])
def test_lans_matches_the_equations(wd, decay_mask):
    params, grads = make_params(), make_grads(make_params())
    tx = optim.lans(LR, weight_decay=wd, weight_decay_mask=decay_mask, stacked_layers=STACKED)
    actual, _, _ = run(tx, params, grads)
    expected = reference_lans(params, grads, wd=wd, decay_mask=decay_mask or ALL_TRUE)
    assert_trees_close(actual, expected)


def test_paper_lamb_equals_optax_lamb_without_stacked_leaves():
    params = {k: v for k, v in make_params().items() if k != "encoder"}
    grads = [{k: v for k, v in g.items() if k != "encoder"} for g in make_grads(make_params())]
    mask = {"dense": {"kernel": True, "bias": False}, "layer_norm": {"scale": False}}
    ours, _, _ = run(optim.lamb(LR, weight_decay=0.01, weight_decay_mask=mask), params, grads)
    theirs, _, _ = run(optax.lamb(LR, weight_decay=0.01, mask=mask), params, grads)
    assert_trees_close(ours, jax.tree.map(np.asarray, theirs))


@pytest.mark.parametrize("name", ["lamb", "lans"])
def test_stacked_leaf_equals_separate_layers(name):
    rng = np.random.default_rng(3)
    stacked = {"layers": {"w": rng.standard_normal((3, 4, 2))}}
    separate = {f"layer{i}": {"w": stacked["layers"]["w"][i]} for i in range(3)}
    grads = [rng.standard_normal((3, 4, 2)) * (3 if t % 2 else 0.2) for t in range(STEPS)]
    make = getattr(optim, name)
    tx_stacked = make(LR, weight_decay=0.01, stacked_layers=optim.stacked_layers_mask)
    got, _, _ = run(tx_stacked, stacked, [{"layers": {"w": g}} for g in grads])
    want, _, _ = run(
        make(LR, weight_decay=0.01),
        separate,
        [{f"layer{i}": {"w": g[i]} for i in range(3)} for g in grads],
    )
    for i in range(3):
        np.testing.assert_allclose(got["layers"]["w"][i], want[f"layer{i}"]["w"], rtol=1e-5)


@pytest.mark.parametrize(
    "name, passes",
    [("adamw", 10), ("lamb paper", 15), ("lamb NVIDIA", 16), ("lans", 22)],
)
def test_update_memory_traffic_in_parameter_passes(name, passes):
    """The update is memory-bound: XLA's cost analysis of the compiled step counts the
    bytes it reads and writes. On CPU, adamw makes 10 parameter-sized passes (3 fusions:
    m, v, the step); each norm of a written-out tensor adds a read, each written-out
    temporary a write and a read. This pins the structure the benchmark's ratios rest on
    (docs/performance.md), e.g. that LANS writes no shared sqrt(v) (24 passes)."""
    if jax.default_backend() != "cpu":
        pytest.skip("counts XLA:CPU's fusions")
    params = {"kernel": jnp.ones((256, 1024)), "layers": {"kernel": jnp.ones((4, 128, 512))}}
    stacked = {"kernel": False, "layers": {"kernel": True}}
    tx = {
        "adamw": optax.adamw(LR, weight_decay=0.01),
        "lamb paper": optim.lamb(LR, weight_decay=0.01, stacked_layers=stacked),
        "lamb NVIDIA": optim.lamb(
            LR, weight_decay=0.01, max_global_norm=1.0, stacked_layers=stacked
        ),
        "lans": optim.lans(LR, weight_decay=0.01, stacked_layers=stacked),
    }[name]
    state = jax.eval_shape(tx.init, params)
    step = jax.jit(update_and_apply(tx), donate_argnums=(0, 1))
    compiled = step.lower(params, state, params).compile()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    measured = compiled.cost_analysis()["bytes accessed"] / param_bytes
    assert measured == pytest.approx(passes, abs=0.01)


def test_second_update_does_not_recompile():
    params, grads = make_params(), make_grads(make_params(), steps=3)
    _, _, step = run(optim.lans(LR, stacked_layers=STACKED), params, grads)
    assert step._cache_size() == 1


@pytest.mark.parametrize("name", ["lamb", "lans"])
def test_state_keeps_the_parameter_shardings_on_8_devices(name):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lambjax import sharding

    mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
    params = {
        "w": jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("fsdp", None))),
        "layers": {"k": jax.device_put(jnp.ones((2, 8, 4)), NamedSharding(mesh, P(None, "fsdp")))},
    }
    tx = getattr(optim, name)(LR, weight_decay=0.01, stacked_layers=optim.stacked_layers_mask)
    state = jax.jit(tx.init)(params)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
        return optax.apply_updates(params, updates), state

    params, state = step(params, state)
    moments = [s for s in jax.tree.leaves(state) if s.ndim >= 2]
    assert moments, "no moments found"
    for leaf in moments:
        expected = P("fsdp", None) if leaf.shape == (8, 16) else P(None, "fsdp")
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, expected), leaf.ndim)
    assert params["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", None)), 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(learning_rate=-1.0), "learning_rate=-1.0"),
        (dict(learning_rate=1e-3, b1=1.0), "b1=1.0 must lie in"),
        (dict(learning_rate=1e-3, b2=-0.1), "b2=-0.1 must lie in"),
        (dict(learning_rate=1e-3, eps=-1.0), "eps=-1.0"),
        (dict(learning_rate=1e-3, weight_decay=-0.1), "weight_decay=-0.1"),
    ],
)
@pytest.mark.parametrize("name", ["lamb", "lans"])
def test_bad_arguments_name_the_argument(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        getattr(optim, name)(**kwargs)


@pytest.mark.parametrize("argument", ["weight_decay_mask", "stacked_layers", "trust_ratio_mask"])
def test_mask_tree_mismatch_names_the_argument(argument):
    params = jax.tree.map(jnp.asarray, make_params())
    bad = {"dense": {"kernel": True}}
    if argument == "trust_ratio_mask":
        tx = optim.lamb(LR, trust_ratio_mask=bad)
    elif argument == "weight_decay_mask":
        tx = optim.lans(LR, weight_decay=0.1, weight_decay_mask=bad)
    else:
        tx = optim.lamb(LR, stacked_layers=bad)
    with pytest.raises(ValueError, match=argument if argument != "trust_ratio_mask" else "mask"):
        tx.init(params)
