#!/usr/bin/env bash
# The GPU check, for a machine with a GPU, nvcc, CMake and ninja, with NCCL and
# cuBLAS inside PyTorch's Python packages (nvidia.nccl, nvidia.cublas) and no
# apt or network. Configures and builds the CUDA backend, runs the GPU tests,
# then the GPU benchmark, and prints a short table last. Under 8 minutes.
#
#   scripts/gpu-deps.sh            # once, on a machine with the Debian packages: fills .deps/
#   scripts/gpu-check.sh           # on the GPU machine, with .deps/ carried along
#
# Environment: DEPS (default .deps), BUILD (default build-gpu), CUDA_ARCHS
# (default 90: H100/H200), JOBS (default: all cores).
# Exit status: 0 when every step ran and every GPU test passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
t_start=$(date +%s)
deps=$(realpath -m "${DEPS:-.deps}")
build=$(realpath -m "${BUILD:-build-gpu}")
archs=${CUDA_ARCHS:-90}
jobs=${JOBS:-$(nproc)}
log=$build/gpu-check-logs
mkdir -p "$log"

say() { echo "gpu-check: $*"; }
elapsed() { echo $(( $(date +%s) - t_start )); }
die() { say "FAILED: $*"; exit 1; }

# ---- self-checks: every tool and input is where it must be -----------------------
nvcc=$(command -v nvcc || true)
[[ -z $nvcc && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
[[ -n $nvcc ]] || die "nvcc not found (PATH or /usr/local/cuda/bin)"
command -v cmake >/dev/null || die "cmake not found"
command -v ninja >/dev/null || die "ninja not found"
command -v python3 >/dev/null || die "python3 not found (needed to locate NCCL/cuBLAS wheels)"
for d in eigen3/Eigen googletest/googletest nlohmann CLI zlib/zlib.h; do
  [[ -e $deps/$d ]] || die "$deps/$d missing: run scripts/gpu-deps.sh on a Debian machine and carry .deps"
done
wheel_dir() {  # directory of a Python package (nvidia.nccl, nvidia.cublas), or nothing
  python3 -c "import importlib, os, sys
m = importlib.import_module(sys.argv[1])
print(os.path.dirname(m.__file__) if getattr(m, '__file__', None) else list(m.__path__)[0])" "$1" 2>/dev/null
}
nccl_root=${NCCL_ROOT:-$(wheel_dir nvidia.nccl)}
cublas_root=${CUBLAS_ROOT:-$(wheel_dir nvidia.cublas)}
[[ -n $nccl_root && -e $nccl_root/include/nccl.h ]] || die "NCCL not found (python3 -c 'import nvidia.nccl'; or set NCCL_ROOT)"
say "nvcc $("$nvcc" --version | grep -o 'release [0-9.]*')  NCCL $nccl_root  cuBLAS ${cublas_root:-<CUDA toolkit>}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu-check: GPU: /'

# zlib: the machine's own library when there is one, else the carried copy.
zlib_lib=$(ldconfig -p 2>/dev/null | awk '/libz\.so\.1 .*x86-64/ {print $NF; exit}')
[[ -n $zlib_lib ]] || zlib_lib=$deps/zlib/libz.so.1

# ---- GoogleTest from source, and CMake configs for the header-only deps -----------
prefix=$build/_deps/prefix
if [[ ! -e $prefix/lib/cmake/GTest/GTestConfig.cmake && ! -e $prefix/lib64/cmake/GTest/GTestConfig.cmake ]]; then
  say "building GoogleTest ($(elapsed)s)"
  cmake -S "$deps/googletest" -B "$build/_deps/gtest" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX="$prefix" -DBUILD_GMOCK=ON -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
      >"$log/gtest.log" 2>&1 &&
    cmake --build "$build/_deps/gtest" -j "$jobs" --target install >>"$log/gtest.log" 2>&1 ||
    { tail -20 "$log/gtest.log"; die "GoogleTest build"; }
fi
cfg=$build/_deps/cmake
# A CMake package config for a header-only dependency: one INTERFACE target.
header_only_package() {  # package target include_dir version
  mkdir -p "$cfg/$1"
  cat >"$cfg/$1/$1Config.cmake" <<CFG
if(NOT TARGET $2)
  add_library($2 INTERFACE IMPORTED)
  set_target_properties($2 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "$3")
endif()
set($1_FOUND TRUE)
CFG
  printf 'set(PACKAGE_VERSION %s)\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n' "$4" \
    >"$cfg/$1/$1ConfigVersion.cmake"
}
header_only_package Eigen3 Eigen3::Eigen "$deps/eigen3" 3.4.0
header_only_package nlohmann_json nlohmann_json::nlohmann_json "$deps" 3.11.2
header_only_package CLI11 CLI11::CLI11 "$deps" 2.3.2

# ---- configure and build ---------------------------------------------------------
say "configuring ($(elapsed)s)"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="$archs" \
    -DDISTSTRAT_WITH_CUDA=ON -DDISTSTRAT_WITH_CUBLAS=ON -DDISTSTRAT_WITH_NCCL=ON \
    -DDISTSTRAT_WITH_MPI=OFF -DDISTSTRAT_WITH_GLOO=OFF \
    -DDISTSTRAT_BUILD_EXAMPLES=OFF -DDISTSTRAT_BUILD_BENCHMARKS=OFF -DDISTSTRAT_BUILD_TESTS=ON \
    -DNCCL_ROOT="$nccl_root" ${cublas_root:+-DCUBLAS_ROOT="$cublas_root"} \
    -DEigen3_DIR="$cfg/Eigen3" -Dnlohmann_json_DIR="$cfg/nlohmann_json" -DCLI11_DIR="$cfg/CLI11" \
    -DCMAKE_PREFIX_PATH="$prefix" \
    -DZLIB_INCLUDE_DIR="$deps/zlib" -DZLIB_LIBRARY="$zlib_lib" \
    >"$log/configure.log" 2>&1 || { tail -30 "$log/configure.log"; die "configure"; }
grep -E "with (CUDA|CUBLAS|NCCL)" "$log/configure.log" | sed 's/^-- */gpu-check: /'
say "building the GPU tests and benchmark ($(elapsed)s)"
cmake --build "$build" -j "$jobs" --target diststrat_gpu_tests gpu_bench >"$log/build.log" 2>&1 ||
  { grep -E "error|Error" "$log/build.log" | head -30; die "build"; }

# The wheels' libraries are found at run time through LD_LIBRARY_PATH.
export LD_LIBRARY_PATH="$nccl_root/lib${cublas_root:+:$cublas_root/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export DISTSTRAT_GPU_LEASE_DIR=$build/leases

# ---- GPU tests --------------------------------------------------------------------
say "running the GPU tests ($(elapsed)s)"
timeout 240 "$build/tests/gpu/diststrat_gpu_tests" >"$log/tests.log" 2>&1
tests_rc=$?
passed=$(grep -oE '^\[  PASSED  \] [0-9]+' "$log/tests.log" | grep -oE '[0-9]+$' || echo 0)
failed=$(grep -oE '^\[  FAILED  \] [0-9]+ test' "$log/tests.log" | grep -oE '[0-9]+' || echo 0)
skipped=$(grep -oE '^\[  SKIPPED \] [0-9]+' "$log/tests.log" | grep -oE '[0-9]+$' || echo 0)
grep -E '^\[  (FAILED|SKIPPED) \] [A-Z]' "$log/tests.log" | grep -v ' ms)$' | sed 's/^/gpu-check: /'
if [[ $tests_rc -ne 0 && $failed == 0 ]]; then
  failed="crash(rc=$tests_rc)"; tail -20 "$log/tests.log"
fi
# Only the multi-GPU NCCL test may skip (one GPU); any other skip means the
# CUDA runtime could not use the GPU (driver too old for this nvcc, ...).
unexpected_skips=$(grep -E '^\[  SKIPPED \] [A-Z]' "$log/tests.log" | grep -v ' ms)$' |
  grep -vc 'AllGpusWithNcclWhenThereAreSeveral')
if (( unexpected_skips > 0 )); then
  say "GPU tests were skipped; the reason:"
  grep -m1 -A1 'Skipped$' "$log/tests.log" | tail -1 | sed 's/^/gpu-check:   /'
fi

# ---- GPU benchmark ----------------------------------------------------------------
say "running the GPU benchmark ($(elapsed)s)"
quick=""
(( $(elapsed) > 300 )) && quick=--quick   # keep the whole check under 8 minutes
timeout 150 "$build/benchmarks/gpu_bench" $quick >"$log/bench.log" 2>&1
bench_rc=$?
grep -v '^result ' "$log/bench.log"
r() { grep -oE "^result $1=[^ ]+" "$log/bench.log" | cut -d= -f2; }

# ---- summary ----------------------------------------------------------------------
echo
echo "================ diststrat GPU check ($(elapsed)s) ================"
printf '%-44s %s\n' "GPU tests passed / failed / skipped" "$passed / $failed / $skipped"
if [[ $bench_rc -eq 0 ]]; then
  printf '%-44s %s ms, %s samples/s\n' "MLP step on GPU (batch 512)" "$(r mlp_gpu_step_ms)" "$(r mlp_gpu_samples_per_s)"
  printf '%-44s %s ms (GPU %sx faster; bar >= 10x)\n' "MLP step on 1 CPU core" "$(r mlp_cpu_step_ms)" "$(r mlp_speedup)"
  printf '%-44s %s GB/s algbw; D2D copy %s GB/s\n' "logical-GPU all-reduce 256 MiB (2 on 1 GPU)" \
    "$(r logical_allreduce_256MiB_algbw_GBs)" "$(r d2d_copy_256MiB_GBs)"
  printf '%-44s %s (bar >= 0.7)\n' "  memory traffic vs copy bandwidth" "$(r logical_allreduce_traffic_vs_copy)"
  printf '%-44s %s GB/s\n' "NCCL 1-GPU all-reduce 256 MiB algbw" "$(r nccl_1gpu_256MiB_algbw_GBs)"
else
  printf '%-44s %s\n' "GPU benchmark" "did not complete (rc=$bench_rc, see $log/bench.log)"
fi
echo "logs: $log"
[[ $tests_rc -eq 0 && $bench_rc -eq 0 && $failed == 0 && $passed -gt 0 && $unexpected_skips == 0 ]] && exit 0
exit 1
