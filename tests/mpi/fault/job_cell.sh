#!/usr/bin/env bash
# A fault cell for a whole job given on the command line (run by ctest, label
# mpi): set-up and early failures of real programs (tests/mpi/CMakeLists.txt).
#   job_cell.sh BOUND_MS [--expect REGEX]... -- MPIEXEC ARGS...
# Runs `MPIEXEC ARGS...` (mpirun with its program(s)) and passes when
#   - it exits non-zero,
#   - it ended within BOUND_MS, mpirun's start-up included,
#   - every REGEX (grep -E) matches some line of its output,
#   - no process of the job is left afterwards: mpirun is given
#     FAULT_CELL_TAG=<unique word> and forwards it to every rank (-x), and
#     after mpirun has returned no process may carry it in its environment
#     (leftovers are printed, then killed by pid).
set -u
if (($# < 3)); then
  echo "usage: $0 BOUND_MS [--expect REGEX]... -- MPIEXEC ARGS..." >&2
  exit 2
fi
bound_ms=$1
shift
expects=()
while (($#)) && [[ $1 != -- ]]; do
  if [[ $1 == --expect && $# -ge 2 ]]; then
    expects+=("$2")
    shift 2
  else
    echo "$0: unexpected argument '$1'" >&2
    exit 2
  fi
done
shift  # --
mpiexec=$1
shift
tag="diststrat-job-cell-$$-$RANDOM$RANDOM"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start_ns=$(date +%s%N)
# The outer timeout only guards this script against a hung mpirun (a failure).
FAULT_CELL_TAG=$tag timeout -s KILL $((bound_ms / 1000 + 60)) \
  "$mpiexec" -x FAULT_CELL_TAG "$@" >"$log" 2>&1
rc=$?
elapsed_ms=$((($(date +%s%N) - start_ns) / 1000000))
cat "$log"
echo "----"
fail=0
if ((rc == 0)); then
  echo "FAIL: mpirun exited 0 (the job did not fail)"
  fail=1
fi
if ((elapsed_ms > bound_ms)); then
  echo "FAIL: the job took ${elapsed_ms} ms, more than its bound (${bound_ms} ms)"
  fail=1
fi
for re in "${expects[@]}"; do
  line=$(grep -E -m1 -- "$re" "$log")
  if [[ -z $line ]]; then
    echo "FAIL: no line matches: $re"
    fail=1
  else
    echo "matched: $line"
  fi
done
sleep 0.5
left=""
for env in /proc/[0-9]*/environ; do
  if grep -qz -- "^FAULT_CELL_TAG=$tag\$" "$env" 2>/dev/null; then
    pid=${env#/proc/}
    left+="${pid%/environ} "
  fi
done
if [[ -n $left ]]; then
  echo "FAIL: processes left running after mpirun returned:"
  ps -o pid,pgid,stat,etime,cmd -p "$(echo $left | tr ' ' ',')" || true
  for pid in $left; do kill -KILL "$pid" 2>/dev/null || true; done
  fail=1
fi
result=PASS
((fail)) && result=FAIL
echo "JOB CELL: mpirun rc=$rc, ended after ${elapsed_ms} ms (bound ${bound_ms} ms)," \
     "orphans: ${left:-none} -> $result"
exit $fail
