#!/usr/bin/env bash
# Resume and preemption of examples/fashion_mnist, as a user runs it:
#  1. interrupted (--max-steps) mid-epoch and at an epoch boundary, then
#     resumed: the final checkpoint is byte-identical to an uninterrupted run's
#     (same weights, momentum, step counter and metadata);
#  2. SIGTERM while training: exits 0 after saving; the next start resumes and
#     ends with the same final checkpoint as an uninterrupted run.
# Usage: resume_test.sh <fashion_mnist binary> [launcher words...] [-- strategy flags...]
#   resume_test.sh build/examples/fashion_mnist
#   resume_test.sh build/examples/fashion_mnist mpirun -np 2 --oversubscribe -- --strategy multi_worker --replicas 1
# Under mpirun, SIGTERM goes to mpirun. Open MPI 4.1 then sends the ranks
# SIGCONT, SIGTERM after OMPI_MCA_odls_base_sigkill_timeout (T) seconds and
# SIGKILL after another T: a rank has T seconds to reach a step boundary and save.
set -euo pipefail
bin=$1
shift
launch=()
while (($#)) && [[ $1 != -- ]]; do launch+=("$1"); shift; done
(($#)) && shift
strategy_flags=("$@")
((${#strategy_flags[@]})) || strategy_flags=(--replicas 2)
export OMPI_MCA_odls_base_sigkill_timeout=${OMPI_MCA_odls_base_sigkill_timeout:-2}
# The preempted run must outlast mpirun's T-second delay before SIGTERM.
pepochs=30
((${#launch[@]})) && pepochs=$((30 + 20 * OMPI_MCA_odls_base_sigkill_timeout))
work=$(mktemp -d /tmp/diststrat_resume_XXXXXX)
trap 'rm -rf "$work"' EXIT
run() { ${launch[@]+"${launch[@]}"} "$bin" "${strategy_flags[@]}" "$@"; }
flags=(--limit 512 --epochs 2 --batch 64 --checkpoint-every 4)

run "${flags[@]}" --checkpoint-dir "$work/ref" > "$work/ref.log"
final=ckpt-16.safetensors
test -f "$work/ref/$final" || { echo "FAIL: no $final in the uninterrupted run"; cat "$work/ref.log"; exit 1; }

for stop in 7 8 13; do   # mid-epoch, at the epoch boundary (8 batches per epoch), in epoch 2
  d="$work/stop$stop"
  run "${flags[@]}" --checkpoint-dir "$d" --max-steps "$stop" > "$d.log1"
  grep -q "stopping at step $stop" "$d.log1" || { echo "FAIL: no stop at $stop"; cat "$d.log1"; exit 1; }
  run "${flags[@]}" --checkpoint-dir "$d" > "$d.log2"
  grep -q "resumed from" "$d.log2" || { echo "FAIL: run after stop $stop did not resume"; cat "$d.log2"; exit 1; }
  cmp "$work/ref/$final" "$d/$final" || { echo "FAIL: stopped at $stop and resumed: final checkpoint differs"; exit 1; }
  echo "ok: interrupted at step $stop, resumed, final checkpoint identical"
done

# Preemption: SIGTERM mid-run.
pflags=(--limit 256 --epochs "$pepochs" --batch 32 --checkpoint-every 10)
run "${pflags[@]}" --checkpoint-dir "$work/pref" > "$work/pref.log"
pfinal=ckpt-$((pepochs * 8)).safetensors
# Not through run(): $! must be the program (or mpirun), not a subshell.
${launch[@]+"${launch[@]}"} "$bin" "${strategy_flags[@]}" "${pflags[@]}" --checkpoint-dir "$work/pre" \
  > "$work/pre.log1" &
pid=$!
trap 'kill -KILL "$pid" 2>/dev/null || true; rm -rf "$work"' EXIT
# Wait until training is under way (the first checkpoint), then preempt.
for _ in $(seq 600); do
  test -f "$work/pre/latest" && break
  sleep 0.05
done
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
# The program exits 0. mpirun itself reports 1 after it was signalled, whatever
# the ranks returned, so under a launcher the saved checkpoint is the criterion.
if [[ $rc -ne 0 && ${#launch[@]} -eq 0 ]]; then echo "FAIL: SIGTERM exit status $rc"; cat "$work/pre.log1"; exit 1; fi
if grep -q "preempted: saved" "$work/pre.log1"; then
  grep "preempted: saved" "$work/pre.log1"
  run "${pflags[@]}" --checkpoint-dir "$work/pre" > "$work/pre.log2"
  grep -q "resumed from" "$work/pre.log2" || { echo "FAIL: no resume after preemption"; cat "$work/pre.log2"; exit 1; }
elif grep -q "finished: saved" "$work/pre.log1"; then
  echo "FAIL: training finished before the signal arrived; make the preemption run longer"; exit 1
else
  echo "FAIL: SIGTERM did not save a checkpoint"; cat "$work/pre.log1"; exit 1
fi
cmp "$work/pref/$pfinal" "$work/pre/$pfinal" || { echo "FAIL: preempted and resumed: final checkpoint differs"; exit 1; }
echo "ok: SIGTERM saved and exited 0, resumed run ends identical to the uninterrupted one"
