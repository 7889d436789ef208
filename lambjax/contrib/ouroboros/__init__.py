"""Ouroboros (Yang et al., NeurIPS 2019, arXiv 1909.06695): BERT cut into K modules on
K - 1 stages (mesh axis `stage`), each module updated with a delayed gradient.

A step method (lambjax.train.method): `config.step_method = "lambjax.contrib.ouroboros"`,
which `configure(config)` sets, adding its fields:

  ouroboros.num_modules        K; 1 = off (the core train step runs). Needs mesh stage = K - 1.
  ouroboros.replay             "stale" (the delayed gradient exactly, as DDG defines it; keeps
                               the last K - 1 steps' weights) or "current" (Features Replay:
                               the current weights).
  ouroboros.synchronous_steps  a warm-up of that many steps of ordinary backpropagation at
                               the start of every phase, before the buffers fill (the paper
                               mentions a warm-up whose form could not be read; the recipes'
                               learning-rate warm-up applies either way).

The variant `ouroboros` (`variant`) picks the paper's Figure 2 layout. The step is in
lambjax.contrib.ouroboros.step, its delayed gradients on the mesh in
lambjax.contrib.ouroboros.delayed, the model's split and each stage's computations in
lambjax.contrib.ouroboros.stages.
"""

import dataclasses
import functools
from collections.abc import Callable

import ml_collections

from lambjax.contrib.ouroboros import stages as stages_lib
from lambjax.contrib.ouroboros import step as step_lib
from lambjax.train.config import model_depth


@dataclasses.dataclass(frozen=True)
class OuroborosPlan:
    """Ouroboros' settings in a phase plan (`PhasePlan.step_method`), when K > 1."""

    num_modules: int
    replay: str  # stale | current
    synchronous_steps: int

    # The stages hold slices of the stacked layers (lambjax.train.layout).
    runs_per_layer = False
    # The mesh axis its stages run on, beside the core's (lambjax.train.method.StepMethod).
    mesh_axes = ("stage",)

    def split(self, phase) -> stages_lib.Split:
        return stages_lib.Split(self.num_modules, phase.model_config.num_layers)

    def train_step(self, phase) -> Callable:
        settings = step_lib.OuroborosStep(
            split=self.split(phase),
            replay=self.replay,
            mesh=phase.mesh,
            model_config=phase.model_config,
            optimizer=phase.optimizer,
            schedule=phase.schedule,
            grad_accum_steps=phase.plan.batch.grad_accum_steps,
            nsp_loss_weight=phase.plan.step.nsp_loss_weight,
            synchronous_steps=self.synchronous_steps,
        )
        return functools.partial(step_lib.train_step, settings=settings)

    def init_method_state(self, phase, params):
        """Empty buffers."""
        return step_lib.init_buffers(
            self.split(phase),
            params,
            global_batch_size=phase.plan.batch.global_batch_size,
            seq_len=phase.plan.batch.max_seq_length,
            dtype=phase.model_config.dtype,
            replay=self.replay,
        )

    def method_state_shardings(self, phase, abstract_method_state, param_shardings):
        return step_lib.buffer_shardings(abstract_method_state, param_shardings, phase.mesh)


def config_fields() -> ml_collections.ConfigDict:
    """`config.ouroboros` at its defaults (off)."""
    return ml_collections.ConfigDict({"num_modules": 1, "replay": "stale", "synchronous_steps": 0})


def configure(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` with this step method and its fields (kept where the config has them)."""
    config.step_method = __name__
    if "ouroboros" not in config:
        config.ouroboros = config_fields()
    return config


def variant(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The paper's Figure 2 layout, 4 modules on 3 stages with the first and the last module
    on stage 0, where the depth divides by 3 (BERT-base and -large); else 3 modules on 2
    stages (the runlocal model's 2 layers). The rest of the devices go to the data axis.
    `--config.ouroboros.num_modules` and `--config.mesh.stage` (= num_modules - 1) change it.
    """
    modules = 4 if model_depth(config) % 3 == 0 else 3
    config = configure(config)
    config.ouroboros.num_modules = modules
    config.mesh.stage = modules - 1
    return config


def check_settings(config: ml_collections.ConfigDict) -> None:
    """`config.ouroboros`'s own values, named by their field."""
    settings = config.ouroboros
    modules, replay = settings.num_modules, settings.replay
    if not isinstance(modules, int) or modules < 1:
        raise ValueError(f"config.ouroboros.num_modules={modules!r} must be an integer >= 1")
    warmup = settings.synchronous_steps
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"config.ouroboros.synchronous_steps={warmup!r} must be an integer >= 0")
    if replay not in step_lib.REPLAYS:
        raise ValueError(f"config.ouroboros.replay={replay!r}; valid: {step_lib.REPLAYS}")


def plan(config: ml_collections.ConfigDict) -> OuroborosPlan | None:
    """The phases' settings; None with one module (the core step)."""
    if config.ouroboros.num_modules == 1:
        return None
    return OuroborosPlan(**config.ouroboros.to_dict())


def check(config: ml_collections.ConfigDict, phases) -> None:
    """`config.ouroboros` against the run's phase plans (lambjax.train.plan): K against the
    depth, the mesh (data x stage, stage = K - 1) and the schemes it does not combine with.
    Its own values were checked first (`check_settings`)."""
    modules = config.ouroboros.num_modules
    if modules == 1:
        for phase in phases:
            stages = phase.mesh["stage"]
            if stages > 1:
                raise ValueError(
                    f"config.phases.{phase.name}: mesh stage={stages} splits the encoder into "
                    f"stages, which Ouroboros runs with config.ouroboros.num_modules="
                    f"{stages + 1} (or the variant ouroboros); else set mesh stage=1"
                )
        return
    if phases[0].step.layer_drop is not None:
        raise ValueError(
            "config.ouroboros.num_modules > 1 and config.layer_drop.enabled=True: Ouroboros "
            "runs every layer of every step; turn one of them off"
        )
    if phases[0].step.standardization_loss_weight > 0:
        raise ValueError(
            "config.ouroboros.num_modules > 1 with config.standardization_loss.weight > 0: "
            "its stages carry no standardization loss; turn one of them off"
        )
    if any(phase.packing is not None for phase in phases):
        raise ValueError(
            "config.ouroboros.num_modules > 1 and config.data.packing=True: Ouroboros' step "
            "reads one example per row; turn one of them off"
        )
    for phase in phases:
        where, mesh = f"config.phases.{phase.name}", dict(phase.mesh)
        if mesh["stage"] != modules - 1 or mesh["fsdp"] != 1 or mesh["tensor"] != 1:
            raise ValueError(
                f"{where}: config.ouroboros.num_modules={modules} runs on a mesh data x stage "
                f"with stage={modules - 1} (the first and the last module share a stage) and "
                f"fsdp=tensor=1, but the mesh is {mesh}; set --config.mesh.stage={modules - 1}"
            )
        if phase.step.num_frozen_layers:
            raise ValueError(
                f"{where}.frozen_layers={phase.step.num_frozen_layers}: Ouroboros trains "
                f"every layer (no multi-stage layerwise training)"
            )
        depth = phase.model.num_layers
        try:
            stages_lib.check(modules, depth)
        except ValueError as e:
            raise ValueError(f"config.ouroboros ({where}, {depth} layers): {e}") from None
