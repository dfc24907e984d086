"""Writes link/hot-functions.txt from what hack/hot-text.sh's profiling run called.

Usage: layout.py BINARY SAMPLED CALLS... > link/hot-functions.txt

BINARY is the coverage build; each CALLS file holds the address of its
__sanitizer_cov_trace_pc_guard_init, then one address inside each function called, in the order
of the first calls (hack/hot-text/coverage.c). SAMPLED names, one per line, the functions a
profiler saw running in the same run: those the coverage build could not count (the standard
library's, shipped compiled; ring's C and assembly; the compiler's builtins).

The list is every function called, first call first, then those only sampled, by their
symbol names; build.rs makes the linker script from it (which names it takes as they are, and
which with the parts that differ between builds left open).
"""
import bisect
import struct
import subprocess
import sys


def functions(binary):
    out = subprocess.run(["nm", "--defined-only", "-S", binary],
                         capture_output=True, text=True, check=True).stdout
    syms, init = [], None
    for line in out.splitlines():
        p = line.split()
        if len(p) == 4 and p[2] in "tTwW":
            syms.append((int(p[0], 16), int(p[1], 16), p[3]))
            if p[3] == "__sanitizer_cov_trace_pc_guard_init":
                init = int(p[0], 16)
    if init is None:
        sys.exit(f"{binary}: not a coverage build (no __sanitizer_cov_trace_pc_guard_init)")
    syms.sort()
    return syms, init


def called(binary, files):
    syms, init = functions(binary)
    starts = [a for a, _, _ in syms]
    names, seen, missed = [], set(), 0
    for f in files:
        data = open(f, "rb").read()
        words = struct.unpack(f"{len(data) // 8}Q", data[: len(data) // 8 * 8])
        if not words:
            continue
        shift = words[0] - init
        for pc in words[1:]:
            at = pc - shift
            i = bisect.bisect_right(starts, at) - 1
            if i < 0 or at >= syms[i][0] + syms[i][1]:
                missed += 1
                continue
            name = syms[i][2]
            if name not in seen:
                seen.add(name)
                names.append(name)
    size = sum(s for _, s, n in syms if n in seen)
    total = sum(s for _, s, _ in syms)
    print(f"{len(names)} of {len(syms)} functions called ({size / 1e6:.1f} of {total / 1e6:.1f} MB);"
          f" {missed} addresses outside any function", file=sys.stderr)
    return names


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    names = called(sys.argv[1], sys.argv[3:])
    known = set(names)
    sampled = 0
    for line in open(sys.argv[2]):
        name = line.strip()
        if name and name not in known and not name.startswith("__sanitizer_cov"):
            known.add(name)
            names.append(name)
            sampled += 1
    print(f"{sampled} more functions sampled", file=sys.stderr)
    print("# The functions `settle operator` ran in hack/hot-text.sh's profiling run, first call")
    print("# first, then those only sampled: build.rs places them first in a release build of")
    print("# `settle`. Generated; write it again with hack/hot-text.sh.")
    for name in names:
        print(name)


if __name__ == "__main__":
    main()
