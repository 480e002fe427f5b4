#!/usr/bin/env bash
# The exit record (issue 43 item 9): a process of a job that returns from
# main writes a record with trigger "exit" holding the newest 16 calls of
# each group, also of a group it closed before; one that ends by _Exit
# writes none; one that wrote a failure record keeps it; a forked child
# that exits writes none.
#   tests/trace/flight_exit_cell.sh PATH/TO/flight_exit_probe
set -euo pipefail
probe=$1
root=$(mktemp -d "${TMPDIR:-/tmp}/diststrat_flight_exit_XXXXXX")
trap 'rm -rf "$root"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
for mode in normal _exit failure fork; do
  dir=$root/$mode
  mkdir "$dir"
  DISTSTRAT_FLIGHT_RECORDER_DIR=$dir timeout 60 "$probe" "$([[ $mode == normal ]] || echo "$mode")" ||
    fail "$mode: the probe exited $?"
done
[[ -z $(ls "$root/_exit") ]] || fail "_Exit left a record: $(ls "$root/_exit")"
python3 - "$root" <<'PY' || fail "the records are not as expected"
import glob, json, sys
root = sys.argv[1]
def only(mode):
    files = glob.glob(root + "/" + mode + "/flight-probe-rank2-pid*.json")
    assert len(files) == 1, (mode, files)
    return json.load(open(files[0]))
j = only("normal")
assert j["trigger"] == "exit", j["trigger"]
seqs = {}
for c in j["calls"]:
    seqs.setdefault(c["group"], []).append(c["seq"])
assert seqs == {"world.1": [0, 1, 2], "world": list(range(24, 40))}, seqs
assert sorted(m["group"] for m in j["members"]) == ["world", "world.1"], j["members"]
assert only("fork")["trigger"] == "exit"  # one file: the child wrote none
f = only("failure")
assert f["trigger"] == "failure", f["trigger"]
assert len(f["calls"]) == 40, len(f["calls"])
PY
echo PASS
