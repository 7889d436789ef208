#!/usr/bin/env bash
# The main job: a short two-phase pretraining of a tiny BERT on the embedded corpus (CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
exec .venv/bin/python -m lambjax.main --config=configs/default.py --workdir="${WORKDIR:-workdir/demo}" "$@"
