#!/usr/bin/env python3
"""Runs every test executable of the crate, several at once, and prints each one's output whole.

`cargo test` runs one test binary after another. Most of Settle's integration suites spend their
time waiting on real servers (a Lease to expire, a broker to restart, a minute of steady state),
not on the CPU, so running a few binaries side by side cuts the wall time without loading the
machine more than the tests inside one binary already do. Each binary's output is printed in one
piece (as cargo would), longest-running first, and the usual `test result:` lines stay intact.

A binary fails when it exits non-zero, when it runs past its timeout, or when it ran no test:
- Timeout: each binary gets `--timeout SECONDS` (or `SETTLE_TEST_TIMEOUT`; 900 unless set: the
  slowest suites took 79 s (reconcile_faults) and 67 s (demo) running three at a time on 2
  cores, and a loaded machine can take several times that). A binary past it is stopped with its
  whole process group (the servers and operators its tests started as child processes: SIGTERM,
  then SIGKILL after a few seconds), its output so far is printed, then a line
  `run-tests: NAME TIMED OUT after N s`.
- No test: its output has no `test result:` line (it crashed before the harness reported, or has
  no harness), or it is an integration suite (a file under tests/) that ran 0 tests. The unit-test
  harnesses of the lib, the bins and the examples may legitimately hold no test.

usage: hack/run-tests.py [--timeout SECONDS] JOBS   (after `cargo test --no-run`; reads cargo's
JSON on stdin). Exits non-zero if any binary failed, after every binary has run.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

# Suites known to take longest start first, longest first (their times in a warm CI run, three
# lanes on 2 cores: chaos 293 s, account 224, nats_cluster 152, reconcile 133, pods 118, adopt 68,
# leader_election 47, pause 37, image 29, demo 28), so the lanes end together: in the order they
# were listed before (reconcile, account, pods, chaos, ..., nats_cluster last) the tests took
# 489 s, because the two campaigns started late.
FIRST = [
    "chaos", "account", "nats_cluster", "reconcile", "pods", "adopt", "leader_election", "pause",
    "image", "demo", "helm_chart", "bus", "webhook_hardening", "webhook_e2e", "kustomize",
    "nack_migration", "operator_cli",
]

# Test threads per binary where the harness default (RUST_TEST_THREADS, else one per core: 2
# here) is too few. `bus` is four suites in one binary (memory, NATS, RabbitMQ, SQS: 99 tests
# that mostly wait on brokers and timers, not the CPU); on 2 cores it took 69 s at 2 threads,
# 35 s at 4, 24 s at 6 and 22 s at 8, against 24 s for the slowest of the four binaries it
# replaced (bus_nats, 2 threads). At 8 it is no slower than they were.
# `reconcile` and `account` are seven suites each (a module per broker and subject), whose
# tests run operators and applications as processes and wait on them: at 2 threads each of the
# fourteen old binaries ran beside two others, so 6 keeps about the same number of tests at once.
TEST_THREADS = {"bus": 8, "reconcile": 6, "account": 6}

DEFAULT_TIMEOUT = 900
# After SIGTERM to a timed-out binary's group, how long before SIGKILL.
TERM_GRACE = 5
# After a binary ends, how long its output may still take to arrive: a child that outlived it
# and holds the pipe open must not hang the run.
DRAIN_GRACE = 10

# Cargo target kinds whose binaries must run at least one test: the integration suites.
MUST_RUN_TESTS = {"test"}

RUNNING = re.compile(r"^running (\d+) tests?$", re.MULTILINE)
RESULT = re.compile(r"^test result:", re.MULTILINE)

# The binaries running now. Each has a process group of its own, which a Ctrl-C at the terminal
# does not reach, so the runner stops them itself when it is interrupted.
RUNNING_NOW = set()
RUNNING_LOCK = threading.Lock()


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


def no_test_reason(kind, output):
    """Why a binary that exited 0 still counts as failed for running no test, or None."""
    if not RESULT.search(output):
        return "its output has no `test result:` line"
    if kind in MUST_RUN_TESTS and sum(int(n) for n in RUNNING.findall(output)) == 0:
        return "it is an integration suite and ran 0 tests"
    return None


def exited(proc):
    """Whether `proc` has exited, leaving it unreaped: while its zombie stands, its pid (the
    group's id) cannot be given to another process, so signalling the group stays safe."""
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return info is not None and info.si_pid == proc.pid


def stop_group(proc):
    """Stops `proc` and every process in its group: SIGTERM, then SIGKILL after TERM_GRACE."""
    os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE
    while not exited(proc) and time.monotonic() < deadline:
        time.sleep(0.1)
    # Whatever is left of the group: the binary itself, or children that ignored SIGTERM.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_one(exe, timeout, threads=None):
    """Runs `exe` in a process group of its own, on `threads` test threads if given (else the
    harness's default): (exit code or None if timed out, output)."""
    argv = [exe] if threads is None else [exe, "--test-threads", str(threads)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, cwd=os.getcwd(), start_new_session=True)
    with RUNNING_LOCK:
        RUNNING_NOW.add(proc)
    chunks = []

    def drain():
        for chunk in iter(lambda: proc.stdout.read1(65536), b""):
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
        stop_group(proc)
    with RUNNING_LOCK:
        RUNNING_NOW.discard(proc)
    reader.join(DRAIN_GRACE)
    return code, b"".join(chunks).decode("utf-8", "replace")


def seconds(text):
    """A timeout in seconds, above zero."""
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


def interrupted(signum, _frame):
    """SIGINT, SIGTERM or SIGHUP to the runner: kill every running binary's group, then exit."""
    with RUNNING_LOCK:
        procs = list(RUNNING_NOW)
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(f"run-tests: interrupted ({signal.Signals(signum).name}); stopped {len(procs)} "
          "running test binaries and their children", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def parse_args(argv):
    p = argparse.ArgumentParser(description="Runs the crate's test executables side by side.")
    p.add_argument("jobs", nargs="?", type=int, default=3, help="binaries at once (3)")
    p.add_argument("--timeout", type=seconds, metavar="SECONDS",
                   help=f"per binary (SETTLE_TEST_TIMEOUT; {DEFAULT_TIMEOUT} unless set)")
    args = p.parse_args(argv)
    if args.timeout is None:
        env = os.environ.get("SETTLE_TEST_TIMEOUT") or str(DEFAULT_TIMEOUT)
        try:
            args.timeout = seconds(env)
        except ValueError:
            p.error(f"SETTLE_TEST_TIMEOUT={env!r}: set it to a number of seconds above 0")
    if args.jobs < 1:
        p.error("JOBS must be at least 1")
    return args


def main():
    args = parse_args(sys.argv[1:])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    tests = sorted(set(executables(sys.stdin)), key=order)
    if not tests:
        print("run-tests: cargo built no test executable", file=sys.stderr)
        return 1
    lock = threading.Lock()
    failed = []

    def run(item):
        name, kind, exe = item
        start = time.monotonic()
        threads = TEST_THREADS.get(name) if kind == "test" else None
        code, output = run_one(exe, args.timeout, threads)
        took = time.monotonic() - start
        if code is None:
            why = f"TIMED OUT after {args.timeout:g} s"
        elif code != 0:
            why = None
        else:
            why = no_test_reason(kind, output)
            why = why and f"ran no test: {why}"
        with lock:
            print(f"     Running {kind} {name} ({took:.1f}s)", flush=True)
            sys.stdout.write(output)
            if output and not output.endswith("\n"):
                sys.stdout.write("\n")
            if why:
                print(f"run-tests: {name} {why}", flush=True)
            sys.stdout.flush()
            if code != 0 or why:
                failed.append(name + (" (timed out)" if code is None else ""))

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(run, tests))
    if failed:
        print(f"run-tests: failed: {', '.join(sorted(failed))}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
