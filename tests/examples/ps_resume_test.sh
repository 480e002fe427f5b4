#!/usr/bin/env bash
# Parameter-server checkpoints of examples/fashion_mnist under mpirun -np 3
# (1 PS + 2 workers), as a user runs it. PS training is asynchronous, so runs
# are not compared byte for byte; what is checked:
#  1. a run stopped by --max-steps resumes from its last checkpoint (the
#     sharded one: an index plus a shard file per PS rank) and finishes;
#     examples/predict, reading that sharded checkpoint, reports exactly the
#     trainer's final test accuracy (the final save is the evaluated state);
#  2. SIGTERM mid-run: the workers agree on a step through PS 0, save there,
#     and the job ends; the next start resumes from that step.
# Usage: ps_resume_test.sh <fashion_mnist> <predict> <mpirun> [mpirun flags...]
set -euo pipefail
source "$(dirname "$0")/preempt.sh"
bin=$1 predict=$2
shift 2
launch=("$@")
export OMPI_MCA_odls_base_sigkill_timeout=${OMPI_MCA_odls_base_sigkill_timeout:-5}
work=$(mktemp -d /tmp/diststrat_ps_resume_XXXXXX)
trap 'rm -rf "$work"' EXIT
ps_flags=(--strategy parameter_server --ps 1)
run() { "${launch[@]}" "$bin" "${ps_flags[@]}" "$@"; }
flags=(--limit 512 --test-limit 1000 --epochs 2 --batch 64 --checkpoint-every 4)

d="$work/stop"
run "${flags[@]}" --checkpoint-dir "$d" --max-steps 6 > "$d.log1" 2>&1
grep -q "stopping at step 6" "$d.log1" || { echo "FAIL: no stop at step 6"; cat "$d.log1"; exit 1; }
ls "$d" | grep -q '^ckpt-4\.ps-0-of-1\..*\.safetensors$' || { echo "FAIL: no shard file of step 4"; ls "$d"; exit 1; }
run "${flags[@]}" --checkpoint-dir "$d" > "$d.log2" 2>&1
grep -q "resumed from $d/ckpt-4.safetensors: epoch 1, batch 4, step 4" "$d.log2" ||
  { echo "FAIL: no resume from step 4"; cat "$d.log2"; exit 1; }
grep -q "finished: saved $d/ckpt-16.safetensors at step 16" "$d.log2" ||
  { echo "FAIL: the resumed run did not finish"; cat "$d.log2"; exit 1; }
want=$(sed -n 's/^final: .*test_accuracy=\([0-9.]*\).*/\1/p' "$d.log2")
"$predict" --checkpoint "$d" --limit 1000 > "$work/predict.log"  # the trainer's --test-limit
got=$(sed -n 's/^accuracy=\([0-9.]*\).*/\1/p' "$work/predict.log")
[[ -n "$want" && "$want" == "$got" ]] || { echo "FAIL: trainer says $want, predict says $got"; cat "$work/predict.log"; exit 1; }
echo "ok: stopped at step 6, resumed from step 4, finished; predict on the sharded checkpoint: accuracy $got"

# Preemption. The run cannot finish first (a million epochs); SIGTERM is sent
# once its first checkpoint exists; every wait below is bounded.
every=25
pflags=(--limit 256 --test-limit 1000 --epochs 1000000 --batch 32 --checkpoint-every $every)
preempt_after_first_checkpoint "$work/pre.log1" "$work/pre" \
  "${launch[@]}" "$bin" "${ps_flags[@]}" "${pflags[@]}" --checkpoint-dir "$work/pre"
# (mpirun's own exit status says nothing here; the saved checkpoint decides.)
saved=$(grep -o "preempted: saved .* at step [0-9]*" "$work/pre.log1" || true)
[[ -n $saved ]] || { echo "FAIL: SIGTERM did not save a checkpoint"; cat "$work/pre.log1"; exit 1; }
echo "$saved"
pstep=${saved##* }
run "${pflags[@]}" --checkpoint-dir "$work/pre" --max-steps $((pstep + 3)) > "$work/pre.log2" 2>&1
grep -q "resumed from .*step $pstep\$" "$work/pre.log2" || { echo "FAIL: no resume from step $pstep"; cat "$work/pre.log2"; exit 1; }
grep -q "stopping at step $((pstep + 3))" "$work/pre.log2" || { echo "FAIL: no training after the resume"; cat "$work/pre.log2"; exit 1; }
echo "ok: SIGTERM at step $pstep: the workers agreed on it, saved there and exited; the next start resumed and trained on"
