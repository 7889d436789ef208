import glob
import importlib.util
import os
import re

import jax
import pytest

from lambjax.models.config import BertConfig
from lambjax.train import config as config_lib
from lambjax.train import plan as plan_lib
from lambjax.train import prng

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
CONFIG_FILES = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.py")))


def validate(config, num_devices, process_count=1):
    """The config resolved into its run plan, as a run on `num_devices` devices does."""
    return plan_lib.resolve(
        config,
        vocab_size=config.data.vocab_size,
        num_devices=num_devices,
        process_count=process_count,
    )


def load(path, variant=None):
    """What `--config=PATH:VARIANT` does: import the file, call get_config(VARIANT)."""
    spec = importlib.util.spec_from_file_location("config_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


VARIANTS = [
    None,
    "runlocal",
    "pld",
    "mslt",
    "pld,runlocal",
    "mslt,runlocal",
    "chunked_accumulation,runlocal",
    "standardization_loss",
    "standardization_loss,pld,runlocal",
]
# Every config file with every argument it takes: the recipes' sizes times the variants.
CONFIG_ARGS = [
    (path, ",".join(part for part in (size, variant) if part) or None)
    for path in CONFIG_FILES
    for size in ((None, "large") if "bert_" in os.path.basename(path) else (None,))
    for variant in VARIANTS
]


@pytest.mark.parametrize(
    "path, variant", CONFIG_ARGS, ids=[f"{os.path.basename(p)}:{a}" for p, a in CONFIG_ARGS]
)
def test_every_config_and_its_variants_validate(path, variant):
    config = load(path, variant)
    # The recipes need a pod; their runlocal forms must fit this machine's 8 fake devices.
    num_devices = 8 if "runlocal" in (variant or "") or "default" in path else 256
    validate(config, num_devices=num_devices)
    if variant and "mslt" in variant:
        assert config.phase_order[-1] == "phase2" and len(config.phase_order) >= 3
    else:
        assert config.phase_order == ("phase1", "phase2")
    assert config.phases[config.phase_order[0]].max_seq_length == 128
    assert config.phases.phase2.max_seq_length == 512
    assert config.layer_drop.enabled == ("pld" in (variant or ""))


def test_mslt_stages_of_the_recipes():
    base = load(os.path.join(CONFIG_DIR, "bert_lamb.py"), "mslt")
    stages = [base.phases[name] for name in base.phase_order]
    assert [(s.num_layers, s.frozen_layers) for s in stages] == [
        (3, 0),
        (6, 3),
        (12, 6),
        (None, 0),  # phase 2: the model's 12 layers, all trained
    ]
    assert sum(s.num_steps for s in stages[:3]) == 7038
    assert [s.optimizer_state for s in stages[1:]] == ["reset"] * 3
    large = load(os.path.join(CONFIG_DIR, "bert_lans.py"), "large,mslt")
    depths = [large.phases[name].num_layers for name in large.phase_order]
    assert depths == [6, 12, 18, 24, None]


def test_the_standardization_loss_needs_a_model_without_layer_norm():
    config = load(os.path.join(CONFIG_DIR, "bert_lamb.py"), "standardization_loss,runlocal")
    assert config.model.overrides.normalization == "none"
    assert config.standardization_loss.weight == 1e-4
    config.model.overrides.normalization = "layer_norm"
    with pytest.raises(config_lib.ConfigError, match="standardization_loss.weight=0.0001"):
        validate(config, num_devices=8)


def test_the_standardization_loss_site_is_one_of_two():
    config = load(os.path.join(CONFIG_DIR, "bert_lamb.py"), "standardization_loss,runlocal")
    config.standardization_loss.site = "preactivation"
    validate(config, num_devices=8)
    config.standardization_loss.site = "attention"
    message = "config.standardization_loss.site='attention'; valid: 'residual', 'preactivation'"
    with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
        validate(config, num_devices=8)


def test_pld_recipe_uses_preln_and_the_papers_settings():
    config = load(os.path.join(CONFIG_DIR, "bert_lamb.py"), "base,pld")
    assert config.model.overrides.layer_norm == "pre"
    assert config.layer_drop.theta_bar == 0.5
    assert config.layer_drop.gamma == pytest.approx(100 / (7038 + 1563))


def test_unknown_variant_names_the_valid_ones():
    with pytest.raises(config_lib.ConfigError, match=r"\['turbo'\].*mslt.*pld.*runlocal"):
        load(os.path.join(CONFIG_DIR, "default.py"), "runlocal,turbo")
    with pytest.raises(config_lib.ConfigError, match=r"'huge'.*base.*large"):
        load(os.path.join(CONFIG_DIR, "bert_lamb.py"), "huge,mslt")
    with pytest.raises(config_lib.ConfigError, match=r"\['base', 'large'\].*\(one\)"):
        load(os.path.join(CONFIG_DIR, "bert_lans.py"), "base,large")


def test_recipe_sizes():
    for path in ("bert_lamb.py", "bert_lans.py"):
        assert load(os.path.join(CONFIG_DIR, path)).model.preset == "base"
        assert load(os.path.join(CONFIG_DIR, path), "large").model.preset == "large"
        assert load(os.path.join(CONFIG_DIR, path), "large,runlocal").model.preset == "tiny"


def test_recipes_match_the_published_numbers():
    lamb = load(os.path.join(CONFIG_DIR, "bert_lamb.py"), "large")
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
    lans = load(os.path.join(CONFIG_DIR, "bert_lans.py"), "large")
    assert lans.optimizer.name == "lans"
    assert lans.phases.phase1.global_batch_size == 98304
    # The paper's "96K" and "33K" with K = 1,024 (LAMB's "32K" is 32,768): whole numbers of
    # sequences on each of its 1,536 GPUs, 64 and 22.
    assert lans.phases.phase1.global_batch_size == 98304 == 96 * 1024
    assert lans.phases.phase2.global_batch_size == 33792 == 33 * 1024
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
        validate(config, num_devices=8)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(frozen_layers=2), r"phase1.frozen_layers=2 must lie in \[0, 2\)"),
        (dict(num_layers=4), r"phase2 has 2 layers, fewer than the 4"),
        (dict(num_layers=0), r"num_layers=0 must be a positive integer"),
        (dict(train_decoder=True), r"phase1.train_decoder=True, but the phase freezes no lay"),
        (dict(continue_schedule=True), r"phase1.continue_schedule=True, but it is the first"),
    ],
)
def test_bad_stage_configs_name_the_value(change, message):
    with pytest.raises(config_lib.ConfigError, match=message):
        validate(default(**change), num_devices=1)


def test_a_stage_that_changes_the_trained_layers_must_reset_the_optimizer():
    config = default(num_layers=1)
    with pytest.raises(config_lib.ConfigError, match="phase2.optimizer_state='reset'"):
        validate(config, num_devices=1)
    config.phases.phase2.optimizer_state = "reset"
    validate(config, num_devices=1)


def test_a_phase_continues_only_a_schedule_with_its_settings():
    config = default()
    config.phases.phase2.continue_schedule = True
    with pytest.raises(config_lib.ConfigError) as error:
        validate(config, num_devices=1)
    phase1, phase2 = config.phases.phase1, config.phases.phase2
    assert str(error.value) == (
        "config.phases.phase2.continue_schedule=True needs the schedule of phase 'phase1': "
        f"learning_rate={phase2.learning_rate!r} there is {phase1.learning_rate!r}"
    )
    phase2.learning_rate, phase2.warmup_fraction = phase1.learning_rate, phase1.warmup_fraction
    schedules = [phase.schedule for phase in validate(config, num_devices=1).phases]
    total = phase1.num_steps + phase2.num_steps
    assert [(s.num_steps, s.start_step) for s in schedules] == [
        (total, 0),
        (total, phase1.num_steps),
    ]


def test_layer_drop_needs_preln_and_valid_settings():
    config = default()
    config.layer_drop.enabled = True
    with pytest.raises(config_lib.ConfigError, match="layer_norm='post'.*overrides.layer_norm=pre"):
        validate(config, num_devices=1)
    config.model.overrides.layer_norm = "pre"
    validate(config, num_devices=1)
    assert config.layer_drop.depth_rule == "deepspeed"  # the authors' code, by default
    config.layer_drop.depth_rule = "reference"
    with pytest.raises(config_lib.ConfigError) as error:
        validate(config, num_devices=1)
    assert str(error.value) == (
        "config.layer_drop.depth_rule='reference'; valid: 'deepspeed', 'paper'"
    )
    config.layer_drop.depth_rule = "paper"
    validate(config, num_devices=1)
    config.layer_drop.theta_bar = 0.0
    with pytest.raises(config_lib.ConfigError, match=r"theta_bar=0.0 must lie in \(0, 1\]"):
        validate(config, num_devices=1)


def test_packing_is_resolved_per_phase_and_checked():
    config = default()
    assert all(phase.packing is None for phase in validate(config, num_devices=1).phases)
    config.data.packing = True
    plan = validate(config, num_devices=1)
    assert [phase.packing.max_examples_per_row for phase in plan.phases] == [3, 3]
    config.data.packing_max_examples = 65
    with pytest.raises(
        config_lib.ConfigError, match=r"packing_max_examples=65 must be an integer in \[2, 64\]"
    ):
        validate(config, num_devices=1)


def test_bad_top_level_configs_name_the_value():
    config = default()
    config.optimizer.name = "sgd"
    with pytest.raises(config_lib.ConfigError, match="optimizer name 'sgd'.*valid"):
        validate(config, num_devices=8)

    config = default()
    config.mesh.data = 3
    with pytest.raises(config_lib.ConfigError, match="needs 3 devices but 8 are available"):
        validate(config, num_devices=8)

    config = default()
    config.phase_order = ("phase1", "phase3")
    with pytest.raises(config_lib.ConfigError, match="phase3"):
        validate(config, num_devices=8)

    config = default()
    config.phases.phase2.optimizer.name = "lans"
    with pytest.raises(config_lib.ConfigError, match="optimizer_state='keep' needs the same"):
        validate(config, num_devices=8)

    config = default()  # training batches of 48 divide over 3 devices; evaluation's 32 do not
    config.phases.phase1.global_batch_size = 48
    config.phases.phase2.global_batch_size = 48
    config.eval_batch_size = 32
    with pytest.raises(
        config_lib.ConfigError,
        match=r"config.eval_batch_size=32 does not divide over phase 'phase1''s 3 data-parallel "
        r"devices \(mesh data x fsdp\); valid: multiples of 3",
    ):
        validate(config, num_devices=3)

    with pytest.raises(config_lib.ConfigError, match=r"argument 'huge': \['huge'\] not understood"):
        load(CONFIG_FILES[0], "huge")


def test_mesh_dcn_places_axes_across_slices():
    """On 2 slices of 4 devices: data across the slices (dcn), fsdp within each; a phase's
    mesh override keeps the run's dcn."""
    config = default()
    config.mesh.update(data=2, fsdp=-1)
    config.mesh.dcn.data = 2
    config.phases.phase2.mesh.update(data=4, fsdp=2)
    plan = plan_lib.resolve(config, vocab_size=config.data.vocab_size, num_devices=8, num_slices=2)
    assert [dict(p.mesh) for p in plan.phases] == [
        {"stage": 1, "data": 2, "fsdp": 4, "tensor": 1},
        {"stage": 1, "data": 4, "fsdp": 2, "tensor": 1},
    ]
    assert [p.mesh_dcn["data"] for p in plan.phases] == [2, 2]
    with pytest.raises(config_lib.ConfigError, match="form 2 TPU slices and mesh.dcn places no"):
        config.mesh.dcn.data = 1
        plan_lib.resolve(config, vocab_size=config.data.vocab_size, num_devices=8, num_slices=2)
    with pytest.raises(
        config_lib.ConfigError,
        match=r"phases.phase1: mesh.dcn \{'data': 2\} spans 2 slices but the devices form 1",
    ):
        config.mesh.dcn.data = 2
        validate(config, num_devices=8)


@pytest.mark.parametrize("impl", ["threefry", "rbg", "unsafe_rbg"])
def test_the_plan_holds_the_prng_impl_and_its_keys_use_it(impl):
    config = default()
    config.prng_impl = impl
    plan = validate(config, num_devices=8)
    assert plan.prng_impl == impl
    key = prng.training_key(plan.seed, plan.prng_impl)
    assert jax.random.key_impl(key) == jax.random.key_impl(jax.random.key(0, impl=prng.IMPLS[impl]))


def test_a_bad_prng_impl_names_the_valid_ones():
    config = default()
    config.prng_impl = "philox"
    message = r"^config.prng_impl='philox'; valid: threefry, rbg, unsafe_rbg$"
    with pytest.raises(config_lib.ConfigError, match=message):
        validate(config, num_devices=8)


# ----------------------------------------------------------------------------------------
# Micro-batches per device: the accumulation follows from the device count


def accumulation(config, num_devices):
    return [phase.batch.grad_accum_steps for phase in validate(config, num_devices).phases]


@pytest.mark.parametrize(
    "recipe, devices, expected",
    [
        # A v4-32 (16 chips), 256 devices, a v5p-1024 (512 chips), a 4-device simulated pod.
        ("bert_lamb.py", 16, [64, 256]),
        ("bert_lamb.py", 256, [4, 16]),
        ("bert_lamb.py", 512, [2, 8]),
        ("bert_lamb.py", 4, [256, 1024]),
        ("bert_lans.py", 16, [96, 192]),
        ("bert_lans.py", 256, [6, 12]),
        ("bert_lans.py", 512, [3, 6]),
        ("bert_lans.py", 1536, [1, 2]),  # the LANS paper's 192 x 8 GPUs
    ],
)
def test_recipes_derive_their_accumulation_from_the_device_count(recipe, devices, expected):
    config = load(os.path.join(CONFIG_DIR, recipe), "large")
    assert accumulation(config, devices) == expected
    for name, steps in zip(config.phase_order, expected, strict=True):
        phase = config.phases[name]
        per_device = phase.global_batch_size // (steps * devices)
        assert per_device == phase.micro_batch_per_device  # 64 (seq 128), 8 or 11 (seq 512)


def test_explicit_grad_accum_steps_wins_over_micro_batch_per_device():
    config = load(os.path.join(CONFIG_DIR, "bert_lamb.py"), "large")
    config.phases.phase1.grad_accum_steps = 32
    assert accumulation(config, 16)[0] == 32
    plain = default()  # neither given: one micro-batch per step
    assert plain.phases.phase1.grad_accum_steps is None
    assert accumulation(plain, 8)[0] == 1


@pytest.mark.parametrize(
    "batch, per_device, devices, message",
    [
        (
            65536,
            64,
            2048,
            "global_batch_size=65536 is not a whole number of micro-batches of "
            "micro_batch_per_device=64 x 2048 data-parallel devices = 131072 rows; "
            "valid micro_batch_per_device: 1, 2, 4, 8, 16, 32",
        ),
        (
            98304,
            40,
            512,
            "micro_batch_per_device=40 x 512 data-parallel devices = 20480 rows; valid "
            "micro_batch_per_device: 1, 2, 3, 4, ..., 96, 192",
        ),
        (
            1000,
            1,
            16,
            "global_batch_size=1000 is not a whole number of micro-batches of "
            "micro_batch_per_device=1 x 16 data-parallel devices = 16 rows; no micro-batch "
            "fits: 1000 is not a multiple of 16",
        ),
    ],
)
def test_a_micro_batch_that_cannot_fit_names_the_numbers(batch, per_device, devices, message):
    config = load(os.path.join(CONFIG_DIR, "bert_lamb.py"), "large")
    config.phases.phase1.global_batch_size = batch
    config.phases.phase1.micro_batch_per_device = per_device
    with pytest.raises(config_lib.ConfigError) as error:
        validate(config, num_devices=devices)
    line = str(error.value)
    assert line.startswith("config.phases.phase1: ") and line.endswith(message), line
    assert "\n" not in line


def test_micro_batch_per_device_must_be_positive():
    config = default(micro_batch_per_device=0)
    with pytest.raises(config_lib.ConfigError, match="micro_batch_per_device=0 must be a pos"):
        validate(config, num_devices=8)


def test_fast_variant_turns_attention_dropout_off_and_explicit_kernels_need_it_off():
    config = load(os.path.join(CONFIG_DIR, "bert_lamb.py"), "large,fast")
    for platform, attention in (("cpu", "xla"), ("tpu", "splash")):  # no fused kernel on CPU
        plan = plan_lib.resolve(config, vocab_size=30522, num_devices=8, platform=platform)
        for phase in plan.phases:
            assert phase.model.attention_dropout == 0.0 and phase.model.hidden_dropout == 0.1
            assert phase.model.attention == attention  # decided once, in the plan
    config = load(os.path.join(CONFIG_DIR, "bert_lamb.py"), "large")
    config.model.overrides.attention = "cudnn"
    with pytest.raises(config_lib.ConfigError, match="attention='cudnn' has no dropout"):
        plan_lib.resolve(config, vocab_size=30522, num_devices=8, platform="gpu")
    config.model.overrides.attention_dropout = 0.0
    phase = plan_lib.resolve(config, vocab_size=30522, num_devices=8, platform="gpu").phases[0]
    assert phase.model.attention == "cudnn"
    with pytest.raises(config_lib.ConfigError, match="runs on gpu only, this is cpu"):
        validate(config, 8)  # planned for this CPU


def test_a_gpu_unrolls_the_layers_unless_the_config_sets_the_loop():
    config = load(os.path.join(CONFIG_DIR, "bert_lamb.py"), "large")

    def first_model(platform):
        plan = plan_lib.resolve(config, vocab_size=30522, num_devices=8, platform=platform)
        return plan.phases[0].model

    assert not first_model("gpu").scan_layers
    assert first_model("cpu").scan_layers
    config.model.overrides.scan_layers = True
    assert first_model("gpu").scan_layers


def test_the_gelu_form_reaches_every_phase_model():
    config = default()
    assert not validate(config, num_devices=8).phases[0].model.gelu_approximate  # erf, as BERT
    config.model.overrides.gelu_approximate = True
    assert all(p.model.gelu_approximate for p in validate(config, num_devices=8).phases)
    with pytest.raises(ValueError, match=r"gelu_approximate='tanh'; valid: True \(tanh\)"):
        BertConfig(gelu_approximate="tanh")


def test_a_vocabulary_larger_than_the_embeddings_is_refused():
    config = default()
    config.model.overrides.vocab_size = 100
    plan = validate(config, 1)
    assert plan.with_vocab_size(100) is plan
    with pytest.raises(config_lib.ConfigError, match="vocab_size=100 is smaller than the "):
        plan.with_vocab_size(101)
    config = default()
    plan = plan_lib.resolve(config, num_devices=1)  # the size is the vocabulary's
    assert plan.vocab_size_from_data
    grown = plan.with_vocab_size(4096)
    assert {p.model.vocab_size for p in grown.phases} == {4096} and not grown.vocab_size_from_data
    assert grown.phases[1].previous is grown.phases[0]
