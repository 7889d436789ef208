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
  3. else, for the first phase of a run whose `config.init` names a published model, that
     model's parameters with a fresh optimizer state (lambjax.train.published);
  4. else a fresh initialisation from the seed.
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
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params, param_logical_axes
from lambjax.train import checkpointing, layerwise, layout, published
from lambjax.train import optimizer as optimizer_lib
from lambjax.train import state as state_lib
from lambjax.train import step as step_lib
from lambjax.train.plan import PhasePlan, RunPlan
from lambjax.train.state import TrainState


class MissingPhaseCheckpoint(RuntimeError):
    """A phase starts from the previous phase's final checkpoint, and it is not there."""


@dataclasses.dataclass(frozen=True)
class Phase:
    """What is built for one phase from its plan: data, mesh, schedule and optimizer."""

    plan: PhasePlan
    prepared: data_lib.Prepared
    mesh: jax.sharding.Mesh
    schedule: optax.Schedule
    optimizer: optax.GradientTransformation

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def index(self) -> int:
        return self.plan.index

    @property
    def model_config(self) -> BertConfig:
        return self.plan.model

    @property
    def num_frozen_layers(self) -> int:
        return self.plan.step.num_frozen_layers

    @property
    def train_decoder(self) -> bool:
        return self.plan.step.train_decoder

    def init_state(self, rng: jax.Array) -> TrainState:
        params = init_params(self.model_config, rng)
        return self.new_state(params)

    def new_state(self, params, opt_state=None) -> TrainState:
        """A state at step 0 (and the step method's state at its start, where one runs)."""
        state = TrainState.create(
            params,
            self.optimizer,
            self.num_frozen_layers,
            opt_state=opt_state,
            train_decoder=self.train_decoder,
        )
        if self.plan.step_method is None:
            return state
        return state.replace(method_state=self.plan.step_method.init_method_state(self, params))

    def init_optimizer(self, params):
        """A fresh optimizer state for this phase's trainable view of `params`."""
        return state_lib.init_optimizer_state(
            self.optimizer, params, self.num_frozen_layers, self.train_decoder
        )

    @functools.cached_property
    def per_layer(self) -> bool:
        """Whether the steps hold the encoder layers one tree per layer (lambjax.train.layout);
        the state rests stacked either way."""
        method = self.plan.step_method
        runs_per_layer = method is None or method.runs_per_layer
        return runs_per_layer and layout.per_layer(self.model_config)

    @functools.cached_property
    def _abstract(self) -> TrainState:
        return jax.eval_shape(self.init_state, jax.random.key(0))

    @functools.cached_property
    def rest_shardings(self) -> TrainState:
        """The shardings of the state at rest (layers stacked): what is restored and saved."""
        shardings = state_lib.shardings(
            self._abstract,
            param_axes=param_logical_axes(self.model_config),
            mesh=self.mesh,
            optimizer=self.optimizer,
            num_frozen_layers=self.num_frozen_layers,
            train_decoder=self.train_decoder,
        )
        method = self.plan.step_method
        if method is None:
            return shardings
        method_state = method.method_state_shardings(
            self, self._abstract.method_state, shardings.params
        )
        return shardings.replace(method_state=method_state)

    @functools.cached_property
    def state_shardings(self) -> TrainState:
        """The shardings of the state the steps take (`to_running`'s layout)."""
        if not self.per_layer:
            return self.rest_shardings
        return state_lib.shardings(
            layout.abstract_running(self._abstract, self.num_frozen_layers),
            param_axes=layout.running_param_axes(
                param_logical_axes(self.model_config), self.model_config.num_layers
            ),
            mesh=self.mesh,
            optimizer=self.optimizer,
            num_frozen_layers=self.num_frozen_layers,
            train_decoder=self.train_decoder,
        )

    def abstract_state(self) -> TrainState:
        """The state's shapes and dtypes at rest, each leaf carrying its sharding (a restore
        target)."""
        return state_lib.with_shardings(self._abstract, self.rest_shardings)

    def to_running(self, state: TrainState) -> TrainState:
        """A state at rest as the steps take it: the one conversion in, beside `to_rest`."""
        return layout.to_running(state, self.num_frozen_layers) if self.per_layer else state

    def to_rest(self, state: TrainState) -> TrainState:
        """The steps' state as it is saved."""
        return layout.to_rest(state) if self.per_layer else state

    def train_step(self) -> Callable:
        """The pure train step as a function of (state, batch, rng), its settings bound: the
        step method's where the plan has one, else the core step's."""
        if self.plan.step_method is not None:
            return self.plan.step_method.train_step(self)
        settings = step_lib.StepSettings.of(self.plan, self.optimizer, self.schedule, self.mesh)
        return functools.partial(step_lib.train_step, settings=settings)

    def batches(self, split: str, global_batch_size: int, seed: int, **kwargs):
        """An iterator over this process's rows of every global batch of `split`. Only the
        training split is packed (where the plan packs): the held-out metrics are then over
        the same examples, one per row, with packing or without."""
        return data_lib.make_iterator(
            self.prepared,
            split=split,
            global_batch_size=global_batch_size,
            max_predictions_per_seq=self.plan.batch.max_predictions_per_seq,
            seed=seed,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            packing=self.plan.packing if split == "train" else None,
            **kwargs,
        )

    def checkpoint_meta(self, config_json: str) -> dict:
        """What a checkpoint records beside the state: the run's config, model, vocabulary."""
        return {
            "config": config_json,
            "model_config": dataclasses.asdict(self.model_config),
            "phase": self.name,
            "vocab_file": self.prepared.vocab_file,
        }

    def eval_step(self) -> Callable:
        """The pure eval step as a function of (params, batch): with the step method's layer
        options where it has some (lambjax.train.method.StepMethod.layer_options)."""
        options = getattr(self.plan.step_method, "layer_options", None)
        return functools.partial(
            step_lib.eval_step, model_config=self.model_config, layer_options=options
        )


def build_phase(plan: PhasePlan, prepared: data_lib.Prepared) -> Phase:
    """The phase of `plan` on this machine: its mesh over this machine's devices, its
    schedule and optimizer."""
    schedule = optimizer_lib.learning_rate_schedule(plan.schedule)
    return Phase(
        plan=plan,
        prepared=prepared,
        mesh=sharding.make_mesh(plan.mesh, dcn=plan.mesh_dcn),
        schedule=schedule,
        optimizer=optimizer_lib.make_optimizer(plan.optimizer, schedule),
    )


def prepare_vocabulary(data_config) -> data_lib.Vocabulary:
    """The run's vocabulary; its size is part of the run's plan (the model's embeddings)."""
    return _prepared(lambda build: data_lib.vocabulary(data_config, build=build))


def prepare_data(run_plan: RunPlan) -> dict[int, data_lib.Prepared]:
    """The run's datasets, by sequence length."""
    return _prepared(
        lambda build: data_lib.prepare_all(run_plan.data, run_plan.seq_lengths, build=build)
    )


def check_data(run_plan: RunPlan, datasets: dict[int, data_lib.Prepared]) -> None:
    """Every phase's global batch fits in its training split, and the evaluation batch in
    the held-out split (after the data is built, before anything is compiled): a batch
    larger than its split would make no batch at all."""
    source = run_plan.data.source
    for plan in run_plan.phases:
        seq = plan.batch.max_seq_length
        prepared = datasets[seq]
        examples = prepared.num_examples("train")
        batch = plan.batch.global_batch_size
        if examples == 0:
            raise data_lib.DataError(
                f"config.data.source={source} yields no training examples at "
                f"max_seq_length={seq} (no sentence pairs); valid: a corpus of at least "
                f"{batch} examples, one global batch of phase {plan.name}"
            )
        if examples < batch:
            raise data_lib.DataError(
                f"config.phases.{plan.name}.global_batch_size={batch} exceeds the {examples} "
                f"training examples config.data.source={source} yields at max_seq_length="
                f"{seq}; valid: at most {examples}, or a larger corpus"
            )
        held_out = prepared.data_sources.get("validation")
        if held_out is not None and run_plan.data.validation_fraction > 0:
            if len(held_out) < run_plan.eval_batch_size:
                raise data_lib.DataError(
                    f"config.eval_batch_size={run_plan.eval_batch_size} exceeds the "
                    f"{len(held_out)} held-out examples (config.data.validation_fraction="
                    f"{run_plan.data.validation_fraction}) at max_seq_length={seq}; valid: at "
                    f"most {len(held_out)}, a larger validation_fraction, or 0 (no evaluation)"
                )


def _prepared(find_or_build: Callable):
    """A single-host run builds what is missing, for every phase of the run at once (one Beam
    pipeline, on the DirectRunner). A multi-host run never builds: that is
    `python -m lambjax.prepare`'s job, run once before the pod starts, and a run whose data
    is missing stops before anything is compiled, naming that command."""
    if jax.process_count() == 1:
        return find_or_build(True)
    try:
        return find_or_build(False)
    except data_lib.NotPrepared as error:
        raise data_lib.NotPrepared(
            f"{error}; a run on {jax.process_count()} processes does not build data: run "
            f"`{prepare_command()}` once first"
        ) from None


def prepare_command() -> str:
    """`python -m lambjax.prepare` with this run's --config and --workdir flags."""
    argv, args = sys.argv[1:], []
    for index, arg in enumerate(argv):
        if arg == "--config" and index + 1 < len(argv):
            args += [arg, argv[index + 1]]
        elif arg.startswith(("--config=", "--config.", "--noconfig.", "--workdir=")):
            args.append(arg)
    return " ".join(["python -m lambjax.prepare", *args])


def initial_state(
    run_plan: RunPlan,
    workdir: str,
    phase: Phase,
    ckpt: checkpointing.PhaseCheckpoints,
    compiled,
    start: published.Published | None = None,
):
    """(state at rest, data iterator state or None, step) by the restore order above.

    `compiled` holds the phase's initialisers as the trainer compiled them
    (lambjax.train.loop.CompiledSteps: `init_state(rng)` and `init_optimizer(params)`, sharded
    outputs, at rest); `start` is the published model the run starts from, if any.
    """
    init_optimizer = compiled.init_optimizer
    restored = ckpt.restore_latest(phase.abstract_state())
    if restored is not None:
        logging.info("Phase %s: resuming from its checkpoint at step %d", phase.name, restored.step)
        return restored.state, restored.data_state, restored.step
    if phase.plan.previous is not None:
        return from_previous_phase(run_plan, workdir, phase, init_optimizer), None, 0
    if start is not None:
        return from_published(start, phase, init_optimizer), None, 0
    logging.info("Phase %s: initialising from scratch (seed %d)", phase.name, run_plan.seed)
    return compiled.init_state(jax.random.key(run_plan.seed)), None, 0


def from_previous_phase(run_plan: RunPlan, workdir: str, phase: Phase, init_optimizer: Callable):
    """The phase transition: the previous phase's final parameters, grown to this phase's
    depth; its moments (step count restarted) or a fresh optimizer state."""
    previous = build_phase(phase.plan.previous, phase.prepared)  # its state's structure
    keep = phase.plan.optimizer_state == "keep"
    # Kept moments need the same optimizer, depth and frozen layers (checked by the plan):
    # this phase's target then fits; otherwise the previous state may have another structure.
    target = previous.abstract_state()
    if keep:  # the previous phase's step method state has its shapes; it is not kept
        target = phase.abstract_state().replace(method_state=target.method_state)
    final_step = previous.plan.num_steps
    ckpt = checkpointing.PhaseCheckpoints(
        workdir, previous.name, max_to_keep=run_plan.max_checkpoints_to_keep, async_save=False
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
        phase.plan.optimizer_state,
    )
    if depth < new_depth:
        _, params = layerwise.grow_layers(previous.model_config, params, new_depth)
        params = jax.device_put(params, phase.rest_shardings.params)
    if keep:
        opt_state = optim.restart_step_count(restored.state.opt_state)
    else:
        opt_state = init_optimizer(params)
    state = phase.new_state(params, opt_state=opt_state)
    return jax.device_put(state, phase.rest_shardings)


def from_published(start: published.Published, phase: Phase, init_optimizer: Callable):
    """The published model's parameters, with a fresh optimizer state."""
    published.log_start(start, phase.name)
    params = published.initial_params(start, phase.abstract_state().params)
    params = jax.device_put(params, phase.rest_shardings.params)
    state = phase.new_state(params, opt_state=init_optimizer(params))
    return jax.device_put(state, phase.rest_shardings)
