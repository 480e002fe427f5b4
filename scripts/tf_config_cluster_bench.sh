#!/usr/bin/env bash
# TF_CONFIG over TCP against MPI on the namespace cluster at 2 x 1 (issue
# 46's bar: TCP >= 0.9x MPI): train_bench --strategy multi_worker on hosts 0
# and 1 of scripts/cluster.sh, alternating `rounds` times between
#   scripts/cluster.sh run --ppn 1 --np 2 train_bench   (MPI over TCP between the hosts)
#   one train_bench per host started with TF_CONFIG    (the library's TCP transport)
# for each build given, and prints each run and the ratio of the medians.
# Bring the cluster up first: scripts/cluster.sh --hosts 2 up (DSC_PREFIX and
# DSC_NET as there).
# Usage: scripts/tf_config_cluster_bench.sh [rounds] [build-dir...]
set -uo pipefail
rounds=${1:-3}
shift $(($# < 1 ? $# : 1))
builds=("$@")
((${#builds[@]})) || builds=(build)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prefix=${DSC_PREFIX:-dsc} net=${DSC_NET:-0}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
rate() { sed -n 's/^train_bench:.*samples_per_sec=\([0-9.]*\).*/\1/p' | head -1; }
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
for b in "${builds[@]}"; do
  tb=$(realpath "$b/benchmarks/train_bench")
  mpi=() tcp=()
  for r in $(seq "$rounds"); do
    m=$(timeout 120 "$here/cluster.sh" run --ppn 1 --np 2 -- "$tb" --strategy multi_worker 2>&1 | rate)
    p0=$((20000 + RANDOM % 20000))
    c="\"cluster\": {\"worker\": [\"198.18.$net.1:$p0\", \"198.18.$net.2:$((p0 + 1))\"]}"
    out=$(mktemp)
    timeout 120 "$here/cluster.sh" exec "$prefix-h0" env \
      TF_CONFIG="{$c, \"task\": {\"type\": \"worker\", \"index\": 0}}" "$tb" --strategy multi_worker >"$out" 2>&1 &
    pid=$!
    timeout 120 "$here/cluster.sh" exec "$prefix-h1" env \
      TF_CONFIG="{$c, \"task\": {\"type\": \"worker\", \"index\": 1}}" "$tb" --strategy multi_worker >/dev/null 2>&1
    wait "$pid"
    t=$(rate <"$out")
    rm -f "$out"
    echo "$b round $r: mpi=${m:-failed} tcp=${t:-failed}"
    [[ -n $m ]] && mpi+=("$m")
    [[ -n $t ]] && tcp+=("$t")
  done
  ((${#mpi[@]} && ${#tcp[@]})) || { echo "$b: no result"; continue; }
  awk -v t="$(median "${tcp[@]}")" -v m="$(median "${mpi[@]}")" -v b="$b" -v l="$(cut -d' ' -f1-3 /proc/loadavg)" \
    'BEGIN {printf "tf_config_cluster_bench %s: 2 x 1 median tcp=%d mpi=%d ratio=%.3f (bar >= 0.9; load average %s)\n", b, t, m, t / m, l}'
done
