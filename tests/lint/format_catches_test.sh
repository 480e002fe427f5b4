#!/usr/bin/env bash
# check_format.sh fails, naming the file, on a tree with one unformatted file,
# and passes once --fix has formatted it.
#   format_catches_test.sh CHECKER SOURCE_ROOT
set -euo pipefail
checker=$1 root=$2
tmp=$(mktemp -d /tmp/diststrat_lint_format.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/src/core" "$tmp/tests"
cp "$root/.clang-format" "$tmp/"
cp "$root/src/core/error.cc" "$tmp/src/core/error.cc"  # formatted
printf 'int  answer( ){return 42 ;}\n' > "$tmp/tests/unformatted.cc"
fail() { echo "FAIL: $*"; exit 1; }
rc=0; out=$("$checker" "$tmp" 2>&1) || rc=$?
echo "$out"
((rc == 1)) || fail "rc $rc on a tree with an unformatted file, expected 1"
grep -q '^tests/unformatted.cc: not as clang-format would write it' <<< "$out" || fail "the file is not named"
grep -q 'check_format: 1 of 2 files not formatted' <<< "$out" || fail "the count is wrong"
"$checker" --fix "$tmp" > /dev/null
out=$("$checker" "$tmp" 2>&1) || fail "still failing after --fix: $out"
echo "$out"
echo "format_catches_test: ok"
