"""Optimizer step time on BERT-shaped parameter trees, as ratios to optax.adamw.

  python benchmarks/optimizer_step.py [--model base|large|all] [--steps 20]
      [--host-memory retain|default]

Each optimizer update (with apply_updates) is jitted with the parameters and state donated,
as in a train step, and timed on random gradients; the median of `--steps` timed steps
after warm-up is reported. All optimizers are measured in the same run. On CPU, malloc
keeps freed memory as `lambjax.main` sets it (lambjax.host_memory); `--host-memory=default`
leaves glibc's defaults, under which every fresh temporary (a trust ratio's update) is
faulted in again at every step.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lambjax import host_memory, optim

SHAPES = {  # (layers, hidden, intermediate, vocab)
    "base": (12, 768, 3072, 30522),
    "large": (24, 1024, 4096, 30522),
}


def bert_shaped_params(model: str):
    """A BERT parameter tree with its encoder layers stacked on axis 0 (as lambjax scans)."""
    layers, hidden, intermediate, vocab = SHAPES[model]
    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.02)

    def b(*shape):
        return jnp.zeros(shape, jnp.float32)

    def norm(*lead):
        return {"scale": jnp.ones((*lead, hidden)), "bias": b(*lead, hidden)}

    L = layers
    return {
        "embeddings": {
            "word": {"embedding": w(vocab, hidden)},
            "position": {"embedding": w(512, hidden)},
            "token_type": {"embedding": w(2, hidden)},
            "layer_norm": norm(),
        },
        "encoder": {
            "layers": {
                "attention": {
                    "query": {"kernel": w(L, hidden, hidden), "bias": b(L, hidden)},
                    "key": {"kernel": w(L, hidden, hidden), "bias": b(L, hidden)},
                    "value": {"kernel": w(L, hidden, hidden), "bias": b(L, hidden)},
                    "output": {"kernel": w(L, hidden, hidden), "bias": b(L, hidden)},
                },
                "attention_layer_norm": norm(L),
                "mlp": {
                    "intermediate": {
                        "kernel": w(L, hidden, intermediate),
                        "bias": b(L, intermediate),
                    },
                    "output": {"kernel": w(L, intermediate, hidden), "bias": b(L, hidden)},
                },
                "mlp_layer_norm": norm(L),
            }
        },
        "pooler": {"kernel": w(hidden, hidden), "bias": b(hidden)},
        "heads": {
            "mlm_transform": {"kernel": w(hidden, hidden), "bias": b(hidden)},
            "mlm_layer_norm": norm(),
            "mlm_bias": b(vocab),
            "nsp": {"kernel": w(hidden, 2), "bias": b(2)},
        },
    }


def random_like(tree, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape, dtype=np.float32) * 1e-3), tree
    )


def optimizers():
    mask = optim.bert_weight_decay_mask
    stacked = optim.stacked_layers_mask
    return {
        "optax.adamw": optax.adamw(1e-3, weight_decay=0.01, mask=mask),
        "optax.lamb": optax.lamb(1e-3, weight_decay=0.01, mask=mask),
        "lambjax.lamb (paper)": optim.lamb(
            1e-3, weight_decay=0.01, weight_decay_mask=mask, stacked_layers=stacked
        ),
        "lambjax.lamb (NVIDIA)": optim.lamb(
            1e-3,
            weight_decay=0.01,
            weight_decay_mask=mask,
            trust_ratio_mask=mask,
            max_global_norm=1.0,
            stacked_layers=stacked,
        ),
        "lambjax.lans": optim.lans(
            1e-3, weight_decay=0.01, weight_decay_mask=mask, stacked_layers=stacked
        ),
    }


def time_optimizer(tx, params, grads, steps):
    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(update, donate_argnums=(0, 1))
    params = jax.tree.map(jnp.copy, params)
    opt_state = jax.jit(tx.init)(params)  # distinct buffers, so they can be donated
    for _ in range(3):
        params, opt_state = step(params, opt_state, grads)
    jax.block_until_ready(params)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        params, opt_state = step(params, opt_state, grads)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["base", "large", "all"], default="all")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--host-memory", choices=["retain", "default"], default="retain")
    args = parser.parse_args()
    if args.host_memory == "retain":
        host_memory.retain_freed_memory()
    models = ["base", "large"] if args.model == "all" else [args.model]
    print(
        f"device: {jax.devices()[0].device_kind}, {jax.device_count()} device(s); "
        f"host memory: {args.host_memory}"
    )
    for model in models:
        params = bert_shaped_params(model)
        count = sum(x.size for x in jax.tree.leaves(params))
        grads = random_like(params, seed=1)
        results = {
            name: time_optimizer(tx, params, grads, args.steps) for name, tx in optimizers().items()
        }
        baseline = results["optax.adamw"]
        print(f"\nBERT-{model} shaped tree ({count / 1e6:.0f}M parameters)")
        print("| optimizer | median step (ms) | vs optax.adamw |")
        print("|---|---:|---:|")
        for name, seconds in results.items():
            print(f"| {name} | {seconds * 1e3:.1f} | {seconds / baseline:.2f}x |")


if __name__ == "__main__":
    main()
