#!/usr/bin/env python3
"""Runs every test executable of the crate, several at once, and prints each one's output whole.

`cargo test` runs one test binary after another. Most of Settle's integration suites spend their
time waiting on real servers (a Lease to expire, a broker to restart, a minute of steady state),
not on the CPU, so running a few binaries side by side cuts the wall time without loading the
machine more than the tests inside one binary already do. Each binary's output is printed in one
piece (as cargo would), longest-running first, and the usual `test result:` lines stay intact.

usage: hack/run-tests.py JOBS     (after `cargo test --no-run`; reads cargo's JSON on stdin)
Exits non-zero if any binary failed, after every binary has run.
"""

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

# Suites known to take longest start first, so the lanes end together.
FIRST = [
    "reconcile_faults", "leader_election", "reconcile_subscription", "reconcile_leader",
    "helm_chart", "webhook_e2e", "reconcile_backend", "reconcile_runtime", "kustomize",
    "bus_nats", "webhook_hardening", "bus_rabbitmq", "bus_sqs", "operator_cli",
]


def executables(lines):
    """(name, kind, path) of every test executable in cargo's JSON messages."""
    found = []
    for line in lines:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("reason") != "compiler-artifact" or not msg.get("profile", {}).get("test"):
            continue
        exe = msg.get("executable")
        if not exe:
            continue
        target = msg["target"]
        found.append((target["name"], target["kind"][0], exe))
    return found


def order(item):
    name = item[0]
    return (FIRST.index(name) if name in FIRST else len(FIRST), name)


def main():
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    tests = sorted(set(executables(sys.stdin)), key=order)
    if not tests:
        print("run-tests: cargo built no test executable", file=sys.stderr)
        return 1
    lock = threading.Lock()
    failed = []

    def run(item):
        name, kind, exe = item
        start = time.monotonic()
        proc = subprocess.run([exe], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              cwd=os.getcwd())
        took = time.monotonic() - start
        with lock:
            print(f"     Running {kind} {name} ({took:.1f}s)", flush=True)
            sys.stdout.write(proc.stdout.decode("utf-8", "replace"))
            sys.stdout.flush()
            if proc.returncode != 0:
                failed.append(name)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(run, tests))
    if failed:
        print(f"run-tests: failed: {', '.join(sorted(failed))}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
