"""What a sweep is: trials, each a set of config overrides, defined beside the config.

A config file may define `get_sweep(arg)` beside `get_config(arg)`, returning a list of
override dicts (dotted field names, as on the command line):

  def get_sweep(arg=None):
      return spec.product(
          {"phases.phase1.learning_rate": [4e-3, 6e-3, 8e-3]},
          {"phases.phase1.warmup_fraction": [0.1, 0.2843]},
      )

`product` makes the grid of its arguments; `zipped` pairs values up (one trial per position);
a list of dicts is concatenated by `+`. Each trial is named after its overrides
(`phase1.learning_rate=0.004,phase1.warmup_fraction=0.1`), which is its folder in the
sweep's directory; `labelled(overrides, **labels)` names it by labels instead
(`optimizer=lamb,batch=64`), for trials whose overrides are many or derived, and the labels
are kept in sweep.json for the report to group trials by. `trials(config, sweep)` validates
the sweep against the config before any trial runs: every field exists, every value has the
field's type, the sweep is not empty, no two trials are the same.
"""

import dataclasses
import itertools

import ml_collections


class SweepError(ValueError):
    """A sweep that cannot run; the message names the trial, field and value."""


@dataclasses.dataclass(frozen=True)
class Trial:
    name: str
    overrides: dict
    labels: dict = dataclasses.field(default_factory=dict)

    def flags(self) -> list[str]:
        """The overrides as `lambjax.main` flags."""
        return [f"--config.{key}={format_value(value)}" for key, value in self.overrides.items()]


def study_size(arg, sizes: dict, default: str = "cpu") -> tuple[str, dict]:
    """(name, settings) of the size a study's config `arg` names (None: `default`)."""
    size = arg or default
    if size not in sizes:
        raise ValueError(f"size {size!r}; valid: {', '.join(sizes)}")
    return size, sizes[size]


def product(*axes: dict) -> list[dict]:
    """The grid: one trial for every combination of the axes' values.

    Each axis is a dict of field -> list of values; the fields of one axis move together
    (`{"a": [1, 2], "b": [3, 4]}` gives a=1,b=3 and a=2,b=4).
    """
    columns = [zipped(axis) for axis in axes]
    return [
        dict(item for part in combo for item in part.items())
        for combo in itertools.product(*columns)
    ]


def zipped(fields: dict) -> list[dict]:
    """One trial per position of the fields' equally long value lists."""
    lengths = {key: len(values) for key, values in fields.items()}
    if len(set(lengths.values())) > 1:
        raise SweepError(f"zipped fields need value lists of one length, got {lengths}")
    return [dict(zip(fields, values, strict=True)) for values in zip(*fields.values(), strict=True)]


class Labelled(dict):
    """A trial's overrides with the labels that name it (see `labelled`)."""

    def __init__(self, overrides: dict, labels: dict):
        super().__init__(overrides)
        self.labels = dict(labels)


def labelled(overrides: dict, **labels) -> Labelled:
    """The trial `overrides`, named `k1=v1,k2=v2` after `labels` rather than its overrides."""
    if not labels:
        raise SweepError(f"labelled() needs at least one label for {overrides!r}")
    return Labelled(overrides, labels)


def format_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return repr(value)
    return str(value)


def trial_name(overrides: dict) -> str:
    """`phase1.learning_rate=0.004,warmup=...`: the fields without `phases.` (or the labels
    of a `labelled` trial), made safe as one folder name."""
    parts = []
    for key, value in getattr(overrides, "labels", overrides).items():
        field = key.removeprefix("phases.")
        parts.append(f"{field}={format_value(value)}")
    name = ",".join(parts) or "default"
    return "".join(c if c.isalnum() or c in "._=,+-" else "_" for c in name)


def trials(config: ml_collections.ConfigDict, sweep: list[dict]) -> list[Trial]:
    """The sweep's trials, each checked against `config` (see the module docstring)."""
    if not sweep:
        raise SweepError("the sweep is empty: get_sweep() returned no trials")
    result, seen = [], {}
    for index, overrides in enumerate(sweep):
        if not isinstance(overrides, dict):
            raise SweepError(f"trial {index}: {overrides!r} is not a dict of field -> value")
        for key, value in overrides.items():
            check_field(config, key, value, index)
        trial = Trial(trial_name(overrides), dict(overrides), getattr(overrides, "labels", {}))
        if trial.name in seen:
            raise SweepError(
                f"trials {seen[trial.name]} and {index} are the same ({trial.name}): remove one"
            )
        seen[trial.name] = index
        result.append(trial)
    return result


def check_field(config, key: str, value, index: int) -> None:
    node, parts = config, key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            where = ".".join(parts[:depth]) or "the config"
            raise SweepError(f"trial {index}: {where} has no field {part!r} ({key}={value!r})")
        field_type = node.get_type(part)
        node = node[part]
    if isinstance(node, ml_collections.ConfigDict):
        raise SweepError(f"trial {index}: {key} is a group of fields; sweep one of its fields")
    if field_type is type(None) or value is None:
        return
    if field_type is float and isinstance(value, int) and not isinstance(value, bool):
        return
    if not isinstance(value, field_type) or (field_type is int and isinstance(value, bool)):
        raise SweepError(
            f"trial {index}: {key}={value!r} is a {type(value).__name__}; the field takes "
            f"{'an' if field_type is int else 'a'} {field_type.__name__} (the config gives "
            f"{node!r})"
        )
