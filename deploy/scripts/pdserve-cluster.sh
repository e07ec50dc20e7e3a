#!/usr/bin/env bash
# pdserve-cluster: an xPyD cluster across hosts, over ssh. Each listed prefill and decode
# host gets a worker, ROUTER_HOST gets the router; every role is started by pdserve-node.sh
# on its host, in the foreground of one ssh session, so this script holds the whole cluster:
# Ctrl-C or SIGTERM stops every role, and when any role exits the others are stopped too.
#
#   PREFILL_HOSTS="gpu1 gpu2" DECODE_HOSTS="gpu3 gpu4@0 gpu4@1" ROUTER_HOST=gpu1 \
#   MODEL_PATH=/models/llama TRANSFER_BACKEND=nccl deploy/scripts/pdserve-cluster.sh
#
# Needs: passwordless ssh to every host (BatchMode), pdserve installed there, and
# pdserve-node.sh at PDSERVE_NODE on each host (a shared file system or the same checkout).
# Variables [default]:
#   PREFILL_HOSTS, DECODE_HOSTS  space-separated HOST or HOST@GPU entries; one worker each
#                     (HOST@GPU pins it with CUDA_VISIBLE_DEVICES)                [required]
#   ROUTER_HOST       where the router runs                                      [required]
#   MODEL_PATH        the model directory, the same path on every worker host    [required]
#   TRANSFER_BACKEND  tcp | nccl | gloo                                               [tcp]
#   WORKER_PORT       the first worker's HTTP port on a host; the k-th worker on the same
#                     host (prefill and decode counted together) uses WORKER_PORT + k [30000]
#   BOOTSTRAP_PORT    the same for prefill bootstrap ports                            [8998]
#   ROUTER_PORT       [8000]
#   ROUTER_BIND       the address the router binds                                [0.0.0.0]
#   EXTRA_ARGS        more flags for every worker, split on spaces
#   ROUTER_ARGS       more flags for the router, split on spaces
#   REMOTE_ENV_FILE   a file on each host sourced before the role starts: put
#                     PDSERVE_API_KEY and PDSERVE_TRANSFER_TOKEN there, so that no secret
#                     crosses a command line                                         [unset]
#   PDSERVE_NODE      pdserve-node.sh's path on the hosts                 [this script's dir]
#   STOP_TIMEOUT      seconds the roles get to exit after SIGTERM before SIGKILL        [60]
#   SSH               the ssh command; it gets HOST then the remote command
#                     [ssh -tt -o BatchMode=yes]: -tt, so a closed session hangs up the role
#   PDSERVE_DRY_RUN   1: print each host and remote command, and exit
set -euo pipefail

die() {
  echo "pdserve-cluster: $*" >&2
  exit 2
}

# A single-quoted word for the remote POSIX shell.
quote() {
  local escaped=${1//\'/\'\\\'\'}
  printf "'%s'" "$escaped"
}

[[ "${STOP_TIMEOUT:-60}" =~ ^[0-9]+$ ]] ||
  die "STOP_TIMEOUT must be whole seconds, got '$STOP_TIMEOUT'"
for name in PREFILL_HOSTS DECODE_HOSTS ROUTER_HOST MODEL_PATH; do
  [[ -n "${!name:-}" ]] || die "$name is required (see the top of $0)"
done
# shellcheck disable=SC2153  # checked just above
read -r -a prefill_hosts <<<"$PREFILL_HOSTS"
# shellcheck disable=SC2153  # checked just above
read -r -a decode_hosts <<<"$DECODE_HOSTS"
read -r -a ssh_command <<<"${SSH:-ssh -tt -o BatchMode=yes}"
PDSERVE_NODE=${PDSERVE_NODE:-"$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/pdserve-node.sh"}
WORKER_PORT=${WORKER_PORT:-30000}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}

roles=()    # "HOST<TAB>remote command", started in this order
declare -A used=() # workers placed on each host so far
prefill_urls=()
decode_urls=()

# add_worker ROLE HOST[@GPU]
add_worker() {
  local role=$1 host=${2%@*} gpu="" env
  [[ "$2" == *@* ]] && gpu=${2#*@}
  [[ -n "$host" ]] || die "empty host in '$2'"
  local k=${used[$host]:-0}
  used[$host]=$((k + 1))
  local port=$((WORKER_PORT + k))
  env="ROLE=$role MODEL_PATH=$(quote "$MODEL_PATH") HOST=$(quote "$host") PORT=$port"
  env+=" TRANSFER_BACKEND=$(quote "${TRANSFER_BACKEND:-tcp}")"
  env+=" EXTRA_ARGS=$(quote "${EXTRA_ARGS:-}")"
  if [[ "$role" == prefill ]]; then
    env+=" BOOTSTRAP_PORT=$((BOOTSTRAP_PORT + k))"
    prefill_urls+=("http://$host:$port")
  else
    decode_urls+=("http://$host:$port")
  fi
  [[ -z "$gpu" ]] || env+=" CUDA_VISIBLE_DEVICES=$(quote "$gpu")"
  roles+=("$host"$'\t'"$env")
}

for entry in "${prefill_hosts[@]}"; do add_worker prefill "$entry"; done
for entry in "${decode_hosts[@]}"; do add_worker decode "$entry"; done
router_env="ROLE=router HOST=$(quote "${ROUTER_BIND:-0.0.0.0}") PORT=${ROUTER_PORT:-8000}"
router_env+=" PREFILL_URLS=$(quote "${prefill_urls[*]}") DECODE_URLS=$(quote "${decode_urls[*]}")"
router_env+=" EXTRA_ARGS=$(quote "${ROUTER_ARGS:-}")"
roles+=("$ROUTER_HOST"$'\t'"$router_env")

source_env=""
if [[ -n "${REMOTE_ENV_FILE:-}" ]]; then
  source_env=". $(quote "$REMOTE_ENV_FILE") && "
fi

pids=()
# shellcheck disable=SC2329  # called by the traps below
stop_all() {
  trap - TERM INT HUP
  echo "pdserve-cluster: stopping ${#pids[@]} roles" >&2
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  # NOTE: a role that outlives STOP_TIMEOUT (a hung ssh session) is killed.
  local deadline=$((SECONDS + ${STOP_TIMEOUT:-60}))
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
      sleep 0.2
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
}

for role in "${roles[@]}"; do
  host=${role%%$'\t'*}
  remote="${source_env}exec env ${role#*$'\t'} $(quote "$PDSERVE_NODE")"
  if [[ "${PDSERVE_DRY_RUN:-0}" == 1 ]]; then
    printf '%s\t%s\n' "$host" "$remote"
    continue
  fi
  echo "pdserve-cluster: $host: $remote" >&2
  "${ssh_command[@]}" "$host" "$remote" </dev/null &
  pids+=("$!")
done
[[ "${PDSERVE_DRY_RUN:-0}" == 1 ]] && exit 0

trap 'stop_all; exit 143' TERM
trap 'stop_all; exit 130' INT HUP
echo "pdserve-cluster: router at http://$ROUTER_HOST:${ROUTER_PORT:-8000}" >&2
# NOTE: the first role to exit (a crash, a lost host) takes the cluster down with it.
status=0
wait -n "${pids[@]}" || status=$?
echo "pdserve-cluster: a role exited (status $status); stopping the rest" >&2
stop_all
exit $((status == 0 ? 1 : status))
