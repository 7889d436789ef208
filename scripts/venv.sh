#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv and installs lambjax
# with everything: training (`train`), the tests and `transformers` interop (`test`).
# Re-runs pip only when setup.py changed since the last install. VENV, PYTHON and EXTRAS
# name another environment (scripts/test_compat.sh's).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
stamp="$venv/.lambjax-installed"
want=$(sha256sum setup.py | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet -e ".[${EXTRAS:-train,test}]"
  echo "$want" > "$stamp"
fi
