"""The step-method hook (lambjax.train.method): the core imports no contrib module, and a
config that names a step method the core cannot load stops with one line."""

import os
import subprocess
import sys

import pytest

from configs import bert_lamb
from lambjax.train import config as config_lib
from lambjax.train import plan as plan_lib
from tests.helpers import REPO

# The studies' own code (it moves to studies/), which reads lambjax.contrib.
STUDY_MODULES = ("lambjax.sweep.chunked_accumulation",)

IMPORT_THE_CORE = f"""
import importlib, pathlib, sys
from absl import flags
skipped = ("lambjax.contrib", "__main__") + {STUDY_MODULES!r}
names = sorted(
    ".".join(path.with_suffix("").parts).removesuffix(".__init__")
    for path in pathlib.Path("lambjax").rglob("*.py")
)
names = [name for name in names if not any(part in name for part in skipped)]
for name in names:
    for flag in list(flags.FLAGS):  # each command defines its own flags (--workdir, ...)
        delattr(flags.FLAGS, flag)
    importlib.import_module(name)
    loaded = sorted(m for m in sys.modules if m.startswith("lambjax.contrib"))
    if loaded:
        sys.exit(f"importing {{name}} imported {{loaded}}")
print(len(names))
"""


def test_the_core_imports_no_contrib_module():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_THE_CORE],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[-1]) > 40  # every module of lambjax was imported


def resolve(config):
    return plan_lib.resolve(config, vocab_size=config.data.vocab_size, num_devices=1)


def test_a_step_method_that_cannot_be_imported_stops_with_one_line():
    config = bert_lamb.get_config("runlocal")
    config.step_method = "lambjax.contrib.no_such_method"
    with pytest.raises(config_lib.ConfigError) as error:
        resolve(config)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("config.step_method='lambjax.contrib.no_such_method' cannot be")
    assert "valid: '' (the core train step)" in message


def test_a_module_that_is_no_step_method_is_named():
    config = bert_lamb.get_config("runlocal")
    config.step_method = "lambjax.train.layerwise"
    with pytest.raises(config_lib.ConfigError, match="is not a step method: it lacks"):
        resolve(config)


def test_the_core_step_runs_without_a_step_method_and_no_stage_axis():
    config = bert_lamb.get_config("runlocal")
    assert config.step_method == ""
    assert all(phase.step_method is None for phase in resolve(config).phases)
    config.mesh.stage = 2
    message = "mesh stage=2 is an axis the core train step does not run on"
    with pytest.raises(config_lib.ConfigError, match=message):
        plan_lib.resolve(config, vocab_size=config.data.vocab_size, num_devices=2)


def test_the_ouroboros_variant_names_its_module_and_plans_its_settings():
    config = bert_lamb.get_config("ouroboros,runlocal")
    assert config.step_method == "lambjax.contrib.ouroboros"
    phases = plan_lib.resolve(config, vocab_size=config.data.vocab_size, num_devices=4).phases
    assert [type(p.step_method).__name__ for p in phases] == ["OuroborosPlan"] * len(phases)
    assert (phases[0].step_method.num_modules, phases[0].step_method.replay) == (3, "stale")
    assert not phases[0].step_method.runs_per_layer
