#!/usr/bin/env python3
"""A CycloneDX 1.5 bill of materials for an image of hack/image.sh, made offline.

What it lists: every crate the binary links (`cargo tree -e normal,no-proc-macro` for the
package that builds it: build scripts and proc-macros run at build time and are not linked),
with its version, its license as the crate states it, its source (crates.io, or this
workspace) and, for a crate from crates.io, the SHA-256 Cargo.lock pins; and every Debian
package the image's files came from (hack/image.sh's `stage` says which), with its version.
Reproducible: no time but the one given, no path of this machine, everything sorted, and the
serial number derived from the content.

It must not build anything nor read the network (`cargo tree --offline --locked`).

    hack/sbom.py --package settle-operator --image ghcr.io/settle-dev/settle --version 0.1.0 \
        --epoch 1700000000 --arch amd64 --debian debian-12 --packages FILE > sbom.cdx.json

FILE holds one "package version" a line (`-` for standard input, an empty file for none).
"""

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tomllib
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def linked_crates(package):
    """(name, version, license, local) of every crate `package`'s binaries link."""
    out = subprocess.run(
        ["cargo", "tree", "--locked", "--offline", "-p", package, "-e", "normal,no-proc-macro",
         "--prefix", "none", "-f", "{p}|{l}"],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout
    crates = set()
    for line in out.splitlines():
        line = line.removesuffix(" (*)").strip()
        if not line:
            continue
        spec, _, license_ = line.partition("|")
        words = spec.split(" ", 2)
        name, version = words[0], words[1].removeprefix("v")
        local = len(words) > 2 and words[2].startswith("(/")
        crates.add((name, version, license_.strip(), local))
    return sorted(crates)


def lock_checksums():
    with open(os.path.join(ROOT, "Cargo.lock"), "rb") as f:
        lock = tomllib.load(f)
    return {(p["name"], p["version"]): p["checksum"]
            for p in lock.get("package", []) if "checksum" in p}


def crate_component(name, version, license_, local, checksums):
    purl = f"pkg:cargo/{name}@{version}"
    c = {"type": "library", "bom-ref": purl, "name": name, "version": version, "purl": purl}
    if license_:
        c["licenses"] = [{"expression": license_}]
    if local:
        c["properties"] = [{"name": "dev.settle.source", "value": "workspace"}]
    else:
        c["properties"] = [{"name": "dev.settle.source", "value": "crates.io"}]
        if (name, version) in checksums:
            c["hashes"] = [{"alg": "SHA-256", "content": checksums[(name, version)]}]
    return c


def deb_component(name, version, arch, distro):
    purl = f"pkg:deb/debian/{name}@{version}?arch={arch}&distro={distro}"
    return {"type": "library", "bom-ref": purl, "name": name, "version": version, "purl": purl,
            "properties": [{"name": "dev.settle.source", "value": "debian"}]}


def main():
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--package", required=True, help="the Cargo package that builds the binary")
    a.add_argument("--image", required=True, help="the image's repository")
    a.add_argument("--version", required=True, help="the image's tag")
    a.add_argument("--epoch", type=int, required=True, help="the time it says (Unix seconds)")
    a.add_argument("--arch", required=True)
    a.add_argument("--debian", required=True, help="the distro qualifier of Debian purls")
    a.add_argument("--packages", required=True, help="'package version' lines, or -")
    args = a.parse_args()

    text = sys.stdin.read() if args.packages == "-" else open(args.packages).read()
    debs = sorted({tuple(l.split(None, 1)) for l in text.splitlines() if l.strip()})
    checksums = lock_checksums()
    components = [crate_component(*c, checksums) for c in linked_crates(args.package)]
    components += [deb_component(n, v.strip(), args.arch, args.debian) for n, v in debs]
    content = json.dumps(components, sort_keys=True).encode()
    when = datetime.datetime.fromtimestamp(args.epoch, datetime.UTC)
    bom = {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, hashlib.sha256(content).hexdigest())}",
        "version": 1,
        "metadata": {
            "timestamp": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "tools": {"components": [{"type": "application", "name": "hack/sbom.py"}]},
            "component": {"type": "container", "bom-ref": f"{args.image}:{args.version}",
                          "name": args.image, "version": args.version},
        },
        "components": components,
    }
    json.dump(bom, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
