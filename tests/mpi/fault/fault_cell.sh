#!/usr/bin/env bash
# One cell of the multi-process fault matrix, run by ctest (label mpi):
#   fault_cell.sh MPIEXEC DRIVER NP STRATEGY KIND RANK STEP TIMEOUT_MS
# Runs DRIVER (diststrat_mpi_fault) under `MPIEXEC -np NP --oversubscribe`
# with DISTSTRAT_FAULT=KIND:RANK:STEP and passes when
#   - mpirun exits non-zero,
#   - the job ended within its deadline + 10 s (deadline: TIMEOUT_MS for
#     multi_worker; 3 x TIMEOUT_MS for parameter_server, the workers' own
#     wait deadline), mpirun's start-up included,
#   - some line of the output names "rank RANK" and "step STEP" (the
#     survivors' or the PS's error, the failing rank's own error, or the
#     injected-fault log line of a rank that exited),
#   - no process of the job is left afterwards: every driver process carries
#     a unique --tag word, looked up with pgrep after mpirun has returned
#     (leftovers are printed with their process group, then killed by pid).
set -u
if (($# != 8)); then
  echo "usage: $0 MPIEXEC DRIVER NP STRATEGY KIND RANK STEP TIMEOUT_MS" >&2
  exit 2
fi
mpiexec=$1 driver=$2 np=$3 strategy=$4 kind=$5 rank=$6 step=$7 timeout_ms=$8
tag="diststrat-fault-cell-$$-$RANDOM$RANDOM"
if [[ $strategy == parameter_server ]]; then deadline_ms=$((3 * timeout_ms)); else deadline_ms=$timeout_ms; fi
bound_ms=$((deadline_ms + 10000))
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start_ns=$(date +%s%N)
# The outer timeout only guards this script against a hung mpirun (a failure).
timeout -s KILL $((bound_ms / 1000 + 60)) \
  "$mpiexec" -np "$np" --oversubscribe --bind-to none -x DISTSTRAT_FAULT="$kind:$rank:$step" \
  "$driver" --strategy "$strategy" --timeout-ms "$timeout_ms" --tag "$tag" >"$log" 2>&1
rc=$?
elapsed_ms=$((($(date +%s%N) - start_ns) / 1000000))
cat "$log"
echo "----"
fail=0
if ((rc == 0)); then
  echo "FAIL: mpirun exited 0 (the fault did not fail the job)"
  fail=1
fi
if ((elapsed_ms > bound_ms)); then
  echo "FAIL: the job took ${elapsed_ms} ms, more than the deadline + 10 s (${bound_ms} ms)"
  fail=1
fi
naming=$(grep -E "rank $rank([^0-9]|$)" "$log" | grep -E "step $step([^0-9]|$)" | head -3)
if [[ -z $naming ]]; then
  echo "FAIL: no line names rank $rank and step $step"
  fail=1
else
  echo "named by: $naming"
fi
sleep 0.5
left=$(pgrep -f -- "--tag $tag" || true)
if [[ -n $left ]]; then
  echo "FAIL: processes left running after mpirun returned:"
  ps -o pid,pgid,stat,etime,cmd -p "$(echo $left | tr ' ' ',')" || true
  for pid in $left; do kill -KILL "$pid" 2>/dev/null || true; done
  fail=1
fi
result=PASS
((fail)) && result=FAIL
echo "CELL $strategy $kind rank $rank step $step: mpirun rc=$rc, ended after ${elapsed_ms} ms" \
     "(bound ${bound_ms} ms), orphans: ${left:-none} -> $result"
exit $fail
