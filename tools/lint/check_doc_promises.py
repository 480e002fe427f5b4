#!/usr/bin/env python3
"""Every promise of closeness to another run in the docs says over how many steps.

Usage: check_doc_promises.py SOURCE_ROOT [FILE...]

Float training matches another run (a sequential one, another worker count,
an unsharded one) only as far as rounding allows, and training amplifies
rounding: 1 and 2 replicas of the example's MLP agree to 1.3e-7 after 50
steps and differ by 0.0067 after 100 (issue 43). So a paragraph of docs/,
README.md or a public header's comment that gives a tolerance ("within
1e-5", "<= 2e-6", "≤ 1e-4") must say how many steps (or updates) it holds
for, as the tests that back it measure it: "within 1e-5 after 20 steps".
Exits 1 naming file and line of each paragraph that does not.
"""
import os
import re
import sys

TOLERANCE = re.compile(r"(?:within|≤|<=)\s*\d*(?:\.\d+)?e-\d+")
ITEM = re.compile(r"(?:[-*+]|\d+\.|\|)\s")
HORIZON = re.compile(r"\b\d+(?:\s*[–-]\s*\d+)?\s+(?:steps|updates)\b")


def paragraphs(path):
    """(first line number, text) of each paragraph: blank-line separated in
    Markdown (each list item and table row on its own), comment blocks
    (separated by an empty comment or code) in headers."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    header = path.endswith(".h")
    start, buf = 0, []
    for i, line in enumerate(lines, 1):
        if header:
            s = line.strip()
            text = s[2:].strip() if s.startswith("//") else ""
        else:
            text = line.strip()
            if buf and ITEM.match(text):  # a list item or table row is its own paragraph
                yield start, " ".join(buf)
                buf = []
        if text:
            if not buf:
                start = i
            buf.append(text)
        elif buf:
            yield start, " ".join(buf)
            buf = []
    if buf:
        yield start, " ".join(buf)


def files(root):
    yield os.path.join(root, "README.md")
    for sub, ext in (("docs", ".md"), ("include", ".h")):
        for d, _, names in os.walk(os.path.join(root, sub)):
            for n in sorted(names):
                if n.endswith(ext):
                    yield os.path.join(d, n)


def main():
    root = sys.argv[1]
    bad = []
    for path in sys.argv[2:] or list(files(root)):
        if not os.path.exists(path):
            continue
        for line, text in paragraphs(path):
            m = TOLERANCE.search(text)
            if m and not HORIZON.search(text):
                bad.append(f"{os.path.relpath(path, root)}:{line}: '{m.group(0)}' says no number "
                           f"of steps it holds for")
    for b in bad:
        print(b)
    if bad:
        print(f"{len(bad)} promise(s) of closeness to another run without a horizon: say over how "
              "many steps the test that backs each one measured it (training amplifies rounding; "
              "docs/elastic.md, 'Not the numbers of a fixed worker count')")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
