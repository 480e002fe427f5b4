#!/usr/bin/env bash
# The built diststrat-trace on directories of flight records:
#   tests/trace/cli_test.sh PATH/TO/diststrat-trace
# A job of 4 ranks where rank 2 computes while the others wait in
# all_reduce #17 (plus one truncated file): analyze exits 0 and prints the
# verdict first; export writes a Chrome trace that is valid JSON. Then the
# exit status 2 cases: no arguments, a missing directory, an empty one, a
# directory of unusable files.
set -euo pipefail
tool=$1
dir=$(mktemp -d "${TMPDIR:-/tmp}/diststrat_trace_cli_XXXXXX")
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# rank R's record: seqs 15 and 16 completed, then (unless R is 2) #17 started.
record() {
  local r=$1 last='' dump=$((17000 + 31200000))
  if [[ $r != 2 ]]; then
    last=',{"group":"world","group_rank":'$r',"group_size":4,"seq":17,"thread":0,"kind":"all_reduce","name":"dense2/kernel +3 more","count":314573,"dtype":"float32","op":"sum","root":-1,"algorithm":"ring","bytes":1258292,"enqueue_us":17000,"start_us":17000,"end_us":-1,"state":"started","waiting_on":[2]}'
  else
    dump=$((16500 + 12000000))
  fi
  cat <<EOF
{"format":"diststrat-flight-record","version":1,
 "process":{"rank":$r,"size":4,"host":"h$((r / 2))","pid":$((1000 + r))},
 "reason":"deadline exceeded in all_reduce 'dense2/kernel'","dump_time_us":$dump,"epoch_unix_us":1764750000000000,
 "calls":[
  {"group":"world","group_rank":$r,"group_size":4,"seq":15,"thread":0,"kind":"all_reduce","name":"grad/15","count":1024,"dtype":"float32","op":"sum","root":-1,"algorithm":"ring","bytes":4096,"enqueue_us":15000,"start_us":15010,"end_us":15500,"state":"completed"},
  {"group":"world","group_rank":$r,"group_size":4,"seq":16,"thread":0,"kind":"all_reduce","name":"grad/16","count":1024,"dtype":"float32","op":"sum","root":-1,"algorithm":"ring","bytes":4096,"enqueue_us":16000,"start_us":16010,"end_us":16500,"state":"completed"}$last
 ]}
EOF
}
for r in 0 1 2 3; do record $r > "$dir/flight-rank$r-pid$((1000 + r)).json"; done
record 1 | head -c 300 > "$dir/flight-rank1-old.json"  # a truncated extra file

expected="rank 2 never entered all_reduce #17 ('dense2/kernel' +3 more, 1.2 MB) of group 'world': it is in compute since 12.0 s (its last call, all_reduce #16, completed then)"
set +e
"$tool" analyze "$dir" > "$dir/out.txt" 2> "$dir/err.txt"
rc=$?
set -e
[[ $rc == 0 ]] || fail "analyze exited $rc: $(cat "$dir/err.txt")"
first=$(head -n 1 "$dir/out.txt")
[[ $first == "$expected" ]] || fail "verdict line: got '$first', want '$expected'"
grep -q "^skipping flight-rank1-old.json: truncated JSON at byte 300$" "$dir/err.txt" ||
  fail "no skip line for the truncated file: $(cat "$dir/err.txt")"
grep -q "group 'world': 4 ranks, 4 with a record" "$dir/out.txt" || fail "no group table: $(cat "$dir/out.txt")"
echo "analyze: $first"

"$tool" export "$dir" -o "$dir/trace.out" > /dev/null 2> "$dir/err.txt" || fail "export exited $?: $(cat "$dir/err.txt")"
python3 - "$dir/trace.out" <<'EOF' || fail "export is not the expected Chrome trace"
import json, sys
t = json.load(open(sys.argv[1]))
x = [e for e in t["traceEvents"] if e["ph"] == "X"]
assert len(x) == 11, len(x)
assert {e["pid"] for e in x} == {0, 1, 2, 3}
open_ = [e for e in x if e["args"].get("in_flight_at_dump")]
assert len(open_) == 3 and all(e["dur"] == 31200000 for e in open_), open_
EOF
echo "export: valid Chrome trace"

expect_2() {  # expect_2 WHAT ARGS...: the tool exits 2 and says something
  local what=$1 rc
  shift
  set +e
  "$tool" "$@" > /dev/null 2> "$dir/err.txt"
  rc=$?
  set -e
  [[ $rc == 2 ]] || fail "$what: exit $rc, want 2"
  [[ -s $dir/err.txt ]] || fail "$what: no message"
  echo "$what: exit 2: $(head -n 1 "$dir/err.txt")"
}
expect_2 "no arguments"
expect_2 "unknown command" frobnicate "$dir"
expect_2 "export without -o" export "$dir"
expect_2 "missing directory" analyze "$dir/none"
mkdir "$dir/empty" "$dir/bad"
expect_2 "empty directory" analyze "$dir/empty"
echo '[1, 2' > "$dir/bad/a.json"
echo '{"format": "other"}' > "$dir/bad/b.json"
expect_2 "unusable files" analyze "$dir/bad"
grep -q "no usable flight record" "$dir/err.txt" || fail "unusable files: $(cat "$dir/err.txt")"
echo "PASS"
