#!/usr/bin/env bash
# What launch/tpu/tpu_vm.sh runs on every TPU VM worker (over `gcloud ... ssh --worker=all`),
# from the shipped checkout in ~/lambjax:
#
#   worker.sh install           Python 3.11 venv (uv-managed) with lambjax[train] and jax[tpu]
#   worker.sh start FLAGS...    clears leftovers, starts python -m lambjax.main FLAGS in the
#                               background (log: train.log, pid: train.pid)
#   worker.sh stop SECONDS      SIGTERM; returns once the process has saved and exited
#   worker.sh status            one line: `lambjax-worker: running|stopped|exit N|none`
#
# The TPU VM images' own python3 is 3.10 (Ubuntu 22.04); lambjax needs 3.11 or newer, so the
# venv's interpreter is one that uv downloads and manages.
set -euo pipefail
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON_VERSION="${PYTHON_VERSION:-3.11}"
# The JAX each Python resolves (setup.py): 0.10.x on 3.11, 0.11.x on 3.12 and later.
if [ "$PYTHON_VERSION" = 3.11 ]; then JAX_TPU="jax[tpu]>=0.10,<0.11"; else JAX_TPU="jax[tpu]>=0.11,<0.12"; fi
# libtpu takes this lock while a process holds the TPU; one killed without cleaning up
# leaves it behind, and the next process then fails to open the TPU.
LIBTPU_LOCKFILE="${LIBTPU_LOCKFILE:-/tmp/libtpu_lockfile}"
# The trainer's own processes, not shells whose command line mentions it (and, below, only
# those running in this checkout).
TRAINER_PATTERN='^[^ ]*python[0-9.]* -m lambjax\.main'

say() { echo "lambjax-worker: $*"; }

install() {
  export PATH="$HOME/.local/bin:$PATH"  # where uv's installer puts uv
  if ! command -v uv > /dev/null; then
    curl -LsSf https://astral.sh/uv/install.sh | sh
  fi
  cd "$DIR"
  uv venv --allow-existing --python "$PYTHON_VERSION" .venv
  uv pip install --python .venv/bin/python -e ".[train]" "$JAX_TPU"
  say "installed: $(.venv/bin/python --version)"
}

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2> /dev/null; }

# Waits up to $2 seconds for process $1 to exit; false if it is still alive then.
wait_gone() {
  local deadline=$((SECONDS + $2))
  while alive "$1"; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 1
  done
}

clear_leftovers() {
  local pid
  pid="$(cat "$DIR/train.pid" 2> /dev/null || true)"
  if alive "$pid"; then
    say "stopping the previous run's process $pid"
    kill -TERM "$pid" 2> /dev/null || true
    wait_gone "$pid" 120 || kill -KILL "$pid" 2> /dev/null || true
  fi
  for pid in $(pgrep -f "$TRAINER_PATTERN" || true); do
    # Only this checkout's trainers (their working directory is $DIR), no other user's.
    [ "$(readlink "/proc/$pid/cwd" 2> /dev/null)" = "$DIR" ] || continue
    say "killing leftover trainer process $pid"
    kill -KILL "$pid" 2> /dev/null || true
  done
  rm -f "$LIBTPU_LOCKFILE"
}

start() {
  [ -x "$DIR/.venv/bin/python" ] || { say "no venv in $DIR: run install first" >&2; exit 1; }
  clear_leftovers
  rm -f "$DIR/train.status" "$DIR/train.pid"
  echo "=== $(date -u +%FT%TZ) lambjax.main $*" >> "$DIR/train.log"
  # Its own session: the run outlives this ssh connection.
  nohup setsid bash "${BASH_SOURCE[0]}" _run "$@" > /dev/null 2>&1 < /dev/null &
  local deadline=$((SECONDS + 30))
  until [ -s "$DIR/train.pid" ]; do
    [ "$SECONDS" -lt "$deadline" ] || { say "the trainer did not start" >&2; exit 1; }
    sleep 0.2
  done
  say "started process $(cat "$DIR/train.pid")"
}

_run() {
  cd "$DIR"
  .venv/bin/python -m lambjax.main "$@" >> train.log 2>&1 &
  local pid=$!
  echo "$pid" > train.pid
  local code=0
  wait "$pid" || code=$?
  # A stop request (SIGTERM: `stop`, a preemption) saves and exits 0, as a finished run does.
  if [ "$code" = 0 ] && tail -n 20 train.log | grep -q "Stopped in phase"; then
    echo stopped > train.status
  else
    echo "exit $code" > train.status
  fi
}

stop() {
  local timeout="${1:-900}" pid
  pid="$(cat "$DIR/train.pid" 2> /dev/null || true)"
  if alive "$pid"; then
    kill -TERM "$pid" 2> /dev/null || true
    if ! wait_gone "$pid" "$timeout"; then
      say "process $pid still saving after ${timeout}s" >&2
      exit 1
    fi
  fi
  # The status follows the process's exit at once; wait for it briefly.
  local deadline=$((SECONDS + 10))
  while [ -n "$pid" ] && [ ! -s "$DIR/train.status" ] && [ "$SECONDS" -lt "$deadline" ]; do
    sleep 0.2
  done
  status
}

status() {
  local pid deadline
  pid="$(cat "$DIR/train.pid" 2> /dev/null || true)"
  if [ ! -s "$DIR/train.status" ] && [ -n "$pid" ] && ! alive "$pid"; then
    # The process has just ended: its status follows at once.
    deadline=$((SECONDS + 5))
    while [ ! -s "$DIR/train.status" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
  fi
  if [ -s "$DIR/train.status" ]; then
    say "$(cat "$DIR/train.status")"
  elif alive "$pid"; then
    say running
  else
    say none
  fi
}

case "${1:-}" in
  install | start | stop | status | _run)
    command="$1"
    shift
    "$command" "$@"
    ;;
  *)
    echo "usage: $0 install|start FLAGS...|stop [SECONDS]|status" >&2
    exit 2
    ;;
esac
