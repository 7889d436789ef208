"""Float64 numpy implementations of LAMB's and LANS's equations
(../shared/reference/optimizers.md), the parameters and gradients they are run on, and the
jitted step the optimizer tests share."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

STEPS = 24
LR = 1e-2


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "dense": {"kernel": rng.standard_normal((4, 3)), "bias": np.zeros(3)},  # ||x|| = 0
        "encoder": {"layers": {"kernel": rng.standard_normal((3, 5, 2))}},  # 3 stacked
        "layer_norm": {"scale": np.ones(3) + 0.1 * rng.standard_normal(3)},
    }


def make_grads(params, steps=STEPS, seed=1):
    """Global norms alternate ~3 and ~0.2; the LayerNorm gradient is exactly 0 at step 3."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        g = jax.tree.map(lambda x: rng.standard_normal(x.shape), params)
        norm = np.sqrt(sum(np.sum(x**2) for x in jax.tree.leaves(g)))
        target = 3.0 if t % 2 == 0 else 0.2
        g = jax.tree.map(lambda x, norm=norm, target=target: x * target / norm, g)
        if t == 3:
            g["layer_norm"]["scale"] = np.zeros(3)
        out.append(g)
    return out


DECAY_MASK = {
    "dense": {"kernel": True, "bias": False},
    "encoder": {"layers": {"kernel": True}},
    "layer_norm": {"scale": False},
}
STACKED = {
    "dense": {"kernel": False, "bias": False},
    "encoder": {"layers": {"kernel": True}},
    "layer_norm": {"scale": False},
}


def per_tensor(fn, x, stacked):
    """Applies fn to each tensor: the whole leaf, or each layer slice of a stacked leaf."""
    return np.stack([fn(s) for s in x]) if stacked else fn(x)


def norm_like(x, stacked):
    n = per_tensor(lambda s: np.sqrt(np.sum(s**2)), x, stacked)
    return n.reshape(n.shape + (1,) * (x.ndim - np.ndim(n))) if stacked else n


def ratio(phi, denominator):
    """phi / denominator, or 1 where phi or the denominator is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((phi == 0) | (denominator == 0), 1.0, phi / denominator)


def reference_lamb(params, grads, *, wd, decay_mask, trust_mask, max_norm, bias_correction):
    b1, b2, eps = 0.9, 0.999, 1e-6
    x = jax.tree.map(np.array, params)
    m = jax.tree.map(np.zeros_like, x)
    v = jax.tree.map(np.zeros_like, x)
    paths = [("dense", "kernel"), ("dense", "bias"), ("encoder", "kernel"), ("layer_norm", "scale")]

    def get(tree, path):
        return (
            tree["encoder"]["layers"]["kernel"] if path[0] == "encoder" else tree[path[0]][path[1]]
        )

    def put(tree, path, value):
        if path[0] == "encoder":
            tree["encoder"]["layers"]["kernel"] = value
        else:
            tree[path[0]][path[1]] = value

    for t, g in enumerate(grads, start=1):
        g_norm = np.sqrt(sum(np.sum(a**2) for a in jax.tree.leaves(g)))
        scale = min(1.0, max_norm / g_norm) if max_norm else 1.0
        for path in paths:
            gp, xp = get(g, path) * scale, get(x, path)
            mp = 0.9 * get(m, path) + 0.1 * gp
            vp = 0.999 * get(v, path) + 0.001 * gp**2
            put(m, path, mp)
            put(v, path, vp)
            mh, vh = (mp / (1 - b1**t), vp / (1 - b2**t)) if bias_correction else (mp, vp)
            u = mh / (np.sqrt(vh) + eps) + (wd * xp if get(decay_mask, path) else 0.0)
            stacked = get(STACKED, path)
            r = ratio(norm_like(xp, stacked), norm_like(u, stacked)) if get(trust_mask, path) else 1
            put(x, path, xp - LR * r * u)
    return x


def reference_lans(params, grads, *, wd, decay_mask):
    b1, b2, eps = 0.9, 0.999, 1e-6
    x = jax.tree.map(np.array, params)
    flat_x, treedef = jax.tree.flatten(x)
    flat_mask = jax.tree.leaves(decay_mask)
    flat_stacked = jax.tree.leaves(STACKED)
    m = [np.zeros_like(a) for a in flat_x]
    v = [np.zeros_like(a) for a in flat_x]
    for t, g in enumerate(grads, start=1):
        for i, (gp, stacked) in enumerate(zip(jax.tree.leaves(g), flat_stacked, strict=True)):
            xp = flat_x[i]
            gn = norm_like(gp, stacked)
            gh = gp * ratio(np.ones_like(gn), gn)  # g/||g||, and 0 stays 0
            m[i] = b1 * m[i] + (1 - b1) * gh
            v[i] = b2 * v[i] + (1 - b2) * gh**2
            d = np.sqrt(v[i] / (1 - b2**t)) + eps
            decay = wd * xp if flat_mask[i] else 0.0
            r = m[i] / (1 - b1**t) / d + decay
            c = gh / d + decay
            phi = norm_like(xp, stacked)
            flat_x[i] = (
                xp
                - LR * b1 * ratio(phi, norm_like(r, stacked)) * r
                - LR * (1 - b1) * ratio(phi, norm_like(c, stacked)) * c
            )
    return jax.tree.unflatten(treedef, flat_x)


def update_and_apply(tx):
    """(params, state, grads) -> (new params, new state): one optimizer step."""

    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    return step


def run(tx, params, grads):
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    state = tx.init(params)
    step = jax.jit(update_and_apply(tx))
    for g in grads:
        params, state = step(params, state, jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), g))
    return params, state, step


def assert_trees_close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), e, rtol=1e-5, atol=1e-6)


ALL_TRUE = jax.tree.map(lambda _: True, DECAY_MASK)
