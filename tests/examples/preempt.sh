# Sourced by the resume tests: preemption of a training run, every wait bounded.
#
# preempt_after_first_checkpoint LOG DIR CMD...
#   Starts CMD in the background (output to LOG), waits at most 120 s for its
#   first checkpoint (DIR/latest), sends it SIGTERM, and waits at most 120 s
#   for it to exit. Sets preempt_rc to its exit status. Fails the test (the
#   log shown) when no checkpoint comes or the run outlives the wait; a run
#   still going when the script exits is killed. Needs $work (removed at exit).
# Under mpirun, SIGTERM goes to mpirun: Open MPI 4.1 then sends the ranks
# SIGCONT, SIGTERM after OMPI_MCA_odls_base_sigkill_timeout (T) seconds and
# SIGKILL after another T; mpirun itself exits 1 after it was signalled,
# whatever the ranks returned.
preempt_after_first_checkpoint() {
  local log=$1 dir=$2
  shift 2
  "$@" > "$log" 2>&1 &
  local pid=$!  # the program (or mpirun) itself, not a subshell
  trap 'kill -KILL '"$pid"' 2>/dev/null || true; rm -rf "$work"' EXIT
  for _ in $(seq 1200); do
    test -f "$dir/latest" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  test -f "$dir/latest" || { echo "FAIL: no checkpoint within 120 s of the start"; cat "$log"; exit 1; }
  kill -TERM "$pid"
  for _ in $(seq 1200); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid" 2>/dev/null || true
    echo "FAIL: still running 120 s after SIGTERM"; cat "$log"; exit 1
  fi
  preempt_rc=0
  wait "$pid" || preempt_rc=$?
}
