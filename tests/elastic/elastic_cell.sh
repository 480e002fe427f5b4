#!/usr/bin/env bash
# Elastic training across processes, by ctest (label cluster):
#   elastic_cell.sh CLUSTER_SH CHECK KIND
# CHECK is diststrat_elastic_check (one worker; see elastic_check.cc). KIND:
#   example    CHECK is examples/fashion_mnist: 3 workers of it with --elastic
#              on this host; one is killed with SIGKILL mid-epoch: the two
#              others finish, and the chief prints the final line with 2
#              replicas and the group change.
#   example_checkpoint
#              CHECK is examples/fashion_mnist: 3 workers with --elastic and
#              --checkpoint-dir on this host; the chief (the worker that
#              prints the saves) is killed with SIGKILL after a save: the new
#              chief saves on and at the end; then 2 new workers of a new job
#              (one more epoch) resume from the last checkpoint and finish.
#   torch_example
#              CHECK is examples/torch_fashion_mnist (LibTorch DDP): 3
#              workers with --elastic and --checkpoint-dir; a worker that is
#              not the chief is killed with SIGKILL after the first epoch: the
#              two others finish; then 2 new workers of a new job resume from
#              the last checkpoint and train one more epoch.
#   local      3 workers on this host (127.0.0.1, a directory store); worker c
#              is killed with SIGKILL mid-epoch; once the survivors re-formed
#              a new worker d starts and is admitted.
#   stopped    3 workers on this host; c is stopped (SIGSTOP) until a and b
#              have re-formed without it (it is declared dead), then
#              continued: it must not come back as c (the group would count
#              it twice) but join again as a new worker, c.r1, and take the
#              group's state; all three finish with exact results.
#   joiner_killed
#              a and b train; three joiners, one after another, are killed
#              with SIGKILL while the record lists them as waiting (between
#              their arrival in the store and their admission): each is
#              declared dead at the next round's settle time and never waited
#              for again; a and b finish with exact results (before issue 43:
#              the group re-formed for the first dead joiner forever).
#   left_behind
#              3 workers; c is stopped (SIGSTOP) past the timeout, a and b
#              finish without it; continued, c must stop at once with
#              'took part in the run ..., which has ended' (before issue 43:
#              it joined again as c.r1 and waited its join_timeout).
#   deterministic
#              determinism mode (--deterministic-across-workers 12,
#              docs/determinism.md) on this host: a, b and c train; c and then
#              b are killed with SIGKILL mid-run, a trains alone, d joins; the
#              final variables of a and d are the same bytes (`cmp`) as those
#              of one worker that trained uninterrupted.
# On the namespace cluster (scripts/cluster.sh, prefix dsct, 198.18.1.0/24),
# 2 hosts x 2 workers (h0a h0b on host 0, h1a h1b on host 1), a redis-server
# in the launcher namespace as the store, min_workers 2:
#   kill       h1b is killed with SIGKILL mid-epoch; once the 3 others
#              re-formed, h1c starts on host 1 and is admitted: 4 again.
#   kills3     three rounds of: a random live worker killed, a replacement
#              started on its host once the others re-formed.
#   kill_zero  kill, with Adam and its state sharded over the workers
#              (ZeRO-1): the dead worker's block comes from the commit.
#   host_dies  every process on host 1 is killed: host 0's two go on.
#   link_down  host 1's cable is pulled for good: host 0's two go on; host
#              1's workers, which can reach neither peers nor the store, stop
#              with an error naming the store.
# Passes when every worker expected to finish exits 0 having trained with
# the final group, its weights within 1e-5 of the same training run
# sequentially over the same global batches, every row used exactly once per
# epoch (count_error < 0.01 uses), and no worker process is left. Prints the
# measured bars: the time from a kill to the survivors' next completed step,
# and from a joiner's start to its first step. Exit 77 (skipped) with the
# reason where namespaces or redis-server are missing.
set -u
if (($# < 3)); then
  echo "usage: $0 CLUSTER_SH CHECK KIND" >&2
  exit 2
fi
cluster=$1 check=$2 kind=$3
dir=$(mktemp -d "${TMPDIR:-/tmp}/diststrat_elastic_XXXXXX")
# The survivors of a kill write flight records (by design): here, not /tmp.
export DISTSTRAT_FLIGHT_RECORDER_DIR=$dir/flight-records
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
common=(--min-workers 2 --rows 512 --batch 32 --settle-ms 1000 --timeout-ms 5000)
extra=()
# wait_count FILE REGEX N SECONDS: until N lines of FILE match.
wait_count() {
  local until=$(($(date +%s) + $4))
  while (($(date +%s) < until)); do
    (($(grep -Ec "$2" "$1" 2>/dev/null) >= $3)) && return 0
    sleep 0.05
  done
  echo "FAIL: fewer than $3 lines matching '$2' in $1 within $4 s"
  tail -5 "$1"
  return 1
}
# start ID: a worker on this host in the background, its output in $dir/ID.log.
start() {
  "$check" --rendezvous "file://$dir/job" --id "$1" --listen-host 127.0.0.1 "${common[@]}" \
    --epochs 4 --step-delay-ms 40 >"$dir/$1.log" 2>&1 &
  pids+=($!)
  eval "pid_$1=$!"
}
# start_on HOST ID: a worker on namespace host HOST (0 or 1).
start_on() {
  "$cluster" exec "$1" "$check" --rendezvous "redis://$store/job" --id "$2" \
    --listen-host "198.18.$DSC_NET.$(($1 + 1))" "${common[@]}" --epochs "$epochs" \
    --step-delay-ms 30 "${extra[@]}" >"$dir/$2.log" 2>&1 &
  pids+=($!)
  eval "pid_$2=$!"
}
# chief_by REGEX: the worker of a, b and c whose log first has a line
# matching REGEX (a line only the group's chief prints), into $chief, and the
# two others into $others; fails if a worker ends first.
chief_by() {
  local w p
  chief=""
  until [[ -n $chief ]]; do
    for w in a b c; do
      grep -Eq "$1" "$dir/$w.log" 2>/dev/null && chief=$w
    done
    for w in a b c; do
      p=pid_$w
      kill -0 "${!p}" 2>/dev/null || { echo "FAIL: worker $w ended early:"; tail -5 "$dir/$w.log"; exit 1; }
    done
    sleep 0.05
  done
  others=($(printf '%s\n' a b c | grep -v "^$chief$"))
}
# check_final ID WORKERS: ID finished with WORKERS workers and exact results.
check_final() {
  local line d e
  line=$(grep "^$1: final" "$dir/$1.log")
  echo "$line"
  [[ $line =~ workers=$2\  ]] || { echo "FAIL: $1 did not finish with $2 workers"; return 1; }
  d=$(sed -E 's/.*weight_diff=([^ ]+).*/\1/' <<<"$line")
  e=$(sed -E 's/.*count_error=([^ ]+).*/\1/' <<<"$line")
  awk -v d="$d" -v e="$e" 'BEGIN { exit !(d < 1e-5 && e < 0.01) }' ||
    { echo "FAIL: $1 weight_diff=$d count_error=$e"; return 1; }
}
# next_step ID SINCE_MS: ms from SINCE_MS to ID's first completed step after it.
next_step() {
  awk -v k="$2" -v id="$1:" '$1 == id && $2 == "step" { if ($5 > k) { print $5 - k; exit } }' \
    "$dir/$1.log"
}
# finish IDS...: waits for each worker; fails for a non-zero exit.
finish() {
  local w p rc=0
  for w in "$@"; do
    p=pid_$w
    if ! wait "${!p}"; then
      echo "FAIL: worker $w exited non-zero:"; tail -5 "$dir/$w.log"; rc=1
    fi
  done
  return $rc
}
# cluster_up: the namespace cluster (2 hosts) and a redis-server on the
# launcher; exit 77 where that cannot be.
cluster_up() {
  export DSC_PREFIX=${DSC_PREFIX:-dsct} DSC_NET=${DSC_NET:-1}
  command -v redis-server >/dev/null || { echo "SKIP: no redis-server (Debian package redis-server)"; exit 77; }
  if ! why=$(timeout 30 "$cluster" check); then
    echo "SKIP: cannot make the namespace cluster here: $why"
    exit 77
  fi
  timeout 60 "$cluster" down >/dev/null 2>&1
  timeout 60 "$cluster" --hosts 2 up >/dev/null || { echo "FAIL: cluster up"; exit 1; }
  trap 'cleanup; timeout 60 "$cluster" down >/dev/null 2>&1' EXIT
  store=198.18.$DSC_NET.254:6391
  ip netns exec "$DSC_PREFIX-l" redis-server --bind "198.18.$DSC_NET.254" --port 6391 \
    --save "" --appendonly no --protected-mode no >"$dir/redis.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do
    ip netns exec "$DSC_PREFIX-l" redis-cli -h "198.18.$DSC_NET.254" -p 6391 ping 2>/dev/null |
      grep -q PONG && return 0
    sleep 0.05
  done
  echo "FAIL: redis-server did not start"; cat "$dir/redis.log"; exit 1
}
# no_leftovers: no worker process in any namespace host.
no_leftovers() {
  local left
  left=$("$cluster" pids 2>/dev/null | xargs -r ps -o pid=,args= -p 2>/dev/null | grep elastic_check)
  [[ -z $left ]] || { echo "FAIL: processes left: $left"; return 1; }
}

case $kind in
  example)
    for w in a b c; do
      "$check" --strategy multi_worker --elastic --rendezvous "file://$dir/job" --min-workers 2 \
        --listen-host 127.0.0.1 --worker-id "$w" --epochs 2 --limit 12000 --test-limit 1000 \
        --batch 64 --timeout 10 --progress-seconds 0.1 >"$dir/$w.log" 2>&1 &
      pids+=($!)
      eval "pid_$w=$!"
    done
    # Mid-epoch: once the chief's progress line shows a step past 20 (the
    # chief is whichever worker arrived first).
    chief_by "step ([2-9][0-9]|[0-9]{3,})/"
    victim=${others[1]}
    p=pid_$victim
    kill -9 "${!p}"
    fail=0
    finish "$chief" "${others[0]}" || fail=1
    grep -E "^final: strategy=multi_worker replicas=2 epochs=2 test_accuracy=" "$dir/$chief.log" ||
      { echo "FAIL: no final line with 2 replicas from the chief $chief:"; tail -5 "$dir/$chief.log"; fail=1; }
    grep -E "^elastic: group 2, 2 workers \(0 joined, 1 left\)" "$dir/$chief.log" ||
      { echo "FAIL: the chief did not report the group change"; fail=1; }
    ((fail == 0)) && echo "PASS: elastic $kind"
    exit $fail
    ;;
  example_checkpoint)
    ck=$dir/ckpt
    # fm ID JOB EPOCHS: a worker of examples/fashion_mnist in the background.
    fm() {
      "$check" --strategy multi_worker --elastic --rendezvous "file://$dir/$2" --min-workers 2 \
        --listen-host 127.0.0.1 --worker-id "$1" --epochs "$3" --limit 6000 --test-limit 1000 \
        --batch 64 --timeout 10 --progress-seconds 0.1 --checkpoint-dir "$ck" \
        --checkpoint-every 10 >"$dir/$1.log" 2>&1 &
      pids+=($!)
      eval "pid_$1=$!"
    }
    fm a job1 2; fm b job1 2; fm c job1 2
    # The chief is the worker that prints the saves; killed after the one at step 20.
    chief_by "^checkpoint: saved .* at step 20$"
    p=pid_$chief
    kill -9 "${!p}"
    fail=0
    finish "${others[@]}" || fail=1
    new_chief=$(grep -l "^finished: saved" "$dir/${others[0]}.log" "$dir/${others[1]}.log" | head -1)
    [[ -n $new_chief ]] || { echo "FAIL: no survivor saved at the end"; tail -3 "$dir/${others[0]}.log" "$dir/${others[1]}.log"; exit 1; }
    grep -E "^(checkpoint|finished): saved" "$new_chief" | head -3
    # The new chief saved after the kill (steps past 20) and at the end.
    grep -Eq "^checkpoint: saved .* at step ([3-9][0-9]|[0-9]{3,})$" "$new_chief" ||
      { echo "FAIL: the new chief saved no checkpoint after the old one was killed"; fail=1; }
    last=$(sed -nE 's/^finished: saved .* at step ([0-9]+)$/\1/p' "$new_chief")
    grep -E "^final: strategy=multi_worker replicas=2 epochs=2 " "$new_chief" ||
      { echo "FAIL: no final line with 2 replicas from the new chief"; fail=1; }
    # A new job of two new workers, one epoch more: no state in memory, so
    # the group starts from the last checkpoint.
    fm d job2 3; fm e job2 3
    finish d e || fail=1
    resumed=$(grep -h "^resumed from " "$dir/d.log" "$dir/e.log")
    echo "$resumed"
    [[ $resumed =~ epoch\ 3,\ batch\ 0,\ step\ $last$ ]] ||
      { echo "FAIL: the new job did not resume at step $last"; fail=1; }
    grep -hE "^finished: saved .* at step $((last / 2 * 3))$" "$dir/d.log" "$dir/e.log" ||
      { echo "FAIL: the new job did not finish epoch 3 (step $((last / 2 * 3)))"; fail=1; }
    grep -hE "^final: strategy=multi_worker replicas=2 epochs=3 " "$dir/d.log" "$dir/e.log" ||
      { echo "FAIL: no final line from the new job"; fail=1; }
    # The killed chief's unfinished save left nothing behind.
    left=$(ls "$ck" | grep -E '\.tmp' || true)
    [[ -z $left ]] || { echo "FAIL: temporary files left in $ck: $left"; fail=1; }
    ((fail == 0)) && echo "PASS: elastic $kind"
    exit $fail
    ;;
  torch_example)
    ck=$dir/ckpt
    # tfm ID JOB EPOCHS: a worker of examples/torch_fashion_mnist in the background.
    tfm() {
      "$check" --strategy multi_worker --elastic --rendezvous "file://$dir/$2" --min-workers 2 \
        --listen-host 127.0.0.1 --worker-id "$1" --epochs "$3" --limit 3000 --test-limit 500 \
        --batch 64 --timeout 20 --checkpoint-dir "$ck" --checkpoint-every 10 >"$dir/$1.log" 2>&1 &
      pids+=($!)
      eval "pid_$1=$!"
    }
    tfm a job1 3; tfm b job1 3; tfm c job1 3
    # The chief prints the epoch lines; one of the others dies after the first.
    chief_by "^epoch 1/3 "
    p=pid_${others[1]}
    kill -9 "${!p}"
    fail=0
    finish "$chief" "${others[0]}" || fail=1
    grep -E "^final: strategy=multi_worker replicas=2 epochs=3 " "$dir/$chief.log" ||
      { echo "FAIL: no final line with 2 replicas from the chief $chief:"; tail -5 "$dir/$chief.log"; fail=1; }
    grep -E "^elastic: group 2, 2 workers \(0 joined, 1 left\)" "$dir/$chief.log" ||
      { echo "FAIL: the chief did not report the group change"; fail=1; }
    last=$(sed -nE 's/^finished: saved .* at step ([0-9]+)$/\1/p' "$dir/$chief.log")
    [[ -n $last ]] || { echo "FAIL: the chief saved nothing at the end"; exit 1; }
    tfm d job2 4; tfm e job2 4
    finish d e || fail=1
    resumed=$(grep -h "^resumed from " "$dir/d.log" "$dir/e.log")
    echo "$resumed"
    [[ $resumed =~ epoch\ 4,\ batch\ 0,\ step\ $last$ ]] ||
      { echo "FAIL: the new job did not resume at step $last"; fail=1; }
    grep -hE "^final: strategy=multi_worker replicas=2 epochs=4 " "$dir/d.log" "$dir/e.log" ||
      { echo "FAIL: no final line from the new job"; fail=1; }
    ((fail == 0)) && echo "PASS: elastic $kind"
    exit $fail
    ;;
  deterministic)
    common=(--rows 512 --batch 48 --epochs 12 --settle-ms 1000 --timeout-ms 5000
      --listen-host 127.0.0.1)
    on=(--min-workers 1 --deterministic-across-workers 12 --save "$dir/out")
    # The reference: one worker, never interrupted.
    "$check" --rendezvous "file://$dir/ref" --id ref "${common[@]}" "${on[@]}" --max-workers 1 \
      >"$dir/ref.log" 2>&1 || { echo "FAIL: the uninterrupted run:"; tail -5 "$dir/ref.log"; exit 1; }
    grep "^ref: final" "$dir/ref.log"
    # With the mode off, 1 and 3 workers (uninterrupted) end with other bits.
    off=(--deterministic-across-workers 0 --save "$dir/off")
    "$check" --rendezvous "file://$dir/off1" --id one "${common[@]}" "${off[@]}" --max-workers 1 \
      >"$dir/one.log" 2>&1 || { echo "FAIL: the run with the mode off:"; tail -5 "$dir/one.log"; exit 1; }
    for w in x y z; do
      "$check" --rendezvous "file://$dir/off3" --id "$w" "${common[@]}" "${off[@]}" --min-workers 3 \
        --max-workers 3 >"$dir/$w.log" 2>&1 &
      pids+=($!)
      eval "pid_$w=$!"
    done
    finish x y z || exit 1
    if cmp -s "$dir/off.one" "$dir/off.x"; then
      echo "FAIL: with the mode off, 1 and 3 workers gave the same bytes (the check cannot tell)"
      exit 1
    fi
    echo "mode off: 1 and 3 workers differ (as expected)"
    djob() {
      "$check" --rendezvous "file://$dir/job" --id "$1" "${common[@]}" "${on[@]}" --step-delay-ms 40 \
        >"$dir/$1.log" 2>&1 &
      pids+=($!)
      eval "pid_$1=$!"
    }
    djob a; djob b; djob c  # one group of 3 (they arrive within the settle time)
    wait_count "$dir/c.log" "^c: step [0-9]+ at" 15 60 || exit 1
    kill -9 "$pid_c"
    wait_for "$dir/a.log" "^a: group [0-9]+ rank [0-9] of 2" 30 || exit 1
    n=$(grep -c "^a: step" "$dir/a.log")
    wait_count "$dir/a.log" "^a: step [0-9]+ at" $((n + 5)) 30 || exit 1
    kill -9 "$pid_b"
    wait_for "$dir/a.log" "^a: group [0-9]+ rank [0-9] of 1" 30 || exit 1
    n=$(grep -c "^a: step" "$dir/a.log")
    wait_count "$dir/a.log" "^a: step [0-9]+ at" $((n + 5)) 30 || exit 1
    djob d
    fail=0
    finish a d || fail=1
    grep -h "^[ad]: group" "$dir/a.log" "$dir/d.log"
    for w in a d; do
      line=$(grep "^$w: final" "$dir/$w.log")
      echo "$line"
      [[ $line =~ workers=2\  ]] || { echo "FAIL: $w did not finish with 2 workers"; fail=1; }
      cmp "$dir/out.ref" "$dir/out.$w" ||
        { echo "FAIL: $w's final variables differ from the uninterrupted run's"; fail=1; }
    done
    ((fail == 0)) && echo "PASS: elastic $kind (a's and d's variables: the same bytes as the uninterrupted run's)"
    exit $fail
    ;;
  joiner_killed)
    for w in a b; do  # 8 epochs: the group still trains when the third joiner comes
      "$check" --rendezvous "file://$dir/job" --id "$w" --listen-host 127.0.0.1 "${common[@]}" \
        --epochs 8 --step-delay-ms 40 >"$dir/$w.log" 2>&1 &
      pids+=($!)
      eval "pid_$w=$!"
    done
    wait_for "$dir/a.log" "^a: step 5 at" 60 || exit 1
    fail=0
    for j in j1 j2 j3; do
      # Started and watched from one process: the waiting lasts until the
      # chief's next look (join_poll, 100 ms), too short for a shell loop.
      python3 - "$dir" "$j" "$check" --rendezvous "file://$dir/job" --id "$j" \
        --listen-host 127.0.0.1 "${common[@]}" --epochs 8 <<'PY' || fail=1
import signal, subprocess, sys, time
d, j, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
p = subprocess.Popen(cmd, stdout=open(f"{d}/{j}.log", "w"), stderr=subprocess.STDOUT)
t0 = time.time()
while time.time() - t0 < 30:
    try:
        rec = open(f"{d}/job.membership").read()
    except OSError:
        rec = ""
    if f"\nwaiting {j}\n" in rec:
        p.send_signal(signal.SIGKILL)
        p.wait()
        print(f"{j}: killed while listed as waiting")
        sys.exit(0)
    if p.poll() is not None or f"\nmember {j}\n" in rec:
        break
    time.sleep(0.0005)
p.kill()
p.wait()
print(f"FAIL: {j} was never seen waiting (admitted or gone first)")
sys.exit(1)
PY
      # The group re-forms once for it and declares it dead.
      wait_for "$dir/job.membership" "^dead $j$" 30 || fail=1
    done
    finish a b || fail=1
    for w in a b; do check_final "$w" 2 || fail=1; done
    dead=$(grep -c "^dead j" "$dir/job.membership")
    waiting=$(grep -c "^waiting" "$dir/job.membership")
    changes=$(grep -c "re-forming" "$dir/a.log")
    echo "record: $dead dead joiners, $waiting waiting; a re-formed $changes times"
    ((dead == 3 && waiting == 0)) || { echo "FAIL: the killed joiners are not all dead"; fail=1; }
    ((changes <= 3)) || { echo "FAIL: $changes re-formations for 3 joiners"; fail=1; }
    ((fail == 0)) && echo "PASS: elastic $kind"
    exit $fail
    ;;
  left_behind)
    common=(--min-workers 2 --rows 512 --batch 32 --settle-ms 1000 --timeout-ms 2000)
    start a; start b; start c
    wait_for "$dir/c.log" "^c: step 1[0-9] at" 60 || exit 1
    kill -STOP "$pid_c"
    fail=0
    finish a b || fail=1
    for w in a b; do check_final "$w" 2 || fail=1; done
    cont_ms=$(ms)
    kill -CONT "$pid_c"
    for _ in $(seq 200); do kill -0 "$pid_c" 2>/dev/null || break; sleep 0.05; done
    if kill -0 "$pid_c" 2>/dev/null; then
      echo "FAIL: c still waits 10 s after it was continued"; fail=1
    else
      wait "$pid_c" && { echo "FAIL: c exited 0"; fail=1; }
      grep -q "took part in the run in file://.*, which has ended" "$dir/c.log" ||
        { echo "FAIL: c's error:"; tail -2 "$dir/c.log"; fail=1; }
      echo "bar: continued -> c told its run ended in $(($(ms) - cont_ms)) ms"
    fi
    ((fail == 0)) && echo "PASS: elastic $kind"
    exit $fail
    ;;
  stopped)
    start a; start b; start c
    wait_for "$dir/a.log" "^a: step 1[0-9] at" 60 || exit 1
    kill -STOP "$pid_c"
    wait_for "$dir/a.log" "^a: group [0-9]+ rank [0-9] of 2" 30 || exit 1
    kill -CONT "$pid_c"
    fail=0
    wait_for "$dir/c.log" "joining again as 'c.r1'" 30 || fail=1
    wait_for "$dir/a.log" "^a: group [0-9]+ rank [0-9] of 3" 60 || fail=1
    finish a b c || fail=1
    for w in a b c; do check_final "$w" 3 || fail=1; done
    grep -h "elastic:" "$dir/c.log" | head -3
    ((fail == 0)) && echo "PASS: elastic $kind"
    exit $fail
    ;;
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
  kill | kill_zero | kills3)
    # kills3 runs ELASTIC_KILLS rounds (default 3; the bar's 20 by hand).
    rounds=1 epochs=6
    [[ $kind == kill_zero ]] && extra=(--zero-adam)
    if [[ $kind == kills3 ]]; then
      rounds=${ELASTIC_KILLS:-3}
      epochs=$((10 + 4 * (rounds > 3 ? rounds - 3 : 0)))
    fi
    cluster_up
    live=(h0a h0b h1a h1b)
    for w in "${live[@]}"; do start_on "${w:1:1}" "$w"; done
    for w in "${live[@]}"; do wait_for "$dir/$w.log" "^$w: step 1[0-9] at" 60 || exit 1; done
    fail=0
    for ((round = 1; round <= rounds; ++round)); do
      if [[ $kind != kills3 ]]; then victim=h1b; else victim=${live[RANDOM % ${#live[@]}]}; fi
      # A survivor that saw every change so far: one of the first workers.
      survivor=$(printf '%s\n' "${live[@]}" | grep -v "^$victim$" | grep -E '^h[01][ab]$' | head -1)
      [[ -n $survivor ]] || survivor=$(printf '%s\n' "${live[@]}" | grep -v "^$victim$" | head -1)
      seen3=$(grep -Ec "^$survivor: group [0-9]+ rank [0-9] of 3" "$dir/$survivor.log")
      seen4=$(grep -Ec "^$survivor: group [0-9]+ rank [0-9] of 4" "$dir/$survivor.log")
      kill_ms=$(ms)
      p=pid_$victim
      kill -9 "${!p}"
      wait "${!p}" 2>/dev/null
      live=($(printf '%s\n' "${live[@]}" | grep -v "^$victim$"))
      wait_count "$dir/$survivor.log" "^$survivor: group [0-9]+ rank [0-9] of 3" $((seen3 + 1)) 30 ||
        exit 1
      until [[ -n $(next_step "$survivor" "$kill_ms") ]]; do sleep 0.05; done
      echo "bar: round $round: kill -9 $victim -> $survivor's next step in $(next_step "$survivor" "$kill_ms") ms"
      newcomer=${victim:0:2}n$round
      join_ms=$(ms)
      start_on "${victim:1:1}" "$newcomer"
      live+=("$newcomer")
      wait_for "$dir/$newcomer.log" "^$newcomer: step [0-9]+ at" 60 || exit 1
      echo "bar: round $round: $newcomer started -> its first step in $(next_step "$newcomer" "$join_ms") ms"
      # The next round once everyone trains in the group of 4 again.
      wait_count "$dir/$survivor.log" "^$survivor: group [0-9]+ rank [0-9] of 4" $((seen4 + 1)) 30 ||
        exit 1
    done
    finish "${live[@]}" || fail=1
    for w in "${live[@]}"; do check_final "$w" 4 || fail=1; done
    no_leftovers || fail=1
    ((fail == 0)) && echo "PASS: elastic $kind"
    exit $fail
    ;;
  host_dies | link_down)
    epochs=6
    cluster_up
    for w in h0a h0b h1a h1b; do start_on "${w:1:1}" "$w"; done
    for w in h0a h0b h1a h1b; do wait_for "$dir/$w.log" "^$w: step 1[0-9] at" 60 || exit 1; done
    fault_ms=$(ms)
    if [[ $kind == host_dies ]]; then
      "$cluster" kill 1
    else
      "$cluster" link 1 down
    fi
    fail=0
    finish h0a h0b || fail=1
    for w in h0a h0b; do check_final "$w" 2 || fail=1; done
    echo "bar: $kind -> h0a's next step in $(next_step h0a "$fault_ms") ms"
    if [[ $kind == link_down ]]; then
      # Host 1's side reaches neither its peers nor the store: it stops,
      # naming the store, within the deadline and the store's timeout.
      for w in h1a h1b; do
        p=pid_$w
        if wait "${!p}"; then echo "FAIL: $w finished on the cut-off side"; fail=1; fi
        grep -q "redis://$store/job" "$dir/$w.log" ||
          { echo "FAIL: $w's error does not name the store:"; tail -3 "$dir/$w.log"; fail=1; }
        tail -1 "$dir/$w.log"
      done
      echo "bar: link_down -> host 1's workers stopped $(($(ms) - fault_ms)) ms after the cut"
    fi
    no_leftovers || fail=1
    ((fail == 0)) && echo "PASS: elastic $kind"
    exit $fail
    ;;
  *)
    echo "elastic_cell.sh: unknown kind '$kind'" >&2
    exit 2
    ;;
esac
