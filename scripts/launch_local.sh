#!/usr/bin/env bash
# Starts N processes of one multi-process JAX run on this machine (127.0.0.1), for testing:
#   bash scripts/launch_local.sh 2 .venv/bin/python examples/train_lm.py --steps 50
# Each process gets the environment jzero.distributed.initialize() reads
# (JZERO_COORDINATOR, JZERO_NUM_PROCESSES, JZERO_PROCESS_ID) and, for CPU runs,
# JZERO_LOCAL_CPU_DEVICES (default 8 / N) forced CPU devices. Exits with the first
# non-zero status of any process (0 when all succeed); Ctrl-C stops them all.
set -euo pipefail
if [[ $# -lt 2 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N COMMAND [ARGS...]   (N >= 1 processes on 127.0.0.1)" >&2
  exit 2
fi
n=$1
shift
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export JZERO_COORDINATOR="127.0.0.1:${port}" JZERO_NUM_PROCESSES="$n"
export JZERO_LOCAL_CPU_DEVICES="${JZERO_LOCAL_CPU_DEVICES:-$(( (8 + n - 1) / n ))}"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' INT TERM
for ((i = 0; i < n; i++)); do
  JZERO_PROCESS_ID=$i "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || { code=$?; [[ $status -eq 0 ]] && status=$code; }
done
exit "$status"
