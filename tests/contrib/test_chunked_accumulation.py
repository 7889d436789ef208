"""The chunked-accumulation step method (lambjax.contrib.chunked_accumulation): its variant,
its checks, and the core train step it runs with the encoder's emulated matmuls."""

import types

import optax
import pytest

from configs import bert_lamb
from lambjax.contrib import chunked_accumulation
from lambjax.models import matmul
from lambjax.train import config as config_lib
from lambjax.train import plan as plan_lib


def resolve(config):
    return plan_lib.resolve(config, vocab_size=config.data.vocab_size, num_devices=1)


def test_the_variant_names_its_module_and_plans_the_einsum_attention():
    config = bert_lamb.get_config("chunked_accumulation,runlocal")
    assert config.step_method == "lambjax.contrib.chunked_accumulation"
    assert config.chunked_accumulation.setting == "float16:chunk=64"
    phases = resolve(config).phases
    assert {p.step_method for p in phases} == {
        chunked_accumulation.ChunkedAccumulationPlan("float16:chunk=64")
    }
    assert all(p.model.attention == "xla" for p in phases)
    assert phases[0].step_method.runs_per_layer  # the core step's layout


def test_float32_is_the_core_step():
    config = chunked_accumulation.configure(bert_lamb.get_config("runlocal"))
    assert config.chunked_accumulation.setting == "float32"
    assert all(p.step_method is None for p in resolve(config).phases)


def test_a_bad_setting_is_named_in_one_line():
    config = bert_lamb.get_config("chunked_accumulation,runlocal")
    config.chunked_accumulation.setting = "float16:64"
    with pytest.raises(config_lib.ConfigError) as error:
        resolve(config)
    message = str(error.value)
    assert "config.chunked_accumulation.setting='float16:64'; valid:" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "form, platform, chosen", [("auto", "tpu", "splash"), ("cudnn", "gpu", "cudnn")]
)
def test_attention_other_than_the_einsum_form_is_refused(form, platform, chosen):
    """A fused kernel is refused, also where 'auto' picks one on the plan's platform."""
    config = bert_lamb.get_config("chunked_accumulation,runlocal")
    config.model.overrides.attention = form
    config.model.overrides.update(dtype="bfloat16", attention_dropout=0.0)
    with pytest.raises(config_lib.ConfigError, match=f"runs attention='{chosen}'; set"):
        plan_lib.resolve(config, vocab_size=2048, num_devices=1, platform=platform)
    config.model.overrides.attention_dropout = 0.1  # 'auto' then takes the einsum form
    if form == "auto":
        plan = plan_lib.resolve(config, vocab_size=2048, num_devices=1, platform=platform)
        assert plan.phases[0].model.attention == "xla"


def test_the_train_step_is_the_core_step_with_the_emulated_matmuls():
    config = bert_lamb.get_config("chunked_accumulation,runlocal")
    phase_plan = resolve(config).phases[0]
    phase = types.SimpleNamespace(
        plan=phase_plan,
        optimizer=optax.sgd(1e-3),
        schedule=optax.constant_schedule(1e-3),
        mesh=None,
    )
    step = phase_plan.step_method.train_step(phase)
    options = step.keywords["settings"].layer_options
    assert options.dot_general is not matmul.dense_dot_general
    assert options.attention_einsum is not None
    assert phase_plan.step_method.layer_options.dot_general is not None
    assert phase_plan.step_method.init_method_state(phase, {}) is None
    float32 = chunked_accumulation.layer_options("float32")
    assert float32.dot_general is matmul.dense_dot_general
