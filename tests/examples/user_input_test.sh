#!/usr/bin/env bash
# What a user types, as the examples receive it (issue 23, items 4, 5, 19):
#  - a --batch near INT64_MAX trains one (short) batch per epoch, not zero
#    steps with exit 0;
#  - a misspelled DISTSTRAT_* variable is a warning naming the closest one;
#  - a negative --limit is refused;
#  - a checkpoint whose position metadata contradicts itself (epoch=99 with
#    step=30; batch=5 with step 30) is a DataLoss error naming the file and
#    keys, not a run that ends at once or repeats batches.
# Usage: user_input_test.sh <example binary> [extra args...]
set -euo pipefail
bin=$1
shift
name=$(basename "$bin")
work=$(mktemp -d /tmp/diststrat_input_XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL ($name): $*"; exit 1; }

# 5: the batch overflowed (rows + b - 1) / b into 0 batches.
"$bin" "$@" --replicas 2 --epochs 1 --limit 256 --test-limit 500 --batch 9223372036854775806 \
  --checkpoint-dir "$work/big" > "$work/big.log" 2>&1 || { cat "$work/big.log"; fail "huge --batch: exit $?"; }
grep -q "finished: saved .* at step 1$" "$work/big.log" || { cat "$work/big.log"; fail "huge --batch did not train exactly one step"; }
echo "ok: --batch 9223372036854775806 trains one batch of all 256 rows"

# 19: a misspelled variable is named, with the closest known one.
DISTSTRAT_TIMEOUTS=5 DISTSTRAT_LOGLEVEL=debug "$bin" "$@" --replicas 2 --epochs 1 --limit 64 --test-limit 500 --batch 32 \
  --max-steps 1 > "$work/env.log" 2>&1 || { cat "$work/env.log"; fail "misspelled variables: exit $?"; }
grep -q "DISTSTRAT_TIMEOUTS.*did you mean DISTSTRAT_TIMEOUT?" "$work/env.log" || { cat "$work/env.log"; fail "no warning for DISTSTRAT_TIMEOUTS"; }
grep -q "DISTSTRAT_LOGLEVEL.*did you mean DISTSTRAT_LOG_LEVEL?" "$work/env.log" || { cat "$work/env.log"; fail "no warning for DISTSTRAT_LOGLEVEL"; }
echo "ok: misspelled DISTSTRAT_* variables are named"

# 5: a negative --limit is not "all rows".
rc=0
"$bin" "$@" --limit -5 --epochs 1 > "$work/limit.log" 2>&1 || rc=$?
[[ $rc -ne 0 ]] || { cat "$work/limit.log"; fail "--limit -5 accepted"; }
echo "ok: --limit -5 refused (exit $rc)"

# 4: metadata that contradicts itself. Write a real checkpoint at step 30
# (3 epochs of 10 batches), then rewrite its metadata with python's
# safetensors-free header edit: the header is JSON after an 8-byte length.
"$bin" "$@" --replicas 2 --epochs 3 --limit 320 --test-limit 500 --batch 32 --checkpoint-dir "$work/c" > "$work/c.log" 2>&1 ||
  { cat "$work/c.log"; fail "writing the checkpoint: exit $?"; }
for edit in "epoch=99" "batch=5"; do
  rm -rf "$work/e" && cp -r "$work/c" "$work/e"
  f=$(ls "$work"/e/ckpt-*.safetensors | tail -1)
  python3 - "$f" "$edit" <<'PY'
import json, struct, sys, zlib
path, edit = sys.argv[1], sys.argv[2]
key, value = edit.split("=")
data = open(path, "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
md = header["__metadata__"]
md[key] = value
# The header CRC covers the header without it: recompute so the file verifies
# (an attacker or a buggy writer can do the same); only the position lies.
crc_key = [k for k in md if k.endswith("header_crc32")]
for k in crc_key:
    del md[k]
text = json.dumps(header, separators=(",", ":"), sort_keys=True)
if crc_key:
    md[crc_key[0]] = "%08x" % zlib.crc32(text.encode())
    text = json.dumps(header, separators=(",", ":"), sort_keys=True)
body = text.encode()
body += b" " * (-(len(body)) % 8)
open(path, "wb").write(struct.pack("<Q", len(body)) + body + data[8 + n:])
PY
  rm -f "$work/e/manifest"  # the manager's list of its files names the header's old CRC
  rc=0
  "$bin" "$@" --replicas 2 --epochs 4 --limit 320 --test-limit 500 --batch 32 --checkpoint-dir "$work/e" > "$work/e.log" 2>&1 || rc=$?
  if grep -q "final:" "$work/e.log" && [[ $rc -eq 0 ]]; then
    cat "$work/e.log"; fail "$edit: the contradicting checkpoint was believed"
  fi
  grep -q "kDataLoss.*contradicts itself" "$work/e.log" || { cat "$work/e.log"; fail "$edit: no DataLoss error naming the contradiction"; }
  echo "ok: $edit refused: $(grep -m1 -o 'kDataLoss.*' "$work/e.log" | cut -c1-200)"
done
