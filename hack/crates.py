#!/usr/bin/env python3
"""Checks every crate Cargo.lock resolves for this machine's platform (the one its images are
built for): its license is one hack/licenses.txt accepts, and it comes from crates.io or this
workspace. Part of `make lint`, after clippy has fetched the crates; offline (`cargo metadata
--offline --locked`), with no advisory database (it cannot be fetched here).

A license is the crate's SPDX expression (`MIT OR Apache-2.0`; the old `MIT/Apache-2.0` read as
OR): OR needs one accepted side, AND both, `X WITH E` needs the line `X WITH E` itself. A crate
with no license expression (a license file only) is refused: say its license in
hack/licenses.txt's exceptions, by name and version, after reading the file.

    hack/crates.py                    check this workspace
    hack/crates.py --metadata FILE    check what FILE (cargo metadata's JSON) resolves
"""

import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES_IO = "registry+https://github.com/rust-lang/crates.io-index"


def accepted():
    """The accepted licenses, and the crates (`name version`) accepted by name."""
    licenses, crates = set(), set()
    with open(os.path.join(ROOT, "hack", "licenses.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line.startswith("crate "):
                crates.add(line.removeprefix("crate ").strip())
            elif line:
                licenses.add(line)
    return licenses, crates


def allowed(expression, licenses):
    """Whether an SPDX expression is satisfied by `licenses`; raises ValueError when unreadable."""
    tokens = re.findall(r"\(|\)|[^\s()]+", expression.replace("/", " OR "))
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError(f"unreadable license expression {expression!r}")
        pos += 1
        return tokens[pos - 1]

    def term():
        if peek() == "(":
            take()
            v = disjunction()
            if peek() != ")":
                raise ValueError(f"unbalanced parentheses in {expression!r}")
            take()
            return v
        word = take() if peek() not in (None, ")", "AND", "OR", "WITH") else None
        if word is None:
            raise ValueError(f"a license expected in {expression!r}")
        if peek() == "WITH":
            take()
            return f"{word} WITH {take()}" in licenses
        return word in licenses

    def conjunction():
        v = term()
        while peek() == "AND":
            take()
            v = term() and v
        return v

    def disjunction():
        v = conjunction()
        while peek() == "OR":
            take()
            v = conjunction() or v
        return v

    v = disjunction()
    if pos != len(tokens):
        raise ValueError(f"unreadable license expression {expression!r}")
    return v


def metadata():
    host = next(l.split(": ", 1)[1] for l in subprocess.run(
        ["rustc", "-vV"], check=True, capture_output=True, text=True).stdout.splitlines()
        if l.startswith("host: "))
    out = subprocess.run(
        ["cargo", "metadata", "--locked", "--offline", "--format-version", "1",
         "--filter-platform", host],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout
    m = json.loads(out)
    resolved = {n["id"] for n in m["resolve"]["nodes"]}
    return [p for p in m["packages"] if p["id"] in resolved]


def problems(packages, licenses, crates):
    out = []
    for p in sorted(packages, key=lambda p: (p["name"], p["version"])):
        who = f"{p['name']} {p['version']}"
        source = p.get("source")
        if source is not None and source != CRATES_IO:
            out.append(f"{who}: from {source}, not crates.io or this workspace (publish it, or "
                       "depend on a crates.io release)")
        if who in crates:
            continue
        license_ = p.get("license")
        if not license_:
            out.append(f"{who}: no license expression (only {p.get('license_file') or 'nothing'}): "
                       f"read it, then add `crate {who}` to hack/licenses.txt")
            continue
        try:
            ok = allowed(license_, licenses)
        except ValueError as e:
            out.append(f"{who}: {e}")
            continue
        if not ok:
            out.append(f"{who}: license {license_!r} is not accepted (hack/licenses.txt); "
                       "choose another crate, or accept the license there after review")
    return out


def main():
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--metadata", help="cargo metadata's JSON to check instead of this workspace's")
    args = a.parse_args()
    if args.metadata:
        with open(args.metadata) as f:
            packages = json.load(f)["packages"]
    else:
        packages = metadata()
    licenses, crates = accepted()
    found = problems(packages, licenses, crates)
    for line in found:
        print(f"crates: {line}", file=sys.stderr)
    if found:
        sys.exit(1)
    print(f"crates: {len(packages)} crates, each from crates.io or this workspace, "
          "each under an accepted license")


if __name__ == "__main__":
    main()
