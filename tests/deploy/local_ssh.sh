#!/usr/bin/env bash
# Stands in for ssh when every "host" is this machine (the two-GPU test of the cluster
# script): `local_ssh.sh HOST COMMAND` runs COMMAND with sh here, as ssh would there.
set -euo pipefail

shift
exec sh -c "$*"
