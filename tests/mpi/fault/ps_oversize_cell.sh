#!/usr/bin/env bash
# The oversize fault cell (issue 14.3), run by ctest (label mpi):
#   ps_oversize_cell.sh MPIEXEC DRIVER TIMEOUT_MS
# Worker 1 of DRIVER (diststrat_mpi_fault --strategy parameter_server, the PS
# is rank 2) sends, at step 3, a push whose header claims 1 GiB + 8 bytes
# more payload than it carries (DISTSTRAT_FAULT=oversize:1:3): a payload the
# PS would receive in parts. Passes when fault_cell.sh passes (mpirun fails
# within the deadline + 10 s, a line names rank 1 and step 3, no process is
# left) and the PS itself rejected that push at once, naming worker 1 --
# rather than waiting for the parts that never come and blaming the healthy
# worker 0.
set -u
if (($# != 3)); then
  echo "usage: $0 MPIEXEC DRIVER TIMEOUT_MS" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
out=$("$here/fault_cell.sh" "$1" "$2" 3 parameter_server oversize 1 3 "$3" 2>&1)
rc=$?
echo "$out"
echo "----"
if ! grep -qE "PS rank 2: push from worker 1: .*header claims a payload of [0-9]+ bytes" <<<"$out"; then
  echo "FAIL: the PS did not reject worker 1's oversized push naming it"
  rc=1
fi
# (Worker 0's pull failing with "the job is ending: worker 1 (rank 1)
# failed" is the PS naming the right worker, not blame.)
if grep -E "pull from worker 0 rejected|worker 0 \(rank 0\) sent nothing" <<<"$out" |
    grep -qv "the job is ending: worker 1 (rank 1) failed"; then
  echo "FAIL: the PS blamed the healthy worker 0"
  rc=1
fi
((rc == 0)) && echo "OVERSIZE CELL: PASS" || echo "OVERSIZE CELL: FAIL"
exit $rc
