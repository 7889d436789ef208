#!/usr/bin/env bash
# lambjax on Cloud TPU VMs, through `gcloud compute tpus`. Runs from any directory.
#
#   launch/tpu/tpu_vm.sh COMMAND [--setting=value ...] [-- lambjax.main flags]
#
# Commands:
#   create        a TPU VM (QUEUED=1: a queued resource, then waits until it is ACTIVE)
#   wait          waits until the queued resource is ACTIVE (QUEUE_TIMEOUT seconds at most)
#   install       ships this checkout's HEAD commit to every worker; a uv-managed Python
#                 (PYTHON_VERSION: 3.11 with jax 0.10, 3.12 with jax 0.11) venv there with
#                 lambjax[train] and jax[tpu]
#   train         starts python -m lambjax.main --config=$CONFIG --workdir=$BUCKET/$RUN and
#                 the flags after `--` on every worker (leftover processes and the libtpu
#                 lockfile cleared first); a run that exists resumes from its checkpoint
#   run           create (if needed), install, train, and supervise until the run finishes:
#                 a preempted spot VM or queued resource is deleted, created again, and the
#                 run resumes; every worker's log is collected at the end. It rides out what
#                 is not a preemption: a describe that fails (a 5xx, a 429, the network) is
#                 retried, and only an explicit PREEMPTED, TERMINATED, FAILED or (queued)
#                 SUSPENDED state deletes anything; a create that fails for capacity (a
#                 stock-out) or a transient error, and an install or train whose SSH
#                 connection dropped (exit 255), are retried. Waits between retries double
#                 from POLL_SECONDS up to RETRY_MAX_SECONDS, and each retry is logged with
#                 its reason. Cloud TPU gives no notice before a preemption: what a run loses
#                 is bounded by its checkpoint interval (config.checkpoint_every_minutes).
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
#   QUEUE_TIMEOUT (21600 s), POLL_SECONDS (60), RETRY_MAX_SECONDS (600), STOP_TIMEOUT (900 s),
#   PYTHON_VERSION (3.11), MAX_RECREATES (20), LOGS_DIR (tpu-logs/$RUN), DRY_RUN=1 (print the gcloud commands, run
#   nothing)
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
  QUEUE_TIMEOUT POLL_SECONDS RETRY_MAX_SECONDS STOP_TIMEOUT MAX_RECREATES LOGS_DIR DRY_RUN
  PYTHON_VERSION)
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
RETRY_MAX_SECONDS="${RETRY_MAX_SECONDS:-600}"
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
  local name
  for name in POLL_SECONDS RETRY_MAX_SECONDS; do
    [[ "${!name}" =~ ^[0-9]+(\.[0-9]+)?$ ]] && [ "${!name}" != 0 ] ||
      EXIT=2 die "$name=${!name} must be a positive number of seconds"
  done
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
worker_script() {  # the Python the workers' venv uses (and so their JAX) goes with each call
  echo "PYTHON_VERSION=$(quote "${PYTHON_VERSION:-3.11}")bash ~/lambjax/launch/tpu/worker.sh $1"
}

# --- The TPU's state ------------------------------------------------------------------------

# Prints the node's state (READY, CREATING, PREEMPTED, ...; MISSING when it does not exist);
# with QUEUED=1 the queued resource's (WAITING_FOR_RESOURCES, ACTIVE, SUSPENDED, ...). Only
# describe's stdout is the state: gcloud writes update notices and warnings to stderr. A
# describe that fails otherwise than NOT_FOUND (a 5xx, a 429, the network) prints
# `UNKNOWN: <its error>`: nothing is known about the node then.
state() {
  local out errors code=0
  errors="$(mktemp)"
  if queued; then
    out="$(tpus queued-resources describe "$TPU_NAME" --format='value(state.state)' 2> "$errors")" || code=$?
  else
    out="$(tpus tpu-vm describe "$TPU_NAME" --format='value(state)' 2> "$errors")" || code=$?
  fi
  out="$(echo "$out" | head -n 1 | tr -d '[:space:]')"
  if [ "$code" = 0 ] && [ -n "$out" ]; then
    echo "$out"
  elif [ "$code" != 0 ] && grep -q NOT_FOUND "$errors"; then
    echo MISSING
  else
    echo "UNKNOWN: $(error_of "$errors") (exit $code)"
  fi
  rm -f "$errors"
}

# The last line of a command's stderr that says something, cut to 300 characters.
error_of() { grep -v '^[[:space:]]*$' "$1" | tail -n 1 | cut -c 1-300; }

# Seconds before retry number $1: POLL_SECONDS, doubled each time, at most RETRY_MAX_SECONDS.
backoff() {
  awk -v p="$POLL_SECONDS" -v n="$1" -v m="$RETRY_MAX_SECONDS" \
    'BEGIN { d = p * 2 ^ (n - 1); print (d < m ? d : m) }'
}

retry_after() {  # retry_after ATTEMPT WHAT REASON
  local delay
  delay="$(backoff "$1")"
  log "$2 failed ($3): retry $1 in ${delay}s"
  sleep "$delay"
}

healthy() { local s; s="$(state)"; [ "$s" = READY ] || [ "$s" = ACTIVE ]; }

worker_count() {
  tpus tpu-vm describe "$TPU_NAME" --format='value(networkEndpoints[].ipAddress)' |
    tr ';' '\n' | grep -c .
}

# --- Commands -------------------------------------------------------------------------------

create() {
  create_request
  if queued && [ "${DRY_RUN:-0}" != 1 ]; then wait_active; fi
}

# The create call alone (a queued resource is then waiting, not yet ACTIVE).
create_request() {
  local spot=()
  [ "${SPOT:-0}" = 1 ] && spot=(--spot)
  if queued; then
    run gcloud compute tpus queued-resources create "$TPU_NAME" "${WHERE[@]}" \
      --node-id="$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE" \
      --runtime-version="$RUNTIME_VERSION" "${spot[@]}"
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

# Errors after which a create is worth trying again (the API's status names and codes, its
# HTTP statuses, a stock-out's "no more capacity", gcloud's own network errors).
RETRYABLE='RESOURCE_EXHAUSTED|UNAVAILABLE|INTERNAL|DEADLINE_EXCEEDED|ABORTED|[Cc]apacity|"code": ?(4|8|10|13|14)[,}]|HTTP 429|HTTP 50[0-4]|\((Connection|Transport|Timeout)Error\)'

# create, for `run`: true once created (or already there), false after an error worth a
# retry (its reason in $1); any other error ends the script.
create_for_run() {
  local errors="$1" code=0
  create_request 2> "$errors" || code=$?
  cat "$errors" >&2
  if [ "$code" = 0 ] || grep -q ALREADY_EXISTS "$errors"; then return 0; fi
  grep -qE "$RETRYABLE" "$errors" || die "creating $TPU_NAME failed: $(error_of "$errors")"
  return 1
}

# install, then train; a command whose SSH connection dropped (gcloud's ssh exits 255) is
# retried up to 5 times. False when the workers stay unreachable; any other failure ends
# the script.
start_run() {
  local command attempt code
  for command in install train; do
    attempt=0
    while :; do
      code=0
      "$command" || code=$?
      [ "$code" = 0 ] && break
      [ "$code" = 255 ] || die "$command on $TPU_NAME failed (exit $code)"
      attempt=$((attempt + 1))
      [ "$attempt" -le 5 ] || return 1
      retry_after "$attempt" "$command on $TPU_NAME" "SSH connection dropped, exit 255"
    done
  done
}

supervise() {
  : "${BUCKET:?set BUCKET (gs://...), the workdir every worker shares}"
  [ "${DRY_RUN:-0}" != 1 ] || EXIT=2 die "run follows the TPU's state: it has no DRY_RUN"
  # lost: the TPU was lost (preempted, or gone) and is not created again yet; to_start: the
  # run must be started on it (after a creation, or on the first READY).
  local recreated=0 lost=0 to_start=1 s="" last="" now unknown=0 create_failures=0 errors
  errors="$(mktemp)"
  trap 'rm -f "$errors"' RETURN
  if healthy && [ "$(run_state)" = running ]; then
    log "the run is already running: supervising it"
    to_start=0
  fi
  while :; do
    s="$(state)"
    if [[ "$s" == UNKNOWN* ]]; then
      unknown=$((unknown + 1))
      retry_after "$unknown" "describing $TPU_NAME" "${s#UNKNOWN: }"
      continue
    fi
    unknown=0
    [ "$s" = "$last" ] || log "$TPU_NAME: $s"
    last="$s"
    case "$s" in
      READY | ACTIVE) ;;
      PREEMPTED | TERMINATED | FAILED | SUSPENDED)
        # The only states that delete: the node (or request) is gone for good.
        if [ "$lost" = 0 ]; then
          [ "$recreated" -lt "$MAX_RECREATES" ] ||
            die "$TPU_NAME is $s again after $recreated re-creations (MAX_RECREATES=$MAX_RECREATES)"
          recreated=$((recreated + 1))
          lost=1
          log "$TPU_NAME is $s (preempted?): creating it again ($recreated), then resuming the run"
        fi
        if ! delete 2> "$errors"; then
          retry_after 1 "deleting $TPU_NAME" "$(error_of "$errors")"
        fi
        continue
        ;;
      MISSING)
        if [ "$to_start" = 0 ] && [ "$lost" = 0 ]; then
          [ "$recreated" -lt "$MAX_RECREATES" ] ||
            die "$TPU_NAME is gone again after $recreated re-creations (MAX_RECREATES=$MAX_RECREATES)"
          recreated=$((recreated + 1))
          log "$TPU_NAME is gone (preempted?): creating it again ($recreated), then resuming the run"
        fi
        lost=1
        if create_for_run "$errors"; then
          create_failures=0
          lost=0
          to_start=1
        else
          create_failures=$((create_failures + 1))
          retry_after "$create_failures" "creating $TPU_NAME" "$(error_of "$errors")"
        fi
        continue
        ;;
      *)
        # On its way (CREATING, STARTING, REPAIRING, WAITING_FOR_RESOURCES, PROVISIONING, ...)
        # or stopped by someone (STOPPED, STOPPING, HIDDEN, DELETING, ...): wait and see.
        sleep "$POLL_SECONDS"
        continue
        ;;
    esac
    if [ "$to_start" = 1 ]; then
      start_run || continue
      to_start=0
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
