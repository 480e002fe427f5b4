#!/usr/bin/env python3
"""check_layering.py fails, naming file, line and rooms, on a tree with wrong includes.

Usage: layering_catches_test.py CHECKER SOURCE_ROOT
Copies src/ and include/ of SOURCE_ROOT into a temporary directory, plants one
breach of each kind, and expects the checker to exit 1 and to name each.
"""
import os
import shutil
import subprocess
import sys
import tempfile

checker, root = sys.argv[1], sys.argv[2]


def run(tree):
    p = subprocess.run([sys.executable, checker, tree], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout + p.stderr


def plant(tree, rel, text):
    path = os.path.join(tree, rel)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    lines.append(text)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return f"{rel}:{len(lines)}:"


failures = []
with tempfile.TemporaryDirectory(prefix="diststrat_lint_") as tmp:
    for d in ("src", "include"):
        shutil.copytree(os.path.join(root, d), os.path.join(tmp, d))
    rc, out = run(tmp)
    if rc != 0:
        failures.append(f"the unchanged copy fails (rc {rc}):\n{out}")
    expected = {
        # the ground floor includes a strategy
        plant(tmp, "src/core/tensor.cc", '#include "parameter_server/service.h"'):
            "core includes parameter_server",
        # a strategy includes a sibling
        plant(tmp, "src/central_storage/central_storage_strategy.cc", '#include "diststrat/mirrored.h"'):
            "central_storage and mirrored are siblings",
        # io includes a strategy's public header
        plant(tmp, "src/io/checkpoint.cc", '#include "diststrat/parameter_server.h"'):
            "io includes parameter_server",
        # a room that is not a seam includes the CUDA integration
        plant(tmp, "src/optim/optimizer.cc", '#include "gpu/cuda_backend.h"'):
            "only the registration seams include src/gpu",
        # std::filesystem in the library (LibTorch's copy would be called)
        plant(tmp, "src/core/tensor.cc", '#include <filesystem>'):
            "<filesystem> in code that may be linked with LibTorch",
    }
    with open(os.path.join(tmp, "include/diststrat/new_concept.h"), "w") as f:
        f.write("#pragma once\n")
    expected["include/diststrat/new_concept.h:1:"] = "public header with no room"
    rc, out = run(tmp)
    if rc != 1:
        failures.append(f"the planted tree: rc {rc}, expected 1:\n{out}")
    for where, what in expected.items():
        if not any(line.startswith(where) and what in line for line in out.splitlines()):
            failures.append(f"no line '{where} ... {what}' in:\n{out}")
    if len(out.strip().splitlines()) != len(expected) + 1:  # the breaches and the summary
        failures.append(f"expected {len(expected)} breaches and a summary, got:\n{out}")

for f in failures:
    print("FAIL:", f)
print("layering_catches_test:", "FAILED" if failures else "ok")
sys.exit(1 if failures else 0)
