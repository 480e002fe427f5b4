#!/usr/bin/env bash
# Issue 28's bar, by hand: N hangs made for real under mpirun (4-8 ranks, a
# random culprit, step and kind), each analysed by the built tool; prints one
# line per run and the count named right.
#   tests/trace/random_hangs.sh BUILD_DIR [N=20] [SEED=1]
set -u
build=$1 n=${2:-20} seed=${3:-1}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
RANDOM=$seed
kinds=(skip different compute other_group)
right=0
for ((i = 0; i < n; ++i)); do
  np=$((4 + RANDOM % 5)) kind=${kinds[RANDOM % 4]} culprit=$((RANDOM % np)) step=$((1 + RANDOM % 6))
  dir=$(mktemp -d "${TMPDIR:-/tmp}/diststrat_random_hang_XXXXXX")
  timeout -k 5 60 mpirun -np "$np" --oversubscribe --bind-to none -x DISTSTRAT_FLIGHT_RECORDER_DIR="$dir" \
    "$build/tests/trace/diststrat_flight_mpi" "$kind" "$culprit" "$step" >/dev/null 2>&1
  verdict=$("$build/tools/diststrat-trace" analyze "$dir" 2>&1 | head -1)
  rm -rf "$dir"
  if [[ $kind == skip ]]; then
    want="^ranks disagree at all_reduce #$step of group 'world': .*rank $culprit has all_reduce 'step_$((step + 1))'"
  elif [[ $kind == different ]]; then
    want="^ranks disagree at (all_reduce|broadcast) #$step of group 'world': .*rank $culprit has broadcast 'step_$step'"
  elif [[ $kind == compute ]]; then
    want="^rank $culprit never entered all_reduce #$step \('step_$step', 1 KB\) of group 'world': it is in compute"
  else
    want="^rank $culprit never entered all_reduce #$step \('step_$step', 1 KB\) of group 'world': it is in barrier #1 of group 'world.1'"
  fi
  if grep -qE "$want" <<<"$verdict"; then ok=right; right=$((right + 1)); else ok=WRONG; fi
  echo "$((i + 1)): np $np $kind culprit $culprit step $step -> $ok: $verdict"
done
echo "$right of $n hangs named right"
