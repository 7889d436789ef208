"""The config resolved once: a run plan, and one typed, frozen plan per phase.

`resolve(config, num_devices=..., process_count=..., num_slices=..., platform=...,
workdir=..., start=...)` is the one reading of the ml_collections config: it checks every
field and returns a frozen `RunPlan`, the run's settings and, in `phases`, a `PhasePlan` per
phase with everything the code below needs (model as it runs on the platform, optimizer and
schedule, mesh, batch geometry, the train step's options, packing). The config is not
changed: where the run keeps its data and which vocabulary a published start brings are
plan fields (`RunPlan.data`). Nothing downstream reads the config again; growing from the
previous phase reads `PhasePlan.previous`. The one fact that joins the plan later is the
size of a vocabulary trained on the corpus (`RunPlan.with_vocab_size`): no check depends on
it, and the plan is resolved before any data or vocabulary work.

Checks live beside their feature and are collected here, in one pass, before anything is
built: the run's and the phases' own fields in lambjax.train.plan_checks; progressive layer
dropping in lambjax.train.layer_drop; multi-stage layerwise training in
lambjax.train.layerwise; the standardization loss in lambjax.models.standardization; a step
method's (`config.step_method`, lambjax.train.method) in its own module; packing in
lambjax.data.packing; the data fields in lambjax.data.builder.check_config; the PRNG
implementation in lambjax.train.prng; the gradient's reduction in lambjax.train.reduction;
the tracking backends in lambjax.train.tracking; a published start's vocabulary and shape in
lambjax.train.published. Numbers are checked against their interval (lambjax.ranges), so
that NaN and inf are refused too. Each raises `ConfigError` (a ValueError) naming the
field, the value and what would be valid.
"""

import copy
import dataclasses
from collections.abc import Mapping

import ml_collections

from lambjax import data as data_lib
from lambjax import sharding, storage
from lambjax.data import packing as packing_lib
from lambjax.models import attention, standardization
from lambjax.models.config import BertConfig
from lambjax.train import (
    layer_drop,
    layerwise,
    noise_scale,
    plan_checks,
    prng,
    published,
    reduction,
    tracking,
)
from lambjax.train import method as method_lib
from lambjax.train import step as step_lib
from lambjax.train import target as target_lib
from lambjax.train.config import OPTIMIZERS, ConfigError


@dataclasses.dataclass(frozen=True)
class OptimizerPlan:
    """The phase's optimizer (lambjax.train.optimizer.make_optimizer)."""

    name: str  # lamb | lans | adamw
    b1: float
    b2: float
    eps: float
    weight_decay: float
    max_global_norm: float | None  # None: no pre-clip
    exclude_norms_and_biases_from_trust_ratio: bool  # LAMB: NVIDIA's trust-ratio mask
    bias_correction: bool
    group_layers: bool = False  # per-layer trees updated stacked (optim.on_stacked_layers)


@dataclasses.dataclass(frozen=True)
class SchedulePlan:
    """The phase's learning-rate schedule (lambjax.train.optimizer.learning_rate_schedule)."""

    schedule: str  # poly_warmup | warmup_constant_decay | constant
    learning_rate: float
    num_steps: int  # the steps its warm-up and decay span: the phase's, or of phases joined
    start_step: int  # the span's steps before this phase (0 unless it continues another's)
    warmup_fraction: float
    constant_fraction: float
    decay_power: float


@dataclasses.dataclass(frozen=True)
class BatchGeometry:
    """How a phase's global batch is cut: over processes, micro-batches and devices."""

    global_batch_size: int  # sequences per optimizer step
    grad_accum_steps: int  # micro-batches per step
    data_parallel: int  # devices a micro-batch is split over (mesh data x fsdp)
    process_count: int
    max_seq_length: int
    max_predictions_per_seq: int

    @property
    def micro_batch_size(self) -> int:
        """Global rows of one micro-batch."""
        return self.global_batch_size // self.grad_accum_steps

    @property
    def per_device_micro_batch(self) -> int:
        return self.micro_batch_size // self.data_parallel

    @property
    def per_process_batch_size(self) -> int:
        """Rows of each step's global batch that one process reads."""
        return self.global_batch_size // self.process_count


@dataclasses.dataclass(frozen=True)
class PhasePlan:
    """Everything one phase is built from."""

    name: str
    index: int
    step_offset: int  # optimizer steps of all earlier phases (TensorBoard x axis, PLD)
    num_steps: int
    batch: BatchGeometry
    # At this phase's depth, as it runs on the plan's platform: its attention form and its
    # layer loop decided (`for_platform`).
    model: BertConfig
    optimizer: OptimizerPlan
    schedule: SchedulePlan
    optimizer_state: str  # at the phase's start: keep the previous moments, or reset
    mesh: Mapping[str, int]  # every mesh axis's size, -1 resolved
    step: step_lib.StepOptions  # the core train step's objective and layer schemes
    step_method: method_lib.StepMethod | None  # None: the core train step (lambjax.train.step)
    packing: packing_lib.Packing | None  # training rows of several examples; None: one
    previous: "PhasePlan | None"  # the phase before, whose final state this one starts from
    # The TPU slices each mesh axis spans (config.mesh.dcn; all 1 on one slice).
    mesh_dcn: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """The run: its phases in order, and what the loop does around them."""

    phases: tuple[PhasePlan, ...]
    seed: int
    prng_impl: str  # the training keys' PRNG (lambjax.train.prng): threefry | rbg | unsafe_rbg
    # lambjax.data.default_config() fields, with the run's data_dir (WORKDIR/data unless the
    # config names one) and a published start's vocabulary where data.vocab is "train".
    data: ml_collections.FrozenConfigDict
    tracking: ml_collections.FrozenConfigDict  # where metrics go besides TensorBoard
    log_every_steps: int
    eval_every_steps: int
    eval_batch_size: int
    eval_steps: int  # validation batches per evaluation; 0 = the whole split
    eval_at_start: bool  # also evaluate before the run's first step (at step 0)
    checkpoint_every_steps: int
    checkpoint_every_minutes: float  # also save by wall time; 0 = by steps only
    max_checkpoints_to_keep: int
    async_checkpointing: bool
    max_consecutive_nonfinite_steps: int
    peak_flops_per_device: float  # 0: look up by device kind
    profile: bool
    # The config with the data fields above, recorded in WORKDIR/config.json and with every
    # checkpoint (what a resume is compared with: lambjax.train.workdir).
    config_json: str
    # The held-out metric that ends the run (lambjax.train.target); None: every phase to its end.
    target: target_lib.Target | None = None
    # The models' vocab_size is the vocabulary's, which is built after the plan: until
    # `with_vocab_size` gives it, the models hold a stand-in (no check depends on it).
    vocab_size_from_data: bool = False

    @property
    def seq_lengths(self) -> list[int]:
        """The sequence lengths of the phases' datasets."""
        return sorted({phase.batch.max_seq_length for phase in self.phases})

    def with_vocab_size(self, vocab_size: int) -> "RunPlan":
        """The plan with the built vocabulary's size in every model, where the size was the
        data's to give (`vocab_size_from_data`); otherwise the plan as it is, whose models
        must embed every id of the vocabulary (ConfigError)."""
        if not self.vocab_size_from_data:
            embeddings = self.phases[0].model.vocab_size
            if vocab_size > embeddings:
                raise ConfigError(
                    f"config.model.overrides.vocab_size={embeddings} is smaller than the "
                    f"vocabulary's {vocab_size} tokens (config.data.vocab="
                    f"{self.data.vocab!r}): its last ids would have no embedding; valid: at "
                    f"least {vocab_size}, or unset (the vocabulary's size)"
                )
            return self
        phases, previous = [], None
        for phase in self.phases:
            model = dataclasses.replace(phase.model, vocab_size=vocab_size)
            previous = dataclasses.replace(phase, model=model, previous=previous)
            phases.append(previous)
        return dataclasses.replace(self, phases=tuple(phases), vocab_size_from_data=False)


# The models' vocab_size until the vocabulary is built (RunPlan.vocab_size_from_data).
_VOCAB_SIZE_STAND_IN = 8


def resolve(
    config,
    *,
    num_devices: int,
    process_count: int = 1,
    num_slices: int = 1,
    platform: str = "cpu",
    workdir: str | None = None,
    start: "published.Published | None" = None,
    vocab_size: int | None = None,
) -> RunPlan:
    """The run plan of `config`, checked; raises ConfigError naming the first bad field.

    The one reading of the config: nothing downstream reads it, and it is not changed.
    `num_devices`, `process_count`, `num_slices` and `platform` ('cpu', 'gpu', 'tpu') are the
    machine the run is planned for; `workdir` the run's (its data goes in WORKDIR/data unless
    config.data.data_dir names a place); `start` the published model `config.init` names
    (lambjax.train.published), whose shape, vocabulary and casing the run takes. The models'
    vocab_size is `model.overrides.vocab_size`, the start's, `vocab_size` (the vocabulary's),
    or, with none of them, the vocabulary's once it is built (`RunPlan.with_vocab_size`).
    """
    plan_checks.check_run(config, process_count)
    plan_checks.run_checks(
        lambda: data_lib.check_config(config.data), lambda: tracking.check(config.tracking)
    )
    method = method_lib.load(config.step_method)
    plan_checks.run_checks(  # the variants' own settings, before the phase plans hold them
        lambda: layer_drop.check_settings(config.layer_drop),
        lambda: method and method.check_settings(config),
        lambda: prng.check(config.prng_impl),
        lambda: standardization.check_site(config.standardization_loss.site),
        lambda: noise_scale.check_settings(config.noise_scale),
        lambda: target_lib.from_config(config.target),
    )
    spans = {}
    plan_checks.run_checks(
        lambda: spans.update(layerwise.schedule_spans(config.phases, config.phase_order))
    )
    if start is not None:
        vocab_size = start.model_config.vocab_size
    from_data = vocab_size is None and "vocab_size" not in config.model.overrides
    step_method = method.plan(config) if method else None
    phases, previous, step_offset = [], None, 0
    for index, name in enumerate(config.phase_order):
        phase = _phase(
            config,
            name,
            index=index,
            step_offset=step_offset,
            previous=previous,
            schedule_span=spans[name],
            step_method=step_method,
            vocab_size=_VOCAB_SIZE_STAND_IN if vocab_size is None else vocab_size,
            num_devices=num_devices,
            process_count=process_count,
            num_slices=num_slices,
            platform=platform,
        )
        phases.append(phase)
        previous, step_offset = phase, step_offset + phase.num_steps
    plan_checks.run_checks(  # the variants against the phase plans
        lambda: layer_drop.check(config.layer_drop, phases),
        lambda: standardization.check(config.standardization_loss.weight, phases),
        lambda: layerwise.check(phases),
        lambda: method and method.check(config, phases),
        lambda: plan_checks.check_method_axes(phases),
        lambda: reduction.check(config.gradient_reduction, phases),
        lambda: noise_scale.check(config.noise_scale.enabled, phases),
    )
    data = run_data(config, workdir=workdir, start=start)
    if start is not None:
        published.check_model(start, phases[0].model)
    return RunPlan(
        phases=tuple(phases),
        seed=config.seed,
        prng_impl=config.prng_impl,
        data=ml_collections.FrozenConfigDict(data),
        tracking=ml_collections.FrozenConfigDict(config.tracking),
        log_every_steps=config.log_every_steps,
        eval_every_steps=config.eval_every_steps,
        eval_batch_size=config.eval_batch_size,
        eval_steps=config.eval_steps,
        eval_at_start=config.eval_at_start,
        checkpoint_every_steps=config.checkpoint_every_steps,
        checkpoint_every_minutes=config.checkpoint_every_minutes,
        max_checkpoints_to_keep=config.max_checkpoints_to_keep,
        async_checkpointing=config.async_checkpointing,
        max_consecutive_nonfinite_steps=config.max_consecutive_nonfinite_steps,
        peak_flops_per_device=config.peak_flops_per_device,
        profile=config.profile,
        config_json=_with_data(config, data).to_json_best_effort(),
        target=target_lib.from_config(config.target),
        vocab_size_from_data=from_data,
    )


def run_data(config, *, workdir: str | None = None, start=None) -> ml_collections.ConfigDict:
    """`config.data` as the run uses it (a copy; the config is not changed): a config that
    names no data_dir keeps its vocabulary and datasets with its run, in WORKDIR/data, so that
    deleting the workdir starts over (data shared by several runs is an explicit
    `--config.data.data_dir`); a run from a published model (`start`) takes its vocabulary."""
    data = copy.deepcopy(config.data)
    if not data.data_dir and workdir:
        data.data_dir = f"{storage.resolve(workdir).rstrip('/')}/data"
    if start is not None:
        plan_checks.run_checks(lambda: setattr(data, "vocab", published.vocabulary(start, data)))
    return data


def _with_data(config, data: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of `config` whose data fields are `data`."""
    recorded = copy.deepcopy(config)
    recorded.data = data
    return recorded


def _phase(
    config,
    name: str,
    *,
    index: int,
    step_offset: int,
    previous: PhasePlan | None,
    schedule_span: tuple[int, int],
    step_method,
    vocab_size: int,
    num_devices: int,
    process_count: int,
    num_slices: int,
    platform: str,
) -> PhasePlan:
    phase, where = config.phases[name], f"config.phases.{name}"
    plan_checks.check_phase_fields(phase, where)
    optimizer = _optimizer(config, name)
    if previous is not None and phase.optimizer_state == "keep":
        if previous.optimizer.name != optimizer.name:
            raise ConfigError(
                f"{where}.optimizer_state='keep' needs the same optimizer as phase "
                f"{previous.name!r}; set it to 'reset' to change optimizers"
            )
    mesh, mesh_dcn = _mesh(config, name, num_devices, num_slices, where)
    model = _model(config, name, vocab_size)
    if phase.max_seq_length > model.max_position_embeddings:
        raise ConfigError(
            f"{where}.max_seq_length={phase.max_seq_length} exceeds the model's "
            f"max_position_embeddings={model.max_position_embeddings}"
        )
    batch = _batch_geometry(phase, mesh, where, process_count)
    if config.eval_batch_size % batch.data_parallel:
        raise ConfigError(
            f"config.eval_batch_size={config.eval_batch_size} does not divide over phase "
            f"{name!r}'s {batch.data_parallel} data-parallel devices (mesh data x fsdp); "
            f"valid: multiples of {batch.data_parallel}"
        )
    scan_by_platform = "scan_layers" not in config.model.overrides
    return PhasePlan(
        name=name,
        index=index,
        step_offset=step_offset,
        num_steps=phase.num_steps,
        batch=batch,
        model=for_platform(model, platform, scan_by_platform, name),
        optimizer=optimizer,
        schedule=_schedule(phase, schedule_span),
        optimizer_state=phase.optimizer_state,
        mesh=mesh,
        mesh_dcn=mesh_dcn,
        step=step_lib.StepOptions.from_config(config, name, step_offset),
        step_method=step_method,
        packing=_packing(config.data, phase.max_seq_length),
        previous=previous,
    )


def for_platform(model: BertConfig, platform: str, scan_by_platform: bool, name: str) -> BertConfig:
    """`model` as phase `name` runs it on `platform` ('cpu', 'gpu', 'tpu'): attention 'auto'
    decided (lambjax.models.attention), and on a GPU the layers unrolled where the config
    leaves `model.overrides.scan_layers` to the platform (`scan_by_platform`; the faster form
    there: docs/performance.md)."""
    if platform == "gpu" and scan_by_platform:
        model = dataclasses.replace(model, scan_layers=False)
    try:
        return attention.resolve(model, platform)
    except ValueError as e:  # an attention kernel this platform does not have
        raise ConfigError(f"config.model (phase {name!r}): {e}") from None


def _schedule(phase, span: tuple[int, int]) -> SchedulePlan:
    """The phase's schedule over `span` = (steps it spans, its steps before the phase)."""
    return SchedulePlan(
        schedule=phase.schedule,
        learning_rate=phase.learning_rate,
        num_steps=span[0],
        start_step=span[1],
        warmup_fraction=phase.warmup_fraction,
        constant_fraction=phase.constant_fraction,
        decay_power=phase.decay_power,
    )


def _packing(data_config, max_seq_length: int) -> packing_lib.Packing | None:
    try:
        return packing_lib.resolve(
            data_config.packing, data_config.packing_max_examples, max_seq_length
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _overrides(fields: ml_collections.ConfigDict) -> dict:
    return {k: v for k, v in fields.to_dict().items() if v is not None}


def _optimizer(config, name: str) -> OptimizerPlan:
    """The top-level optimizer with the phase's overrides applied."""
    overrides = _overrides(config.phases[name].optimizer)
    plan_checks.check_optimizer(overrides, f"config.phases.{name}.optimizer")
    merged = {**config.optimizer.to_dict(), **overrides}
    if merged["name"] not in OPTIMIZERS:
        raise ConfigError(
            f"optimizer name {merged['name']!r} (config.phases.{name}); valid: {OPTIMIZERS}"
        )
    return OptimizerPlan(**merged)


def _mesh(config, name: str, num_devices: int, num_slices: int, where: str):
    """(the phase's mesh axis sizes, the slices each spans)."""
    merged = {**config.mesh.to_dict(), **_overrides(config.phases[name].mesh)}
    dcn = merged.pop("dcn", {})
    try:
        return sharding.mesh_layout(merged, dcn, num_devices, num_slices)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from e


def _model(config, name: str, vocab_size: int) -> BertConfig:
    """The model of the run, at the phase's depth if the phase sets one."""
    overrides = dict(config.model.overrides.to_dict())
    overrides.setdefault("vocab_size", vocab_size)
    if config.phases[name].num_layers is not None:
        overrides["num_layers"] = config.phases[name].num_layers
    try:
        return BertConfig.preset(config.model.preset, **overrides)
    except (TypeError, ValueError) as e:  # no such field, or values BertConfig rejects
        raise ConfigError(f"config.model (phase {name!r}): {e}") from e


def _batch_geometry(phase, mesh: dict, where: str, process_count: int) -> BatchGeometry:
    data_parallel = mesh["data"] * mesh["fsdp"]
    accum = grad_accum_steps(phase, data_parallel, where)
    if phase.global_batch_size % accum:
        raise ConfigError(
            f"{where}.global_batch_size={phase.global_batch_size} is not divisible by "
            f"grad_accum_steps={accum}"
        )
    micro_batch = phase.global_batch_size // accum
    if micro_batch % data_parallel:
        raise ConfigError(
            f"{where}: the micro-batch global_batch_size/grad_accum_steps = "
            f"{phase.global_batch_size}/{accum} = {micro_batch} does not divide over the "
            f"{data_parallel} data-parallel devices (mesh data x fsdp); valid micro-batches are "
            f"multiples of {data_parallel}"
        )
    if phase.global_batch_size % process_count:
        raise ConfigError(
            f"{where}.global_batch_size={phase.global_batch_size} does not divide over "
            f"{process_count} processes"
        )
    return BatchGeometry(
        global_batch_size=phase.global_batch_size,
        grad_accum_steps=accum,
        data_parallel=data_parallel,
        process_count=process_count,
        max_seq_length=phase.max_seq_length,
        max_predictions_per_seq=phase.max_predictions_per_seq,
    )


def grad_accum_steps(phase, data_parallel: int, where: str = "config.phases.<phase>") -> int:
    """The phase's micro-batches per step on `data_parallel` (mesh data x fsdp) devices.

    `grad_accum_steps` where given; else global_batch_size / (micro_batch_per_device x
    data_parallel), which must be a whole number >= 1; else 1.
    """
    if phase.grad_accum_steps is not None:
        if phase.grad_accum_steps <= 0:
            raise ConfigError(
                f"{where}.grad_accum_steps={phase.grad_accum_steps} must be a positive integer"
            )
        return phase.grad_accum_steps
    per_device = phase.micro_batch_per_device
    if per_device is None:
        return 1
    if per_device <= 0:
        raise ConfigError(f"{where}.micro_batch_per_device={per_device} must be a positive integer")
    batch, micro_batch = phase.global_batch_size, per_device * data_parallel
    if batch % micro_batch:
        fits = [m for m in range(1, batch // data_parallel + 1) if batch % (m * data_parallel) == 0]
        valid = (
            f"valid micro_batch_per_device: {_few(fits)}"
            if fits
            else (f"no micro-batch fits: {batch} is not a multiple of {data_parallel}")
        )
        raise ConfigError(
            f"{where}: global_batch_size={batch} is not a whole number of micro-batches of "
            f"micro_batch_per_device={per_device} x {data_parallel} data-parallel devices = "
            f"{micro_batch} rows; {valid}"
        )
    return batch // micro_batch


def _few(values: list[int]) -> str:
    return (
        ", ".join(map(str, values))
        if len(values) <= 8
        else (", ".join(map(str, values[:4])) + ", ..., " + ", ".join(map(str, values[-2:])))
    )
