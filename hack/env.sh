#!/usr/bin/env bash
# Starts and stops Settle's local environment of real parts, all on 127.0.0.1:
#   kube-apiserver + etcd (hack/controlplane), nats-server with JetStream, RabbitMQ (with its
#   management plugin and its own epmd) and ElasticMQ (SQS).
#   hack/env.sh up       install what is missing, start all four side by side, wait until each is
#                        ready, write $SETTLE_ENV_DIR/settle.env (default target/env/settle.env)
#   hack/env.sh up --node  the same plus a real Kubernetes node with its own API server
#                        (hack/node.sh: kubelet, containerd, kube-proxy; root, one per machine),
#                        for the pod suite; `make test` starts it
#   hack/env.sh up --nats-cluster  the same plus a JetStream cluster of three more nats-servers
#                        (settle-c1..c3, routes on loopback), for crates/settle-e2e/tests/nats_cluster.rs; the
#                        single nats-server stays what every other suite uses. Flags combine.
#   hack/env.sh down     stop them all (the node too) and remove their state
#   hack/env.sh status   say what runs
# `up` is idempotent: if the environment is already up and healthy it only prints how to use it.
# Several environments run side by side (SETTLE_ENV_DIR): each has its own ports, data, node
# names and epmd, and a server that finds its port taken at start is restarted on new ones.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=hack/lib.sh
. "$ROOT/hack/lib.sh"
# SETTLE_ENV_DIR lets `make test` run its own environment beside a developer's `make env-up`.
ENV_DIR="${SETTLE_ENV_DIR:-$ROOT/target/env}"
ENV_FILE="$ENV_DIR/settle.env"
PARTS="controlplane nats rabbitmq elasticmq"
PROCESSES="operator controlplane nats rabbitmq epmd elasticmq"   # operator: started by `make demo`

kubeconfig() { echo "$ENV_DIR/cp/kubeconfig"; }
api_ready() {
  [ -f "$(kubeconfig)" ] && kubectl --kubeconfig "$(kubeconfig)" get --raw=/readyz >/dev/null 2>&1 &&
    # /readyz answers before the API server's own bootstrap objects exist; wait for `default`.
    kubectl --kubeconfig "$(kubeconfig)" get namespace default -o name >/dev/null 2>&1
}

# --- kube-apiserver + etcd: ports chosen here; restarted on new ones when one is taken ---------
launch_controlplane() {
  read -r API_PORT ETCD_PORT PEER_PORT < <(free_ports 3)
  rm -rf "$ENV_DIR/cp"; mkdir -p "$ENV_DIR/cp"
  spawn controlplane "$("$ROOT/hack/tools.sh" path controlplane)" -dir "$ENV_DIR/cp" \
    -apiserver-port "$API_PORT" -etcd-port "$ETCD_PORT" -etcd-peer-port "$PEER_PORT"
}
ports_controlplane() { echo "$API_PORT $ETCD_PORT $PEER_PORT"; }
start_controlplane() {
  start_retrying controlplane 180 launch_controlplane api_ready ports_controlplane
  echo "export KUBECONFIG=$(kubeconfig)" >"$ENV_DIR/controlplane.env"
  echo "kube-apiserver+etcd ready on 127.0.0.1:$API_PORT"
}

# --- nats-server: picks its own ports and writes them to a file (no race) ---------------------
nats_ports_file() { compgen -G "$ENV_DIR/nats/nats-server_*.ports" >/dev/null; }
start_nats() {
  local nats; nats="$("$ROOT/hack/tools.sh" path nats-server)"
  mkdir -p "$ENV_DIR/nats"
  spawn nats "$nats" -a 127.0.0.1 -p -1 -m -1 -js -sd "$ENV_DIR/nats" --ports_file_dir "$ENV_DIR/nats" -n settle-test
  wait_for nats 60 nats_ports_file
  local ports
  ports="$(python3 -c 'import json,sys; p=json.load(open(sys.argv[1])); print(p["nats"][0].rsplit(":",1)[1], p["monitoring"][0].rsplit(":",1)[1])' \
    "$(compgen -G "$ENV_DIR/nats/nats-server_*.ports" | head -n1)")"
  read -r NATS_PORT NATS_MON_PORT <<<"$ports"
  wait_for nats 60 http_ok "http://127.0.0.1:$NATS_MON_PORT/healthz?js-enabled-only=true"
  cat >"$ENV_DIR/nats.env" <<ENV
export SETTLE_NATS_URL=nats://127.0.0.1:$NATS_PORT
export SETTLE_NATS_MONITOR_URL=http://127.0.0.1:$NATS_MON_PORT
export SETTLE_NATS_SERVER=$nats
ENV
  echo "nats-server ready on 127.0.0.1:$NATS_PORT"
}

# --- a JetStream cluster of three nats-servers (`up --nats-cluster`) -------------------------
# Each runs from its own config file, $ENV_DIR/nats-cluster/cN.conf (client, monitor and route
# ports fixed there, so a test can SIGKILL one by its pid file and start it again with the same
# config and store), as process nats-cluster/cN (pid and log beside the config). Routes need
# their ports known up front: chosen free, and all three started again on new ones when one is
# taken.
CLUSTER_NODES="c1 c2 c3"
cluster_dir() { echo "$ENV_DIR/nats-cluster"; }
launch_nats_cluster() {
  local d n i=0 routes=""
  d="$(cluster_dir)"
  read -r -a CLUSTER_PORTS < <(free_ports 9)
  for n in $CLUSTER_NODES; do
    routes="$routes, \"nats-route://127.0.0.1:${CLUSTER_PORTS[$((i * 3 + 2))]}\""; i=$((i + 1))
  done
  i=0
  for n in $CLUSTER_NODES; do
    rm -rf "${d:?}/$n"; mkdir -p "$d/$n"
    cat >"$d/$n.conf" <<CONF
server_name: settle-$n
listen: 127.0.0.1:${CLUSTER_PORTS[$((i * 3))]}
http: 127.0.0.1:${CLUSTER_PORTS[$((i * 3 + 1))]}
jetstream { store_dir: "$d/$n" }
cluster {
  name: settle-cluster
  listen: 127.0.0.1:${CLUSTER_PORTS[$((i * 3 + 2))]}
  routes: [${routes#, }]
}
CONF
    spawn "nats-cluster/$n" "$1" -c "$d/$n.conf"
    i=$((i + 1))
  done
}
cluster_monitor() { echo "http://127.0.0.1:${CLUSTER_PORTS[$(($1 * 3 + 1))]}"; }
# Every server has JetStream on and names the same meta leader.
cluster_ready() {
  python3 - "$(cluster_monitor 0)" "$(cluster_monitor 1)" "$(cluster_monitor 2)" <<'PY'
import json, sys, urllib.request
leaders = set()
try:
    for m in sys.argv[1:]:
        with urllib.request.urlopen(m + "/healthz?js-enabled-only=true", timeout=2) as r:
            if r.status != 200:
                sys.exit(1)
        with urllib.request.urlopen(m + "/jsz", timeout=2) as r:
            leaders.add((json.load(r).get("meta_cluster") or {}).get("leader", ""))
except Exception:
    sys.exit(1)
sys.exit(0 if len(leaders) == 1 and "" not in leaders else 1)
PY
}
# 0: ready; 1: not yet; 2: a server exited or found its port taken.
cluster_state() {
  local n
  for n in $CLUSTER_NODES; do
    alive "nats-cluster/$n" || return 2
    ! bind_failed "nats-cluster/$n" || return 2
  done
  cluster_ready || return 1
}
stop_nats_cluster() {
  local n pids=()
  for n in $CLUSTER_NODES; do stop_one "nats-cluster/$n" & pids+=($!); done
  for n in "${pids[@]}"; do wait "$n" || true; done
}
start_nats_cluster() {
  local nats d attempt rc n i start
  nats="$("$ROOT/hack/tools.sh" path nats-server)"
  d="$(cluster_dir)"
  mkdir -p "$d"
  for attempt in 1 2 3 4 5; do
    launch_nats_cluster "$nats"
    start=$SECONDS; rc=1
    while (( SECONDS - start < 90 )); do
      rc=0; cluster_state || rc=$?
      [ "$rc" = 1 ] || break
      sleep 0.5
    done
    if [ "$rc" = 0 ]; then
      i=0
      for n in $CLUSTER_NODES; do
        # shellcheck disable=SC2046 # the port list is split on purpose
        ports_owned "$(cat "$d/$n.pid")" $(printf '%s ' "${CLUSTER_PORTS[@]:$((i * 3)):3}") >/dev/null || rc=3
        i=$((i + 1))
      done
      [ "$rc" = 0 ] && break
    fi
    stop_nats_cluster
    if [ "$rc" != 3 ] && ! grep -qiE "$BIND_FAILED" "$d"/c?.log 2>/dev/null; then
      echo "error: the nats-server cluster did not start (rc $rc); last lines of $d/c?.log:" >&2
      tail -n 10 "$d"/c?.log >&2 || true
      return 1
    fi
    echo "nats-cluster: a port was taken; retrying on new ports ($attempt/5)" >&2
    for n in $CLUSTER_NODES; do mv "$d/$n.log" "$d/$n.log.$attempt"; done
    [ "$attempt" != 5 ] || { echo "error: the nats-server cluster found its ports taken 5 times" >&2; return 1; }
  done
  local urls="" mons=""
  i=0
  for n in $CLUSTER_NODES; do
    urls="$urls,nats://127.0.0.1:${CLUSTER_PORTS[$((i * 3))]}"
    mons="$mons,$(cluster_monitor "$i")"
    i=$((i + 1))
  done
  cat >"$ENV_DIR/nats_cluster.env" <<ENV
export SETTLE_NATS_CLUSTER_URLS=${urls#,}
export SETTLE_NATS_CLUSTER_MONITOR_URLS=${mons#,}
export SETTLE_NATS_CLUSTER_DIR=$d
ENV
  echo "nats-server cluster settle-c1..c3 ready on ${urls#,}"
}

# --- RabbitMQ: its own epmd first, then the node; both restarted on new ports when taken ------
launch_epmd() {
  EPMD_PORT="$(free_port)"
  # -d: say "already running" in the log when the port is taken, instead of exiting silently.
  spawn epmd epmd -d -port "$EPMD_PORT" -address 127.0.0.1
}
ready_epmd() { tcp_open "$EPMD_PORT"; }
ports_epmd() { echo "$EPMD_PORT"; }

# Erlang's schedulers spin while idle by default; on a shared 2-core machine that spinning takes
# CPU from the tests and the other servers.
ERL_NO_SPIN="+sbwt none +sbwtdcpu none +sbwtdio none"
launch_rabbitmq() {
  read -r AMQP_PORT MGMT_PORT DIST_PORT < <(free_ports 3)
  local d="$ENV_DIR/rabbitmq"
  rm -rf "$d"; mkdir -p "$d/log"
  cat >"$d/rabbitmq.conf" <<CONF
listeners.tcp.1 = 127.0.0.1:$AMQP_PORT
management.tcp.ip = 127.0.0.1
management.tcp.port = $MGMT_PORT
log.console = true
log.console.level = info
log.console.use_colors = off
log.file = false
CONF
  echo '[rabbitmq_management].' >"$d/enabled_plugins"
  : >"$d/rabbitmq-env.conf"   # an empty one of our own, so /etc/rabbitmq/rabbitmq-env.conf is not read
  # HOME: the Erlang cookie is created there; a shared ~/.erlang.cookie races between environments.
  spawn rabbitmq env HOME="$d" \
    RABBITMQ_NODENAME="$RABBITMQ_NODE" \
    RABBITMQ_CONF_ENV_FILE="$d/rabbitmq-env.conf" \
    RABBITMQ_CONFIG_FILE="$d/rabbitmq.conf" \
    RABBITMQ_ADVANCED_CONFIG_FILE="$d/advanced.config" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$d/enabled_plugins" \
    RABBITMQ_MNESIA_BASE="$d/mnesia" \
    RABBITMQ_LOG_BASE="$d/log" \
    RABBITMQ_PID_FILE="$d/rabbitmq.pid" \
    RABBITMQ_DIST_PORT="$DIST_PORT" \
    ERL_EPMD_PORT="$EPMD_PORT" \
    ERL_CRASH_DUMP="$d/erl_crash.dump" \
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1} $ERL_NO_SPIN" \
    "$("$ROOT/hack/tools.sh" path rabbitmq)"
}
ready_rabbitmq() { tcp_open "$AMQP_PORT" && http_ok "http://127.0.0.1:$MGMT_PORT/api/overview" guest guest; }
ports_rabbitmq() { echo "$AMQP_PORT $MGMT_PORT $DIST_PORT"; }
start_rabbitmq() {
  # One node name per environment directory (readable in logs and the management UI).
  RABBITMQ_NODE="settle-$(printf '%s' "$ENV_DIR" | sha256sum | cut -c1-8)@localhost"
  start_retrying epmd 30 launch_epmd ready_epmd ports_epmd
  start_retrying rabbitmq 120 launch_rabbitmq ready_rabbitmq ports_rabbitmq
  cat >"$ENV_DIR/rabbitmq.env" <<ENV
export SETTLE_RABBITMQ_URL=amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2f
export SETTLE_RABBITMQ_MANAGEMENT_URL=http://127.0.0.1:$MGMT_PORT
ENV
  echo "RabbitMQ ready on 127.0.0.1:$AMQP_PORT (management http://127.0.0.1:$MGMT_PORT, node $RABBITMQ_NODE)"
}

# --- ElasticMQ: binds port 0 and logs the port it got (no race) -------------------------------
elasticmq_started() { [ -n "$(elasticmq_port)" ]; }
elasticmq_port() {
  sed -n 's/.*Started SQS rest server, bind address 127\.0\.0\.1:\([0-9]*\).*/\1/p' "$ENV_DIR/elasticmq.log" | head -n1
}
sqs_ready() {
  python3 - "$1" <<'PY'
import sys, urllib.parse, urllib.request
body = urllib.parse.urlencode({"Action": "ListQueues", "Version": "2012-11-05"}).encode()
try:
    with urllib.request.urlopen(sys.argv[1], data=body, timeout=2) as r:
        sys.exit(0 if r.status == 200 and b"ListQueuesResponse" in r.read() else 1)
except Exception:
    sys.exit(1)
PY
}
start_elasticmq() {
  local d="$ENV_DIR/elasticmq"
  mkdir -p "$d"
  cat >"$d/elasticmq.conf" <<CONF
include classpath("application.conf")
rest-sqs { enabled = true, bind-port = 0, bind-hostname = "127.0.0.1", sqs-limits = strict }
rest-stats { enabled = false }
# Queue URLs name the host and the port the server really bound (not the default 9324).
generate-node-address = true
CONF
  # A small heap and the C1 compiler only: it starts faster and serves test traffic well.
  spawn elasticmq env JAVA_OPTS="-Xmx512m -XX:+UseSerialGC -XX:TieredStopAtLevel=1" \
    "$("$ROOT/hack/tools.sh" path elasticmq)" -Dconfig.file="$d/elasticmq.conf"
  wait_for elasticmq 120 elasticmq_started
  SQS_PORT="$(elasticmq_port)"
  wait_for elasticmq 60 sqs_ready "http://127.0.0.1:$SQS_PORT/"
  ports_owned "$(cat "$ENV_DIR/elasticmq.pid")" "$SQS_PORT" >/dev/null ||
    { echo "error: ElasticMQ logged port $SQS_PORT but does not listen on it" >&2; return 1; }
  echo "export SETTLE_SQS_ENDPOINT=http://127.0.0.1:$SQS_PORT" >"$ENV_DIR/elasticmq.env"
  echo "ElasticMQ ready on 127.0.0.1:$SQS_PORT"
}

print_usage() {
  cat <<MSG
Settle environment is up (state in $ENV_DIR):
$(sed -n 's/^export /  /p' "$ENV_FILE" | grep -vE 'SETTLE_(NATS_SERVER|HELM)=')
Use it in your shell with:
  source $ENV_FILE
  kubectl get --raw=/version
Stop it with: make env-down${SETTLE_ENV_DIR:+ (with SETTLE_ENV_DIR=$ENV_DIR)}
MSG
}

healthy() {
  local p
  for p in controlplane nats epmd rabbitmq elasticmq; do alive "$p" || return 1; done
  [ -f "$ENV_FILE" ] && api_ready
}
# The cluster's servers all run (a test stops one only for a moment, and starts it again).
cluster_alive() {
  local n
  for n in $CLUSTER_NODES; do alive "nats-cluster/$n" || return 1; done
}

BRIDGE_NOTE="10.244.0.1 (hack/node.sh)"
# The node, with `up --node`: started beside the other parts, its variables in settle.env.
start_node() { "$ROOT/hack/node.sh" up; }
write_env_file() {
  {
    echo "# Written by hack/env.sh up; source it to use the environment."
    for part in $PARTS; do cat "$ENV_DIR/$part.env"; done
    echo "export SETTLE_HELM=$("$ROOT/hack/tools.sh" path helm)"
  } >"$ENV_FILE"
}

up() {
  local flag
  for flag in "$@"; do
    case "$flag" in
      --node) PARTS="$PARTS node" ;;
      --nats-cluster) PARTS="$PARTS nats_cluster" ;;
      *) echo "usage: hack/env.sh up [--node] [--nats-cluster]" >&2; return 2 ;;
    esac
  done
  # A cluster started before stays part of the environment (its variables in settle.env).
  if [ -f "$ENV_DIR/nats_cluster.env" ] && [[ " $PARTS " != *" nats_cluster "* ]]; then
    PARTS="$PARTS nats_cluster"
  fi
  if healthy; then
    # Up already: add the node and the cluster when they are asked for and missing.
    case " $PARTS " in *" node "*) start_node; write_env_file ;; esac
    case " $PARTS " in *" nats_cluster "*)
      cluster_alive || { stop_nats_cluster; start_nats_cluster; }; write_env_file ;;
    esac
    print_usage; return 0
  fi
  down >/dev/null
  "$ROOT/hack/tools.sh" build
  mkdir -p "$ENV_DIR"
  local start=$SECONDS part pids=() failed=""
  echo "starting kube-apiserver+etcd, nats-server, RabbitMQ and ElasticMQ on 127.0.0.1"
  case " $PARTS " in *" node "*) echo "and a Kubernetes node on the bridge $BRIDGE_NOTE" ;; esac
  case " $PARTS " in *" nats_cluster "*) echo "and a JetStream cluster of three nats-servers" ;; esac
  # Side by side: together they take as long as the slowest, not the sum.
  for part in $PARTS; do
    ( set -e; t=$SECONDS; "start_$part"; echo "  ($part: $((SECONDS - t))s)" ) & pids+=($!)
  done
  local i=0
  for part in $PARTS; do
    wait "${pids[$i]}" || failed="$failed $part"
    i=$((i + 1))
  done
  if [ -n "$failed" ]; then
    echo "error: did not start:$failed (logs in $ENV_DIR); stopping the rest" >&2
    "$ROOT/hack/node.sh" down >/dev/null 2>&1 || true
    down_processes
    return 1
  fi
  write_env_file
  echo "environment ready in $((SECONDS - start))s"
  print_usage
}

# Stop every process of the environment, side by side. Its state is deleted next, so RabbitMQ
# gets 2 s to stop cleanly (it takes about 8 s on a busy machine), the others the usual 10 s.
down_processes() {
  local p pids=()
  for p in $PROCESSES; do
    case "$p" in
      epmd) continue ;;
      rabbitmq) stop_one "$p" 2 & pids+=($!) ;;
      *) stop_one "$p" & pids+=($!) ;;
    esac
  done
  [ ! -d "$(cluster_dir)" ] || { stop_nats_cluster & pids+=($!); }
  for p in "${pids[@]}"; do wait "$p" || true; done
  stop_one epmd   # last: the RabbitMQ node deregisters from it as it stops
}

down() {
  # The node first: its pods are torn down while its API server still runs.
  [ ! -d "$ENV_DIR/node" ] || "$ROOT/hack/node.sh" down
  down_processes
  rm -rf "$ENV_DIR"
  echo "Settle environment is down"
}

status() {
  local p
  for p in $PROCESSES; do
    if alive "$p"; then echo "$p: running (pid $(cat "$ENV_DIR/$p.pid"), log $ENV_DIR/$p.log)"
    elif [ "$p" != operator ]; then echo "$p: stopped"; fi
  done
  if [ -d "$(cluster_dir)" ]; then
    for p in $CLUSTER_NODES; do
      if alive "nats-cluster/$p"; then
        echo "nats-cluster/$p: running (pid $(cat "$(cluster_dir)/$p.pid"), log $(cluster_dir)/$p.log, config $(cluster_dir)/$p.conf)"
      else echo "nats-cluster/$p: stopped"; fi
    done
  fi
  [ ! -d "$ENV_DIR/node" ] || "$ROOT/hack/node.sh" status
  [ -f "$ENV_FILE" ] && sed -n 's/^export /  /p' "$ENV_FILE"
  return 0
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  status) status ;;
  *) echo "usage: hack/env.sh up [--node] [--nats-cluster] | down | status" >&2; exit 2 ;;
esac
