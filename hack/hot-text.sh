#!/usr/bin/env bash
# Writes crates/settle-operator/link/hot-functions.txt: the functions `settle operator` runs, first call first, which
# build.rs places first and together in a release build, so the operator touches few pages of
# its code and the kernel maps few around them. Run it when the operator's code changed much,
# or after a dependency or toolchain update (they rename most functions): the reconcile
# bench's "file-backed" figure at rest grows as the list goes stale.
#
#   hack/hot-text.sh [N]     N Subscriptions in the profiling run (default 1000)
#
# How: a release build of `settle` with LLVM's SanitizerCoverage at function level and
# hack/hot-text/coverage.c as its runtime (in $CARGO_TARGET_DIR/hot-text, apart from the normal
# build) runs as the operator of `cargo bench --bench reconcile -- N 0` (through
# SETTLE_OPERATOR_WRAPPER): it starts, takes N Subscriptions on NATS through the webhooks, keeps
# them a minute at rest and deletes them, writing each function's first call; perf samples the
# run for what the coverage build cannot count (the standard library, C and assembly).
# hack/hot-text/layout.py turns both into the list. Needs the environment up (hack/env.sh up),
# python3, and perf for the sampled part.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
N="${1:-1000}"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
OUT="$TARGET/hot-text"
mkdir -p "$OUT"
rm -f "$OUT"/calls.*

cc -O2 -fPIC -c "$ROOT/hack/hot-text/coverage.c" -o "$OUT/coverage.o"
RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=1 -Cllvm-args=-sanitizer-coverage-trace-pc-guard -Clink-arg=$OUT/coverage.o" \
    SETTLE_HOT_TEXT=0 CARGO_TARGET_DIR="$OUT/target" \
    cargo build --release --locked --bin settle
COVERAGE_BIN="$OUT/target/release/settle"

# The bench runs its operator as `WRAPPER <its binary> operator ...`: this one runs the
# coverage build instead.
cat >"$OUT/wrapper" <<WRAP
#!/bin/sh
shift
SETTLE_COVERAGE_OUT="$OUT/calls" exec "$COVERAGE_BIN" "\$@"
WRAP
chmod +x "$OUT/wrapper"
(cd "$ROOT" && cargo bench --locked --bench reconcile --no-run)

# The functions the coverage build cannot count (the standard library's, shipped compiled; C
# and assembly) are found by sampling: perf over the whole machine for the run (the bench kills
# its operator's process group, so a perf under the wrapper would be killed unfinished).
: >"$OUT/sampled"
if command -v perf >/dev/null; then
    perf record -q -F 2000 -a -o "$OUT/perf.data" 2>"$OUT/perf.log" &
    PERF=$!
else
    echo "no perf: only the functions the coverage build counts are placed" >&2
fi
(cd "$ROOT" && SETTLE_OPERATOR_WRAPPER="$OUT/wrapper" cargo bench --locked --bench reconcile -- "$N" 0)
if [ -n "${PERF:-}" ]; then
    kill -INT "$PERF"
    wait "$PERF" || true
    perf script -i "$OUT/perf.data" -F ip,sym,dso --no-demangle 2>/dev/null |
        awk -v dso="($COVERAGE_BIN)" '$NF == dso { print $2 }' | awk '!seen[$0]++' >"$OUT/sampled"
fi

python3 "$ROOT/hack/hot-text/layout.py" "$COVERAGE_BIN" "$OUT/sampled" "$OUT"/calls.* >"$ROOT/crates/settle-operator/link/hot-functions.txt.new"
mv "$ROOT/crates/settle-operator/link/hot-functions.txt.new" "$ROOT/crates/settle-operator/link/hot-functions.txt"
echo "wrote link/hot-functions.txt"
