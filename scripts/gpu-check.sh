#!/usr/bin/env bash
# The GPU check, for a machine with a GPU, nvcc, CMake and ninja, with NCCL and
# cuBLAS inside PyTorch's Python packages (nvidia/nccl, nvidia/cu13) or the
# CUDA toolkit, and no apt, network or MPI. One call: checks its tools and
# inputs, configures and builds the CUDA backend, the GPU tests, the GPU
# benchmark, the examples and (once it exists) diststrat::torch against the
# machine's own LibTorch; runs the GPU tests, gpu_bench, the LibTorch tests,
# fashion_mnist and train_bench on the GPU (MirroredStrategy on 2 and 4
# logical GPUs, CentralStorageStrategy), and prints a table last.
#
#   scripts/gpu-deps.sh            # once, on a machine with the Debian packages: fills .deps/
#   scripts/gpu-check.sh           # on the GPU machine, with .deps/ carried along
#   scripts/gpu-check.sh --dry-run # here, without a GPU: every step that needs none
#                                  # (self-checks, GoogleTest, configure, build), with
#                                  # the machine's Debian packages hidden from CMake;
#                                  # with Debian's CPU LibTorch, diststrat::torch is
#                                  # built apart (CPU only, /usr visible) and the
#                                  # LibTorch tests run
#
# Environment: DEPS (default .deps), BUILD (default build-gpu), CUDA_ARCHS
# (default 90: H100/H200), JOBS (default: all cores), NCCL_ROOT / CUBLAS_ROOT
# (override the lookup), TORCH_PREFIX (LibTorch's CMake prefix).
# Exit status: 0 when every step that ran passed (and, without --dry-run,
# every GPU test ran and passed), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
t_start=$(date +%s)
dry_run=0
for a in "$@"; do
  case $a in
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument '$a' (see --help)"; exit 2 ;;
  esac
done
deps=$(realpath -m "${DEPS:-.deps}")
build=$(realpath -m "${BUILD:-build-gpu}")
archs=${CUDA_ARCHS:-90}
jobs=${JOBS:-$(nproc)}
log=$build/gpu-check-logs
mkdir -p "$log"

say() { echo "gpu-check: $*"; }
elapsed() { echo $(( $(date +%s) - t_start )); }

# The table, printed last: one row per step.
rows=()
failed_steps=0
row() {  # name status [detail]
  rows+=("$(printf '%-46s %s' "$1" "$2${3:+ ($3)}")")
  [[ $2 == FAILED* ]] && failed_steps=$((failed_steps + 1))
  return 0
}
print_table() {
  echo
  echo "================ diststrat GPU check$( ((dry_run)) && echo ' --dry-run') ($(elapsed)s) ================"
  for r in "${rows[@]}"; do echo "$r"; done
  echo "logs: $log"
}
finish() {
  print_table
  ((failed_steps == 0)) && exit 0
  exit 1
}
die() { say "FAILED: $*"; row "${step:-self-checks}" "FAILED" "$*"; finish; }

# torch_fashion_mnist --device gpu (the example's binary). It exits 2 with one
# line naming why it cannot run: "this LibTorch has no CUDA ..." (a CPU-only
# LibTorch such as Debian's, or no GPU visible to it) or "not supported by
# diststrat::libtorch yet: ..." (docs/torch.md). Both are a skip with that
# reason, not a failure; any other outcome but success is.
torch_gpu_row() {
  local label="torch_fashion_mnist --device gpu" logf=$log/torch_fashion_mnist.log reason rc
  timeout 120 "$1" --device gpu --epochs 1 --data "$deps/fashion-mnist" >"$logf" 2>&1
  rc=$?
  reason=$(grep -m1 -e '--device gpu: ' "$logf" | sed 's/^.*--device gpu: //')
  if ((rc == 0)); then
    row "$label" "ok" "$(grep -m1 -oE 'test_accuracy=[0-9.]+' "$logf")"
  elif ((rc == 2)) && [[ $reason == "this LibTorch has no CUDA"* ]]; then
    row "$label" "skipped" "LibTorch without CUDA: $reason"
  elif ((rc == 2)) && [[ $reason == "not supported by diststrat::libtorch yet"* ]]; then
    row "$label" "skipped" "$reason"
  else
    tail -5 "$logf" | sed 's/^/gpu-check:   /'
    row "$label" "FAILED" "rc=$rc, see $logf"
  fi
}

# ---- self-checks: every tool and input is where it must be -----------------------
step="self-checks"
nvcc=$(command -v nvcc || true)
[[ -z $nvcc && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
[[ -n $nvcc ]] || die "nvcc not found (PATH or /usr/local/cuda/bin)"
cuda_root=$(dirname "$(dirname "$(realpath "$nvcc")")")
command -v cmake >/dev/null || die "cmake not found"
command -v ninja >/dev/null || die "ninja not found"
command -v python3 >/dev/null || die "python3 not found (needed to locate the NCCL/cuBLAS wheels)"
for d in eigen3/Eigen googletest/googletest nlohmann CLI dlpack/include/dlpack/dlpack.h zlib/zlib.h fashion-mnist/train-images-idx3-ubyte.gz; do
  [[ -e $deps/$d ]] || die "$deps/$d missing: run scripts/gpu-deps.sh on a Debian machine and carry .deps"
done

# A wheel's root (the folder with include/ and lib/): every entry of the
# namespace package nvidia.__path__ (no __file__) is searched for
# <entry>/<sub>/include/<header>, <sub> = the library's own folder (nvidia/nccl)
# or a CUDA-major folder (nvidia/cu13: the CUDA 13 cuBLAS wheel), then any.
wheel_root() {  # header library-glob sub...
  python3 - "$@" <<'PY' 2>/dev/null
import glob, os, sys
header, lib, subs = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    import nvidia
    paths = list(nvidia.__path__)
except ImportError:
    sys.exit(0)
for p in paths:
    for r in [os.path.join(p, s) for s in subs] + sorted(glob.glob(os.path.join(p, "*"))):
        if os.path.isfile(os.path.join(r, "include", header)) and glob.glob(os.path.join(r, "lib", lib)):
            print(r)
            sys.exit(0)
PY
}
toolkit_has() {  # header library-glob
  [[ -e $cuda_root/include/$1 ]] && compgen -G "$cuda_root/lib64/$2" >/dev/null ||
    { [[ -e $cuda_root/include/$1 ]] && compgen -G "$cuda_root/targets/x86_64-linux/lib/$2" >/dev/null; }
}
# NCCL: NCCL_ROOT, else the wheel, else the toolkit.
nccl_root=${NCCL_ROOT:-$(wheel_root nccl.h 'libnccl.so*' nccl)}
nccl_from="wheel"
[[ -n ${NCCL_ROOT:-} ]] && nccl_from="NCCL_ROOT"
if [[ -z $nccl_root ]] && toolkit_has nccl.h 'libnccl.so*'; then nccl_root=$cuda_root; nccl_from="CUDA toolkit"; fi
[[ -n $nccl_root && -e $nccl_root/include/nccl.h ]] ||
  die "NCCL not found (no nvidia/nccl wheel, none in $cuda_root; set NCCL_ROOT)"
# cuBLAS: CUBLAS_ROOT, else the toolkit's when it has one, else the wheel.
cublas_root=${CUBLAS_ROOT:-}
cublas_from="CUBLAS_ROOT"
if [[ -z $cublas_root ]]; then
  if toolkit_has cublas_v2.h 'libcublas.so*'; then
    cublas_from="CUDA toolkit"
  else
    cublas_root=$(wheel_root cublas_v2.h 'libcublas.so*' cu13 cublas cu12)
    cublas_from="wheel"
    [[ -n $cublas_root ]] || die "cuBLAS not found (not in $cuda_root, no nvidia/cu13 or nvidia/cublas wheel; set CUBLAS_ROOT)"
  fi
fi
say "nvcc $("$nvcc" --version | grep -o 'release [0-9.]*') ($cuda_root)"
say "NCCL from the $nccl_from: $nccl_root"
say "cuBLAS from the $cublas_from: ${cublas_root:-$cuda_root}"
gpu_name=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
[[ -n $gpu_name ]] && say "GPU: $gpu_name"
if ((!dry_run)) && [[ -z $gpu_name ]]; then say "nvidia-smi sees no GPU (the GPU tests will say why they skip)"; fi
# LibTorch: the machine's own (PyTorch's CMake prefix), else Debian's.
torch_prefix=${TORCH_PREFIX:-$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)}
if [[ -z $torch_prefix ]]; then
  for p in /usr/share/cmake /usr/lib/x86_64-linux-gnu/cmake /usr/lib/cmake; do
    [[ -e $p/Torch/TorchConfig.cmake ]] && { torch_prefix=$p; break; }
  done
fi
say "LibTorch: ${torch_prefix:-none found}"
# zlib: the machine's own library when there is one, else the carried copy.
zlib_lib=$(ldconfig -p 2>/dev/null | awk '/libz\.so\.1 .*x86-64/ {print $NF; exit}')
[[ -n $zlib_lib ]] || zlib_lib=$deps/zlib/libz.so.1
row "self-checks" "ok" "NCCL: $nccl_from, cuBLAS: $cublas_from"

# ---- GoogleTest from source, and CMake configs for the header-only deps -----------
step="GoogleTest (from .deps)"
prefix=$build/_deps/prefix
if [[ ! -e $prefix/lib/cmake/GTest/GTestConfig.cmake && ! -e $prefix/lib64/cmake/GTest/GTestConfig.cmake ]]; then
  say "building GoogleTest ($(elapsed)s)"
  cmake -S "$deps/googletest" -B "$build/_deps/gtest" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX="$prefix" -DBUILD_GMOCK=ON -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
      >"$log/gtest.log" 2>&1 &&
    cmake --build "$build/_deps/gtest" -j "$jobs" --target install >>"$log/gtest.log" 2>&1 ||
    { tail -20 "$log/gtest.log"; die "GoogleTest build, see $log/gtest.log"; }
fi
row "$step" "ok"
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
# Debian's packages under /usr are hidden from find_package, so a dry run here
# finds only what the GPU machine has or .deps carries.
step="configure"
configure() {  # torch-prefix (may be empty)
  local torch_mode=OFF
  [[ -n $1 ]] && torch_mode=AUTO
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="$archs" \
      -DCMAKE_CUDA_RUNTIME_LIBRARY=Shared \
      -DDISTSTRAT_WITH_CUDA=ON -DDISTSTRAT_WITH_CUBLAS=ON -DDISTSTRAT_WITH_NCCL=ON \
      -DDISTSTRAT_WITH_MPI=OFF -DDISTSTRAT_WITH_GLOO=OFF -DDISTSTRAT_WITH_TORCH=$torch_mode \
      -DDISTSTRAT_WITH_DLPACK=ON -DDLPACK_ROOT="$deps/dlpack" \
      -DDISTSTRAT_BUILD_EXAMPLES=ON -DDISTSTRAT_BUILD_BENCHMARKS=OFF -DDISTSTRAT_BUILD_TESTS=ON \
      -DNCCL_ROOT="$nccl_root" ${cublas_root:+-DCUBLAS_ROOT="$cublas_root"} \
      -DEigen3_DIR="$cfg/Eigen3" -Dnlohmann_json_DIR="$cfg/nlohmann_json" -DCLI11_DIR="$cfg/CLI11" \
      -DCMAKE_PREFIX_PATH="$prefix${1:+;$1}" -DCMAKE_IGNORE_PREFIX_PATH=/usr \
      -DZLIB_INCLUDE_DIR="$deps/zlib" -DZLIB_LIBRARY="$zlib_lib" \
      >"$log/configure.log" 2>&1
}
say "configuring ($(elapsed)s)"
torch_configure_failed=""
# A dry run with Debian's LibTorch (under /usr, which the configure above
# hides: its Caffe2 config needs Debian's glog, gflags and protobuf) builds
# diststrat::torch in a build of its own without the hiding, CPU only (see
# "LibTorch, dry run" below); the GPU machine's LibTorch (PyTorch's prefix)
# goes into the main build.
debian_torch=""
if ((dry_run)) && [[ $torch_prefix == /usr/* ]]; then
  debian_torch=$torch_prefix
  torch_prefix=""
fi
if ! configure "$torch_prefix"; then
  if [[ -n $torch_prefix ]]; then
    # LibTorch must not cost the rest of the check: configure again without it.
    cp "$log/configure.log" "$log/configure-with-torch.log"
    tail -15 "$log/configure-with-torch.log"
    say "configure with LibTorch failed; configuring without it"
    torch_configure_failed="configure with LibTorch failed, see $log/configure-with-torch.log"
    rm -f "$build/CMakeCache.txt"
    configure "" || { tail -30 "$log/configure.log"; die "configure, see $log/configure.log"; }
  else
    tail -30 "$log/configure.log"
    die "configure, see $log/configure.log"
  fi
fi
grep -E "with (CUDA|CUBLAS|NCCL|TORCH)|^-- (NCCL|cuBLAS):" "$log/configure.log" | sed 's/^-- */gpu-check: /'
grep -q "with NCCL *: yes" "$log/configure.log" || die "configured without NCCL"
row "$step" "ok" "sm_$archs"

# diststrat::torch and its tests/example, where the tree has them.
targets=$(cmake --build "$build" --target help 2>/dev/null | sed -n 's/^\([A-Za-z0-9_.+-]*\): .*/\1/p')
has_target() { grep -qx "$1" <<<"$targets"; }
torch_targets=()
if has_target diststrat_torch; then
  torch_targets=(diststrat_torch)
  for t in diststrat_torch_tests torch_fashion_mnist; do has_target "$t" && torch_targets+=("$t"); done
fi
step="build"
build_targets=(diststrat_gpu_tests gpu_bench fashion_mnist train_bench "${torch_targets[@]}")
say "building ${build_targets[*]} ($(elapsed)s)"
cmake --build "$build" -j "$jobs" --target "${build_targets[@]}" >"$log/build.log" 2>&1 ||
  { grep -E "error|Error" "$log/build.log" | head -30; die "build, see $log/build.log"; }
row "$step" "ok" "$(elapsed)s so far"
# The libraries must resolve before anything runs (the wheels' through LD_LIBRARY_PATH).
export LD_LIBRARY_PATH="$nccl_root/lib${cublas_root:+:$cublas_root/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
step="libraries resolve"
missing=$(ldd "$build/tests/gpu/diststrat_gpu_tests" 2>&1 | grep "not found" || true)
[[ -z $missing ]] || die "unresolved libraries: $(echo $missing)"
ldd "$build/tests/gpu/diststrat_gpu_tests" | grep -E "libnccl|libcublas\.|libcudart" | sed 's/^\s*/gpu-check:   /'
n_cudart=$(ldd "$build/tests/gpu/diststrat_gpu_tests" | grep -c "libcudart")
row "$step" "ok" "$n_cudart cudart"

if ((dry_run)); then
  # The binaries load and run here too: the GPU tests skip (no GPU), the
  # GPU-less error tests pass.
  export DISTSTRAT_GPU_LEASE_DIR=$build/leases
  timeout 120 "$build/tests/gpu/diststrat_gpu_tests" >"$log/tests.log" 2>&1
  rc=$?
  dp=$(grep -oE '^\[  PASSED  \] [0-9]+' "$log/tests.log" | grep -oE '[0-9]+$' || echo 0)
  ds=$(grep -oE '^\[  SKIPPED \] [0-9]+' "$log/tests.log" | grep -oE '[0-9]+$' || echo 0)
  if ((rc == 0)); then row "GPU test binary runs (no GPU here)" "ok" "$dp passed, $ds skipped"
  else row "GPU test binary runs (no GPU here)" "FAILED" "rc=$rc, see $log/tests.log"; fi
  row "GPU tests" "skipped" "dry run"
  row "gpu_bench" "skipped" "dry run"
  if [[ -n $torch_configure_failed ]]; then
    row "LibTorch" "FAILED" "$torch_configure_failed"
  elif ((${#torch_targets[@]})); then
    row "LibTorch tests, torch_fashion_mnist" "skipped" "dry run; built: ${torch_targets[*]}"
  elif [[ -n $debian_torch ]]; then
    # Debian's CPU LibTorch: configure, build and run what needs no GPU.
    tb=$build/torch-dry-run
    say "LibTorch, dry run: Debian's CPU LibTorch in $tb ($(elapsed)s)"
    if cmake -S "$root" -B "$tb" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDISTSTRAT_WITH_TORCH=ON \
         -DDISTSTRAT_WITH_CUDA=OFF -DDISTSTRAT_WITH_MPI=OFF -DDISTSTRAT_WITH_GLOO=OFF \
         -DDISTSTRAT_BUILD_BENCHMARKS=OFF -DCMAKE_PREFIX_PATH="$prefix;$debian_torch" \
         -DEigen3_DIR="$cfg/Eigen3" -Dnlohmann_json_DIR="$cfg/nlohmann_json" -DCLI11_DIR="$cfg/CLI11" \
         >"$log/configure-torch-dry-run.log" 2>&1 &&
       cmake --build "$tb" -j "$jobs" --target diststrat_torch diststrat_torch_tests torch_fashion_mnist \
         >"$log/build-torch-dry-run.log" 2>&1; then
      timeout 300 "$tb/tests/torch/diststrat_torch_tests" >"$log/torch_tests.log" 2>&1
      rc=$?
      tp=$(grep -oE '^\[  PASSED  \] [0-9]+' "$log/torch_tests.log" | grep -oE '[0-9]+$' || echo 0)
      if ((rc == 0)); then row "LibTorch tests (Debian's CPU LibTorch)" "ok" "$tp passed"
      else row "LibTorch tests (Debian's CPU LibTorch)" "FAILED" "rc=$rc, see $log/torch_tests.log"; fi
    else
      row "LibTorch build (Debian's CPU LibTorch)" "FAILED" "see $log/{configure,build}-torch-dry-run.log"
    fi
    if [[ -x $tb/examples/torch_fashion_mnist ]]; then torch_gpu_row "$tb/examples/torch_fashion_mnist"
    else row "torch_fashion_mnist --device gpu" "FAILED" "not built in $tb"; fi
  else
    row "LibTorch" "skipped: diststrat::torch not built"
  fi
  row "fashion_mnist / train_bench on GPUs" "skipped" "dry run"
  finish
fi

# ---- run-time environment ------------------------------------------------------------
export DISTSTRAT_GPU_LEASE_DIR=$build/leases
# Single node: NCCL must not need a usable network interface (a VM may have
# none but lo), and its warnings are worth seeing.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

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
if [[ $tests_rc -eq 0 && $failed == 0 && $passed -gt 0 && $unexpected_skips == 0 ]]; then
  row "GPU tests passed / failed / skipped" "ok" "$passed / $failed / $skipped"
else
  row "GPU tests passed / failed / skipped" "FAILED" "$passed / $failed / $skipped, rc=$tests_rc"
fi

# ---- GPU benchmark ----------------------------------------------------------------
say "running the GPU benchmark ($(elapsed)s)"
quick=""
(( $(elapsed) > 240 )) && quick=--quick   # keep the whole check under 8 minutes
timeout 150 "$build/benchmarks/gpu_bench" $quick >"$log/bench.log" 2>&1
bench_rc=$?
grep -v '^result ' "$log/bench.log"
r() { grep -oE "^result $1=[^ ]+" "$log/bench.log" | cut -d= -f2; }
if [[ $bench_rc -eq 0 ]]; then
  row "gpu_bench" "ok" "NCCL $(r nccl_version) at run time"
  bench_rows=(
    "$(printf '%-46s %s ms, %s samples/s' "  MLP step on GPU (batch 512)" "$(r mlp_gpu_step_ms)" "$(r mlp_gpu_samples_per_s)")"
    "$(printf '%-46s %s ms (GPU %sx faster; bar >= 10x)' "  MLP step on 1 CPU core" "$(r mlp_cpu_step_ms)" "$(r mlp_speedup)")"
    "$(printf '%-46s %s GB/s algbw; D2D copy %s GB/s' "  logical-GPU all-reduce 256 MiB (2 on 1 GPU)" "$(r logical_allreduce_256MiB_algbw_GBs)" "$(r d2d_copy_256MiB_GBs)")"
    "$(printf '%-46s %s (bar >= 0.7)' "    memory traffic vs copy bandwidth" "$(r logical_allreduce_traffic_vs_copy)")"
    "$(printf '%-46s %s GB/s' "  NCCL 1-GPU all-reduce 256 MiB algbw" "$(r nccl_1gpu_256MiB_algbw_GBs)")"
  )
  rows+=("${bench_rows[@]}")
else
  row "gpu_bench" "FAILED" "rc=$bench_rc, see $log/bench.log"
fi

# ---- LibTorch -----------------------------------------------------------------------
if [[ -n $torch_configure_failed ]]; then
  row "LibTorch" "FAILED" "$torch_configure_failed"
elif ((${#torch_targets[@]} == 0)); then
  row "LibTorch" "skipped: diststrat::torch not built"
else
  say "running the LibTorch tests ($(elapsed)s)"
  torch_tests=$(find "$build" -type f -name diststrat_torch_tests -perm -u+x | head -1)
  if [[ -n $torch_tests ]]; then
    timeout 180 "$torch_tests" >"$log/torch_tests.log" 2>&1
    rc=$?
    tp=$(grep -oE '^\[  PASSED  \] [0-9]+' "$log/torch_tests.log" | grep -oE '[0-9]+$' || echo 0)
    if ((rc == 0)); then row "LibTorch tests" "ok" "$tp passed"; else row "LibTorch tests" "FAILED" "rc=$rc, see $log/torch_tests.log"; fi
  else
    row "LibTorch tests" "FAILED" "diststrat_torch_tests not built"
  fi
  torch_example=$(find "$build" -type f -name torch_fashion_mnist -perm -u+x | head -1)
  if [[ -n $torch_example ]]; then
    torch_gpu_row "$torch_example"
  fi
fi

# ---- the examples on the GPU ---------------------------------------------------------
run_case() {  # label logfile timeout command...
  local label=$1 logf=$log/$2 t=$3
  shift 3
  say "$label ($(elapsed)s)"
  timeout "$t" "$@" >"$logf" 2>&1
  local rc=$?
  if ((rc == 0)); then
    row "$label" "ok" "$(grep -E '^(final|train_bench):' "$logf" | grep -oE '(test_accuracy|samples_per_sec)=[0-9.]+' | tr '\n' ' ' | sed 's/ $//')"
  else
    tail -5 "$logf" | sed 's/^/gpu-check:   /'
    row "$label" "FAILED" "rc=$rc, see $logf"
  fi
}
fm=("$build/examples/fashion_mnist" --device gpu --epochs 1 --data "$deps/fashion-mnist")
tb=("$build/benchmarks/train_bench" --device gpu --steps 100 --warmup 10 --data "$deps/fashion-mnist")
for n in 2 4; do
  run_case "fashion_mnist mirrored, $n logical GPUs" "fm_mirrored_$n.log" 120 \
    "${fm[@]}" --strategy mirrored --replicas $n --split-gpus $n
  run_case "train_bench mirrored, $n logical GPUs" "tb_mirrored_$n.log" 120 \
    "${tb[@]}" --strategy mirrored --replicas $n --split-gpus $n
done
run_case "fashion_mnist central_storage, 2 logical GPUs" "fm_central.log" 120 \
  "${fm[@]}" --strategy central_storage --replicas 2 --split-gpus 2
run_case "train_bench central_storage, 2 logical GPUs" "tb_central.log" 120 \
  "${tb[@]}" --strategy central_storage --replicas 2 --split-gpus 2

finish
