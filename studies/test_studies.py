"""What every study shares: its sizes named when given another (in-process, each config, and
once as the command's last line), and one dataset for all the smallest forms."""

import glob
import importlib
import os
import sys

import pytest

from lambjax import cli
from studies import common
from tests.helpers import REPO, run

STUDIES = sorted(glob.glob(os.path.join(REPO, "studies", "*", "config.py")))


def study_name(path: str) -> str:
    return os.path.basename(os.path.dirname(path))


def test_the_studies_smallest_forms_share_one_dataset():
    """Every study's `smoke` size (studies/*/config.py) reads the dataset the others read:
    the same data settings at the same sequence length, so the suite builds it once
    (conftest.py's study_data_dir); the same predictions per sequence too."""
    forms = {}
    for path in STUDIES:
        config = cli.load_module(path)[0].get_config("smoke")
        for name in config.phase_order:
            phase = config.phases[name]
            forms[f"{study_name(path)}:{name}"] = (
                config.data.to_dict(),
                phase.max_seq_length,
                phase.max_predictions_per_seq,
            )
    assert len(forms) >= 3, sorted(forms)
    first = next(iter(forms.values()))
    assert first[0] == common.cpu_study_config().data.to_dict()
    assert {name: form == first for name, form in forms.items()} == dict.fromkeys(forms, True)


@pytest.mark.parametrize("path", STUDIES, ids=study_name)
def test_a_study_names_its_sizes_when_given_another(path):
    module = cli.load_module(path)[0]
    valid = ", ".join(module.SIZES)
    for function in (module.get_config, module.get_sweep, module.get_study):
        with pytest.raises(ValueError, match=f"^size 'huge'; valid: {valid}$"):
            function("huge")


@pytest.mark.slow  # a subprocess that starts lambjax.sweep
def test_an_unknown_study_size_ends_the_command_with_one_line(tmp_path):
    config = "studies/pld/config.py"
    command = [sys.executable, "-m", "lambjax.sweep", f"--config={config}:huge"]
    result = run([*command, f"--workdir={tmp_path}/x"], 1, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"lambjax.sweep: error: --config={config}:huge: size 'huge'; valid: cpu, base, smoke"
    )
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("path", STUDIES, ids=study_name)
def test_a_study_names_the_module_that_reports_it(path):
    study = cli.load_module(path)[0].get_study("smoke")
    assert study["report"] == f"studies.{study_name(path)}.report"
    assert callable(importlib.import_module(study["report"]).study_report)
