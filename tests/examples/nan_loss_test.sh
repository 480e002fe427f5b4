#!/usr/bin/env bash
# A training run whose loss becomes non-finite stops at that step with a
# clear error and a non-zero exit (Keras's TerminateOnNaN), and saves no
# checkpoint of the diverged model (issue 23, item 3).
# Usage: nan_loss_test.sh <fashion_mnist or torch_fashion_mnist binary>
set -uo pipefail
bin=$1
work=$(mktemp -d /tmp/diststrat_nanloss_XXXXXX)
trap 'rm -rf "$work"' EXIT
# A learning rate of 1e30 blows the weights up within a few steps.
"$bin" --limit 512 --epochs 2 --batch 64 --lr 1e30 --checkpoint-dir "$work/ckpt" --checkpoint-every 1 \
  > "$work/out.log" 2> "$work/err.log"
rc=$?
[[ $rc -ne 0 ]] || { echo "FAIL: exit 0 after a non-finite loss"; cat "$work/out.log" "$work/err.log"; exit 1; }
grep -q "not finite" "$work/err.log" || { echo "FAIL: no clear error"; cat "$work/err.log"; exit 1; }
step=$(sed -n 's/.*training loss of step \([0-9]*\) is.*/\1/p' "$work/err.log" | head -1)
[[ -n $step ]] || { echo "FAIL: the error names no step"; cat "$work/err.log"; exit 1; }
! grep -q "train_loss=nan" "$work/out.log" || { echo "FAIL: finished with train_loss=nan"; exit 1; }
[[ ! -e "$work/ckpt/ckpt-$step.safetensors" ]] || { echo "FAIL: the diverged step $step was saved"; exit 1; }
echo "ok: stopped at step $step with rc $rc: $(head -c 200 "$work/err.log")"
