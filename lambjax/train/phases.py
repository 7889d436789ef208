"""A phase of a run: what it is built from, and where its train state comes from.

A phase fixes every shape of its step (sequence length, batch, encoder depth), so each one
is jitted once. Phase 1 and phase 2 of the recipes are phases, and so is every stage of
multi-stage layerwise training.

Restore order, for the phase about to run:
  1. this phase's latest checkpoint (a preempted or killed run continues);
  2. else the previous phase's final checkpoint: its parameters (grown by copying the top
     layers where this phase is deeper), and its optimizer moments with the step count
     restarted if this phase keeps them (`optimizer_state='keep'`), else a fresh
     optimizer state;
  3. else a fresh initialisation from the seed.
"""

import dataclasses
import functools
import sys
from collections.abc import Callable

import jax
import optax
from absl import logging

from lambjax import data as data_lib
from lambjax import optim, sharding
from lambjax.models import bert, pipeline
from lambjax.train import checkpointing, ouroboros, stacking, throughput
from lambjax.train import config as config_lib
from lambjax.train import optimizer as optimizer_lib
from lambjax.train import state as state_lib
from lambjax.train import step as step_lib
from lambjax.train.layer_drop import LayerDrop
from lambjax.train.state import TrainState


class MissingPhaseCheckpoint(RuntimeError):
    """A phase starts from the previous phase's final checkpoint, and it is not there."""


@dataclasses.dataclass(frozen=True)
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
    nsp_loss_weight: float  # 0 without next-sentence prediction
    standardization_loss_weight: float  # lambda of the standardization loss; 0 = off
    ouroboros_split: pipeline.Split | None = None  # Ouroboros' modules, when on
    ouroboros_replay: str = "stale"
    ouroboros_synchronous_steps: int = 0

    def init_state(self, rng: jax.Array) -> TrainState:
        params = bert.init_params(self.model_config, rng)
        return self.new_state(params)

    def new_state(self, params, opt_state=None) -> TrainState:
        """A state at step 0 (and, under Ouroboros, empty pipeline buffers)."""
        state = TrainState.create(
            params, self.optimizer, self.num_frozen_layers, opt_state=opt_state
        )
        if self.ouroboros_split is None:
            return state
        pipeline = ouroboros.init_pipeline(
            self.ouroboros_split,
            params,
            global_batch_size=self.config.global_batch_size,
            seq_len=self.config.max_seq_length,
            dtype=self.model_config.dtype,
            replay=self.ouroboros_replay,
        )
        return state.replace(pipeline=pipeline)

    def init_optimizer(self, params):
        """A fresh optimizer state for this phase's trainable view of `params`."""
        return state_lib.init_optimizer_state(self.optimizer, params, self.num_frozen_layers)

    @functools.cached_property
    def _abstract(self) -> TrainState:
        return jax.eval_shape(self.init_state, jax.random.key(0))

    @functools.cached_property
    def state_shardings(self) -> TrainState:
        shardings = state_lib.shardings(
            self._abstract,
            param_axes=bert.param_logical_axes(self.model_config),
            mesh=self.mesh,
            optimizer=self.optimizer,
            num_frozen_layers=self.num_frozen_layers,
        )
        if self.ouroboros_split is None:
            return shardings
        pipeline = ouroboros.pipeline_shardings(
            self._abstract.pipeline, shardings.params, self.mesh
        )
        return shardings.replace(pipeline=pipeline)

    def abstract_state(self) -> TrainState:
        """The state's shapes and dtypes, each leaf carrying its sharding (a restore target)."""
        return state_lib.with_shardings(self._abstract, self.state_shardings)

    def train_step(self) -> Callable:
        """The pure train step as a function of (state, batch, rng), its settings bound."""
        if self.ouroboros_split is not None:
            settings = ouroboros.PipelineStep(
                split=self.ouroboros_split,
                replay=self.ouroboros_replay,
                mesh=self.mesh,
                model_config=self.model_config,
                optimizer=self.optimizer,
                schedule=self.schedule,
                grad_accum_steps=config_lib.grad_accum_steps_on(self.config, self.mesh),
                nsp_loss_weight=self.nsp_loss_weight,
                synchronous_steps=self.ouroboros_synchronous_steps,
            )
            return functools.partial(ouroboros.train_step, settings=settings)
        return functools.partial(
            step_lib.train_step,
            model_config=self.model_config,
            optimizer=self.optimizer,
            schedule=self.schedule,
            grad_accum_steps=config_lib.grad_accum_steps_on(self.config, self.mesh),
            nsp_loss_weight=self.nsp_loss_weight,
            layer_drop=self.layer_drop,
            num_frozen_layers=self.num_frozen_layers,
            standardization_loss_weight=self.standardization_loss_weight,
        )

    def batches(self, split: str, global_batch_size: int, seed: int, **kwargs):
        """An iterator over this process's rows of every global batch of `split`."""
        return data_lib.make_iterator(
            self.prepared,
            split=split,
            global_batch_size=global_batch_size,
            max_predictions_per_seq=self.config.max_predictions_per_seq,
            seed=seed,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            **kwargs,
        )

    def checkpoint_meta(self, config) -> dict:
        """What a checkpoint records beside the state: the run's config, model, vocabulary."""
        return {
            "config": config.to_json_best_effort(),
            "model_config": dataclasses.asdict(self.model_config),
            "phase": self.name,
            "vocab_file": self.prepared.vocab_file,
        }

    def eval_step(self) -> Callable:
        """The pure eval step as a function of (params, batch)."""
        return functools.partial(step_lib.eval_step, model_config=self.model_config)


def build_phase(config, name: str, index: int, step_offset: int) -> Phase:
    phase_config = config.phases[name]
    prepared = prepare_data(config, phase_config.max_seq_length)
    model_config = config_lib.model_config(config, prepared.vocab_size, name)
    if phase_config.max_seq_length > model_config.max_position_embeddings:
        raise config_lib.ConfigError(
            f"config.phases.{name}.max_seq_length={phase_config.max_seq_length} exceeds the "
            f"model's max_position_embeddings={model_config.max_position_embeddings}"
        )
    schedule = optimizer_lib.learning_rate_schedule(phase_config)
    layer_drop = None
    if config.layer_drop.enabled:
        drop = config.layer_drop
        layer_drop = LayerDrop(drop.theta_bar, drop.gamma, step_offset=step_offset)
    return Phase(
        name=name,
        index=index,
        config=phase_config,
        step_offset=step_offset,
        prepared=prepared,
        model_config=model_config,
        mesh=sharding.make_mesh(config_lib.phase_mesh(config, name)),
        schedule=schedule,
        optimizer=optimizer_lib.make_optimizer(config_lib.phase_optimizer(config, name), schedule),
        num_frozen_layers=phase_config.frozen_layers,
        layer_drop=layer_drop,
        nsp_loss_weight=1.0 if config.data.next_sentence_prediction else 0.0,
        standardization_loss_weight=config.standardization_loss.weight,
        ouroboros_split=(
            pipeline.Split(config.ouroboros.num_modules, model_config.num_layers)
            if config.ouroboros.num_modules > 1
            else None
        ),
        ouroboros_replay=config.ouroboros.replay,
        ouroboros_synchronous_steps=config.ouroboros.synchronous_steps,
    )


def prepare_data(config, max_seq_length: int) -> data_lib.Prepared:
    """The dataset of the phase at `max_seq_length`.

    A single-host run builds what is missing, for every phase of the run at once (one Beam
    pipeline, on the DirectRunner). A multi-host run never builds: that is
    `python -m lambjax.prepare`'s job, run once before the pod starts, and a run whose data
    is missing stops here, before anything is compiled, naming that command.
    """
    lengths = sorted({config.phases[name].max_seq_length for name in config.phase_order})
    lengths = sorted(set(lengths) | {max_seq_length})
    if jax.process_count() == 1:
        return data_lib.prepare_all(config.data, lengths)[max_seq_length]
    try:
        return data_lib.prepare_all(config.data, lengths, build=False)[max_seq_length]
    except data_lib.NotPrepared as error:
        raise data_lib.NotPrepared(
            f"{error}; a run on {jax.process_count()} processes does not build data: run "
            f"`{prepare_command()}` once first"
        ) from None


def prepare_command() -> str:
    """`python -m lambjax.prepare` with this run's --config flags."""
    argv, args = sys.argv[1:], []
    for index, arg in enumerate(argv):
        if arg == "--config" and index + 1 < len(argv):
            args += [arg, argv[index + 1]]
        elif arg.startswith(("--config=", "--config.", "--noconfig.")):
            args.append(arg)
    return " ".join(["python -m lambjax.prepare", *args])


def initial_state(
    config,
    workdir: str,
    phase: Phase,
    ckpt: checkpointing.PhaseCheckpoints,
    init_state: Callable,
    init_optimizer: Callable,
):
    """(state, data iterator state or None, step) by the restore order above.

    `init_state(rng)` and `init_optimizer(params)` are the phase's initialisers as the
    trainer compiled them (sharded outputs).
    """
    restored = ckpt.restore_latest(phase.abstract_state())
    if restored is not None:
        logging.info("Phase %s: resuming from its checkpoint at step %d", phase.name, restored.step)
        return restored.state, restored.data_state, restored.step
    if phase.index > 0:
        return from_previous_phase(config, workdir, phase, init_optimizer), None, 0
    logging.info("Phase %s: initialising from scratch (seed %d)", phase.name, config.seed)
    return init_state(jax.random.key(config.seed)), None, 0


def previous_phase(config, phase: Phase) -> Phase:
    """The phase before `phase`, as far as restoring its final state needs it."""
    name = config.phase_order[phase.index - 1]
    schedule = optimizer_lib.learning_rate_schedule(config.phases[name])
    return dataclasses.replace(
        phase,
        name=name,
        index=phase.index - 1,
        config=config.phases[name],
        optimizer=optimizer_lib.make_optimizer(config_lib.phase_optimizer(config, name), schedule),
        model_config=config_lib.model_config(config, phase.model_config.vocab_size, name),
        num_frozen_layers=config.phases[name].frozen_layers,
    )


def from_previous_phase(config, workdir: str, phase: Phase, init_optimizer: Callable):
    """The phase transition: the previous phase's final parameters, grown to this phase's
    depth; its moments (step count restarted) or a fresh optimizer state."""
    previous = previous_phase(config, phase)
    keep = phase.config.optimizer_state == "keep"
    # Kept moments need the same optimizer, depth and frozen layers (validated): this phase's
    # target then fits; otherwise the previous state may have another structure.
    target = previous.abstract_state()
    if keep:  # the previous phase's pipeline buffers have its shapes; they are not kept
        target = phase.abstract_state().replace(pipeline=target.pipeline)
    final_step = previous.config.num_steps
    ckpt = checkpointing.PhaseCheckpoints(
        workdir, previous.name, max_to_keep=config.max_checkpoints_to_keep, async_save=False
    )
    restored = ckpt.restore_latest(target, step=final_step)
    ckpt.close()
    if restored is None or restored.step != final_step:
        raise MissingPhaseCheckpoint(
            f"phase {phase.name!r} starts from phase {previous.name!r}'s final checkpoint "
            f"(step {final_step}), which is missing under "
            f"{checkpointing.checkpoint_dir(workdir, previous.name)}"
        )
    params = restored.state.params
    depth, new_depth = previous.model_config.num_layers, phase.model_config.num_layers
    logging.info(
        "Phase %s: starting from phase %s's final state (%d -> %d layers, %d frozen; "
        "optimizer state: %s)",
        phase.name,
        previous.name,
        depth,
        new_depth,
        phase.num_frozen_layers,
        phase.config.optimizer_state,
    )
    if depth < new_depth:
        _, params = stacking.grow_layers(previous.model_config, params, new_depth)
        params = jax.device_put(params, phase.state_shardings.params)
    if keep:
        opt_state = optim.restart_step_count(restored.state.opt_state)
    else:
        opt_state = init_optimizer(params)
    state = phase.new_state(params, opt_state=opt_state)
    return jax.device_put(state, phase.state_shardings)


def train_step_flops(config, name: str, vocab_size: int) -> int:
    """Model FLOPs of one optimizer step of phase `name` (lambjax.train.throughput)."""
    phase_config = config.phases[name]
    return throughput.train_step_flops(
        config_lib.model_config(config, vocab_size, name),
        phase_config.global_batch_size,
        phase_config.max_seq_length,
        phase_config.max_predictions_per_seq,
        num_frozen_layers=phase_config.frozen_layers,
    )


def later_phases_flops(config, phase: Phase) -> int:
    """Model FLOPs of every step of the phases after `phase` (for the run's ETA)."""
    later = config.phase_order[phase.index + 1 :]
    vocab_size = phase.model_config.vocab_size
    return sum(
        config.phases[name].num_steps * train_step_flops(config, name, vocab_size) for name in later
    )


def throughput_meter(config, phase: Phase) -> throughput.Throughput:
    peak = throughput.peak_flops_per_device(config.peak_flops_per_device)
    return throughput.Throughput(
        tokens_per_step=phase.config.global_batch_size * phase.config.max_seq_length,
        flops_per_step=train_step_flops(config, phase.name, phase.model_config.vocab_size),
        peak_flops=peak * jax.device_count() if peak else None,
    )
