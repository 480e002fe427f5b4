#!/usr/bin/env bash
# diststrat-smi against a lease directory with hostile contents (issue 14,
# items 5, 8, 9): a FIFO and a 2 GiB sparse file at lock paths must neither
# hang it nor make it read them; an unsafe directory is a clear error.
#   smi_test.sh <diststrat-smi>
set -u
smi=$1
dir=$(mktemp -d /tmp/diststrat-smi-test-XXXXXX)
trap 'rm -rf "$dir"' EXIT
fail() { echo "smi_test: FAIL: $*"; exit 1; }

mkfifo "$dir/gpu-fifo0.lock"
truncate -s 2G "$dir/gpu-sparse0.lock"
out=$(timeout 20 "$smi" --lease-dir "$dir" 2>&1); rc=$?
[[ $rc -eq 124 ]] && fail "diststrat-smi hung on a FIFO or a huge file in the lease directory"
[[ $rc -eq 0 ]] || fail "exit $rc: $out"
grep -q "Leases held: none" <<<"$out" || fail "expected no lease held, got: $out"

chmod 0777 "$dir"  # writable by everyone, not sticky: others could swap lock files
out=$(timeout 20 "$smi" --lease-dir "$dir" 2>&1); rc=$?
[[ $rc -eq 1 ]] || fail "an unsafe directory: exit $rc, expected 1: $out"
grep -q "kPermissionDenied.*$dir.*not sticky" <<<"$out" || fail "unexpected message: $out"
echo "smi_test: ok"
