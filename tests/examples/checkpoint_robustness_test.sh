#!/usr/bin/env bash
# examples/fashion_mnist and examples/predict on checkpoint directories as an
# operator leaves them (issues 13.8-13.10, 14.5). Every run must end promptly
# (under `timeout`; a hang or a signal such as std::terminate's SIGABRT fails):
#  1. `latest` is a FIFO: predict exits 1 naming it; training resumes from the
#     newest checkpoint with a warning naming the damaged pointer.
#  2. a checkpoint file that is a FIFO: predict exits 1 naming it.
#  3. `latest` deleted: training resumes from the newest checkpoint (a warning
#     names the missing pointer), never from scratch; predict uses the newest.
#  4. metadata "step=abc" / "epoch=1e20" in a checkpoint with valid checksums:
#     exit 1 with kDataLoss naming the file and the key.
# Usage: checkpoint_robustness_test.sh <fashion_mnist binary> <predict binary>
set -euo pipefail
train=$1 predict=$2
work=$(mktemp -d /tmp/diststrat_ckrob_XXXXXX)
trap 'rm -rf "$work"' EXIT
flags=(--limit 256 --test-limit 1000 --epochs 1 --batch 64 --replicas 1 --checkpoint-every 1)

fail() {
  echo "FAIL: $*"
  for f in "$work"/*.log; do echo "== $f"; cat "$f"; done
  exit 1
}
# bounded <seconds> <log> <command...>: sets rc; a timeout or a signal fails.
bounded() {
  local limit=$1 log=$2
  shift 2
  rc=0
  timeout -k 5 "$limit" "$@" > "$log" 2>&1 || rc=$?
  if ((rc == 124 || rc == 137)); then fail "hung (timeout ${limit}s): $*"; fi
  if ((rc > 128)); then fail "ended by signal $((rc - 128)) (std::terminate?): $*"; fi
  return 0
}

# ckpt-1..3 of a run stopped at step 3 (4 steps per epoch).
bounded 120 "$work/train.log" "$train" "${flags[@]}" --checkpoint-dir "$work/c" --max-steps 3
[[ $rc -eq 0 && -f "$work/c/ckpt-3.safetensors" ]] || fail "the first run wrote no ckpt-3 (rc $rc)"

# 1. `latest` as a FIFO.
cp -r "$work/c" "$work/fifo"
rm "$work/fifo/latest"
mkfifo "$work/fifo/latest"
bounded 30 "$work/predict_fifo.log" "$predict" --checkpoint "$work/fifo" --limit 10
[[ $rc -eq 1 ]] && grep -q "$work/fifo/latest' is a FIFO, not a regular file" "$work/predict_fifo.log" ||
  fail "predict with a FIFO latest: rc $rc"
bounded 120 "$work/train_fifo.log" "$train" "${flags[@]}" --checkpoint-dir "$work/fifo"
[[ $rc -eq 0 ]] && grep -q "resumed from $work/fifo/ckpt-3.safetensors" "$work/train_fifo.log" &&
  grep -q "its 'latest' pointer is damaged" "$work/train_fifo.log" || fail "training with a FIFO latest: rc $rc"
echo "ok: a FIFO as 'latest': predict refuses at once, training falls back to ckpt-3 with a warning"

# 2. A checkpoint file that is a FIFO.
mkfifo "$work/pipe.safetensors"
bounded 30 "$work/predict_pipe.log" "$predict" --checkpoint "$work/pipe.safetensors" --limit 10
[[ $rc -eq 1 ]] && grep -q "is a FIFO, not a regular file" "$work/predict_pipe.log" || fail "predict on a FIFO: rc $rc"
echo "ok: a FIFO as the checkpoint file: predict refuses at once"

# 3. `latest` deleted.
cp -r "$work/c" "$work/nolatest"
rm "$work/nolatest/latest"
bounded 30 "$work/predict_nolatest.log" "$predict" --checkpoint "$work/nolatest" --limit 10
[[ $rc -eq 0 ]] && grep -q "checkpoint: $work/nolatest/ckpt-3.safetensors" "$work/predict_nolatest.log" ||
  fail "predict without latest: rc $rc"
bounded 120 "$work/train_nolatest.log" "$train" "${flags[@]}" --checkpoint-dir "$work/nolatest"
[[ $rc -eq 0 ]] && grep -q "resumed from $work/nolatest/ckpt-3.safetensors" "$work/train_nolatest.log" &&
  grep -q "$work/nolatest/latest' is missing" "$work/train_nolatest.log" || fail "training without latest: rc $rc"
echo "ok: 'latest' deleted: resumed from ckpt-3 with a warning, not from scratch"

# 4. Metadata that is no number, in a file whose checksums are valid.
set_metadata() {  # <file> <key> <value>: rewrites the header, recomputing diststrat's header CRC
  python3 - "$@" << 'PY'
import json, struct, sys, zlib
path, key, value = sys.argv[1:4]
b = open(path, "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
md = h["__metadata__"]
md[key] = value
md.pop("diststrat.header_crc32")
canon = json.dumps(h, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
md["diststrat.header_crc32"] = "%08x" % (zlib.crc32(canon) & 0xffffffff)
text = json.dumps(h, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
text += b" " * ((8 - len(text) % 8) % 8)
open(path, "wb").write(struct.pack("<Q", len(text)) + text + b[8 + n:])
PY
}
for kv in step=abc epoch=1e20 batch=-1; do
  d="$work/meta_${kv%%=*}"
  cp -r "$work/c" "$d"
  set_metadata "$d/ckpt-3.safetensors" "${kv%%=*}" "${kv#*=}"
  # The manager's manifest lists ckpt-3 with its old header CRC, so with it the
  # edited file is "not this run's" and restore falls back to ckpt-2 (the
  # ownership tests cover that). Without a manifest (a directory from before
  # manifests) `latest`'s checkpoint is taken as the run's: the metadata check.
  rm -f "$d/manifest"
  bounded 120 "$d.log" "$train" "${flags[@]}" --checkpoint-dir "$d"
  [[ $rc -eq 1 ]] && grep -q "kDataLoss" "$d.log" && grep -q "$d/ckpt-3.safetensors" "$d.log" &&
    grep -q "metadata '${kv%%=*}'" "$d.log" || fail "metadata $kv: rc $rc"
  grep kDataLoss "$d.log"
done
echo "ok: bad metadata numbers are a kDataLoss error naming the file and key"
