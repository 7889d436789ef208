#!/usr/bin/env bash
# The main job: a short two-phase pretraining of a tiny BERT on the embedded corpus (CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
exec .venv/bin/python -m lambjax.demo "$@"
