#!/usr/bin/env python3
"""Checks the Markdown documentation against itself and the tree.

Usage: check_docs.py [SOURCE_ROOT]      (default: the repository above tools/)

What stale text this catches (issue 43 found each by hand):
- tables: every row has as many cells as its header (a '|' in a cell must
  be written '\\|', inside backticks too: GitHub splits the cell there), and
  no table row stands apart from its table (a paragraph between them makes
  it a line of text);
- programs: a path build/examples/X, build/tools/X or build/benchmarks/X
  names a program the build makes there, <prefix>/bin/X (/opt/diststrat,
  $prefix, <prefix>) one that `cmake --install` puts there, and a command in
  a shell block that passes the examples' --strategy runs a program the
  build makes (not a ./train that does not exist);
- docs/architecture.md: its limit on lines per file under src/, include/
  and tools/ holds except for the files it names as over it, each of which
  is; its table of rooms has one row per folder of src/, with line counts
  within 10% of the folder's .cc/.h/.cu files and file counts within 3.
Prints "file:line: what" for each and exits 1; exits 0 with a summary.
"""
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
problems = []


def problem(path, line, what):
    problems.append(f"{os.path.relpath(path, root)}:{line}: {what}")


def markdown_files():
    out = [os.path.join(root, f) for f in os.listdir(root) if f.endswith(".md")]
    for d, dirs, files in os.walk(os.path.join(root, "docs")):
        out += [os.path.join(d, f) for f in files if f.endswith(".md")]
    return sorted(p for p in out if os.path.isfile(p))


def read_lines(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read().split("\n")


FENCE = re.compile(r"^\s*(```|~~~)")


def prose_and_fences(lines):
    """(line number, text, fence info or None) for every line; fence lines themselves skipped."""
    fence = None
    for i, text in enumerate(lines, 1):
        m = FENCE.match(text)
        if m:
            fence = None if fence is not None else text.strip()[3:].strip()
            continue
        yield i, text, fence


# ---- tables ----------------------------------------------------------------------
DELIMITER = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")


def cells(row):
    row = row.strip()
    if row.startswith("|"):
        row = row[1:]
    if row.endswith("|") and not row.endswith("\\|"):
        row = row[:-1]
    return len(re.split(r"(?<!\\)\|", row))


def is_row(text):
    t = text.strip()
    return t.startswith("|") and t.endswith("|") and len(t) > 1


def check_tables(path, lines):
    prose = [(i, t) for i, t, fence in prose_and_fences(lines) if fence is None]
    in_table, width, prev_line = False, 0, -1
    for k, (i, text) in enumerate(prose):
        contiguous = i == prev_line + 1
        prev_line = i
        if in_table and contiguous and text.strip().startswith("|"):
            n = cells(text)
            if n != width:
                problem(path, i, f"a table row of {n} cells under a header of {width} "
                        "(an unescaped '|' in a cell? write \\|)")
            continue
        in_table = False
        nxt = prose[k + 1] if k + 1 < len(prose) else None
        if is_row(text) and nxt and nxt[0] == i + 1 and DELIMITER.match(nxt[1]) and "-" in nxt[1]:
            in_table, width = True, cells(text)
            if cells(nxt[1]) != width:
                problem(path, nxt[0], f"the delimiter row has {cells(nxt[1])} cells, the header {width}")
            continue
        if DELIMITER.match(text) and "|" in text and "-" in text:
            continue  # the header's delimiter row, checked with the header
        if is_row(text):
            problem(path, i, "a table row outside any table (text or a blank line between it "
                    "and its table makes it a line of text)")


# ---- programs --------------------------------------------------------------------
def cmake_files(sub):
    for d, dirs, files in os.walk(os.path.join(root, sub)):
        for f in files:
            if f == "CMakeLists.txt":
                yield os.path.join(d, f)


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def programs():
    """(build-tree names per folder, installed names) as the CMake files make them."""
    built = {"examples": set(), "tools": set(), "benchmarks": set()}
    installed = set()
    for f in cmake_files("examples"):
        text = read(f)
        built["examples"] |= set(re.findall(r"add_executable\(([\w.-]+)", text))
        # examples/CMakeLists.txt: built as diststrat-<name>, installed so.
        for target in re.findall(r"diststrat_example_program\((\w+)\)", text):
            name = "diststrat-" + target.replace("_", "-")
            built["examples"].add(name)
            installed.add(name)
        for group in re.findall(r"install\(TARGETS\s+([^)]*?)\s+RUNTIME", text):
            installed |= {t for t in group.split() if not t.startswith("$")}
    for f in cmake_files("tools"):
        text = read(f)
        built["tools"] |= set(re.findall(r"add_executable\(([\w.-]+)", text))
        for group in re.findall(r"install\(TARGETS\s+([^)]*?)\s+RUNTIME", text):
            installed |= set(group.split())
    for f in cmake_files("benchmarks"):
        built["benchmarks"] |= set(re.findall(r"add_executable\(([\w.-]+)", read(f)))
    return built, installed


BUILD_PATH = re.compile(r"\bbuild/(examples|tools|benchmarks)/([A-Za-z_][\w.-]*)")
PREFIX_BIN = re.compile(r"(?:/opt/diststrat|\$\{?prefix\}?|\$\{?PREFIX\}?|<prefix>)/bin/([A-Za-z_][\w.-]*)")
SHELL = {"", "sh", "bash", "console", "shell"}


def check_programs(path, lines, built, installed):
    every = set().union(*built.values()) | installed
    logical, start = "", 0
    for i, text, fence in prose_and_fences(lines):
        for m in BUILD_PATH.finditer(text):
            if m.group(2) not in built[m.group(1)]:
                problem(path, i, f"build/{m.group(1)}/{m.group(2)}: the build makes no such program "
                        f"(it makes {', '.join(sorted(built[m.group(1)]))})")
        for m in PREFIX_BIN.finditer(text):
            if m.group(1) not in installed:
                problem(path, i, f"bin/{m.group(1)}: `cmake --install` installs no such program "
                        f"(it installs {', '.join(sorted(installed))})")
        if fence is None or fence.split()[0:1] not in ([], *[[s] for s in SHELL]):
            logical = ""
            continue
        if not logical:
            start = i
        logical += text.rstrip("\\") + " "
        if text.rstrip().endswith("\\"):
            continue
        if re.search(r"(^|\s)--strategy(\s|=|$)", logical):
            words = {os.path.basename(w.strip("\"'")) for w in logical.split()}
            if not words & every:
                problem(path, start, "a command passes --strategy (the examples' flag) but runs no "
                        "program the build makes: " + logical.strip()[:120])
        logical = ""


# ---- docs/architecture.md --------------------------------------------------------
CODE = (".cc", ".h", ".cu")


def line_count(path):
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def check_architecture(path, lines):
    text = "\n".join(lines)
    flat = re.sub(r"\s+", " ", text)
    m = re.search(r"no file (?:under `src/`, `include/` or `tools/` )?is over ([\d,]+) lines", flat)
    if not m:
        problem(path, 1, "no sentence 'no file under `src/`, `include/` or `tools/` is over N lines'")
        limit = None
    else:
        limit = int(m.group(1).replace(",", ""))
        at = next((i for i, t in enumerate(lines, 1) if "lines" in t and "over" in t), 1)
        e = re.search(r"Over it today[^:]*:(.*?)\.( |$)", flat)
        named = set(re.findall(r"`([\w/.-]+\.(?:cc|h|cu|py|sh))`", e.group(1))) if e else set()
        over = {}
        for top in ("src", "include", "tools"):
            for d, dirs, files in os.walk(os.path.join(root, top)):
                for f in files:
                    if f.endswith(CODE + (".py", ".sh")):
                        p = os.path.join(d, f)
                        n = line_count(p)
                        if n > limit:
                            over[os.path.relpath(p, root)] = n
        for p in sorted(set(over) - named):
            problem(path, at, f"says no file is over {limit} lines, but {p} has {over[p]} "
                    "(split it, or name it under 'Over it today')")
        for p in sorted(named - set(over)):
            problem(path, at, f"names {p} as over {limit} lines, but it is not (any more)")
    rooms = {}
    src = os.path.join(root, "src")
    for room in sorted(os.listdir(src)):
        files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(src, room))
                 for f in fs if f.endswith(CODE)]
        if files:
            rooms[room] = (sum(line_count(f) for f in files), len(files))
    seen = set()
    for i, row in enumerate(lines, 1):
        r = re.match(r"^\| `src/(\w+)` \| ([\d,]+) \| (\d+) \|", row)
        if not r:
            continue
        room, lines_said, files_said = r.group(1), int(r.group(2).replace(",", "")), int(r.group(3))
        seen.add(room)
        if room not in rooms:
            problem(path, i, f"the table lists src/{room}, which has no source file")
            continue
        n, k = rooms[room]
        if abs(n - lines_said) > 0.1 * n:
            problem(path, i, f"src/{room}: the table says {lines_said:,} lines, the folder has {n:,}")
        if abs(k - files_said) > 3:
            problem(path, i, f"src/{room}: the table says {files_said} files, the folder has {k}")
    for room in sorted(set(rooms) - seen):
        problem(path, 1, f"the table of rooms has no row for src/{room}")


built, installed = programs()
files = markdown_files()
for path in files:
    lines = read_lines(path)
    check_tables(path, lines)
    check_programs(path, lines, built, installed)
arch = os.path.join(root, "docs", "architecture.md")
if os.path.isfile(arch):
    check_architecture(arch, read_lines(arch))

for p in problems:
    print(p)
if problems:
    sys.exit(1)
print(f"ok: {len(files)} Markdown files: tables, program names and docs/architecture.md's "
      "counts match the tree")
