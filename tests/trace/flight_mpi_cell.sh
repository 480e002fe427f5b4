#!/usr/bin/env bash
# The flight recorder under mpirun -np 4 (tests/trace/flight_mpi.cc): each
# hang is made for real, every rank writes its record (on its failure, or
# through its watchdog when a peer failed), and `diststrat-trace analyze`
# must name the culprit:
#   flight_mpi_cell.sh MPIEXEC PROGRAM TRACE_TOOL KIND
# KIND: skip | different | compute | other_group | exit | straggler | clean
set -u
mpiexec=$1 program=$2 tool=$3 kind=$4
dir=$(mktemp -d "${TMPDIR:-/tmp}/diststrat_flight_mpi_XXXXXX")
trap 'rm -rf "$dir"' EXIT
run() {
  timeout -k 5 90 "$mpiexec" -np 4 --oversubscribe --bind-to none \
    -x DISTSTRAT_FLIGHT_RECORDER_DIR="$dir" "$program" "$@" 2>&1
}
case $kind in
  skip) want="^ranks disagree at all_reduce #3 of group 'world': ranks 0, 1, 2 have all_reduce 'step_3' .*, rank 3 has all_reduce 'step_4'" ;;
  different) want="^ranks disagree at all_reduce #2 of group 'world': ranks 0, 1, 3 have all_reduce 'step_2' .*, rank 2 has broadcast 'step_2'" ;;
  compute) want="^rank 1 never entered all_reduce #3 \('step_3', 1 KB\) of group 'world': it is in compute since [0-9.]+ s" ;;
  exit) want="^rank 2 never entered all_reduce #3 \('step_3', 1 KB\) of group 'world': it is gone: its process exited normally" ;;
  other_group) want="^rank 3 never entered all_reduce #3 \('step_3', 1 KB\) of group 'world': it is in barrier #1 of group 'world.1'" ;;
  straggler)
    out=$(run straggler 120 2)
    echo "$out"
    # Flagged at the first window (50 compute intervals: the one before
    # the first call is set-up, so by step 51), rank 2 alone; warned about
    # (slow in two windows running) by the end.
    if ! grep -qE "^flagged rank 2 \(host [^)]+\) after ([0-9]|[1-4][0-9]|5[01]) steps" <<<"$out"; then
      echo "FAIL: rank 2 (30 % slower) was not flagged within 50 steps"; exit 1
    fi
    if grep -E "straggler 1" <<<"$out" | grep -qv "^rank 2 "; then
      echo "FAIL: a rank other than 2 flagged"; exit 1
    fi
    if ! grep -qE "^warning: straggler in group 'world' over the last 100 calls: rank 2 \(host " <<<"$out"; then
      echo "FAIL: no warning naming rank 2"; exit 1
    fi
    echo PASS; exit 0 ;;
  clean)
    out=$(run straggler "${DSC_CLEAN_STEPS:-1000}" -1)
    echo "$out"
    # (A window may flag a rank the machine starved for a moment; only a
    # rank slow in two windows running is warned about.)
    if grep -qE "straggler in group" <<<"$out"; then echo "FAIL: a straggler warned about among equal ranks"; exit 1; fi
    if ! grep -qE "^warning: \(none\)" <<<"$out"; then echo "FAIL: no final report"; exit 1; fi
    echo PASS; exit 0 ;;
  *) echo "unknown kind $kind"; exit 2 ;;
esac
out=$(run "$kind")
echo "$out" | grep -E "^rank [0-9]:" | cut -c1-300
ls "$dir"
verdict=$("$tool" analyze "$dir" 2>&1)
echo "$verdict"
files=$(ls "$dir" | grep -c '^flight-.*\.json$')
if ((files != 4)); then echo "FAIL: $files records, want one per rank (4)"; exit 1; fi
if ! grep -qE "$want" <<<"$verdict"; then echo "FAIL: the verdict is not /$want/"; exit 1; fi
# The ranks that waited say for whom (rank 1, in its compute).
if [[ $kind == compute ]] && ! grep -q '"waiting_on": \[1\]' "$dir"/flight-*-rank0-*.json; then
  echo "FAIL: rank 0's record does not say it waited for rank 1"; exit 1
fi
echo PASS
