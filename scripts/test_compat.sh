#!/usr/bin/env bash
# The compatibility tier: lambjax on the other JAX it supports, jax 0.11.x on Python 3.12 (as
# the accelerator images ship it), in .venv-compat/. The optimizers, the model, the train
# step, attention and its lowering for GPU and TPU, the XLA flags, cluster detection, the
# device check at tiny size and one short two-phase run of the demo. Extra arguments go to
# pytest. The full suite runs on jax 0.10.x (scripts/test.sh); CI runs both.
set -euo pipefail
cd "$(dirname "$0")/.."
# A Python 3.12 that runs: PYTHON_COMPAT, python3.12 on PATH, else one that pyenv installed
# (pyenv's shim answers "command not found" when 3.12 is not the selected version).
python=""
for candidate in "${PYTHON_COMPAT:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
  if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    python=$(command -v "$candidate")
    break
  fi
done
if [ -z "$python" ]; then
  echo "scripts/test_compat.sh: no Python 3.12 found (PATH, pyenv); name one in PYTHON_COMPAT" >&2
  exit 2
fi
VENV=.venv-compat PYTHON="$python" EXTRAS=compat bash scripts/venv.sh
.venv-compat/bin/python -c 'import jax, sys; print(f"compat tier: jax {jax.__version__}, Python {sys.version.split()[0]}")'
exec .venv-compat/bin/python -m pytest -n 2 --dist loadfile -m "not slow or compat" "$@" \
  tests/optim tests/models/test_bert.py tests/models/test_attention.py \
  tests/models/test_packing.py tests/train/test_step.py tests/test_xla_flags.py \
  tests/launch/test_distributed.py tests/benchmarks/test_device_check.py tests/test_install.py \
  "tests/train/test_runs.py::test_two_phases_run_and_learn"
