"""The installed commands (setup.py's console scripts) and their `--help`.

The package is installed without its dependencies into a folder of its own (`pip install
--no-deps --target`), whose bin/ then holds the commands as pip writes them; they run with
this environment's Python and the installed copy of lambjax. Each `--help` starts with the
command's usage and its own flags, not absl's dump of every library's flags; `python -m`
prints the same.
"""

import ast
import configparser
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from lambjax import cli
from tests.helpers import REPO, environment


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("install")
    source = root / "src"
    source.mkdir()
    for name in ("setup.py", "README.md", "pyproject.toml"):
        shutil.copy(os.path.join(REPO, name), source)
    shutil.copytree(
        os.path.join(REPO, "lambjax"), source / "lambjax", ignore=shutil.ignore_patterns("*.pyc")
    )
    target = root / "target"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--target", str(target), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return str(target)


def entry_points(target: str) -> dict[str, str]:
    (info,) = [name for name in os.listdir(target) if name.endswith(".dist-info")]
    parser = configparser.ConfigParser()
    parser.read(os.path.join(target, info, "entry_points.txt"))
    return dict(parser["console_scripts"])


def test_every_command_is_installed_and_runs_a_callable(installed):
    scripts = entry_points(installed)
    assert sorted(scripts) == sorted(cli.COMMANDS.values())
    for command, target in scripts.items():
        module, function = target.split(":")
        assert cli.COMMANDS[module.removesuffix(".__main__")] == command
        # Each module defines its flags once per process: read the function, not import it.
        spec = importlib.util.find_spec(module)
        tree = ast.parse(open(spec.origin, encoding="utf-8").read())
        functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
        assert function in functions, f"{module} has no function {function}"
        assert spec.origin.startswith(REPO)
        assert os.access(os.path.join(installed, "bin", command), os.X_OK)


@pytest.mark.parametrize("module", list(cli.COMMANDS))
def test_help_starts_with_the_usage_and_the_commands_own_flags(installed, module):
    command = cli.COMMANDS[module]
    env = {**environment(1), "PYTHONPATH": installed}
    result = subprocess.run(
        [os.path.join(installed, "bin", command), "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0] == f"usage: {command} [flags]   (or: python -m {module} [flags])"
    flags = lines[lines.index("flags:") + 1 :]
    assert any(line.startswith("  --workdir") for line in flags)
    assert len(lines) < 80, "the help lists other modules' flags"
    assert lines[-1].startswith("--helpfull lists every flag")

    as_module = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=REPO,
        env=environment(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert as_module.stdout == result.stdout
