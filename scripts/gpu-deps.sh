#!/usr/bin/env bash
# Fills the git-ignored .deps/ folder that scripts/gpu-check.sh needs on a GPU
# machine without apt or network, from this (Debian) machine's packages. What
# a GPU build needs and where it comes from there:
#   CUDA (nvcc, cudart), CMake, ninja, g++, python3, libz.so.1   the GPU machine
#   NCCL, cuBLAS                 the GPU machine's Python wheels (nvidia/nccl,
#                                nvidia/cu13), or its CUDA toolkit
#   .deps/eigen3      <- /usr/include/eigen3            (libeigen3-dev, headers)
#   .deps/googletest  <- /usr/src/googletest            (googletest sources; built there)
#   .deps/nlohmann    <- /usr/include/nlohmann          (nlohmann-json3-dev, headers)
#   .deps/CLI         <- /usr/include/CLI               (libcli11-dev, headers)
#   .deps/dlpack/include/dlpack <- /usr/include/dlpack (libdlpack-dev, one header;
#                        gpu-check.sh passes DLPACK_ROOT=.deps/dlpack)
#   .deps/zlib        <- zlib.h, zconf.h, libz.so.1     (zlib1g-dev; the library is a
#                        fallback: gpu-check.sh prefers the GPU machine's own libz)
#   .deps/fashion-mnist <- the test set and the first 12000 training rows of
#                        /usr/share/datasets/fashion-mnist (for the example runs)
# MPI, Gloo and Google Benchmark are not needed (the GPU build turns them off).
# About 24 MiB. Pass .deps in the device tool's `carry` list.
# gpu-check.sh --torch2 DIR compiles diststrat::torch against a LibTorch 2.x's
# headers: unpack them outside the repository (never into .deps: CI and the
# device carry do not need 60 MiB of headers).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.deps
data=${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
# Only what this script fills: .deps/python (scripts/setup.sh's pip packages)
# and anything else there stays.
for d in eigen3 googletest nlohmann CLI dlpack zlib fashion-mnist; do rm -rf "${out:?}/$d"; done
mkdir -p "$out/zlib" "$out/fashion-mnist"
cp -r /usr/include/eigen3 "$out/eigen3"
cp -r /usr/src/googletest "$out/googletest"
cp -r /usr/include/nlohmann "$out/nlohmann"
cp -r /usr/include/CLI "$out/CLI"
mkdir -p "$out/dlpack/include"
cp -r /usr/include/dlpack "$out/dlpack/include/dlpack"
cp /usr/include/zlib.h /usr/include/zconf.h "$out/zlib/"
cp -L /usr/lib/x86_64-linux-gnu/libz.so.1 "$out/zlib/libz.so.1"
cp "$data"/t10k-images-idx3-ubyte.gz "$data"/t10k-labels-idx1-ubyte.gz "$out/fashion-mnist/"
# The first 12000 training rows, as valid IDX files (the count in the header).
python3 - "$data" "$out/fashion-mnist" 12000 <<'PY'
import gzip, struct, sys
src, dst, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
for name, item in (("train-images-idx3-ubyte.gz", 28 * 28), ("train-labels-idx1-ubyte.gz", 1)):
    with gzip.open(f"{src}/{name}") as f:
        data = f.read()
    header = 16 if item > 1 else 8
    n = struct.unpack(">I", data[4:8])[0]
    keep = min(rows, n)
    body = data[header:header + keep * item]
    with gzip.open(f"{dst}/{name}", "wb", compresslevel=6) as f:
        f.write(data[:4] + struct.pack(">I", keep) + data[8:header] + body)
PY
du -sh "$out"
echo "gpu-deps: filled $out"
