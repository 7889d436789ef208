"""A config file whose own code fails (its import, its get_config or get_sweep raises) ends
every command in one line naming the file and the exception, exit status 2; --verbosity=1
prints the traceback before it."""

import pytest

from lambjax import cli
from tests import helpers

RAISES = """
def get_config(arg=None):
    return {"a": 1}["missing"]
"""
IMPORT_FAILS = """
import a_module_that_is_not_installed

def get_config(arg=None):
    return None
"""
SWEEP_RAISES = """
from lambjax.train import config as config_lib

def get_config(arg=None):
    return config_lib.base_config()

def get_sweep(arg=None):
    return 1 / 0
"""


@pytest.fixture
def files(tmp_path):
    paths = {}
    for name, text in [("raises", RAISES), ("import_fails", IMPORT_FAILS), ("sweep", SWEEP_RAISES)]:
        paths[name] = tmp_path / f"{name}.py"
        paths[name].write_text(text)
    return paths


@pytest.mark.slow
def test_config_code_errors_end_in_one_line(tmp_path, files):
    workdir = f"--workdir={tmp_path / 'run'}"
    cases = [
        ("lambjax.main", [f"--config={files['raises']}", workdir], "get_config() raised KeyError"),
        ("lambjax.main", [f"--config={files['raises']}:v", workdir], "get_config('v') raised"),
        (
            "lambjax.prepare",
            [f"--config={files['import_fails']}", workdir],
            f"importing {files['import_fails']} raised ModuleNotFoundError",
        ),
        ("lambjax.finetune", [f"--config={files['raises']}", workdir], "raised KeyError"),
        ("lambjax.sweep", [f"--config={files['sweep']}", workdir], "get_sweep() raised Zero"),
    ]
    commands = [(module, args) for module, args, _ in cases]
    codes, errors = helpers.run_command_cases(tmp_path, commands)
    for (module, args, expected), code, stderr in zip(cases, codes, errors, strict=True):
        lines = [line for line in stderr.splitlines() if ": error: " in line]
        assert code == 2 and "Traceback" not in stderr, (module, code, stderr[-2000:])
        assert len(lines) == 1 and stderr.strip().splitlines()[-1] == lines[0], (module, stderr)
        assert expected in lines[0] and args[0] in lines[0], (module, lines[0])
        assert "--verbosity=1 prints the traceback" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_verbosity_prints_the_traceback_then_the_line(tmp_path, files):
    args = [f"--config={files['raises']}", f"--workdir={tmp_path / 'run'}", "--verbosity=1"]
    (code,), (stderr,) = helpers.run_command_cases(tmp_path, [("lambjax.main", args)])
    assert code == 2
    assert "Traceback" in stderr and 'return {"a": 1}["missing"]' in stderr
    assert stderr.strip().splitlines()[-1].startswith("lambjax: error: --config=")


@pytest.mark.parametrize(
    "args, verbose",
    [
        (["--verbosity=1"], True),
        (["-v", "2"], True),
        (["--v=1"], True),
        (["--verbosity=0"], False),
        (["--config.verbosity=1"], False),
        ([], False),
    ],
)
def test_verbose_flag_reads_absl_spellings(args, verbose):
    assert cli.verbose_flag(args) == verbose
