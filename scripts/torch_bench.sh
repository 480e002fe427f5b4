#!/usr/bin/env bash
# LibTorch bars, measured in one invocation (benchmarks/torch_bench: the CNN
# of examples/torch_fashion_mnist, batch 64 per process, one core each):
#   this library's DDP (overlap on, overlap off) and LibTorch's c10d
#   ProcessGroupGloo loop (pytorch/examples' dist-mnist), at 1 and 2
#   processes, alternating `rounds` times (all six configurations per round,
#   so a change of load hits every one alike); prints each run, the median
#   samples/s of each configuration, and the ratios:
#     ours / c10d at 2 processes            (bar: DDP >= 1.3x c10d Gloo)
#     2 processes / 1 process, each mode    (bar: >= 1.8x)
#   and the load average before and after (the machine is shared).
# Usage: scripts/torch_bench.sh [build-dir] [rounds] [steps]
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
steps=${3:-200}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi="timeout 600 mpirun --oversubscribe --bind-to none"
bench=$build/benchmarks/torch_bench
[ -x "$bench" ] || { echo "no $bench (configure with LibTorch: DISTSTRAT_WITH_TORCH)" >&2; exit 1; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "# load before: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
for r in $(seq "$rounds"); do
  for np in 1 2; do
    for mode in "--mode ddp --overlap" "--mode ddp --no-overlap" "--mode c10d"; do
      # shellcheck disable=SC2086
      $mpi -np "$np" "$bench" $mode --steps "$steps" | grep '^torch_bench:' | tee -a "$out"
    done
  done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
median() {  # median samples/s of mode $1 at $2 processes
  grep "mode=$1 processes=$2 " "$out" | sed 's/.*samples_per_sec=//' | sort -n |
    awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'
}
for mode in ddp_overlap ddp_no_overlap c10d_gloo; do
  echo "torch_bench: median $mode 1 process=$(median $mode 1) 2 processes=$(median $mode 2) samples/s"
done
c=$(median c10d_gloo 2)
for mode in ddp_overlap ddp_no_overlap; do
  awk -v a="$(median $mode 2)" -v c="$c" -v m=$mode \
    'BEGIN {printf "torch_bench: %s / c10d_gloo at 2 processes = %.2f (bar >= 1.3)\n", m, a / c}'
done
for mode in ddp_overlap ddp_no_overlap c10d_gloo; do
  awk -v a="$(median $mode 1)" -v b="$(median $mode 2)" -v m=$mode \
    'BEGIN {printf "torch_bench: %s 2 processes / 1 process = %.2f (bar >= 1.8)\n", m, b / a}'
done
