#!/usr/bin/env python3
"""Packs a root filesystem directory into an OCI image archive, without a container engine.

hack/image.sh stages the directory and calls this; it is not meant to be run by hand. The
archive is an OCI image layout (oci-layout, index.json, blobs/sha256/...), which
`ctr images import` and `skopeo copy oci-archive:` read, with a Docker `manifest.json` beside it
so that `docker load` takes the same file. One gzip layer, one config, one manifest.

Reproducible: the same directory and arguments give the same bytes. Every entry is sorted, has
the mtime --epoch, owner 0:0 (or what --owner says) and no user or group names; file modes are
0755 or 0644 by the executable bit (or what --mode says); gzip carries no name and mtime 0;
every JSON document has sorted keys and no spaces. Nothing is read from the host but the
directory: the caller says what goes in.

It must not decide what the image holds (hack/image.sh does) nor talk to a registry.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import stat
import sys
import tarfile
import time

LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG = "application/vnd.oci.image.config.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def blob(data):
    return "blobs/sha256/" + hashlib.sha256(data).hexdigest()


def key_value(text, what):
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"oci-image: {what} must be KEY=VALUE, got {text!r}")
    return key, value


def walk(rootfs):
    """Every path under rootfs (relative, '/'-separated), parents before children, sorted by
    path components so the order never depends on the filesystem."""
    found = []
    for here, dirs, files in os.walk(rootfs):
        rel = os.path.relpath(here, rootfs)
        for name in dirs + files:
            found.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return sorted(found, key=lambda p: p.split("/"))


def layer_tar(rootfs, epoch, modes, owners):
    """The layer, uncompressed: a PAX tar of rootfs with normalized metadata."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in walk(rootfs):
            full = os.path.join(rootfs, rel)
            st = os.lstat(full)
            info = tarfile.TarInfo(rel)
            info.mtime = epoch
            info.uid, info.gid = owners.get("/" + rel, (0, 0))
            info.uname = info.gname = ""
            data = None
            if stat.S_ISDIR(st.st_mode):
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            elif stat.S_ISLNK(st.st_mode):
                info.type, info.mode = tarfile.SYMTYPE, 0o777
                info.linkname = os.readlink(full)
            elif stat.S_ISREG(st.st_mode):
                info.type = tarfile.REGTYPE
                info.mode = 0o755 if st.st_mode & 0o111 else 0o644
                with open(full, "rb") as f:
                    data = f.read()
                info.size = len(data)
            else:
                raise SystemExit(f"oci-image: {full}: only files, directories and symlinks go in an image")
            info.mode = modes.get("/" + rel, info.mode)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def outer_tar(path, members):
    """The archive: members (name, bytes) in the order given, directories implied by
    blobs/sha256/ written once before the blobs."""
    tmp = path + ".part"
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.mode, info.size = 0o644, len(data)
                tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rootfs", required=True)
    p.add_argument("--out", required=True, help="the archive to write")
    p.add_argument("--name", required=True, help="the full reference, e.g. ghcr.io/settle-dev/settle:0.1.0")
    p.add_argument("--arch", required=True, help="OCI architecture, e.g. amd64")
    p.add_argument("--epoch", type=int, required=True, help="mtime of every entry, and the image's created time")
    p.add_argument("--entrypoint", required=True, help="JSON list")
    p.add_argument("--cmd", default="[]", help="JSON list")
    p.add_argument("--user", required=True)
    p.add_argument("--workdir", default="/")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE")
    p.add_argument("--port", action="append", default=[], help="e.g. 8443/tcp")
    p.add_argument("--label", action="append", default=[], help="KEY=VALUE")
    p.add_argument("--mode", action="append", default=[], help="/PATH=OCTAL")
    p.add_argument("--owner", action="append", default=[], help="/PATH=UID:GID")
    p.add_argument("--created-by", default="hack/image.sh")
    a = p.parse_args()

    repo, _, tag = a.name.rpartition(":")
    if not repo or "/" in tag:
        raise SystemExit(f"oci-image: --name {a.name!r} must be REPOSITORY:TAG")
    modes = {k: int(v, 8) for k, v in (key_value(m, "--mode") for m in a.mode)}
    owners = {}
    for o in a.owner:
        k, v = key_value(o, "--owner")
        uid, _, gid = v.partition(":")
        owners[k] = (int(uid), int(gid or uid))
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(a.epoch))

    layer = layer_tar(a.rootfs, a.epoch, modes, owners)
    # mtime 0 and no file name in the gzip header: the same bytes on every run with the same
    # zlib. Level 6 (gzip's default): 9 took three times as long for the same size.
    packed = gzip.compress(layer, compresslevel=6, mtime=0)
    config = canonical({
        "architecture": a.arch,
        "os": "linux",
        "created": created,
        "config": {
            "User": a.user,
            "Entrypoint": json.loads(a.entrypoint),
            "Cmd": json.loads(a.cmd),
            "Env": a.env,
            "WorkingDir": a.workdir,
            "ExposedPorts": {port: {} for port in a.port},
            "Labels": dict(key_value(label, "--label") for label in a.label),
        },
        "rootfs": {"type": "layers", "diff_ids": [sha256(layer)]},
        "history": [{"created": created, "created_by": a.created_by}],
    })
    manifest = canonical({
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {"mediaType": CONFIG, "digest": sha256(config), "size": len(config)},
        "layers": [{"mediaType": LAYER, "digest": sha256(packed), "size": len(packed)}],
    })
    # The name lives in the index only, so another tag is the same manifest digest.
    index = canonical({
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": [{
            "mediaType": MANIFEST,
            "digest": sha256(manifest),
            "size": len(manifest),
            "platform": {"architecture": a.arch, "os": "linux"},
            "annotations": {
                "io.containerd.image.name": a.name,
                "org.opencontainers.image.ref.name": tag,
            },
        }],
    })
    docker = canonical([{"Config": blob(config), "RepoTags": [a.name], "Layers": [blob(packed)]}])
    blobs = sorted({blob(d): d for d in (config, manifest, packed)}.items())
    outer_tar(a.out, [
        ("oci-layout", canonical({"imageLayoutVersion": "1.0.0"})),
        ("index.json", index),
        ("manifest.json", docker),
        ("blobs", None),
        ("blobs/sha256", None),
        *blobs,
    ])
    # What hack/image.sh prints and keeps beside the archive.
    print(json.dumps({
        "manifest": sha256(manifest),
        "config": sha256(config),
        "layer": sha256(packed),
        "diff_id": sha256(layer),
        "layer_bytes": len(layer),
        "archive_bytes": os.path.getsize(a.out),
    }, sort_keys=True))


if __name__ == "__main__":
    sys.exit(main())
