#!/usr/bin/env bash
# From a fresh machine: install dependencies, build (Release) and train the
# Fashion-MNIST example with its defaults. Extra arguments go to the example,
# e.g. scripts/run.sh --replicas 1 --epochs 1
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
build=${DISTSTRAT_BUILD_DIR:-$root/build}
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" --target fashion_mnist
"$build/examples/fashion_mnist" "$@"
