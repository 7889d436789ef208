"""The experiment config: its fields, the building blocks the files in configs/ share, and
its validation.

A config is an `ml_collections.ConfigDict`:

  seed, workdir-independent run settings (log/eval/checkpoint intervals, ...)
  model:      a preset name plus field overrides for `lambjax.models.bert.BertConfig`
  data:       `lambjax.data.default_config()` (source, vocab, ...)
  optimizer:  the default optimizer of every phase (name, betas, weight decay, clipping)
  mesh:       the default device mesh of every phase ({data, fsdp, tensor, stage} sizes;
              -1 = rest)
  layer_drop: progressive layer dropping (off by default; lambjax.train.layer_drop)
  standardization_loss: its weight (0: off; lambjax.models.standardization)
  ouroboros:  model parallelism with delayed gradients: its number of modules K (1: off) and
              how a module replays (lambjax.train.ouroboros); needs mesh stage = K - 1
  phases:     name -> phase (sequence length, global batch, accumulation, steps, schedule,
              optional `optimizer` / `mesh` overrides, and the encoder depth and frozen
              bottom layers of a multi-stage layerwise training stage: lambjax.train.stacking)
  phase_order: the phase names in the order they run.

The recipes are the files in configs/; the variants every config accepts (`runlocal`, `pld`,
`mslt`, `chunked_accumulation`, `standardization_loss`, `ouroboros`) are in
lambjax.train.variants.
"""

import ml_collections

from lambjax import data as data_lib
from lambjax.models import bert

OPTIMIZERS = ("lamb", "lans", "adamw")
SCHEDULES = ("poly_warmup", "warmup_constant_decay", "constant")
OPTIMIZER_STATE_AT_PHASE_START = ("keep", "reset")


class ConfigError(ValueError):
    """A config that cannot run; the message names the field and the valid values."""


def optimizer_config(name: str = "lamb") -> ml_collections.ConfigDict:
    """NVIDIA's BERT recipe settings; `lans` takes the same fields where they apply."""
    return ml_collections.ConfigDict(
        {
            "name": name,
            "b1": 0.9,
            "b2": 0.999,
            "eps": 1e-6,
            "weight_decay": 0.01,
            # Global gradient-norm pre-clip (NVIDIA and the LANS scripts: 1.0); None = off.
            "max_global_norm": 1.0,
            # LAMB only: no trust ratio for biases and LayerNorm (NVIDIA's recipe). False
            # gives the paper's / optax's LAMB, where every tensor gets a ratio.
            "exclude_norms_and_biases_from_trust_ratio": True,
            "bias_correction": True,
        }
    )


def _unset_fields(example) -> ml_collections.ConfigDict:
    """The same fields, each None (settable from the command line with its type)."""
    return ml_collections.ConfigDict(
        {
            k: ml_collections.FieldReference(None, field_type=type(v) if v is not None else float)
            for k, v in dict(example).items()
        }
    )


def _overrides(fields: ml_collections.ConfigDict) -> dict:
    return {k: v for k, v in fields.to_dict().items() if v is not None}


def phase_config(
    *,
    max_seq_length: int,
    max_predictions_per_seq: int,
    global_batch_size: int,
    num_steps: int,
    learning_rate: float,
    schedule: str = "poly_warmup",
    warmup_fraction: float = 0.01,
    constant_fraction: float = 0.0,
    grad_accum_steps: int | None = None,
    micro_batch_per_device: int | None = None,
    optimizer_state: str = "keep",
    num_layers: int | None = None,
    frozen_layers: int = 0,
) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        {
            "max_seq_length": max_seq_length,
            "max_predictions_per_seq": max_predictions_per_seq,
            "global_batch_size": global_batch_size,
            # The gradient accumulation: `grad_accum_steps` micro-batches per step where it
            # is given; else derived from the rows each data-parallel device computes at once,
            # global_batch_size / (micro_batch_per_device x data-parallel devices), so that
            # one recipe fits any pod; with neither, 1.
            "grad_accum_steps": ml_collections.FieldReference(grad_accum_steps, field_type=int),
            "micro_batch_per_device": ml_collections.FieldReference(
                micro_batch_per_device, field_type=int
            ),
            "num_steps": num_steps,
            "learning_rate": learning_rate,
            "schedule": schedule,
            "warmup_fraction": warmup_fraction,
            "constant_fraction": constant_fraction,
            # NVIDIA: poly power 0.5; LANS: linear decay (degree 1).
            "decay_power": 0.5 if schedule == "poly_warmup" else 1.0,
            # At the start of a later phase: keep the previous phase's moments (with the
            # step count and bias correction restarted, as NVIDIA's phase 2) or start fresh.
            "optimizer_state": optimizer_state,
            # Multi-stage layerwise training: this phase's encoder depth (None: the model's)
            # and how many bottom layers run forward only (not trained, no optimizer state).
            # A deeper phase than the one before grows the encoder by copying its top layers.
            "num_layers": ml_collections.FieldReference(num_layers, field_type=int),
            "frozen_layers": frozen_layers,
            # Overrides of the top-level optimizer / mesh for this phase only (None: inherit),
            # e.g. --config.phases.phase2.optimizer.name=lans.
            "optimizer": _unset_fields(optimizer_config()),
            "mesh": _unset_fields({"data": 1, "fsdp": 1, "tensor": 1, "stage": 1}),
        }
    )


def base_config() -> ml_collections.ConfigDict:
    """Fields every experiment has, with the embedded tiny demo's values."""
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.model = ml_collections.ConfigDict(
        {
            "preset": "tiny",
            # Fields of BertConfig to override; vocab_size defaults to the data's vocab.
            "overrides": ml_collections.ConfigDict({"dtype": "bfloat16"}),
        }
    )
    config.data = data_lib.default_config()
    config.optimizer = optimizer_config("lamb")
    config.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1, "stage": 1})
    # Progressive layer dropping (needs model layer_norm="pre"): keep probability
    # theta(t) = (1 - theta_bar) exp(-gamma t) + theta_bar, t = optimizer steps of the run.
    config.layer_drop = ml_collections.ConfigDict(
        {"enabled": False, "theta_bar": 0.5, "gamma": 0.001}
    )
    # The standardization loss (Collins et al. 2019): weight lambda of L_std in the objective,
    # for a model with model.overrides.normalization="none"; 0 = off.
    config.standardization_loss = ml_collections.ConfigDict({"weight": 0.0})
    # Ouroboros (Yang et al. 2019): the encoder cut into num_modules modules on num_modules - 1
    # pipeline stages (mesh axis `stage`), each updated with a delayed gradient; 1 = off.
    # replay: "stale" (the delayed gradient exactly, as DDG defines it; keeps the last
    # num_modules - 1 steps' weights) or "current" (Features Replay: current weights).
    # synchronous_steps: a warm-up of that many steps of ordinary backpropagation at the
    # start of every phase, before the pipeline fills (the paper mentions a warm-up whose
    # form could not be read; the recipes' learning-rate warm-up applies either way).
    config.ouroboros = ml_collections.ConfigDict(
        {"num_modules": 1, "replay": "stale", "synchronous_steps": 0}
    )
    config.phases = ml_collections.ConfigDict()
    config.phase_order = ()
    config.log_every_steps = 10
    config.eval_every_steps = 100
    config.eval_batch_size = 32
    # Validation batches per evaluation; 0 = the whole held-out split.
    config.eval_steps = 0
    config.checkpoint_every_steps = 100
    # Also save once this many minutes of wall time have passed since the last save (checked
    # at log steps, decided by process 0 for all): a preemption without notice then loses at
    # most about this much work. 0 = by steps only.
    config.checkpoint_every_minutes = 30.0
    config.max_checkpoints_to_keep = 3
    config.async_checkpointing = True
    # Stop when this many consecutive steps had a non-finite loss or gradient.
    config.max_consecutive_nonfinite_steps = 10
    # Peak FLOP/s of one device, for MFU; 0 = look up by device kind (unknown: no MFU).
    config.peak_flops_per_device = 0.0
    # Capture a profile of a few steps into the workdir (clu Profile action).
    config.profile = False
    return config


def pod_config(preset: str) -> ml_collections.ConfigDict:
    """The fields of a pod-scale BERT run that are not the optimizer recipe: BERT's
    vocabulary size, Wikipedia as the corpus, and log/eval/checkpoint intervals."""
    config = base_config()
    config.model.preset = preset
    config.data.source = "tfds:wikipedia/20230601.en"
    config.data.vocab_size = 30522
    config.log_every_steps = 10
    config.eval_every_steps = 500
    config.eval_batch_size = 1024
    config.eval_steps = 10
    config.checkpoint_every_steps = 200
    return config


def with_phases(config: ml_collections.ConfigDict, **phases) -> ml_collections.ConfigDict:
    """Sets `config.phases` and `config.phase_order` from keyword arguments, in order."""
    config.phases = ml_collections.ConfigDict(phases)
    config.phase_order = tuple(phases)
    return config


def phase_optimizer(config, phase_name: str) -> ml_collections.ConfigDict:
    """The top-level optimizer config with the phase's overrides applied."""
    merged = ml_collections.ConfigDict(config.optimizer.to_dict())
    merged.update(_overrides(config.phases[phase_name].optimizer))
    return merged


def phase_mesh(config, phase_name: str) -> dict[str, int]:
    merged = dict(config.mesh.to_dict())
    merged.update(_overrides(config.phases[phase_name].mesh))
    return merged


def model_config(config, vocab_size: int, phase_name: str | None = None) -> bert.BertConfig:
    """The model of the run, at the depth of phase `phase_name` if that phase sets one."""
    overrides = dict(config.model.overrides.to_dict())
    overrides.setdefault("vocab_size", vocab_size)
    if phase_name is not None and config.phases[phase_name].num_layers is not None:
        overrides["num_layers"] = config.phases[phase_name].num_layers
    try:
        return bert.BertConfig.preset(config.model.preset, **overrides)
    except (TypeError, ValueError) as e:  # no such field, or values BertConfig rejects
        where = f"config.model (phase {phase_name!r})" if phase_name else "config.model"
        raise ConfigError(f"{where}: {e}") from e


def validate(config, *, num_devices: int, process_count: int = 1) -> None:
    """Checks everything that can be checked before any data or model is built."""
    if not config.phase_order:
        raise ConfigError("config.phase_order is empty: name at least one phase")
    unknown = [p for p in config.phase_order if p not in config.phases]
    if unknown:
        raise ConfigError(
            f"config.phase_order names {unknown}, which are not in config.phases "
            f"({sorted(config.phases.keys())})"
        )
    for field in ("log_every_steps", "eval_every_steps", "checkpoint_every_steps"):
        if config[field] <= 0:
            raise ConfigError(f"config.{field}={config[field]} must be a positive integer")
    if not config.checkpoint_every_minutes >= 0:
        raise ConfigError(
            f"config.checkpoint_every_minutes={config.checkpoint_every_minutes} must be >= 0 "
            "(0: checkpoints by steps only)"
        )
    if config.eval_batch_size <= 0 or config.eval_batch_size % process_count:
        raise ConfigError(
            f"config.eval_batch_size={config.eval_batch_size} must be positive and divisible "
            f"by the number of processes ({process_count})"
        )
    for index, name in enumerate(config.phase_order):
        validate_phase(config, name, index, num_devices=num_devices, process_count=process_count)
    validate_layer_schemes(config)
    validate_ouroboros(config, num_devices)


def validate_layer_schemes(config) -> None:
    """Progressive layer dropping and the stages of multi-stage layerwise training."""
    drop = config.layer_drop
    if drop.enabled:
        if not 0 < drop.theta_bar <= 1:
            raise ConfigError(f"config.layer_drop.theta_bar={drop.theta_bar} must lie in (0, 1]")
        if drop.gamma < 0:
            raise ConfigError(f"config.layer_drop.gamma={drop.gamma} must be >= 0")
        layer_norm = model_config(config, vocab_size=1).layer_norm
        if layer_norm != "pre":
            raise ConfigError(
                f"config.layer_drop.enabled=True needs PreLN blocks (the paper's switchable "
                f"transformer blocks), but the model has layer_norm={layer_norm!r}; set "
                f"--config.model.overrides.layer_norm=pre"
            )
    weight = config.standardization_loss.weight
    if weight < 0:
        raise ConfigError(f"config.standardization_loss.weight={weight} must be >= 0")
    if weight > 0 and model_config(config, vocab_size=1).normalization != "none":
        raise ConfigError(
            f"config.standardization_loss.weight={weight} replaces the encoder's LayerNorms, "
            f"but the model has normalization='layer_norm'; set "
            f"--config.model.overrides.normalization=none (or the variant standardization_loss)"
        )
    previous = None
    for name in config.phase_order:
        phase, where = config.phases[name], f"config.phases.{name}"
        depth = model_config(config, vocab_size=1, phase_name=name).num_layers
        if not 0 <= phase.frozen_layers < depth:
            raise ConfigError(
                f"{where}.frozen_layers={phase.frozen_layers} must lie in [0, {depth}) for "
                f"its {depth} layers (at least the top layer trains)"
            )
        if previous is not None:
            previous_phase, previous_depth = previous
            if depth < previous_depth:
                raise ConfigError(
                    f"{where} has {depth} layers, fewer than the {previous_depth} of the phase "
                    f"before it: stages may only grow the encoder"
                )
            changed = depth != previous_depth or phase.frozen_layers != (
                previous_phase.frozen_layers
            )
            if changed and phase.optimizer_state == "keep":
                raise ConfigError(
                    f"{where} changes the trained layers (depth {previous_depth} -> {depth}, "
                    f"frozen {previous_phase.frozen_layers} -> {phase.frozen_layers}), so the "
                    f"optimizer state cannot be kept: set {where}.optimizer_state='reset'"
                )
        previous = (phase, depth)


def validate_ouroboros(config, num_devices: int) -> None:
    """Ouroboros' modules against the model's depth, the mesh and the other schemes."""
    from lambjax import sharding
    from lambjax.train import ouroboros

    modules, replay = config.ouroboros.num_modules, config.ouroboros.replay
    if not isinstance(modules, int) or modules < 1:
        raise ConfigError(f"config.ouroboros.num_modules={modules!r} must be an integer >= 1")
    warmup = config.ouroboros.synchronous_steps
    if not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"config.ouroboros.synchronous_steps={warmup!r} must be an integer >= 0")
    if replay not in ouroboros.REPLAYS:
        raise ConfigError(f"config.ouroboros.replay={replay!r}; valid: {ouroboros.REPLAYS}")
    on = modules > 1
    if on and config.layer_drop.enabled:
        raise ConfigError(
            "config.ouroboros.num_modules > 1 and config.layer_drop.enabled=True: Ouroboros "
            "runs every layer of every step; turn one of them off"
        )
    if on and config.standardization_loss.weight > 0:
        raise ConfigError(
            "config.ouroboros.num_modules > 1 with config.standardization_loss.weight > 0: "
            "the pipeline carries no standardization loss; turn one of them off"
        )
    for name in config.phase_order:
        where = f"config.phases.{name}"
        mesh = sharding.mesh_shape(phase_mesh(config, name), num_devices)
        if not on:
            if mesh["stage"] > 1:
                raise ConfigError(
                    f"{where}: mesh stage={mesh['stage']} splits the encoder into pipeline "
                    f"stages, which only Ouroboros runs; set --config.ouroboros.num_modules="
                    f"{mesh['stage'] + 1} (or the variant ouroboros), or mesh stage=1"
                )
            continue
        if mesh["stage"] != modules - 1 or mesh["fsdp"] != 1 or mesh["tensor"] != 1:
            raise ConfigError(
                f"{where}: config.ouroboros.num_modules={modules} runs on a mesh data x stage "
                f"with stage={modules - 1} (the first and the last module share a stage) and "
                f"fsdp=tensor=1, but the mesh is {mesh}; set --config.mesh.stage={modules - 1}"
            )
        if config.phases[name].frozen_layers:
            raise ConfigError(
                f"{where}.frozen_layers={config.phases[name].frozen_layers}: Ouroboros trains "
                f"every layer (no multi-stage layerwise training)"
            )
        depth = model_config(config, vocab_size=1, phase_name=name).num_layers
        try:
            ouroboros.check(modules, depth)
        except ValueError as e:
            raise ConfigError(f"config.ouroboros ({where}, {depth} layers): {e}") from None


def validate_phase(config, name: str, index: int, *, num_devices: int, process_count: int):
    phase = config.phases[name]
    where = f"config.phases.{name}"
    for field in ("max_seq_length", "max_predictions_per_seq", "global_batch_size", "num_steps"):
        if phase[field] <= 0:
            raise ConfigError(f"{where}.{field}={phase[field]} must be a positive integer")
    if phase.max_predictions_per_seq > phase.max_seq_length:
        raise ConfigError(
            f"{where}.max_predictions_per_seq={phase.max_predictions_per_seq} exceeds "
            f"max_seq_length={phase.max_seq_length}"
        )
    if phase.learning_rate <= 0:
        raise ConfigError(f"{where}.learning_rate={phase.learning_rate} must be positive")
    if phase.schedule not in SCHEDULES:
        raise ConfigError(f"{where}.schedule={phase.schedule!r}; valid: {SCHEDULES}")
    if not 0 <= phase.warmup_fraction + phase.constant_fraction <= 1:
        raise ConfigError(
            f"{where}: warmup_fraction + constant_fraction = "
            f"{phase.warmup_fraction + phase.constant_fraction} must lie in [0, 1]"
        )
    if phase.optimizer_state not in OPTIMIZER_STATE_AT_PHASE_START:
        raise ConfigError(
            f"{where}.optimizer_state={phase.optimizer_state!r}; "
            f"valid: {OPTIMIZER_STATE_AT_PHASE_START}"
        )
    optimizer = phase_optimizer(config, name)
    if optimizer.name not in OPTIMIZERS:
        raise ConfigError(f"optimizer name {optimizer.name!r} ({where}); valid: {OPTIMIZERS}")
    if index > 0 and phase.optimizer_state == "keep":
        previous = config.phase_order[index - 1]
        if phase_optimizer(config, previous).name != optimizer.name:
            raise ConfigError(
                f"{where}.optimizer_state='keep' needs the same optimizer as phase "
                f"{previous!r}; set it to 'reset' to change optimizers"
            )
    mesh = phase_mesh(config, name)
    data_parallel = _data_parallel_size(mesh, num_devices, where)
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


def grad_accum_steps_on(phase, mesh) -> int:
    """`grad_accum_steps` of a phase on its built jax Mesh (data-parallel: data x fsdp)."""
    return grad_accum_steps(phase, mesh.shape["data"] * mesh.shape["fsdp"])


def _few(values: list[int]) -> str:
    return (
        ", ".join(map(str, values))
        if len(values) <= 8
        else (", ".join(map(str, values[:4])) + ", ..., " + ", ".join(map(str, values[-2:])))
    )


def _data_parallel_size(mesh: dict, num_devices: int, where: str) -> int:
    from lambjax import sharding

    try:
        shape = sharding.mesh_shape(mesh, num_devices)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from e
    return shape["data"] * shape["fsdp"]
