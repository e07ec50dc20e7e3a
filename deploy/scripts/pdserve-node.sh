#!/usr/bin/env bash
# pdserve-node: start one pdserve role on this node, configured by environment variables.
# The container image has it as `pdserve-node`; Kubernetes manifests, the ssh cluster script
# and people on bare metal all start roles through it.
#
#   ROLE=prefill MODEL_PATH=/models/llama deploy/scripts/pdserve-node.sh [more pdserve flags]
#
# Variables [default]:
#   ROLE              prefill | decode | router | serve (colocated worker)        [required]
#   MODEL_PATH        the model directory (workers)                              [required]
#   HOST              address to bind and to tell peers: the bootstrap and transfer
#                     endpoints listen there [POD_IP, else the address this node reaches
#                     MASTER_ADDR from, else the first address of `hostname -I`]
#   POD_IP            the pod's address (Kubernetes downward API: status.podIP)
#   PORT              HTTP port                               [router 8000, workers 30000]
#   BOOTSTRAP_PORT    prefill: where decode workers fetch KV                       [8998]
#   BOOTSTRAP_ALLOW   decode: comma-separated addresses/CIDRs of the prefill workers it may
#                     contact [pdserve's: loopback and this host's attached networks]
#   TRANSFER_BACKEND  tcp (ZMQ, anywhere) | nccl (GPU to GPU) | gloo (CPU)          [tcp]
#   DEVICE            auto | cpu | cuda | cuda:N                                   [auto]
#   SHUTDOWN_TIMEOUT  seconds in-flight requests may take to finish after SIGTERM; keep it
#                     under the pod's terminationGracePeriodSeconds        [pdserve's: 5]
#   PREFILL_SERVICE, DECODE_SERVICE   router: NAME:PORT, every address NAME resolves to is
#                     a worker (a Kubernetes headless Service); several: space-separated
#   PREFILL_URLS, DECODE_URLS         router: space-separated worker URLs (bootstrap ports
#                     are asked from the prefill workers)
#   TP_SIZE           tensor-parallel ranks of one worker, over all its nodes (GPUs cuda:N..
#                     from DEVICE on each node; TP_SIZE / NNODES per node)                [1]
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   the node group this node is part of
#                     [1, 0, unset, 29500]; NNODES > 1: one tensor-parallel worker spans
#                     the nodes, node 0 (at MASTER_ADDR:MASTER_PORT) serves HTTP (and moves a
#                     prefill or decode worker's KV), the others run ranks only
#   LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX   set by a LeaderWorkerSet; they
#                     stand in for MASTER_ADDR, NNODES and NODE_RANK when those are unset
#   EXTRA_ARGS        more pdserve flags, split on spaces (e.g. speculative decoding)
#   LOG_LEVEL         [INFO]
#   PDSERVE_API_KEY, PDSERVE_TRANSFER_TOKEN   secrets: pdserve reads them from the
#                     environment itself, so they never appear on a command line
#   PDSERVE_BIN       the pdserve command                                       [pdserve]
#   PDSERVE_DRY_RUN   1: print the command, one argument a line, and exit
#
# SIGTERM, SIGINT and SIGHUP (an ssh session that closes) are forwarded to pdserve as
# SIGTERM; the script exits with pdserve's status. A missing or bad variable exits 2.
set -euo pipefail

die() {
  echo "pdserve-node: $*" >&2
  exit 2
}

require() {
  [[ -n "${!1:-}" ]] || die "$1 is required for ROLE=${ROLE:-?}: $2"
}

check_port() {
  if ! [[ "${!1}" =~ ^[0-9]{1,5}$ ]] || ((10#${!1} < 1 || 10#${!1} > 65535)); then
    die "$1 must be a port number in [1, 65535], got '${!1}'"
  fi
}

# The address peers reach this node at: the pod's, else the source address of the route to
# the group's leader, else the first non-loopback address.
node_address() {
  if [[ -n "${POD_IP:-}" ]]; then
    echo "$POD_IP"
    return
  fi
  if [[ -n "${MASTER_ADDR:-}" ]] && command -v ip >/dev/null; then
    local route
    route=$(ip route get "$MASTER_ADDR" 2>/dev/null || true)
    if [[ "$route" =~ src\ ([^ ]+) ]]; then
      echo "${BASH_REMATCH[1]}"
      return
    fi
  fi
  local addresses
  addresses=$(hostname -I 2>/dev/null || true)
  if [[ -n "${addresses// /}" ]]; then
    echo "${addresses%% *}"
    return
  fi
  die "cannot tell this node's address (no POD_IP, no route to MASTER_ADDR, nothing from" \
    "'hostname -I'): set HOST to the address other nodes reach this one at"
}

# LeaderWorkerSet names the group its own way; the usual names win when both are set.
NNODES=${NNODES:-${LWS_GROUP_SIZE:-1}}
NODE_RANK=${NODE_RANK:-${LWS_WORKER_INDEX:-0}}
MASTER_ADDR=${MASTER_ADDR:-${LWS_LEADER_ADDRESS:-}}
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$NNODES'"
if ! [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || ((NODE_RANK >= NNODES)); then
  die "NODE_RANK must be in [0, NNODES=$NNODES), got '$NODE_RANK'"
fi
if [[ -n "${MASTER_PORT:-}" ]]; then
  check_port MASTER_PORT
fi
TP_SIZE=${TP_SIZE:-1}
[[ "$TP_SIZE" =~ ^[1-9][0-9]*$ ]] || die "TP_SIZE must be a positive integer, got '$TP_SIZE'"
if ((NNODES > 1)); then
  [[ "${ROLE:-}" != router ]] ||
    die "NNODES=$NNODES: only workers (serve, prefill, decode) span nodes; the router runs on one"
  ((TP_SIZE % NNODES == 0)) || die "TP_SIZE=$TP_SIZE does not split evenly over NNODES=$NNODES"
  [[ -n "$MASTER_ADDR" ]] || die "NNODES=$NNODES needs MASTER_ADDR: node 0's address"
fi

ROLE=${ROLE:-}
case "$ROLE" in
  prefill | decode | serve) default_port=30000 ;;
  router) default_port=8000 ;;
  "") die "ROLE is required: prefill, decode, router or serve" ;;
  *) die "unknown ROLE '$ROLE': choose prefill, decode, router or serve" ;;
esac
PORT=${PORT:-$default_port}
check_port PORT
HOST=${HOST:-$(node_address)}
if [[ ! "$HOST" =~ ^[0-9.]+$ && "$HOST" != *:* ]]; then
  # NOTE: a name: bind the address it resolves to (ZMQ binds addresses, not names).
  read -r resolved _ < <(getent hosts "$HOST" || true) || true
  [[ -n "${resolved:-}" ]] || die "HOST '$HOST' does not resolve to an address on this node"
  HOST=$resolved
fi
PDSERVE_BIN=${PDSERVE_BIN:-pdserve}
args=(--log-level "${LOG_LEVEL:-INFO}" "$ROLE" --host "$HOST" --port "$PORT")
if [[ -n "${SHUTDOWN_TIMEOUT:-}" ]]; then
  [[ "$SHUTDOWN_TIMEOUT" =~ ^[0-9]+([.][0-9]+)?$ ]] ||
    die "SHUTDOWN_TIMEOUT must be a number of seconds, got '$SHUTDOWN_TIMEOUT'"
  args+=(--shutdown-timeout "$SHUTDOWN_TIMEOUT")
fi

if [[ "$ROLE" == router ]]; then
  read -r -a prefill_urls <<<"${PREFILL_URLS:-}"
  read -r -a decode_urls <<<"${DECODE_URLS:-}"
  read -r -a prefill_services <<<"${PREFILL_SERVICE:-}"
  read -r -a decode_services <<<"${DECODE_SERVICE:-}"
  ((${#prefill_urls[@]} + ${#prefill_services[@]} > 0)) ||
    die "the router needs prefill workers: set PREFILL_SERVICE (NAME:PORT) or PREFILL_URLS"
  ((${#decode_urls[@]} + ${#decode_services[@]} > 0)) ||
    die "the router needs decode workers: set DECODE_SERVICE (NAME:PORT) or DECODE_URLS"
  for url in "${prefill_urls[@]}"; do args+=(--prefill "$url"); done
  for url in "${decode_urls[@]}"; do args+=(--decode "$url"); done
  for name in "${prefill_services[@]}"; do args+=(--prefill-service "$name"); done
  for name in "${decode_services[@]}"; do args+=(--decode-service "$name"); done
else
  require MODEL_PATH "the model directory (config.json, safetensors, tokenizer)"
  [[ "${PDSERVE_DRY_RUN:-0}" == 1 || -d "$MODEL_PATH" ]] ||
    die "MODEL_PATH '$MODEL_PATH' is not a directory on this node"
  args+=(--model-path "$MODEL_PATH" --device "${DEVICE:-auto}")
  if ((TP_SIZE > 1)); then
    args+=(--tp-size "$TP_SIZE")
  fi
  if ((NNODES > 1)); then
    args+=(--nnodes "$NNODES" --node-rank "$NODE_RANK")
    args+=(--dist-init-addr "$MASTER_ADDR:${MASTER_PORT:-29500}")
  fi
  if [[ "$ROLE" != serve ]]; then
    advertised=$HOST
    case "$HOST" in
      0.0.0.0 | :: | "[::]") advertised=$(node_address) ;;
    esac
    args+=(--transfer-backend "${TRANSFER_BACKEND:-tcp}" --bootstrap-host "$advertised")
  fi
  if [[ "$ROLE" == decode && -n "${BOOTSTRAP_ALLOW:-}" ]]; then
    args+=(--bootstrap-allow "$BOOTSTRAP_ALLOW")
  fi
  if [[ "$ROLE" == prefill ]]; then
    BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
    check_port BOOTSTRAP_PORT
    args+=(--bootstrap-port "$BOOTSTRAP_PORT")
  fi
fi
read -r -a extra <<<"${EXTRA_ARGS:-}"
args+=("${extra[@]}" "$@")

if [[ "${PDSERVE_DRY_RUN:-0}" == 1 ]]; then
  printf '%s\n' "$PDSERVE_BIN" "${args[@]}"
  exit 0
fi

child=
# shellcheck disable=SC2329  # called by the trap below
forward() {
  if [[ -n "$child" ]]; then
    kill -TERM "$child" 2>/dev/null || true
  fi
}
trap forward TERM INT HUP
echo "pdserve-node: starting $PDSERVE_BIN ${args[*]}" >&2
"$PDSERVE_BIN" "${args[@]}" &
child=$!
# NOTE: `wait` returns early when a trapped signal arrives; keep waiting for pdserve itself.
while kill -0 "$child" 2>/dev/null; do
  wait "$child" || true
done
status=0
wait "$child" || status=$?
exit "$status"
