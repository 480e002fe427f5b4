#!/usr/bin/env python3
"""Checks the per-instruction-set kernel objects (cmake/DiststratIsa.cmake).

Usage: check_isa_objects.py OBJDUMP baseline OBJ... avx2 OBJ... avx512 OBJ...

1. The baseline objects hold no VEX/EVEX-encoded instruction: no ymm/zmm or
   mask register, no 'v'-prefixed (AVX) mnemonic. They are what a pre-AVX
   x86-64 CPU runs.
2. In the AVX objects, every function that holds such an instruction is in its
   variant's namespace (isa_avx2 / isa_avx512, Eigen's renamed one included):
   a function outside it (an inline template of Eigen's or the standard
   library's) could be the copy the linker keeps for the baseline's calls too.
3. The AVX objects do hold AVX instructions (the variant flags reached the
   compiler, and the scan sees them).
Prints each finding as "object: function: instruction" and exits 1.
"""
import re
import subprocess
import sys

# Mnemonics that start with 'v' without being AVX (virtualization, segment checks).
NOT_AVX = {"verr", "verw", "vmcall", "vmlaunch", "vmresume", "vmxoff", "vmxon", "vmread",
           "vmwrite", "vmptrld", "vmptrst", "vmclear", "vmfunc"}
AVX_REGISTER = re.compile(r"%(ymm|zmm)\d+|%k[0-7]\b")
FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")
INSTRUCTION = re.compile(r"^\s+[0-9a-f]+:\s+(\S+)\s*(.*)$")


def avx_functions(objdump, obj):
    """{function: first AVX instruction} of one object."""
    out = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", obj], check=True,
                         capture_output=True, text=True).stdout
    found, function = {}, "?"
    for line in out.splitlines():
        m = FUNCTION.match(line)
        if m:
            function = m.group(1)
            continue
        m = INSTRUCTION.match(line)
        if not m:
            continue
        mnemonic, operands = m.group(1), m.group(2)
        if (mnemonic.startswith("v") and mnemonic not in NOT_AVX) or AVX_REGISTER.search(operands):
            found.setdefault(function, f"{mnemonic} {operands}".strip())
    return found


def main(argv):
    objdump, groups, current = argv[1], {}, None
    for a in argv[2:]:
        if a in ("baseline", "avx2", "avx512"):
            current = groups.setdefault(a, [])
        else:
            current.append(a)
    findings, checked = [], 0
    for isa, objs in groups.items():
        for obj in objs:
            checked += 1
            functions = avx_functions(objdump, obj)
            if isa == "baseline":
                findings += [f"{obj}: {f}: {i} (baseline object)" for f, i in functions.items()]
                continue
            findings += [f"{obj}: {f}: {i} (outside namespace isa_{isa})"
                         for f, i in functions.items() if f"isa_{isa}" not in f]
            if not functions:
                findings.append(f"{obj}: no AVX instruction at all in an {isa} object")
    for f in findings:
        print(f)
    if not checked:
        print("no objects given")
        return 1
    print(f"check_isa_objects: {checked} objects, {len(findings)} findings")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
