#!/usr/bin/env bash
# lambjax on Cloud TPU VMs, through `gcloud compute tpus`. Runs from any directory.
#
#   launch/tpu/tpu_vm.sh COMMAND [--setting=value ...] [-- lambjax.main flags]
#
# Commands:
#   create        a TPU VM (QUEUED=1: a queued resource, then waits until it is ACTIVE)
#   wait          waits until the queued resource is ACTIVE (QUEUE_TIMEOUT seconds at most)
#   install       ships this checkout's HEAD commit to every worker; a uv-managed Python 3.11
#                 venv there with lambjax[train] and jax[tpu]
#   train         starts python -m lambjax.main --config=$CONFIG --workdir=$BUCKET/$RUN and
#                 the flags after `--` on every worker (leftover processes and the libtpu
#                 lockfile cleared first); a run that exists resumes from its checkpoint
#   run           create (if needed), install, train, and supervise until the run finishes:
#                 a preempted spot VM or queued resource is deleted, created again, and the
#                 run resumes; every worker's log is collected at the end
#   status        every worker's trainer: running, stopped, exit N, none
#   stop          SIGTERM on every worker; returns once every worker has saved and exited
#   logs          follows worker 0's log
#   collect-logs  copies every worker's log to $LOGS_DIR/worker-N.log
#   delete        the TPU VM (or queued resource)
#
# Settings (environment variables, or --setting=value with the name in lower case and
# dashes, e.g. --zone=us-central2-b):
#   PROJECT, ZONE, TPU_NAME        required
#   ACCELERATOR_TYPE               v4-32 (default), v5litepod-16, v5p-32, v6e-16, ...
#   RUNTIME_VERSION                default: chosen from ACCELERATOR_TYPE (README table)
#   BUCKET, RUN, CONFIG            the workdir is $BUCKET/$RUN (gs://..., shared by all
#                                  workers); CONFIG: configs/X.py[:size,variants]
#   SPOT=1, QUEUED=1               spot capacity; a queued resource instead of a plain VM
#   QUEUE_TIMEOUT (21600 s), POLL_SECONDS (60), STOP_TIMEOUT (900 s), MAX_RECREATES (20),
#   LOGS_DIR (tpu-logs/$RUN), DRY_RUN=1 (print the gcloud commands, run nothing)
set -euo pipefail
LAUNCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() {
  echo "tpu_vm.sh: $*" >&2
  exit "${EXIT:-1}"
}
usage() {
  EXIT=2 die "$*; usage: tpu_vm.sh create|wait|install|train|run|status|stop|logs|collect-logs|delete [--setting=value ...] [-- lambjax.main flags]"
}

SETTINGS=(PROJECT ZONE TPU_NAME ACCELERATOR_TYPE RUNTIME_VERSION BUCKET RUN CONFIG SPOT QUEUED
  QUEUE_TIMEOUT POLL_SECONDS STOP_TIMEOUT MAX_RECREATES LOGS_DIR DRY_RUN)
COMMAND="${1:-}"
[ $# -gt 0 ] && shift
TRAIN_FLAGS=()
while [ $# -gt 0 ]; do
  arg="$1"
  shift
  case "$arg" in
    --)
      TRAIN_FLAGS=("$@")
      break
      ;;
    --*=*)
      name="$(echo "${arg%%=*}" | sed 's/^--//' | tr 'a-z-' 'A-Z_')"
      if ! printf '%s\n' "${SETTINGS[@]}" | grep -qx "$name"; then
        usage "unknown setting $arg (settings: $(printf -- '--%s ' "${SETTINGS[@]}" | tr 'A-Z_' 'a-z-')and lambjax.main flags after --)"
      fi
      printf -v "$name" '%s' "${arg#*=}"
      ;;
    *) usage "unexpected argument $arg (lambjax.main flags go after --)" ;;
  esac
done

ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-32}"
CONFIG="${CONFIG:-configs/bert_lamb.py:large}"
QUEUE_TIMEOUT="${QUEUE_TIMEOUT:-21600}"
POLL_SECONDS="${POLL_SECONDS:-60}"
STOP_TIMEOUT="${STOP_TIMEOUT:-900}"
MAX_RECREATES="${MAX_RECREATES:-20}"

# The TPU software version for an accelerator type (Cloud TPU's "TPU software versions").
runtime_for() {
  case "$1" in
    v2-* | v3-* | v4-*) echo tpu-ubuntu2204-base ;;
    v5litepod-* | v5e-*) echo v2-alpha-tpuv5-lite ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    *) EXIT=2 die "no default runtime version for ACCELERATOR_TYPE=$1: set RUNTIME_VERSION" ;;
  esac
}

settings() {
  : "${PROJECT:?set PROJECT}" "${ZONE:?set ZONE}" "${TPU_NAME:?set TPU_NAME}"
  RUNTIME_VERSION="${RUNTIME_VERSION:-$(runtime_for "$ACCELERATOR_TYPE")}"
  RUN="${RUN:-$TPU_NAME}"
  LOGS_DIR="${LOGS_DIR:-tpu-logs/$RUN}"
  WHERE=(--project="$PROJECT" --zone="$ZONE")
}

log() { echo "[tpu_vm $(date -u +%H:%M:%S)] $*"; }

run() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "$@"
    echo
  else
    "$@"
  fi
}

tpus() { gcloud compute tpus "$@" "${WHERE[@]}"; }
queued() { [ "${QUEUED:-0}" = 1 ]; }

# A command line for the workers' shell, every word quoted.
quote() { printf '%q ' "$@"; }
on_workers() {  # on_workers all|N COMMAND_LINE
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${WHERE[@]}" --worker="$1" --command="$2"
}
worker_script() { echo "bash ~/lambjax/launch/tpu/worker.sh $1"; }

# --- The TPU's state ------------------------------------------------------------------------

# Prints the node's state (READY, CREATING, PREEMPTED, ...; MISSING when it does not exist);
# with QUEUED=1 the queued resource's (WAITING_FOR_RESOURCES, ACTIVE, SUSPENDED, ...).
state() {
  local out
  if queued; then
    out="$(tpus queued-resources describe "$TPU_NAME" --format='value(state.state)' 2>&1)" ||
      { [[ "$out" == *NOT_FOUND* ]] && echo MISSING || echo "UNKNOWN"; return; }
  else
    out="$(tpus tpu-vm describe "$TPU_NAME" --format='value(state)' 2>&1)" ||
      { [[ "$out" == *NOT_FOUND* ]] && echo MISSING || echo "UNKNOWN"; return; }
  fi
  echo "$out"
}

healthy() { local s; s="$(state)"; [ "$s" = READY ] || [ "$s" = ACTIVE ]; }

worker_count() {
  tpus tpu-vm describe "$TPU_NAME" --format='value(networkEndpoints[].ipAddress)' |
    tr ';' '\n' | grep -c .
}

# --- Commands -------------------------------------------------------------------------------

create() {
  local spot=()
  [ "${SPOT:-0}" = 1 ] && spot=(--spot)
  if queued; then
    run gcloud compute tpus queued-resources create "$TPU_NAME" "${WHERE[@]}" \
      --node-id="$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE" \
      --runtime-version="$RUNTIME_VERSION" "${spot[@]}"
    [ "${DRY_RUN:-0}" = 1 ] || wait_active
  else
    run gcloud compute tpus tpu-vm create "$TPU_NAME" "${WHERE[@]}" \
      --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" "${spot[@]}"
  fi
}

# A queued resource waits (WAITING_FOR_RESOURCES, PROVISIONING, ...) before its node exists.
wait_active() {
  local deadline=$((SECONDS + QUEUE_TIMEOUT)) s="" last=""
  while :; do
    s="$(state)"
    [ "$s" = "$last" ] || log "$TPU_NAME: $s"
    last="$s"
    case "$s" in
      ACTIVE | READY) return 0 ;;
      FAILED | SUSPENDED | SUSPENDING | DELETING | MISSING)
        die "$TPU_NAME is $s, it will not become ACTIVE (delete and create it again)"
        ;;
    esac
    [ "$SECONDS" -lt "$deadline" ] ||
      die "$TPU_NAME still $s after QUEUE_TIMEOUT=${QUEUE_TIMEOUT}s; it stays queued (tpu_vm.sh wait, or delete)"
    sleep "$POLL_SECONDS"
  done
}

install() {
  local repo archive
  repo="$(git -C "$LAUNCH_DIR" rev-parse --show-toplevel)"
  archive="$(mktemp -d)/lambjax.tar.gz"
  run git -C "$repo" archive --format=tar.gz -o "$archive" HEAD
  run gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME:~/lambjax.tar.gz" "${WHERE[@]}" --worker=all
  # Fresh sources over the previous ones; the venv and the run's log stay.
  on_workers all "mkdir -p ~/lambjax && find ~/lambjax -mindepth 1 -maxdepth 1 ! -name .venv ! -name 'train.*' -exec rm -rf {} + && tar -xzf ~/lambjax.tar.gz -C ~/lambjax && $(worker_script install)"
}

train() {
  : "${BUCKET:?set BUCKET (gs://...), the workdir every worker shares}"
  on_workers all "$(worker_script start) $(quote --config="$CONFIG" --workdir="$BUCKET/$RUN" "${TRAIN_FLAGS[@]}")"
}

stop() { on_workers all "$(worker_script stop) $(quote "$STOP_TIMEOUT")"; }

status() { on_workers all "$(worker_script status)"; }

collect_logs() {
  local n i
  n="$(worker_count)"
  mkdir -p "$LOGS_DIR"
  for ((i = 0; i < n; i++)); do
    run gcloud compute tpus tpu-vm scp "$TPU_NAME:~/lambjax/train.log" "$LOGS_DIR/worker-$i.log" \
      "${WHERE[@]}" --worker="$i" || log "worker $i: no log"
  done
  log "logs of $n workers in $LOGS_DIR"
}

delete() {
  if queued; then
    run gcloud compute tpus queued-resources delete "$TPU_NAME" "${WHERE[@]}" --force --quiet
  else
    run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${WHERE[@]}" --quiet
  fi
}

# The workers' statuses, summed up: running, finished, stopped, failed (exit N) or unknown.
run_state() {
  local out n
  out="$(status 2> /dev/null | grep '^lambjax-worker: ' | sed 's/^lambjax-worker: //')" || true
  n="$(worker_count 2> /dev/null || echo 0)"
  if [ "$n" = 0 ] || [ "$(echo "$out" | grep -c .)" != "$n" ]; then
    echo unknown
  elif echo "$out" | grep -q '^running$'; then
    echo running
  elif echo "$out" | grep -qv -e '^exit 0$' -e '^stopped$'; then
    echo "failed: $(echo "$out" | grep -v -e '^exit 0$' -e '^stopped$' | sort | uniq -c | xargs)"
  elif echo "$out" | grep -q '^stopped$'; then
    echo stopped
  else
    echo finished
  fi
}

supervise() {
  : "${BUCKET:?set BUCKET (gs://...), the workdir every worker shares}"
  [ "${DRY_RUN:-0}" != 1 ] || EXIT=2 die "run follows the TPU's state: it has no DRY_RUN"
  local recreated=0 started=0 s now
  recreate_once() {
    [ "$recreated" -lt "$MAX_RECREATES" ] ||
      die "$TPU_NAME is $1 again after $recreated re-creations (MAX_RECREATES=$MAX_RECREATES)"
    recreated=$((recreated + 1))
    log "$TPU_NAME is $1 (preempted?): creating it again ($recreated), then resuming the run"
  }
  s="$(state)"
  if [ "$s" = READY ] || [ "$s" = ACTIVE ]; then
    started=1
    now="$(run_state)"
    if [ "$now" = running ]; then
      log "the run is already running: supervising it"
    else
      install
      train
    fi
  fi
  while :; do
    s="$(state)"
    if [ "$s" != READY ] && [ "$s" != ACTIVE ]; then
      case "$s" in
        CREATING | ACCEPTED | PROVISIONING | WAITING_FOR_RESOURCES | RESTARTING | REPAIRING | STARTING)
          log "$TPU_NAME: $s"
          queued && wait_active || { sleep "$POLL_SECONDS"; continue; }
          ;;
        MISSING)
          if [ "$started" = 1 ]; then
            recreate_once "$s"
          else
            log "creating $TPU_NAME"
          fi
          create
          ;;
        *)
          recreate_once "$s"
          delete
          create
          ;;
      esac
      install
      train
      started=1
    fi
    sleep "$POLL_SECONDS"
    healthy || continue
    now="$(run_state)"
    case "$now" in
      running | unknown) ;;
      finished)
        collect_logs
        log "the run finished"
        return 0
        ;;
      stopped)
        # Stopped with the TPU still healthy a poll later: `stop` did it, not a preemption.
        sleep "$POLL_SECONDS"
        healthy || continue
        collect_logs
        log "the run was stopped (saved); \`run\` again resumes it"
        return 0
        ;;
      failed*)
        collect_logs
        die "the run $now; logs in $LOGS_DIR"
        ;;
    esac
  done
}

case "$COMMAND" in
  create) settings; create ;;
  wait) settings; wait_active ;;
  install) settings; install ;;
  train) settings; train ;;
  run) settings; supervise ;;
  status) settings; status ;;
  stop) settings; stop ;;
  logs)
    settings
    on_workers 0 "tail -n 100 -f ~/lambjax/train.log"
    ;;
  collect-logs) settings; collect_logs ;;
  delete) settings; delete ;;
  "") usage "no command" ;;
  *) usage "unknown command $COMMAND" ;;
esac
