#!/usr/bin/env bash
# Stands in for ssh in the multi-host test: `netns_ssh.sh HOST COMMAND` runs COMMAND with sh
# inside the network namespace that plays HOST. NETNS_HOSTS maps them: "ADDR=NAMESPACE ...".
# Like ssh, it hands the remote shell one command string.
set -euo pipefail

host=$1
shift
read -r -a pairs <<<"${NETNS_HOSTS:?set NETNS_HOSTS to ADDR=NAMESPACE pairs}"
for pair in "${pairs[@]}"; do
  if [[ "${pair%%=*}" == "$host" ]]; then
    exec ip netns exec "${pair#*=}" sh -c "$*"
  fi
done
echo "netns_ssh: no namespace plays host '$host' (NETNS_HOSTS=$NETNS_HOSTS)" >&2
exit 255
