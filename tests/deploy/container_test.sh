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
#   container_test.sh mpijob REPO HOST_FASHION_MNIST
#     deploy/k8s/mpijob-cpu.yaml as the MPI Operator runs it, on two namespace
#     hosts (scripts/cluster.sh): one worker container per host (its PID 1 the
#     manifest's command), a launcher container running the manifest's mpirun
#     command (a shorter job) with what the operator injects (the hostfile via
#     OMPI_MCA_orte_default_hostfile, the workers' host names, the ssh key
#     pair mounted read-only at sshAuthMountPath), the checkpoints on a volume
#     both workers mount. The final checkpoint is byte-identical to the same
#     job run by scripts/cluster.sh without containers.
#   container_test.sh preempt REPO HOST_FASHION_MNIST
#     the same job, longer, preempted as Kubernetes does it: `podman stop -t
#     GRACE` of one worker container (SIGTERM to its PID 1, SIGKILL after
#     GRACE). Every rank saves and exits 0; new containers resume, and the final
#     checkpoint is byte-identical to an uninterrupted run's.
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
cluster_up=0
teardown() {
  local c
  # The containers first: they live in the cluster's network namespaces.
  for c in $("${podman_cmd[@]}" ps -a -q --no-trunc --filter "name=^$name"); do
    "${podman_cmd[@]}" rm -f -t 0 "$c" >/dev/null 2>&1 || true
  done
  ((cluster_up == 0)) || cluster down >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap teardown EXIT

# The same Fashion-MNIST job everywhere: 2 ranks, 2 replicas each, 300 rows,
# one epoch, checkpoints at the end only.
job_args=(--strategy multi_worker --replicas 2 --epochs 1 --batch 64 --limit 300 --test-limit 100
          --progress-seconds 0 --timeout 120)

# DIR's final checkpoint: `latest`, the manifest and the checkpoint `latest`
# names, hashed (the ranks' flight records beside them name hosts and PIDs).
checkpoint_digest() {
  [[ -f $1/latest ]] || { echo "no $1/latest"; return 0; }
  (cd "$1" && sha256sum latest manifest "$(basename "$(cat latest)")")
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

# ---- the MPI Operator's job on namespace hosts -------------------------------
cluster() { DSC_PREFIX=dct DSC_NET=48 "$repo/scripts/cluster.sh" "$@"; }
host_ip() { echo "198.18.48.$(($1 + 1))"; }

# The image of HEAD: scripts/container.sh build cpu (the cache when present).
need_image() {
  local want got=""
  want=$(git -C "$repo" rev-parse HEAD)
  "${podman_cmd[@]}" image exists diststrat:cpu &&
    got=$("${podman_cmd[@]}" image inspect --format '{{index .Labels "org.opencontainers.image.revision"}}' diststrat:cpu)
  if [[ $got != "$want" ]]; then
    echo "== diststrat:cpu is of '${got:-nothing}': scripts/container.sh build cpu"
    DISTSTRAT_BUILD_JOBS=${DISTSTRAT_BUILD_JOBS:-2} "$repo/scripts/container.sh" build cpu >"$work/build.log" 2>&1 ||
      { tail -n 30 "$work/build.log"; fail "scripts/container.sh build cpu failed"; }
  fi
}

# The manifest's launcher command and environment, as NAME=VALUE lines then
# "--" then the arguments one a line, with the job's length and the
# checkpoint directory replaced (EPOCHS LIMIT CKPT_EVERY).
manifest_job() {
  python3 - "$repo/deploy/k8s/mpijob-cpu.yaml" "$@" <<'PY'
import sys, yaml
path, epochs, limit, every = sys.argv[1:5]
job = [d for d in yaml.safe_load_all(open(path)) if d and d.get("kind") == "MPIJob"][0]
c = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
cmd = c["command"] + c["args"]
override = {"--epochs": epochs, "--checkpoint-every": every}
out = []
i = 0
while i < len(cmd):
    out.append(cmd[i])
    if cmd[i] in override:
        out.append(override[cmd[i]]); i += 1
    i += 1
out += ["--limit", limit, "--test-limit", "100", "--batch", "64", "--progress-seconds", "0.5", "--timeout", "120"]
for e in c.get("env", []):
    print(f"{e['name']}={e['value']}")
print("--")
print("\n".join(out))
PY
}

# Two worker containers (dct-h0, dct-h1) and the launcher's run options, as
# the operator makes them. Needs $work/ssh, $work/hostfile, $work/ckpt.
hosts_opts=()
start_workers() {
  local i wcmd
  mapfile -t wcmd < <(python3 - "$repo/deploy/k8s/mpijob-cpu.yaml" <<'PY'
import sys, yaml
job = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d.get("kind") == "MPIJob"][0]
c = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
print("\n".join(c["command"] + c["args"]))
PY
)
  for i in 0 1; do
    "${podman_cmd[@]}" run -d --name "$name-w$i" --network "ns:/run/netns/dct-h$i" --hostname "dct-h$i" \
      "${hosts_opts[@]}" "${run_limits[@]}" --shm-size 256m --user 1000 \
      -v "$work/ssh:/home/mpiuser/.ssh:ro" -v "$work/ckpt:/ckpt" diststrat:cpu "${wcmd[@]}" >/dev/null
  done
}
launcher_opts() {
  local -n _opts=$1
  _opts=(--name "$name-l" --network ns:/run/netns/dct-l --hostname launcher "${hosts_opts[@]}"
         "${run_limits[@]}" --user 1000 -v "$work/ssh:/home/mpiuser/.ssh:ro" -v "$work/hostfile:/etc/mpi/hostfile:ro"
         -e OMPI_MCA_orte_default_hostfile=/etc/mpi/hostfile -e OMPI_MCA_orte_keep_fqdn_hostnames=true
         -e "OMPI_MCA_plm_rsh_args=-o ConnectionAttempts=10")
  local e
  for e in "${job_env[@]}"; do _opts+=(-e "$e"); done
}
stop_job() {
  local c
  for c in "$name-l" "$name-w0" "$name-w1"; do "${podman_cmd[@]}" rm -f -t 0 "$c" >/dev/null 2>&1 || true; done
}

setup_cluster() {
  command -v python3 >/dev/null && python3 -c "import yaml" 2>/dev/null || skip "python3-yaml is not installed"
  local why
  why=$(cluster check) || skip "namespace hosts: $why"
  need_image
  cluster --hosts 2 up >/dev/null
  cluster_up=1
  hosts_opts=(--add-host "dct-h0:$(host_ip 0)" --add-host "dct-h1:$(host_ip 1)")
  # The operator's secret: a key pair, the public key authorized, read-only,
  # mode 0600, owned by the pods' user; made by the image's ssh-keygen.
  mkdir -p "$work/ssh" "$work/ckpt"
  chown 1000 "$work/ssh"  # ssh-keygen runs as the image's user
  "${podman_cmd[@]}" run --rm --network none "${run_limits[@]}" -v "$work/ssh:/k" diststrat:cpu \
    ssh-keygen -q -t rsa -b 3072 -N "" -f /k/id_rsa >/dev/null
  cp "$work/ssh/id_rsa.pub" "$work/ssh/authorized_keys"
  chown -R 1000 "$work/ssh" "$work/ckpt"
  chmod 600 "$work/ssh"/*; chmod 700 "$work/ckpt"
  # The operator's hostfile: one line per worker, slotsPerWorker slots.
  printf 'dct-h0 slots=1\ndct-h1 slots=1\n' >"$work/hostfile"
  chmod 644 "$work/hostfile"
}

# The host's reference: the same program arguments through scripts/cluster.sh.
reference_run() {  # DIR
  local args=("${job_prog[@]:1}") i
  for i in "${!args[@]}"; do [[ ${args[$i]} == /ckpt/* ]] && args[$i]=$1; done
  local out
  mkdir -p "$(dirname "$1")"
  out=$(DSC_PREFIX=dct DSC_NET=48 timeout 900 "$repo/scripts/cluster.sh" run --np 2 -- "$host_program" "${args[@]}" 2>&1) ||
    { echo "$out" | tail -n 30; fail "the reference run through scripts/cluster.sh failed"; }
  echo "$out" | tail -n 2
}

parse_job() {  # EPOCHS LIMIT CKPT_EVERY -> job_env, job_cmd (mpirun ...), job_prog (program + args), job_ckpt
  local lines l seen=0
  mapfile -t lines < <(manifest_job "$@")
  job_env=() job_cmd=()
  for l in "${lines[@]}"; do
    if ((seen)); then job_cmd+=("$l"); elif [[ $l == -- ]]; then seen=1; else job_env+=("$l"); fi
  done
  local i
  for i in "${!job_cmd[@]}"; do
    [[ ${job_cmd[$i]} == /opt/diststrat/bin/* ]] && job_prog=("${job_cmd[@]:$i}")
    [[ ${job_cmd[$i]} == --checkpoint-dir ]] && job_ckpt=${job_cmd[$((i + 1))]}
  done
  [[ ${job_cmd[0]} == mpirun && -n ${job_ckpt:-} && ${#job_prog[@]} -gt 0 ]] || fail "cannot read the manifest's job: ${job_cmd[*]}"
  [[ $job_ckpt == /ckpt/* ]] || fail "the manifest's checkpoint directory $job_ckpt is not under /ckpt"
}

test_mpijob() {
  [[ -x $host_program ]] || fail "no host fashion_mnist program '$host_program'"
  setup_cluster
  parse_job 1 300 200
  echo "== the manifest's job in containers: ${job_cmd[*]}"
  start_workers
  local opts out
  launcher_opts opts
  out=$(timeout 900 "${podman_cmd[@]}" run --rm "${opts[@]}" diststrat:cpu "${job_cmd[@]}" 2>&1) ||
    { echo "$out" | tail -n 30; "${podman_cmd[@]}" logs "$name-w0" 2>&1 | tail; fail "the launcher's mpirun failed"; }
  echo "$out" | tail -n 2
  stop_job
  echo "== the same job through scripts/cluster.sh, no containers"
  reference_run "$work/ref/run"
  local got=$work/ckpt/${job_ckpt#/ckpt/}
  checkpoint_digest "$got" >"$work/container.sum"
  checkpoint_digest "$work/ref/run" >"$work/host.sum"
  [[ -s $work/host.sum ]] || fail "the reference run wrote no checkpoint"
  cat "$work/container.sum"
  diff "$work/container.sum" "$work/host.sum" || fail "the containers' checkpoint differs from scripts/cluster.sh's"
  echo "the checkpoints are byte-identical ($(wc -l <"$work/host.sum") files)"
}

# The checkpoint `latest` names in DIR: its name and hash.
final_checkpoint() {
  [[ -f $1/latest ]] || fail "no $1/latest"
  (cd "$1" && sha256sum "$(basename "$(cat latest)")")
}

wait_for() {  # SECONDS DESCRIPTION COMMAND...: poll until COMMAND succeeds
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@"; do
    ((SECONDS < deadline)) || fail "timed out after ${deadline}s waiting for $what"
    sleep 0.5
  done
}
has_checkpoint() { compgen -G "$1/ckpt-*.safetensors" >/dev/null; }

test_preempt() {
  [[ -x $host_program ]] || fail "no host fashion_mnist program '$host_program'"
  setup_cluster
  # Long enough to be preempted in the middle: 20000 rows x 2 epochs at batch
  # 64 (626 steps, about 40 s here), a checkpoint every 50 steps.
  parse_job 2 20000 50
  local dir=$work/ckpt/${job_ckpt#/ckpt/} grace
  grace=$(python3 -c 'import sys, yaml
job = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d.get("kind") == "MPIJob"][0]
print(job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["terminationGracePeriodSeconds"])' \
    "$repo/deploy/k8s/mpijob-cpu.yaml")
  echo "== the manifest's job in containers, worker 1 preempted (podman stop -t $grace)"
  start_workers
  local opts
  launcher_opts opts
  "${podman_cmd[@]}" run -d "${opts[@]}" diststrat:cpu "${job_cmd[@]}" >/dev/null
  wait_for 300 "the job's first checkpoint" has_checkpoint "$dir"
  local t0=$SECONDS
  "${podman_cmd[@]}" stop -t "$grace" "$name-w1" >/dev/null
  echo "podman stop -t $grace $name-w1: $((SECONDS - t0)) s"
  local rc
  rc=$(timeout 300 "${podman_cmd[@]}" wait "$name-l") || fail "the launcher did not end after the preemption"
  local wlog llog
  wlog=$("${podman_cmd[@]}" logs "$name-w1" 2>&1)
  llog=$("${podman_cmd[@]}" logs "$name-l" 2>&1)
  echo "$wlog" | grep diststrat-worker-init || true
  echo "$llog" | tail -n 4
  grep -q "passed to the ranks" <<<"$wlog" || fail "worker 1's PID 1 did not pass SIGTERM to its rank"
  grep -q "the ranks have exited" <<<"$wlog" || fail "worker 1's PID 1 did not see its rank exit"
  grep -q "preempted" <<<"$llog" || fail "no rank saved a preemption checkpoint"
  echo "launcher (mpirun) exit status $rc"
  # Not 0: the MPI Operator marks a job whose launcher exits 0 Succeeded and
  # never restarts it; the ranks exit 143 after a preemption save.
  [[ $rc != 0 ]] || fail "the launcher exited 0 after a preemption: the operator would call the job Succeeded"
  local saved
  saved=$(final_checkpoint "$dir")
  echo "saved at the preemption: $saved"
  stop_job
  echo "== new containers: the job resumes"
  start_workers
  local out
  out=$(timeout 900 "${podman_cmd[@]}" run --rm "${opts[@]}" diststrat:cpu "${job_cmd[@]}" 2>&1) ||
    { echo "$out" | tail -n 30; fail "the resumed job failed"; }
  echo "$out" | grep -i "resum\|restor" | head -n 2 || true
  echo "$out" | tail -n 2
  stop_job
  echo "== the same job uninterrupted through scripts/cluster.sh"
  reference_run "$work/ref/run"
  local a b
  a=$(final_checkpoint "$dir") b=$(final_checkpoint "$work/ref/run")
  echo "preempted and resumed: $a"
  echo "uninterrupted:         $b"
  [[ $a != "$saved" ]] || fail "the resumed job saved nothing after the preemption's checkpoint"
  [[ $a == "$b" ]] || fail "the resumed job's final checkpoint differs from the uninterrupted run's"
  echo "the final checkpoints are byte-identical"
}

case $mode in
  build) test_build ;;
  mpijob) test_mpijob ;;
  preempt) test_preempt ;;
  *) fail "unknown mode $mode" ;;
esac
check_nothing_left
echo PASS
