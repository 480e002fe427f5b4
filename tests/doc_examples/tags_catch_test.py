#!/usr/bin/env python3
"""doc_examples.py check fails, naming each, on a tree with planted mistakes:
an unknown tag, a whole example without main(), C++ in an untagged fence, a
header example outside a fence, a missing prelude, an unclosed fence."""
import os
import subprocess
import sys
import tempfile

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "doc_examples.py")

README = """# x
```cpp fragment fast
int a = 1;
```
```cpp
ds::MirroredStrategy strategy;
```
```
ds::SGD opt(strategy, {0.1f});
```
```cpp fragment=no_such_prelude
int b = 2;
```
"""
HEADER = """// An example outside a fence:
//
//   ds::MirroredStrategy strategy;
//   strategy.run(step_fn);
//
//   ```cpp fragment
//   int c = 3;
"""
EXPECTED = [
    "README.md:3: unknown tag(s) fast",
    "README.md:6: a whole example defines main()",
    "README.md:8: C++ in a fence without a language",
    "README.md:12: no prelude tests/doc_examples/preludes/no_such_prelude.h",
    "include/diststrat/x.h:3: code in a comment outside a fence",
    "include/diststrat/x.h:4: code in a comment outside a fence",
    "include/diststrat/x.h:6: fence in a comment not closed",
]

with tempfile.TemporaryDirectory() as d:
    os.makedirs(os.path.join(d, "include", "diststrat"))
    with open(os.path.join(d, "README.md"), "w") as f:
        f.write(README)
    with open(os.path.join(d, "include", "diststrat", "x.h"), "w") as f:
        f.write(HEADER)
    p = subprocess.run([sys.executable, CHECK, "check", d], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, universal_newlines=True)
    missing = [e for e in EXPECTED if e not in p.stdout]
    if p.returncode != 1 or missing:
        print(p.stdout)
        print("FAILED: exit status %d (want 1); not reported: %s" % (p.returncode, missing))
        sys.exit(1)
    print("the check caught all %d planted mistakes" % len(EXPECTED))
