"""The schemes that plug into the core train step (lambjax.train.step), each through the
same named hooks, so that `train_step` reads as the plain algorithm.

A scheme is on where its `StepOptions` field turns it on (`of`, in the order below); its
mathematics lives in its feature's module, and each class here only says where the step
calls into it:

  layer_options(options, rng, step)   the layer stack's options for one micro-batch
  microbatch(loss, stats, options)    a micro-batch's loss and statistics, after the forward
  grad_fn(grad_fn)                    wraps a micro-batch's gradient function
  accumulate(accumulate)              wraps the loop over the micro-batches
  dropout_key(rng)                    a micro-batch's dropout key
  objective(objective, metrics, stats)  the step's objective, after the loop
  metrics(step, stats, update_metrics, batch)  what the step logs besides the core metrics

`stat_keys` names the statistics a scheme adds to each micro-batch's (summed by the loop).
Multi-stage layerwise training's frozen layers are not a scheme: which parameters train is
part of the core step (lambjax.train.layerwise.split), as is the gradient it is given.
"""

import dataclasses

import jax
import jax.numpy as jnp

from lambjax.models.encoder import LayerOptions
from lambjax.train import noise_scale, reduction
from lambjax.train.layer_drop import LayerDrop


class Scheme:
    """The hooks, each changing nothing: a scheme overrides those it needs."""

    stat_keys: tuple[str, ...] = ()

    def layer_options(self, options: LayerOptions, rng: jax.Array, step) -> LayerOptions:
        return options

    def microbatch(self, loss, stats: dict, options: LayerOptions):
        return loss, stats

    def grad_fn(self, grad_fn):
        return grad_fn

    def accumulate(self, accumulate):
        return accumulate

    def dropout_key(self, rng: jax.Array) -> jax.Array:
        return rng

    def objective(self, objective, metrics: dict, stats: dict):
        return objective, metrics

    def metrics(self, step, stats: dict, update_metrics: dict, batch: dict) -> dict:
        return {}


# fold_in constant separating PLD's draws from the dropout keys of the same micro-batch.
_LAYER_DROP_STREAM = 0x504C44


@dataclasses.dataclass(frozen=True)
class LayerDropping(Scheme):
    """Progressive layer dropping (lambjax.train.layer_drop): each micro-batch draws which
    layers run, from its own stream (the dropout keys stay those of the baseline)."""

    schedule: LayerDrop
    num_layers: int
    grad_accum_steps: int
    stat_keys = ("layers_run_sum",)

    def layer_options(self, options, rng, step):
        pld_rng = jax.random.fold_in(rng, _LAYER_DROP_STREAM)
        keep, scale = self.schedule.sample(pld_rng, step, self.num_layers)
        return dataclasses.replace(options, keep=keep, scale=scale)

    def microbatch(self, loss, stats, options):
        return loss, {**stats, "layers_run_sum": jnp.sum(options.keep.astype(jnp.float32))}

    def metrics(self, step, stats, update_metrics, batch):
        return {
            "pld_theta": self.schedule.theta(step),
            "pld_layers_run": stats["layers_run_sum"] / self.grad_accum_steps,
        }


@dataclasses.dataclass(frozen=True)
class StandardizationLoss(Scheme):
    """lambda x L_std at its site (lambjax.models.standardization) joins the objective; it is
    logged as `standardization_loss` (unweighted), and `loss` stays the MLM + NSP loss."""

    weight: float
    site: str
    grad_accum_steps: int
    stat_keys = ("standardization_loss",)

    def layer_options(self, options, rng, step):
        return dataclasses.replace(options, standardization_site=self.site)

    def microbatch(self, loss, stats, options):
        loss += self.weight * stats["standardization_loss"] / self.grad_accum_steps
        return loss, stats

    def objective(self, objective, metrics, stats):
        standardization_loss = stats["standardization_loss"] / self.grad_accum_steps
        metrics = {**metrics, "standardization_loss": standardization_loss}
        return objective + self.weight * standardization_loss, metrics


@dataclasses.dataclass(frozen=True)
class NoiseScale(Scheme):
    """The gradient noise scale's per-step estimates (lambjax.train.noise_scale), from each
    micro-batch's squared gradient norm."""

    grad_accum_steps: int
    stat_keys = (noise_scale.MICROBATCH_SQ_NORM,)

    def grad_fn(self, grad_fn):
        return noise_scale.with_sq_norm(grad_fn)

    def metrics(self, step, stats, update_metrics, batch):
        global_batch = batch["masked_lm_weights"].shape[0]
        grad_norm = update_metrics["grad_norm"]
        return noise_scale.step_estimates(stats, grad_norm, global_batch, self.grad_accum_steps)


@dataclasses.dataclass(frozen=True)
class ReduceOnce(Scheme):
    """One data-parallel sum of the gradient per step (lambjax.train.reduction): the loop runs
    per data shard, each with its own dropout keys."""

    mesh: jax.sharding.Mesh
    sum_keys: tuple[str, ...]  # the row sums among the statistics (the others are means)

    def accumulate(self, accumulate):
        return reduction.reduce_once(accumulate, self.mesh, self.sum_keys)

    def dropout_key(self, rng):
        return reduction.shard_dropout_key(rng, self.mesh)


def of(options, *, num_layers: int, grad_accum_steps: int, mesh, sum_keys) -> tuple[Scheme, ...]:
    """The schemes a phase's `StepOptions` turns on, in the order the step calls them;
    `mesh` is the phase's (None where no scheme needs it), `sum_keys` the core statistics."""
    schemes = []
    if options.layer_drop is not None:
        schemes.append(LayerDropping(options.layer_drop, num_layers, grad_accum_steps))
    if options.standardization_loss_weight > 0:
        schemes.append(
            StandardizationLoss(
                options.standardization_loss_weight,
                options.standardization_loss_site,
                grad_accum_steps,
            )
        )
    if options.noise_scale_ema_decay is not None:
        schemes.append(NoiseScale(grad_accum_steps))
    if options.gradient_reduction == "once" and mesh is not None:
        schemes.append(ReduceOnce(mesh, sum_keys))
    return tuple(schemes)
