#!/usr/bin/env bash
# torch_fashion_mnist --device gpu where it cannot run: exit status 2 at once
# (before any set-up, so under mpirun every rank says the same), one line on
# stderr naming the reason, nothing on stdout. With a CPU-only LibTorch
# (Debian's) or no visible GPU every strategy is refused for the missing
# CUDA; with CUDA, mirrored and multi_worker train (not run here: gpu-check
# runs them) and central_storage / parameter_server are refused naming what
# diststrat::libtorch does not support yet (docs/torch.md).
# scripts/gpu-check.sh reads the same two messages.
# Usage: torch_device_gpu_test.sh <torch_fashion_mnist>
set -uo pipefail
bin=$1
work=$(mktemp -d /tmp/diststrat_torch_gpu_XXXXXX)
trap 'rm -rf "$work"' EXIT
no_cuda='^torch_fashion_mnist: --device gpu: this LibTorch has no CUDA or sees no CUDA device \(torch::cuda::is_available\(\) is false\); --device gpu needs a CUDA build of LibTorch and a visible GPU$'
unsupported='^torch_fashion_mnist: --device gpu: not supported by diststrat::libtorch yet: .+ \(docs/torch\.md\)$'
strategies="parameter_server central_storage mirrored multi_worker"
for strategy in $strategies; do
  timeout 60 "$bin" --device gpu --strategy "$strategy" --epochs 1 --limit 64 >"$work/out" 2>"$work/err"
  rc=$?
  [[ $rc -eq 2 ]] || { echo "FAIL: --strategy $strategy --device gpu exited $rc, expected 2"; cat "$work/out" "$work/err"; exit 1; }
  [[ ! -s $work/out ]] || { echo "FAIL: --strategy $strategy --device gpu wrote to stdout"; cat "$work/out"; exit 1; }
  [[ $(wc -l <"$work/err") -eq 1 ]] || { echo "FAIL: --strategy $strategy --device gpu: not one line on stderr"; cat "$work/err"; exit 1; }
  if grep -qE "$no_cuda" "$work/err"; then
    echo "ok: --strategy $strategy --device gpu: exit 2, LibTorch without CUDA named"
  elif grep -qE "$unsupported" "$work/err"; then
    echo "ok: --strategy $strategy --device gpu: exit 2, CUDA LibTorch, unsupported part named: $(cat "$work/err")"
    [[ $strategy == central_storage ]] && break  # CUDA LibTorch: mirrored and multi_worker train
  else
    echo "FAIL: --strategy $strategy --device gpu: unexpected message"; cat "$work/err"; exit 1
  fi
done
