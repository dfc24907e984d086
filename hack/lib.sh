# shellcheck shell=bash
# Helpers shared by hack/tools.sh, env.sh, test.sh and demo.sh (sourced, never run). Processes
# are tracked by pid files in $ENV_DIR (NAME.pid, log in NAME.log): set ENV_DIR before using
# alive, await, stop_one or start_retrying.

# Print an error and exit unless the command $1 is on PATH; $2 says how to get it.
need() { command -v "$1" >/dev/null 2>&1 || { echo "error: '$1' is required on PATH ($2)" >&2; exit 1; }; }

# free_ports N: N distinct ports that are free on 127.0.0.1 right now. Nothing reserves them:
# a server started later may find one taken, which is why servers are started with
# start_retrying below, never trusted to get the port they were given.
free_ports() {
  python3 - "$1" <<'PY'
import socket, sys
held = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    held.append(s)
print(" ".join(str(s.getsockname()[1]) for s in held))
for s in held:
    s.close()
PY
}
free_port() { free_ports 1; }

# http_ok URL [USER PASS]: the URL answers 2xx within 2 s.
http_ok() {
  python3 - "$@" <<'PY'
import base64, sys, urllib.request
req = urllib.request.Request(sys.argv[1])
if len(sys.argv) > 3:
    token = base64.b64encode(f"{sys.argv[2]}:{sys.argv[3]}".encode()).decode()
    req.add_header("Authorization", "Basic " + token)
try:
    with urllib.request.urlopen(req, timeout=2) as r:
        sys.exit(0 if 200 <= r.status < 300 else 1)
except Exception:
    sys.exit(1)
PY
}

# tcp_open PORT: something accepts TCP connections on 127.0.0.1:PORT.
tcp_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# ports_owned PID PORT...: every PORT is listened on by a process of PID's session (each server
# is started under setsid, so its session id is its pid and its children share it). Fails, naming
# the ports, when one is not: then a server of another environment answered on it.
ports_owned() {
  python3 - "$@" <<'PY'
import os, sys
sid, ports = int(sys.argv[1]), {int(p) for p in sys.argv[2:]}
inodes = {}
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        lines = open(table).read().splitlines()[1:]
    except OSError:
        continue
    for line in lines:
        f = line.split()
        port = int(f[1].rsplit(":", 1)[1], 16)
        if f[3] == "0A" and port in ports:  # 0A: LISTEN
            inodes[f"socket:[{f[9]}]"] = port
owned = set()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/stat") as st:
            if int(st.read().rsplit(")", 1)[1].split()[3]) != sid:
                continue
        for fd in os.listdir(f"/proc/{pid}/fd"):
            port = inodes.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
            if port is not None:
                owned.add(port)
    except OSError:
        continue
missing = sorted(ports - owned)
if missing:
    print(" ".join(map(str, missing)))
    sys.exit(1)
PY
}

# group_running PGID: a process of the group is running (a zombie is not: a stopped server stays
# one until init reaps it, which can take seconds).
group_running() { ps -e -o pgid= -o stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {found = 1} END {exit !found}'; }

# alive NAME: the process group spawn started for NAME still runs.
alive() { [ -f "$ENV_DIR/$1.pid" ] && group_running "$(cat "$ENV_DIR/$1.pid")"; }

# await NAME SECONDS CHECK...: poll CHECK every 0.5 s. Returns 0 when it passes, 1 when NAME's
# process exited, 2 after SECONDS. Silent: callers say what went wrong.
await() {
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS
  until "$@"; do
    alive "$name" || return 1
    (( SECONDS - start > limit )) && return 2
    sleep 0.5
  done
}

# wait_for NAME SECONDS CHECK...: await, with an error naming the log when it fails.
wait_for() {
  local rc=0
  await "$@" || rc=$?
  [ "$rc" = 0 ] || start_failed "$1" "$2" "$rc"
}

# start_failed NAME SECONDS RC: say why NAME did not start (RC from await).
start_failed() {
  if [ "$3" = 1 ]; then
    echo "error: $1 exited during start; last lines of $ENV_DIR/$1.log:" >&2
    tail -n 30 "$ENV_DIR/$1.log" >&2 || true
  else
    echo "error: $1 not ready after ${2}s; see $ENV_DIR/$1.log" >&2
  fi
  return 1
}

# stop_one NAME [SECONDS]: TERM the process group NAME's pid file names (the server and its
# children, as spawn starts them), KILL it after SECONDS (default 10), and remove the pid file.
stop_one() {
  local name="$1" grace="${2:-10}" pid
  [ -f "$ENV_DIR/$name.pid" ] || return 0
  pid="$(cat "$ENV_DIR/$name.pid")"
  if group_running "$pid"; then
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 $((grace * 4))); do group_running "$pid" || break; sleep 0.25; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  rm -f "$ENV_DIR/$name.pid"
}

# spawn NAME CMD...: start CMD in a session of its own (so stop_one can end it and its children,
# and ports_owned can tell its sockets), output to NAME.log, its pid to NAME.pid.
spawn() {
  local name="$1"; shift
  rm -f "$ENV_DIR/$name.pid"
  # The pid is written from inside: setsid forks when it is a group leader already.
  # shellcheck disable=SC2016 # expanded by the inner sh
  setsid sh -c 'echo $$ >"$0"; exec "$@"' "$ENV_DIR/$name.pid" "$@" >"$ENV_DIR/$name.log" 2>&1 </dev/null &
  for _ in $(seq 1 100); do [ -s "$ENV_DIR/$name.pid" ] && return 0; sleep 0.05; done
  echo "error: $name did not start (no pid after 5 s)" >&2
  return 1
}

# What servers write when a port is taken (etcd, kube-apiserver: Go's "bind: address already in
# use"; RabbitMQ: eaddrinuse, or dist_port_already_used for its distribution port; epmd -d:
# "there is already a epmd running").
BIND_FAILED='address already in use|eaddrinuse|dist_port_already_used|already a epmd running|BindException'

bind_failed() { grep -qiE "$BIND_FAILED" "$ENV_DIR/$1.log" 2>/dev/null; }

# start_retrying NAME SECONDS LAUNCH READY PORTS: start a server on ports chosen by free_ports
# without a race with anyone else choosing at the same moment. LAUNCH picks ports (into globals)
# and spawns NAME; READY checks it answers; PORTS prints the ports it must own. When the server
# reports a taken port (in its log, whether it exits or not), or another process turns out to own
# one of its ports, NAME is stopped and LAUNCH runs again with new ports (up to 5 times).
start_retrying() {
  local name="$1" limit="$2" launch="$3" ready="$4" ports="$5" attempt rc taken
  for attempt in 1 2 3 4 5; do
    "$launch"
    rc=0; await "$name" "$limit" _ready_or_bind_failed "$name" "$ready" || rc=$?
    taken=""
    if bind_failed "$name"; then
      taken="$(grep -iE -m1 "$BIND_FAILED" "$ENV_DIR/$name.log" | cut -c1-160)"
    elif [ "$rc" = 0 ]; then
      # shellcheck disable=SC2046 # the port list is split on purpose
      taken="$(ports_owned "$(cat "$ENV_DIR/$name.pid")" $("$ports"))" && return 0
      taken="port $taken answered for another process"
    else
      start_failed "$name" "$limit" "$rc"
      return 1
    fi
    echo "$name: a port was taken ($taken); retrying on new ports ($attempt/5)" >&2
    stop_one "$name"
    mv "$ENV_DIR/$name.log" "$ENV_DIR/$name.log.$attempt"
  done
  echo "error: $name found its ports taken 5 times in a row; see $ENV_DIR/$name.log.*" >&2
  return 1
}

_ready_or_bind_failed() { bind_failed "$1" || "$2"; }
