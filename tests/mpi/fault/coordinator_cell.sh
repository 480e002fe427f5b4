#!/usr/bin/env bash
# ClusterCoordinator fault cells (docs/parameter_server.md, "Coordinator"):
#   coordinator_cell.sh MPIEXEC CHECK stopped|killed
# Runs CHECK (diststrat_coordinator_check) under `MPIEXEC -np 4`: worker 0
# coordinates, workers 1 and 2 serve, rank 3 is the PS; function timeout
# 1 s. Once the functions are scheduled, worker 2 is stopped (SIGSTOP) for
# 3 s and continued. Passes when mpirun exits 0 within 60 s and the
# coordinator's final line says every function's result arrived exactly once
# (delivered = functions, each value checked), at least one function ran
# again (reruns >= 1) and the stopped worker's late result was refused
# (late_refused >= 1).
# killed: the same job started without a launcher, one process per task with
# its own TF_CONFIG (3 workers, 1 PS, over the library's TCP mesh, with
# ParameterServerOptions::survive_worker_loss): once the functions are
# scheduled, worker 2 is killed (SIGKILL) and worker 1 is stopped for 3 s
# and continued. Passes when the coordinator, worker 1 and the PS exit 0
# within 60 s, the final line is as above (every result once, reruns >= 1,
# late_refused >= 1), and the PS names the lost worker.
# (Under mpirun a killed worker cannot be shown: Open MPI ends the whole job
# when a process dies.)
set -u
if (($# != 3)); then
  echo "usage: $0 MPIEXEC CHECK stopped" >&2
  exit 2
fi
mpiexec=$1 check=$2 kind=$3
[[ $kind == stopped || $kind == killed ]] || { echo "unknown kind $kind" >&2; exit 2; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/diststrat_coordinator_XXXXXX")
job=
pids=()
cleanup() {
  [[ -n $job ]] && kill -9 "$job" 2>/dev/null
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  # The job's own processes (the pids above are their `timeout` wrappers).
  for f in "$dir"/*.pid; do
    [[ -f $f ]] || continue
    p=$(cat "$f")
    # (Only while the pid is still this job's program: a pid may be reused.)
    if [[ -r /proc/$p/cmdline ]] && tr '\0' ' ' 2>/dev/null <"/proc/$p/cmdline" | grep -q -- "--pid-dir $dir"; then
      kill -CONT "$p" 2>/dev/null
      kill -9 "$p" 2>/dev/null
    fi
  done
  wait 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$dir"/*log; do [[ -f $f ]] && { echo "--- $(basename "$f")"; tail -c 3000 "$f"; }; done
  exit 1
}
if [[ $kind == killed ]]; then
  # Not an MPI job: nothing of Open MPI's may leak in from the caller.
  for v in $(env | grep -o '^\(OMPI\|PMIX\|PMI\|SLURM\)_[A-Za-z0-9_]*'); do unset "$v"; done
  port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
  cluster="{\"worker\": [\"127.0.0.1:$(port)\", \"127.0.0.1:$(port)\", \"127.0.0.1:$(port)\"], \"ps\": [\"127.0.0.1:$(port)\"]}"
  for task in worker:0 worker:1 worker:2 ps:0; do
    TF_CONFIG="{\"cluster\": $cluster, \"task\": {\"type\": \"${task%:*}\", \"index\": ${task#*:}}}" \
      timeout -s KILL 60 "$check" --functions 40 --sleep-ms 50 --function-timeout-ms 1000 \
      --timeout-ms 6000 --pid-dir "$dir" --expect-late 1 --survive 1 >"$dir/${task%:*}${task#*:}.log" 2>&1 &
    pids+=($!)
  done
  t0=$SECONDS
  until grep -q 'scheduled' "$dir/worker0.log" 2>/dev/null && [[ -s $dir/worker2.pid && -s $dir/worker1.pid ]]; do
    ((SECONDS - t0 > 30)) && fail "the coordinator never scheduled"
    kill -0 "${pids[0]}" 2>/dev/null || fail "the coordinator ended before the faults"
    sleep 0.1
  done
  sleep 0.5
  kill -9 "$(cat "$dir/worker2.pid")" || fail "could not kill worker 2"
  echo "killed worker 2 (SIGKILL)"
  w1=$(cat "$dir/worker1.pid")
  kill -STOP "$w1" || fail "could not stop worker 1"
  echo "stopped worker 1 (pid $w1) for 3 s"
  sleep 3
  kill -CONT "$w1"
  rcs=()
  for i in 0 1 3; do
    wait "${pids[$i]}"
    rcs+=($?)
  done
  wait "${pids[2]}" 2>/dev/null
  pids=()
  [[ ${rcs[*]} == "0 0 0" ]] || fail "exit codes ${rcs[*]} (worker 0, worker 1, ps 0)"
  final=$(grep '^final:' "$dir/worker0.log")
  [[ $final =~ delivered=40\ .*reruns=([0-9]+)\ late_refused=([0-9]+).*OK ]] ||
    fail "the final line is not OK: '$final'"
  ((BASH_REMATCH[1] >= 1)) || fail "no function ran again: $final"
  ((BASH_REMATCH[2] >= 1)) || fail "no late result was refused: $final"
  grep -q 'worker1: served' "$dir/worker1.log" || fail "worker 1 did not end well"
  grep -q 'ps0: OK' "$dir/ps0.log" || fail "the PS did not end well"
  echo "PASS: $final"
  echo "PS: $(grep -m1 'ps0: OK' "$dir/ps0.log" | cut -c1-300)"
  exit 0
fi
timeout -s KILL 60 "$mpiexec" -np 4 --oversubscribe --bind-to none "$check" --functions 40 \
  --sleep-ms 100 --function-timeout-ms 1000 --timeout-ms 20000 --pid-dir "$dir" \
  --expect-late 1 >"$dir/log" 2>&1 &
job=$!
t0=$SECONDS
until grep -q 'scheduled' "$dir/log" 2>/dev/null && [[ -s $dir/worker2.pid ]]; do
  ((SECONDS - t0 > 30)) && fail "the coordinator never scheduled"
  kill -0 "$job" 2>/dev/null || fail "the job ended before the fault"
  sleep 0.1
done
sleep 0.5
pid=$(cat "$dir/worker2.pid")
kill -STOP "$pid" || fail "could not stop worker 2 (pid $pid)"
echo "stopped worker 2 (pid $pid) for 3 s"
sleep 3
kill -0 "$job" 2>/dev/null || fail "the job ended while worker 2 was stopped"
kill -CONT "$pid"
wait "$job"
rc=$?
job=
((rc == 0)) || fail "mpirun exited $rc"
final=$(grep '^final:' "$dir/log")
[[ $final =~ delivered=40\ .*reruns=([0-9]+)\ late_refused=([0-9]+).*OK ]] ||
  fail "the final line is not OK: '$final'"
((BASH_REMATCH[1] >= 1)) || fail "no function ran again: $final"
((BASH_REMATCH[2] >= 1)) || fail "no late result was refused: $final"
grep -q 'worker1: served' "$dir/log" && grep -q 'worker2: served' "$dir/log" && grep -q 'ps0: OK' "$dir/log" ||
  fail "a process did not end well"
echo "PASS: $final"
