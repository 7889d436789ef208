"""The optimizer's work per update by parameter layout: stacked layers, one tree per layer,
and one tree per layer updated through `optim.on_stacked_layers` (grouped).

  python benchmarks/optimizer_layout.py [--model tiny|base|large] [--steps 10]
      [--optimizers lamb,lans] [--no-time]

For each optimizer and layout, in the same run: the parameter tree's leaves, the fusions
the compiled CPU update launches (by kind: reductions, slices and the rest), and the
median time of `--steps` donated updates after warm-up. The counts do not depend on the
width, only on the depth and the tree, so `--model tiny` (BERT-large's 24 layers at width
8) counts in seconds; times need a real width. Lowered for CUDA (no GPU needed), the
StableHLO text gives the reductions (one per per-tensor norm) that the update asks for;
which kernels XLA:GPU fuses them into is only known where it compiles.
"""

import argparse
import collections
import json
import re
import statistics
import sys

import jax
import optax

from lambjax import host_memory, optim
from lambjax.models import layer_layout

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from optimizer_step import SHAPES, bert_shaped_params, random_like, time_steps  # noqa: E402

SIZES = {**SHAPES, "tiny": (24, 8, 16, 64)}
LAYOUTS = ("stacked", "per_layer", "grouped")


def make_optimizer(name: str) -> optax.GradientTransformation:
    """NVIDIA's LAMB recipe, or LANS, with BERT's masks and stacked layers."""
    mask, stacked = optim.bert_weight_decay_mask, optim.stacked_layers_mask
    if name == "lamb":
        return optim.lamb(
            1e-3,
            weight_decay=0.01,
            weight_decay_mask=mask,
            trust_ratio_mask=mask,
            max_global_norm=1.0,
            stacked_layers=stacked,
        )
    return optim.lans(
        1e-3, weight_decay=0.01, weight_decay_mask=mask, max_global_norm=1.0, stacked_layers=stacked
    )


def layout_case(tx, params, layout: str):
    """(params, optimizer) for a layout: the stacked tree, or the tree one tree per layer
    updated leaf by leaf or grouped."""
    if layout == "stacked":
        return params, tx
    per_layer = layer_layout.unstack_layers(params)
    return per_layer, optim.on_stacked_layers(tx) if layout == "grouped" else tx


def update_step(tx):
    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


def fusion_kinds(compiled_text: str) -> collections.Counter:
    """The fusions in the ENTRY computation of compiled HLO (each one kernel launched),
    by kind: `reduce` (a reduction inside), `slice` (a slice, i.e. a copy out of a stacked
    array) or `other` (elementwise and the rest)."""
    entry = compiled_text[compiled_text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    kinds = collections.Counter()
    for name in re.findall(r"^\s*(?:ROOT )?%?([\w.-]+) = [^\n]*? fusion\(", entry, re.MULTILINE):
        kind = "reduce" if "reduce" in name else "slice" if "slice" in name else "other"
        kinds[kind] += 1
    return kinds


def cuda_reductions(update, params, opt_state, grads) -> int | None:
    """The reductions (`stablehlo.reduce` and `stablehlo.dot_general`, the norms' form)
    in the update lowered for CUDA; None where this jaxlib cannot lower for it."""
    try:
        lowered = (
            jax.jit(update).trace(params, opt_state, grads).lower(lowering_platforms=("cuda",))
        )
    except Exception:  # noqa: BLE001 (no CUDA lowering rules in this jaxlib)
        return None
    text = lowered.as_text()
    return len(re.findall(r"stablehlo\.(?:reduce|dot_general)\b", text))


def measure(name: str, model: str, layout: str, steps: int) -> dict:
    params, tx = layout_case(make_optimizer(name), bert_shaped_params(model), layout)
    grads = random_like(params, seed=1)
    update = update_step(tx)
    opt_state = jax.eval_shape(tx.init, params)
    compiled = jax.jit(update, donate_argnums=(0, 1)).lower(params, opt_state, grads).compile()
    kinds = fusion_kinds(compiled.as_text())
    row = {
        "optimizer": name,
        "model": model,
        "layout": layout,
        "leaves": len(jax.tree.leaves(params)),
        "fusions": sum(kinds.values()),
        **{f"fusions_{k}": kinds[k] for k in ("reduce", "slice", "other")},
        "cuda_reductions": cuda_reductions(update, params, opt_state, grads),
    }
    if steps:
        times = time_steps(jax.jit(tx.init), compiled, params, grads, steps)
        row["median_update_ms"] = round(statistics.median(times) * 1e3, 2)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=10, help="timed updates (0: counts only)")
    parser.add_argument("--optimizers", default="lamb,lans")
    args = parser.parse_args(argv)
    names = args.optimizers.split(",")
    for name in names:
        if name not in ("lamb", "lans"):
            parser.error(f"--optimizers: {name!r} is not one of lamb, lans")
    if args.steps < 0:
        parser.error(f"--steps={args.steps}: need 0 (counts only) or more")
    SHAPES.update(SIZES)
    host_memory.retain_freed_memory()
    rows = [measure(n, args.model, layout, args.steps) for n in names for layout in LAYOUTS]
    columns = [k for k in rows[0] if k not in ("optimizer", "model")]
    print(f"device: {jax.devices()[0].device_kind}; BERT-{args.model} shaped tree")
    print("| optimizer | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for row in rows:
        print(f"| {row['optimizer']} | " + " | ".join(str(row.get(c)) for c in columns) + " |")
    for row in rows:
        print(json.dumps(row))
    return rows


if __name__ == "__main__":
    main()
