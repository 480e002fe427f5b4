#!/usr/bin/env bash
# Fails, naming each file, when clang-format (the committed .clang-format)
# would change a C++/CUDA file under src/ include/ tests/ examples/
# benchmarks/ tools/.
#   tools/lint/check_format.sh [SOURCE_ROOT]     check (the lint_format test)
#   tools/lint/check_format.sh --fix [SOURCE_ROOT]  format those files in place
# clang-format comes from Debian (scripts/setup.sh); other major versions
# format some constructs differently, so the check names the version it ran.
set -euo pipefail
fix=0
if [[ ${1:-} == --fix ]]; then fix=1; shift; fi
root=$(cd "${1:-$(dirname "$0")/../..}" && pwd)
cd "$root"
command -v clang-format > /dev/null || { echo "check_format: clang-format not found (scripts/setup.sh installs it)" >&2; exit 2; }
[[ -f .clang-format ]] || { echo "check_format: no .clang-format in $root" >&2; exit 2; }
dirs=(src include tests examples benchmarks tools)
if [[ $(git rev-parse --show-toplevel 2> /dev/null) == "$root" ]]; then  # the files git knows
  mapfile -t files < <(git ls-files -- "${dirs[@]}" | grep -E '\.(h|cc|cu|cuh)$' || true)
else
  present=()
  for d in "${dirs[@]}"; do [[ -d $d ]] && present+=("$d"); done
  mapfile -t files < <(find "${present[@]}" -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) | sort)
fi
((${#files[@]} > 0)) || { echo "check_format: no source files found under $root" >&2; exit 2; }
if ((fix)); then
  clang-format -i --style=file "${files[@]}"
  echo "check_format: formatted ${#files[@]} files ($(clang-format --version))"
  exit 0
fi
# One run over every file; each unformatted spot is a warning
# "<file>:<line>:<col>: warning: ... [-Wclang-format-violations]". Without
# --Werror the run fails only when clang-format itself cannot work.
out=$(clang-format --dry-run --style=file "${files[@]}" 2>&1) ||
  { echo "$out" | tail -5 >&2; echo "check_format: clang-format failed" >&2; exit 2; }
mapfile -t bad < <(sed -n 's/^\([^:]*\):[0-9]*:[0-9]*: .*clang-format-violations.*/\1/p' <<< "$out" | sort -u)
if ((${#bad[@]})); then
  for f in "${bad[@]}"; do echo "$f: not as clang-format would write it (tools/lint/check_format.sh --fix)"; done
  echo "check_format: ${#bad[@]} of ${#files[@]} files not formatted ($(clang-format --version))"
  exit 1
fi
echo "check_format: ${#files[@]} files formatted ($(clang-format --version))"
