#!/usr/bin/env bash
# TF_CONFIG over TCP against MPI (issue 46): steady-state training throughput
# of the Fashion-MNIST MLP (train_bench: warm-up steps, then timed ones) with
# 2 workers on this host, alternating `rounds` times between
#   mpirun -np 2 train_bench --strategy multi_worker      (MPI; on one host
#                                                        Open MPI's shared memory)
#   2 processes started here with TF_CONFIG, no mpirun   (the chief's store,
#                                                        Gloo TCP over loopback)
# Prints each run and the ratio of the medians (the issue's bar, on the
# namespace cluster at 2 x 1: TCP >= 0.9x MPI).
# Usage: scripts/tf_config_bench.sh [build-dir] [rounds] [train_bench args...]
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
shift $(($# < 2 ? $# : 2))
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
train=$build/benchmarks/train_bench
args=(--strategy multi_worker "$@")
pids=()
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done' EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
tcp_run() {
  local c out
  c="\"cluster\": {\"worker\": [\"127.0.0.1:$(port)\", \"127.0.0.1:$(port)\"]}"
  out=$(mktemp)
  TF_CONFIG="{$c, \"task\": {\"type\": \"worker\", \"index\": 0}}" "$train" "${args[@]}" >"$out" 2>&1 &
  pids=($!)
  TF_CONFIG="{$c, \"task\": {\"type\": \"worker\", \"index\": 1}}" "$train" "${args[@]}" >/dev/null 2>&1
  wait "${pids[0]}"
  pids=()
  grep '^train_bench:' "$out"
  rm -f "$out"
}
mpi=() tcp=()
for r in $(seq "$rounds"); do
  line=$(mpirun --oversubscribe --bind-to none -np 2 "$train" "${args[@]}" | grep '^train_bench:')
  echo "mpi: $line"; mpi+=("$(sed 's/.*samples_per_sec=\([0-9.]*\).*/\1/' <<<"$line")")
  line=$(tcp_run)
  echo "tcp: $line"; tcp+=("$(sed 's/.*samples_per_sec=\([0-9.]*\).*/\1/' <<<"$line")")
done
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
t=$(median "${tcp[@]}"); m=$(median "${mpi[@]}")
awk -v t="$t" -v m="$m" -v l="$(cut -d' ' -f1-3 /proc/loadavg)" 'BEGIN {printf "tf_config_bench: median tcp=%d mpi=%d ratio=%.3f (bar >= 0.9 on the namespace cluster; load average %s)\n", t, m, t / m, l}'
