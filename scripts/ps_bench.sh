#!/usr/bin/env bash
# Parameter-server bars, measured in one invocation:
#  1. Fashion-MNIST MLP throughput: PS (1 PS + 2 workers) vs multi_worker (2
#     workers), alternating `rounds` times; prints each run and the ratio of
#     the medians (bar: PS >= 0.8x multi_worker).
#  2. Row-sparse push of 1% of a 1M x 64 f32 table vs a dense push of it
#     (bar: <= 5%).
# Usage: scripts/ps_bench.sh [build-dir] [rounds]
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi="mpirun --oversubscribe --bind-to none"
train=$build/benchmarks/train_bench
ps=() mw=()
for r in $(seq "$rounds"); do
  line=$($mpi -np 3 "$train" --strategy parameter_server --ps 1 | grep '^train_bench:')
  echo "$line"; ps+=("$(sed 's/.*samples_per_sec=//' <<<"$line")")
  line=$($mpi -np 2 "$train" --strategy multi_worker | grep '^train_bench:')
  echo "$line"; mw+=("$(sed 's/.*samples_per_sec=//' <<<"$line")")
done
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
p=$(median "${ps[@]}"); m=$(median "${mw[@]}")
awk -v p="$p" -v m="$m" 'BEGIN {printf "train: median parameter_server=%d multi_worker=%d ratio=%.3f (bar >= 0.8)\n", p, m, p / m}'
"$build/benchmarks/ps_bench"
