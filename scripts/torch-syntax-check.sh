#!/usr/bin/env bash
# Compiles every translation unit of diststrat::torch (src/torch/*.cc), of
# its tests (tests/torch/*.cc) and of the LibTorch examples
# (examples/torch_*/*.cc) with `g++ -fsyntax-only` against another
# LibTorch's headers, without building or linking anything: the proof that one
# source builds against Debian's LibTorch 1.13 (the real build here) and the
# GPU machine's LibTorch 2.x (headers only, e.g. from its wheel).
#
#   scripts/torch-syntax-check.sh TORCH_ROOT
#
# TORCH_ROOT holds include/ and share/cmake/ (a LibTorch, or the torch/ folder
# of a PyTorch wheel). Prints one line per translation unit (ok / FAILED, with
# the first errors) and, last, `torch-syntax-check: N of M translation units ok
# against LibTorch X.Y.Z`. Exit status: 0 all ok, 1 a failure, 2 usage.
#
# What it gives the compiler, as the real build would:
#   - the C++ standard the headers need: C++17, or C++20 when a probe that
#     includes <torch/torch.h> fails at C++17 and passes at C++20;
#   - the headers' own include dirs (include/, include/torch/csrc/api/include);
#   - the compile definitions of LibTorch's CMake targets (the literal
#     INTERFACE_COMPILE_DEFINITIONS of share/cmake/Caffe2/Caffe2Targets.cmake)
#     and of this project's targets (-D_GLIBCXX_USE_CXX11_ABI=1, DISTSTRAT_SOURCE_DIR);
#   - the project's include/ and src/, and a generated diststrat/config.h as a
#     build of the GPU machine has it (CUDA, cuBLAS, NCCL on; DLPack on when
#     its header is found), written to a temporary folder;
#   - the CUDA headers (CUDA_HOME, default /usr/local/cuda) when present, for
#     the c10/cuda headers the CUDA paths include; DLPack from DLPACK_INCLUDE_DIR
#     or /usr/include; GoogleTest and CLI11 from GTEST_INCLUDE_DIR /
#     CLI11_INCLUDE_DIR, .deps or /usr/include.
# A LibTorch header missing from TORCH_ROOT would be found in /usr/include
# (Debian's LibTorch lives there) and hide the failure: every TU is compiled
# with -H and fails when any header came from a LibTorch outside TORCH_ROOT.
#
# Environment: CXX (default g++), JOBS (parallel compiles, default 2),
# CUDA_HOME, DLPACK_INCLUDE_DIR, GTEST_INCLUDE_DIR, CLI11_INCLUDE_DIR.
set -uo pipefail

usage() {
  echo "usage: $0 TORCH_ROOT   (a folder holding include/torch and share/cmake)" >&2
  exit 2
}
[[ $# -eq 1 ]] || usage
case "$1" in -h | --help) usage ;; esac
torch_root=$(cd "$1" 2>/dev/null && pwd) || {
  echo "torch-syntax-check: '$1' is not a folder" >&2
  usage
}
tinc="$torch_root/include"
[[ -f "$tinc/torch/csrc/api/include/torch/torch.h" ]] || {
  echo "torch-syntax-check: no include/torch/csrc/api/include/torch/torch.h under '$torch_root'" >&2
  usage
}
cd "$(dirname "$0")/.."
root=$(pwd)
cxx=${CXX:-g++}
jobs=${JOBS:-2}

# The version: torch/version.h (2.x keeps it in torch/headeronly/version.h),
# else share/cmake/Torch/TorchConfigVersion.cmake.
version=""
for vh in "$tinc/torch/headeronly/version.h" "$tinc/torch/csrc/api/include/torch/version.h"; do
  [[ -f "$vh" ]] || continue
  maj=$(sed -n 's/^#define TORCH_VERSION_MAJOR \([0-9]*\).*/\1/p' "$vh")
  min=$(sed -n 's/^#define TORCH_VERSION_MINOR \([0-9]*\).*/\1/p' "$vh")
  pat=$(sed -n 's/^#define TORCH_VERSION_PATCH \([0-9]*\).*/\1/p' "$vh")
  if [[ -n "$maj" && -n "$min" && -n "$pat" ]]; then
    version="$maj.$min.$pat"
    break
  fi
done
if [[ -z "$version" && -f "$torch_root/share/cmake/Torch/TorchConfigVersion.cmake" ]]; then
  version=$(sed -n 's/^set(PACKAGE_VERSION "\([^"]*\)").*/\1/p' \
    "$torch_root/share/cmake/Torch/TorchConfigVersion.cmake" | head -1)
fi
version=${version:-unknown}

tmp=$(mktemp -d /tmp/torch-syntax-check.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# diststrat/config.h as a CUDA build generates it from config.h.in.
proj_version=$(sed -n 's/^project(diststrat VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
cuda_home=${CUDA_HOME:-/usr/local/cuda}
dlpack_dir=${DLPACK_INCLUDE_DIR:-}
if [[ -z "$dlpack_dir" ]]; then
  for d in "$root/.deps/include" /usr/local/include /usr/include; do
    [[ -f "$d/dlpack/dlpack.h" ]] && { dlpack_dir=$d; break; }
  done
fi
have_dlpack=0
[[ -n "$dlpack_dir" && -f "$dlpack_dir/dlpack/dlpack.h" ]] && have_dlpack=1
mkdir -p "$tmp/gen/diststrat"
sed -e "s/@PROJECT_VERSION@/${proj_version:-0.0.0}/" \
  -e 's/^#cmakedefine01 \(DISTSTRAT_HAVE_\(CUDA\|CUBLAS\|NCCL\)\)$/#define \1 1/' \
  -e "s/^#cmakedefine01 \(DISTSTRAT_HAVE_DLPACK\)$/#define \1 $have_dlpack/" \
  -e 's/^#cmakedefine01 \(.*\)$/#define \1 0/' \
  include/diststrat/config.h.in >"$tmp/gen/diststrat/config.h"

# The headers that live next to /usr/include's other headers (DLPack,
# GoogleTest) come through a folder of links, so that /usr/include itself is
# never an -I ahead of TORCH_ROOT.
mkdir -p "$tmp/extra"
[[ $have_dlpack == 1 ]] && ln -s "$dlpack_dir/dlpack" "$tmp/extra/dlpack"
gtest_dir=${GTEST_INCLUDE_DIR:-}
if [[ -z "$gtest_dir" ]]; then
  for d in "$root/.deps/include" "$root"/.deps/googletest*/googletest/include /usr/local/include /usr/include; do
    [[ -f "$d/gtest/gtest.h" ]] && { gtest_dir=$d; break; }
  done
fi
# CLI11 (examples/torch_*): CLI11_INCLUDE_DIR, .deps or /usr/include.
cli_dir=${CLI11_INCLUDE_DIR:-}
if [[ -z "$cli_dir" ]]; then
  for d in "$root/.deps/include" /usr/local/include /usr/include; do
    [[ -f "$d/CLI/CLI.hpp" ]] && { cli_dir=$d; break; }
  done
fi
[[ -n "$cli_dir" ]] && ln -s "$cli_dir/CLI" "$tmp/extra/CLI"
if [[ -n "$gtest_dir" ]]; then
  ln -s "$gtest_dir/gtest" "$tmp/extra/gtest"
  [[ -d "$gtest_dir/gmock" ]] && ln -s "$gtest_dir/gmock" "$tmp/extra/gmock"
fi

# LibTorch's own compile definitions (its imported targets').
defs=()
targets="$torch_root/share/cmake/Caffe2/Caffe2Targets.cmake"
if [[ -f "$targets" ]]; then
  while read -r d; do
    [[ -n "$d" ]] && defs+=("-D$d")
  done < <(sed -n 's/^ *INTERFACE_COMPILE_DEFINITIONS "\([^"$]*\)"$/\1/p' "$targets" | tr ';' '\n' | sort -u)
fi

flags=(-fsyntax-only -H -D_GLIBCXX_USE_CXX11_ABI=1 "${defs[@]}"
  -I"$root/include" -I"$tmp/gen" -I"$root/src"
  -isystem "$tinc" -isystem "$tinc/torch/csrc/api/include" -isystem "$tmp/extra")
[[ -f "$cuda_home/include/cuda_runtime_api.h" ]] && flags+=(-isystem "$cuda_home/include")

# The standard: C++17 unless the headers refuse it and take C++20.
printf '#include <torch/torch.h>\nint main() { return 0; }\n' >"$tmp/probe.cc"
std=""
for s in c++17 c++20; do
  if "$cxx" -std=$s "${flags[@]}" "$tmp/probe.cc" >"$tmp/probe.$s.log" 2>&1; then
    std=$s
    break
  fi
done
if [[ -z "$std" ]]; then
  echo "torch-syntax-check: <torch/torch.h> alone does not compile at C++17 or C++20 against '$tinc':" >&2
  grep -v '^\.' "$tmp/probe.c++17.log" | head -20 >&2
  echo "torch-syntax-check: 0 of 0 translation units ok against LibTorch $version"
  exit 1
fi
echo "torch-syntax-check: LibTorch $version at $torch_root, -std=$std, ${#defs[@]} LibTorch definitions, CUDA headers: $([[ -f "$cuda_home/include/cuda_runtime_api.h" ]] && echo "$cuda_home/include" || echo none), DLPack: $have_dlpack"

tus=()
for f in src/torch/*.cc tests/torch/*.cc examples/torch_*/*.cc; do [[ -f "$f" ]] && tus+=("$f"); done

# One TU: compile, then check where its LibTorch headers came from.
check_one() {
  local tu=$1 log
  log="$tmp/$(echo "$tu" | tr '/' '_').log"
  local extra=(-Wall -Wextra -Wno-unused-parameter)
  # The torch tests' targets add tests/ (the fake GPU backend) to the include path.
  [[ $tu == tests/* ]] && extra=(-I"$root/tests" -DGTEST_HAS_PTHREAD=1 "-DDISTSTRAT_SOURCE_DIR=\"$root\"")
  local t0=$SECONDS rc=0
  "$cxx" -std="$std" "${flags[@]}" "${extra[@]}" "$tu" >"$log" 2>&1 || rc=$?
  # -H lists headers as lines of dots and a path; a LibTorch header from
  # anywhere but TORCH_ROOT means the check tested the wrong LibTorch.
  local stray
  stray=$(grep -E '^\.+ /' "$log" | sed 's/^\.* //' |
    grep -E '/(torch|ATen|c10|caffe2)/' | grep -v -F "$tinc/" | grep -v -F "$root/" | head -3)
  # Whether the TU compiled the CUDA paths (src/torch/torch_compat.h includes
  # c10/cuda only in a CUDA LibTorch with the CUDA headers at hand).
  local cuda=""
  grep -qE '^\.+ .*/c10/cuda/CUDAStream\.h$' "$log" && cuda=", CUDA paths"
  if [[ $rc -eq 0 && -z "$stray" ]]; then
    echo "ok      $tu ($((SECONDS - t0)) s$cuda)"
  elif [[ $rc -eq 0 ]]; then
    echo "FAILED  $tu: LibTorch headers from outside $torch_root: $(echo "$stray" | tr '\n' ' ')"
  else
    echo "FAILED  $tu ($((SECONDS - t0)) s):"
    grep -v -E '^\.+ |^Multiple include guards|^/.*\.h$' "$log" | grep -E ': (fatal )?error: |required from here' |
      head -8 | sed 's/^/          /'
  fi
}
export -f check_one
export tmp std tinc root cxx torch_root
# Arrays do not cross `export`; pass them through a file of NUL-separated words.
printf '%s\0' "${flags[@]}" >"$tmp/flags"
check_wrapper() {
  local -a flags
  mapfile -d '' flags <"$tmp/flags"
  check_one "$1"
}
export -f check_wrapper
printf '%s\n' "${tus[@]}" | xargs -P "$jobs" -I{} bash -c 'check_wrapper "$1"' _ {} | tee "$tmp/results"

n=${#tus[@]}
ok=$(grep -c '^ok ' "$tmp/results" || true)
echo "torch-syntax-check: $ok of $n translation units ok against LibTorch $version"
[[ $ok -eq $n ]] || exit 1
exit 0
