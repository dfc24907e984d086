#!/usr/bin/env bash
# A real single-node Kubernetes for the pod suite (crates/settle-e2e/tests/pods.rs), started by `hack/env.sh up
# --node` beside the other parts: containerd (its CRI, runc, the CNI bridge plugin), its own
# etcd + kube-apiserver bound to the bridge address, kube-controller-manager, kube-scheduler, a
# kubelet and kube-proxy (iptables), all upstream code (hack/tools.sh). It is separate from the
# environment's API server on 127.0.0.1, so the chart's cluster-wide webhook and operator never
# see the other suites' objects.
#   hack/node.sh up       start it (about 6 s), wait for the node to be Ready, write node.env
#   hack/node.sh down     stop it and put the host back as it was
#   hack/node.sh status   say what runs
#   hack/node.sh check    fail, naming it, if anything of a node is left on the host
# State: $SETTLE_ENV_DIR/node (default target/env/node); the variables: $SETTLE_ENV_DIR/node.env.
#
# Host-global, so one node per machine, guarded by the lock $NODE_LOCK: the bridge cni0 with
# 10.244.0.1/24, the route to the Service range 10.96.0.0/16, kube-proxy's and the kubelet's
# iptables chains, the sysctls the kubelet and the bridge plugin set, /var/lib/kubelet and
# /var/log/containers. `down` restores or removes each and says what it could not. Every
# listener is on 127.0.0.1 or the bridge address; pods get no default route and no DNS server
# (resolvConf ""), and the API server reaches the kubelet by its InternalIP: nothing is sent
# anywhere else and no name is looked up in the machine's resolver. Needs root (it is a node).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=hack/lib.sh
. "$ROOT/hack/lib.sh"
PARENT="${SETTLE_ENV_DIR:-$ROOT/target/env}"
ENV_DIR="$PARENT/node"            # pid files and logs (lib.sh), and all of the node's state
NODE_ENV="$PARENT/node.env"
NODE_LOCK="${SETTLE_NODE_LOCK:-/run/settle-node.lock}"
NODE_IP=10.244.0.1
POD_CIDR=10.244.0.0/24
SERVICE_CIDR=10.96.0.0/16
BRIDGE=cni0
NODE_NAME=settle-node
PAUSE_IMAGE=registry.local/settle-pause:1
COMPONENTS="kube-proxy kubelet kube-scheduler kube-controller-manager controlplane"
# What the kubelet sets at start (and the bridge plugin: ip_forward); `down` writes them back.
SYSCTLS="vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys kernel/keys/root_maxbytes net/ipv4/ip_forward"
# Host paths outside the state directory the kubelet makes (device-plugins is hard-coded, the
# container log links too); `down` removes those that were not there before `up`.
HOST_PATHS="/var/lib/kubelet /var/log/containers /var/log/pods"

kc() { echo "$ENV_DIR/cp/kubeconfig"; }
k() { kubectl --kubeconfig "$(kc)" --request-timeout=10s "$@"; }
ctr_() { "$(dirname "$("$ROOT/hack/tools.sh" path containerd)")/ctr" --address "$ENV_DIR/containerd/containerd.sock" -n k8s.io "$@"; }

# --- the lock: one node per machine --------------------------------------------------------
# A directory (mkdir is atomic) holding the state directory of the node that owns the host.
take_lock() {
  local owner
  if mkdir "$NODE_LOCK" 2>/dev/null; then echo "$ENV_DIR" >"$NODE_LOCK/owner"; return 0; fi
  owner="$(cat "$NODE_LOCK/owner" 2>/dev/null || true)"
  [ "$owner" = "$ENV_DIR" ] && return 0
  if [ -n "$owner" ] && [ -f "$owner/kubelet.pid" ] && group_running "$(cat "$owner/kubelet.pid")"; then
    echo "error: a Settle node already runs on this machine (state $owner); only one fits:" \
      "it owns the bridge $BRIDGE, $POD_CIDR and the host's iptables. Stop it first:" \
      "SETTLE_ENV_DIR=$(dirname "$owner") hack/env.sh down" >&2
    exit 1
  fi
  # The owner is gone without its `down` (a killed run): put the host back on its behalf.
  echo "a node that stopped without cleaning up held $NODE_LOCK (state ${owner:-unknown}); cleaning up after it"
  if [ -n "$owner" ] && [ -d "$owner" ]; then SETTLE_ENV_DIR="$(dirname "$owner")" "$0" down >/dev/null || true; fi
  rm -rf "$NODE_LOCK"
  mkdir "$NODE_LOCK" && echo "$ENV_DIR" >"$NODE_LOCK/owner"
}
release_lock() {
  [ "$(cat "$NODE_LOCK/owner" 2>/dev/null || true)" = "$ENV_DIR" ] && rm -rf "$NODE_LOCK"
  return 0
}

# --- configuration files ------------------------------------------------------------------
write_configs() {
  local s="$ENV_DIR" shim_dir
  shim_dir="$(dirname "$("$ROOT/hack/tools.sh" path containerd)")"
  mkdir -p "$s/containerd" "$s/cni/net.d" "$s/kubelet" "$s/pod-logs"
  cat >"$s/containerd/config.toml" <<TOML
# containerd $shim_dir (config version 3), written by hack/node.sh: its own root, state,
# socket and runc root; no metrics or debug listener.
version = 3
root = "$s/containerd/root"
state = "$s/containerd/state"
[grpc]
  address = "$s/containerd/containerd.sock"
[ttrpc]
  address = "$s/containerd/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins.'io.containerd.internal.v1.opt']
  path = "$s/containerd/opt"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "$PAUSE_IMAGE"
[plugins.'io.containerd.cri.v1.runtime']
  # The VMs of this machine kind drop CAP_SYS_RESOURCE: the kubelet's negative oom_score_adj
  # for the sandbox cannot be set, and runc fails every sandbox unless it is clamped.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$s/containerd/runc"
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$s/cni/net.d"
    max_conf_num = 1
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
TOML
  # The bridge is the pods' gateway and the host's address on it; pods get a route to the
  # Service range only (no default route, no masquerade): they reach the host and Services.
  cat >"$s/cni/net.d/10-settle.conflist" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "settle-node",
  "plugins": [
    {
      "type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
      "ipam": {
        "type": "host-local", "dataDir": "$s/cni/ipam",
        "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$NODE_IP"}]],
        "routes": [{"dst": "$SERVICE_CIDR"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
  read -r KUBELET_PORT KUBELET_HEALTHZ PROXY_HEALTHZ PROXY_METRICS KCM_PORT SCHED_PORT < <(free_ports 6)
  cat >"$s/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false            # this machine kind has cgroup v1; the kubelet refuses it by default
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$s/containerd/containerd.sock
address: $NODE_IP
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $s/cp/pki/ca.crt}
authorization: {mode: AlwaysAllow}
podLogsDir: $s/pod-logs
volumePluginDir: $s/kubelet/volume-plugins
resolvConf: ""                 # pods get no DNS server: nothing is looked up in the host's resolver
clusterDomain: cluster.local
failSwapOn: false
rotateCertificates: false
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "50Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
syncFrequency: 10s
nodeStatusUpdateFrequency: 5s
YAML
  cat >"$s/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection: {kubeconfig: $s/cp/kubeconfig}
hostnameOverride: $NODE_NAME
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:$PROXY_HEALTHZ
metricsBindAddress: 127.0.0.1:$PROXY_METRICS
clusterCIDR: $POD_CIDR
nodePortAddresses: ["$NODE_IP/32"]
# No conntrack sysctl writes and no route_localnet: the host's settings stay as they are.
conntrack: {maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
iptables: {localhostNodePorts: false, syncPeriod: 30s, minSyncPeriod: 1s}
YAML
}

# --- the pod sandbox image: hack/pause.c built static, packed as an OCI archive -------------
pause_image() {
  local d="$ENV_DIR/pause"
  need gcc "the C compiler builds the node's pause (Debian: apt-get install gcc libc6-dev)"
  mkdir -p "$d/rootfs"
  gcc -static -Os -s -o "$d/rootfs/pause" "$ROOT/hack/pause.c"
  python3 "$ROOT/hack/oci-image.py" --rootfs "$d/rootfs" --out "$d/pause.oci.tar" --name "$PAUSE_IMAGE" \
    --arch amd64 --epoch 0 --entrypoint '["/pause"]' --user 65535:65535 --created-by hack/node.sh
  ctr_ images import "$d/pause.oci.tar" >/dev/null
}

# --- up -----------------------------------------------------------------------------------
remember_host() {
  local p k
  [ -f "$ENV_DIR/host.sysctl" ] || for k in $SYSCTLS; do echo "$k $(cat "/proc/sys/$k")"; done >"$ENV_DIR/host.sysctl"
  [ -f "$ENV_DIR/host.paths" ] || for p in $HOST_PATHS; do [ -e "$p" ] || echo "$p"; done >"$ENV_DIR/host.paths"
}

bridge_up() {
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$NODE_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  # The host reaches ClusterIPs over the bridge (kube-proxy DNATs them), not its default route.
  ip route replace "$SERVICE_CIDR" dev "$BRIDGE" src "$NODE_IP"
}

containerd_ready() { ctr_ version >/dev/null 2>&1; }
api_ready() { [ -f "$(kc)" ] && k get --raw=/readyz >/dev/null 2>&1 && k get namespace default -o name >/dev/null 2>&1; }
launch_controlplane() {
  read -r API_PORT ETCD_PORT PEER_PORT < <(free_ports 3)
  rm -rf "$ENV_DIR/cp"; mkdir -p "$ENV_DIR/cp"
  spawn controlplane "$CP" -dir "$ENV_DIR/cp" -node-ip "$NODE_IP" \
    -apiserver-port "$API_PORT" -etcd-port "$ETCD_PORT" -etcd-peer-port "$PEER_PORT"
}
ports_controlplane() { echo "$API_PORT $ETCD_PORT $PEER_PORT"; }
node_ready() {
  [ "$(k get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}

up() {
  [ "$(id -u)" = 0 ] || { echo "error: the node needs root (a kubelet, a bridge, iptables); run as root or without --node" >&2; exit 1; }
  if healthy; then echo "Settle node $NODE_NAME is up (state $ENV_DIR)"; return 0; fi
  mkdir -p "$ENV_DIR"
  take_lock
  stop_parts
  local start=$SECONDS containerd shim_dir
  CP="$("$ROOT/hack/tools.sh" path controlplane)"
  containerd="$("$ROOT/hack/tools.sh" path containerd)"; shim_dir="$(dirname "$containerd")"
  for t in controlplane containerd runc cni-plugins iptables; do
    [ -x "$("$ROOT/hack/tools.sh" path "$t")" ] || { echo "error: $t is not installed; run hack/tools.sh build" >&2; exit 1; }
  done
  remember_host
  bridge_up
  write_configs
  # containerd finds its shim, then runc, on PATH.
  spawn containerd env PATH="$shim_dir:/usr/sbin:/usr/bin:/sbin:/bin" "$containerd" --config "$ENV_DIR/containerd/config.toml"
  wait_for containerd 30 containerd_ready
  pause_image
  start_retrying controlplane 180 launch_controlplane api_ready ports_controlplane
  local auth=(--kubeconfig="$(kc)" --authentication-kubeconfig="$(kc)" --authorization-kubeconfig="$(kc)")
  spawn kube-controller-manager "$CP" kube-controller-manager "${auth[@]}" \
    --bind-address=127.0.0.1 --secure-port="$KCM_PORT" --leader-elect=false --use-service-account-credentials=false \
    --root-ca-file="$ENV_DIR/cp/pki/ca.crt" --service-account-private-key-file="$ENV_DIR/cp/pki/sa.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" --v=1
  spawn kube-scheduler "$CP" kube-scheduler "${auth[@]}" \
    --bind-address=127.0.0.1 --secure-port="$SCHED_PORT" --leader-elect=false --v=1
  spawn kubelet env PATH="/usr/sbin:/usr/bin:/sbin:/bin" "$CP" kubelet --config="$ENV_DIR/kubelet.yaml" --kubeconfig="$(kc)" \
    --root-dir="$ENV_DIR/kubelet" --cert-dir="$ENV_DIR/kubelet/pki" \
    --node-ip="$NODE_IP" --hostname-override="$NODE_NAME" --v=1
  spawn kube-proxy env PATH="/usr/sbin:/usr/bin:/sbin:/bin" "$CP" kube-proxy --config="$ENV_DIR/kube-proxy.yaml" --v=1
  wait_for kubelet 120 node_ready
  wait_for kube-controller-manager 60 k -n default get serviceaccount default -o name >/dev/null
  cat >"$NODE_ENV" <<ENV
export SETTLE_NODE_KUBECONFIG=$(kc)
export SETTLE_NODE_IP=$NODE_IP
export SETTLE_NODE_NAME=$NODE_NAME
export SETTLE_NODE_CTR=$shim_dir/ctr
export SETTLE_NODE_CONTAINERD=$ENV_DIR/containerd/containerd.sock
ENV
  echo "Kubernetes node $NODE_NAME Ready in $((SECONDS - start))s (API https://$NODE_IP:$API_PORT, pods $POD_CIDR, Services $SERVICE_CIDR)"
}

healthy() {
  local p
  for p in containerd $COMPONENTS; do alive "$p" || return 1; done
  [ -f "$NODE_ENV" ] && api_ready && node_ready
}

# --- down ---------------------------------------------------------------------------------
stop_parts() {
  local c t
  if alive controlplane && api_ready; then
    # The kubelet tears the pods down (CNI DEL, unmounts) while everything still runs.
    k delete validatingwebhookconfiguration,mutatingwebhookconfiguration --all --wait=false >/dev/null 2>&1 || true
    k delete deploy,rs,sts,ds,job --all -A --wait=false >/dev/null 2>&1 || true
    k delete pod --all -A --grace-period=0 --force >/dev/null 2>&1 || true
    for _ in $(seq 1 40); do [ -z "$(ctr_ tasks ls -q 2>/dev/null)" ] && break; sleep 0.5; done
  fi
  for c in $COMPONENTS; do stop_one "$c"; done
  if alive containerd; then
    for t in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s KILL "$t" >/dev/null 2>&1 || true; done
    sleep 1
    for t in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks delete -f "$t" >/dev/null 2>&1 || true; done
  fi
  stop_one containerd
  # Shims outlive containerd by design; ours name our socket.
  pkill -KILL -f "containerd-shim-runc-v2 .*-address $ENV_DIR/containerd/containerd.sock" 2>/dev/null || true
}

restore_host() {
  local ipt tbl ch rule m n s
  # kube-proxy's chains (its own cleanup), then the kubelet's (KUBE-FIREWALL and its canaries),
  # which --cleanup leaves: drop the jumps to them, then flush and delete the chains.
  if [ -x "${CP:-}" ]; then "$CP" kube-proxy --cleanup >/dev/null 2>&1 || true; fi
  for ipt in iptables ip6tables; do
    command -v "$ipt" >/dev/null || continue
    for tbl in mangle nat filter; do
      "$ipt" -t "$tbl" -S 2>/dev/null | grep -E '^-A [A-Z]+ .*-j KUBE-' | grep -vE '^-A KUBE-' | sed 's/^-A //' |
        while read -r rule; do eval "$ipt -t $tbl -D $rule" 2>/dev/null || true; done || true
      for ch in $("$ipt" -t "$tbl" -S 2>/dev/null | awk '/^-N KUBE-/ {print $2}'); do "$ipt" -t "$tbl" -F "$ch" 2>/dev/null || true; done
      for ch in $("$ipt" -t "$tbl" -S 2>/dev/null | awk '/^-N KUBE-/ {print $2}'); do "$ipt" -t "$tbl" -X "$ch" 2>/dev/null || true; done
    done
  done
  { findmnt -rn -o TARGET | grep -F "$ENV_DIR/" | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done; } || true
  for n in /run/netns/cni-*; do [ ! -e "$n" ] || { umount "$n" 2>/dev/null || true; rm -f "$n"; }; done
  for s in /sys/fs/cgroup/*/kubepods; do [ ! -d "$s" ] || find "$s" -depth -type d -exec rmdir {} \; 2>/dev/null || true; done
  ip route del "$SERVICE_CIDR" dev "$BRIDGE" 2>/dev/null || true
  ip link del "$BRIDGE" 2>/dev/null || true
  for m in /var/log/containers/*.log; do
    [ ! -L "$m" ] || case "$(readlink "$m")" in "$ENV_DIR"/*) rm -f "$m" ;; esac
  done
  if [ -f "$ENV_DIR/host.sysctl" ]; then
    while read -r k v; do echo "$v" >"/proc/sys/$k" 2>/dev/null || echo "warning: could not restore $k to $v" >&2; done <"$ENV_DIR/host.sysctl"
    rm -f "$ENV_DIR/host.sysctl"
  fi
  if [ -f "$ENV_DIR/host.paths" ]; then
    while read -r p; do [ -n "$p" ] && rm -rf "$p"; done <"$ENV_DIR/host.paths"
    rm -f "$ENV_DIR/host.paths"
  fi
}

# What `down` must leave: nothing of the node on the host. Prints what is left and fails.
check_host() {
  local left=""
  ! ip link show "$BRIDGE" >/dev/null 2>&1 || left="$left the bridge $BRIDGE;"
  ! ip route show "$SERVICE_CIDR" 2>/dev/null | grep -q . || left="$left the route to $SERVICE_CIDR;"
  ! iptables-save 2>/dev/null | grep -q 'KUBE-' || left="$left KUBE-* iptables chains;"
  ! findmnt -rn -o TARGET | grep -qE "/kubelet/pods/|/run/netns/cni-|/containerd/.*/rootfs" || left="$left pod mounts;"
  ! compgen -G "/sys/fs/cgroup/*/kubepods" >/dev/null || left="$left kubepods cgroups;"
  ! compgen -G "/run/netns/cni-*" >/dev/null || left="$left pod network namespaces;"
  [ ! -e "$NODE_LOCK" ] || left="$left the lock $NODE_LOCK (owner $(cat "$NODE_LOCK/owner" 2>/dev/null));"
  [ -z "$left" ] && return 0
  echo "error: the host still has:$left" >&2
  return 1
}

down() {
  [ -d "$ENV_DIR" ] || { rm -f "$NODE_ENV"; return 0; }
  [ "$(id -u)" = 0 ] || { echo "error: stopping the node needs root" >&2; exit 1; }
  CP="$("$ROOT/hack/tools.sh" path controlplane 2>/dev/null || true)"
  stop_parts
  restore_host
  rm -f "$NODE_ENV"
  rm -rf "$ENV_DIR"
  release_lock
  check_host || return 1
  echo "Settle node is down; the host is as it was"
}

status() {
  local p
  for p in containerd $COMPONENTS; do
    if alive "$p"; then echo "node $p: running (pid $(cat "$ENV_DIR/$p.pid"), log $ENV_DIR/$p.log)"; else echo "node $p: stopped"; fi
  done
  return 0
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  check) check_host ;;
  *) echo "usage: hack/node.sh up|down|status|check" >&2; exit 2 ;;
esac
