#!/usr/bin/env bash
# The whole test suite: lint, format check, then pytest on 2 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
.venv/bin/ruff check lambjax configs launch tests benchmarks studies conftest.py
.venv/bin/ruff format --check lambjax configs launch tests benchmarks studies conftest.py
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@" tests studies
