#!/usr/bin/env bash
# Cloud TPU VM lifecycle for lambjax, through `gcloud compute tpus`.
#
#   launch/tpu/tpu_vm.sh create|install|train|logs|stop|delete
#
# Settings (environment variables; flags of the same name in lower case also work, e.g.
# --zone=us-central2-b):
#   PROJECT, ZONE, TPU_NAME, ACCELERATOR_TYPE (v4-32), RUNTIME_VERSION (tpu-ubuntu2204-base),
#   BUCKET (gs://... for the shared workdir), RUN (run name), CONFIG (configs/X.py[:size,variants]),
#   SPOT=1 (spot VMs), QUEUED=1 (a queued resource rather than a plain TPU VM),
#   DRY_RUN=1 (print the exact commands, run nothing).
# Training runs on every worker (--worker=all), each writing its shards of the checkpoints to
# $BUCKET/$RUN; `stop` sends SIGTERM, so every process saves and exits 0; rerunning `train`
# resumes.
set -euo pipefail

for arg in "${@:2}"; do
  case "$arg" in
    --*=*) key="${arg%%=*}"; key="${key#--}"; export "$(echo "$key" | tr 'a-z-' 'A-Z_')=${arg#*=}" ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

: "${PROJECT:?set PROJECT}" "${ZONE:?set ZONE}" "${TPU_NAME:?set TPU_NAME}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-32}"
RUNTIME_VERSION="${RUNTIME_VERSION:-tpu-ubuntu2204-base}"
CONFIG="${CONFIG:-configs/bert_lamb.py:large}"
RUN="${RUN:-$TPU_NAME}"

run() {
  if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

where=(--project="$PROJECT" --zone="$ZONE")
ssh_all() { run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${where[@]}" --worker=all --command="$1"; }

case "${1:-}" in
  create)
    spot=(); [ "${SPOT:-0}" = 1 ] && spot=(--spot)
    if [ "${QUEUED:-0}" = 1 ]; then
      run gcloud compute tpus queued-resources create "$TPU_NAME" "${where[@]}" \
        --node-id="$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE" \
        --runtime-version="$RUNTIME_VERSION" "${spot[@]}"
    else
      run gcloud compute tpus tpu-vm create "$TPU_NAME" "${where[@]}" \
        --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" "${spot[@]}"
    fi
    ;;
  install)
    # Ships this checkout (as committed) to every worker and installs it with TPU JAX.
    archive="$(mktemp -d)/lambjax.tar.gz"
    run git archive --format=tar.gz -o "$archive" HEAD
    run gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME:~/lambjax.tar.gz" "${where[@]}" --worker=all
    ssh_all "mkdir -p ~/lambjax && tar -xzf ~/lambjax.tar.gz -C ~/lambjax && cd ~/lambjax && python3 -m pip install -q -e '.[train]' 'jax[tpu]>=0.10,<0.11'"
    ;;
  train)
    : "${BUCKET:?set BUCKET (gs://...), the workdir every worker shares}"
    ssh_all "cd ~/lambjax && nohup python3 -m lambjax.main --config=$CONFIG --workdir=$BUCKET/$RUN > ~/lambjax-train.log 2>&1 &"
    ;;
  logs)
    run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${where[@]}" --worker=0 --command="tail -n 100 -f ~/lambjax-train.log"
    ;;
  stop)
    ssh_all "pkill -TERM -f lambjax.main || true"
    ;;
  delete)
    if [ "${QUEUED:-0}" = 1 ]; then
      run gcloud compute tpus queued-resources delete "$TPU_NAME" "${where[@]}" --force --quiet
    else
      run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${where[@]}" --quiet
    fi
    ;;
  *)
    echo "usage: $0 create|install|train|logs|stop|delete [--project=... --zone=... ...]" >&2
    exit 2
    ;;
esac
