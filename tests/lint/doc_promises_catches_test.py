#!/usr/bin/env python3
"""check_doc_promises.py fails, naming the line, on a promise of closeness
without a number of steps (the text docs/elastic.md had before issue 43), and
passes the same promise once it says over how many steps it was measured.

Usage: doc_promises_catches_test.py CHECKER
"""
import os
import subprocess
import sys
import tempfile

checker = sys.argv[1]
BAD = """# Elastic

- **Exactly once.** A step either completes in a commit or is redone by the
  next group, so every row is used exactly once per epoch. The tests count
  it, after kills and joins, and the weights match the same training run
  sequentially over the same global batches to within 1e-5.
"""
GOOD = BAD.replace("to within 1e-5.", "to within 1e-5 (a linear model, 12 steps).")
HEADER = """// The weights match the run with one worker
// (within 2e-6).
int f();
"""

failures = []
with tempfile.TemporaryDirectory(prefix="diststrat_lint_") as tmp:
    def check(name, text):
        path = os.path.join(tmp, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        p = subprocess.run([sys.executable, checker, tmp, path], capture_output=True, text=True,
                           timeout=60)
        return p.returncode, p.stdout + p.stderr

    rc, out = check("bad.md", BAD)
    if rc != 1 or "bad.md:3: 'within 1e-5'" not in out:
        failures.append(f"the promise without steps was not named (rc {rc}):\n{out}")
    rc, out = check("good.md", GOOD)
    if rc != 0:
        failures.append(f"the promise with its steps was refused (rc {rc}):\n{out}")
    rc, out = check("bad.h", HEADER)
    if rc != 1 or "bad.h:1: 'within 2e-6'" not in out:
        failures.append(f"the header's promise without steps was not named (rc {rc}):\n{out}")

for f in failures:
    print("FAIL:", f)
sys.exit(1 if failures else 0)
