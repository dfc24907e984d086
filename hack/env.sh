#!/usr/bin/env bash
# Starts and stops Settle's local environment of real parts, all on 127.0.0.1:
#   kube-apiserver + etcd (tests/controlplane) and nats-server with JetStream.
#   hack/env.sh up       build what is missing, start both, wait until ready, write $SETTLE_ENV_DIR/settle.env
#                        (default target/env/settle.env)
#   hack/env.sh down     stop both and remove their state
#   hack/env.sh status   say what runs
# `up` is idempotent: if the environment is already up and healthy it only prints how to use it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# SETTLE_ENV_DIR lets `make test` run its own environment beside a developer's `make env-up`.
ENV_DIR="${SETTLE_ENV_DIR:-$ROOT/target/env}"
ENV_FILE="$ENV_DIR/settle.env"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
alive() { [ -f "$ENV_DIR/$1.pid" ] && kill -0 "$(cat "$ENV_DIR/$1.pid")" 2>/dev/null; }

api_ready() { [ -f "$ENV_DIR/cp/kubeconfig" ] && kubectl --kubeconfig "$ENV_DIR/cp/kubeconfig" get --raw=/readyz >/dev/null 2>&1; }
nats_ready() {
  python3 - "$1" <<'PY'
import sys, urllib.request
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/healthz?js-enabled-only=true", timeout=2) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
PY
}

wait_for() { # NAME SECONDS CHECK...
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS
  until "$@"; do
    if ! alive "$name"; then
      echo "error: $name exited during start; last lines of $ENV_DIR/$name.log:" >&2
      tail -n 30 "$ENV_DIR/$name.log" >&2 || true
      return 1
    fi
    if (( SECONDS - start > limit )); then
      echo "error: $name not ready after ${limit}s; see $ENV_DIR/$name.log" >&2
      return 1
    fi
    sleep 0.5
  done
}

stop_one() {
  local name="$1"
  [ -f "$ENV_DIR/$name.pid" ] || return 0
  local pid; pid="$(cat "$ENV_DIR/$name.pid")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$ENV_DIR/$name.pid"
}

print_usage() {
  cat <<MSG
Settle environment is up (state in $ENV_DIR):
  $(grep -E '^export (KUBECONFIG|SETTLE_NATS_URL)=' "$ENV_FILE" | sed 's/^export //' | paste -sd' ')
Use it in your shell with:
  source $ENV_FILE
  kubectl get --raw=/version
Stop it with: make env-down${SETTLE_ENV_DIR:+ (with SETTLE_ENV_DIR=$ENV_DIR)}
MSG
}

up() {
  if alive controlplane && alive nats && [ -f "$ENV_FILE" ] && api_ready; then
    print_usage; return 0
  fi
  down >/dev/null
  "$ROOT/hack/tools.sh" build
  mkdir -p "$ENV_DIR/cp" "$ENV_DIR/nats"
  local cp nats api_port etcd_port peer_port nats_port mon_port
  cp="$("$ROOT/hack/tools.sh" path controlplane)"
  nats="$("$ROOT/hack/tools.sh" path nats-server)"
  api_port="$(free_port)"; etcd_port="$(free_port)"; peer_port="$(free_port)"
  nats_port="$(free_port)"; mon_port="$(free_port)"

  echo "starting kube-apiserver+etcd on 127.0.0.1:$api_port"
  setsid "$cp" -dir "$ENV_DIR/cp" -apiserver-port "$api_port" -etcd-port "$etcd_port" -etcd-peer-port "$peer_port" \
    >"$ENV_DIR/controlplane.log" 2>&1 </dev/null &
  echo $! >"$ENV_DIR/controlplane.pid"

  echo "starting nats-server (JetStream) on 127.0.0.1:$nats_port"
  setsid "$nats" -a 127.0.0.1 -p "$nats_port" -m "$mon_port" -js -sd "$ENV_DIR/nats" -n settle-test \
    >"$ENV_DIR/nats.log" 2>&1 </dev/null &
  echo $! >"$ENV_DIR/nats.pid"

  wait_for nats 30 nats_ready "$mon_port"
  wait_for controlplane 120 api_ready
  # The API server answers /readyz before its own bootstrap objects exist; wait for `default`.
  wait_for controlplane 60 kubectl --kubeconfig "$ENV_DIR/cp/kubeconfig" get namespace default -o name >/dev/null 2>&1

  cat >"$ENV_FILE" <<ENV
# Written by hack/env.sh up; source it to use the environment.
export KUBECONFIG=$ENV_DIR/cp/kubeconfig
export SETTLE_NATS_URL=nats://127.0.0.1:$nats_port
export SETTLE_NATS_MONITOR_URL=http://127.0.0.1:$mon_port
export SETTLE_NATS_SERVER=$nats
export SETTLE_HELM=$("$ROOT/hack/tools.sh" path helm)
ENV
  print_usage
}

down() {
  stop_one operator   # started by `make demo`
  stop_one controlplane
  stop_one nats
  rm -rf "$ENV_DIR"
  echo "Settle environment is down"
}

status() {
  for n in controlplane nats; do
    if alive "$n"; then echo "$n: running (pid $(cat "$ENV_DIR/$n.pid"))"; else echo "$n: stopped"; fi
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: hack/env.sh up|down|status" >&2; exit 2 ;;
esac
