"""The README's commands work as printed.

Every ```bash and ```python block of README.md follows a marker that says how it is checked:

  <!-- readme-test: run -->                     run here, as printed (offline, seconds)
  <!-- readme-test: covered by tests/X.py ... --> run, shortened, by that test
  <!-- readme-test: skip, REASON -->            needs what a test cannot have (a cloud, data)

Blocks run in a scratch folder that links the checkout's folders (so `workdir/...` is written
there, not into the checkout); a ```bash block in `bash -e` after the README's own
`source .venv/bin/activate`, a ```python block with the venv's Python.
"""

import os
import re
import subprocess
import sys

import pytest

from tests import helpers

README = os.path.join(helpers.REPO, "README.md")
BLOCK = re.compile(
    r"(?:<!-- readme-test: (?P<marker>.*?) -->\n)?```(?P<lang>bash|python)\n(?P<code>.*?)```", re.S
)
LINKED = ("configs", "lambjax", "launch", "scripts", "tests", ".venv", "setup.py")


def blocks() -> list[tuple[str | None, str, str]]:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return [(m["marker"], m["lang"], m["code"]) for m in BLOCK.finditer(text)]


def test_every_block_says_how_it_is_checked():
    found = blocks()
    assert len(found) >= 10
    for marker, _, code in found:
        assert marker is not None, f"a README block has no readme-test marker:\n{code}"
        kind = marker.split(",")[0].split(" ")[0]
        assert kind in ("run", "covered", "skip"), marker
        if kind == "covered":
            path = marker.split()[2]
            assert os.path.isfile(os.path.join(helpers.REPO, path)), f"{marker}: no {path}"
        if kind == "skip":
            assert len(marker) > len("skip, ") + 10, f"{marker}: say why it cannot run here"


RUN = [(lang, code) for marker, lang, code in blocks() if marker == "run"]


@pytest.mark.parametrize(("lang", "code"), RUN, ids=[c.splitlines()[0][:40] for _, c in RUN])
def test_block_runs_as_printed(lang, code, tmp_path):
    for name in LINKED:
        os.symlink(os.path.join(helpers.REPO, name), tmp_path / name)
    if lang == "python":
        command = [sys.executable, "-c", code]
    else:
        check = 'python -c "import absl"\n'  # the README's claim for the activated venv
        script = f"source .venv/bin/activate\n{code}\n{check}"
        command = ["bash", "-e", "-o", "pipefail", "-c", script]
    env = helpers.environment(1)
    env.pop("VIRTUAL_ENV", None)
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{code}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
