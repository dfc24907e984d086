#!/usr/bin/env bash
# Builds (once) and prints the paths of the real parts Settle's tests and demo run against:
# kube-apiserver+etcd (tests/controlplane), nats-server, helm and kube-score (the chart's lint),
# each pinned and cached under target/tools/<name>-<version>/. Safe to run repeatedly; a finished
# binary is never rebuilt.
#   hack/tools.sh build        build whatever is missing
#   hack/tools.sh path NAME    print the cached binary of NAME (controlplane|nats-server|helm|kube-score)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CP_VERSION="$(cat "$ROOT/tests/controlplane/VERSION")"
NATS_VERSION="v2.15.3"
HELM_VERSION="v3.21.4"
KUBE_SCORE_VERSION="v1.20.0"
TOOLS="${CARGO_TARGET_DIR:-$ROOT/target}/tools"

cp_hash() { cat "$ROOT"/tests/controlplane/{VERSION,go.mod,go.sum,main.go} | sha256sum | cut -c1-12; }
path_of() {
  case "$1" in
    controlplane) echo "$TOOLS/controlplane-$CP_VERSION-$(cp_hash)/settle-controlplane" ;;
    nats-server)  echo "$TOOLS/nats-server-$NATS_VERSION/nats-server" ;;
    helm)         echo "$TOOLS/helm-$HELM_VERSION/helm" ;;
    kube-score)   echo "$TOOLS/kube-score-$KUBE_SCORE_VERSION/kube-score" ;;
    *) echo "unknown tool $1" >&2; exit 2 ;;
  esac
}

need() { command -v "$1" >/dev/null 2>&1 || { echo "error: '$1' is required on PATH ($2)" >&2; exit 1; }; }

# Print a line every 30 s while a long build runs, so a cold CI log shows it is alive.
with_progress() {
  local what="$1"; shift
  local start=$SECONDS
  "$@" & local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 30 & wait $! || true
    kill -0 "$pid" 2>/dev/null && echo "  ... still building $what ($((SECONDS - start))s)"
  done
  wait "$pid"
}

build_one() {
  local name="$1" out; out="$(path_of "$name")"
  [ -x "$out" ] && return 0
  need go "install Go 1.26+"
  mkdir -p "$(dirname "$out")"
  local tmp; tmp="$(mktemp -d "$TOOLS/.build-XXXXXX")"
  echo "building $name -> $out (first time only)"
  local start=$SECONDS
  case "$name" in
    controlplane)
      (cd "$ROOT/tests/controlplane" && with_progress "kube-apiserver+etcd $CP_VERSION" \
        go build -trimpath -ldflags='-s -w' -o "$tmp/settle-controlplane" .) ;;
    nats-server)
      with_progress "nats-server $NATS_VERSION" env GOBIN="$tmp" go install "github.com/nats-io/nats-server/v2@$NATS_VERSION" ;;
    helm)
      with_progress "helm $HELM_VERSION" env GOBIN="$tmp" go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" ;;
    kube-score)
      with_progress "kube-score $KUBE_SCORE_VERSION" env GOBIN="$tmp" go install "github.com/zegl/kube-score/cmd/kube-score@$KUBE_SCORE_VERSION" ;;
  esac
  mv "$tmp/$(basename "$out")" "$out"
  rm -rf "$tmp"
  echo "built $name in $((SECONDS - start))s"
}

case "${1:-build}" in
  build)
    need kubectl "the Kubernetes client; Debian: apt-get install kubectl, or see kubernetes.io"
    mkdir -p "$TOOLS"
    for t in ${2:-nats-server helm kube-score controlplane}; do build_one "$t"; done ;;
  path) path_of "$2" ;;
  *) echo "usage: hack/tools.sh build [names] | path NAME" >&2; exit 2 ;;
esac
