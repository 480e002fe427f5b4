#!/usr/bin/env bash
# The GPU check, for a machine with a GPU, nvcc, CMake and ninja, with NCCL and
# cuBLAS inside PyTorch's Python packages (nvidia/nccl, nvidia/cu13) or the
# CUDA toolkit, and no apt, network or MPI. One call, in stages, each of which
# marks only its own rows when it fails while the others still run:
#   0. self-checks (tools, inputs), GoogleTest from .deps, configure (with the
#      machine's LibTorch when there is one; without it when that fails);
#   1. build the library, the GPU tests and gpu_bench; say which architectures
#      nvcc got; run the GPU tests and gpu_bench (bars checked);
#   2. build and run fashion_mnist and train_bench on logical GPUs, against a
#      CPU run of the same example (accuracy bar);
#   3. build and run diststrat::torch's tests and torch_fashion_mnist on CUDA.
# PyTorch side by side (benchmarks/pytorch/, with the machine's Python torch):
# gpu_bench's MLP step against the same step in PyTorch eager and in one CUDA
# graph (stage 1), torch_fashion_mnist on one GPU against a plain Python loop
# (stage 3); each row prints the ratio and is asserted on a GPU.
# The builds of stages 2 and 3 run in the background (nice 19) while stage 1's
# programs run. Every row is printed when it completes, the table again last.
#
#   scripts/gpu-deps.sh              # once, on a machine with the Debian packages: fills .deps/
#   scripts/gpu-check.sh --budget 540   # on the GPU machine, with .deps/ carried along
#   scripts/gpu-check.sh --dry-run   # here, without a GPU: every step that needs none
#                                    # (self-checks, GoogleTest, configure, builds, the
#                                    # test binary's skips, the CUDA flags under a
#                                    # LibTorch's CMake), with the machine's Debian
#                                    # packages hidden from CMake; with Debian's CPU
#                                    # LibTorch, diststrat::torch is built apart (CPU
#                                    # only, /usr visible) and its tests run
#   --budget S       total seconds for the whole call (default 540; none in a dry
#                    run): each step's timeout is cut to what is left, a step that
#                    does not fit is "skipped (time)"
#   --pytorch-only   only the PyTorch side-by-side rows: no self-checks, configure
#                    or build; the library's side runs from an existing $BUILD
#                    (gpu_bench, examples/torch_fashion_mnist) when built there.
#                    With --dry-run the Python scripts run a few steps on the CPU
#                    and every ratio reads "skipped (no CUDA)"
#   --torch2 DIR     a LibTorch 2.x's headers (DIR/include, DIR/share/cmake, e.g. the
#                    torch/ folder of `pip download --no-deps torch==2.11.0`, unpacked
#                    outside the repository): diststrat::torch's sources are compiled
#                    against them (scripts/torch-syntax-check.sh); also TORCH2_ROOT
#
# Environment: DEPS (default .deps), BUILD (default build-gpu), CUDA_ARCHS
# (default 90: H100/H200), JOBS (default: all cores), NCCL_ROOT / CUBLAS_ROOT
# (override the lookup), TORCH_PREFIX (LibTorch's CMake prefix), PYTHON (the
# Python with torch for the PyTorch rows; default the first of python3 and
# /usr/bin/python3 that imports torch), OUT (when set, the logs and the table
# are written under it: the device tool brings it back).
# Exit status: 0 when every step that ran passed and every bar held (and,
# without --dry-run, every step fitted in the budget and every GPU test ran
# and passed), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
t_start=$(date +%s)
dry_run=0
pytorch_only=0
budget=""
torch2=${TORCH2_ROOT:-}
while (($#)); do
  case $1 in
    --dry-run) dry_run=1 ;;
    --pytorch-only) pytorch_only=1 ;;
    --budget) budget=${2:-}; shift ;;
    --budget=*) budget=${1#--budget=} ;;
    --torch2) torch2=${2:-}; shift ;;
    --torch2=*) torch2=${1#--torch2=} ;;
    -h|--help) sed -n '2,50p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument '$1' (see --help)"; exit 2 ;;
  esac
  shift
done
if [[ -z $budget ]]; then ((dry_run)) && budget=0 || budget=540; fi
[[ $budget =~ ^[0-9]+$ ]] || { echo "gpu-check: --budget '$budget' is not a number of seconds"; exit 2; }
deps=$(realpath -m "${DEPS:-.deps}")
build=$(realpath -m "${BUILD:-build-gpu}")
archs=${CUDA_ARCHS:-90}
jobs=${JOBS:-$(nproc)}
if [[ -n ${OUT:-} ]]; then
  log=$(realpath -m "$OUT")/gpu-check-logs
  table_file=$(realpath -m "$OUT")/gpu-check-table.txt
else
  log=$build/gpu-check-logs
  table_file=$log/table.txt
fi
mkdir -p "$log"
: >"$table_file"

say() { echo "gpu-check: $*"; }
elapsed() { echo $(( $(date +%s) - t_start )); }
# Seconds left of the budget (a large number without one).
left() { if ((budget == 0)); then echo 999999; else echo $(( t_start + budget - $(date +%s) )); fi; }
clock() { if ((budget == 0)); then echo "$(elapsed)s"; else echo "$(elapsed)s of ${budget}s"; fi; }

# The table: one row per step, printed as it completes and again last.
rows=()
failed_steps=0
cut_steps=0  # rows the budget cut: a real run that left any out did not pass
row() {  # name status [detail]
  local r
  r=$(printf '%-50s %s' "$1" "$2${3:+ ($3)}")
  rows+=("$r")
  echo "gpu-check: | $r    [$(clock)]"
  echo "$r" >>"$table_file"
  [[ $2 == FAILED* ]] && failed_steps=$((failed_steps + 1))
  [[ $2 == "skipped (time)"* ]] && cut_steps=$((cut_steps + 1))
  return 0
}
print_table() {
  echo
  echo "================ diststrat GPU check$( ((dry_run)) && echo ' --dry-run') ($(clock)) ================"
  for r in "${rows[@]}"; do echo "$r"; done
  echo "logs: $log"
  { echo "# diststrat GPU check$( ((dry_run)) && echo ' --dry-run'), $(clock)"; printf '%s\n' "${rows[@]}"; } >"$table_file"
}
finished=0
finish() {
  finished=1
  print_table
  ((cut_steps > 0 && !dry_run)) && say "$cut_steps step(s) did not fit in the budget"
  ((failed_steps == 0 && (cut_steps == 0 || dry_run))) && exit 0
  exit 1
}
die() { say "FAILED: $*"; row "${step:-self-checks}" "FAILED" "$*"; finish; }
lease_dir=""
bg_pid=""
on_exit() {
  [[ -n $bg_pid ]] && { kill -- "-$bg_pid"; kill -CONT -- "-$bg_pid"; } 2>/dev/null
  [[ -n $lease_dir ]] && rm -rf "$lease_dir"
  return 0
}
trap on_exit EXIT
trap 'say "interrupted ($(clock))"; row "gpu-check" "FAILED" "interrupted at $(clock)"; finish' TERM INT

# Whether at least N seconds of the budget are left.
time_for() { (( $(left) >= $1 )); }
# Runs "$@" with a timeout of min(want, what is left - margin); returns 125
# without running it when less than `need` seconds are left.
limited() {  # want need command...
  local want=$1 need=$2 l t
  shift 2
  l=$(( $(left) - 5 ))
  ((l < need)) && return 125
  t=$(( want < l ? want : l ))
  timeout "$t" "$@"
}

# Per-suite counts of a GoogleTest log (passed / failed / skipped), as rows
# under a heading row: each GPU test suite is listed, so a new one shows here.
suite_rows() {  # logfile
  local s p f k
  # (Not a pipeline into the loop: row must run in this shell to keep its rows.)
  while read -r s p f k; do
    if ((f > 0)); then row "  $s" "FAILED" "$p passed, $f failed, $k skipped"
    else row "  $s" "ok" "$p passed, $k skipped"; fi
  done < <(awk '
    /^\[       OK \] /     { split($4, a, "."); s = a[1]; ok[s]++; seen[s] = 1 }
    /^\[  FAILED  \] .* ms\)$/ { split($4, a, "."); s = a[1]; bad[s]++; seen[s] = 1 }
    /^\[  SKIPPED \] .* ms\)$/ { split($4, a, "."); s = a[1]; skip[s]++; seen[s] = 1 }
    END { for (s in seen) printf "%s %d %d %d\n", s, ok[s], bad[s], skip[s] }' "$1" | sort)
}
gtest_count() {  # logfile PASSED|FAILED|SKIPPED
  local n
  n=$(grep -oE "^\[  $2 *\] [0-9]+ test" "$1" | grep -oE '[0-9]+' | head -1)
  echo "${n:-0}"
}

# ---- PyTorch side by side (benchmarks/pytorch/) ---------------------------------------
# The same work in plain PyTorch, on the same card in the same call: gpu_bench's
# MLP step against PyTorch eager and a CUDA graph of the whole step, and
# torch_fashion_mnist on one GPU against a plain Python loop. In a dry run (no
# GPU) the scripts run a few steps on the CPU, which proves them, and every
# timing row reads "skipped (no CUDA)".
pytorch_python=""
find_pytorch() {  # sets pytorch_python; fails when no Python here imports torch
  local p
  [[ -n $pytorch_python ]] && return 0
  for p in ${PYTHON:-} python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import torch' >/dev/null 2>&1; then
      pytorch_python=$p
      return 0
    fi
  done
  return 1
}
no_pytorch_row() {  # label
  if ((dry_run)); then row "$1" "skipped" "no Python here imports torch (set PYTHON)"
  else row "$1" "FAILED" "no Python imports torch (set PYTHON)"; fi
}
# A bar on ours / PyTorch's, both from this call; the row prints the ratio.
ratio_row() {  # label ours theirs op(<=|>=) threshold unit
  local r verdict
  if [[ -z $2 || -z $3 ]]; then row "$1" "FAILED" "no value: ours ${2:-none}, PyTorch ${3:-none}"; return; fi
  r=$(awk -v a="$2" -v b="$3" 'BEGIN { if (b > 0) printf "%.3f", a / b; else print "inf" }')
  if awk -v r="$r" -v t="$5" -v op="$4" 'BEGIN { if (r == "inf") exit 1; exit !((op == ">=") ? r >= t : r <= t) }'
  then verdict=ok; else verdict=FAILED; fi
  row "$1" "$verdict" "ours $2 $6, PyTorch $3 $6: ratio $r (bar $4 $5)"
}
# A run's "final:" line: test_accuracy and samples_per_sec.
final_of() { grep -E '^(final|train_bench):' "$1" | grep -oE "$2=[0-9.]+" | tail -1 | cut -d= -f2; }
# A `result key=value` line of a log.
result_of() { grep -oE "^result $2=[^ ]+" "$1" | tail -1 | cut -d= -f2; }
# Runs benchmarks/pytorch/mlp_step.py into $log/pytorch_mlp.log; sets
# pytorch_mlp_rc (125: did not fit, 126: no PyTorch). On a GPU it runs while
# the background builds are stopped, as gpu_bench does: eager PyTorch is
# bound by the host's launch rate.
pytorch_mlp_rc=126
pytorch_mlp_run() {
  local steps=1000 warmup=20
  local threads=()
  ((dry_run)) && { steps=20; warmup=2; threads=(--threads 1); }  # on the CPU: proves the script
  find_pytorch || { pytorch_mlp_rc=126; return; }
  say "PyTorch MLP step, eager and CUDA graph ($(clock))"
  limited 90 20 "$pytorch_python" "$root/benchmarks/pytorch/mlp_step.py" --steps $steps \
    --warmup $warmup "${threads[@]}" >"$log/pytorch_mlp.log" 2>&1
  pytorch_mlp_rc=$?
}
pytorch_mlp_rows() {  # the library's MLP step in ms, from gpu_bench in this call ("" if none)
  local label="PyTorch MLP step (eager, CUDA graph)" logf=$log/pytorch_mlp.log dev eager graph
  local bar_eager="  bar: MLP step <= 0.5x PyTorch eager's"
  local bar_graph="  bar: MLP step <= 1.25x PyTorch CUDA graph's"
  if ((pytorch_mlp_rc == 126)); then no_pytorch_row "$label"; return; fi
  if ((pytorch_mlp_rc == 125)); then row "$label" "skipped (time)"; return; fi
  if ((pytorch_mlp_rc != 0)); then
    tail -5 "$logf" | sed 's/^/gpu-check:   /'
    row "$label" "FAILED" "rc=$pytorch_mlp_rc, see $logf"
    return
  fi
  dev=$(result_of "$logf" device)
  eager=$(result_of "$logf" pytorch_mlp_eager_step_ms)
  graph=$(result_of "$logf" pytorch_mlp_graph_step_ms)
  if [[ $dev != cuda ]]; then
    row "$label" "ok" "the script ran on ${dev:-?} ($(grep -m1 -oE '^PyTorch [^ ,]+' "$logf")); timing skipped (no CUDA)"
    row "$bar_eager" "skipped (no CUDA)"
    row "$bar_graph" "skipped (no CUDA)"
  elif ((dry_run)); then
    row "$label" "info" "eager $eager ms, graph $graph ms"
    row "$bar_eager" "skipped" "dry run: the library's step not measured"
    row "$bar_graph" "skipped" "dry run: the library's step not measured"
  else
    row "$label" "info" "eager $eager ms, graph $graph ms ($(grep -m1 -oE '^PyTorch [^ ,]+' "$logf"))"
    ratio_row "$bar_eager" "$1" "$eager" "<=" 0.5 ms
    ratio_row "$bar_graph" "$1" "$graph" "<=" 1.25 ms
  fi
}
# torch_fashion_mnist --device gpu on one GPU against
# benchmarks/pytorch/fashion_mnist_loop.py: the same CNN, batch, optimizer,
# seed, epochs and loss-read cadence, both with deterministic kernels.
pytorch_fm_rows() {  # torch_fashion_mnist binary ("" when not built) data-dir
  local label="PyTorch Fashion-MNIST loop (1 GPU)" bar="  bar: torch_fashion_mnist >= 0.95x PyTorch's"
  local logf=$log/pytorch_fashion_mnist.log rc dev theirs ours
  local common=(--epochs 3 --deterministic --data "$2")
  ((dry_run)) && common=(--epochs 1 --limit 1024 --test-limit 1000 --deterministic --data "$2")
  find_pytorch || { no_pytorch_row "$label"; return; }
  say "PyTorch Fashion-MNIST loop ($(clock))"
  limited 120 20 "$pytorch_python" "$root/benchmarks/pytorch/fashion_mnist_loop.py" \
    "${common[@]}" >"$logf" 2>&1
  rc=$?
  if ((rc == 125)); then row "$label" "skipped (time)"; return; fi
  if ((rc != 0)); then
    tail -5 "$logf" | sed 's/^/gpu-check:   /'
    row "$label" "FAILED" "rc=$rc, see $logf"
    return
  fi
  dev=$(grep -E '^final:' "$logf" | grep -oE 'device=[a-z]+' | tail -1 | cut -d= -f2)
  theirs=$(final_of "$logf" samples_per_sec)
  if [[ $dev != cuda ]]; then
    row "$label" "ok" "the script ran on ${dev:-?}: test_accuracy=$(final_of "$logf" test_accuracy); timing skipped (no CUDA)"
    row "$bar" "skipped (no CUDA)"
    return
  fi
  row "$label" "info" "samples_per_sec=$theirs test_accuracy=$(final_of "$logf" test_accuracy)"
  if ((dry_run)); then row "$bar" "skipped" "dry run: torch_fashion_mnist not run"; return; fi
  if [[ -z $1 || ! -x $1 ]]; then row "$bar" "FAILED" "torch_fashion_mnist not built"; return; fi
  say "torch_fashion_mnist --device gpu, 1 replica ($(clock))"
  limited 120 20 "$1" --device gpu --strategy mirrored --replicas 1 "${common[@]}" \
    >"$log/torch_fashion_mnist_1gpu.log" 2>&1
  rc=$?
  if ((rc == 125)); then row "$bar" "skipped (time)"; return; fi
  if ((rc != 0)); then row "$bar" "FAILED" "torch_fashion_mnist rc=$rc, see $log/torch_fashion_mnist_1gpu.log"; return; fi
  ours=$(final_of "$log/torch_fashion_mnist_1gpu.log" samples_per_sec)
  ratio_row "$bar" "$ours" "$theirs" ">=" 0.95 samples/s
}
if ((pytorch_only)); then
  say "PyTorch side by side only$( ((dry_run)) && echo ', dry run')"
  fm_data=$deps/fashion-mnist
  [[ -e $fm_data/train-images-idx3-ubyte.gz ]] || fm_data=/usr/share/datasets/fashion-mnist
  ours_mlp=""
  if ((!dry_run)) && [[ -x $build/benchmarks/gpu_bench ]]; then
    limited 150 40 "$build/benchmarks/gpu_bench" --quick >"$log/bench.log" 2>&1 &&
      ours_mlp=$(result_of "$log/bench.log" mlp_gpu_step_ms)
    row "gpu_bench (the library's MLP step)" "info" "${ours_mlp:-none} ms"
  fi
  pytorch_mlp_run
  pytorch_mlp_rows "$ours_mlp"
  pytorch_fm_rows "$build/examples/torch_fashion_mnist" "$fm_data"
  finish
fi

# ---- 0. self-checks: every tool and input is where it must be ---------------------------
step="self-checks"
say "budget: $( ((budget == 0)) && echo none || echo "${budget}s")"
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
# The wheels' libraries must resolve from the first build on: GoogleTest's
# test discovery runs test binaries at build time.
export LD_LIBRARY_PATH="$nccl_root/lib${cublas_root:+:$cublas_root/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# ---- GoogleTest from source, and CMake configs for the header-only deps -----------
step="GoogleTest (from .deps)"
prefix=$build/_deps/prefix
if [[ ! -e $prefix/lib/cmake/GTest/GTestConfig.cmake && ! -e $prefix/lib64/cmake/GTest/GTestConfig.cmake ]]; then
  say "building GoogleTest ($(clock))"
  cmake -S "$deps/googletest" -B "$build/_deps/gtest" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX="$prefix" -DBUILD_GMOCK=ON -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
      >"$log/gtest.log" 2>&1 &&
    limited 200 30 cmake --build "$build/_deps/gtest" -j "$jobs" --target install >>"$log/gtest.log" 2>&1 ||
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

# ---- configure -----------------------------------------------------------------------
# Debian's packages under /usr are hidden from find_package, so a dry run here
# finds only what the GPU machine has or .deps carries.
step="configure"
configure() {  # build-dir torch-prefix (may be empty) extra-cmake-args...
  local dir=$1 tp=$2 torch_mode=OFF
  shift 2
  [[ -n $tp ]] && torch_mode=AUTO
  cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="$archs" \
      -DCMAKE_CUDA_RUNTIME_LIBRARY=Shared \
      -DDISTSTRAT_WITH_CUDA=ON -DDISTSTRAT_WITH_CUBLAS=ON -DDISTSTRAT_WITH_NCCL=ON \
      -DDISTSTRAT_WITH_MPI=OFF -DDISTSTRAT_WITH_GLOO=OFF -DDISTSTRAT_WITH_TORCH=$torch_mode \
      -DDISTSTRAT_WITH_DLPACK=ON -DDLPACK_ROOT="$deps/dlpack" \
      -DDISTSTRAT_BUILD_EXAMPLES=ON -DDISTSTRAT_BUILD_BENCHMARKS=OFF -DDISTSTRAT_BUILD_TESTS=ON \
      -DNCCL_ROOT="$nccl_root" ${cublas_root:+-DCUBLAS_ROOT="$cublas_root"} \
      -DEigen3_DIR="$cfg/Eigen3" -Dnlohmann_json_DIR="$cfg/nlohmann_json" -DCLI11_DIR="$cfg/CLI11" \
      -DCMAKE_PREFIX_PATH="$prefix${tp:+;$tp}" -DCMAKE_IGNORE_PREFIX_PATH=/usr \
      -DZLIB_INCLUDE_DIR="$deps/zlib" -DZLIB_LIBRARY="$zlib_lib" "$@"
}
say "configuring ($(clock))"
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
if ! configure "$build" "$torch_prefix" >"$log/configure.log" 2>&1; then
  if [[ -n $torch_prefix ]]; then
    # LibTorch must not cost the rest of the check: configure again without it.
    cp "$log/configure.log" "$log/configure-with-torch.log"
    tail -15 "$log/configure-with-torch.log"
    say "configure with LibTorch failed; configuring without it"
    torch_configure_failed="configure with LibTorch failed, see $log/configure-with-torch.log"
    rm -f "$build/CMakeCache.txt"
    configure "$build" "" >"$log/configure.log" 2>&1 ||
      { tail -30 "$log/configure.log"; die "configure, see $log/configure.log"; }
  else
    tail -30 "$log/configure.log"
    die "configure, see $log/configure.log"
  fi
fi
grep -E "with (CUDA|CUBLAS|NCCL|TORCH)|CUDA kernels|LibTorch|^-- (NCCL|cuBLAS):" "$log/configure.log" | sed 's/^-- */gpu-check: /'
grep -q "with NCCL *: yes" "$log/configure.log" || die "configured without NCCL"
row "$step" "ok" "CUDA_ARCHS=$archs"

targets=$(cmake --build "$build" --target help 2>/dev/null | sed -n 's/^\([A-Za-z0-9_.+-]*\): .*/\1/p')
has_target() { grep -qx "$1" <<<"$targets"; }
torch_targets=()
if has_target diststrat_torch; then
  torch_targets=(diststrat_torch)
  for t in diststrat_torch_tests diststrat_torch_gpu_tests torch_fashion_mnist; do has_target "$t" && torch_targets+=("$t"); done
fi

# What nvcc was given for the kernels: the architectures must be CUDA_ARCHS
# whatever a LibTorch's CMake set (it sets CMAKE_CUDA_ARCHITECTURES OFF and
# adds its own -gencode list in the caller's scope).
arch_flags() {  # build-dir
  ninja -C "$1" -t commands diststrat 2>/dev/null | grep -m1 -E 'kernels\.cu(\.o)?( |$)' |
    grep -oE -- '(--generate-code|-gencode)[= ][^ ]+|-arch[= ][^ ]+' | tr '\n' ' ' | sed 's/ $//'
}
arch_row() {  # label build-dir
  local got
  got=$(arch_flags "$2")
  if [[ -z $got ]]; then row "$1" "FAILED" "no architecture flags on kernels.cu's command"
  elif grep -q "sm_$archs" <<<"$got" && ! grep -qE "sm_[0-9]+" <<<"$(sed "s/sm_$archs//g" <<<"$got")"; then
    row "$1" "ok" "$got"
  else row "$1" "FAILED" "$got; wanted sm_$archs only"; fi
}
arch_row "CUDA kernels built for sm_$archs" "$build"
# GoogleTest's discovery must not run a test binary at build time (it needs
# the wheels' libraries): DISCOVERY_MODE PRE_TEST.
if ninja -C "$build" -t commands diststrat_gpu_tests 2>/dev/null | grep -q GoogleTestAddTests; then
  row "GPU test discovery at test time" "FAILED" "the build runs diststrat_gpu_tests (POST_BUILD discovery)"
else
  row "GPU test discovery at test time" "ok" "the build runs no test binary"
fi

# ---- 1. the library, the GPU tests and gpu_bench -------------------------------------
step="build 1: library, GPU tests, gpu_bench"
say "building diststrat_gpu_tests gpu_bench ($(clock))"
limited 3600 60 cmake --build "$build" -j "$jobs" --target diststrat_gpu_tests gpu_bench >"$log/build-1.log" 2>&1
rc=$?
stage1_ok=0
not_built="FAILED"  # what the rows of later stages say when stage 1 did not build
if ((rc == 0)); then
  stage1_ok=1
  row "$step" "ok"
elif ((rc == 125 || rc == 124)); then
  not_built="skipped (time)"
  row "$step" "skipped (time)" "the budget ran out"
else
  grep -E "error|Error" "$log/build-1.log" | head -30
  row "$step" "FAILED" "see $log/build-1.log"
fi
if command -v cuobjdump >/dev/null || [[ -x $cuda_root/bin/cuobjdump ]]; then
  lib=$(find "$build" -maxdepth 1 -name 'libdiststrat.so*' -type f | head -1)
  if ((stage1_ok)) && [[ -n $lib ]]; then
    elf=$("$cuda_root/bin/cuobjdump" --list-elf "$lib" 2>/dev/null | grep -oE 'sm_[0-9a-z]+' | sort -u | tr '\n' ' ')
    say "machine code in $(basename "$lib"): ${elf:-none}"
  fi
fi

# The later stages' builds run in the background, at nice 19, while stage 1's
# programs run (ninja is never run twice at once on one build folder).
status2=$log/build-2.status
status3=$log/build-3.status
rm -f "$status2" "$status3"
start_background_builds() {
  (
    set +e
    nice -n 19 cmake --build "$build" -j "$jobs" --target fashion_mnist train_bench >"$log/build-2.log" 2>&1
    echo $? >"$status2"
    if ((${#torch_targets[@]})); then
      nice -n 19 cmake --build "$build" -j "$jobs" --target "${torch_targets[@]}" >"$log/build-3.log" 2>&1
      echo $? >"$status3"
    fi
  ) &
  bg_pid=$!
}
# Waits (within the budget) for a background build's status; prints its rc,
# 124 when the budget ran out first.
wait_build() {  # status-file
  while [[ ! -e $1 ]]; do
    (( $(left) < 15 )) && { echo 124; return; }
    sleep 2
  done
  cat "$1"
}
set -m  # the background builds get their own process group (killed on exit)
start_background_builds
set +m

lease_dir=$(mktemp -d /tmp/diststrat-gpu-leases.XXXXXX)
export DISTSTRAT_GPU_LEASE_DIR=$lease_dir
# Single node: NCCL must not need a usable network interface (a VM may have
# none but lo), and its warnings are worth seeing.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

step="libraries resolve"
gpu_tests=$build/tests/gpu/diststrat_gpu_tests
if ((stage1_ok)); then
  missing=$(ldd "$gpu_tests" 2>&1 | grep "not found" || true)
  if [[ -n $missing ]]; then
    row "$step" "FAILED" "unresolved: $(echo $missing)"
    stage1_ok=0
  else
    ldd "$gpu_tests" | grep -E "libnccl|libcublas\.|libcudart" | sed 's/^\s*/gpu-check:   /'
    row "$step" "ok" "$(ldd "$gpu_tests" | grep -c "libcudart") cudart"
  fi
fi

# ---- GPU tests ----
if ((!stage1_ok)); then
  row "GPU tests" "$not_built" "stage 1 not built"
  row "gpu_bench" "$not_built" "stage 1 not built"
else
  say "running the GPU tests ($(clock))"
  limited 240 30 "$gpu_tests" >"$log/tests.log" 2>&1
  tests_rc=$?
  if ((tests_rc == 125)); then
    row "GPU tests" "skipped (time)"
  else
    passed=$(gtest_count "$log/tests.log" PASSED)
    failed=$(gtest_count "$log/tests.log" FAILED)
    skipped=$(gtest_count "$log/tests.log" SKIPPED)
    if ((dry_run)); then
      # No GPU here: every GPU test skips, the GPU-less error tests pass.
      if ((tests_rc == 0)); then row "GPU test binary runs (no GPU here)" "ok" "$passed passed, $skipped skipped"
      else row "GPU test binary runs (no GPU here)" "FAILED" "rc=$tests_rc, see $log/tests.log"; fi
    else
      grep -E '^\[  (FAILED|SKIPPED) \] [A-Z]' "$log/tests.log" | grep -v ' ms)$' | sed 's/^/gpu-check: /'
      # Only the multi-GPU tests may skip (one GPU); any other skip means the
      # CUDA runtime could not use the GPU (driver too old for this nvcc, ...).
      unexpected_skips=$(grep -E '^\[  SKIPPED \] [A-Z]' "$log/tests.log" | grep -v ' ms)$' |
        grep -vcE 'WhenThereAreSeveral|SeveralGpus|TwoGpus')
      if ((unexpected_skips > 0)); then
        say "GPU tests were skipped; the reason:"
        grep -m1 -A1 'Skipped$' "$log/tests.log" | tail -1 | sed 's/^/gpu-check:   /'
      fi
      if ((tests_rc == 124)); then
        row "GPU tests passed / failed / skipped" "FAILED" "timed out at $(clock): $passed / $failed / $skipped so far"
      elif ((tests_rc == 0 && failed == 0 && passed > 0 && unexpected_skips == 0)); then
        row "GPU tests passed / failed / skipped" "ok" "$passed / $failed / $skipped"
      else
        row "GPU tests passed / failed / skipped" "FAILED" "$passed / $failed / $skipped, rc=$tests_rc"
      fi
    fi
    suite_rows "$log/tests.log"
  fi

  # ---- GPU benchmark, and its bars ----
  if ((dry_run)); then
    row "gpu_bench" "skipped" "dry run: built"
    pytorch_mlp_run
    pytorch_mlp_rows ""
  else
    say "running the GPU benchmark ($(clock))"
    quick=""
    (( $(left) < 300 )) && quick=--quick
    # Its CPU rows are the bar's reference: the background builds are
    # stopped meanwhile (SIGSTOP to their process group), so that they do
    # not share the cores with it (runs 1-3 on the H200 read the -march=native
    # core at 10.2, 7.2 and 5.0 ms with them running).
    [[ -n $bg_pid ]] && kill -STOP -- "-$bg_pid" 2>/dev/null
    limited 150 40 "$build/benchmarks/gpu_bench" $quick >"$log/bench.log" 2>&1
    bench_rc=$?
    pytorch_mlp_run  # the same step in PyTorch, on the same quiet cores
    [[ -n $bg_pid ]] && kill -CONT -- "-$bg_pid" 2>/dev/null
    grep -v '^result ' "$log/bench.log"
    r() { grep -oE "^result $1=[^ ]+" "$log/bench.log" | cut -d= -f2; }
    bar() {  # label value op threshold detail
      local verdict
      if [[ -z $2 ]]; then row "$1" "FAILED" "no value"; return; fi
      if awk -v v="$2" -v t="$4" -v op="$3" 'BEGIN { exit !((op == ">=") ? v >= t : v <= t) }'; then
        verdict=ok; else verdict=FAILED; fi
      row "$1" "$verdict" "$5"
    }
    if ((bench_rc == 125)); then
      row "gpu_bench" "skipped (time)"
    elif ((bench_rc == 0)); then
      row "gpu_bench" "ok" "NCCL $(r nccl_version) at run time${quick:+, $quick}"
      row "  MLP step on GPU (batch 512)" "info" "$(r mlp_gpu_step_ms) ms, $(r mlp_gpu_samples_per_s) samples/s"
      row "  MLP step, library on 1 CPU core" "info" "$(r mlp_cpu_step_ms) ms (GPU $(r mlp_speedup)x)"
      bar "  bar: GPU MLP step >= 10x a -march=native core" "$(r mlp_speedup_native)" ">=" 10 \
        "$(r mlp_native_step_ms) ms on the core: GPU $(r mlp_speedup_native)x"
      row "  logical-GPU all-reduce 256 MiB (2 on 1 GPU)" "info" \
        "$(r logical_allreduce_256MiB_algbw_GBs) GB/s algbw; D2D copy $(r d2d_copy_256MiB_GBs) GB/s"
      bar "  bar: all-reduce traffic >= 0.7 of D2D copy" "$(r logical_allreduce_traffic_vs_copy)" ">=" 0.7 \
        "$(r logical_allreduce_traffic_vs_copy) of the copy's bandwidth"
      row "  NCCL, 1 rank, 256 MiB (a local copy)" "info" "$(r nccl_1gpu_256MiB_algbw_GBs) GB/s: no collective with one GPU"
    else
      row "gpu_bench" "FAILED" "rc=$bench_rc, see $log/bench.log"
    fi
    pytorch_mlp_rows "$( ((bench_rc == 0)) && r mlp_gpu_step_ms)"
  fi
fi

# ---- 2. the examples on logical GPUs, against a CPU run ------------------------------
cpu_accuracy=""
run_case() {  # label logfile want-seconds bar(accuracy|none) command...
  local label=$1 logf=$log/$2 want=$3 bar=$4 rc acc sps
  shift 4
  say "$label ($(clock))"
  limited "$want" 20 "$@" >"$logf" 2>&1
  rc=$?
  if ((rc == 125)); then row "$label" "skipped (time)"; return; fi
  if ((rc != 0)); then
    tail -5 "$logf" | sed 's/^/gpu-check:   /'
    row "$label" "FAILED" "rc=$rc$( ((rc == 124)) && echo ' (timed out)'), see $logf"
    return
  fi
  acc=$(final_of "$logf" test_accuracy)
  sps=$(final_of "$logf" samples_per_sec)
  if [[ $bar == accuracy && -n $cpu_accuracy ]]; then
    if [[ -n $acc ]] && awk -v a="$acc" -v c="$cpu_accuracy" 'BEGIN { exit !(a >= c - 0.01) }'; then
      row "$label" "ok" "test_accuracy=$acc >= CPU $cpu_accuracy - 0.01; samples_per_sec=$sps"
    else
      row "$label" "FAILED" "test_accuracy=${acc:-none} < CPU $cpu_accuracy - 0.01"
    fi
  else
    row "$label" "ok" "${acc:+test_accuracy=$acc }${sps:+samples_per_sec=$sps}"
  fi
}
# The row of a background build (stages 2 and 3 need the library, not the GPU
# tests: they run whatever stage 1 gave); succeeds when it built.
background_build_row() {  # label status-file log-file [detail]
  local rc
  rc=$(wait_build "$2")
  if ((rc == 124)); then row "$1" "skipped (time)"; return 1; fi
  if ((rc != 0)); then
    grep -E "error|Error" "$3" | head -20
    row "$1" "FAILED" "see $3"
    return 1
  fi
  row "$1" "ok" "${4:-}"
}
if background_build_row "build 2: fashion_mnist, train_bench" "$status2" "$log/build-2.log"; then
  if ((dry_run)); then
    row "fashion_mnist / train_bench on GPUs" "skipped" "dry run: built"
  else
    fm=("$build/examples/fashion_mnist" --epochs 1 --data "$deps/fashion-mnist")
    tb=("$build/benchmarks/train_bench" --device gpu --steps 100 --warmup 10 --data "$deps/fashion-mnist")
    run_case "fashion_mnist mirrored, 2 replicas on the CPU" "fm_cpu.log" 60 none \
      "${fm[@]}" --device cpu --strategy mirrored --replicas 2
    cpu_accuracy=$(final_of "$log/fm_cpu.log" test_accuracy)
    for n in 2 4; do
      run_case "fashion_mnist mirrored, $n logical GPUs" "fm_mirrored_$n.log" 60 accuracy \
        "${fm[@]}" --device gpu --strategy mirrored --replicas $n --split-gpus $n
      run_case "train_bench mirrored, $n logical GPUs" "tb_mirrored_$n.log" 60 none \
        "${tb[@]}" --strategy mirrored --replicas $n --split-gpus $n
    done
    run_case "fashion_mnist central_storage, 2 logical GPUs" "fm_central.log" 60 accuracy \
      "${fm[@]}" --device gpu --strategy central_storage --replicas 2 --split-gpus 2
    run_case "train_bench central_storage, 2 logical GPUs" "tb_central.log" 60 none \
      "${tb[@]}" --strategy central_storage --replicas 2 --split-gpus 2
  fi
fi

# ---- 3. LibTorch ------------------------------------------------------------------------
# torch_fashion_mnist --device gpu. It exits 2 with one line naming why it
# cannot run: "this LibTorch has no CUDA ..." (a CPU-only LibTorch such as
# Debian's, or no GPU visible to it) or "not supported by diststrat::libtorch
# yet: ..." (docs/torch.md). Both are a skip with that reason, not a failure;
# any other outcome but success is. Its accuracy is held to the CPU run's.
torch_gpu_row() {  # binary
  local label="torch_fashion_mnist --device gpu" logf=$log/torch_fashion_mnist.log reason rc acc
  local cpu_acc="" cpu_loss="" loss acc2 loss2 rc2
  # Two DDP replicas on two logical GPUs of GPU 0, against the same on the
  # CPU, with LibTorch's deterministic kernels: cuDNN's default convolution
  # backward is not, and two plain GPU runs of this CNN read test_accuracy
  # 0.8271 and 0.8162 (train_loss 0.6918 and 0.6915) against the CPU's 0.8310
  # (0.6964) on the first H200 runs. Deterministic, two GPU runs must end
  # alike (a race in the GPU path would show as a difference); the CPU is
  # the reference within 0.02 (float rounding over one epoch moves the
  # end point that much).
  local common=(--strategy mirrored --replicas 2 --epochs 1 --deterministic --data "$deps/fashion-mnist")
  if ((!dry_run)); then
    limited 90 20 "$1" --device cpu "${common[@]}" >"$log/torch_fashion_mnist_cpu.log" 2>&1 &&
      cpu_acc=$(final_of "$log/torch_fashion_mnist_cpu.log" test_accuracy) &&
      cpu_loss=$(final_of "$log/torch_fashion_mnist_cpu.log" train_loss)
  fi
  limited 120 20 "$1" --device gpu --logical-gpus "${common[@]}" >"$logf" 2>&1
  rc=$?
  reason=$(grep -m1 -e '--device gpu: ' "$logf" | sed 's/^.*--device gpu: //')
  acc=$(final_of "$logf" test_accuracy)
  loss=$(final_of "$logf" train_loss)
  if ((rc == 125)); then
    row "$label" "skipped (time)"
  elif ((rc == 0)); then
    limited 120 20 "$1" --device gpu --logical-gpus "${common[@]}" >"$log/torch_fashion_mnist_2.log" 2>&1
    rc2=$?
    acc2=$(final_of "$log/torch_fashion_mnist_2.log" test_accuracy)
    loss2=$(final_of "$log/torch_fashion_mnist_2.log" train_loss)
    local got="test_accuracy=$acc train_loss=$loss; again: $acc2 $loss2; CPU: ${cpu_acc:-none} ${cpu_loss:-none}"
    if ((rc2 == 125)); then
      row "$label" "skipped (time)" "the second GPU run did not fit; $got"
    elif ((rc2 != 0)) || [[ $acc != "$acc2" || $loss != "$loss2" ]]; then
      row "$label" "FAILED" "two deterministic GPU runs differ (rc $rc2): $got"
    elif [[ -n $cpu_acc ]] && ! awk -v a="${acc:-0}" -v c="$cpu_acc" 'BEGIN { exit !(a >= c - 0.02) }'; then
      row "$label" "FAILED" "test_accuracy below CPU - 0.02: $got"
    else
      row "$label" "ok" "two GPU runs alike, within CPU - 0.02: $got"
    fi
  elif ((rc == 2)) && [[ $reason == "this LibTorch has no CUDA"* ]]; then
    row "$label" "skipped" "LibTorch without CUDA: $reason"
  elif ((rc == 2)) && [[ $reason == "not supported by diststrat::libtorch yet"* ]]; then
    row "$label" "skipped" "$reason"
  else
    tail -5 "$logf" | sed 's/^/gpu-check:   /'
    row "$label" "FAILED" "rc=$rc, see $logf"
  fi
}
torch_tests_row() {  # binary label logfile
  local rc lf=$log/$3
  say "running $(basename "$1") ($(clock))"
  limited 180 30 "$1" >"$lf" 2>&1
  rc=$?
  if ((rc == 125)); then row "$2" "skipped (time)"; return; fi
  if ((rc == 0)); then row "$2" "ok" "$(gtest_count "$lf" PASSED) passed, $(gtest_count "$lf" SKIPPED) skipped"
  else row "$2" "FAILED" "rc=$rc, see $lf"; fi
  suite_rows "$lf"
}
# Both LibTorch test binaries of build folder $1: the CPU ones, then the
# CUDA-module ones (label gpu: they skip, with the reason, on a LibTorch
# without CUDA).
torch_test_rows() {  # build-dir which-libtorch
  local d=$1/tests/torch
  if [[ -x $d/diststrat_torch_tests ]]; then torch_tests_row "$d/diststrat_torch_tests" "LibTorch tests ($2)" torch_tests.log
  else row "LibTorch tests ($2)" "FAILED" "diststrat_torch_tests not built"; fi
  if [[ -x $d/diststrat_torch_gpu_tests ]]; then
    torch_tests_row "$d/diststrat_torch_gpu_tests" "LibTorch CUDA-module tests ($2)" torch_gpu_tests.log
  else row "LibTorch CUDA-module tests ($2)" "FAILED" "diststrat_torch_gpu_tests not built"; fi
}

# The sources against a LibTorch 2.x's headers (the GPU machine's version),
# whatever LibTorch this machine has.
if [[ -z $torch2 ]]; then
  row "LibTorch 2.x syntax check" "skipped" "no LibTorch 2.x headers given (--torch2 DIR)"
elif [[ ! -d $torch2/include/torch || ! -d $torch2/share/cmake ]]; then
  row "LibTorch 2.x syntax check" "FAILED" "$torch2 has no include/torch and share/cmake"
else
  say "LibTorch 2.x syntax check against $torch2 ($(clock))"
  JOBS=$jobs limited 900 30 "$root/scripts/torch-syntax-check.sh" "$torch2" >"$log/torch2-syntax.log" 2>&1
  rc=$?
  summary=$(grep -m1 '^torch-syntax-check: .* ok against' "$log/torch2-syntax.log" || tail -1 "$log/torch2-syntax.log")
  if ((rc == 125)); then row "LibTorch 2.x syntax check" "skipped (time)"
  elif ((rc == 0)); then row "LibTorch 2.x syntax check" "ok" "${summary#torch-syntax-check: }"
  else
    grep -E 'FAILED|error' "$log/torch2-syntax.log" | head -10 | sed 's/^/gpu-check:   /'
    row "LibTorch 2.x syntax check" "FAILED" "see $log/torch2-syntax.log"
  fi
fi

if ((dry_run)); then
  # A CUDA LibTorch's CMake in the same configure must not change what the
  # kernels are built for: a stand-in TorchConfig.cmake that does to the
  # caller's scope what PyTorch's does (tests/gpu/cuda_torch_config/).
  say "CUDA flags under a CUDA LibTorch's CMake ($(clock))"
  if ! time_for 60; then
    row "CUDA kernels under a CUDA LibTorch's CMake" "skipped (time)"
  elif configure "$build/cuda-torch-flags" "$root/tests/gpu/cuda_torch_config" \
       -DDISTSTRAT_WITH_TORCH=ON -DDISTSTRAT_BUILD_TESTS=OFF -DDISTSTRAT_BUILD_EXAMPLES=OFF \
       >"$log/configure-cuda-torch-flags.log" 2>&1; then
    arch_row "CUDA kernels under a CUDA LibTorch's CMake" "$build/cuda-torch-flags"
  else
    row "CUDA kernels under a CUDA LibTorch's CMake" "FAILED" "configure, see $log/configure-cuda-torch-flags.log"
  fi
fi

torch_example=""  # torch_fashion_mnist with CUDA, for the PyTorch row below
if [[ -n $torch_configure_failed ]]; then
  row "LibTorch" "FAILED" "$torch_configure_failed"
elif ((${#torch_targets[@]})); then
  if background_build_row "build 3: diststrat::torch" "$status3" "$log/build-3.log" "${torch_targets[*]}"; then
    torch_test_rows "$build" "this machine's LibTorch"
    te=$build/examples/torch_fashion_mnist
    [[ -x $te ]] && { torch_gpu_row "$te"; torch_example=$te; }
  fi
elif [[ -n $debian_torch ]]; then
  # Dry run with Debian's CPU LibTorch: configure, build and run what needs no GPU.
  tb=$build/torch-dry-run
  say "LibTorch, dry run: Debian's CPU LibTorch in $tb ($(clock))"
  if ! time_for 120; then
    row "LibTorch build (Debian's CPU LibTorch)" "skipped (time)"
  elif cmake -S "$root" -B "$tb" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDISTSTRAT_WITH_TORCH=ON \
       -DDISTSTRAT_WITH_CUDA=OFF -DDISTSTRAT_WITH_MPI=OFF -DDISTSTRAT_WITH_GLOO=OFF \
       -DDISTSTRAT_BUILD_BENCHMARKS=OFF -DCMAKE_PREFIX_PATH="$prefix;$debian_torch" \
       -DEigen3_DIR="$cfg/Eigen3" -Dnlohmann_json_DIR="$cfg/nlohmann_json" -DCLI11_DIR="$cfg/CLI11" \
       >"$log/configure-torch-dry-run.log" 2>&1 &&
     { limited 3600 60 cmake --build "$tb" -j "$jobs" --target diststrat_torch diststrat_torch_tests \
           diststrat_torch_gpu_tests torch_fashion_mnist \
         >"$log/build-torch-dry-run.log" 2>&1; rc=$?; ((rc == 0 || rc == 124 || rc == 125)); }; then
    if ((rc != 0)); then
      row "LibTorch build (Debian's CPU LibTorch)" "skipped (time)"
    else
      torch_test_rows "$tb" "Debian's CPU LibTorch"
      torch_gpu_row "$tb/examples/torch_fashion_mnist"
    fi
  else
    row "LibTorch build (Debian's CPU LibTorch)" "FAILED" "see $log/{configure,build}-torch-dry-run.log"
  fi
else
  row "LibTorch" "skipped" "no LibTorch on this machine"
fi
# torch_fashion_mnist on one GPU against a plain Python PyTorch loop.
pytorch_fm_rows "$torch_example" "$deps/fashion-mnist"

finish
