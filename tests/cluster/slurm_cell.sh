#!/usr/bin/env bash
# Slurm cells on a real slurmctld/slurmd cluster over the namespace hosts
# (scripts/slurm_cluster.sh), run by ctest (label slurm):
#   slurm_cell.sh SLURM_CLUSTER_SH BIN_DIR KIND
# BIN_DIR holds the examples (fashion_mnist, torch_fashion_mnist). 2 hosts.
# KIND:
#   launch   srun --mpi=pmix launches the examples across the hosts: 2 x 1
#            multi_worker ends with the same final checkpoint, byte for byte,
#            as mpirun -np 2 over the same hosts with the same flags; 2 x 2
#            multi_worker resolves its cluster from Slurm on every task and
#            takes the hierarchical path; -c 2 gives each task 2 replicas;
#            parameter_server with the last task as PS; the LibTorch example
#   requeue  sbatch --requeue; the steps get SIGTERM (scancel --signal=TERM,
#            what --signal=TERM@N does before the time limit): every rank
#            saves at one step and exits 0; scontrol requeue starts the job
#            again, it resumes and its final checkpoint is byte-identical to
#            an uninterrupted run's. Then scancel mid-run ends every task
#            within the deadline, nothing left on any host.
#   fault    host 1's tasks are killed mid-training (slurmd stays): srun
#            exits non-zero within the deadline + 10 s, the output names
#            rank 1 or host 1, nothing is left running on any host
#   link_down  host 1's cable pulled mid-training: every task ends within
#            the deadline + 10 s, rank 0 naming rank 1; srun returns once
#            Slurm declares the node failed (SlurmdTimeout 10 s here)
#   elastic  srun (no MPI, --kill-on-bad-exit=0) starts 2 x 2 elastic workers
#            of fashion_mnist with a redis-server on the launcher as the
#            store; one task on host 1 is killed mid-epoch: the step goes on,
#            the other three re-form and train; a second srun starts a
#            worker on host 1, which joins: the chief ends with 4 replicas
# Exit 77 (ctest: skipped) with the reason where the cluster cannot be made.
set -u
if (($# < 3)); then
  echo "usage: $0 SLURM_CLUSTER_SH BIN_DIR KIND" >&2
  exit 2
fi
slurm=$1 bin=$2 kind=$3
export DSC_PREFIX=${DSC_PREFIX:-dsls} DSC_NET=${DSC_NET:-2}
cluster=$(dirname "$slurm")/cluster.sh
if ! why=$(timeout 30 "$slurm" check); then
  echo "SKIP: cannot make the Slurm cluster here: $why"
  exit 77
fi
# On a file system every host sees (the build tree's, like a cluster's
# shared home), not in a host's own TmpFS.
work=$(mktemp -d "${TMPDIR:-/tmp}/diststrat_slurm_XXXXXX")
# The workers' flight records go here, not to /tmp (srun passes the
# environment on).
export DISTSTRAT_FLIGHT_RECORDER_DIR=$work/flight-records
cleanup() {
  timeout 60 "$slurm" down >/dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
timeout 60 "$slurm" down >/dev/null 2>&1  # a previous crash's leftovers
timeout 60 "$slurm" --hosts 2 --cpus 4 up || { echo "FAIL: slurm up"; exit 1; }
subnet=198.18.$DSC_NET.0/24
# Open MPI over the cluster's links only (a real cluster's default interfaces
# do this); srun passes the caller's environment to the tasks.
export OMPI_MCA_btl=tcp,self,vader OMPI_MCA_btl_tcp_if_include=$subnet \
  OMPI_MCA_oob_tcp_if_include=$subnet OMPI_MCA_pml=ob1 \
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The strategies' set-up lines say where the cluster came from.
export DISTSTRAT_LOG_LEVEL=info

fail() { echo "FAIL: $*"; exit 1; }
expect() {  # expect N PATTERN FILE
  local n
  n=$(grep -cE "$2" "$3" || true)
  ((n == $1)) || { cat "$3"; fail "$n lines match '$2' in $3, expected $1"; }
}
# Nothing of ours left on any host.
no_leftovers() {
  local pids p
  pids=$("$cluster" pids 2>/dev/null || true)
  for p in $pids; do
    if grep -qE "fashion_mnist|diststrat" "/proc/$p/cmdline" 2>/dev/null; then
      ps -o pid,args -p "$p"
      fail "a task is still running after $1"
    fi
  done
}
srun_() { timeout 300 "$slurm" srun --mpi=pmix "$@"; }
flags=(--strategy multi_worker --epochs 1 --limit 2000 --test-limit 500 --batch 64)
# A training that runs until it is stopped, 2 x 1 tasks with a 2 s deadline,
# in the background (srun_pid), logging to $1; returns once it is training.
timeout_s=2
start_training() {
  srun_ -N 2 --ntasks-per-node=1 "$bin/fashion_mnist" --strategy multi_worker \
    --limit 256 --test-limit 500 --epochs 1000000 --batch 32 --timeout $timeout_s >"$1" 2>&1 &
  srun_pid=$!
  for ((i = 0; i < 300; ++i)); do
    grep -q "step" "$1" 2>/dev/null && break
    sleep 0.1
  done
  sleep 1
}

case $kind in
  launch)
    srun_ -N 2 --ntasks-per-node=1 "$bin/fashion_mnist" "${flags[@]}" \
      --checkpoint-dir "$work/srun" >"$work/srun.log" 2>&1 || { cat "$work/srun.log"; fail "srun 2x1"; }
    expect 2 "\(cluster from slurm\)" "$work/srun.log"
    timeout 300 "$cluster" run --ppn 1 --hosts-used 2 -- "$bin/fashion_mnist" "${flags[@]}" \
      --checkpoint-dir "$work/mpirun" >"$work/mpirun.log" 2>&1 || { cat "$work/mpirun.log"; fail "mpirun 2x1"; }
    a=$(grep -h "^final:" "$work/srun.log") b=$(grep -h "^final:" "$work/mpirun.log")
    echo "srun:   $a"
    echo "mpirun: $b"
    last=$(ls "$work/mpirun" | grep -E '^ckpt-[0-9]+\.safetensors$' | sort -t- -k2 -n | tail -1)
    [[ -n $last ]] || fail "no checkpoint from mpirun"
    cmp "$work/srun/$last" "$work/mpirun/$last" || fail "srun and mpirun final checkpoints differ"
    [[ ${a% samples_per_sec*} == "${b% samples_per_sec*}" ]] || fail "final lines differ"
    echo "ok: srun -N 2 --ntasks-per-node=1 = mpirun -np 2 ($last identical)"

    srun_ -N 2 --ntasks-per-node=2 "$bin/fashion_mnist" "${flags[@]}" >"$work/x2.log" 2>&1 ||
      { cat "$work/x2.log"; fail "srun 2x2"; }
    expect 4 "worker [0-3] of 4 \(cluster from slurm\).* node [01] of 2, hierarchical" "$work/x2.log"
    expect 1 "^final:" "$work/x2.log"
    echo "ok: srun -N 2 --ntasks-per-node=2: 4 tasks from Slurm, hierarchical"

    srun_ -N 2 -n 2 -c 2 "$bin/fashion_mnist" "${flags[@]}" >"$work/c2.log" 2>&1 ||
      { cat "$work/c2.log"; fail "srun -c 2"; }
    expect 2 "2 local replica\(s\), 4 in sync" "$work/c2.log"
    echo "ok: srun -c 2: 2 replicas per task"

    srun_ -N 2 --ntasks-per-node=2 "$bin/fashion_mnist" --strategy parameter_server --ps 1 \
      --epochs 1 --limit 2000 --test-limit 500 >"$work/ps.log" 2>&1 || { cat "$work/ps.log"; fail "srun PS"; }
    expect 1 "rank 3 of 4 is PS 0" "$work/ps.log"
    expect 1 "^final:" "$work/ps.log"
    echo "ok: srun parameter_server, PS = the last task"

    if [[ -x $bin/torch_fashion_mnist ]]; then
      srun_ -N 2 --ntasks-per-node=1 "$bin/torch_fashion_mnist" "${flags[@]}" >"$work/torch.log" 2>&1 ||
        { cat "$work/torch.log"; fail "srun LibTorch example"; }
      expect 2 "\(cluster from slurm\)" "$work/torch.log"
      expect 1 "^final:" "$work/torch.log"
      echo "ok: srun LibTorch example"
    fi
    no_leftovers "the launches"
    ;;

  requeue)
    cat >"$work/job.sh" <<EOF
#!/bin/sh
#SBATCH -N 2 --ntasks-per-node=1 --requeue --open-mode=append
# Every start of the job (the first and each requeue) resumes from the latest
# checkpoint in the directory.
echo "start \$SLURM_RESTART_COUNT"
srun --mpi=pmix "$bin/fashion_mnist" --strategy multi_worker --limit 256 --test-limit 500 \\
  --epochs \$EPOCHS --batch 32 --checkpoint-every 250 --max-steps \$STEPS --checkpoint-dir "$work/job"
EOF
    # The reference: the same steps, uninterrupted.
    srun_ -N 2 --ntasks-per-node=1 "$bin/fashion_mnist" --strategy multi_worker --limit 256 \
      --test-limit 500 --epochs 1000000 --batch 32 --checkpoint-every 250 --max-steps 2000 \
      --checkpoint-dir "$work/ref" >"$work/ref.log" 2>&1 || { cat "$work/ref.log"; fail "reference run"; }
    id=$(EPOCHS=1000000 STEPS=2000 "$slurm" client sbatch --parsable -o "$work/job.log" "$work/job.sh") ||
      fail "sbatch"
    # Preempt once its first checkpoint exists.
    for ((i = 0; i < 600; ++i)); do
      ls "$work/job" 2>/dev/null | grep -q '^ckpt-' && break
      sleep 0.1
    done
    ls "$work/job" | grep -q '^ckpt-' || { cat "$work/job.log"; fail "no first checkpoint"; }
    "$slurm" client scancel --signal=TERM "$id" || fail "scancel --signal=TERM"
    state=""
    for ((i = 0; i < 300; ++i)); do
      state=$("$slurm" client squeue -h -j "$id" -o %T 2>/dev/null || true)
      [[ -z $state ]] && break
      sleep 0.1
    done
    [[ -z $state ]] || fail "the job is still $state 30 s after SIGTERM"
    expect 1 "preempted: saved .* at step" "$work/job.log"
    "$slurm" client scontrol requeue "$id" || fail "scontrol requeue"
    for ((i = 0; i < 900; ++i)); do
      state=$("$slurm" client squeue -h -j "$id" -o %T 2>/dev/null || true)
      [[ -z $state ]] && grep -q "^start 1" "$work/job.log" && break
      sleep 0.1
    done
    [[ -z $state ]] || fail "the requeued job is still $state after 90 s"
    expect 1 "resumed from" "$work/job.log"
    final=$(ls "$work/ref" | grep -E '^ckpt-[0-9]+\.safetensors$' | sort -t- -k2 -n | tail -1)
    cmp "$work/ref/$final" "$work/job/$final" || { cat "$work/job.log"; fail "preempted, requeued and resumed: $final differs"; }
    echo "ok: TERM, requeue, resume: $final identical to the uninterrupted run"

    # scancel mid-run: every task ends, on every host.
    EPOCHS=1000000 STEPS=100000000 "$slurm" client sbatch --parsable -o "$work/cancel.log" \
      --export=ALL "$work/job.sh" >"$work/cancel.id" || fail "sbatch"
    id=$(cat "$work/cancel.id")
    for ((i = 0; i < 300; ++i)); do
      [[ $("$slurm" client squeue -h -j "$id" -o %T 2>/dev/null) == RUNNING ]] && break
      sleep 0.1
    done
    sleep 2
    t0=$(date +%s)
    "$slurm" client scancel "$id" || fail "scancel"
    for ((i = 0; i < 300; ++i)); do
      [[ -z $("$slurm" client squeue -h -j "$id" -o %T 2>/dev/null) ]] && break
      sleep 0.1
    done
    no_leftovers "scancel"
    echo "ok: scancel ended every task within $(($(date +%s) - t0)) s"
    ;;

  fault)
    start_training "$work/fault.log"
    victims=""
    for p in $("$cluster" pids "${DSC_PREFIX}-h1" 2>/dev/null); do
      grep -q fashion_mnist "/proc/$p/cmdline" 2>/dev/null && victims="$victims $p"
    done
    [[ -n $victims ]] || { cat "$work/fault.log"; fail "no task on host 1"; }
    t0=$(date +%s.%N)
    kill -KILL $victims
    wait "$srun_pid"
    rc=$?
    t1=$(date +%s.%N)
    took=$(echo "$t1 - $t0" | bc)
    ((rc != 0)) || { cat "$work/fault.log"; fail "srun exited 0 after host 1's task was killed"; }
    (($(echo "$took <= $timeout_s + 10" | bc))) || { cat "$work/fault.log"; fail "took $took s"; }
    grep -qE "rank 1|${DSC_PREFIX}-h1" "$work/fault.log" || { cat "$work/fault.log"; fail "nothing names rank 1 or ${DSC_PREFIX}-h1"; }
    no_leftovers "the fault"
    echo "ok: host 1's task killed: srun exit $rc after $took s, named:"
    grep -E "rank 1|${DSC_PREFIX}-h1" "$work/fault.log" | head -3
    ;;
  link_down)
    # Host 1's cable pulled mid-training, for good. The library's part: both
    # tasks end within the deadline + 10 s (rank 0 naming rank 1; rank 1,
    # cut off, on its own deadline). srun's part: it returns once slurmctld
    # declares the node failed (SlurmdTimeout, 10 s in this cluster; 300 s by
    # default), since host 1's slurmstepd cannot report its task's exit.
    start_training "$work/link.log"
    t0=$(date +%s.%N)
    "$cluster" link "${DSC_PREFIX}-h1" down
    gone=""
    while [[ -z $gone ]] && (($(echo "$(date +%s.%N) - $t0 < $timeout_s + 10" | bc))); do
      gone=yes  # the tasks on the hosts (srun on the launcher host names the program too)
      for p in $("$cluster" pids "${DSC_PREFIX}-h0" 2>/dev/null) $("$cluster" pids "${DSC_PREFIX}-h1" 2>/dev/null); do
        grep -q fashion_mnist "/proc/$p/cmdline" 2>/dev/null && gone=""
      done
      sleep 0.2
    done
    took=$(echo "$(date +%s.%N) - $t0" | bc)
    [[ -n $gone ]] || { cat "$work/link.log"; fail "tasks still running $took s after the link went down"; }
    wait "$srun_pid"
    rc=$?
    srun_took=$(echo "$(date +%s.%N) - $t0" | bc)
    ((rc != 0)) || { cat "$work/link.log"; fail "srun exited 0"; }
    (($(echo "$srun_took <= $timeout_s + 10 + 15" | bc))) || fail "srun returned after $srun_took s"
    grep -q "rank 1" "$work/link.log" || { cat "$work/link.log"; fail "nothing names rank 1"; }
    echo "ok: host 1's link down: every task ended within $took s, srun exit $rc after $srun_took s"
    grep -E "rank 1|${DSC_PREFIX}-h1" "$work/link.log" | head -3
    ;;
  elastic)
    command -v redis-server >/dev/null || { echo "SKIP: no redis-server (Debian package redis-server)"; exit 77; }
    store=198.18.$DSC_NET.254:6392
    ip netns exec "$DSC_PREFIX-l" redis-server --bind "198.18.$DSC_NET.254" --port 6392 \
      --save "" --appendonly no --protected-mode no >"$work/redis.log" 2>&1 &
    redis_pid=$!
    trap 'kill -9 $redis_pid 2>/dev/null; wait $redis_pid 2>/dev/null; cleanup' EXIT
    for ((i = 0; i < 100; ++i)); do
      ip netns exec "$DSC_PREFIX-l" redis-cli -h "198.18.$DSC_NET.254" -p 6392 ping 2>/dev/null |
        grep -q PONG && break
      sleep 0.05
    done
    # Each task listens on its host's address (peers connect to it).
    printf '%s\n' '#!/bin/sh' \
      "ip=\$(ip -4 -o addr show | awk '\$4 ~ /^198\\.18\\./ { sub(/\\/.*/, \"\", \$4); print \$4; exit }')" \
      'exec "$@" --listen-host "$ip"' >"$work/task.sh"
    chmod +x "$work/task.sh"
    # Long enough (about 10 s for 4 workers here) that the joiner, started
    # after the kill and the re-forming, arrives while the others still train.
    eflags=(--strategy multi_worker --elastic --rendezvous "redis://$store/job" --min-workers 2
      --epochs 3 --limit 24000 --test-limit 1000 --batch 64 --timeout 10 --progress-seconds 0.1)
    timeout 240 "$slurm" srun --mpi=none -N 2 --ntasks-per-node=2 --kill-on-bad-exit=0 \
      "$work/task.sh" "$bin/fashion_mnist" "${eflags[@]}" >"$work/elastic.log" 2>&1 &
    srun_pid=$!
    for ((i = 0; i < 1200; ++i)); do
      grep -Eq "step ([2-9][0-9]|[0-9]{3,})/" "$work/elastic.log" 2>/dev/null && break
      sleep 0.1
    done
    grep -Eq "step ([2-9][0-9]|[0-9]{3,})/" "$work/elastic.log" || { cat "$work/elastic.log"; fail "no training"; }
    victim=""
    for p in $("$cluster" pids "${DSC_PREFIX}-h1" 2>/dev/null); do
      grep -q fashion_mnist "/proc/$p/cmdline" 2>/dev/null && { victim=$p; break; }
    done
    [[ -n $victim ]] || fail "no task on host 1"
    kill -9 "$victim"
    regrouped="^elastic: group [0-9]+, 3 workers \(0 joined, 1 left\)"
    for ((i = 0; i < 300; ++i)); do
      grep -Eq "$regrouped" "$work/elastic.log" && break
      sleep 0.1
    done
    grep -Eq "$regrouped" "$work/elastic.log" ||
      { cat "$work/elastic.log"; fail "the three others did not re-form within 30 s"; }
    echo "ok: task pid $victim on host 1 killed; the other three re-formed"
    timeout 180 "$slurm" srun --mpi=none -N 1 -n 1 -w "${DSC_PREFIX}-h1" --kill-on-bad-exit=0 \
      "$work/task.sh" "$bin/fashion_mnist" "${eflags[@]}" >"$work/joiner.log" 2>&1 ||
      { cat "$work/joiner.log"; fail "the joiner's srun failed"; }
    wait "$srun_pid"
    rc=$?
    grep -E "^elastic: group [0-9]+, 4 workers \(1 joined, 0 left\)" "$work/elastic.log" ||
      { cat "$work/elastic.log"; fail "the chief did not report the joiner"; }
    grep -E "^final: strategy=multi_worker replicas=4 epochs=3 test_accuracy=" "$work/elastic.log" ||
      { cat "$work/elastic.log"; fail "no final line with 4 replicas"; }
    no_leftovers "the elastic job"
    echo "ok: srun elastic: a task killed, the others went on, a worker joined (first srun's exit $rc)"
    ;;
  *) fail "unknown kind '$kind'" ;;
esac
