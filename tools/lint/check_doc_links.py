#!/usr/bin/env python3
"""Checks the links between the project's pages (README.md, docs/*.md).

Every link to a local file must name one that exists, and a link to a
heading (`page.md#anchor`, `#anchor`) one that the page has, by GitHub's
anchor rule (lower case; punctuation other than '-' and '_' dropped; spaces
to '-'; a repeated heading gets -1, -2 ...). A page that promised a section
it did not have (the README's "launch recipes" of docs/elastic.md, issue 43)
fails here.

usage: check_doc_links.py SOURCE_DIR [FILE.md ...]   (default: README.md docs/*.md)
Exit 0 when every link resolves; 1 with one line per broken link.
"""
import os
import re
import sys

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(heading):
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def lines_outside_code(path):
    """(line number, text) of the lines that are not in a fenced block."""
    out, fenced = [], False
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if FENCE.match(line):
                fenced = not fenced
                continue
            if not fenced:
                out.append((n, line))
    return out


def anchors(path, cache={}):
    if path not in cache:
        seen, found = {}, set()
        for _, line in lines_outside_code(path):
            m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
            if not m:
                continue
            s = slug(m.group(2))
            k = seen.get(s, 0)
            found.add(s if k == 0 else "%s-%d" % (s, k))
            seen[s] = k + 1
        for _, line in lines_outside_code(path):  # <a name="x"> / id="x"
            for a in re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line):
                found.add(a)
        cache[path] = found
    return cache[path]


def check(root, page):
    errors = []
    where = os.path.relpath(page, root)
    for n, line in lines_outside_code(page):
        line = re.sub(r"`[^`]*`", "", line)  # code spans hold no links
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(dest):
                errors.append("%s:%d: link to %s: no such file" % (where, n, target))
                continue
            if anchor and dest.endswith(".md") and anchor not in anchors(dest):
                errors.append(
                    "%s:%d: link to %s: %s has no heading with anchor '%s'"
                    % (where, n, target, os.path.relpath(dest, root), anchor)
                )
    return errors


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = argv[1]
    pages = [os.path.join(root, p) for p in argv[2:]]
    if not pages:
        pages = [os.path.join(root, "README.md")]
        docs = os.path.join(root, "docs")
        pages += sorted(os.path.join(docs, p) for p in os.listdir(docs) if p.endswith(".md"))
    errors = []
    for page in pages:
        errors += check(root, page)
    for e in errors:
        print(e)
    if errors:
        print("%d broken link(s) between the pages" % len(errors))
        return 1
    print("%d page(s): every link resolves" % len(pages))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
