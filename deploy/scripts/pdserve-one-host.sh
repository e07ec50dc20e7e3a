#!/usr/bin/env bash
# pdserve-one-host: every role on this machine (router, prefill and decode workers), through
# `pdserve launch`, configured by environment variables.
#
#   MODEL_PATH=/models/llama GPUS=0,1 TRANSFER_BACKEND=nccl deploy/scripts/pdserve-one-host.sh
#
# Variables [default]:
#   MODEL_PATH        the model directory            [the built-in tiny model, for a try-out]
#   NUM_PREFILL       prefill workers                                                   [1]
#   NUM_DECODE        decode workers                                                    [1]
#   GPUS              comma-separated GPU ids; worker k (prefill first) runs on GPUS[k % n]
#                     [unset: every worker on the default device]
#   HOST              the address everything binds                              [127.0.0.1]
#   PORT              the router's port                                              [8000]
#   TRANSFER_BACKEND  tcp | nccl | gloo                                               [tcp]
#   EXTRA_ARGS        more `pdserve launch` flags, split on spaces (engine, speculative)
#   LOG_LEVEL         [INFO]
#   PDSERVE_BIN       the pdserve command                                       [pdserve]
#   PDSERVE_DRY_RUN   1: print the command, one argument a line, and exit
#
# `pdserve launch` replaces this script (exec), so SIGTERM and Ctrl-C reach it directly; it
# stops the router and the workers, and its children exit by themselves if it dies.
set -euo pipefail

die() {
  echo "pdserve-one-host: $*" >&2
  exit 2
}

for name in NUM_PREFILL NUM_DECODE; do
  value=${!name:-1}
  [[ "$value" =~ ^[1-9][0-9]*$ ]] || die "$name must be a positive integer, got '$value'"
done
args=(--log-level "${LOG_LEVEL:-INFO}" launch
  --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}"
  --num-prefill "${NUM_PREFILL:-1}" --num-decode "${NUM_DECODE:-1}"
  --transfer-backend "${TRANSFER_BACKEND:-tcp}")
if [[ -n "${MODEL_PATH:-}" ]]; then
  [[ "${PDSERVE_DRY_RUN:-0}" == 1 || -d "$MODEL_PATH" ]] ||
    die "MODEL_PATH '$MODEL_PATH' is not a directory"
  args+=(--model-path "$MODEL_PATH")
fi
if [[ -n "${GPUS:-}" ]]; then
  [[ "$GPUS" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "GPUS must look like 0,1,2, got '$GPUS'"
  args+=(--gpus "$GPUS")
fi
read -r -a extra <<<"${EXTRA_ARGS:-}"
args+=("${extra[@]}" "$@")

if [[ "${PDSERVE_DRY_RUN:-0}" == 1 ]]; then
  printf '%s\n' "${PDSERVE_BIN:-pdserve}" "${args[@]}"
  exit 0
fi
exec "${PDSERVE_BIN:-pdserve}" "${args[@]}"
