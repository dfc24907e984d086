#!/usr/bin/env bash
# `make check`: the quick tier. Lint (rustfmt, clippy, shellcheck), then every test that needs no
# environment: the unit tests of every crate, and the integration suites that run on files and
# in process (the admission rules' table, the house order, the code layout, `settle check`, the
# webhook's review, the docs and their generated reference pages). `make test` runs these too,
# with everything that needs the real API server, brokers and node.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
# shellcheck source=hack/lib.sh
. "$ROOT/hack/lib.sh"
need cargo "install Rust 1.89+ (rustup.rs)"
start=$SECONDS
make --no-print-directory lint
cargo test --workspace --locked --lib --bins --quiet
for suite in settle:admission_rules settle-operator:layering settle-operator:hot_text \
  settle-operator:check_cli settle-operator:webhook_review settle-operator:reference settle-e2e:docs \
  settle-e2e:supply_chain; do
  cargo test --locked --quiet -p "${suite%%:*}" --test "${suite#*:}"
done
(cd clients/go && go test -count=1 -short -parallel 16 ./...)   # the Go runtime: everything but its broker suites
echo "make check: lint and the tests that need no environment passed in $((SECONDS - start))s"
