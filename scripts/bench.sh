#!/usr/bin/env bash
# The collectives and multi-worker bars of docs/benchmarks.md, in one go, on
# a quiet machine (timings on a shared machine say little):
#   1. allreduce_bench under mpirun -np 2: ours vs MPI_Allreduce vs Gloo, 4K..256M
#   2. allreduce_bench --inproc 2: the in-process 64 MiB bar and its ceiling
#   3. fusion_bench under mpirun -np 2: fused vs one all-reduce vs 1000 MPI_Allreduce
#   4. train_bench, 1 vs 2 workers (multi_worker), alternating `rounds` times,
#      with the CPU kernels' instruction set in use (include/diststrat/cpu_isa.h)
#   5. given a second build directory built with -DDISTSTRAT_NATIVE=ON (or
#      -DCMAKE_CXX_FLAGS=-march=native): train_bench 1 worker, this build vs
#      that one, alternating `rounds` times, and the ratio of the medians
# Raw outputs go to OUT (default bench-out/), the all-reduce plot next to them.
# Usage: scripts/bench.sh [build-dir] [out-dir] [rounds] [native-build-dir]
set -euo pipefail
build=${1:-build}
out=${2:-bench-out}
rounds=${3:-3}
native=${4:-}
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi="mpirun --oversubscribe --bind-to none"
b=$build/benchmarks

echo "== load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== cpu kernels: $("$b/train_bench" --strategy mirrored --replicas 1 --steps 1 --warmup 0 |
                       sed -n 's/.*cpu_kernels=//p') (DISTSTRAT_CPU=${DISTSTRAT_CPU:-unset})"
$mpi -np 2 "$b/allreduce_bench" --algos memcpy,shm,shm_registered,auto,auto_registered,ring,mpi,gloo \
  --min-bytes 4096 --max-bytes 268435456 --step-factor 4 --iters 10 --warmup 2 --check \
  --csv-out "$out/allreduce_mpi_np2.csv" | tee "$out/allreduce_mpi_np2.txt" | grep '^#'
"$b/allreduce_bench" --inproc 2 --algos direct,ring --min-bytes 4096 --max-bytes 67108864 \
  --step-factor 4 --iters 10 --warmup 2 --check | tee "$out/allreduce_inproc2.txt" | grep '^#'
$mpi -np 2 "$b/fusion_bench" --iters 60 | tee "$out/fusion_np2.txt"
for r in $(seq "$rounds"); do
  $mpi -np 1 "$b/train_bench" --strategy multi_worker | grep '^train_bench:'
  $mpi -np 2 "$b/train_bench" --strategy multi_worker | grep '^train_bench:'
done | tee "$out/train_np1_np2.txt"
median() { grep "workers=$1 " "$out/train_np1_np2.txt" | sed 's/.*samples_per_sec=//' | sort -n |
           awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
awk -v a="$(median 1)" -v b="$(median 2)" 'BEGIN {printf "train: median samples/s 1 worker=%d 2 workers=%d ratio=%.2f (bar >= 1.85)\n", a, b, b / a}' |
  tee -a "$out/train_np1_np2.txt"
if [[ -n "$native" ]]; then
  for r in $(seq "$rounds"); do
    echo "default $($mpi -np 1 "$b/train_bench" --strategy multi_worker | grep '^train_bench:')"
    echo "native $($mpi -np 1 "$native/benchmarks/train_bench" --strategy multi_worker | grep '^train_bench:')"
  done | tee "$out/train_default_vs_native.txt"
  med() { grep "^$1 " "$out/train_default_vs_native.txt" | sed 's/.*samples_per_sec=//' | sort -n |
          awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
  awk -v a="$(med default)" -v b="$(med native)" 'BEGIN {printf "train 1 worker: median samples/s default=%d native=%d ratio=%.2f (bar >= 0.95)\n", a, b, a / b}' |
    tee -a "$out/train_default_vs_native.txt"
fi
echo "== load after: $(cut -d' ' -f1-3 /proc/loadavg)"
if command -v /usr/bin/python3 >/dev/null && /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
  /usr/bin/python3 scripts/plot_bench.py "$out/allreduce_mpi_np2.csv" -o "$out/allreduce_busbw.png"
fi
