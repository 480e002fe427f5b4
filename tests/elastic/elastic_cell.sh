#!/usr/bin/env bash
# Elastic training across processes, by ctest (label cluster):
#   elastic_cell.sh CLUSTER_SH CHECK KIND
# CHECK is diststrat_elastic_check (one worker; see elastic_check.cc). KIND:
#   local   3 workers on this host (127.0.0.1, a directory store); worker c
#           is killed with SIGKILL mid-epoch; once the survivors re-formed a
#           new worker d starts and is admitted.
# Passes when every surviving worker and the joiner exit 0 having trained
# with the final group (3 workers), their weights within 1e-5 of the same
# training run sequentially over the same global batches, every row used
# exactly once per epoch (count_error < 0.01 uses), and no worker process is
# left. Prints the measured bars: the time from the kill to the survivors'
# next completed step, and from the joiner's start to its first step.
set -u
if (($# < 3)); then
  echo "usage: $0 CLUSTER_SH CHECK KIND" >&2
  exit 2
fi
cluster=$1 check=$2 kind=$3
dir=$(mktemp -d "${TMPDIR:-/tmp}/diststrat_elastic_XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

ms() { date +%s%3N; }
# wait_for FILE REGEX SECONDS: until a line of FILE matches.
wait_for() {
  local until=$(($(date +%s) + $3))
  while (($(date +%s) < until)); do
    grep -Eq "$2" "$1" 2>/dev/null && return 0
    sleep 0.05
  done
  echo "FAIL: no line matching '$2' in $1 within $3 s"
  tail -5 "$1"
  return 1
}
# start ID: a worker in the background, its output in $dir/ID.log.
start() {
  "$check" --rendezvous "file://$dir/job" --id "$1" --listen-host 127.0.0.1 --min-workers 2 \
    --rows 512 --batch 32 --epochs 4 --step-delay-ms 40 --settle-ms 1000 --timeout-ms 10000 \
    >"$dir/$1.log" 2>&1 &
  pids+=($!)
  eval "pid_$1=$!"
}

case $kind in
  local)
    start a; start b; start c
    wait_for "$dir/a.log" "^a: step 1[0-9] at" 60 || exit 1
    kill_ms=$(ms)
    kill -9 "$pid_c"
    wait_for "$dir/a.log" "^a: group [0-9]+ rank [0-9] of 2" 30 || exit 1
    join_ms=$(ms)
    start d
    fail=0
    for w in a b d; do
      p=pid_$w
      if ! wait "${!p}"; then
        echo "FAIL: worker $w exited non-zero:"; tail -5 "$dir/$w.log"; fail=1
      fi
    done
    for w in a b d; do
      line=$(grep "^$w: final" "$dir/$w.log")
      echo "$line"
      [[ $line =~ workers=3\  ]] || { echo "FAIL: $w did not finish with 3 workers"; fail=1; }
      d=$(sed -E 's/.*weight_diff=([^ ]+).*/\1/' <<<"$line")
      e=$(sed -E 's/.*count_error=([^ ]+).*/\1/' <<<"$line")
      awk -v d="$d" -v e="$e" 'BEGIN { exit !(d < 1e-5 && e < 0.01) }' ||
        { echo "FAIL: $w weight_diff=$d count_error=$e"; fail=1; }
    done
    # The bars: the survivors' next step after the kill; the joiner's first step.
    next=$(awk -v k="$kill_ms" '/^a: step [0-9]+ at/ { if ($5 > k) { print $5 - k; exit } }' "$dir/a.log")
    first=$(awk -v k="$join_ms" '/^d: step [0-9]+ at/ { print $5 - k; exit }' "$dir/d.log")
    echo "bar: kill -9 -> survivors' next step completed in ${next:-?} ms (settle 1000 ms)"
    echo "bar: joiner started -> its first step completed in ${first:-?} ms"
    grep -h "elastic:" "$dir"/a.log | head -5
    ((fail == 0)) && echo "PASS: elastic $kind"
    exit $fail
    ;;
  *)
    echo "elastic_cell.sh: unknown kind '$kind'" >&2
    exit 2
    ;;
esac
