"""LAMB and LANS in optax's own programs: the checks optax runs on its optimizers (its alias,
contrib, sharding, tree-utility and inject_hyperparams tests), applied to lambjax's
optimizers with `optax.lamb` and `optax.adamw` as controls in the same parametrization.
Wrappers (inject_hyperparams, MultiSteps, masked, partition, apply_if_finite), explicit
and automatic sharding, tree_map_params-derived shardings, donation, dtypes, schedules."""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lambjax import optim

MASK = optim.bert_weight_decay_mask


@dataclasses.dataclass(frozen=True)
class Case:
    """An optimizer as `factory(learning_rate, **kwargs)`; `static_args` are its masks
    (optax.inject_hyperparams would take a callable for a schedule)."""

    factory: Callable
    kwargs: dict
    static_args: tuple = ()
    learning_rate: float = 1e-3  # one that solves optax's parabola in PARABOLA_STEPS

    def make(self, learning_rate=None, **overrides):
        rate = self.learning_rate if learning_rate is None else learning_rate
        return self.factory(rate, **{**self.kwargs, **overrides})

    def injected(self, learning_rate=None, hyperparam_dtype=None, **overrides):
        rate = self.learning_rate if learning_rate is None else learning_rate
        inject = optax.inject_hyperparams(
            self.factory, static_args=self.static_args, hyperparam_dtype=hyperparam_dtype
        )
        return inject(rate, **{**self.kwargs, **overrides})


CASES = {
    "lambjax.lamb": Case(optim.lamb, {}),
    "lambjax.lamb NVIDIA": Case(
        optim.lamb,
        dict(weight_decay=0.01, weight_decay_mask=MASK, trust_ratio_mask=MASK, max_global_norm=1.0),
        ("weight_decay_mask", "trust_ratio_mask"),
    ),
    "lambjax.lans": Case(
        optim.lans, dict(weight_decay=0.01, weight_decay_mask=MASK), ("weight_decay_mask",)
    ),
    "optax.lamb": Case(optax.lamb, dict(weight_decay=0.01, mask=MASK), ("mask",)),
    "optax.adamw": Case(optax.adamw, dict(weight_decay=0.01, mask=MASK), ("mask",), 1e-1),
}
LAMBJAX = [name for name in CASES if name.startswith("lambjax")]

SHAPES = {"dense": {"kernel": (8, 4), "bias": (8,)}, "layer_norm": {"scale": (8,)}}
SPECS = {"dense": {"kernel": P("x"), "bias": P("x")}, "layer_norm": {"scale": P()}}


def make_params(dtype=jnp.float32):
    """A small BERT-like tree: a kernel, a bias at 0 (||x|| = 0) and a LayerNorm scale."""
    kernel = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)
    params = {
        "dense": {"kernel": kernel, "bias": jnp.zeros(8)},
        "layer_norm": {"scale": jnp.ones(8)},
    }
    return jax.tree.map(lambda x: x.astype(dtype), params)


def make_grads(params, seed=0):
    return jax.tree.map(
        lambda x: jnp.sin(jnp.arange(x.size) + 1.0 + seed).reshape(x.shape).astype(x.dtype), params
    )


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-7):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), rtol, atol)


def types(tree):
    return jax.tree.map(jax.typeof, tree)


def update_and_apply(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= 8, "tests/conftest.py forces 8 CPU devices"
    return Mesh(np.array(jax.devices()[:8]), ("x",))


# ----------------------------------------------------------------------------------------
# Sharding


@pytest.mark.parametrize("name", CASES)
def test_explicit_sharding_keeps_state_types_eager_and_jitted(name):
    """optax's sharding test: under explicit sharding (sharding in the types), init and
    update run eagerly and jitted, and the state's types (shape, dtype, sharding) are the
    same from init, jitted init, update and jitted update."""
    tx = CASES[name].make()
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    expected, _ = tx.update(make_grads(make_params()), tx.init(make_params()), make_params())
    with jax.set_mesh(mesh):
        place = lambda tree: jax.tree.map(  # noqa: E731
            lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), tree, SPECS
        )
        params, grads = place(make_params()), place(make_grads(make_params()))
        state = tx.init(params)
        assert types(jax.jit(tx.init)(params)) == types(state)
        updates, eager_state = tx.update(grads, state, params)
        jitted_updates, jitted_state = jax.jit(tx.update)(grads, state, params)
        assert types(eager_state) == types(jitted_state) == types(state)
        assert types(updates) == types(jitted_updates) == types(params)
    assert_trees_close(updates, expected)
    assert_trees_close(jitted_updates, expected)


@pytest.mark.parametrize("name", CASES)
def test_tree_map_params_shardings_serve_as_out_shardings_of_donated_steps(name, mesh):
    """The shardings of the state derived with `optax.tree_map_params` from the parameters'
    (a parameter-shaped tree gets its parameter's, anything else replicated) are the
    out_shardings of a jitted init and of a step that donates params and state, from an
    eagerly initialised state; the numbers are those of one device."""
    tx = CASES[name].make()
    param_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), SPECS)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(make_params(), param_shardings)
    state = tx.init(params)
    assert jax.tree.structure(optax.tree_map_params(tx, lambda v: v, state)) == (
        jax.tree.structure(state)
    )
    state_shardings = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        jax.eval_shape(tx.init, params),
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
    jitted_state = jax.jit(tx.init, out_shardings=state_shardings)(params)
    assert_trees_close(jitted_state, state)
    step = jax.jit(
        update_and_apply(tx),
        out_shardings=(param_shardings, state_shardings),
        donate_argnums=(0, 1),
    )
    unsharded, unsharded_state = make_params(), tx.init(make_params())
    for seed in range(2):
        donated = params
        params, state = step(params, state, make_grads(make_params(), seed))
        assert all(x.is_deleted() for x in jax.tree.leaves(donated))
        unsharded, unsharded_state = update_and_apply(tx)(
            unsharded, unsharded_state, make_grads(make_params(), seed)
        )
    for leaf, sharding in zip(
        jax.tree.leaves(state), jax.tree.leaves(state_shardings), strict=True
    ):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    assert_trees_close(params, unsharded)
    assert_trees_close(state, unsharded_state, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------
# Wrappers


@pytest.mark.parametrize("name", CASES)
def test_inject_hyperparams_get_and_set_the_learning_rate(name):
    """`optax.tree.get` finds one `learning_rate` (the injected one) and, in the plain
    state, one `count`; `optax.tree.set` of the rate doubles the update (the rate scales
    it last), in a jitted step."""
    case = CASES[name]
    params, grads = make_params(), make_grads(make_params())
    tx, plain = case.injected(), case.make()
    state, plain_state = tx.init(params), plain.init(params)
    assert float(optax.tree.get(state, "learning_rate")) == pytest.approx(case.learning_rate)
    assert int(optax.tree.get(plain_state, "count")) == 0
    state = optax.tree.set(state, learning_rate=jnp.float32(2 * case.learning_rate))
    updates, state = jax.jit(tx.update)(grads, state, params)
    expected, plain_state = jax.jit(plain.update)(grads, plain_state, params)
    assert_trees_close(updates, jax.tree.map(lambda u: 2 * u, expected))
    assert float(optax.tree.get(state, "learning_rate")) == pytest.approx(2 * case.learning_rate)
    assert int(optax.tree.get(plain_state, "count")) == 1


@pytest.mark.parametrize("name", CASES)
def test_multisteps_applies_the_mean_gradient_every_k_steps(name):
    params = make_params()
    tx = optax.MultiSteps(CASES[name].make(), every_k_schedule=2)
    state = tx.init(params)
    step = jax.jit(tx.update)
    first, state = step(make_grads(params, 0), state, params)
    assert all(not np.any(x) for x in jax.tree.leaves(first))
    second, state = step(make_grads(params, 1), state, params)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, make_grads(params, 0), make_grads(params, 1))
    plain = CASES[name].make()
    expected, _ = plain.update(mean, plain.init(params), params)
    assert_trees_close(second, expected)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("mask", ["dense only", "no leaf", "empty tree"])
def test_masked(name, mask):
    """optax.masked: the selected leaves step as with the optimizer alone, the others get
    their gradient; an inner optimizer that sees no leaf at all runs too."""
    params = {} if mask == "empty tree" else make_params()
    selected = {
        "dense only": {"dense": True, "layer_norm": False},
        "no leaf": {"dense": False, "layer_norm": False},
        "empty tree": {},
    }[mask]
    tx = optax.masked(CASES[name].make(), selected)
    grads = make_grads(params)
    state = tx.init(params)
    updates, _ = tx.update(grads, state, params)
    if mask != "dense only":
        assert_trees_close(updates, grads, rtol=0, atol=0)
        return
    assert_trees_close(jax.jit(tx.update)(grads, state, params)[0], updates)
    plain = CASES[name].make()
    dense = {"dense": params["dense"]}
    expected, _ = plain.update({"dense": grads["dense"]}, plain.init(dense), dense)
    assert_trees_close(updates["dense"], expected["dense"])
    assert_trees_close(updates["layer_norm"], grads["layer_norm"], rtol=0, atol=0)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("labels", ["with an empty group", "all frozen"])
def test_partition(name, labels):
    """optax.partition with a group that has no parameter, and with every parameter in
    the frozen group (the optimizer's group then sees no leaf)."""
    params, grads = make_params(), make_grads(make_params())
    label_tree = {
        "with an empty group": {"dense": "train", "layer_norm": "frozen"},
        "all frozen": {"dense": "frozen", "layer_norm": "frozen"},
    }[labels]
    transforms = {"train": CASES[name].make(), "frozen": optax.set_to_zero()}
    if labels == "with an empty group":
        transforms["unused"] = CASES[name].make()
    tx = optax.partition(transforms, label_tree)
    state = tx.init(params)
    updates, _ = (tx.update if labels == "all frozen" else jax.jit(tx.update))(grads, state, params)
    assert all(not np.any(x) for x in jax.tree.leaves(updates["layer_norm"]))
    if labels == "all frozen":
        assert all(not np.any(x) for x in jax.tree.leaves(updates))
        return
    plain = CASES[name].make()
    dense = {"dense": params["dense"]}
    expected, _ = plain.update({"dense": grads["dense"]}, plain.init(dense), dense)
    assert_trees_close(updates["dense"], expected["dense"])


@pytest.mark.parametrize("name", CASES)
def test_apply_if_finite_skips_a_nonfinite_step(name):
    params = make_params()
    tx = optax.apply_if_finite(CASES[name].make(), max_consecutive_errors=3)
    state = tx.init(params)
    step = jax.jit(tx.update)
    nonfinite = jax.tree.map(lambda g: g.at[0].set(jnp.nan), make_grads(params))
    skipped, after_skip = step(nonfinite, state, params)
    assert all(not np.any(x) for x in jax.tree.leaves(skipped))
    assert int(after_skip.notfinite_count) == 1
    assert_trees_close(after_skip.inner_state, state.inner_state, rtol=0, atol=0)
    updates, _ = step(make_grads(params), after_skip, params)
    plain = CASES[name].make()
    expected, _ = plain.update(make_grads(params), plain.init(params), params)
    assert_trees_close(updates, expected)


@pytest.mark.parametrize("name", CASES)
def test_update_accepts_extra_arguments(name):
    params = make_params()
    tx = CASES[name].make()
    expected, _ = tx.update(make_grads(params), tx.init(params), params)
    updates, _ = tx.update(make_grads(params), tx.init(params), params, unexpected_argument=1)
    assert_trees_close(updates, expected)


# ----------------------------------------------------------------------------------------
# Dtypes


PARABOLA_STEPS = 10_000


def parabola(dtype):
    """optax's quadratic target: from [-1, 10, 1] to [1, -1, 1] (times 1 + 1j if complex)."""
    initial = jnp.array([-1.0, 10.0, 1.0], dtype)
    final = jnp.array([1.0, -1.0, 1.0], dtype)
    if jnp.iscomplexobj(initial):
        final = final * (1 + 1j)
    return initial, final, lambda x: jnp.sum(jnp.real(jnp.conj(x - final) * (x - final)))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.complex64])
def test_solves_optax_parabola(name, dtype):
    """The bare array decays (no path, as optax would) under the BERT masks; complex
    gradients are conjugated before the update, as optax's test does."""
    tx = CASES[name].make()
    initial, final, objective = parabola(dtype)

    @jax.jit
    def solve(params):
        def step(carry, _):
            params, state = carry
            grads = jax.tree.map(jnp.conj, jax.grad(objective)(params))
            updates, state = tx.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None

        (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), length=PARABOLA_STEPS)
        return params

    solved = solve(initial)
    assert solved.dtype == dtype
    np.testing.assert_allclose(solved, final, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("name", CASES)
def test_bfloat16_params_keep_their_dtype_and_state_types(name):
    params = make_params(jnp.bfloat16)
    tx = CASES[name].make()
    state = jax.jit(tx.init)(params)
    updates, new_state = jax.jit(tx.update)(make_grads(params), state, params)
    assert types(new_state) == types(state)
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))
    assert all(np.all(np.isfinite(np.asarray(u, np.float32))) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("name", CASES)
def test_inject_hyperparams_with_bfloat16_params(name):
    """inject_hyperparams casts hyperparameters to the parameters' dtype: b2 = 0.999 is 1.0
    in bfloat16. lambjax refuses it up front with the remedy; with the remedy
    (hyperparam_dtype=jnp.float32) every optimizer takes finite steps."""
    params = make_params(jnp.bfloat16)
    if name in LAMBJAX:
        with pytest.raises(ValueError, match="hyperparam_dtype=jnp.float32"):
            CASES[name].injected().init(params)
    tx = CASES[name].injected(hyperparam_dtype=jnp.float32)
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)(make_grads(params), state, params)
    assert all(np.all(np.isfinite(np.asarray(u, np.float32))) for u in jax.tree.leaves(updates))


# ----------------------------------------------------------------------------------------
# Schedules


@pytest.mark.parametrize("name", CASES)
def test_schedules_for_learning_rate_and_weight_decay(name):
    """Constant schedules step as the numbers; decaying ones the same, given directly or
    through inject_hyperparams."""
    case = CASES[name]
    lr, weight_decay = case.learning_rate, 0.01
    params = make_params()

    def run(tx, steps=2):
        state, updates = tx.init(params), None
        for seed in range(steps):
            updates, state = jax.jit(tx.update)(make_grads(params, seed), state, params)
        return updates

    constant = case.make(
        optax.constant_schedule(lr), weight_decay=optax.constant_schedule(weight_decay)
    )
    assert_trees_close(run(constant), run(case.make(lr, weight_decay=weight_decay)))
    lr_schedule = optax.linear_schedule(lr, lr / 10, 4)
    decay_schedule = optax.linear_schedule(weight_decay, 0.1, 4)
    direct = run(case.make(lr_schedule, weight_decay=decay_schedule), steps=3)
    injected = run(case.injected(lr_schedule, weight_decay=decay_schedule), steps=3)
    assert_trees_close(injected, direct)


# ----------------------------------------------------------------------------------------
# lambjax's own: the ratios the optax way, refusals


@pytest.mark.parametrize("name", LAMBJAX)
def test_last_trust_ratios_read_the_optax_way(name):
    """The logged trust ratios are one vector per kind, found by `optax.tree.get` under
    inject_hyperparams too, the same as `optim.last_trust_ratios` (a tree like the
    params, given them)."""
    params = make_params()
    tx = CASES[name].injected()
    _, state = jax.jit(tx.update)(make_grads(params), tx.init(params), params)
    by_optim = optim.last_trust_ratios(state, params)
    fields = {"trust_ratio": "trust_ratios", "trust_ratio_adam": "adam_trust_ratios"}
    for key, field in fields.items():
        if key in by_optim:
            vector = optax.tree.get(state, field)
            assert vector.shape == (3,)
            assert_trees_close(optim.per_tensor_tree(vector, params), by_optim[key], 0, 0)
    assert float(by_optim[next(iter(by_optim))]["dense"]["bias"]) == 1.0  # ||x|| = 0


def test_clipping_schedule_is_refused_with_the_remedy():
    with pytest.raises(ValueError, match="a schedule is not supported"):
        optim.lamb(1e-3, max_global_norm=optax.constant_schedule(1.0))
