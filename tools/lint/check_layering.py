#!/usr/bin/env python3
"""Checks the library's floors from the #includes of src/ and include/diststrat/.

Usage: check_layering.py [SOURCE_ROOT]      (default: the repository above tools/)

Every file belongs to a room: src/<room>/... to <room>, a public header
include/diststrat/<name>.h to the room that implements it (PUBLIC_HEADERS).
Rooms stand in floors (FLOORS). A file may include its own room and rooms on
lower floors; never a room on its own floor (strategies are siblings) or
above. Two exceptions, each named here: the umbrella header includes
everything, and only the registration seams (SEAMS) include the optional
integrations' rooms (src/gpu) from below.
One more rule, for every file that may be linked into a program with
LibTorch (NO_FILESYSTEM): no #include <filesystem>.
Prints every breach as "file:line: <room> includes <room> (<header>): why"
and exits 1; exits 0 with a one-line summary when the tree keeps the rules.
docs/architecture.md describes the same floors.
"""
import os
import re
import sys

# Lowest first. A room may include rooms of lower floors only.
FLOORS = [
    ["core"],                    # errors, dtypes, tensors, devices, files, threads: includes no other room
    ["allreduce"],               # collectives: algorithms once, every transport and communicator
    ["runtime"],                 # what every strategy shares: Strategy base, replicas, cluster, processes
    ["nn", "optim"],             # layers and losses; optimizers
    ["io"],                      # checkpoints (of variables and optimizer state), dataset readers
    ["mirrored", "multiworker", "central_storage", "parameter_server"],  # strategies: siblings
    ["torch"],                   # diststrat::torch, over everything
]
# The CUDA integration implements core's GpuBackend seam and the NCCL
# communicator: it may include any room up to this floor, and only the seams
# below include it.
GPU_FLOOR = "optim"
SEAMS = {
    "src/core/gpu_backend.cc": {"gpu"},  # registers the CUDA backend when built with CUDA
}
# Public headers by the room that implements them.
PUBLIC_HEADERS = {
    "config": "core", "error": "core", "dtype": "core", "tensor": "core", "device": "core",
    "device_manager": "core", "gpu_lease": "core", "logging": "core", "fault": "core",
    "collective": "core", "flight_recorder": "core", "cpu_isa": "core",
    "algorithm_registry": "allreduce",
    "strategy": "runtime", "variable": "runtime", "data": "runtime", "cluster": "runtime",
    "determinism": "runtime",
    "slurm": "runtime",
    "process_group": "runtime", "elastic_options": "runtime",
    "nn": "nn", "optimizer": "optim", "learning_rate_schedule": "optim", "update_rule": "optim",
    "gradient_options": "optim", "optimizer_sharding": "optim",
    "safetensors": "io", "checkpoint": "io", "checkpoint_manager": "io", "preemption": "io",
    "io": "io", "data_position": "io",
    "mirrored": "mirrored", "multi_worker_mirrored": "multiworker",
    "elastic": "multiworker",
    "central_storage": "central_storage", "parameter_server": "parameter_server", "cluster_coordinator": "parameter_server",
    "torch": "torch",
    "diststrat": None,  # the umbrella: includes every public header
}

floor_of = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
floor_of["gpu"] = floor_of[GPU_FLOOR] + 0.5
INCLUDE = re.compile(r'\s*#\s*include\s*[<"]([^>"]+)[>"]')


def room_of(rel):
    parts = rel.split("/")
    if parts[0] == "include":
        name = os.path.splitext(os.path.splitext(parts[-1])[0])[0]  # config.h.in -> config
        if name not in PUBLIC_HEADERS:
            raise LookupError("public header with no room: add it to PUBLIC_HEADERS")
        return PUBLIC_HEADERS[name]
    if parts[1] not in floor_of:
        raise LookupError(f"room '{parts[1]}' is on no floor: add it to FLOORS")
    return parts[1]


def target_of(inc, here_dir, root):
    """The repository path an #include names, or None (system / third party)."""
    if inc.startswith("diststrat/"):
        return "include/" + inc
    for base in (os.path.join(root, "src"), here_dir):
        if os.path.exists(os.path.join(base, inc)):
            return os.path.relpath(os.path.normpath(os.path.join(base, inc)), root)
    return None


def why(src, dst):
    if dst == "gpu":
        return "only the registration seams include src/gpu"
    if floor_of[src] == floor_of[dst]:
        return f"{src} and {dst} are siblings on one floor"
    return f"{dst} is above {src}"


# Code that may be linked into a program with LibTorch (the library, its
# public headers, the LibTorch tests, the headers tests share, the examples)
# does not include <filesystem>: PyTorch's 2.x libtorch.so exports a copy of
# std::filesystem that crashes its callers (pytorch/pytorch#133437).
NO_FILESYSTEM = ("src", "include/diststrat", "tests/torch", "tests/common", "examples")


def sources(root, tops):
    """(dirpath, path, rel) of every C++/CUDA source under the folders `tops`, in order."""
    for top in tops:
        for dirpath, dirnames, names in os.walk(os.path.join(root, top)):
            dirnames.sort()
            for name in sorted(names):
                if re.search(r"\.(h|cc|cu|cuh|h\.in)$", name):
                    path = os.path.join(dirpath, name)
                    yield dirpath, path, os.path.relpath(path, root)


def check_no_filesystem(root):
    breaches = []
    for _, path, rel in sources(root, NO_FILESYSTEM):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line_no, line in enumerate(f, 1):
                m = INCLUDE.match(line)
                if m and m.group(1) == "filesystem":
                    breaches.append(
                        f"{rel}:{line_no}: <filesystem> in code that may be linked with "
                        f"LibTorch: PyTorch's libtorch.so exports a std::filesystem that "
                        f"crashes callers (pytorch/pytorch#133437); use POSIX calls")
    return breaches


def check(root):
    breaches, files = check_no_filesystem(root), 0
    for dirpath, path, rel in sources(root, ("src", "include/diststrat")):
        files += 1
        try:
            src = room_of(rel)
        except LookupError as e:
            breaches.append(f"{rel}:1: {e}")
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for line_no, line in enumerate(f, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                target = target_of(m.group(1), dirpath, root)
                if target is None or src is None:
                    continue
                try:
                    dst = room_of(target)
                except LookupError as e:
                    breaches.append(f"{rel}:{line_no}: {m.group(1)}: {e}")
                    continue
                if dst is None or dst == src or dst in SEAMS.get(rel, ()):
                    continue
                if src == "gpu" and floor_of[dst] <= floor_of[GPU_FLOOR]:
                    continue
                if dst == "gpu" or floor_of[dst] >= floor_of[src]:
                    breaches.append(f"{rel}:{line_no}: {src} includes {dst} "
                                    f"({m.group(1)}): {why(src, dst)}")
    return breaches, files


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), "..", ".."))
    breaches, files = check(root)
    for b in breaches:
        print(b)
    if breaches:
        print(f"check_layering: {len(breaches)} include(s) break the floors "
              f"(rules: tools/lint/check_layering.py, docs/architecture.md)")
        return 1
    print(f"check_layering: {files} files keep the floors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
