"""Chunk-based low-precision accumulation in the encoder's matmuls, emulated (Wang et al.,
NeurIPS 2018, arXiv 1812.08011; the arithmetic: lambjax.contrib.precision): a numerics study,
many times slower than the platform's dot.

A step method (lambjax.train.method): `config.step_method =
"lambjax.contrib.chunked_accumulation"`, which `configure(config)` sets, adding its field:

  chunked_accumulation.setting  "float32" (off: the platform's dot, the core step), or
                                "FORMAT[:chunk=N][:operands=OPERAND]" (parse_accumulation):
                                "float16" (naive), "float16:chunk=64" (chunk-based), likewise
                                bfloat16 or an eXmY format, of 8-bit operands with
                                ":operands=float8_e5m2" ("e6m9:chunk=64:operands=float8_e5m2":
                                Wang et al.'s setting).

The train step is the core's, its layer stack given the emulated matmuls
(lambjax.models.encoder.LayerOptions): the encoder layers' six Dense layers and the einsum
attention's two contractions, forward and backward. The embeddings and the heads keep the
platform's dot, as Wang et al. keep the first and last layers in higher precision. The held-out
evaluation runs the same matmuls. Fine-tuning and export run the platform's dot: the setting is
a way of training, not part of the model.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections

from lambjax.contrib.precision import chunked_dot, parse_accumulation
from lambjax.models import matmul
from lambjax.models.encoder import LayerOptions
from lambjax.train import step as step_lib

ATTENTION_SPECS = ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd")


def _accumulation(setting: str):
    """chunked_dot's keyword arguments for a setting, or None (the platform's dot)."""
    parsed = parse_accumulation(setting)
    return None if parsed is None else parsed._asdict()


def encoder_dot_general(setting: str) -> Callable:
    """The encoder's Dense layers' dot_general: `matmul.dense_dot_general`, or `chunked_dot`
    over the flattened Dense form where `setting` emulates a low-precision accumulator."""
    kwargs = _accumulation(setting)
    if kwargs is None:
        return matmul.dense_dot_general

    def emulated(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        (lhs_contracting, _), _ = dimension_numbers
        count = len(lhs_contracting)
        leading, features = lhs.shape[: lhs.ndim - count], rhs.shape[count:]
        # The Dense form: the inputs' trailing axes against the kernel's leading ones.
        out = chunked_dot(lhs.reshape(leading + (-1,)), rhs.reshape(-1, *features), **kwargs)
        return out.astype(lhs.dtype)

    return emulated


def attention_einsum(setting: str) -> Callable:
    """The two attention einsums, `einsum(spec, x, y)`: `jnp.einsum`, or, where `setting`
    emulates a low-precision accumulator, `chunked_dot` per batch row and head (the scores
    q k^T contract the head dimension, the outputs contract the keys)."""
    kwargs = _accumulation(setting)
    if kwargs is None:
        return jnp.einsum

    def einsum(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
        def dot(a, b):
            return chunked_dot(a, b, **kwargs).astype(x.dtype)

        if spec == "bqhd,bkhd->bhqk":
            per_head = jax.vmap(lambda q, k: dot(q, k.T), in_axes=(1, 1))
            return jax.vmap(per_head)(x, y)
        if spec != "bhqk,bkhd->bqhd":
            raise ValueError(f"attention_einsum: spec {spec!r}; valid: {list(ATTENTION_SPECS)}")
        per_head = jax.vmap(dot, in_axes=(0, 1), out_axes=1)
        return jax.vmap(per_head)(x, y)

    return einsum


def layer_options(setting: str) -> LayerOptions:
    """The layer stack's options with the encoder's matmuls of `setting`."""
    return LayerOptions(
        dot_general=encoder_dot_general(setting), attention_einsum=attention_einsum(setting)
    )


@dataclasses.dataclass(frozen=True)
class ChunkedAccumulationPlan:
    """The setting in a phase plan (`PhasePlan.step_method`), when it is not float32."""

    setting: str

    # The core step runs: its layout of the layers too (lambjax.train.layout).
    runs_per_layer = True

    @property
    def layer_options(self) -> LayerOptions:
        """The train and the eval step's matmuls (lambjax.train.method.StepMethod)."""
        return layer_options(self.setting)

    def train_step(self, phase) -> Callable:
        settings = step_lib.StepSettings.of(phase.plan, phase.optimizer, phase.schedule, phase.mesh)
        settings = dataclasses.replace(settings, layer_options=self.layer_options)
        return functools.partial(step_lib.train_step, settings=settings)

    def init_method_state(self, phase, params):
        return None

    def method_state_shardings(self, phase, abstract_method_state, param_shardings):
        return None


def configure(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` with this step method and its field (kept where the config has it)."""
    config.step_method = __name__
    if "chunked_accumulation" not in config:
        config.chunked_accumulation = ml_collections.ConfigDict({"setting": "float32"})
    return config


def variant(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """float16 accumulation in chunks of 64, Wang et al.'s chunk length, with the einsum
    attention (the one whose matmuls it emulates). `--config.chunked_accumulation.setting`
    picks another format or chunk ('float16' alone: naive accumulation)."""
    config = configure(config)
    config.chunked_accumulation.setting = "float16:chunk=64"
    config.model.overrides.attention = "xla"
    return config


def check_settings(config: ml_collections.ConfigDict) -> None:
    """`config.chunked_accumulation.setting`, named in the error."""
    setting = config.chunked_accumulation.setting
    try:
        parse_accumulation(setting)
    except ValueError as e:
        raise ValueError(f"config.chunked_accumulation.{e}") from None


def plan(config: ml_collections.ConfigDict) -> ChunkedAccumulationPlan | None:
    """The setting; None for float32 (the core step)."""
    setting = config.chunked_accumulation.setting
    return None if parse_accumulation(setting) is None else ChunkedAccumulationPlan(setting)


def check(config: ml_collections.ConfigDict, phases) -> None:
    """The einsum attention, whose matmuls the method emulates: a fused kernel (also one
    that 'auto' picks on the plan's platform) is refused."""
    if plan(config) is None:
        return
    for phase in phases:
        form = phase.model.attention
        if form != "xla":
            raise ValueError(
                f"config.chunked_accumulation.setting={config.chunked_accumulation.setting!r} "
                f"emulates the einsum attention's matmuls, but config.phases.{phase.name} runs "
                f"attention={form!r}; set --config.model.overrides.attention=xla"
            )
