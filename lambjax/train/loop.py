"""The run loop that pretraining and fine-tuning share: compile once, iterate, log, evaluate,
save, stop on request.

A job (a pretraining phase in lambjax.train.trainer, a fine-tuning run in
lambjax.finetune.loop) supplies its step, its data and its metrics through `Job`;
`compile_steps` is the one place lambjax calls `jax.jit` on a step, and `run_job` drives the
iterations:

  every step     the job's batch, the compiled train step
  log interval   the means of the metrics since the last log (one device-to-host transfer)
  eval interval  the job's evaluation (and after the last step, where the job asks for it)
  checkpoint     at its interval, after the last step, and where the job says one is due
                 (pretraining: by wall time)
  stop request   (SIGTERM, a pod's preemption notice): save at the step boundary and return
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from lambjax import sharding


def _same(state):
    return state


class CompiledSteps(NamedTuple):
    init_state: Callable | None  # rng -> state at rest (pretraining's fresh start)
    init_optimizer: Callable  # params -> optimizer state at rest
    train: Callable  # (state, batch, rng) -> (state, metrics); the state is donated
    eval: Callable  # (params, batch) -> the job's evaluation outputs, replicated
    to_running: Callable = _same  # state at rest (initialised, restored) -> the train step's
    to_rest: Callable = _same  # the train step's state -> as it is saved


class StateLayout(NamedTuple):
    """A state that rests (is initialised, saved, restored) in another layout than the
    steps take it (lambjax.train.layout)."""

    rest_shardings: Any
    to_running: Callable
    to_rest: Callable


def _under_mesh(mesh: jax.sharding.Mesh, step: Callable) -> Callable:
    """`step` called, and so traced, with `mesh` as JAX's context mesh: the fused attention
    kernels read it to run per shard (lambjax.models.attention.partitioned)."""

    def call(*args):
        with jax.set_mesh(mesh):
            return step(*args)

    return call


def compile_steps(
    mesh: jax.sharding.Mesh,
    state_shardings,
    *,
    train_step: Callable,
    eval_step: Callable,
    init_optimizer: Callable,
    init_state: Callable | None = None,
    layout: StateLayout | None = None,
) -> CompiledSteps:
    """A job's pure functions, jitted with the shardings of its state and batches;
    `state_shardings` those of the state the steps take."""
    batch = sharding.batch_sharding(mesh)
    replicated = sharding.replicated(mesh)
    rest = state_shardings if layout is None else layout.rest_shardings
    conversions = {}
    if layout is not None:
        # Each in its own jit: fused into the initialisation, the unstacking took XLA:GPU
        # minutes to compile at BERT-large (docs/performance.md), apart about a second.
        conversions = dict(
            to_running=jax.jit(layout.to_running, out_shardings=state_shardings),
            to_rest=jax.jit(layout.to_rest, out_shardings=rest),
        )
    return CompiledSteps(
        init_state=(jax.jit(init_state, out_shardings=rest) if init_state is not None else None),
        init_optimizer=jax.jit(init_optimizer, out_shardings=rest.opt_state),
        train=_under_mesh(
            mesh,
            jax.jit(
                train_step,
                in_shardings=(state_shardings, batch, replicated),
                out_shardings=(state_shardings, replicated),
                donate_argnums=(0,),
            ),
        ),
        eval=_under_mesh(
            mesh,
            jax.jit(
                eval_step, in_shardings=(state_shardings.params, batch), out_shardings=replicated
            ),
        ),
        **conversions,
    )


@dataclasses.dataclass(frozen=True)
class Intervals:
    log_every_steps: int
    eval_every_steps: int  # 0: no evaluation during training
    checkpoint_every_steps: int
    eval_after_last_step: bool  # False: the job scores its final state itself


class Job(Protocol):
    """What a job supplies to `run_job`."""

    num_steps: int
    intervals: Intervals
    steps: CompiledSteps
    rng: jax.Array  # the train step derives each step's keys from it and the state's step

    def batch(self, step: int) -> dict:
        """The global batch of the (0-based) step about to run."""

    def log(self, step: int, state, means: dict[str, float]) -> None:
        """Writes and prints the means of the train metrics since the last log."""

    def evaluate(self, step: int, state) -> bool | None:
        """Evaluates; True ends the job after a save (e.g. its target metric reached)."""

    def save(self, step: int, state) -> None: ...

    def save_due(self, step: int) -> bool:
        """Whether to save after `step` beyond the checkpoint interval (the same answer on
        every process)."""


def run_job(job: Job, state, step: int, stop, hooks=()) -> tuple[object, int, bool]:
    """Trains from `step` to the job's last step, or to an evaluation that ends the job:
    (state, step, whether a stop was asked)."""
    intervals, pending = job.intervals, []
    while step < job.num_steps:
        if stop.requested(step):
            job.save(step, state)
            return state, step, True
        state, metrics = job.steps.train(state, job.batch(step), job.rng)
        step += 1
        pending.append(metrics)
        for hook in hooks:
            hook(step)
        last = step == job.num_steps
        if step % intervals.log_every_steps == 0 or last:
            job.log(step, state, mean_metrics(pending))
            pending = []
        every = intervals.eval_every_steps
        if (every and step % every == 0 and not last) or (last and intervals.eval_after_last_step):
            if job.evaluate(step, state):  # the job ends here (its target reached)
                job.save(step, state)
                return state, step, False
        if step % intervals.checkpoint_every_steps == 0 or last or job.save_due(step):
            job.save(step, state)
    return state, step, False


def mean_metrics(pending: list[dict]) -> dict[str, float]:
    """The means of a list of metric dicts of device scalars, in one transfer."""
    stacked = jax.device_get(jax.tree.map(lambda *xs: jnp.stack(xs), *pending))
    return {k: float(np.mean(v)) for k, v in stacked.items()}


def to_global(local_batch: dict, batch_sharding) -> dict:
    """This process's rows of a global batch -> global arrays sharded over data x fsdp."""
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(batch_sharding, x), local_batch
    )
