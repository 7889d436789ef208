"""Progressive layer dropping (PLD; Zhang & He, NeurIPS 2020), as used by the train step.

Every optimizer step t has a global keep probability

    theta(t) = (1 - theta_bar) * exp(-gamma * t) + theta_bar          (theta(0) = 1)

and with step = (1 - theta(t)) / L, layer i = 0..L-1 of the encoder (lower layers more often)
is kept and, when kept, scaled as one of two depth rules (`depth_rule`) says:

  deepspeed  the authors' code (DeepSpeedExamples, `modelingpreln_layerdrop.py`): kept with
             probability 1 - i * step, so the first layer is never dropped, but scaled by
             1 / (1 - (i + 1) * step), one layer's probability off from the one it is kept
             with; the default, as the paper's results were produced by it;
  paper      the paper's formula p_l = 1 - (l / L)(1 - theta(t)) for l = i + 1 = 1..L: kept
             with probability 1 - (i + 1) * step, scaled by its inverse (an unbiased
             estimate of the full layer).

One Bernoulli draw per layer and forward pass (so per micro-batch, shared by all its
examples). A dropped layer is skipped (`lax.cond` in the layer scan: no forward and no
backward compute) and is exactly the identity; a kept layer's two sub-layer outputs are
multiplied by its scale (PreLN switchable blocks: see `lambjax.models.bert.Layer`). The draws come
from the step's key, which every host derives from the seed and the step alone, so all
replicas drop the same layers. Evaluation runs every layer, unscaled.

References:
  Zhang & He, "Accelerating Training of Transformer-Based Language Models with Progressive
  Layer Dropping", 2020 (arXiv 2010.13369).
"""

import dataclasses

import jax
import jax.numpy as jnp

from lambjax import ranges

DEPTH_RULES = ("deepspeed", "paper")


@dataclasses.dataclass(frozen=True)
class LayerDrop:
    """PLD's schedule. Hashable: the trainer passes it to the jitted step as a constant.

    Attributes:
      theta_bar: the keep probability theta approaches (the paper: 0.5 to 0.9).
      gamma: how fast theta decays from 1 (the authors' default 0.001; heuristic 100 / T).
      step_offset: optimizer steps taken before this phase, so theta continues across phases.
      depth_rule: how the keep probability and the scale fall with depth (`DEPTH_RULES`; see
        the module docstring).
    """

    theta_bar: float = 0.5
    gamma: float = 0.001
    step_offset: int = 0
    depth_rule: str = "deepspeed"

    def __post_init__(self):
        if not 0.0 < self.theta_bar <= 1.0:
            raise ValueError(f"PLD theta_bar={self.theta_bar} must lie in (0, 1]")
        if self.gamma < 0:
            raise ValueError(f"PLD gamma={self.gamma} must be >= 0")
        if self.depth_rule not in DEPTH_RULES:
            raise ValueError(f"PLD depth_rule={self.depth_rule!r}; valid: {DEPTH_RULES}")

    def theta(self, step) -> jax.Array:
        """theta(t) at the phase's optimizer step `step` (t = step_offset + step)."""
        t = jnp.asarray(step, jnp.float32) + self.step_offset
        return (1.0 - self.theta_bar) * jnp.exp(-self.gamma * t) + self.theta_bar

    def _paper_probabilities(self, step, num_layers: int) -> jax.Array:
        """1 - (i + 1) * step for i = 0..L-1: the paper's p_l, l = 1..L."""
        depth = jnp.arange(1, num_layers + 1, dtype=jnp.float32) / num_layers
        return 1.0 - depth * (1.0 - self.theta(step))

    def keep_probabilities(self, step, num_layers: int) -> jax.Array:
        """The probability that each layer runs, float32 [num_layers], bottom layer first."""
        if self.depth_rule == "paper":
            return self._paper_probabilities(step, num_layers)
        depth = jnp.arange(num_layers, dtype=jnp.float32) / num_layers
        return 1.0 - depth * (1.0 - self.theta(step))

    def scales(self, step, num_layers: int) -> jax.Array:
        """What a kept layer's sub-layer outputs are multiplied by, float32 [num_layers]:
        1 / (1 - (i + 1) * step) under both rules (under `deepspeed` the inverse of the next
        layer's keep probability)."""
        return 1.0 / self._paper_probabilities(step, num_layers)

    def sample(self, rng: jax.Array, step, num_layers: int) -> tuple[jax.Array, jax.Array]:
        """(keep [L] bool, scale [L] float32) for one forward pass."""
        probabilities = self.keep_probabilities(step, num_layers)
        keep = jax.random.uniform(rng, (num_layers,)) < probabilities
        return keep, self.scales(step, num_layers)


def check_settings(settings) -> None:
    """`config.layer_drop`'s own values, named by their field."""
    if not settings.enabled:
        return
    ranges.check("config.layer_drop.theta_bar", settings.theta_bar, "(0, 1]")
    ranges.check("config.layer_drop.gamma", settings.gamma, "[0, inf)")
    if settings.depth_rule not in DEPTH_RULES:
        raise ValueError(
            f"config.layer_drop.depth_rule={settings.depth_rule!r}; valid: "
            f"{', '.join(repr(rule) for rule in DEPTH_RULES)}"
        )


def check(settings, phases) -> None:
    """`config.layer_drop` against the run's phase plans (lambjax.train.plan): PLD's
    switchable blocks are PreLN."""
    if not settings.enabled:
        return
    layer_norm = phases[0].model.layer_norm
    if layer_norm != "pre":
        raise ValueError(
            f"config.layer_drop.enabled=True needs PreLN blocks (the paper's switchable "
            f"transformer blocks), but the model has layer_norm={layer_norm!r}; set "
            f"--config.model.overrides.layer_norm=pre"
        )
