#!/usr/bin/env bash
# A fault cell (ctest, label mpi): the parameter server's process is stopped
# and continued while its workers train, as an operator's SIGSTOP, a
# debugger or a starved host would:
#   ps_stopped_cell.sh MPIEXEC DRIVER TIMEOUT_MS
# Runs DRIVER (diststrat_mpi_fault --strategy parameter_server: workers 0, 1,
# the PS is rank 2; worker_timeout TIMEOUT_MS, the workers' own deadline
# 3 x TIMEOUT_MS) under `MPIEXEC -np 3`, stops the PS rank (SIGSTOP) once it
# is serving for 1.5 x TIMEOUT_MS and continues it (SIGCONT), STOPS times
# (a stop that lands while the loop is between its receive and its liveness
# check used to make the PS declare every worker gone and quit), and passes
# when
#   - the PS was stopped while the job ran (it did not end before SIGCONT),
#   - mpirun exits 0 and every rank prints OK with exact values: the PS did
#     not declare its healthy workers gone for the time it was not running
#     ("sent nothing", "went silent" never appear),
#   - no process of the job is left afterwards (see fault_cell.sh).
set -u
if (($# != 3)); then
  echo "usage: $0 MPIEXEC DRIVER TIMEOUT_MS" >&2
  exit 2
fi
mpiexec=$1 driver=$2 timeout_ms=$3
stop_ms=$((3 * timeout_ms / 2))
stops=${DISTSTRAT_PS_STOPPED_STOPS:-4}
steps=${DISTSTRAT_PS_STOPPED_STEPS:-20000}
tag="diststrat-ps-stopped-$$-$RANDOM$RANDOM"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
fail=0
timeout -s KILL 100 "$mpiexec" -np 3 --oversubscribe --bind-to none \
  "$driver" --strategy parameter_server --steps "$steps" --timeout-ms "$timeout_ms" --tag "$tag" >"$log" 2>&1 &
job=$!
# The PS: the job's process whose launcher rank is 2.
ps_pid=
for _ in $(seq 200); do
  for pid in $(pgrep -f -- "--tag $tag" || true); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=2"; then ps_pid=$pid; fi
  done
  [[ -n $ps_pid ]] && break
  sleep 0.05
done
stopped=0
if [[ -z $ps_pid ]]; then
  echo "FAIL: the PS process (rank 2) never appeared"
  fail=1
else
  for ((k = 0; k < stops && !fail; ++k)); do
    sleep 0.3  # let training go on
    if kill -STOP "$ps_pid" 2>/dev/null; then
      echo "stopped the PS (pid $ps_pid) for ${stop_ms} ms"
      sleep "$(awk "BEGIN { print $stop_ms / 1000 }")"
      if ! kill -0 "$job" 2>/dev/null; then
        echo "FAIL: the job ended while the PS was stopped"
        fail=1
      fi
      kill -CONT "$ps_pid" 2>/dev/null
      stopped=$((stopped + 1))
    else
      echo "FAIL: the job ended before the PS could be stopped $stops times (raise DISTSTRAT_PS_STOPPED_STEPS)"
      fail=1
    fi
  done
fi
wait "$job"
rc=$?
cat "$log"
echo "----"
if ((rc != 0)); then
  echo "FAIL: mpirun exited $rc"
  fail=1
fi
for r in 0 1; do
  if ! grep -qE "^rank $r: OK .*values exact" "$log"; then
    echo "FAIL: worker rank $r did not finish with exact values"
    fail=1
  fi
done
if ! grep -qE "^rank 2: OK" "$log"; then
  echo "FAIL: the PS did not finish cleanly"
  fail=1
fi
if grep -qE "sent nothing|went silent" "$log"; then
  echo "FAIL: the PS blamed its workers for the time it was stopped"
  fail=1
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
echo "CELL parameter_server PS stopped $stopped x ${stop_ms} ms: mpirun rc=$rc," \
     "orphans: ${left:-none} -> $result"
exit $fail
