"""Where the data-parallel sum of the gradient happens: after every micro-batch, or once.

`config.gradient_reduction`:

  each_microbatch  (the default) the train step is one SPMD program that XLA partitions
                   (GSPMD). The gradient of a replicated parameter is a sum over the batch,
                   which is sharded, so XLA all-reduces it where it is computed: inside the
                   micro-batch loop, layer by layer in the backward pass. With A
                   micro-batches a step all-reduces A times the gradient's bytes. Every
                   sharding of the batch draws the same dropout masks.
  once             the micro-batch loop runs per data shard (`shard_map`, manual over the
                   mesh axis `data` only; fsdp and tensor stay XLA's): each shard sums its
                   rows' gradients unreduced and one `psum` over `data` after the loop
                   reduces them, the gradient's bytes once per step, as Lin, Li and
                   Pekhimenko (2020) count accumulation's saving. Each data shard draws
                   its own dropout masks (fold_in of its index, as Ouroboros does), so runs
                   on different data-axis sizes agree only without dropout; on one data
                   shard the two forms are the same program's numbers. Nothing overlaps
                   the one reduction with the backward pass.

With mesh fsdp > 1 a micro-batch's gradient is still reduce-scattered over fsdp inside the
loop in both forms: a sharded parameter's gradient is kept sharded (ZeRO's memory), so only
the data axis can carry an unreduced sum. studies/gradient_reduction/README.md measures both.
"""

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

REDUCTIONS = ("each_microbatch", "once")
DATA_AXIS = "data"


def check(reduction: str, phases) -> None:
    """`config.gradient_reduction` against the run's phase plans."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"config.gradient_reduction={reduction!r}; valid: {', '.join(REDUCTIONS)}")
    if reduction != "once":
        return
    for phase in phases:
        if phase.step_method is not None:
            raise ValueError(
                "config.gradient_reduction='once' is for the core train step; the step method "
                f"{type(phase.step_method).__name__} (config.step_method) runs its own: set "
                "gradient_reduction='each_microbatch'"
            )
        if phase.mesh["fsdp"] > 1 and phase.mesh["tensor"] > 1:
            # XLA (jax 0.10.2) aborts the process partitioning the embedding lookup there.
            raise ValueError(
                f"config.gradient_reduction='once' with mesh fsdp={phase.mesh['fsdp']} and "
                f"tensor={phase.mesh['tensor']} (phase {phase.name!r}) does not compile; valid "
                "with fsdp or tensor at 1, else gradient_reduction='each_microbatch'"
            )
        if phase.step.standardization_loss_weight > 0:
            raise ValueError(
                "config.gradient_reduction='once' computes each micro-batch's statistics per "
                "data shard, and the standardization loss "
                f"(weight {phase.step.standardization_loss_weight}) needs them over the whole "
                "micro-batch: set gradient_reduction='each_microbatch'"
            )


def reduce_once(
    accumulate: Callable, mesh: jax.sharding.Mesh, sum_keys: tuple[str, ...]
) -> Callable:
    """`accumulate(trainable, batch, rng) -> (grads, stats)` run per data shard on this
    shard's rows, its sums reduced once over the mesh axis `data`.

    `stats` entries named in `sum_keys` are sums over rows (summed over the shards); the
    others are the same on every shard (e.g. layers run under PLD, drawn from the shared
    key) and are taken from the shards' mean.
    """

    def per_shard(trainable, batch, rng):
        grads, stats = accumulate(trainable, batch, rng)
        grads = jax.lax.psum(grads, DATA_AXIS)
        stats = {
            key: (jax.lax.psum if key in sum_keys else jax.lax.pmean)(value, DATA_AXIS)
            for key, value in stats.items()
        }
        return grads, stats

    if mesh.shape[DATA_AXIS] == 1:  # nothing to sum over: the step as it is
        return accumulate
    return jax.shard_map(
        per_shard,
        mesh=mesh,
        in_specs=(P(), P(DATA_AXIS), P()),
        out_specs=(P(), P()),
        axis_names={DATA_AXIS},
        check_vma=False,
    )


def shard_dropout_key(rng: jax.Array, mesh: jax.sharding.Mesh | None) -> jax.Array:
    """The dropout key of this data shard inside `reduce_once` (each shard its own masks);
    `rng` itself outside it, or on one data shard."""
    if mesh is None or mesh.shape[DATA_AXIS] == 1:
        return rng
    return jax.random.fold_in(rng, jax.lax.axis_index(DATA_AXIS))
