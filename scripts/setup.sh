#!/usr/bin/env bash
# Installs every Debian package that the build, the tests, the examples and the
# benchmarks need. Idempotent: packages already present are skipped, and apt is
# only consulted when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git clang-format
  libeigen3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libcli11-dev
  openmpi-bin libopenmpi-dev
  libgloo-dev
  slurmctld slurmd slurm-client munge
  libhiredis-dev redis-server
  zlib1g-dev
  libdlpack-dev
  libtorch-dev python3-torch
  dataset-fashion-mnist
  python3 python3-matplotlib python3-yaml python3-numpy python3-pip
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "setup: all ${#packages[@]} packages already installed"
else
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  echo "setup: done"
fi

# Python's safetensors (not packaged by Debian) for the checkpoint interop test,
# installed with pip into the ignored .deps/python. Optional: without it (no
# network) that one test reports itself skipped.
root=$(cd "$(dirname "$0")/.." && pwd)
pydeps="$root/.deps/python"
if ! PYTHONPATH="$pydeps" /usr/bin/python3 -c 'import safetensors.numpy' 2>/dev/null; then
  if /usr/bin/python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
       --target "$pydeps" safetensors 2>/dev/null; then
    echo "setup: installed Python safetensors into $pydeps"
  else
    echo "setup: could not pip-install Python safetensors; the interop test will be skipped"
  fi
fi
