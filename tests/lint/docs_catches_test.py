#!/usr/bin/env python3
"""check_docs.py fails, naming file and line, on docs with each kind of stale text.

Usage: docs_catches_test.py CHECKER SOURCE_ROOT
Copies the Markdown files and what the checker reads of SOURCE_ROOT into a
temporary directory, expects the copy to pass, plants one fault of each kind
(issue 43 found each in the docs by hand) and expects the checker to exit 1
naming each.
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile

checker, root = sys.argv[1], sys.argv[2]


def run(tree):
    p = subprocess.run([sys.executable, checker, tree], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout + p.stderr


def append(tree, rel, text):
    path = os.path.join(tree, rel)
    with open(path, encoding="utf-8") as f:
        n = f.read().count("\n")
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
    return n  # the planted text's first line is n + 1


failures = []
with tempfile.TemporaryDirectory(prefix="diststrat_lint_docs_") as tmp:
    for d in ("docs", "src", "include", "tools", "examples", "benchmarks"):
        shutil.copytree(os.path.join(root, d), os.path.join(tmp, d))
    for f in glob.glob(os.path.join(root, "*.md")):
        shutil.copy(f, tmp)
    rc, out = run(tmp)
    if rc != 0:
        failures.append(f"the unchanged copy fails (rc {rc}):\n{out}")
    n = append(tmp, "docs/gpu.md", "\n| a | b |\n|---|---|\n| `x|y` | z |\n\ntext\n| stray | row |\n")
    expected = {
        f"docs/gpu.md:{n + 4}:": "a table row of 3 cells under a header of 2",
        f"docs/gpu.md:{n + 7}:": "a table row outside any table",
    }
    n = append(tmp, "docs/slurm.md", "\n```sh\nsrun --mpi=pmix ./train \\\n  --strategy multi_worker\n```\n"
               "build/examples/train and /opt/diststrat/bin/predict\n")
    expected[f"docs/slurm.md:{n + 3}:"] = "passes --strategy (the examples' flag) but runs no program"
    expected[f"docs/slurm.md:{n + 6}: build/examples/train"] = "the build makes no such program"
    expected[f"docs/slurm.md:{n + 6}: bin/predict"] = "installs no such program"
    # A source file over the limit (and its room's count off by more than 10%).
    append(tmp, "src/nn/mlp.cc", "// planted\n" * 700)
    expected["docs/architecture.md:"] = "src/nn/mlp.cc has"
    expected["src/nn: the table says"] = "lines, the folder has"
    os.makedirs(os.path.join(tmp, "src", "newroom"))
    with open(os.path.join(tmp, "src", "newroom", "a.cc"), "w") as f:
        f.write("int a;\n")
    expected["docs/architecture.md:1:"] = "no row for src/newroom"
    rc, out = run(tmp)
    if rc != 1:
        failures.append(f"the planted faults give rc {rc}, expected 1:\n{out}")
    for where, what in expected.items():
        if not any(where in line and what in line for line in out.splitlines()):
            failures.append(f"no line with '{where}' and '{what}' in:\n{out}")

for f in failures:
    print("FAIL:", f)
sys.exit(1 if failures else 0)
