#!/usr/bin/env bash
# A correctness cell on the namespace cluster (scripts/cluster.sh), run by
# ctest (label cluster):
#   mpi_cell.sh CLUSTER_SH HOSTS PPN [--expect N REGEX]... -- PROGRAM ARGS...
# Makes a cluster of HOSTS hosts, runs PROGRAM under mpirun with PPN ranks
# per host (ranks on one host share memory; across hosts only TCP through the
# veths) and passes when mpirun exits 0 and, for every --expect, exactly N
# output lines match REGEX (grep -E). The cluster is torn down on exit.
# Exit 77 (ctest: skipped) with the reason where namespaces are refused.
set -u
if (($# < 4)); then
  echo "usage: $0 CLUSTER_SH HOSTS PPN [--expect N REGEX]... -- PROGRAM ARGS..." >&2
  exit 2
fi
cluster=$1 hosts=$2 ppn=$3
shift 3
expects=()
while (($#)) && [[ $1 != -- ]]; do
  [[ $1 == --expect && $# -ge 3 ]] || { echo "bad argument $1" >&2; exit 2; }
  expects+=("$2" "$3")
  shift 3
done
shift  # --
export DSC_PREFIX=${DSC_PREFIX:-dsct} DSC_NET=${DSC_NET:-1}
if ! why=$(timeout 30 "$cluster" check); then
  echo "SKIP: cannot make the namespace cluster here: $why"
  exit 77
fi
log=$(mktemp)
# Flight records of the ranks go here, not to /tmp (cluster.sh passes it on).
export DISTSTRAT_FLIGHT_RECORDER_DIR=$(mktemp -d "${TMPDIR:-/tmp}/diststrat_cell_flight_XXXXXX")
trap 'timeout 60 "$cluster" down >/dev/null 2>&1; rm -f "$log"; rm -rf "$DISTSTRAT_FLIGHT_RECORDER_DIR"' EXIT
trap 'exit 1' INT TERM
timeout 60 "$cluster" down >/dev/null 2>&1
timeout 60 "$cluster" --hosts "$hosts" up || { echo "FAIL: cluster up"; exit 1; }
timeout -s KILL 400 "$cluster" run --ppn "$ppn" -- "$@" >"$log" 2>&1
rc=$?
cat "$log"
echo "----"
fail=0
((rc == 0)) || { echo "FAIL: mpirun exited $rc"; fail=1; }
for ((i = 0; i < ${#expects[@]}; i += 2)); do
  want=${expects[i]} re=${expects[i + 1]}
  got=$(grep -cE -- "$re" "$log")
  if ((got != want)); then
    echo "FAIL: $got lines match '$re', want $want"
    fail=1
  else
    echo "ok: $got lines match '$re'"
  fi
done
left=$(timeout 10 "$cluster" pids)
if [[ -n $left ]]; then echo "FAIL: processes left in the cluster: $left"; fail=1; fi
((fail)) && echo "CELL $hosts hosts x $ppn: FAIL" || echo "CELL $hosts hosts x $ppn: PASS"
exit $fail
