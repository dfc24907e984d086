#!/usr/bin/env bash
# `make test`: builds what is missing, brings up the real environment (kube-apiserver + etcd,
# nats-server, RabbitMQ, ElasticMQ, a JetStream cluster of three nats-servers for
# crates/settle-e2e/tests/nats_cluster.rs, and a Kubernetes node for the pod suite), runs every test, and
# always brings the environment down again (the node puts the host back as it was).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
# shellcheck source=hack/lib.sh
. "$ROOT/hack/lib.sh"
need cargo "install Rust 1.89+ (rustup.rs)"
need go "install Go 1.26+ (go.dev/dl)"
start=$SECONDS

# Each phase's wall time, printed at the end (a cold run's figures in the README come from here).
phases=""
phase() { phases="$phases $1 $((SECONDS - mark))s,"; mark=$SECONDS; }
mark=$SECONDS

hack/tools.sh build; phase tools
cargo build --workspace --all-targets --locked --quiet   # compile before the environment starts (no idle servers)
# The Go runtime's modules and its test application (the account suite runs it beside the Rust one).
(cd clients/go && go mod download && go build -o ../../target/go/account-app ./cmd/account-app && go test -count=1 -run XXX ./... >/dev/null)
phase build
hack/image.sh build                          # the images crates/settle-e2e/tests/image.rs and the pod suite read
phase images

# The tests get an environment of their own (a developer's `make env-up` keeps running), and
# read where it is from the variables its env file exports.
export SETTLE_ENV_DIR="$ROOT/target/test-env"
hack/env.sh down >/dev/null 2>&1 || true
trap 'hack/env.sh down >/dev/null 2>&1 || true' EXIT
hack/env.sh up --node --nats-cluster
phase environment
# shellcheck disable=SC1091
source "$SETTLE_ENV_DIR/settle.env"

# Unit and integration tests (benches are compiled above but not run: they print figures and
# are run with `make bench`). The test binaries run SETTLE_TEST_JOBS at a time (default 3): most
# suites wait on real servers rather than the CPU; each binary's output is printed whole. Each
# binary gets SETTLE_TEST_TIMEOUT seconds (default 900), then it and its children are killed.
log="$ROOT/target/test-output.log"
{
  cargo test --workspace --locked --no-run --lib --bins --tests --examples --message-format=json-render-diagnostics \
    | python3 hack/run-tests.py "${SETTLE_TEST_JOBS:-3}"
  cargo test --workspace --locked --doc
  # The Go runtime (clients/go): its unit tests, the admission vectors, and the shared scenes
  # on every broker. After the Rust suites, not beside them: beside them, the cluster's
  # campaign (nats_cluster, timing-bound on two cores) failed once (docs/guide/chaos.md).
  (cd clients/go && go test -count=1 -parallel 16 -v ./... | grep -v '^=== ')
} 2>&1 | tee "$log"
phase tests
# The node changed the host (a bridge, iptables chains, sysctls): its `down` must undo all of it.
trap - EXIT
hack/env.sh down >/dev/null
hack/node.sh check
counts="$(awk '/^test result:/ {p += $4; f += $6} END {printf "%d passed, %d failed", p, f}' "$log")"
go_counts="$(awk '/^ *--- PASS/ {p++} /^ *--- FAIL/ {f++} END {printf "%d passed, %d failed", p, f}' "$log")"
phase down
phases="${phases%,}"
echo "make test: every suite green in $((SECONDS - start))s (${phases# })"
echo "settle: $counts"
echo "settle.dev/messaging (Go): $go_counts"
