#!/usr/bin/env bash
# Builds the diststrat images with podman from the committed tree (HEAD), on a
# machine where no image registry is reachable: the Debian base image is made
# with debootstrap from apt's configured Debian mirror. Facts behind the podman
# flags (runc, vfs, cgroupfs, the two --ulimit): ../shared/cluster-notes.md and
# docs/deployment.md.
#
#   scripts/container.sh base            localhost/debian:<suite> (kept when present)
#   scripts/container.sh build [cpu|gpu] base + image diststrat:<target>, then report
#   scripts/container.sh report [IMAGE]  size, installed programs and libraries
#   scripts/container.sh clean           remove the images this script made
#
# Environment: DISTSTRAT_DEBIAN_SUITE (bookworm), DISTSTRAT_DEBIAN_MIRROR (else
# apt's sources), DISTSTRAT_BUILD_JOBS (compile jobs inside the build, default
# 2; it is a build argument, so another value compiles again instead of using
# the cache), DISTSTRAT_CONTAINER_NICE (10: the build runs niced).
# The build context is `git archive HEAD`: uncommitted changes are not in the
# image (the script says so when the tree is dirty).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
suite=${DISTSTRAT_DEBIAN_SUITE:-bookworm}
base_image=localhost/debian:$suite
nice_level=${DISTSTRAT_CONTAINER_NICE:-10}

# runc (crun refuses a hybrid cgroup tree), vfs (no overlay in a nested
# container), cgroupfs (no systemd), and rlimits within this machine's hard ones.
podman_cmd=(podman --storage-driver vfs --runtime runc --cgroup-manager cgroupfs)
run_limits=(--ulimit nofile=20000:20000 --ulimit nproc=4096:4096)

# Temporary files, the disk sampler and the build containers of an
# interrupted build (buildah's "*-working-container", which podman leaves in
# storage when its build is killed) go at exit, however the script ends.
cleanup_paths=()
sampler=
containers_before=
buildah_before=
cleanup() {
  # Every step, whatever the one before it did (a sampler already gone
  # makes kill fail, and errexit would end the cleanup there).
  set +e
  [[ -z $sampler ]] || { kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null; }
  if [[ -n $containers_before ]]; then
    # Only buildah's (state "Storage"), only new ones; one build at a time
    # (the lock below), so new ones are this build's.
    local c
    for c in $("${podman_cmd[@]}" ps -a --external --no-trunc --format '{{.ID}} {{.Status}}' | awk '$2 == "Storage" { print $1 }'); do
      grep -qx "$c" <<<"$containers_before" || "${podman_cmd[@]}" rm -f "$c" >/dev/null 2>&1 || true
    done
  fi
  if [[ -n $buildah_before ]]; then  # a killed build's run directory (/var/tmp/buildahNNN)
    local d
    for d in /var/tmp/buildah[0-9]*; do
      if [[ -d $d ]] && ! grep -qx "$d" <<<"$buildah_before"; then rm -rf --one-file-system "$d"; fi
    done
  fi
  ((${#cleanup_paths[@]} == 0)) || rm -rf --one-file-system "${cleanup_paths[@]}"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say() { printf 'container.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

need() {
  local missing=()
  for p in "$@"; do command -v "$p" >/dev/null 2>&1 || missing+=("$p"); done
  ((${#missing[@]} == 0)) || die "missing: ${missing[*]} (apt-get install podman runc debootstrap uidmap)"
}

image_exists() { "${podman_cmd[@]}" image exists "$1"; }

# The first Debian mirror in apt's sources (one-line or deb822 format) that
# serves $suite itself (not -security / -updates).
apt_mirror() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -r $f ]] || continue
    awk -v s="$suite" '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {
                          if ($(i + 1) == s) { print $i; exit } } }' "$f"
  done | head -n1 | grep . && return 0
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -r $f ]] || continue
    # deb822: paragraphs of "Key: value"; take URIs of a paragraph whose Suites has $suite.
    awk -v s="$suite" 'BEGIN { RS = ""; FS = "\n" }
      { uris = ""; ok = 0; deb = 0
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^URIs:/) { sub(/^URIs:[ \t]*/, "", $i); uris = $i }
          if ($i ~ /^Types:/ && $i ~ /(^|[ \t])deb([ \t]|$)/) deb = 1
          if ($i ~ /^Suites:/) { n = split($i, w, /[ \t]+/); for (j = 2; j <= n; j++) if (w[j] == s) ok = 1 } }
        if (ok && deb && uris != "") { split(uris, u, /[ \t]+/); print u[1]; exit } }' "$f"
  done | head -n1 | grep .
}

cmd_base() {
  need podman debootstrap
  if image_exists "$base_image"; then
    say "$base_image present: reused"
    return 0
  fi
  local mirror=${DISTSTRAT_DEBIAN_MIRROR:-}
  [[ -n $mirror ]] || mirror=$(apt_mirror) || die "no Debian mirror for '$suite' in /etc/apt/sources.list*; set DISTSTRAT_DEBIAN_MIRROR"
  local rootfs
  rootfs=$(mktemp -d /var/tmp/diststrat-rootfs.XXXXXX)
  cleanup_paths+=("$rootfs" "$rootfs.log")
  say "debootstrap --variant=minbase $suite from $mirror"
  local t0=$SECONDS
  nice -n "$nice_level" debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 ||
    { tail -n 20 "$rootfs.log" >&2; rm -f "$rootfs.log"; die "debootstrap failed"; }
  rm -f "$rootfs.log"
  # apt's lists and caches are not part of an image: the Dockerfile runs apt-get update.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  # mktemp made the root 0700, and a layer's change of / does not reach the
  # image (a RUN chmod 755 / is lost): as mpiuser every program was "not found".
  chmod 755 "$rootfs"
  # The configuration Docker Hub's debian image has (an import has none).
  tar -C "$rootfs" --numeric-owner -c . |
    "${podman_cmd[@]}" import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'CMD ["bash"]' - "$base_image" >/dev/null
  rm -rf --one-file-system "$rootfs"  # not kept for the length of the build
  say "$base_image made in $((SECONDS - t0)) s"
}

# Peak disk use of podman's storage and this script's temporary directories
# (the debootstrap root, the build context), sampled every 10 s while the
# build runs (vfs copies every layer in full).
storage_dir() { "${podman_cmd[@]}" info --format '{{.Store.GraphRoot}}'; }
sample_disk() {
  local out=$1 graph=$2
  local peak=0 now
  # du fails when a file vanishes under it (layers come and go): that sample
  # still counts, and the sampler goes on.
  set +e +o pipefail
  while :; do
    now=$(du -sxk "$graph" /var/tmp/diststrat-rootfs.* /var/tmp/diststrat-ctx.* 2>/dev/null |
          awk '{ s += $1 } END { print s + 0 }')
    ((now > peak)) && peak=$now && echo "$peak" >"$out"
    sleep 10
  done
}

cmd_build() {
  local target=${1:-cpu}
  [[ $target == cpu || $target == gpu ]] || die "target is cpu or gpu, not '$target'"
  need podman git
  local t_all=$SECONDS head ctx graph before peak_file
  # One build at a time: what an interrupted build leaves is then its own.
  exec 9>/run/lock/diststrat-container.lock
  flock -n 9 || { say "another scripts/container.sh build is running: waiting"; flock 9; }
  containers_before=$("${podman_cmd[@]}" ps -a --external -q --no-trunc; echo none)
  buildah_before=$(ls -d /var/tmp/buildah[0-9]* 2>/dev/null; echo none)
  peak_file=$(mktemp /var/tmp/diststrat-peak.XXXXXX)
  cleanup_paths+=("$peak_file")
  graph=$(storage_dir)
  before=$(du -sxk "$graph" | awk '{ print $1 }')
  sample_disk "$peak_file" "$graph" &
  sampler=$!
  cmd_base
  if [[ -n $(git -C "$repo" status --porcelain --untracked-files=no) ]]; then
    say "the working tree has uncommitted changes: they are NOT in the image (context = HEAD)"
  fi
  head=$(git -C "$repo" rev-parse --short HEAD)
  ctx=$(mktemp -d /var/tmp/diststrat-ctx.XXXXXX)
  cleanup_paths+=("$ctx")
  git -C "$repo" archive --format=tar HEAD | tar -x -C "$ctx"
  local args=(build --network host "${run_limits[@]}" --layers
              --build-arg "REVISION=$(git -C "$repo" rev-parse HEAD)"
              -f deploy/Dockerfile --build-arg "DEBIAN_IMAGE=$base_image"
              --build-arg "BUILD_JOBS=${DISTSTRAT_BUILD_JOBS:-2}")
  if [[ $target == gpu ]]; then
    # The CUDA base images come from a registry (nvidia/cuda on Docker Hub).
    say "target gpu: FROM ${CUDA_DEVEL_IMAGE:-docker.io/nvidia/cuda:12.6.3-devel-ubuntu24.04} needs an image registry"
  fi
  # The build stage is tagged too, so that its layers (the compile) are a named
  # image and not a dangling one: a warm build reuses them, a prune keeps them.
  local stage=build-$target t0=$SECONDS
  say "building $stage and $target from HEAD $head (nice $nice_level)"
  # podman build exits 0 when it is sent SIGTERM: success is the image ID it
  # writes (--iidfile) only once the image is committed.
  local t iid=$ctx.iid
  cleanup_paths+=("$iid")
  for t in "$stage" "$target"; do
    rm -f "$iid"
    (cd "$ctx" && nice -n "$nice_level" "${podman_cmd[@]}" "${args[@]}" --iidfile "$iid" \
       --target "$t" -t "diststrat:$t" .) || die "podman build --target $t failed"
    [[ -s $iid ]] || die "podman build --target $t ended without an image (interrupted?)"
  done
  local build_s=$((SECONDS - t0))
  kill "$sampler" 2>/dev/null || true
  wait "$sampler" 2>/dev/null || true
  sampler=
  peak=$(cat "$peak_file" 2>/dev/null || echo 0)
  ((peak > 0)) || peak=$before
  say "image diststrat:$target from $head: podman build ${build_s} s, base + build $((SECONDS - t_all)) s"
  say "disk: podman storage before ${before} KiB; peak (storage + context) $((peak / 1024)) MiB; after $(($(du -sxk "$graph" | awk '{ print $1 }') / 1024)) MiB"
  cmd_report "diststrat:$target"
}

cmd_report() {
  local image=${1:-diststrat:cpu}
  need podman
  image_exists "$image" || die "no image $image"
  local size image_err
  image_err=$(mktemp /var/tmp/diststrat-report.XXXXXX)
  cleanup_paths+=("$image_err")
  size=$("${podman_cmd[@]}" image inspect --format '{{.Size}}' "$image")
  echo "image $image: $((size / 1024 / 1024)) MiB ($size bytes), base $base_image $(($("${podman_cmd[@]}" image inspect --format '{{.Size}}' "$base_image") / 1024 / 1024)) MiB"
  # As root: what is installed, and whether every installed program and
  # library finds its shared libraries (a "not found" is a broken image).
  # Then, as the image's user, its default command.
  "${podman_cmd[@]}" run --rm --network none "${run_limits[@]}" --user 0 --entrypoint /bin/sh "$image" -c '
    set -e
    echo "programs (/opt/diststrat/bin):"; ls -1 /opt/diststrat/bin | sed "s/^/  /"
    echo "libraries (/opt/diststrat/lib):"; ls -1 /opt/diststrat/lib | grep "\.so" | sed "s/^/  /"
    echo "libdiststrat links:"; ldd /opt/diststrat/lib/libdiststrat.so | awk "{ print \$1 }" |
      grep -E "mpi|gloo|hiredis|ibverbs|z\.so" | sed "s/^/  /"
    for p in mpirun orted sshd diststrat-worker-init redis-server; do printf "  %-13s %s\n" "$p" "$(command -v $p || ls /usr/sbin/$p 2>/dev/null || echo absent)"; done
    echo "fashion-mnist data: $(ls /usr/share/datasets/fashion-mnist 2>/dev/null | wc -l) files"
    missing=$(for f in /opt/diststrat/bin/* /opt/diststrat/lib/*.so; do ldd "$f" | grep "not found" | sed "s|^|$f: |"; done)
    if [ -n "$missing" ]; then echo "UNRESOLVED LIBRARIES:"; echo "$missing"; exit 1; fi
    echo "every installed program and library resolves its shared libraries"
    echo "root directory: $(stat -c %A /)"'
  local user
  user=$("${podman_cmd[@]}" image inspect --format '{{.Config.User}}' "$image")
  if "${podman_cmd[@]}" run --rm --network none "${run_limits[@]}" "$image" >/dev/null 2>"$image_err"; then
    echo "as ${user:-root}: the image's command (diststrat-fashion-mnist --help) runs"
  else
    echo "as ${user:-root}: the image's command FAILS: $(tail -n 1 "$image_err")"
    return 1
  fi
}

cmd_clean() {
  need podman
  local i
  for i in diststrat:cpu diststrat:build-cpu diststrat:gpu diststrat:build-gpu "$base_image"; do
    image_exists "$i" && "${podman_cmd[@]}" rmi "$i" >/dev/null && say "removed $i"
  done
  return 0
}

main() {
  case "${1:-}" in
    base) cmd_base ;;
    build) shift; cmd_build "$@" ;;
    report) shift; cmd_report "$@" ;;
    clean) cmd_clean ;;
    *) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
}
# One line, parsed whole before it runs: an edit of this file during a long
# build does not change what the running script does next.
main "$@"; exit $?
