"""Ouroboros' train step: delayed gradients through K modules on K - 1 stages.

Module k (1 = bottom, K = top) is updated at step t with the gradient of the batch of step
t - (K - k), taken at the weights of that step (`replay='stale'`), or at the current weights
(`replay='current'`, Features Replay). The model's split and each stage's computations are in
lambjax.contrib.ouroboros.stages; this module applies the update.

The gradients go through the recipe's optimizer unchanged; a module without a gradient yet
(module k in a phase's first K - k delayed steps) keeps its weights and moments.

The stages' computations on the mesh, and the layout of what they carry from one step to the
next, are in lambjax.contrib.ouroboros.delayed; this module creates those buffers empty
(`init_buffers`, `buffer_shardings`) and records each step's weights for the stale replays.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lambjax.contrib.ouroboros import delayed
from lambjax.contrib.ouroboros import stages as stages_lib
from lambjax.models.config import BertConfig
from lambjax.train import step as step_lib
from lambjax.train.state import TrainState

REPLAYS = ("stale", "current")


@dataclasses.dataclass(frozen=True)
class OuroborosStep:
    """The settings of an Ouroboros step: everything but its (state, batch, rng)."""

    split: stages_lib.Split
    mesh: jax.sharding.Mesh  # data x stage, stage = split.stages
    model_config: BertConfig
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    grad_accum_steps: int
    replay: str = "stale"  # one of REPLAYS
    nsp_loss_weight: float = 1.0
    # Steps of ordinary backpropagation at the start of a phase, before the buffers fill.
    synchronous_steps: int = 0

    def __post_init__(self):
        if self.replay not in REPLAYS:
            raise ValueError(f"replay={self.replay!r}; valid: {REPLAYS}")
        stages = self.mesh.shape.get("stage", 1)
        if stages != self.split.stages:
            raise ValueError(
                f"{self.split.num_modules} modules run on a mesh with stage="
                f"{self.split.stages}, but the mesh has stage={stages}"
            )

    @property
    def model(self) -> stages_lib.StageModel:
        return stages_lib.StageModel(self.model_config, self.split, self.nsp_loss_weight)


# ----------------------------------------------------------------------------------------
# The state carried between steps


def init_buffers(
    split: stages_lib.Split, params, *, global_batch_size: int, seq_len: int, dtype, replay
):
    """Empty buffers (module k's first K - k steps have no gradient yet)."""
    stages = slots = split.stages
    hidden = params["embeddings"]["word"]["embedding"].shape[1]
    rows = (stages, slots, global_batch_size, seq_len)
    buffers = {
        "tokens": {k: jnp.zeros(rows, jnp.int32) for k in delayed.TOKEN_KEYS},
        "hidden": jnp.zeros(rows + (hidden,), dtype),
        "mailbox": jnp.zeros((stages, global_batch_size, seq_len, hidden), dtype),
    }
    if replay == "stale":
        buffers["weights"] = jax.tree.map(
            lambda x: jnp.zeros((slots,) + x.shape, x.dtype), _replayed(params)
        )
    return buffers


def _replayed(params) -> dict:
    """The parameters a replay reads: the embeddings and the encoder layers."""
    return {"embeddings": params["embeddings"], "layers": params["encoder"]["layers"]}


def buffer_shardings(abstract_buffers, param_shardings, mesh):
    """Buffers split over stage x data; the weight history like the parameters it copies."""
    rows = NamedSharding(mesh, P("stage", None, "data"))
    shardings = {
        "tokens": {k: rows for k in delayed.TOKEN_KEYS},
        "hidden": rows,
        "mailbox": NamedSharding(mesh, P("stage", "data")),
    }
    if "weights" in abstract_buffers:
        shardings["weights"] = jax.tree.map(
            lambda s: NamedSharding(mesh, P(None, *s.spec)), _replayed(param_shardings)
        )
    return shardings


# ----------------------------------------------------------------------------------------
# The step and the update rule


def train_step(
    state: TrainState, batch: dict, rng: jax.Array, *, settings: OuroborosStep
) -> tuple[TrainState, dict]:
    """One Ouroboros iteration: the delayed gradients, then the update of every module that
    has one. The counterpart of lambjax.train.step.train_step (the same metrics, and
    `ouroboros_modules_updated`).

    The first `settings.synchronous_steps` steps of a phase are ordinary backpropagation (a
    warm-up; the buffers then fill from empty), the rest delayed."""
    if not settings.synchronous_steps:
        return _delayed_step(state, batch, rng, state.step, settings)

    def delayed(state, batch, rng):  # its own dropout keys: not those of the warm-up steps
        delayed_rng = jax.random.fold_in(rng, _DELAYED_STREAM)
        iteration = state.step - settings.synchronous_steps
        return _delayed_step(state, batch, delayed_rng, iteration, settings)

    synchronous = functools.partial(_synchronous_step, settings=settings)
    warming_up = state.step < settings.synchronous_steps
    return jax.lax.cond(warming_up, synchronous, delayed, state, batch, rng)


# fold_in constant of the delayed steps' keys after a synchronous warm-up.
_DELAYED_STREAM = 0x4F5552


def _synchronous_step(state, batch, rng, *, settings: OuroborosStep):
    """A step of ordinary backpropagation (lambjax.train.step), every module updated."""
    core_settings = step_lib.StepSettings(
        model_config=settings.model_config,
        optimizer=settings.optimizer,
        schedule=settings.schedule,
        grad_accum_steps=settings.grad_accum_steps,
        options=step_lib.StepOptions(nsp_loss_weight=settings.nsp_loss_weight),
    )
    new_state, metrics = step_lib.train_step(state, batch, rng, settings=core_settings)
    metrics["ouroboros_modules_updated"] = jnp.float32(settings.split.num_modules)
    return new_state, metrics


def _delayed_step(state, batch, rng, iteration, settings: OuroborosStep):
    """The delayed step; `iteration` counts the steps since the buffers started filling."""
    split, optimizer = settings.split, settings.optimizer
    grads, stats, buffers = delayed.delayed_gradients(
        state.params, state.method_state, batch, rng, iteration, settings=settings
    )
    metrics = step_lib.metrics_from_stats(stats)
    loss = metrics["mlm_loss"] + settings.nsp_loss_weight * metrics["nsp_loss"]
    active = active_modules(split, iteration, state.params)
    updated, update_metrics = step_lib.apply_if_finite(state, grads, loss, optimizer, 0)
    params = jax.tree.map(_select, active, updated.params, state.params)
    opt_state = _select_optimizer_state(optimizer, active, updated.opt_state, state.opt_state)
    if "weights" in buffers:  # this step's weights, for the replays of the next D steps
        slot = iteration % split.stages
        buffers["weights"] = jax.tree.map(
            lambda history, w: jax.lax.dynamic_update_index_in_dim(history, w, slot, 0),
            buffers["weights"],
            _replayed(state.params),
        )
    new_state = updated.replace(params=params, opt_state=opt_state, method_state=buffers)
    update_metrics["update_norm"] = optax.global_norm(
        jax.tree.map(jnp.subtract, params, state.params)
    )
    metrics = step_lib.train_metrics(
        metrics, loss, state, new_state, update_metrics, schedule=settings.schedule
    )
    delays = jnp.arange(split.num_modules)  # module K - d has delay d
    metrics["ouroboros_modules_updated"] = jnp.sum(iteration >= delays).astype(jnp.float32)
    return new_state, metrics


def active_modules(split: stages_lib.Split, step: jax.Array, params):
    """A tree like `params`: whether each leaf (each layer, for the stacked layers) has a
    gradient at `step`. Module k has one from step K - k on."""
    layers = step >= jnp.asarray(split.layer_delays())
    first = step >= split.num_modules - 1
    active = jax.tree.map(lambda _: jnp.bool_(True), params)  # module K's and the heads
    active["embeddings"] = jax.tree.map(lambda _: first, params["embeddings"])
    active["embeddings"]["word"] = jax.tree.map(
        lambda _: jnp.bool_(True), active["embeddings"]["word"]
    )
    active["encoder"]["layers"] = jax.tree.map(lambda _: layers, params["encoder"]["layers"])
    return active


def _select(active, new, old):
    """`new` where active (per leading index for a per-layer flag), else `old`."""
    active = active.reshape(active.shape + (1,) * (new.ndim - active.ndim))
    return jnp.where(active, new, old)


def _select_optimizer_state(optimizer, active, new, old):
    """The new optimizer state, but the old moments of modules without a gradient yet."""
    flags = optax.tree_map_params(
        optimizer,
        lambda _, flag: flag,
        new,
        active,
        transform_non_params=lambda _: jnp.bool_(True),
    )
    return jax.tree.map(_select, flags, new, old)
