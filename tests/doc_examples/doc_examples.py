#!/usr/bin/env python3
"""Every C++ example in README.md, CONTRIBUTING.md, docs/*.md and the public
headers (include/diststrat/*.h), built against an installed diststrat and run.

The convention (CONTRIBUTING.md, "Code examples in docs and headers"):

  ```cpp [tags]            in Markdown
  //   ```cpp [tags]       in a header comment (the example's lines follow,
  //   ...                 as comment lines; the fence closes with //   ```)
  //   ```

  tags:
    fragment[=PRELUDE]  not a whole program: compiled as the body of a function
                        after tests/doc_examples/preludes/PRELUDE.h (default
                        "base": the includes and `namespace ds/dt`), which
                        declares the names the fragment uses. Without this tag
                        the example is a whole program: it defines main().
    torch               needs LibTorch (diststrat::torch): built when the
                        installed package has it, else skipped, saying so.
    mpi                 run under `mpirun -np 2` (and built against MPI when
                        it uses MPI itself).
    gpu                 needs a GPU: compiled, never run here (said so).
    norun               compiled only (needs what a test cannot give: a store,
                        a Slurm step, a PS job); the prelude's comment says
                        why. A prelude with `// @params:` is compiled only.
    args=A,B            a run with arguments A B; several args= tags: several
                        runs, in order, in the same working directory (a
                        program that resumes from what the run before left).

Examples of one kind (with or without torch) are compiled in ONE translation
unit, each in a namespace of its own with its includes hoisted to the top and
main() renamed; the unit's main() runs the example named by argv[1]. A
fragment or program that runs gets its own empty working directory.

  doc_examples.py check SOURCE_DIR
      the tags and fences only (no build): unknown tags, an unclosed fence, a
      whole example without main(), a missing prelude, a header comment that
      shows code outside a fence.
  doc_examples.py run SOURCE_DIR PREFIX WORK_DIR [--torch] [--mpiexec PATH]
      generate, configure against PREFIX (find_package(diststrat)), build
      (-j2) and run; a summary line per example; exit status 1 on any failure.
"""
import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

KNOWN_TAGS = {"fragment", "torch", "mpi", "gpu", "norun", "args"}
RUN_TIMEOUT_S = 120  # one example's run (mpirun included); a hang is a failure
HERE = os.path.dirname(os.path.abspath(__file__))
PRELUDES = os.path.join(HERE, "preludes")

FENCE_MD = re.compile(r"^(\s*)(```+|~~~+)\s*(.*?)\s*$")
FENCE_H = re.compile(r"^\s*//(\s*)```\s*(.*?)\s*$")
# A header comment line that reads as code (a call or a declaration ending in ';').
CODE_IN_COMMENT = re.compile(
    r"^\s*//\s{2,}(?!-).*(\b(ds|dt|diststrat)::|\b\w+(\.|->)\w+\(|\bauto\b).*;\s*(//.*)?$")


class Example:
    def __init__(self, path, line, tags, code):
        self.path = path  # relative to the source dir
        self.line = line  # 1-based line of the first code line
        self.tags = tags
        self.code = code  # list of lines
        self.prelude = "base"
        self.fragment = False
        for t in tags:
            if t.startswith("fragment"):
                self.fragment = True
                if "=" in t:
                    self.prelude = t.split("=", 1)[1]

    @property
    def where(self):
        return "%s:%d" % (self.path, self.line)

    def has(self, tag):
        return tag in self.tags


def parse_tags(info):
    """'cpp fragment=x torch' -> (is_cpp, tags)."""
    words = info.split()
    if not words or words[0] not in ("cpp", "c++"):
        return False, []
    return True, words[1:]


def scan_markdown(rel, text, errors):
    out = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = FENCE_MD.match(lines[i])
        if not m:
            i += 1
            continue
        marker, info = m.group(2), m.group(3)
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(marker[:3]):
            j += 1
        if j == len(lines):
            errors.append("%s:%d: fence not closed" % (rel, i + 1))
            return out
        body = lines[i + 1:j]
        is_cpp, tags = parse_tags(info)
        if is_cpp:
            indent = len(m.group(1))
            out.append(Example(rel, i + 2, tags, [l[indent:] for l in body]))
        elif not info and any(re.search(r"\b(ds|dt|diststrat)::\w+.*;", l) for l in body):
            errors.append("%s:%d: C++ in a fence without a language: write ```cpp (and its tags)"
                          % (rel, i + 1))
        i = j + 1
    return out


def scan_header(rel, text, errors):
    out = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = FENCE_H.match(lines[i])
        if not m:
            if CODE_IN_COMMENT.match(lines[i]):
                errors.append("%s:%d: code in a comment outside a fence: put the example in "
                              "//   ```cpp [tags] ... //   ``` (CONTRIBUTING.md)" % (rel, i + 1))
            i += 1
            continue
        is_cpp, tags = parse_tags(m.group(2))
        if not is_cpp:
            errors.append("%s:%d: a fence in a header comment must be ```cpp" % (rel, i + 1))
        j = i + 1
        while j < len(lines) and not FENCE_H.match(lines[j]):
            if not re.match(r"^\s*//", lines[j]):
                break
            j += 1
        if j == len(lines) or not FENCE_H.match(lines[j]) or FENCE_H.match(lines[j]).group(2):
            errors.append("%s:%d: fence in a comment not closed by //   ```" % (rel, i + 1))
            i = j
            continue
        # Strip "//" and the indentation of the fence line itself.
        cut = len(m.group(1))
        body = []
        for l in lines[i + 1:j]:
            s = l.strip()[2:]
            body.append(s[cut:] if s[:cut].strip() == "" else s.lstrip())
        if is_cpp:
            out.append(Example(rel, i + 2, tags, body))
        i = j + 1
    return out


def collect(src):
    files = ["README.md", "CONTRIBUTING.md"] + sorted(
        os.path.relpath(p, src) for p in glob.glob(os.path.join(src, "docs", "*.md")))
    headers = sorted(os.path.relpath(p, src)
                     for p in glob.glob(os.path.join(src, "include", "diststrat", "*.h")))
    errors, examples = [], []
    for rel in files + headers:
        path = os.path.join(src, rel)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        scan = scan_header if rel.endswith(".h") else scan_markdown
        examples += scan(rel, text, errors)
    for e in examples:
        bad = [t for t in e.tags if t.split("=", 1)[0] not in KNOWN_TAGS
               or (t.startswith("fragment=") and not t[len("fragment="):])
               or (t.startswith("args") and not t.startswith("args="))]
        if bad:
            errors.append("%s: unknown tag(s) %s (known: %s)" % (e.where, " ".join(bad),
                                                                 ", ".join(sorted(KNOWN_TAGS))))
        has_main = any(re.search(r"\bint\s+main\s*\(", l) for l in e.code)
        if not e.fragment and not has_main:
            errors.append("%s: a whole example defines main(); mark a part of a program "
                          "```cpp fragment[=PRELUDE]" % e.where)
        if e.fragment and has_main:
            errors.append("%s: a fragment defines main(): drop the fragment tag" % e.where)
        if e.fragment and not os.path.exists(os.path.join(PRELUDES, e.prelude + ".h")):
            errors.append("%s: no prelude tests/doc_examples/preludes/%s.h" % (e.where, e.prelude))
    return examples, errors


def read_prelude(name):
    """-> (includes, scope lines, params, body lines, first line numbers).

    `// @extends: BASE` puts the prelude BASE's includes, scope and body
    before this one's (a prelude that adds to another, not a copy of it)."""
    path = os.path.join(PRELUDES, name + ".h")
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    includes, scope, body, params = [], [], [], ""
    part = scope
    body_line = 1
    for n, l in enumerate(lines, 1):
        if l.startswith("#include"):
            includes.append(l)
            l = ""
        m = re.match(r"^// @params:\s*(.*)$", l)
        if m:
            params = m.group(1)
            continue
        m = re.match(r"^// @extends:\s*(\S+)$", l)
        if m:
            b_inc, b_scope, b_params, b_body, b_body_line, b_path = read_prelude(m.group(1))
            includes += b_inc
            # #line keeps a compiler's message on the file and line it names.
            scope += ['#line 1 "%s"' % b_path] + b_scope + ['#line %d "%s"' % (n + 1, path)]
            body += ['#line %d "%s"' % (b_body_line, b_path)] + b_body
            params = params or b_params
            continue
        if l.strip() == "// @body":
            part = body
            body_line = n + 1
            if body:  # a base's body came first: this file's resumes here
                body.append('#line %d "%s"' % (body_line, path))
            continue
        part.append(l)
    return includes, scope, params, body, body_line, path


def is_runnable(e, params):
    return not (e.has("norun") or e.has("gpu") or params)


def generate(examples, kind_torch, out_path):
    """One translation unit for the examples given; returns the names of those it can run."""
    includes = ["#include <diststrat/diststrat.h>"]
    if kind_torch:
        includes.append("#include <diststrat/torch.h>")
    parts, runnable = [], []
    for n, e in enumerate(examples):
        ns = "%s_%d" % ("doc_torch_example" if kind_torch else "doc_example", n)
        code = []
        for l in e.code:
            if l.lstrip().startswith("#include"):
                includes.append(l.strip())
                code.append("")
            else:
                code.append(re.sub(r"\bint\s+main\s*\(", "int doc_main(", l))
        if not e.fragment:
            # Only the global main() returns 0 when it flows off its end: say it
            # before main's closing brace (the last line that is just "}").
            close = max(i for i, l in enumerate(code) if l.rstrip() == "}")
            code[close] = "return 0; }"
        src = ['// %s' % e.where, "namespace %s {" % ns]
        params = ""
        if e.fragment:
            inc, scope, params, body, body_line, ppath = read_prelude(e.prelude)
            includes += inc
            src += ['#line 1 "%s"' % ppath] + scope
            src.append("int doc_main(%s) {" % params)
            src += ['#line %d "%s"' % (body_line, ppath)] + body
            src.append("{")
            src += ['#line %d "%s"' % (e.line, e.path)] + code
            src.append("}")
            src.append("return 0;")
            src.append("}")
        else:
            src += ['#line %d "%s"' % (e.line, e.path)] + code
        src.append("}  // namespace %s" % ns)
        parts.append("\n".join(src))
        if is_runnable(e, params):
            runnable.append((ns, e))
    seen, hoisted = set(), []
    for inc in includes:
        if inc not in seen:
            seen.add(inc)
            hoisted.append(inc)
    driver = [
        "#include <cstdio>", "#include <cstring>",
        "namespace {",
        "[[maybe_unused]] int doc_call(int (*f)(), int, char**) { return f(); }",
        "[[maybe_unused]] int doc_call(int (*f)(int, char**), int argc, char** argv) {",
        "  return f(argc, argv);",
        "}",
        "}  // namespace",
        "int main(int argc, char** argv) {",
        "  if (argc < 2) { std::fprintf(stderr, \"usage: %s EXAMPLE\\n\", argv[0]); return 2; }",
        "  const char* doc_name = argv[1];",
        "  argv[1] = argv[0];  // the example sees its own argv: [program, args...]",
    ]
    for ns, e in runnable:
        driver.append('  if (std::strcmp(doc_name, "%s") == 0) return doc_call(%s::doc_main, argc - 1, argv + 1);'
                      % (ns, ns))
    driver += ["  std::fprintf(stderr, \"no example %s\\n\", doc_name);", "  return 2;", "}"]
    with open(out_path, "w", encoding="utf-8") as f:
        f.write("// Generated by tests/doc_examples/doc_examples.py: do not edit.\n")
        f.write("\n".join(hoisted) + "\n\n")
        f.write("\n\n".join(parts) + "\n\n")
        f.write("\n".join(driver) + "\n")
    return runnable


def run_cmd(cmd, cwd=None, env=None, timeout=None):
    """-> (exit status or None on timeout, output, seconds). On timeout the
    whole process group goes (mpirun's ranks too), not only the command."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        rc = None
    return rc, out.decode(errors="replace"), time.monotonic() - t0


def main_check(args):
    examples, errors = collect(args.source)
    for e in errors:
        print("error: " + e)
    print("%d examples (%d fragments) in %d files; %d error(s)" % (
        len(examples), sum(e.fragment for e in examples),
        len({e.path for e in examples}), len(errors)))
    return 1 if errors else 0


def main_run(args):
    t_start = time.monotonic()
    examples, errors = collect(args.source)
    if errors:
        for e in errors:
            print("error: " + e)
        return 1
    if args.only:  # while working on some: `--only 'torch'` builds and runs those alone
        examples = [e for e in examples if re.search(args.only, e.where)]
    work = os.path.abspath(args.work)
    shutil.rmtree(work, ignore_errors=True)
    gen = os.path.join(work, "src")
    os.makedirs(gen)
    skipped = []
    plain = [e for e in examples if not e.has("torch")]
    torch = [e for e in examples if e.has("torch")]
    if not args.torch:
        skipped += [(e, "needs LibTorch (this package was built without diststrat::torch)")
                    for e in torch]
        torch = []
    runnable = generate(plain, False, os.path.join(gen, "doc_examples.cc"))  # possibly empty
    runnable_torch = generate(torch, True, os.path.join(gen, "doc_examples_torch.cc")) if torch else []
    shutil.copy(os.path.join(HERE, "project", "CMakeLists.txt"), gen)
    build = os.path.join(work, "build")
    args.prefix = os.path.abspath(args.prefix)
    cfg = [args.cmake, "-S", gen, "-B", build, "-DCMAKE_PREFIX_PATH=" + args.prefix,
           "-DDOC_EXAMPLES_TORCH=" + ("ON" if torch else "OFF")]
    rc, out, dt = run_cmd(cfg, timeout=300)
    if rc != 0:
        print(out)
        print("FAILED: configure against the installed package (%.1f s)" % dt)
        return 1
    print("configured against %s (%.1f s)" % (args.prefix, dt))
    rc, out, dt = run_cmd([args.cmake, "--build", build, "-j2"], timeout=600)
    if rc != 0:
        print(out[:30000])
        print("FAILED: an example does not compile (the errors above name the file and line) "
              "(%.1f s)" % dt)
        return 1
    print("built %d examples in %d units (%.1f s)" % (len(plain) + len(torch),
                                                      1 + bool(torch), dt))
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.join(args.prefix, "lib") + ":" + env.get("LD_LIBRARY_PATH", "")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    failed = 0
    for exe, items in (("doc_examples", runnable), ("doc_examples_torch", runnable_torch)):
        for ns, e in items:
            if e.has("mpi") and not args.mpiexec:
                skipped.append((e, "compiled; not run: needs mpirun (this build found none)"))
                continue
            cwd = os.path.join(work, "run", ns)
            os.makedirs(cwd)
            runs = [t[len("args="):].split(",") if t != "args=" else []
                    for t in e.tags if t.startswith("args=")] or [[]]
            dt = 0.0
            for argv in runs:
                cmd = [os.path.join(build, exe), ns] + argv
                if e.has("mpi"):
                    cmd = [args.mpiexec, "-np", "2", "--oversubscribe", "--bind-to", "none"] + cmd
                rc, out, t = run_cmd(cmd, cwd=cwd, env=env, timeout=RUN_TIMEOUT_S)
                dt += t
                with open(os.path.join(cwd, "output.txt"), "a", encoding="utf-8") as f:
                    f.write("$ %s\n%s" % (" ".join(cmd), out))
                if rc != 0:
                    break
            if rc == 0:
                print("ok      %-40s %5.1f s  %s" % (e.where, dt, " ".join(e.tags)))
            else:
                failed += 1
                why = "timed out after %d s" % RUN_TIMEOUT_S if rc is None else "exit status %d" % rc
                # What a reader needs is near the start (the exception's what())
                # and at the end; the whole output is in the example's directory.
                lines = out.rstrip().split("\n")
                if len(lines) > 40:
                    lines = lines[:20] + ["[... %d lines: %s ...]" % (
                        len(lines) - 40, os.path.join(cwd, "output.txt"))] + lines[-20:]
                print("\n".join(l[:300] for l in lines))
                print("FAILED  %-40s %5.1f s  %s: %s" % (e.where, dt, " ".join(e.tags), why))
    ran = {id(e) for _, e in runnable + runnable_torch}
    for e in examples:
        if id(e) in ran or any(e is s for s, _ in skipped):
            continue
        if e.has("gpu"):
            skipped.append((e, "compiled; not run: needs a GPU (gpu)"))
        else:
            skipped.append((e, "compiled; not run (%s)" % (
                "norun" if e.has("norun") else "its prelude takes parameters")))
    for e, why in skipped:
        print("skip    %-40s %s" % (e.where, why))
    print("%d examples: %d ran, %d failed, %d compiled only or skipped (%.1f s)" % (
        len(examples), len(runnable) + len(runnable_torch) - sum(
            1 for e, _ in skipped if id(e) in ran), failed, len(skipped),
        time.monotonic() - t_start))
    return 1 if failed else 0


def main():
    sys.stdout.reconfigure(line_buffering=True)  # progress lines as they come, under ctest -V
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("source")
    r = sub.add_parser("run")
    r.add_argument("source")
    r.add_argument("prefix")
    r.add_argument("work")
    r.add_argument("--torch", action="store_true")
    r.add_argument("--mpiexec", default="", help="run the mpi examples with it (none: skip them)")
    r.add_argument("--cmake", default="cmake")
    r.add_argument("--only", default="", help="a regex: only the examples whose file:line match")
    args = p.parse_args()
    return main_check(args) if args.cmd == "check" else main_run(args)


if __name__ == "__main__":
    sys.exit(main())
