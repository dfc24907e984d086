#!/usr/bin/env bash
# Builds Settle's images as OCI image archives, without a container engine: the operator image
# the Helm chart runs (ghcr.io/settle-dev/settle:<chart appVersion>) and the example application
# image (ghcr.io/settle-dev/settle-example:<version>, examples/account_app.rs), and the Go
# runtime's example application (ghcr.io/settle-dev/settle-example-go:<version>,
# clients/go/cmd/account-app, built static). Each is one layer holding what
# gcr.io/distroless/cc-debian12:nonroot holds for a Rust binary: the binary, the glibc runtime
# libraries `ldd` says it links and the loader (none for the static Go binary), Debian's CA
# bundle, /etc/passwd and /etc/group with root and nonroot (65532), /tmp and /home/nonroot. The Dockerfile describes the
# same operator image for those who build with Docker (crates/settle-e2e/tests/image.rs compares them).
#
# The operator image carries a CycloneDX bill of materials at /usr/share/doc/settle/sbom.cdx.json
# (hack/sbom.py: every crate the binary links, every Debian package its files came from), also
# written beside the archive as <archive>.cdx.json.
#
# Pinned inputs: the files come from this machine's Debian packages, and the image says which:
# a label per package with its version (dev.settle.image.debian.<package>), the rustc version
# (the Go version for the Go application),
# and the commit (org.opencontainers.image.revision). Reproducible: the same commit, built in
# the same place with the same toolchain and packages, gives the same digest (every mtime is
# SOURCE_DATE_EPOCH, default the commit's time; see hack/oci-image.py for the rest).
#
#   hack/image.sh build [settle|example|example-go|all] [--tag T] [--label K=V]... [--out DIR]
#                          cargo build (--release for the operator), then write the archive(s);
#                          prints size and digest
#   hack/image.sh path settle|example [--tag T] [--out DIR]    the archive's path
#   hack/image.sh digest settle|example [--tag T] [--out DIR]  its manifest digest (once built)
#   hack/image.sh ref settle|example [--tag T]                 the image reference it carries
#
# --tag T (or SETTLE_IMAGE_TAG) writes the image under another tag: the same manifest digest,
# another name in the archive's index. --label K=V adds a label, and so makes an image that
# differs in digest (an upgrade test's "new image"). --out DIR (or SETTLE_IMAGE_DIR; default
# ${CARGO_TARGET_DIR:-target}/image) is where the archives go: settle-<tag>.oci.tar, with the
# manifest digest in settle-<tag>.oci.tar.digest. An archive whose inputs did not change is
# not written again.
set -euo pipefail
shopt -s inherit_errexit   # a failing step inside $(...) stops the build too
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# Cargo picks the package by the working directory: build from the workspace root, wherever
# this runs from (`cargo test -p settle-e2e` runs tests in crates/settle-e2e).
cd "$ROOT"
# shellcheck source=hack/lib.sh
. "$ROOT/hack/lib.sh"

REGISTRY="ghcr.io/settle-dev"
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/Cargo.toml" | head -n1)"
APP_VERSION="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$ROOT/charts/settle/Chart.yaml")"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
# What the chart's Deployment listens on (charts/settle/values.yaml: webhook.port, metrics.port,
# probe.port); the Dockerfile's EXPOSE says the same.
PORTS="8443/tcp 8080/tcp 8081/tcp"
NONROOT="65532"

usage() {
  echo "usage: hack/image.sh build [settle|example|example-go|all] [--tag T] [--label K=V]... [--out DIR]" >&2
  echo "       hack/image.sh path|digest|ref settle|example|example-go [--tag T] [--out DIR]" >&2
  exit 2
}

# --- the arguments ------------------------------------------------------------------------------
cmd="${1:-}"; [ -n "$cmd" ] || usage; shift
which="all"
case "${1:-}" in settle|example|example-go|all) which="$1"; shift ;; esac
TAG="${SETTLE_IMAGE_TAG:-}"
OUT="${SETTLE_IMAGE_DIR:-$TARGET/image}"
LABELS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) [ $# -ge 2 ] || usage; TAG="$2"; shift 2 ;;
    --label) [ $# -ge 2 ] || usage; LABELS+=("$2"); shift 2 ;;
    --out) [ $# -ge 2 ] || usage; OUT="$2"; shift 2 ;;
    *) echo "error: unknown argument '$1'" >&2; usage ;;
  esac
done
if [ -n "$TAG" ] && ! [[ "$TAG" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]]; then
  echo "error: --tag '$TAG' is not an image tag (letters, digits, _ . -, at most 128, not starting with . or -)" >&2
  exit 2
fi
for l in ${LABELS[@]+"${LABELS[@]}"}; do
  case "$l" in ?*=*) ;; *) echo "error: --label '$l' must be KEY=VALUE" >&2; exit 2 ;; esac
done

# repo_of NAME, tag_of NAME: the image reference of settle (the chart's appVersion: what
# `helm install` with default values runs) or example (the crate's version).
repo_of() {
  case "$1" in
    settle) echo "$REGISTRY/settle" ;; example) echo "$REGISTRY/settle-example" ;;
    example-go) echo "$REGISTRY/settle-example-go" ;; *) usage ;;
  esac
}
tag_of() {
  if [ -n "$TAG" ]; then echo "$TAG"; elif [ "$1" = settle ]; then echo "$APP_VERSION"; else echo "$VERSION"; fi
}
archive_of() { echo "$OUT/$(basename "$(repo_of "$1")")-$(tag_of "$1").oci.tar"; }

# --- the root filesystem ------------------------------------------------------------------------
# The libraries the dynamic loader maps for BIN, loader included, as absolute paths.
linked_libraries() {
  local out
  # A static binary (the Go application's) maps nothing.
  if file_is_static "$1"; then return 0; fi
  out="$(ldd "$1")" || { echo "error: ldd $1 failed: is it a dynamically linked binary?" >&2; return 1; }
  if grep -q "not found" <<<"$out"; then
    echo "error: $1 links libraries this machine does not have:" >&2
    grep "not found" <<<"$out" >&2
    return 1
  fi
  awk '$2 == "=>" && $3 ~ /^\// {print $3; next} $1 ~ /^\// {print $1}' <<<"$out"
}

# Whether BIN is statically linked (no program interpreter).
file_is_static() { ! readelf -l "$1" 2>/dev/null | grep -q 'Requesting program interpreter'; }

# The Debian package that installed PATH ("libc6:amd64"), its name without the architecture.
package_of() {
  local path="$1" owner
  owner="$(dpkg-query -S "$path" 2>/dev/null || dpkg-query -S "$(readlink -f "$path")" 2>/dev/null)" || {
    echo "error: no Debian package owns $path; the image records the package of every file it copies" >&2
    return 1
  }
  owner="${owner%%: *}"; echo "${owner%%,*}"
}

# Debian's CA bundle as its package ships it: every certificate of ca-certificates, in the
# order update-ca-certificates concatenates them. Not /etc/ssl/certs/ca-certificates.crt: that
# file also holds whatever this machine added under /usr/local/share/ca-certificates.
ca_bundle() {
  local crt
  dpkg-query -L ca-certificates | grep '^/usr/share/ca-certificates/.*\.crt$' | LC_ALL=C sort \
    | while read -r crt; do awk 1 "$crt"; done   # awk 1: a missing last newline added
}

# stage ROOTFS BIN NAME: ROOTFS holds BIN as /usr/local/bin/NAME and the base files; prints the
# Debian packages the files came from, one "package version" a line.
stage() {
  local rootfs="$1" bin="$2" name="$3" libs lib pkg pkgs=()
  libs="$(linked_libraries "$bin")"
  rm -rf "$rootfs"
  mkdir -p "$rootfs"/{usr/local/bin,etc/ssl/certs,tmp,home/nonroot}
  cp -L "$bin" "$rootfs/usr/local/bin/$name"
  chmod 0755 "$rootfs/usr/local/bin/$name"
  for lib in $libs; do
    mkdir -p "$rootfs$(dirname "$lib")"
    cp -L "$lib" "$rootfs$lib"
    pkg="$(package_of "$lib")"; pkgs+=("$pkg")
  done
  ca_bundle >"$rootfs/etc/ssl/certs/ca-certificates.crt"
  pkgs+=(ca-certificates)
  # distroless's users and groups, and its name service order.
  printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' \
    'nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin' \
    "nonroot:x:$NONROOT:$NONROOT:nonroot:/home/nonroot:/sbin/nologin" >"$rootfs/etc/passwd"
  printf '%s\n' 'root:x:0:' 'nobody:x:65534:' "nonroot:x:$NONROOT:" >"$rootfs/etc/group"
  printf '%s\n' 'passwd: files' 'group: files' 'hosts: files dns' >"$rootfs/etc/nsswitch.conf"
  printf '%s\n' "${pkgs[@]}" | LC_ALL=C sort -u | while read -r p; do
    echo "${p%%:*} $(dpkg-query -W -f='${Version}' "$p")"
  done
}

# --- one image -------------------------------------------------------------------------------------
build_image() {
  local name="$1" exe bin title description archive rootfs epoch revision tree arch packages start=$SECONDS
  case "$name" in
    settle)
      exe=settle; bin="$TARGET/release/settle"; title="settle"
      description="Settle, the Kubernetes operator for message subscriptions" ;;
    example)
      exe=account_app; bin="$TARGET/debug/examples/account_app"; title="settle-example"
      description="An application on Settle's handler runtime (examples/account_app.rs)" ;;
    example-go)
      exe=account-app; bin="$TARGET/go/account-app-static"; title="settle-example-go"
      description="An application on Settle's Go runtime (clients/go/cmd/account-app)" ;;
  esac
  archive="$(archive_of "$name")"
  rootfs="$OUT/rootfs-$title"
  epoch="${SOURCE_DATE_EPOCH:-$(git -C "$ROOT" log -1 --format=%ct 2>/dev/null || echo 0)}"
  revision="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
  tree=clean
  git -C "$ROOT" diff --quiet HEAD -- 2>/dev/null || tree=modified
  case "$(uname -m)" in
    x86_64) arch=amd64 ;; aarch64) arch=arm64 ;;
    *) echo "error: no OCI architecture known for $(uname -m)" >&2; exit 1 ;;
  esac
  packages="$(stage "$rootfs" "$bin" "$exe")"
  # The operator image carries its bill of materials (the crates the binary links, the Debian
  # packages of its files), also written beside the archive. It names the release, not the tag,
  # so another --tag keeps the digest.
  local sbom=""
  if [ "$name" = settle ]; then
    sbom="$rootfs/usr/share/doc/settle/sbom.cdx.json"
    mkdir -p "$(dirname "$sbom")"
    printf '%s\n' "$packages" | python3 "$ROOT/hack/sbom.py" --package settle-operator \
      --image "$(repo_of "$name")" --version "$VERSION" --epoch "$epoch" --arch "$arch" \
      --debian "debian-$(sed -n 's/^VERSION_ID="\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' /etc/os-release)" \
      --packages - >"$sbom"
    cp "$sbom" "$archive.cdx.json"
  fi

  local args=(
    --rootfs "$rootfs" --out "$archive.new" --name "$(repo_of "$name"):$(tag_of "$name")"
    --arch "$arch" --epoch "$epoch" --user "$NONROOT:$NONROOT" --workdir /home/nonroot
    --entrypoint "[\"/usr/local/bin/$exe\"]"
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
    --mode /tmp=1777 --mode /home/nonroot=0700 --owner "/home/nonroot=$NONROOT:$NONROOT"
    --created-by "hack/image.sh build $name"
    --label "org.opencontainers.image.title=$title"
    --label "org.opencontainers.image.description=$description"
    --label "org.opencontainers.image.version=$VERSION"
    --label "org.opencontainers.image.revision=$revision"
    --label "org.opencontainers.image.created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)"
    --label "org.opencontainers.image.licenses=Apache-2.0"
    --label "dev.settle.image.tree=$tree"
    --label "$(if [ "$name" = example-go ]; then echo "dev.settle.image.go=$(go version)"; else echo "dev.settle.image.rustc=$(rustc -V)"; fi)"
    --label "dev.settle.image.debian=$(sed -n 's/^PRETTY_NAME="\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' /etc/os-release)"
  )
  if [ "$name" = settle ]; then
    args+=(--cmd '["operator"]')
    for p in $PORTS; do args+=(--port "$p"); done
  fi
  local pkg ver
  while read -r pkg ver; do args+=(--label "dev.settle.image.debian.$pkg=$ver"); done <<<"$packages"
  for l in ${LABELS[@]+"${LABELS[@]}"}; do args+=(--label "$l"); done

  # Skip the packing (the gzip is most of it) when the archive holds exactly these inputs.
  local inputs
  inputs="$( { printf '%s\n' "${args[@]}"; sha256sum "$ROOT/hack/oci-image.py";
               (cd "$rootfs" && find . -printf '%p %y %m %l\n' | LC_ALL=C sort &&
                 find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum); } | sha256sum | cut -d' ' -f1)"
  if [ -f "$archive" ] && [ -f "$archive.digest" ] && [ "$(cat "$archive.inputs" 2>/dev/null)" = "$inputs" ]; then
    echo "image $(repo_of "$name"):$(tag_of "$name"): up to date, $archive"
  else
    rm -f "$archive.inputs"
    local facts
    facts="$(python3 "$ROOT/hack/oci-image.py" "${args[@]}")"
    mv "$archive.new" "$archive"
    python3 -c 'import json,sys; print(json.loads(sys.argv[1])["manifest"])' "$facts" >"$archive.digest"
    echo "$facts" >"$archive.json"
    echo "$inputs" >"$archive.inputs"
    echo "image $(repo_of "$name"):$(tag_of "$name"): built in $((SECONDS - start))s, $archive"
  fi
  echo "  size $(du -m --apparent-size "$archive" | cut -f1) MB ($(stat -c %s "$archive") bytes)," \
    "digest $(cat "$archive.digest")"
  if [ -n "$sbom" ]; then
    echo "  sbom $archive.cdx.json (CycloneDX; also /usr/share/doc/settle/sbom.cdx.json in the image)"
  fi
}

case "$cmd" in
  build)
    need cargo "install Rust 1.89+ (rustup.rs)"
    need python3 "Debian: apt-get install python3"
    need dpkg-query "the image records the Debian package of every file it copies; build it on Debian 12"
    need ldd "Debian: apt-get install libc-bin"
    need flock "Debian: apt-get install util-linux"
    if [ "$VERSION" != "$APP_VERSION" ]; then
      echo "error: charts/settle/Chart.yaml appVersion ($APP_VERSION) differs from Cargo.toml's version ($VERSION):" \
        "the chart runs the image of its appVersion; set both to the release" >&2
      exit 1
    fi
    mkdir -p "$OUT"
    # One build at a time per output directory (a test suite and `make image` may meet there).
    exec 9>"$OUT/.lock"
    flock 9
    case "$which" in all) names="settle example example-go" ;; *) names="$which" ;; esac
    # One cargo build per binary: built together, the operator would link a library compiled
    # with the dev-dependencies' features (an example pulls them in), not the Dockerfile's
    # `--bin settle` alone; apart, each library variant is cached under its own hash.
    for n in $names; do
      case "$n" in
        settle) cargo build --release --locked --bin settle ;;
        # The example is a test application: its dev build (the one `cargo build --all-targets`
        # makes anyway) spares a cold CI run a second release build of the whole tree.
        example) cargo build --locked --example account_app ;;
        # Static, reproducible: no cgo, no paths or build id of this machine in the binary.
        example-go)
          need go "install Go 1.26+ (go.dev/dl)"
          (cd "$ROOT/clients/go" && CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags=-buildid= \
            -o "$TARGET/go/account-app-static" ./cmd/account-app) ;;
      esac
    done
    for n in $names; do build_image "$n"; done ;;
  path|digest|ref)
    [ "$which" != all ] || usage
    case "$cmd" in
      path) archive_of "$which" ;;
      ref) echo "$(repo_of "$which"):$(tag_of "$which")" ;;
      digest)
        f="$(archive_of "$which").digest"
        [ -f "$f" ] || { echo "error: $f does not exist: build it with hack/image.sh build $which" >&2; exit 1; }
        cat "$f" ;;
    esac ;;
  *) usage ;;
esac
