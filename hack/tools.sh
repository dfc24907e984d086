#!/usr/bin/env bash
# Installs (once) and prints the paths of the real parts Settle's tests and demo run against,
# each pinned: kube-apiserver+etcd with the node's kubelet, kube-proxy, kube-controller-manager
# and kube-scheduler (one binary, hack/controlplane), containerd, nats-server, helm and
# kube-score (the chart's lint), promtool (checks and unit-tests the chart's alerts), built from
# Go modules and cached under target/tools/<name>-<version>/; ElasticMQ, its jars resolved from
# Maven Central into target/tools/elasticmq-<version>/; NACK's jetstream-controller (a test tool
# only, for crates/settle-operator/tests/nack_migration.rs: never in the image or the chart) from its module pinned in
# hack/nack/go.mod, with its CRDs (deploy/crds.yml of the same module) beside it; RabbitMQ,
# runc, the CNI plugins, iptables and shellcheck, Debian packages installed with apt-get when
# missing. Safe to run repeatedly; nothing finished is redone.
#   hack/tools.sh build [NAMES]  install whatever is missing (default: everything the tests need)
#   hack/tools.sh path NAME      print the program of NAME
#                                (controlplane|containerd|nats-server|helm|kube-score|promtool|rabbitmq|
#                                 elasticmq|runc|cni-plugins|iptables|shellcheck|nack|nack-crds)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=hack/lib.sh
. "$ROOT/hack/lib.sh"
CP_VERSION="$(cat "$ROOT/hack/controlplane/VERSION")"
NATS_VERSION="v2.15.3"
HELM_VERSION="v3.21.4"
KUBE_SCORE_VERSION="v1.20.0"
PROMTOOL_VERSION="v0.316.0"      # github.com/prometheus/prometheus (Prometheus 3.16)
ELASTICMQ_VERSION="1.6.11"       # org.elasticmq:elasticmq-server_2.13
RABBITMQ_SERIES="3.10"           # Debian bookworm's rabbitmq-server (3.10.8)
MAVEN_DEPENDENCY_PLUGIN="3.6.1"
TOOLS="${CARGO_TARGET_DIR:-$ROOT/target}/tools"

CONTAINERD_VERSION="v2.4.2"      # github.com/containerd/containerd/v2 (the CRI the node's kubelet runs pods on)
# NATS's own controller, which crates/settle-operator/tests/nack_migration.rs migrates from. The version is the one
# hack/nack/go.mod requires (its go.sum pins the rest); the proxy serves no version list for it,
# so it is built from that module, not with `go install ...@version`.
NACK_VERSION="$(awk '$1 == "require" && $2 == "github.com/nats-io/nack" {print $3}' "$ROOT/hack/nack/go.mod")"
nack_hash() { cat "$ROOT"/hack/nack/{go.mod,go.sum,tools.go} | sha256sum | cut -c1-12; }

cp_hash() { cat "$ROOT"/hack/controlplane/{VERSION,go.mod,go.sum,main.go,node.go} | sha256sum | cut -c1-12; }
# Stamp the release into the binary as upstream's hack/lib/version.sh does: unstamped, /version
# says v0.0.0-master, which kubectl cannot parse and Helm's kubeVersion checks read as 0.0.0.
cp_ldflags() {
  local v="$CP_VERSION" major minor p=k8s.io/component-base/version c=k8s.io/client-go/pkg/version
  major="${v#v}"; major="${major%%.*}"; minor="${v#v*.}"; minor="${minor%%.*}"
  echo "-s -w -X $p.gitVersion=$v -X $p.gitMajor=$major -X $p.gitMinor=$minor -X $p.gitTreeState=clean" \
    "-X $p.buildDate=1970-01-01T00:00:00Z -X $c.gitVersion=$v -X $c.gitMajor=$major -X $c.gitMinor=$minor"
}
path_of() {
  case "$1" in
    controlplane) echo "$TOOLS/controlplane-$CP_VERSION-$(cp_hash)/settle-controlplane" ;;
    containerd)   echo "$TOOLS/containerd-$CONTAINERD_VERSION/containerd" ;;
    # Debian packages the node runs pods with: the OCI runtime, the CNI plugins, iptables for
    # kube-proxy.
    runc)         echo "/usr/sbin/runc" ;;
    cni-plugins)  echo "/usr/lib/cni/bridge" ;;
    iptables)     echo "/usr/sbin/iptables" ;;
    nats-server)  echo "$TOOLS/nats-server-$NATS_VERSION/nats-server" ;;
    helm)         echo "$TOOLS/helm-$HELM_VERSION/helm" ;;
    kube-score)   echo "$TOOLS/kube-score-$KUBE_SCORE_VERSION/kube-score" ;;
    promtool)     echo "$TOOLS/promtool-$PROMTOOL_VERSION/promtool" ;;
    elasticmq)    echo "$TOOLS/elasticmq-$ELASTICMQ_VERSION/elasticmq-server" ;;
    # The package's own server script, run as the calling user; /usr/sbin/rabbitmq-server would
    # switch to the rabbitmq user and the system's configuration.
    rabbitmq)     echo "/usr/lib/rabbitmq/bin/rabbitmq-server" ;;
    shellcheck)   echo "/usr/bin/shellcheck" ;;
    nack)         echo "$TOOLS/nack-$NACK_VERSION-$(nack_hash)/jetstream-controller" ;;
    nack-crds)    echo "$TOOLS/nack-$NACK_VERSION-$(nack_hash)/crds.yml" ;;
    *) echo "unknown tool $1" >&2; exit 2 ;;
  esac
}

# Print a line every 30 s while a long build runs, so a cold CI log shows it is alive.
with_progress() {
  local what="$1"; shift
  local start=$SECONDS
  "$@" & local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 30 & wait $! || true
    kill -0 "$pid" 2>/dev/null && echo "  ... still installing $what ($((SECONDS - start))s)"
  done
  wait "$pid"
}

# apt_install PACKAGE...: install Debian packages, without letting their maintainer scripts start
# system services (a system-wide RabbitMQ and epmd would hold the default ports for good).
apt_install() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "error: $* missing and apt-get cannot install it here (needs root on Debian);" \
      "install it yourself: apt-get install $*" >&2
    exit 1
  fi
  local policy=/usr/sbin/policy-rc.d made_policy="" rc=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# written by settle hack/tools.sh during apt-get install\nexit 101\n' >"$policy"
    chmod 755 "$policy"; made_policy=1
  fi
  local apt=(apt-get -q -o DPkg::Lock::Timeout=600)
  # A fresh machine may have no package lists, or stale ones that name removed versions.
  if ! apt-cache show "$@" >/dev/null 2>&1; then "${apt[@]}" update -qq || rc=$?; fi
  if [ "$rc" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y --no-install-recommends "$@" >/dev/null || {
      "${apt[@]}" update -qq && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y --no-install-recommends "$@" >/dev/null
    } || rc=$?
  fi
  [ -n "$made_policy" ] && rm -f "$policy"
  [ "$rc" = 0 ] || { echo "error: apt-get install $* failed (see above)" >&2; exit 1; }
}

install_rabbitmq() {
  local version pids
  if ! [ -x "$(path_of rabbitmq)" ]; then
    echo "installing rabbitmq-server (Debian package, with Erlang) (first time only)"
    local start=$SECONDS
    with_progress "rabbitmq-server" apt_install rabbitmq-server
    # Should the package have started its service anyway (a policy-rc.d that was not honoured),
    # stop it: it runs as the rabbitmq user, which Settle's environments never do. Only right
    # after our own install: a system RabbitMQ someone runs on purpose is left alone.
    pids="$(pgrep -u rabbitmq 2>/dev/null || true)"
    if [ -n "$pids" ]; then
      echo "stopping the system RabbitMQ service the package started (pids $(echo "$pids" | paste -sd' '))"
      # shellcheck disable=SC2086 # one pid per word
      kill $pids 2>/dev/null || true
    fi
    echo "installed rabbitmq-server in $((SECONDS - start))s"
  fi
  version="$(dpkg-query -W -f='${Version}' rabbitmq-server 2>/dev/null || true)"
  case "$version" in
    "$RABBITMQ_SERIES".*) ;;
    *) echo "error: rabbitmq-server $RABBITMQ_SERIES.x expected, found '${version:-none}'" >&2; exit 1 ;;
  esac
}

install_elasticmq() {
  local out; out="$(path_of elasticmq)"
  [ -x "$out" ] && return 0
  if ! command -v java >/dev/null || ! command -v mvn >/dev/null; then
    apt_install openjdk-17-jre-headless maven
  fi
  local dir tmp start=$SECONDS
  dir="$(dirname "$out")"
  mkdir -p "$TOOLS"
  tmp="$(mktemp -d "$TOOLS/.build-XXXXXX")"
  echo "resolving ElasticMQ $ELASTICMQ_VERSION from Maven Central -> $dir (first time only)"
  cat >"$tmp/pom.xml" <<POM
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dev.settle.tools</groupId>
  <artifactId>elasticmq-classpath</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.elasticmq</groupId>
      <artifactId>elasticmq-server_2.13</artifactId>
      <version>$ELASTICMQ_VERSION</version>
    </dependency>
  </dependencies>
  <build><plugins><plugin>
    <groupId>org.apache.maven.plugins</groupId>
    <artifactId>maven-dependency-plugin</artifactId>
    <version>$MAVEN_DEPENDENCY_PLUGIN</version>
  </plugin></plugins></build>
</project>
POM
  if ! with_progress "ElasticMQ $ELASTICMQ_VERSION" mvn -q -B -f "$tmp/pom.xml" -l "$tmp/mvn.log" \
    dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$tmp/lib"; then
    cat "$tmp/mvn.log" >&2
    rm -rf "$tmp"
    echo "error: Maven could not resolve org.elasticmq:elasticmq-server_2.13:$ELASTICMQ_VERSION (above)" >&2
    exit 1
  fi
  local main
  main="$(python3 - "$tmp/lib/elasticmq-server_2.13-$ELASTICMQ_VERSION.jar" <<'PY'
import sys, zipfile
for line in zipfile.ZipFile(sys.argv[1]).read("META-INF/MANIFEST.MF").decode().splitlines():
    if line.startswith("Main-Class:"):
        print(line.split(":", 1)[1].strip())
PY
)"
  [ -n "$main" ] || { rm -rf "$tmp"; echo "error: no Main-Class in the elasticmq-server jar" >&2; exit 1; }
  cat >"$tmp/elasticmq-server" <<SH
#!/bin/sh
# ElasticMQ $ELASTICMQ_VERSION (written by hack/tools.sh). Pass JVM options such as -Dconfig.file=FILE.
exec java \${JAVA_OPTS:-} "\$@" -cp "\$(dirname "\$0")/lib/*" $main
SH
  chmod 755 "$tmp/elasticmq-server"
  rm -f "$tmp/pom.xml" "$tmp/mvn.log"
  chmod 755 "$tmp"
  rm -rf "$dir"
  mv "$tmp" "$dir"
  echo "resolved ElasticMQ ($(find "$dir/lib" -name '*.jar' | wc -l) jars) in $((SECONDS - start))s"
}

build_one() {
  local name="$1" out; out="$(path_of "$name")"
  case "$name" in
    rabbitmq) install_rabbitmq; return ;;
    elasticmq) install_elasticmq; return ;;
    shellcheck) [ -x "$out" ] || apt_install shellcheck; return ;;
    runc) [ -x "$out" ] || apt_install runc; return ;;
    cni-plugins) [ -x "$out" ] || apt_install containernetworking-plugins; return ;;
    iptables) [ -x "$out" ] || apt_install iptables; return ;;
    nack-crds) build_one nack; return ;;
  esac
  [ -x "$out" ] && return 0
  need go "install Go 1.26+"
  mkdir -p "$(dirname "$out")"
  local tmp; tmp="$(mktemp -d "$TOOLS/.build-XXXXXX")"
  echo "building $name -> $out (first time only)"
  local start=$SECONDS
  case "$name" in
    controlplane)
      (cd "$ROOT/hack/controlplane" && with_progress "kube-apiserver+etcd $CP_VERSION" \
        go build -trimpath -ldflags="$(cp_ldflags)" -o "$tmp/settle-controlplane" .) ;;
    containerd)
      # The shim beside containerd: the node puts this directory first in containerd's PATH.
      with_progress "containerd $CONTAINERD_VERSION" env GOBIN="$tmp" CGO_ENABLED=0 go install \
        "github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD_VERSION" \
        "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION" \
        "github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD_VERSION"
      mv "$tmp/containerd-shim-runc-v2" "$tmp/ctr" "$(dirname "$out")/" ;;
    nack)
      (cd "$ROOT/hack/nack" && with_progress "nack $NACK_VERSION" \
        go build -trimpath -ldflags="-s -w" -o "$tmp/jetstream-controller" github.com/nats-io/nack/cmd/jetstream-controller)
      # The CRDs of the same module, for the test's API server.
      install -m 0644 "$(cd "$ROOT/hack/nack" && go list -m -f '{{.Dir}}' github.com/nats-io/nack)/deploy/crds.yml" "$(dirname "$out")/crds.yml" ;;
    nats-server)
      with_progress "nats-server $NATS_VERSION" env GOBIN="$tmp" go install "github.com/nats-io/nats-server/v2@$NATS_VERSION" ;;
    helm)
      with_progress "helm $HELM_VERSION" env GOBIN="$tmp" go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" ;;
    kube-score)
      with_progress "kube-score $KUBE_SCORE_VERSION" env GOBIN="$tmp" go install "github.com/zegl/kube-score/cmd/kube-score@$KUBE_SCORE_VERSION" ;;
    promtool)
      # remove_all_sd leaves out the cloud service discoveries (AWS, Azure, GCE, ...), about a
      # fifth of the packages, which checking and unit-testing rules never use.
      with_progress "promtool $PROMTOOL_VERSION" env GOBIN="$tmp" go install -tags remove_all_sd "github.com/prometheus/prometheus/cmd/promtool@$PROMTOOL_VERSION" ;;
  esac
  mv "$tmp/$(basename "$out")" "$out"
  rm -rf "$tmp"
  echo "built $name in $((SECONDS - start))s"
}

case "${1:-build}" in
  build)
    names="${2:-rabbitmq runc cni-plugins iptables elasticmq nats-server helm kube-score promtool controlplane containerd nack}"
    for t in $names; do path_of "$t" >/dev/null; done   # unknown names fail here
    case " $names " in
      *" controlplane "*) need kubectl "the Kubernetes client; Debian: apt-get install kubectl, or see kubernetes.io" ;;
    esac
    mkdir -p "$TOOLS"
    # The downloads (apt, Maven) wait on the network and the Go builds on the CPU: run the
    # downloads beside the builds. Each group runs its own tools in order.
    pids=()
    for group in "rabbitmq runc cni-plugins iptables" "elasticmq" "nats-server helm kube-score promtool controlplane containerd nack nack-crds shellcheck"; do
      mine=""
      for t in $names; do case " $group " in *" $t "*) mine="$mine $t" ;; esac; done
      [ -n "$mine" ] || continue
      ( for t in $mine; do build_one "$t"; done ) & pids+=($!)
    done
    failed=0
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    exit "$failed" ;;
  path) path_of "$2" ;;
  *) echo "usage: hack/tools.sh build [NAMES] | path NAME" >&2; exit 2 ;;
esac
