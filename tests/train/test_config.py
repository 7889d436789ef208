import glob
import importlib.util
import os

import pytest

from lambjax.train import config as config_lib

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
CONFIG_FILES = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.py")))


def load(path, variant=None):
    """What `--config=PATH:VARIANT` does: import the file, call get_config(VARIANT)."""
    spec = importlib.util.spec_from_file_location("config_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
@pytest.mark.parametrize("variant", [None, "runlocal"])
def test_every_config_and_its_runlocal_variant_validates(path, variant):
    config = load(path, variant)
    # The recipes need a pod; their runlocal forms must fit this machine's 8 fake devices.
    num_devices = 8 if variant == "runlocal" or "default" in path else 256
    config_lib.validate(config, num_devices=num_devices)
    assert config.phase_order == ("phase1", "phase2")
    assert config.phases.phase1.max_seq_length == 128
    assert config.phases.phase2.max_seq_length == 512


def test_recipes_match_the_published_numbers():
    lamb = load(os.path.join(CONFIG_DIR, "bert_large_lamb.py"))
    p1, p2 = lamb.phases.phase1, lamb.phases.phase2
    assert (p1.global_batch_size, p1.learning_rate, p1.warmup_fraction, p1.num_steps) == (
        65536,
        6e-3,
        0.2843,
        7038,
    )
    assert (p2.global_batch_size, p2.learning_rate, p2.warmup_fraction, p2.num_steps) == (
        32768,
        4e-3,
        0.128,
        1563,
    )
    assert lamb.optimizer.max_global_norm == 1.0 and lamb.optimizer.weight_decay == 0.01
    lans = load(os.path.join(CONFIG_DIR, "bert_large_lans.py"))
    assert lans.optimizer.name == "lans"
    assert lans.phases.phase1.global_batch_size == 98304
    assert lans.phases.phase2.global_batch_size == 32768
    assert lans.phases.phase1.schedule == "warmup_constant_decay"


def default(**phase1):
    config = load(os.path.join(CONFIG_DIR, "default.py"))
    config.phases.phase1.update(phase1)
    return config


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(global_batch_size=30), "global_batch_size=30 is not divisible by grad_accum"),
        (dict(global_batch_size=36, grad_accum_steps=3), "micro-batch .* 12 does not divide"),
        (dict(schedule="cosine"), "schedule='cosine'; valid"),
        (dict(learning_rate=-1.0), "learning_rate=-1.0 must be positive"),
        (dict(max_predictions_per_seq=200), "exceeds max_seq_length=128"),
        (dict(optimizer_state="forget"), "optimizer_state='forget'"),
    ],
)
def test_bad_phase_configs_name_the_value(change, message):
    config = default(**change)
    if "grad_accum_steps" not in change:
        config.phases.phase1.grad_accum_steps = 4
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.validate(config, num_devices=8)


def test_bad_top_level_configs_name_the_value():
    config = default()
    config.optimizer.name = "sgd"
    with pytest.raises(config_lib.ConfigError, match="optimizer name 'sgd'.*valid"):
        config_lib.validate(config, num_devices=8)

    config = default()
    config.mesh.data = 3
    with pytest.raises(config_lib.ConfigError, match="needs 3 devices but 8 are available"):
        config_lib.validate(config, num_devices=8)

    config = default()
    config.phase_order = ("phase1", "phase3")
    with pytest.raises(config_lib.ConfigError, match="phase3"):
        config_lib.validate(config, num_devices=8)

    config = default()
    config.phases.phase2.optimizer.name = "lans"
    with pytest.raises(config_lib.ConfigError, match="optimizer_state='keep' needs the same"):
        config_lib.validate(config, num_devices=8)

    with pytest.raises(config_lib.ConfigError, match="unknown config variant 'huge'"):
        load(CONFIG_FILES[0], "huge")
