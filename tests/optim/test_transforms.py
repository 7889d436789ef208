"""The small transforms on their own, the schedules, the masks and the state helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lambjax import optim


def test_normalize_per_tensor_never_nan_and_unit_norm():
    grads = {"a": jnp.array([3.0, 4.0]), "zero": jnp.zeros(3), "layers": jnp.ones((2, 4))}
    stacked = {"a": False, "zero": False, "layers": True}
    tx = optim.normalize_per_tensor(stacked)
    out, _ = tx.update(grads, tx.init(grads), grads)
    np.testing.assert_allclose(out["a"], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_array_equal(out["zero"], np.zeros(3))
    np.testing.assert_allclose(np.linalg.norm(out["layers"], axis=1), [1.0, 1.0], rtol=1e-6)


@pytest.mark.parametrize("scale", [0.1, 10.0, 0.0])
def test_clip_by_global_norm_matches_optax(scale):
    grads = {"a": jnp.array([3.0, 4.0]) * scale, "layers": jnp.ones((2, 4)) * scale}
    expected, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    out, _ = optim.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    for name in grads:
        np.testing.assert_allclose(out[name], expected[name], rtol=1e-6)
        assert np.all(np.isfinite(out[name]))
    with pytest.raises(ValueError, match="max_norm=0"):
        optim.clip_by_global_norm(0)


def test_trust_ratio_mask_bounds_and_zero_guard():
    params = {"w": jnp.full((4,), 3.0), "b": jnp.zeros(2), "skip": jnp.ones(2)}
    updates = {"w": jnp.full((4,), 0.5), "b": jnp.ones(2), "skip": jnp.ones(2) * 7}
    tx = optim.scale_by_trust_ratio(
        mask={"w": True, "b": True, "skip": False}, param_norm_bounds=(0.0, 2.0)
    )
    out, state = tx.update(updates, tx.init(params), params)
    # ||x|| = 6 clipped to 2, ||u|| = 1: ratio 2. ||x|| = 0: ratio 1. Masked off: 1.
    np.testing.assert_allclose(out["w"], updates["w"] * 2.0, rtol=1e-6)
    np.testing.assert_array_equal(out["b"], updates["b"])
    np.testing.assert_array_equal(out["skip"], updates["skip"])
    assert float(optim.last_trust_ratios(state, params)["trust_ratio"]["w"]) == pytest.approx(2.0)


def test_bad_bounds_are_rejected():
    with pytest.raises(ValueError, match="param_norm_bounds"):
        optim.scale_by_trust_ratio(param_norm_bounds=(2.0, 1.0))


def test_restart_step_count_keeps_moments():
    params = {"w": jnp.ones(3)}
    tx = optax.inject_hyperparams(optim.lamb)(learning_rate=optax.linear_schedule(0.0, 1.0, 10))
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update({"w": jnp.ones(3)}, state, params)
    restarted = optim.restart_step_count(state)
    counts = [c for f in COUNTERS for _, c in optax.tree_utils.tree_get_all_with_path(restarted, f)]
    assert len(counts) >= 3 and all(int(c) == 0 for c in counts)  # inject, Adam, the rate's
    adam = [s for s in jax.tree.leaves(restarted, is_leaf=_is_adam) if _is_adam(s)][0]
    assert float(jnp.sum(adam.mu["w"])) != 0.0


COUNTERS = ("count", "schedule_count")


def _is_adam(s):
    return isinstance(s, optax.ScaleByAdamState)


def test_poly_warmup_schedule_is_nvidias():
    lr = optim.poly_warmup_schedule(6e-3, total_steps=7038, warmup_fraction=0.2843)
    warmup_steps = 0.2843 * 7038
    # Step t (from 1) = count + 1.
    assert float(lr(0)) == pytest.approx(6e-3 * (1 / 7038) / 0.2843, rel=1e-5)
    assert float(lr(int(warmup_steps) - 1)) < 6e-3
    after = float(lr(int(warmup_steps) + 1))
    assert after == pytest.approx(6e-3 * (1 - (int(warmup_steps) + 2) / 7038) ** 0.5, rel=1e-5)
    assert after == pytest.approx(5.08e-3, abs=0.01e-3)  # the documented drop
    assert float(lr(7037)) == 0.0
    shifted = optim.poly_warmup_schedule(1.0, 100, 0.1, offset=50)
    assert float(shifted(10)) == 0.0
    assert float(shifted(50)) == pytest.approx((1 / 100) / 0.1)  # re-warms from step 50


def test_warmup_constant_decay_schedule_is_the_lans_authors():
    lr = optim.warmup_constant_decay_schedule(
        5e-3, 1000, warmup_fraction=0.05, constant_fraction=0.25
    )
    assert float(lr(0)) == 0.0
    assert float(lr(25)) == pytest.approx(5e-3 * 0.025 / 0.05)
    assert float(lr(100)) == pytest.approx(5e-3)
    assert float(lr(299)) == pytest.approx(5e-3)
    assert float(lr(650)) == pytest.approx(5e-3 * (1 - 0.65) / 0.7, rel=1e-5)
    assert float(lr(1000)) == 0.0
    with pytest.raises(ValueError, match="warmup_fraction \\+ constant_fraction"):
        optim.warmup_constant_decay_schedule(1.0, 10, 0.6, 0.6)


def test_schedules_work_with_inject_hyperparams():
    schedule = optim.poly_warmup_schedule(1e-3, 10, 0.5)
    tx = optax.inject_hyperparams(optim.lans)(learning_rate=schedule)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    _, state = tx.update({"w": jnp.ones(2)}, state, params)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(float(schedule(0)))


def test_bert_weight_decay_mask_by_path():
    params = {
        "embeddings": {"word": {"embedding": 0}, "layer_norm": {"scale": 0, "bias": 0}},
        "encoder": {"layers": {"attention": {"query": {"kernel": 0, "bias": 0}}}},
        "bert": {"LayerNorm": {"gamma": 0, "beta": 0}, "ln_1": {"weight": 0}},
    }
    mask = optim.bert_weight_decay_mask(params)
    assert mask["embeddings"]["word"]["embedding"] is True
    assert mask["encoder"]["layers"]["attention"]["query"]["kernel"] is True
    assert not any(
        [
            mask["embeddings"]["layer_norm"]["scale"],
            mask["encoder"]["layers"]["attention"]["query"]["bias"],
            mask["bert"]["LayerNorm"]["gamma"],
            mask["bert"]["ln_1"]["weight"],
        ]
    )
    stacked = optim.stacked_layers_mask(params)
    assert stacked["encoder"]["layers"]["attention"]["query"]["kernel"] is True
    assert stacked["embeddings"]["word"]["embedding"] is False


def f64_norm(tree) -> float:
    return float(
        np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))
    )


def schedule(count):
    return 1e-2 / (1.0 + count)


NORM_CASES = {
    "lamb NVIDIA": lambda: optim.lamb(
        schedule,
        weight_decay=0.01,
        weight_decay_mask=optim.bert_weight_decay_mask,
        trust_ratio_mask=optim.bert_weight_decay_mask,
        max_global_norm=1.0,
        stacked_layers=optim.stacked_layers_mask,
    ),
    "inject_hyperparams(lamb)": lambda: optax.inject_hyperparams(
        optim.lamb, static_args=("stacked_layers",)
    )(1e-2, weight_decay=0.01, stacked_layers=optim.stacked_layers_mask),
    "lans": lambda: optim.lans(schedule, stacked_layers=optim.stacked_layers_mask),
    "adamw": lambda: optax.adamw(1e-2),
}


@pytest.mark.parametrize("name", NORM_CASES)
def test_last_norms_are_the_norms_of_the_update(name):
    """`last_norms` after 3 updates: ||x|| of the parameters the last update was given and
    ||update|| of what it returned, from the per-tensor norms; masked-off tensors (biases,
    LayerNorm) count, a stacked leaf's layers too. What an optimizer does not measure is
    missing: LANS's update norm, all of AdamW's."""
    params = jax.tree.map(
        lambda x: jnp.asarray(x, jnp.float32),
        {
            "dense": {"kernel": np.arange(12.0).reshape(4, 3) / 7, "bias": np.ones(3)},
            "encoder": {"layers": {"kernel": np.linspace(-1, 1, 30).reshape(3, 5, 2)}},
            "layer_norm": {"scale": np.full(3, 1.1)},
        },
    )
    tx = NORM_CASES[name]()
    state = tx.init(params)
    step = jax.jit(tx.update)
    for seed in range(3):
        grads = jax.tree.map(
            lambda x, s=seed: jnp.sin(jnp.arange(x.size, dtype=jnp.float32) + s).reshape(x.shape),
            params,
        )
        updates, state = step(grads, state, params)
        norms = optim.last_norms(state)
        expected = {"param_norm": f64_norm(params), "update_norm": f64_norm(updates)}
        measured = {"lamb": ("param_norm", "update_norm"), "lans": ("param_norm",), "adamw": ()}
        kind = next(k for k in measured if k in name)
        assert sorted(norms) == sorted(measured[kind])
        for key in measured[kind]:
            assert float(norms[key]) == pytest.approx(expected[key], rel=1e-6), key
        params = optax.apply_updates(params, updates)


@pytest.mark.parametrize("scale", [0.1, 10.0])
def test_clip_given_the_gradient_norm_clips_as_without(scale):
    """`update(..., grad_norm=||g||)` (the train step's) gives the same bits as the clip
    that computes ||g|| itself: alone, inside lamb's chain and under inject_hyperparams."""
    grads = {"a": jnp.array([3.0, 4.0]) * scale, "layers": jnp.ones((2, 4)) * scale}
    params = jax.tree.map(jnp.ones_like, grads)
    grad_norm = optax.global_norm(grads)
    for tx in (
        optim.clip_by_global_norm(1.0),
        optim.lamb(1e-2, max_global_norm=1.0),
        optax.inject_hyperparams(optim.lamb)(1e-2, max_global_norm=1.0),
    ):
        state = tx.init(params)
        expected, _ = tx.update(grads, state, params)
        given, _ = tx.update(grads, state, params, grad_norm=grad_norm)
        for name in grads:
            np.testing.assert_array_equal(given[name], expected[name])


def test_scale_by_learning_rate_as_optax_and_keeps_the_rate():
    updates = {"w": jnp.array([1.0, -2.0])}
    for rate in (0.5, schedule):
        tx, reference = optim.scale_by_learning_rate(rate), optax.scale_by_learning_rate(rate)
        state, reference_state = tx.init(updates), reference.init(updates)
        for count in range(3):
            out, state = tx.update(updates, state)
            expected, reference_state = reference.update(updates, reference_state)
            np.testing.assert_array_equal(out["w"], expected["w"])
            want = rate(count) if callable(rate) else rate
            assert float(state.last_learning_rate) == pytest.approx(want)


def test_bert_weight_decay_mask_decays_a_bare_array():
    """No path to read a name from: decayed, as optax decays every leaf by default."""
    assert optim.bert_weight_decay_mask(jnp.ones(3)) is True
    assert optim.bert_weight_decay_mask(1.0) is True
