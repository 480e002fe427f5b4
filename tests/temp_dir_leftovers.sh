#!/usr/bin/env bash
# Runs a test command with a private TMPDIR and fails when it fails or leaves
# anything behind: in the private TMPDIR, or in /tmp under one of the given
# prefixes (a test that ignores TMPDIR). ctest runs it RUN_SERIAL, so no other
# test creates /tmp/<prefix>* meanwhile.
# Usage: temp_dir_leftovers.sh <prefix>... -- <command> [args...]
set -euo pipefail
prefixes=()
while (($# > 0)) && [[ $1 != -- ]]; do
  prefixes+=("$1")
  shift
done
if (($# < 2)); then
  echo "usage: $0 <prefix>... -- <command> [args...]" >&2
  exit 2
fi
shift
work=$(mktemp -d "${TMPDIR:-/tmp}/diststrat_leftover_check_XXXXXX")
trap 'rm -rf "$work"' EXIT
private=$work/tmp log=$work/run.log
mkdir "$private"
# Like /tmp: tests that drop root's privileges must still reach it.
chmod 755 "$work"
chmod 1777 "$private"

list_tmp() {
  local p
  for p in "$@"; do
    find /tmp -maxdepth 1 -name "${p}*" -print 2>/dev/null
  done | sort -u
}
before=$(list_tmp "${prefixes[@]}")
rc=0
TMPDIR=$private timeout -k 5 600 "$@" > "$log" 2>&1 || rc=$?
after=$(list_tmp "${prefixes[@]}")
tail -3 "$log"
if ((rc != 0)); then
  tail -30 "$log"
  echo "FAIL: $* exited $rc"
  exit 1
fi
status=0
left=$(find "$private" -mindepth 1 -maxdepth 1 -print)
if [[ -n $left ]]; then
  echo "FAIL: left in the private TMPDIR ($(wc -l <<< "$left") entries):"
  head -20 <<< "$left"
  status=1
fi
new=$(comm -13 <(printf '%s\n' "$before") <(printf '%s\n' "$after") | sed '/^$/d')
if [[ -n $new ]]; then
  echo "FAIL: left in /tmp ($(wc -l <<< "$new") entries, TMPDIR ignored):"
  head -20 <<< "$new"
  status=1
fi
((status == 0)) && echo "PASS: no temporary directory left behind"
exit $status
