"""Optimizer step time on BERT-shaped parameter trees, as ratios to optax.adamw.

  python benchmarks/optimizer_step.py [--model base|large|all] [--steps 20]
      [--host-memory retain|default]

Each optimizer update (with apply_updates) is jitted with the parameters and state donated,
as in a train step, and timed on random gradients; the median of `--steps` timed steps
after warm-up is reported. All optimizers are measured in the same run, one after another.
(Taking turns, each turn from a fresh state, was tried: with freed memory retained, the
heap of five BERT-large optimizers outgrew 24 GB and the process was killed.)

Next to the time, the memory traffic of the compiled step (XLA's cost analysis: bytes read
and written, in parameter-sized passes). The update is memory-bound, so its time should
follow its traffic; "time / traffic" compares the two ratios to adamw (1.00 = the extra
time is all extra traffic).

On CPU, malloc keeps freed memory as `lambjax.main` sets it (lambjax.host_memory);
`--host-memory=default` leaves glibc's defaults, under which every fresh temporary (a trust
ratio's update) is faulted in again at every step.
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


def compile_step(tx, params, grads):
    """The jitted update + apply_updates, compiled, and its memory traffic in bytes."""

    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = jax.eval_shape(tx.init, params)
    compiled = jax.jit(update, donate_argnums=(0, 1)).lower(params, opt_state, grads).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list of one in older jax
    return compiled, cost["bytes accessed"]


def time_steps(init, step, params, grads, steps):
    """Seconds per step for `steps` steps, from a fresh state after a warm-up."""
    params = jax.tree.map(jnp.copy, params)  # distinct buffers, so they can be donated
    opt_state = init(params)
    for _ in range(3):
        params, opt_state = step(params, opt_state, grads)
    jax.block_until_ready(params)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        params, opt_state = step(params, opt_state, grads)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - start)
    return times


def measure(params, grads, steps):
    """{name: (median seconds per step, bytes accessed per step)} for every optimizer."""
    results = {}
    for name, tx in optimizers().items():
        step, accessed = compile_step(tx, params, grads)
        times = time_steps(jax.jit(tx.init), step, params, grads, steps)
        results[name] = (statistics.median(times), accessed)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["base", "large", "all"], default="all")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per optimizer")
    parser.add_argument("--host-memory", choices=["retain", "default"], default="retain")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps={args.steps}: need at least 1 timed step")
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
        param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        results = measure(params, grads, args.steps)
        base_seconds, base_bytes = results["optax.adamw"]
        print(f"\nBERT-{model} shaped tree ({count / 1e6:.0f}M parameters)")
        print(
            "| optimizer | median step (ms) | vs optax.adamw | traffic (parameter passes) "
            "| traffic vs adamw | time / traffic |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for name, (seconds, accessed) in results.items():
            time_ratio, traffic_ratio = seconds / base_seconds, accessed / base_bytes
            print(
                f"| {name} | {seconds * 1e3:.1f} | {time_ratio:.2f}x | "
                f"{accessed / param_bytes:.1f} | {traffic_ratio:.2f}x | "
                f"{time_ratio / traffic_ratio:.2f} |"
            )


if __name__ == "__main__":
    main()
