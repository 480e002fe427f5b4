#!/usr/bin/env bash
# Fuzzes one target for real with clang's libFuzzer + ASan/UBSan:
#   scripts/fuzz.sh idx 600        # target tests/fuzz/fuzz_idx.cc for 600 s
# New interesting inputs are added to tests/fuzz/corpus/NAME/ (commit the small
# ones); a crash leaves crash-* in build-fuzz/ — add it to the corpus so the
# replay test in ctest keeps it fixed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
name=${1:?usage: scripts/fuzz.sh NAME SECONDS}
seconds=${2:-60}
"$root/scripts/setup.sh"
build=${DISTSTRAT_FUZZ_BUILD_DIR:-$root/build-fuzz}
CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DDISTSTRAT_FUZZ=ON -DDISTSTRAT_SANITIZE=address,undefined \
  -DDISTSTRAT_WITH_CUDA=OFF -DDISTSTRAT_BUILD_EXAMPLES=OFF -DDISTSTRAT_BUILD_BENCHMARKS=OFF
cmake --build "$build" --target "fuzz_$name"
corpus="$root/tests/fuzz/corpus/$name"
mkdir -p "$corpus" "$build/artifacts"
cd "$build"
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} \
  "./tests/fuzz/fuzz_$name" -max_total_time="$seconds" -print_final_stats=1 -max_len=65536 \
  -artifact_prefix="$build/artifacts/" "$corpus"
