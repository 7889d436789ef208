"""The pure train and eval steps. Only the trainer jits them (with shardings and donation).

Gradient accumulation (`accumulate_gradients`): the global batch [G, ...] is split into
`grad_accum_steps` micro-batches that a `lax.scan` walks through, summing gradients. Losses
are sums over the micro-batch divided by counts over the *global* batch, so the accumulated
gradient is exactly the gradient of the global-batch loss, whatever the number of
micro-batches or devices. The update is applied once, after the scan, and only if the loss
and gradient are finite (`apply_if_finite`).

Multi-stage layerwise training (`num_frozen_layers`, lambjax.train.layerwise) is part of the
step itself: it differentiates and updates only the parameters above the frozen bottom
layers (and, with `train_decoder`, the tied MLM decoder). The other schemes a phase turns on
(progressive layer dropping, the standardization loss, the gradient noise scale, one
gradient reduction per step) plug in through named hooks (lambjax.train.schemes).

The step's settings are one `StepSettings`, built from the phase's plan in `StepSettings.of`;
what the plan sets of the step beyond its model, optimizer and batch is one `StepOptions`.
"""

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax

from lambjax import optim
from lambjax.models import pretraining
from lambjax.models.config import BertConfig
from lambjax.models.encoder import LayerOptions
from lambjax.train import layerwise
from lambjax.train import schemes as schemes_lib
from lambjax.train.layer_drop import LayerDrop
from lambjax.train.state import TrainState

if TYPE_CHECKING:  # the plan imports the config's ml_collections, which the step does not need
    from lambjax.train.plan import PhasePlan

STAT_KEYS = (
    "mlm_loss_sum",
    "mlm_weight_sum",
    "mlm_correct_sum",
    "nsp_loss_sum",
    "nsp_correct_sum",
    "nsp_count",
)


def split_microbatches(batch: dict, num_microbatches: int) -> dict:
    """[G, ...] -> [num_microbatches, G / num_microbatches, ...], interleaved.

    Micro-batch i takes rows i, i + n, i + 2n, ...: every device keeps its own rows, so the
    split needs no communication, and the micro-batches are the same sets of examples on any
    number of devices.
    """

    def split(x):
        x = x.reshape(x.shape[0] // num_microbatches, num_microbatches, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


def metrics_from_stats(stats: dict) -> dict:
    mlm_weight = jnp.maximum(stats["mlm_weight_sum"], 1e-9)
    nsp_count = jnp.maximum(stats["nsp_count"], 1)
    return {
        "mlm_loss": stats["mlm_loss_sum"] / mlm_weight,
        "mlm_accuracy": stats["mlm_correct_sum"] / mlm_weight,
        "nsp_loss": stats["nsp_loss_sum"] / nsp_count,
        "nsp_accuracy": stats["nsp_correct_sum"] / nsp_count,
    }


def accumulate_gradients(
    grad_fn: Callable, trainable, batch: dict, rng: jax.Array, grad_accum_steps: int, stat_keys
):
    """(Summed gradients, summed statistics) of `grad_fn(trainable, microbatch, rng)` over
    the micro-batches of `batch`; micro-batch i draws its randomness from fold_in(rng, i)."""
    if grad_accum_steps == 1:
        return grad_fn(trainable, batch, jax.random.fold_in(rng, 0))

    def accumulate(carry, xs):
        microbatch, index = xs
        grads, stats = grad_fn(trainable, microbatch, jax.random.fold_in(rng, index))
        return jax.tree.map(jnp.add, carry, (grads, stats)), None

    zeros = jax.tree.map(
        jnp.zeros_like, (trainable, {k: jnp.zeros((), jnp.float32) for k in stat_keys})
    )
    xs = (split_microbatches(batch, grad_accum_steps), jnp.arange(grad_accum_steps))
    (grads, stats), _ = jax.lax.scan(accumulate, zeros, xs)
    return grads, stats


def apply_if_finite(
    state: TrainState,
    grads,
    loss: jax.Array,
    optimizer: optax.GradientTransformation,
    num_frozen_layers: int,
    train_decoder: bool = False,
) -> tuple[TrainState, dict]:
    """The optimizer update, or none at all where the loss or the gradient is not finite.

    A skipped step leaves parameters and optimizer state untouched and counts in
    `consecutive_nonfinite` / `total_nonfinite`. Returns the new state and its metrics:
    `grad_norm` (of `grads`, the gradient the optimizer is given, before any clipping),
    the norms of `update_norms` (the update's is 0 on a skipped step) and `nonfinite`.
    """
    trainable, frozen = layerwise.split(
        state.params, num_frozen_layers, train_decoder=train_decoder
    )
    # The finiteness test needs the gradient's norm before the update. The optimizer is
    # given it (lambjax's clip_by_global_norm uses it instead of computing it again).
    # Testing after the update and selecting the old or new state instead, to take the
    # norm from the update, makes XLA copy the moments (docs/performance.md).
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    update = optax.with_extra_args_support(optimizer).update

    def apply_update(_):
        updates, opt_state = update(grads, state.opt_state, trainable, grad_norm=grad_norm)
        params = layerwise.merge(optax.apply_updates(trainable, updates), frozen)
        return params, opt_state, update_norms(trainable, updates, opt_state)

    def skip_update(_):
        norms = {"param_norm": optax.global_norm(trainable), "update_norm": jnp.float32(0.0)}
        return state.params, state.opt_state, norms

    # A cond, not a select: only the taken branch runs, so a normal step costs no extra pass.
    params, opt_state, norms = jax.lax.cond(finite, apply_update, skip_update, None)
    if frozen is not None:
        norms["param_norm"] = jnp.hypot(norms["param_norm"], optax.global_norm(frozen))
    new_state = state.replace(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        consecutive_nonfinite=jnp.where(finite, 0, state.consecutive_nonfinite + 1),
        total_nonfinite=state.total_nonfinite + (~finite).astype(jnp.int32),
    )
    metrics = {"grad_norm": grad_norm, **norms, "nonfinite": (~finite).astype(jnp.float32)}
    return new_state, metrics


def update_norms(trainable, updates, opt_state) -> dict:
    """`param_norm` (of the trainable parameters before the update) and `update_norm` (of
    `updates`): the norms the optimizer measured on its way where it did (`optim.last_norms`:
    LAMB and LANS compute per-tensor norms for their trust ratios), one pass over the
    tensors each otherwise (AdamW: both; LANS: the update's).
    """
    norms = optim.last_norms(opt_state)
    if "param_norm" not in norms:
        norms["param_norm"] = optax.global_norm(trainable)
    if "update_norm" not in norms:
        norms["update_norm"] = optax.global_norm(updates)
    return norms


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What a phase's plan sets of the core train step besides its model, optimizer, schedule
    and accumulation (`PhasePlan.step`): the objective's terms and the layer schemes.

    `from_config` reads them from the config while the plan is resolved (lambjax.train.plan),
    and the step reads them here: a new option is its config default (lambjax.train.config),
    its field and read below, and its use in `train_step`."""

    nsp_loss_weight: float = 1.0  # 0 without next-sentence prediction
    # Bottom layers not trained (a stage of MSLT, lambjax.train.layerwise); with frozen
    # layers, `train_decoder` trains the tied MLM decoder through the output projection.
    num_frozen_layers: int = 0
    train_decoder: bool = False
    layer_drop: LayerDrop | None = None  # progressive layer dropping (lambjax.train.layer_drop)
    # lambda of the standardization loss (0: off) and its site (lambjax.models.standardization).
    standardization_loss_weight: float = 0.0
    standardization_loss_site: str = "residual"
    # each_microbatch: XLA all-reduces each micro-batch's gradient inside the loop; once: each
    # data shard accumulates unreduced and one sum follows the loop (lambjax.train.reduction).
    gradient_reduction: str = "each_microbatch"
    # Per-step decay of the gradient noise scale's averages (lambjax.train.noise_scale), whose
    # per-step estimates the step then logs; None: off.
    noise_scale_ema_decay: float | None = None

    @classmethod
    def from_config(cls, config, phase_name: str, step_offset: int) -> "StepOptions":
        """The options of phase `phase_name`, whose first step is the run's `step_offset`;
        each field's own check lives with its feature (lambjax.train.plan lists them)."""
        phase, drop = config.phases[phase_name], config.layer_drop
        return cls(
            nsp_loss_weight=1.0 if config.data.next_sentence_prediction else 0.0,
            num_frozen_layers=phase.frozen_layers,
            train_decoder=phase.train_decoder,
            layer_drop=(
                LayerDrop(
                    drop.theta_bar, drop.gamma, step_offset=step_offset, depth_rule=drop.depth_rule
                )
                if drop.enabled
                else None
            ),
            standardization_loss_weight=config.standardization_loss.weight,
            standardization_loss_site=config.standardization_loss.site,
            gradient_reduction=config.gradient_reduction,
            noise_scale_ema_decay=(
                config.noise_scale.ema_decay if config.noise_scale.enabled else None
            ),
        )


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """Everything the core train step takes but its (state, batch, rng)."""

    model_config: BertConfig
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    grad_accum_steps: int
    options: StepOptions = StepOptions()
    # The phase's mesh, over whose axis `data` a gradient reduced `once` is summed.
    mesh: jax.sharding.Mesh | None = None
    # The layer stack's options the step starts from (a step method's matmuls, e.g.); the
    # frozen layers, the standardization site and PLD's draws are set on top of them.
    layer_options: LayerOptions = LayerOptions()

    @classmethod
    def of(
        cls,
        plan: "PhasePlan",
        optimizer: optax.GradientTransformation,
        schedule: optax.Schedule,
        mesh: jax.sharding.Mesh,
    ) -> "StepSettings":
        """The settings of the phase `plan`, with the optimizer, schedule and mesh built from
        it (lambjax.train.phases)."""
        return cls(plan.model, optimizer, schedule, plan.batch.grad_accum_steps, plan.step, mesh)


def train_step(
    state: TrainState, batch: dict, rng: jax.Array, *, settings: StepSettings
) -> tuple[TrainState, dict]:
    """One optimizer step on one global batch. Returns the new state and scalar metrics.

    The plain algorithm: each micro-batch's loss and gradient, summed over the micro-batches,
    then the update where they are finite. The schemes the phase turns on
    (lambjax.train.schemes) plug in at their named hooks."""
    model_config, grad_accum_steps, options = (
        settings.model_config,
        settings.grad_accum_steps,
        settings.options,
    )
    schemes = schemes_lib.of(
        options,
        num_layers=model_config.num_layers,
        grad_accum_steps=grad_accum_steps,
        mesh=settings.mesh,
        sum_keys=STAT_KEYS,
    )
    mlm_total = jnp.maximum(jnp.sum(batch["masked_lm_weights"].astype(jnp.float32)), 1e-9)
    nsp_total = jnp.maximum(jnp.sum(pretraining.nsp_example_weights(batch)), 1.0)
    step_rng = jax.random.fold_in(rng, state.step)
    trainable, frozen = layerwise.split(
        state.params, options.num_frozen_layers, train_decoder=options.train_decoder
    )
    base_options = dataclasses.replace(
        settings.layer_options,
        num_frozen_layers=options.num_frozen_layers,
        standardization_site=None,
    )

    def loss_fn(trainable, microbatch, microbatch_rng):
        layer_options, dropout_rng = base_options, microbatch_rng
        for scheme in schemes:
            layer_options = scheme.layer_options(layer_options, microbatch_rng, state.step)
            dropout_rng = scheme.dropout_key(dropout_rng)
        stats = pretraining.pretraining_stats(
            model_config,
            layerwise.merge(trainable, frozen),
            microbatch,
            dropout_rng=dropout_rng,
            options=layer_options,
        )
        loss = stats["mlm_loss_sum"] / mlm_total + options.nsp_loss_weight * (
            stats["nsp_loss_sum"] / nsp_total
        )
        for scheme in schemes:
            loss, stats = scheme.microbatch(loss, stats, layer_options)
        return loss, stats

    grad_fn = jax.grad(loss_fn, has_aux=True)
    stat_keys = STAT_KEYS
    for scheme in schemes:
        grad_fn, stat_keys = scheme.grad_fn(grad_fn), stat_keys + scheme.stat_keys

    def accumulate(trainable, batch, rng):
        return accumulate_gradients(grad_fn, trainable, batch, rng, grad_accum_steps, stat_keys)

    for scheme in schemes:
        accumulate = scheme.accumulate(accumulate)
    grads, stats = accumulate(trainable, batch, step_rng)
    metrics = metrics_from_stats(stats)
    loss = metrics["mlm_loss"] + options.nsp_loss_weight * metrics["nsp_loss"]
    objective = loss
    for scheme in schemes:
        objective, metrics = scheme.objective(objective, metrics, stats)
    new_state, update_metrics = apply_if_finite(
        state,
        grads,
        objective,
        settings.optimizer,
        options.num_frozen_layers,
        options.train_decoder,
    )
    metrics = train_metrics(
        metrics, loss, state, new_state, update_metrics, schedule=settings.schedule
    )
    for scheme in schemes:
        metrics.update(scheme.metrics(state.step, stats, update_metrics, batch))
    return new_state, metrics


def train_metrics(
    metrics: dict,
    loss: jax.Array,
    state: TrainState,
    new_state: TrainState,
    update_metrics: dict,
    *,
    schedule: optax.Schedule,
) -> dict:
    """`metrics` (from `metrics_from_stats`) and what every train step logs beside them: the
    loss, the learning rate of `state`, the update's metrics (`apply_if_finite`: the norms)
    and the trust ratios of the update to `new_state`."""
    return {
        **metrics,
        "loss": loss,
        "learning_rate": schedule(state.step),
        **update_metrics,
        **trust_ratio_metrics(new_state.opt_state),
    }


def trust_ratio_metrics(opt_state) -> dict:
    """Min / mean / max of the per-tensor (per-layer) trust ratios of the last update."""
    ratios = optim.last_trust_ratios(opt_state)
    metrics = {}
    for name, values in ratios.items():
        flat = jnp.concatenate([jnp.ravel(v) for v in jax.tree.leaves(values)])
        metrics[f"{name}_min"] = jnp.min(flat)
        metrics[f"{name}_mean"] = jnp.mean(flat)
        metrics[f"{name}_max"] = jnp.max(flat)
    return metrics


def eval_step(
    params, batch: dict, *, model_config: BertConfig, layer_options: LayerOptions | None = None
) -> dict:
    """Sums of the MLM/NSP statistics over one batch (no dropout); callers add them up.
    `layer_options`: the train step's base options (`StepSettings.layer_options`; None: the
    defaults)."""
    return pretraining.pretraining_stats(model_config, params, batch, options=layer_options)
