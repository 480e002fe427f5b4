#!/usr/bin/env bash
# Restart after a host died, on the namespace cluster (ctest label cluster):
#   restart_cell.sh CLUSTER_SH FASHION_MNIST
# 2 hosts x 1 rank, examples/fashion_mnist --strategy multi_worker with a
# checkpoint directory both hosts see (/tmp: the namespaces share the file
# system, as real hosts share a network file system):
#  1. a run that cannot finish (10^6 epochs) is started; once its first
#     checkpoint exists, every process on host 1 is killed; the job must end
#     within 10 s, leaving no process on any host;
#  2. the same command restarted with --max-steps T (two checkpoint intervals
#     past the last checkpoint) resumes from the last checkpoint;
#  3. an uninterrupted run to T writes a byte-identical checkpoint at T.
# Exit 77 (ctest: skipped) with the reason where namespaces are refused.
set -u
if (($# != 2)); then
  echo "usage: $0 CLUSTER_SH FASHION_MNIST" >&2
  exit 2
fi
cluster=$1 fm=$2
export DSC_PREFIX=${DSC_PREFIX:-dsct} DSC_NET=${DSC_NET:-1}
if ! why=$(timeout 30 "$cluster" check); then
  echo "SKIP: cannot make the namespace cluster here: $why"
  exit 77
fi
work=$(mktemp -d /tmp/diststrat_cluster_restart_XXXXXX)
trap 'timeout 60 "$cluster" down >/dev/null 2>&1; rm -rf "$work"' EXIT
trap 'exit 1' INT TERM
timeout 60 "$cluster" down >/dev/null 2>&1
timeout 60 "$cluster" --hosts 2 up || { echo "FAIL: cluster up"; exit 1; }
every=25
flags=(--strategy multi_worker --limit 256 --epochs 1000000 --batch 32 --checkpoint-every $every)
run() { timeout -s KILL 120 "$cluster" run --ppn 1 -- "$fm" "${flags[@]}" "$@"; }
fail() { echo "FAIL: $*"; exit 1; }
latest() { ls "$1" 2>/dev/null | sed -n 's/^ckpt-\([0-9]*\)\.safetensors$/\1/p' | sort -n | tail -1; }

run --checkpoint-dir "$work/crash" >"$work/crash.log" 2>&1 &
job=$!
for ((i = 0; i < 300; ++i)); do
  [[ -n $(latest "$work/crash") ]] && break
  kill -0 "$job" 2>/dev/null || break
  sleep 0.2
done
[[ -n $(latest "$work/crash") ]] || { wait "$job"; tr '\r' '\n' <"$work/crash.log" | tail -20; fail "no checkpoint appeared"; }
t0=$(date +%s%N)
timeout 20 "$cluster" kill "${DSC_PREFIX}-h1"
wait "$job"
rc=$?
ended_ms=$((($(date +%s%N) - t0) / 1000000))
tr '\r' '\n' <"$work/crash.log" | grep -vE "^ *$|^epoch " | tail -12
((rc != 0)) || fail "the job exited 0 although host 1 died"
((ended_ms <= 10000)) || fail "the job ended ${ended_ms} ms after host 1 died (bound 10000 ms)"
sleep 0.5
left=$(timeout 10 "$cluster" pids)
[[ -z $left ]] || fail "processes left on the cluster: $left"
last=$(latest "$work/crash")
echo "host 1 killed; job ended after ${ended_ms} ms (rc $rc); last checkpoint: step $last"
target=$(((last / every + 2) * every))

run --checkpoint-dir "$work/crash" --max-steps "$target" >"$work/resume.log" 2>&1 ||
  { tr '\r' '\n' <"$work/resume.log" | tail -20; fail "the restarted run failed"; }
grep -q "resumed from .*step $last\$" <(tr '\r' '\n' <"$work/resume.log") ||
  { tr '\r' '\n' <"$work/resume.log" | tail -20; fail "the restart did not resume from step $last"; }
run --checkpoint-dir "$work/ref" --max-steps "$target" >"$work/ref.log" 2>&1 ||
  { tr '\r' '\n' <"$work/ref.log" | tail -20; fail "the uninterrupted run failed"; }
final=ckpt-$target.safetensors
[[ -f $work/ref/$final ]] || fail "no $final in the uninterrupted run"
[[ -f $work/crash/$final ]] || fail "no $final in the restarted run"
cmp "$work/ref/$final" "$work/crash/$final" || fail "restarted run: checkpoint at step $target differs"
echo "CELL restart: host 1 died after step $last's checkpoint, restarted, checkpoint at step $target" \
     "byte-identical to an uninterrupted run -> PASS"
