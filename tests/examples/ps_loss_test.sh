#!/usr/bin/env bash
# The training loss the programs print under ParameterServerStrategy is the
# job's, not one worker's share (issue 13.5). With max_staleness 0 (lockstep)
# and plain SGD a PS job of 2 workers trains as synchronous SGD over the same
# global batches, so its loss must equal multi_worker's with 2 workers; one
# worker's share would be about half of it.
#  1. examples/fashion_mnist: the final line's train_loss (mean per example
#     over the run, every worker's);
#  2. benchmarks/train_bench (when given): its loss= over the timed steps.
# Usage: ps_loss_test.sh <fashion_mnist> <train_bench or ""> <mpirun> [mpirun flags...]
set -euo pipefail
bin=$1 bench=$2
shift 2
launch=("$@")
work=$(mktemp -d /tmp/diststrat_ps_loss_XXXXXX)
trap 'rm -rf "$work"' EXIT
# Equal within 2% (float rounding of the summation order drifts a little
# over the steps; a per-worker figure is off by ~50%).
same() { awk -v a="$1" -v b="$2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(b > 0 && d <= 0.02 * b) }'; }
field() { sed -n "s/.*$1=\([0-9.]*\).*/\1/p" | tail -1; }

flags=(--epochs 1 --limit 6400 --momentum 0)
"${launch[@]}" -np 3 "$bin" --strategy parameter_server --ps 1 --max-staleness 0 "${flags[@]}" \
  > "$work/ps.log" 2>&1 || { echo "FAIL: parameter_server run"; cat "$work/ps.log"; exit 1; }
"${launch[@]}" -np 2 "$bin" --strategy multi_worker --replicas 1 "${flags[@]}" \
  > "$work/mw.log" 2>&1 || { echo "FAIL: multi_worker run"; cat "$work/mw.log"; exit 1; }
ps=$(grep '^final:' "$work/ps.log" | field train_loss)
mw=$(grep '^final:' "$work/mw.log" | field train_loss)
[[ -n "$ps" && -n "$mw" ]] || { echo "FAIL: no train_loss on a final line"; cat "$work/ps.log" "$work/mw.log"; exit 1; }
same "$ps" "$mw" || { echo "FAIL: fashion_mnist train_loss: parameter_server $ps, multi_worker $mw"; exit 1; }
# The progress lines show the same meter's mean since the previous line
# (under the PS: every example any worker added since then, so their windows
# are not whole steps and are not compared here); there must be one at the
# last step.
tr '\r' '\n' < "$work/ps.log" | grep -q '^epoch 1  step 50/50  loss [0-9.]*' ||
  { echo "FAIL: no progress line at the last step"; cat "$work/ps.log"; exit 1; }
echo "ok: fashion_mnist train_loss parameter_server $ps = multi_worker $mw"

if [[ -n "$bench" ]]; then
  bflags=(--steps 20 --warmup 5 --no-overlap)
  "${launch[@]}" -np 3 "$bench" --strategy parameter_server --ps 1 --max-staleness 0 "${bflags[@]}" \
    > "$work/bps.log" 2>&1 || { echo "FAIL: train_bench parameter_server"; cat "$work/bps.log"; exit 1; }
  "${launch[@]}" -np 2 "$bench" --strategy multi_worker "${bflags[@]}" \
    > "$work/bmw.log" 2>&1 || { echo "FAIL: train_bench multi_worker"; cat "$work/bmw.log"; exit 1; }
  bps=$(grep '^train_bench:' "$work/bps.log" | field loss)
  bmw=$(grep '^train_bench:' "$work/bmw.log" | field loss)
  [[ -n "$bps" && -n "$bmw" ]] || { echo "FAIL: no loss= on train_bench's line"; cat "$work/bps.log" "$work/bmw.log"; exit 1; }
  same "$bps" "$bmw" || { echo "FAIL: train_bench loss: parameter_server $bps, multi_worker $bmw"; exit 1; }
  echo "ok: train_bench loss parameter_server $bps = multi_worker $bmw"
fi
