#!/usr/bin/env bash
# ctest label "container": the images of deploy/Dockerfile, built and run with
# podman (scripts/container.sh). Opt-in (DISTSTRAT_CONTAINER_TESTS=1): a cold
# build compiles the whole library inside the image, beyond CI's budget (times
# in docs/deployment.md). Exit 77 = skipped, with the reason.
#
#   container_test.sh build REPO HOST_FASHION_MNIST
#     scripts/container.sh build cpu (cached base and layers when present), then:
#     the image is of HEAD, installs the programs under their prefixed names,
#     resolves every shared library (Gloo, hiredis, Open MPI); a second build
#     takes every step from the cache; a 2-rank multi_worker job under mpirun
#     inside one container ends with a checkpoint byte-identical to the same job
#     run by the host's build; nothing is left behind (containers, dangling
#     images, temporary directories, mounts).
set -euo pipefail

mode=${1:?mode}
repo=${2:?repo}
host_program=${3:-}
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

[[ ${DISTSTRAT_CONTAINER_TESTS:-0} == 1 ]] ||
  skip "container tests are opt-in (DISTSTRAT_CONTAINER_TESTS=1): a cold image build compiles the library in the image (see docs/deployment.md)"
((EUID == 0)) || skip "podman runs as root here (vfs storage, runc): uid $EUID"
for p in podman runc git; do command -v "$p" >/dev/null || skip "$p is not installed (apt-get install podman runc debootstrap)"; done
podman_cmd=(podman --storage-driver vfs --runtime runc --cgroup-manager cgroupfs)
run_limits=(--ulimit nofile=20000:20000 --ulimit nproc=4096:4096)
"${podman_cmd[@]}" image exists localhost/debian:bookworm || command -v debootstrap >/dev/null ||
  skip "no base image localhost/debian:bookworm and no debootstrap to make one"
unshare --pid --fork --mount --uts true 2>/dev/null || skip "cannot make PID/mount/UTS namespaces here"

work=$(mktemp -d /tmp/diststrat-ctest.XXXXXX)
name=diststrat-ctest-$$
# What a run may leave, before it: compared at the end, and torn down on any exit.
containers_before=$("${podman_cmd[@]}" ps -a --external -q --no-trunc | sort)
dangling_before=$("${podman_cmd[@]}" images -q --filter dangling=true | sort)
mounts_before=$(grep -c /var/lib/containers /proc/mounts || true)
teardown() {
  local c
  for c in $("${podman_cmd[@]}" ps -a -q --no-trunc --filter "name=^$name"); do
    "${podman_cmd[@]}" rm -f -t 0 "$c" >/dev/null 2>&1 || true
  done
  rm -rf "$work"
}
trap teardown EXIT

# The same Fashion-MNIST job everywhere: 2 ranks, 2 replicas each, 300 rows,
# one epoch, checkpoints at the end only.
job_args=(--strategy multi_worker --replicas 2 --epochs 1 --batch 64 --limit 300 --test-limit 100
          --progress-seconds 0 --timeout 120)

checkpoint_digest() {  # DIR: the checkpoint files' names and contents, hashed
  (cd "$1" && find . -type f | LC_ALL=C sort | xargs sha256sum)
}

test_build() {
  [[ -x $host_program ]] || fail "no host fashion_mnist program '$host_program'"
  local log=$work/build.log
  echo "== scripts/container.sh build cpu"
  local t0=$SECONDS
  local rc=0
  DISTSTRAT_BUILD_JOBS=${DISTSTRAT_BUILD_JOBS:-2} "$repo/scripts/container.sh" build cpu >"$log" 2>&1 || rc=$?
  grep -E "^container.sh:|^image |^  |^every|--help|^user" "$log" || true
  ((rc == 0)) || { tail -n 30 "$log"; fail "scripts/container.sh build cpu failed"; }
  echo "first build: $((SECONDS - t0)) s"

  local want got
  want=$(git -C "$repo" rev-parse HEAD)
  got=$("${podman_cmd[@]}" image inspect --format '{{index .Labels "org.opencontainers.image.revision"}}' diststrat:cpu)
  [[ $got == "$want" ]] || fail "diststrat:cpu is of revision '$got', HEAD is $want"
  local p
  for p in diststrat-fashion-mnist diststrat-predict diststrat-embedding-ps diststrat-smi diststrat-trace; do
    grep -qx "  $p" "$log" || fail "the image does not install $p"
  done
  for p in libmpi libgloo libhiredis; do
    grep -q "^  $p" "$log" || fail "libdiststrat.so in the image does not link $p"
  done
  grep -q "^every installed program and library resolves" "$log" || fail "unresolved libraries in the image"

  echo "== the same build again: every step from the cache"
  t0=$SECONDS
  "$repo/scripts/container.sh" build cpu >"$log" 2>&1 || { cat "$log"; fail "second build failed"; }
  local steps cached
  steps=$(grep -cE "STEP [0-9]+/[0-9]+: (RUN|COPY)" "$log")
  cached=$(grep -c -- "--> Using cache" "$log" || true)
  echo "second build: $((SECONDS - t0)) s, $cached of $steps RUN/COPY steps from the cache"
  ((steps > 0 && cached == steps)) || { grep -E "STEP|Using cache" "$log"; fail "the second build ran steps again"; }

  echo "== 2 ranks under mpirun in one container vs the host's build"
  mkdir -p "$work/ckpt-container" "$work/ckpt-host"
  # The checkpoint manager refuses a directory open to others: the volume is
  # mpiuser's (uid 1000 in the image), mode 0700, as a pod's fsGroup would make it.
  chown 1000 "$work/ckpt-container" && chmod 700 "$work/ckpt-container"
  local out
  out=$(timeout 600 "${podman_cmd[@]}" run --rm --name "$name-job" --network none "${run_limits[@]}" \
          --shm-size 256m -v "$work/ckpt-container:/ckpt" diststrat:cpu \
          mpirun -np 2 --bind-to none /opt/diststrat/bin/diststrat-fashion-mnist "${job_args[@]}" \
          --checkpoint-dir /ckpt/run 2>&1) || { echo "$out" | tail -n 30; fail "the job in the container failed"; }
  echo "$out" | tail -n 3
  out=$(timeout 600 mpirun --allow-run-as-root --oversubscribe -np 2 --bind-to none "$host_program" \
          "${job_args[@]}" --checkpoint-dir "$work/ckpt-host/run" 2>&1) ||
    { echo "$out" | tail -n 30; fail "the job on the host failed"; }
  echo "$out" | tail -n 3
  checkpoint_digest "$work/ckpt-container/run" >"$work/container.sum"
  checkpoint_digest "$work/ckpt-host/run" >"$work/host.sum"
  [[ -s $work/host.sum ]] || fail "the host's job wrote no checkpoint"
  cat "$work/container.sum"
  diff "$work/container.sum" "$work/host.sum" || fail "the container's checkpoint differs from the host's"
  echo "the checkpoints are byte-identical ($(wc -l <"$work/host.sum") files)"
}

check_nothing_left() {
  local now
  now=$("${podman_cmd[@]}" ps -a --external -q --no-trunc | sort)
  [[ $now == "$containers_before" ]] || fail "containers left behind: $(comm -13 <(echo "$containers_before") <(echo "$now"))"
  now=$("${podman_cmd[@]}" images -q --filter dangling=true | sort)
  [[ $now == "$dangling_before" ]] || fail "dangling images left behind: $now"
  now=$(grep -c /var/lib/containers /proc/mounts || true)
  [[ $now == "$mounts_before" ]] || fail "mounts under /var/lib/containers: $mounts_before before, $now after"
  now=$(ls -d /var/tmp/diststrat-* /var/tmp/buildah[0-9]* 2>/dev/null || true)
  [[ -z $now ]] || fail "temporary directories left behind: $now"
  echo "nothing left behind (containers, dangling images, mounts, temporary directories)"
}

case $mode in
  build) test_build ;;
  *) fail "unknown mode $mode" ;;
esac
check_nothing_left
echo PASS
