#!/usr/bin/env bash
# `make demo`: the main job, locally, on real parts. Starts kube-apiserver+etcd and nats-server
# on 127.0.0.1, installs Settle's CRDs, applies the samples, and shows what the API server
# accepts and refuses. Leaves the environment up so you can keep going (`make env-down` stops it).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
cargo build --quiet
hack/env.sh up >/dev/null
# shellcheck disable=SC1091
source target/env/settle.env
NS=settle-demo
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "Install the CRDs (generated from the Rust types)"
./target/debug/settle crds | kubectl apply --server-side --force-conflicts -f -
kubectl wait --for=condition=Established --timeout=60s crd/subscriptions.messaging.settle.dev crd/backends.messaging.settle.dev

step "Apply the samples into namespace $NS"
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -n "$NS" -k config/samples/
kubectl get backends,subscriptions -n "$NS"

step "The API server itself refuses a malformed duration"
kubectl apply -n "$NS" -f - <<'YAML' || true
apiVersion: messaging.settle.dev/v1alpha1
kind: Subscription
metadata: {name: typo}
spec:
  backendRef: {name: nats}
  pattern: "orders.>"
  ackWait: 30 seconds
YAML

step "Done. The environment is still up:"
echo "  source target/env/settle.env && kubectl get subscriptions -A"
echo "  make env-down    # to stop it"
