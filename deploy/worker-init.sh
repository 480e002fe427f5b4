#!/bin/sh
# PID 1 of an MPI Operator worker container (installed as
# /usr/local/bin/diststrat-worker-init): runs its arguments (sshd -De ...) and
# passes a SIGTERM or SIGINT on to the ranks.
#
# Why: when a node is preempted, Kubernetes sends SIGTERM to PID 1 of every
# container of its pods, then SIGKILL after terminationGracePeriodSeconds. With
# sshd as PID 1 the worker's sshd exits at once, and the end of the PID
# namespace's init kills orted and the ranks before they can save. Here the
# ranks (the children of orted) get the signal themselves, and PID 1 waits
# until they have exited: they agree on a step, save (docs/checkpoints.md,
# "Preemption") and exit; then sshd is stopped and the container ends. orted
# is not signalled: a signalled orted would abort the job and kill the ranks.
# A rank that does not finish within the grace period is killed by the
# kubelet's SIGKILL, as before.
set -u

"$@" &
child=$!

# The PIDs of the processes whose parent is an orted.
ranks() {
  orteds=""
  for s in /proc/[0-9]*/stat; do
    read -r pid comm rest <"$s" 2>/dev/null || continue
    [ "$comm" = "(orted)" ] && orteds="$orteds $pid"
  done
  [ -n "$orteds" ] || return 0
  for s in /proc/[0-9]*/stat; do
    read -r pid comm state ppid rest <"$s" 2>/dev/null || continue
    for o in $orteds; do [ "$ppid" = "$o" ] && echo "$pid"; done
  done
}

forward() {
  r=$(ranks)
  if [ -n "$r" ]; then
    echo "diststrat-worker-init: SIG$1: passed to the ranks" $r >&2
    # shellcheck disable=SC2086
    kill -s "$1" $r 2>/dev/null
    while [ -n "$(ranks)" ]; do sleep 0.2; done
    echo "diststrat-worker-init: the ranks have exited" >&2
  fi
  kill -s TERM "$child" 2>/dev/null
  wait "$child"
  exit 0
}
trap 'forward TERM' TERM
trap 'forward INT' INT

wait "$child"
