#!/usr/bin/env bash
# examples/predict on a checkpoint that examples/fashion_mnist wrote: the same
# test accuracy as the trainer reported, per-class counts that add up, and a
# corrupted checkpoint refused with a DataLoss error (exit 1), not a crash.
# Usage: predict_test.sh <fashion_mnist binary> <predict binary>
set -euo pipefail
train=$1 predict=$2
work=$(mktemp -d /tmp/diststrat_predict_XXXXXX)
trap 'rm -rf "$work"' EXIT

"$train" --limit 512 --epochs 1 --batch 64 --replicas 2 --checkpoint-dir "$work/c" > "$work/train.log"
want=$(sed -n 's/.*test_accuracy=\([0-9.]*\).*/\1/p' "$work/train.log")
"$predict" --checkpoint "$work/c" > "$work/predict.log"
cat "$work/predict.log"
got=$(sed -n 's/^accuracy=\([0-9.]*\).*/\1/p' "$work/predict.log")
[[ -n "$want" && "$want" == "$got" ]] || { echo "FAIL: trainer says $want, predict says $got"; exit 1; }
# The per-class rows add up to the 10000 test images, predicted and true.
awk '/^[0-9]/ { t += $(NF-3); p += $(NF-2) } END { if (t != 10000 || p != 10000) { print "FAIL: counts " t " " p; exit 1 } }' \
  "$work/predict.log"

# Flip one byte in the middle of the file: refused, exit 1, DataLoss.
f=$(ls "$work"/c/ckpt-*.safetensors | head -1)
size=$(stat -c %s "$f")
printf '\xff' | dd of="$f" bs=1 seek=$((size / 2)) conv=notrunc status=none
rc=0
"$predict" --checkpoint "$f" 2> "$work/err.log" > /dev/null || rc=$?
[[ $rc -eq 1 ]] && grep -q "kDataLoss" "$work/err.log" || { echo "FAIL: corrupt file: rc $rc"; cat "$work/err.log"; exit 1; }
cat "$work/err.log"
echo "ok: predict matches the trainer's accuracy and refuses a corrupted checkpoint"
