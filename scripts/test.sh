#!/usr/bin/env bash
# From a fresh machine: install dependencies, configure, build and run every
# test with ctest.
#   scripts/test.sh                          the normal build (build/)
#   scripts/test.sh --sanitize address,undefined   a sanitizer build (build-<sanitizers>/)
#   scripts/test.sh --sanitize thread -- -LE "mpi|examples|deploy|package"
#                                            the in-process suite under TSan (build-thread/)
# Extra arguments after -- go to ctest, e.g. scripts/test.sh -- -R Mirrored
# DISTSTRAT_CMAKE_ARGS (words) are added to the configure step, e.g.
#   DISTSTRAT_CMAKE_ARGS="-DDISTSTRAT_BUILD_EXAMPLES=OFF" scripts/test.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sanitize=""
ctest_args=()
while (($#)); do
  case "$1" in
    --sanitize) sanitize="$2"; shift 2 ;;
    --sanitize=*) sanitize="${1#*=}"; shift ;;
    --) shift; ctest_args+=("$@"); break ;;
    *) echo "test.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
"$root/scripts/setup.sh"
if [[ -n "$sanitize" ]]; then
  # Any finding fails the test that triggered it.
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}
  build=${DISTSTRAT_BUILD_DIR:-$root/build-${sanitize//,/-}}
  # -O1 -g1: line tables are all a sanitizer report needs (file:line in every
  # frame), and the build takes about half as long as -O2 -g.
  # Test programs at -Og: sanitizer instrumentation makes the compile slow
  # (UBSan most), and the tests' own code needs no optimization.
  # The library in unity batches too (a third less compile time under the
  # sanitizers); the normal build compiles each source alone.
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
        -DDISTSTRAT_TEST_COMPILE_OPTIONS=-Og -DDISTSTRAT_UNITY_LIBRARY=ON \
        -DDISTSTRAT_SANITIZE="$sanitize" ${DISTSTRAT_CMAKE_ARGS:-}
else
  build=${DISTSTRAT_BUILD_DIR:-$root/build}
  # The library, examples and benchmarks at Release's -O3; test programs at -O1.
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDISTSTRAT_TEST_COMPILE_OPTIONS=-O1 \
        ${DISTSTRAT_CMAKE_ARGS:-}
fi
cmake --build "$build"
cd "$build"
# Twice as many test slots as there are cores (unless -j is given): most of
# the suite waits rather than computes (mpirun start-up, deadlines, network
# namespaces, Slurm daemons): on the 2-core machine, -j2 ran the 907 tests in
# 1748 s of wall time for about 11 minutes of CPU time. Tests that need
# several slots (mpirun jobs) say so (PROCESSORS); the namespace-cluster and
# Slurm cells share one lock and run one at a time.
jobs=(-j"$((2 * $(nproc)))")
for a in "${ctest_args[@]}"; do [[ $a == -j* ]] && jobs=(); done
ctest --output-on-failure --timeout 900 "${jobs[@]}" "${ctest_args[@]}"
