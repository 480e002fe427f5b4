#!/usr/bin/env bash
# Fills the git-ignored .deps/ folder that scripts/gpu-check.sh needs on a GPU
# machine without apt or network, from this (Debian) machine's packages:
#   .deps/eigen3      <- /usr/include/eigen3            (libeigen3-dev)
#   .deps/googletest  <- /usr/src/googletest            (googletest sources)
#   .deps/nlohmann    <- /usr/include/nlohmann          (nlohmann-json3-dev)
#   .deps/CLI         <- /usr/include/CLI               (libcli11-dev)
#   .deps/zlib        <- zlib.h, zconf.h, libz.so.1     (zlib1g-dev; the library is a
#                        fallback: gpu-check.sh prefers the GPU machine's own libz)
# About 16 MiB. Pass .deps in the device tool's `carry` list.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.deps
rm -rf "$out"
mkdir -p "$out/zlib"
cp -r /usr/include/eigen3 "$out/eigen3"
cp -r /usr/src/googletest "$out/googletest"
cp -r /usr/include/nlohmann "$out/nlohmann"
cp -r /usr/include/CLI "$out/CLI"
cp /usr/include/zlib.h /usr/include/zconf.h "$out/zlib/"
cp -L /usr/lib/x86_64-linux-gnu/libz.so.1 "$out/zlib/libz.so.1"
du -sh "$out"
echo "gpu-deps: filled $out"
