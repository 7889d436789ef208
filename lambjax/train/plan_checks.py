"""The plan's own checks: the run's and the phases' fields, and the mesh axes a step method
brings.

The features' checks live beside each feature (lambjax.train.plan lists them);
`run_checks` runs them, turning the ValueErrors that name a config field into ConfigErrors.
"""

import math

from lambjax import ranges
from lambjax.train.config import (
    OPTIMIZER_STATE_AT_PHASE_START,
    SCHEDULES,
    ConfigError,
)


def run_checks(*checks) -> None:
    """Runs the features' checks, each in its feature's module; their ValueErrors, which
    name the config field, become ConfigErrors."""
    for check in checks:
        try:
            check()
        except ConfigError:
            raise
        except ValueError as error:
            raise ConfigError(str(error)) from None


# The run's and a phase's numeric fields with a range (those not checked elsewhere).
RUN_RANGES = (
    ("seed", "[0, inf)", True),  # numpy's generators take no negative seed
    ("eval_steps", "[0, inf)", True),
    ("max_checkpoints_to_keep", "[1, inf)", True),
    ("max_consecutive_nonfinite_steps", "[1, inf)", True),
    ("peak_flops_per_device", "[0, inf)", False),
)
PHASE_RANGES = (
    ("warmup_fraction", "[0, 1]", False),
    ("constant_fraction", "[0, 1]", False),
    ("decay_power", "[0, inf)", False),
    ("frozen_layers", "[0, inf)", True),
)
OPTIMIZER_RANGES = (
    ("b1", "[0, 1)", False),
    ("b2", "[0, 1)", False),
    ("eps", "(0, inf)", False),
    ("weight_decay", "[0, inf)", False),
)


def check_range(field: str, value, interval: str, integer: bool = False) -> None:
    """ConfigError unless `value` lies in `interval` (lambjax.ranges)."""
    try:
        ranges.check(field, value, interval, integer=integer)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check_optimizer(fields: dict, where: str) -> None:
    """The optimizer's numbers among `fields` (all of config.optimizer, or a phase's
    overrides); `where` names the config group they come from."""
    for field, interval, integer in OPTIMIZER_RANGES:
        if fields.get(field) is not None:
            check_range(f"{where}.{field}", fields[field], interval, integer)
    if fields.get("max_global_norm") is not None:
        check_range(f"{where}.max_global_norm", fields["max_global_norm"], "(0, inf)")


# The mesh axes the core train step runs on; any other axis belongs to a step method.
CORE_MESH_AXES = ("data", "fsdp", "tensor")


def check_method_axes(phases) -> None:
    """A mesh axis the core train step does not run on (e.g. `stage`) may be larger than 1
    only in a phase whose step method runs on it (`StepMethod.mesh_axes`)."""
    for phase in phases:
        claimed = getattr(phase.step_method, "mesh_axes", ())
        for axis, size in phase.mesh.items():
            if size > 1 and axis not in CORE_MESH_AXES and axis not in claimed:
                raise ConfigError(
                    f"config.phases.{phase.name}: mesh {axis}={size} is an axis the core "
                    f"train step does not run on (it runs on {', '.join(CORE_MESH_AXES)}); "
                    f"set mesh {axis}=1, or a config.step_method that runs on it"
                )


def check_run(config, process_count: int) -> None:
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
    for field, interval, integer in RUN_RANGES:
        check_range(f"config.{field}", config[field], interval, integer)
    check_optimizer(config.optimizer.to_dict(), "config.optimizer")
    check_range(
        "config.standardization_loss.weight", config.standardization_loss.weight, "[0, inf)"
    )
    if config.eval_batch_size <= 0 or config.eval_batch_size % process_count:
        raise ConfigError(
            f"config.eval_batch_size={config.eval_batch_size} must be positive and divisible "
            f"by the number of processes ({process_count})"
        )


def check_phase_fields(phase, where: str) -> None:
    for field in ("max_seq_length", "max_predictions_per_seq", "global_batch_size", "num_steps"):
        if phase[field] <= 0:
            raise ConfigError(f"{where}.{field}={phase[field]} must be a positive integer")
    if phase.max_predictions_per_seq > phase.max_seq_length:
        raise ConfigError(
            f"{where}.max_predictions_per_seq={phase.max_predictions_per_seq} exceeds "
            f"max_seq_length={phase.max_seq_length}"
        )
    if not (math.isfinite(phase.learning_rate) and phase.learning_rate > 0):
        raise ConfigError(
            f"{where}.learning_rate={phase.learning_rate} must be positive and finite (> 0)"
        )
    for field, interval, integer in PHASE_RANGES:
        check_range(f"{where}.{field}", phase[field], interval, integer)
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
