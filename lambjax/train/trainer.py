"""The training loop: phases, sharded state, checkpoints, evaluation, metrics, preemption.

`train_and_evaluate(config, workdir)` runs every phase of `config.phase_order` that has not
finished yet. Each phase jits one train step (its shapes are fixed by the phase), restores
according to the order in lambjax.train.checkpointing, and saves every
`checkpoint_every_steps`, at its end, and when the job is asked to stop (SIGTERM).
"""

import dataclasses
import functools
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from clu import parameter_overview, periodic_actions
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from lambjax import data as data_lib
from lambjax import optim, sharding
from lambjax.models import bert
from lambjax.train import checkpointing, peak_flops, stacking
from lambjax.train import config as config_lib
from lambjax.train import metrics as metrics_lib
from lambjax.train import optimizer as optimizer_lib
from lambjax.train import step as step_lib
from lambjax.train.layer_drop import LayerDrop


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite steps)."""


class StopRequest:
    """SIGTERM handling: the loop asks `requested(step)` at every step boundary.

    With one process a Python signal handler sets a flag. With several, JAX's preemption
    sync point makes every process agree on the same step to stop at (the coordination
    service relays the SIGTERM any one of them received).
    """

    def __init__(self):
        self._signalled = False
        if jax.process_count() == 1:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        logging.warning("SIGTERM received: saving at the next step boundary, then exiting.")
        self._signalled = True

    def requested(self, step: int) -> bool:
        if jax.process_count() == 1:
            return self._signalled
        return multihost_utils.reached_preemption_sync_point(step)


@dataclasses.dataclass
class Phase:
    """Everything built for one phase."""

    name: str
    index: int
    config: object  # the phase's ConfigDict
    step_offset: int  # optimizer steps of all earlier phases (TensorBoard x axis)
    prepared: data_lib.Prepared
    model_config: bert.BertConfig
    mesh: jax.sharding.Mesh
    schedule: optax.Schedule
    optimizer: optax.GradientTransformation
    num_frozen_layers: int  # bottom layers not trained in this phase (a stage of MSLT)
    layer_drop: LayerDrop | None  # progressive layer dropping, when enabled


def train_and_evaluate(config, workdir: str) -> dict:
    """Runs the remaining phases; returns the last evaluation's metrics."""
    if "://" not in workdir:  # Orbax needs absolute local paths (gs://... stays as it is)
        workdir = os.path.abspath(workdir)
    config_lib.validate(config, num_devices=jax.device_count(), process_count=jax.process_count())
    writer = metrics_lib.create_writer(workdir)
    stop = StopRequest()
    eval_metrics = {}
    step_offset = 0
    try:
        for index, name in enumerate(config.phase_order):
            phase = build_phase(config, name, index, step_offset)
            outcome, eval_metrics = run_phase(config, workdir, phase, writer, stop)
            if outcome == "stopped":
                logging.info("Stopped in phase %s; rerun the same command to continue.", name)
                break
            step_offset += phase.config.num_steps
    finally:
        writer.close()
    return eval_metrics


def build_phase(config, name: str, index: int, step_offset: int) -> Phase:
    phase_config = config.phases[name]
    prepared = prepare_data(config.data, phase_config.max_seq_length)
    model_config = config_lib.model_config(config, prepared.vocab_size, name)
    if phase_config.max_seq_length > model_config.max_position_embeddings:
        raise config_lib.ConfigError(
            f"config.phases.{name}.max_seq_length={phase_config.max_seq_length} exceeds the "
            f"model's max_position_embeddings={model_config.max_position_embeddings}"
        )
    schedule = optimizer_lib.learning_rate_schedule(phase_config)
    optimizer = optimizer_lib.make_optimizer(config_lib.phase_optimizer(config, name), schedule)
    mesh = sharding.make_mesh(config_lib.phase_mesh(config, name))
    layer_drop = None
    if config.layer_drop.enabled:
        layer_drop = LayerDrop(
            config.layer_drop.theta_bar, config.layer_drop.gamma, step_offset=step_offset
        )
    return Phase(
        name,
        index,
        phase_config,
        step_offset,
        prepared,
        model_config,
        mesh,
        schedule,
        optimizer,
        num_frozen_layers=phase_config.frozen_layers,
        layer_drop=layer_drop,
    )


def phase_train_step(config, phase: Phase):
    """The phase's train step as a function of (state, batch, rng), its settings bound."""
    return functools.partial(
        step_lib.train_step,
        model_config=phase.model_config,
        optimizer=phase.optimizer,
        schedule=phase.schedule,
        grad_accum_steps=phase.config.grad_accum_steps,
        nsp_loss_weight=1.0 if config.data.next_sentence_prediction else 0.0,
        layer_drop=phase.layer_drop,
        num_frozen_layers=phase.num_frozen_layers,
    )


def prepare_data(data_config, max_seq_length: int) -> data_lib.Prepared:
    """Process 0 builds the dataset (if needed) before the others look for it."""
    if jax.process_index() == 0:
        prepared = data_lib.prepare(data_config, max_seq_length)
    checkpointing.sync(f"data-{max_seq_length}")
    if jax.process_index() != 0:
        prepared = data_lib.prepare(data_config, max_seq_length)
    return prepared


# ----------------------------------------------------------------------------------------
# Sharded state


def state_shardings(phase: Phase, abstract_state: step_lib.TrainState):
    """Shardings of every TrainState leaf, from the model's logical axes and the rules."""
    mesh = phase.mesh
    param_axes = bert.param_logical_axes(phase.model_config)
    param_shardings = sharding.tree_shardings(abstract_state.params, param_axes, mesh)
    replicated = sharding.replicated(mesh)

    def like_param(leaf, param, param_sharding):
        # Moments mirror their parameter; anything else there (e.g. per-layer ratios) is small.
        return param_sharding if leaf.shape == param.shape else replicated

    # The optimizer state covers the trainable view only (all parameters, but in an MSLT
    # stage). Cutting layers off a stacked leaf keeps its sharding: `layers` is not sharded.
    n = phase.num_frozen_layers
    trainable_params = jax.eval_shape(lambda p: stacking.split(p, n)[0], abstract_state.params)
    trainable_shardings, _ = stacking.split(param_shardings, n, take=lambda s, _: s)
    opt_shardings = optax.tree_map_params(
        phase.optimizer,
        like_param,
        abstract_state.opt_state,
        trainable_params,
        trainable_shardings,
        transform_non_params=lambda _: replicated,
    )
    return step_lib.TrainState(
        step=replicated,
        params=param_shardings,
        opt_state=opt_shardings,
        consecutive_nonfinite=replicated,
        total_nonfinite=replicated,
    )


def abstract_train_state(phase: Phase):
    def init(rng):
        return step_lib.TrainState.create(
            bert.init_params(phase.model_config, rng), phase.optimizer, phase.num_frozen_layers
        )

    abstract = jax.eval_shape(init, jax.random.key(0))
    shardings = state_shardings(phase, abstract)
    return init, abstract, shardings


def initial_state(config, workdir: str, phase: Phase, ckpt: checkpointing.PhaseCheckpoints):
    """(state, data_state, start_step) by the restore order of lambjax.train.checkpointing."""
    init, abstract, shardings = abstract_train_state(phase)
    target = checkpointing.abstract_with_shardings(abstract, shardings)

    restored = ckpt.restore_latest(target)
    if restored is not None:
        logging.info("Phase %s: resuming from its checkpoint at step %d", phase.name, restored.step)
        return restored.state, restored.data_state, restored.step, shardings

    if phase.index > 0:
        previous = config.phase_order[phase.index - 1]
        state = from_previous_phase(config, workdir, phase, previous, target, shardings)
        return state, None, 0, shardings

    logging.info("Phase %s: initialising from scratch (seed %d)", phase.name, config.seed)
    init_jit = jax.jit(init, out_shardings=shardings)
    return init_jit(jax.random.key(config.seed)), None, 0, shardings


def from_previous_phase(config, workdir, phase: Phase, previous: str, target, shardings):
    """Phase transition: parameters always; moments kept (step count restarted) or reset.

    A deeper phase (the next stage of multi-stage layerwise training) grows the encoder by
    copying the previous phase's top layers; its optimizer state is always fresh (validated).
    """
    previous_config = config.phases[previous]
    if phase.config.optimizer_state == "keep":
        previous_target = target  # same optimizer, depth and frozen layers (validated)
    else:  # the previous phase's state may have another structure and depth
        previous_optimizer = optimizer_lib.make_optimizer(
            config_lib.phase_optimizer(config, previous),
            optimizer_lib.learning_rate_schedule(previous_config),
        )
        previous_phase = dataclasses.replace(
            phase,
            optimizer=previous_optimizer,
            model_config=config_lib.model_config(config, phase.model_config.vocab_size, previous),
            num_frozen_layers=previous_config.frozen_layers,
        )
        _, abstract, previous_shardings = abstract_train_state(previous_phase)
        previous_target = checkpointing.abstract_with_shardings(abstract, previous_shardings)
    previous_ckpt = checkpointing.PhaseCheckpoints(
        workdir, previous, max_to_keep=config.max_checkpoints_to_keep, async_save=False
    )
    restored = previous_ckpt.restore_latest(previous_target, step=previous_config.num_steps)
    previous_ckpt.close()
    if restored is None or restored.step != previous_config.num_steps:
        raise TrainingStopped(
            f"phase {phase.name!r} starts from phase {previous!r}'s final checkpoint (step "
            f"{previous_config.num_steps}), which is missing under "
            f"{checkpointing.checkpoint_dir(workdir, previous)}"
        )
    params = restored.state.params
    depth = jax.tree.leaves(params["encoder"]["layers"])[0].shape[0]
    logging.info(
        "Phase %s: starting from phase %s's final state (%d -> %d layers, %d frozen; "
        "optimizer state: %s)",
        phase.name,
        previous,
        depth,
        phase.model_config.num_layers,
        phase.num_frozen_layers,
        phase.config.optimizer_state,
    )
    if depth < phase.model_config.num_layers:
        previous_model = dataclasses.replace(phase.model_config, num_layers=depth)
        _, params = bert.grow_layers(previous_model, params, phase.model_config.num_layers)
        params = jax.device_put(params, shardings.params)
    if phase.config.optimizer_state == "keep":
        opt_state = optim.restart_step_count(restored.state.opt_state)
    else:
        n = phase.num_frozen_layers
        init = lambda p: phase.optimizer.init(stacking.split(p, n)[0])  # noqa: E731
        opt_state = jax.jit(init, out_shardings=shardings.opt_state)(params)
    state = step_lib.TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        consecutive_nonfinite=jnp.zeros((), jnp.int32),
        total_nonfinite=jnp.zeros((), jnp.int32),
    )
    return jax.device_put(state, shardings)


# ----------------------------------------------------------------------------------------
# The loop


def run_phase(config, workdir, phase: Phase, writer, stop: StopRequest):
    """Trains one phase to its last step (or until stopped). Returns (outcome, eval metrics)."""
    phase_config = phase.config
    ckpt = checkpointing.PhaseCheckpoints(
        workdir,
        phase.name,
        max_to_keep=config.max_checkpoints_to_keep,
        async_save=config.async_checkpointing,
    )
    state, data_state, step, shardings = initial_state(config, workdir, phase, ckpt)
    if step >= phase_config.num_steps:
        logging.info("Phase %s already finished (step %d).", phase.name, step)
        ckpt.close()
        return "finished", {}
    if phase.index == 0 and step == 0:
        parameter_overview.log_parameter_overview(
            state.params, include_stats=False, msg=f"Parameters of {phase.model_config}"
        )

    batch_sharding = sharding.batch_sharding(phase.mesh)
    replicated = sharding.replicated(phase.mesh)
    train_step = jax.jit(
        phase_train_step(config, phase),
        in_shardings=(shardings, batch_sharding, replicated),
        out_shardings=(shardings, replicated),
        donate_argnums=(0,),
    )
    eval_step = jax.jit(
        functools.partial(step_lib.eval_step, model_config=phase.model_config),
        in_shardings=(shardings.params, batch_sharding),
        out_shardings=replicated,
    )

    train_iter = data_lib.make_iterator(
        phase.prepared,
        split="train",
        global_batch_size=phase_config.global_batch_size,
        max_predictions_per_seq=phase_config.max_predictions_per_seq,
        seed=config.seed + phase.index,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    if data_state is not None:
        train_iter.set_state(data_state)

    meta = {
        "config": config.to_json_best_effort(),
        "model_config": dataclasses.asdict(phase.model_config),
        "phase": phase.name,
        "vocab_file": phase.prepared.vocab_file,
    }
    rng = jax.random.fold_in(jax.random.key(config.seed), phase.index)
    throughput = Throughput(phase, config)
    total_steps = sum(config.phases[name].num_steps for name in config.phase_order)
    hooks = [
        periodic_actions.ReportProgress(num_train_steps=total_steps, writer=writer, every_secs=30.0)
    ]
    if config.profile and jax.process_index() == 0:
        hooks.append(
            periodic_actions.Profile(logdir=workdir, first_profile=phase.step_offset + step + 5)
        )

    pending_metrics = []
    eval_metrics = {}
    outcome = "finished"
    logging.info("Phase %s: training steps %d..%d", phase.name, step + 1, phase_config.num_steps)
    while step < phase_config.num_steps:
        if stop.requested(step):
            outcome = "stopped"
            break
        batch = to_global(next(train_iter), batch_sharding)
        state, metrics = train_step(state, batch, rng)
        step += 1
        pending_metrics.append(metrics)
        for hook in hooks:
            hook(phase.step_offset + step)
        is_last = step == phase_config.num_steps
        if step % config.log_every_steps == 0 or is_last:
            summary = summarize(pending_metrics)
            pending_metrics = []
            summary.update(throughput.measure(step))
            summary["phase"] = phase.index + 1
            writer.write_scalars(
                phase.step_offset + step, {f"train/{k}": v for k, v in summary.items()}
            )
            check_nonfinite(state, step, config.max_consecutive_nonfinite_steps)
        if step % config.eval_every_steps == 0 or is_last:
            eval_metrics = evaluate(config, phase, eval_step, state.params, batch_sharding)
            if eval_metrics:
                writer.write_scalars(
                    phase.step_offset + step, {f"eval/{k}": v for k, v in eval_metrics.items()}
                )
            throughput.reset(step)
        if step % config.checkpoint_every_steps == 0 or is_last:
            ckpt.save(step, state, train_iter.get_state(), meta)
    if outcome == "stopped" and step not in ckpt.steps():
        ckpt.save(step, state, train_iter.get_state(), meta)
    writer.flush()
    ckpt.close()
    return outcome, eval_metrics


def to_global(local_batch: dict, batch_sharding: NamedSharding) -> dict:
    """This process's rows of the global batch -> global arrays sharded over data x fsdp."""
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(batch_sharding, x), local_batch
    )


def summarize(step_metrics: list[dict]) -> dict:
    """Means of the per-step metrics since the last log (one device-to-host transfer)."""
    stacked = jax.device_get(jax.tree.map(lambda *xs: jnp.stack(xs), *step_metrics))
    return {k: float(np.mean(v)) for k, v in stacked.items()}


def check_nonfinite(state: step_lib.TrainState, step: int, limit: int) -> None:
    consecutive = int(jax.device_get(state.consecutive_nonfinite))
    if consecutive >= limit:
        raise TrainingStopped(
            f"{consecutive} consecutive steps ({step - consecutive + 1}..{step}) had a "
            f"non-finite loss or gradient and were skipped (limit: "
            f"max_consecutive_nonfinite_steps={limit})"
        )


class Throughput:
    """Step time, tokens/s and MFU over the steps since the last measurement."""

    def __init__(self, phase: Phase, config):
        phase_config = phase.config
        self._tokens_per_step = phase_config.global_batch_size * phase_config.max_seq_length
        self._flops_per_step = bert.train_step_flops(
            phase.model_config,
            phase_config.global_batch_size,
            phase_config.max_seq_length,
            phase_config.max_predictions_per_seq,
            num_frozen_layers=phase.num_frozen_layers,
        )
        peak = peak_flops.peak_flops_per_device(config.peak_flops_per_device)
        self._peak = peak * jax.device_count() if peak else None
        self._start_step = None
        self._start_time = None

    def reset(self, step: int) -> None:
        self._start_step, self._start_time = step, time.perf_counter()

    def measure(self, step: int) -> dict:
        """The first call only starts the clock (its window holds the compilation)."""
        now = time.perf_counter()
        if self._start_step is None or step <= self._start_step:
            self.reset(step)
            return {}
        seconds = (now - self._start_time) / (step - self._start_step)
        self.reset(step)
        out = {
            "step_time_s": seconds,
            "tokens_per_s": self._tokens_per_step / seconds,
            "flops_per_s": self._flops_per_step / seconds,
        }
        if self._peak:
            out["mfu"] = self._flops_per_step / seconds / self._peak
        return out


def evaluate(config, phase: Phase, eval_step, params, batch_sharding) -> dict:
    """MLM loss and accuracy on the held-out split (the MLPerf metric), plus NSP."""
    if "validation" not in phase.prepared.data_sources:
        logging.warning("Phase %s: no validation split was built; no evaluation.", phase.name)
        return {}
    iterator = data_lib.make_iterator(
        phase.prepared,
        split="validation",
        global_batch_size=config.eval_batch_size,
        max_predictions_per_seq=phase.config.max_predictions_per_seq,
        seed=config.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        num_epochs=1,
    )
    totals = None
    for index, batch in enumerate(iterator):
        if config.eval_steps and index >= config.eval_steps:
            break
        stats = eval_step(params, to_global(batch, batch_sharding))
        totals = stats if totals is None else jax.tree.map(jnp.add, totals, stats)
    if totals is None:
        logging.warning(
            "Phase %s: the validation split has fewer than eval_batch_size=%d examples; "
            "no evaluation.",
            phase.name,
            config.eval_batch_size,
        )
        return {}
    return {k: float(v) for k, v in jax.device_get(step_lib.metrics_from_stats(totals)).items()}
