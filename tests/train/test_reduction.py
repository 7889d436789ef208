"""Where the data-parallel gradient is summed (lambjax.train.reduction): the compiled step's
all-reduces on 8 fake CPU devices, the update against XLA's own placement, the plan's checks."""

import functools
import os
import re

import jax
import numpy as np
import optax
import pytest

from lambjax import sharding
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params, param_logical_axes
from lambjax.train import config as config_lib
from lambjax.train import plan as plan_lib
from lambjax.train import state as state_lib
from lambjax.train import step as step_lib
from lambjax.train.config import optimizer_config
from lambjax.train.optimizer import make_optimizer
from lambjax.train.state import TrainState
from tests import helpers

CONFIG = BertConfig.preset(
    "tiny", vocab_size=128, num_layers=2, dtype="float32", hidden_dropout=0.0, attention_dropout=0.0
)
ACCUM = 4
CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


@functools.cache
def compiled_step(once: bool):
    """The train step as the trainer jits it, on a data-parallel mesh of 8, compiled: the
    executable and its HLO text."""
    mesh = sharding.make_mesh({"data": 8})
    optimizer = make_optimizer(optimizer_config("lamb"), optax.constant_schedule(1e-3))
    abstract = jax.eval_shape(init_state)
    state_shardings = state_lib.shardings(
        abstract,
        param_axes=param_logical_axes(CONFIG),
        mesh=mesh,
        optimizer=optimizer,
        num_frozen_layers=0,
    )
    step = functools.partial(
        step_lib.train_step,
        settings=step_lib.StepSettings(
            model_config=CONFIG,
            optimizer=optimizer,
            schedule=optax.constant_schedule(1e-3),
            grad_accum_steps=ACCUM,
            options=step_lib.StepOptions(gradient_reduction="once" if once else "each_microbatch"),
            mesh=mesh,
        ),
    )
    replicated = sharding.replicated(mesh)
    jitted = jax.jit(
        step,
        in_shardings=(state_shardings, sharding.batch_sharding(mesh), replicated),
        out_shardings=(state_shardings, replicated),
    )
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), random_batch())
    compiled = jitted.lower(abstract, batch, jax.random.key(1)).compile()
    return compiled, compiled.as_text(), state_shardings


def init_state():
    optimizer = make_optimizer(optimizer_config("lamb"), optax.constant_schedule(1e-3))
    return TrainState.create(init_params(CONFIG, jax.random.key(0)), optimizer)


def random_batch():
    return helpers.random_batch(0, batch=64, seq=16, predictions=4, vocab_size=128)


def all_reduces(hlo: str) -> tuple[list[str], list[str]]:
    """The all-reduce instructions of a compiled module: (inside while-loop bodies, in the
    entry computation)."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    inside, entry = [], []
    for computation in re.split(r"\n(?=\S.*\{\n)", hlo):
        head = computation.split("\n", 1)[0]
        found = re.findall(r"^\s*(?:ROOT )?%\S+ = (.*?) all-reduce(?:-start)?\(", computation, re.M)
        if head.startswith("ENTRY"):
            entry += found
        elif head.split()[0].lstrip("%") in bodies:
            inside += found
    return inside, entry


def elements(shapes: list[str]) -> int:
    """The number of float32 elements the all-reduces of `shapes` (their result types)
    carry."""
    dims = re.findall(r"f32\[([\d,]*)\]", " ".join(shapes))
    return sum(int(np.prod([int(d) for d in x.split(",") if d])) for x in dims)


def parameter_count() -> int:
    return sum(x.size for x in jax.tree.leaves(jax.eval_shape(init_state).params))


def test_xla_reduces_every_micro_batch_inside_the_loop():
    """What the default form compiles to: the gradient all-reduced inside the loops (the
    micro-batches' scan, and the layers' scan within it, whose body holds one layer's
    share), every element once per micro-batch, so A times per step."""
    inside, entry = all_reduces(compiled_step(once=False)[1])
    assert elements(inside) > parameter_count() / 2
    assert elements(entry) < parameter_count()


@pytest.mark.slow
def test_once_reduces_the_gradient_once_after_the_loop():
    inside, entry = all_reduces(compiled_step(once=True)[1])
    assert inside == []
    gradients = [shapes for shapes in entry if elements([shapes]) > ACCUM]
    assert len(gradients) == 1, entry  # one (combined) all-reduce carries every gradient
    assert elements(gradients) - parameter_count() < 16  # and the loss statistics


@pytest.mark.slow
def test_once_gives_the_same_update():
    batch = random_batch()
    results = {}
    for once in (False, True):
        compiled, _, shardings = compiled_step(once)
        state = jax.jit(init_state, out_shardings=shardings)()
        results[once] = compiled(state, batch, jax.random.key(1))
    (each, each_metrics), (once, once_metrics) = results[False], results[True]
    for key in ("loss", "mlm_accuracy", "nsp_loss", "grad_norm", "update_norm"):
        np.testing.assert_allclose(once_metrics[key], each_metrics[key], rtol=2e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(each.params), jax.tree.leaves(once.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def default_config():
    import importlib.util

    spec = importlib.util.spec_from_file_location("default", os.path.join(CONFIG_DIR, "default.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("runlocal")


def resolve(config, num_devices=8):
    return plan_lib.resolve(config, vocab_size=config.data.vocab_size, num_devices=num_devices)


def test_the_plan_carries_the_reduction():
    config = default_config()
    assert {p.step.gradient_reduction for p in resolve(config).phases} == {"each_microbatch"}
    config.gradient_reduction = "once"
    assert {p.step.gradient_reduction for p in resolve(config).phases} == {"once"}


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"gradient_reduction": "never"},
            r"gradient_reduction='never'; valid: each_microbatch, once$",
        ),
        ({"mesh.fsdp": 2, "mesh.tensor": 2}, r"fsdp=2 and tensor=2 .* does not compile"),
        ({"standardization_loss.weight": 1e-4}, r"needs them over the whole micro-batch"),
    ],
)
def test_bad_reductions_name_the_value(change, message):
    config = default_config()
    config.gradient_reduction = "once"
    if "standardization_loss.weight" in change:
        config.model.overrides.normalization = "none"
    for field, value in change.items():
        section, _, name = field.rpartition(".")
        (config[section] if section else config)[name] = value
    with pytest.raises(config_lib.ConfigError, match=message):
        resolve(config)
