"""The one place a training method outside the core replaces the train step.

`config.step_method` names a module ("" = the core step, lambjax.train.step), e.g.
"lambjax.contrib.ouroboros". The plan (lambjax.train.plan) imports it once, by name, and asks
it, through the functions of `StepMethodModule`, to check the config and to give each phase
its typed settings: a frozen `StepMethod`, kept in `PhasePlan.step_method`, or None where
the method is off for that config (the phase then runs the core step). The phase
(lambjax.train.phases) builds its train step, its state and the state's shardings from that
object. The core imports no such module itself: lambjax/contrib holds them.

A method's config fields are its own: the module adds them (`configure`), so a config file
that uses a method calls it, and the method's variant (lambjax.train.variants) does.
"""

import importlib
from collections.abc import Callable
from typing import Any, Protocol

import ml_collections

from lambjax.train.config import ConfigError


class StepMethod(Protocol):
    """A phase's step method with its settings (frozen, in `PhasePlan.step_method`).

    `phase` below is the lambjax.train.phases.Phase being built; the train step's state is a
    lambjax.train.state.TrainState whose `method_state` holds what the method carries from
    one step to the next (checkpointed with the rest).

    Optionally, a `layer_options` attribute: a lambjax.models.encoder.LayerOptions (e.g. the
    encoder's matmuls) that the phase's eval step runs the model with, as the method's train
    step does (the core step: `StepSettings.layer_options`); absent or None: the defaults.
    And a `mesh_axes` attribute: the mesh axes beside the core step's (data, fsdp, tensor)
    that the method's step runs on, e.g. Ouroboros' ("stage",); a phase whose mesh has any
    other axis larger than 1 is refused (lambjax.train.plan_checks.check_method_axes)."""

    @property
    def runs_per_layer(self) -> bool:
        """Whether the step takes an unrolled model's layers one tree per layer
        (lambjax.train.layout); False: stacked, as they rest."""

    def train_step(self, phase) -> Callable:
        """The pure step (state, batch, rng) -> (state, metrics), its settings bound."""

    def init_method_state(self, phase, params) -> Any:
        """`TrainState.method_state` at the phase's step 0."""

    def method_state_shardings(self, phase, abstract_method_state, param_shardings) -> Any:
        """The shardings of `method_state` (a tree like `abstract_method_state`)."""


class StepMethodModule(Protocol):
    """What the module `config.step_method` names provides."""

    def configure(self, config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        """`config` with `step_method` naming this module and the method's fields added, at
        their defaults (what a config file calls to use the method)."""

    def variant(self, config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        """`configure`d, with the method's recipe settings (the variant of its name)."""

    def check_settings(self, config: ml_collections.ConfigDict) -> None:
        """Its own fields' values; a ValueError names the field."""

    def plan(self, config: ml_collections.ConfigDict) -> StepMethod | None:
        """Its settings, checked by `check_settings`; None: off (the core step runs)."""

    def check(self, config: ml_collections.ConfigDict, phases) -> None:
        """Its settings against the phase plans (lambjax.train.plan.PhasePlan)."""


FUNCTIONS = ("configure", "variant", "check_settings", "plan", "check")


def load(name: str) -> StepMethodModule | None:
    """The module `name` (a `config.step_method` value); None for "" (the core step)."""
    if not name:
        return None
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        raise ConfigError(
            f"config.step_method={name!r} cannot be imported ({error}); valid: '' (the core "
            "train step) or a module that provides a step method, e.g. 'lambjax.contrib.ouroboros'"
        ) from None
    missing = [function for function in FUNCTIONS if not callable(getattr(module, function, None))]
    if missing:
        raise ConfigError(
            f"config.step_method={name!r} is not a step method: it lacks {missing} "
            "(lambjax.train.method.StepMethodModule)"
        )
    return module


def variant(name: str) -> Callable[[ml_collections.ConfigDict], ml_collections.ConfigDict]:
    """The config variant of the step method module `name` (imported when it is applied)."""

    def apply(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        return load(name).variant(config)

    apply.__doc__ = f"The step method {name} (its `variant`)."
    return apply
