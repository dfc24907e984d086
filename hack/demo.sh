#!/usr/bin/env bash
# `make demo`: the main job, locally, on real parts. Starts the environment (kube-apiserver+etcd,
# nats-server, RabbitMQ, ElasticMQ) on 127.0.0.1, installs Settle's CRDs, runs `settle operator`
# as a local process with its webhook registered by url:, shows what is admitted, refused and
# warned about, the JetStream consumers the operator makes from the Subscriptions (and makes
# again when one is deleted on the broker), then an application on the runtime consuming a few
# hundred orders (some declined until they run out of attempts) and the account in status:
# `kubectl get subscriptions`, `kubectl describe subscription orders`, the Exhausting condition;
# then the same application on an SQS Subscription, its counters next to the NATS one's, and both
# accounts in one table with `kubectl settle status`.
# Exits non-zero on any failure. Leaves the environment and the operator running so you can keep
# going; `make env-down` stops it all.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
# shellcheck source=hack/lib.sh
. "$ROOT/hack/lib.sh"
cargo build --quiet --bin settle --bin kubectl-settle --example account_app
hack/env.sh up >/dev/null
ENV_DIR="${SETTLE_ENV_DIR:-$ROOT/target/env}"
# shellcheck disable=SC1091
source "$ENV_DIR/settle.env"
NS=settle-demo
SETTLE="${CARGO_TARGET_DIR:-$ROOT/target}/debug/settle"
APP="${CARGO_TARGET_DIR:-$ROOT/target}/debug/examples/account_app"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
# js_api SUBJECT JSON: one JetStream API request over the plain NATS protocol (no CLI needed).
js_api() {
  python3 - "$SETTLE_NATS_URL" "$1" "$2" <<'PY'
import json, socket, sys
url, subject, body = sys.argv[1], sys.argv[2], sys.argv[3].encode()
host, port = url.split("//")[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)), timeout=5)
f = s.makefile("rb")
f.readline()  # INFO
s.sendall(b'CONNECT {"verbose":false}\r\nSUB _INBOX.demo 1\r\nPUB $JS.API.' + subject.encode()
          + b" _INBOX.demo %d\r\n" % len(body) + body + b"\r\n")
while True:
    line = f.readline()
    if line.startswith(b"PING"):
        s.sendall(b"PONG\r\n")
    elif line.startswith(b"MSG"):
        reply = json.loads(f.read(int(line.split()[-1]) + 2))
        err = reply.get("error")
        print(f"  {subject}: " + (f"error {err.get('description')}" if err else "ok"))
        break
PY
}
# consumers: the consumers nats-server holds, from its monitoring endpoint.
consumers() {
  python3 - "$SETTLE_NATS_MONITOR_URL" <<'PY'
import json, sys, urllib.request
jsz = json.load(urllib.request.urlopen(sys.argv[1] + "/jsz?consumers=true&config=true"))
print("  %-10s %-28s %-9s %-11s %s" % ("STREAM", "CONSUMER", "ACK", "MAXDELIVER", "CREATED"))
for acc in jsz.get("account_details", []):
    for st in acc.get("stream_detail", []):
        if st["name"] != "DEMO":
            continue
        for c in st.get("consumer_detail", []):
            cfg = c.get("config", {})
            print("  %-10s %-28s %-9s %-11s %s" % (st["name"], c["name"], cfg.get("ack_policy"), cfg.get("max_deliver"), c["created"][:23]))
PY
}

step "Install the CRDs (generated from the Rust types)"
"$SETTLE" crds | kubectl apply --server-side --force-conflicts -f -
# Polled: `kubectl wait --for=condition` fails at once ("accessor error: <nil>") on a CRD created
# a moment ago whose conditions are still null.
established() {
  [ "$(kubectl get "crd/$1" -o 'jsonpath={.status.conditions[?(@.type=="Established")].status}')" = True ]
}
for crd in subscriptions.messaging.settle.dev backends.messaging.settle.dev; do
  for _ in $(seq 1 120); do established "$crd" && break; sleep 0.5; done
  established "$crd" || { echo "error: CRD $crd is not Established after 60s" >&2; exit 1; }
done

step "Start settle operator; the API server reaches its webhook by url:"
stop_one operator
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
# The webhook's URL names the operator's port, so each start registers the port it was given.
launch_operator() {
  read -r WEBHOOK_PORT METRICS_PORT < <(free_ports 2)
  kubectl apply -f - >/dev/null <<YAML
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata: {name: settle}
webhooks:
  - name: subscriptions.messaging.settle.dev
    admissionReviewVersions: ["v1"]
    sideEffects: None
    failurePolicy: Fail
    timeoutSeconds: 5
    # Only the demo's namespace: a stopped demo operator must not block Subscriptions elsewhere.
    namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: $NS}}
    rules: [{apiGroups: [messaging.settle.dev], apiVersions: [v1alpha1], operations: [CREATE, UPDATE], resources: [subscriptions]}]
    clientConfig: {url: "https://127.0.0.1:$WEBHOOK_PORT/validate"}
YAML
  # --stats-interval 2s: the account reaches status within seconds here (10s by default).
  # --shutdown-delay 0s: one local process behind a url:, no Service to leave before it stops.
  spawn operator "$SETTLE" operator --log-format text --namespace "$NS" --watch-namespaces "$NS" --webhook-configuration settle \
    --webhook-ips 127.0.0.1 --webhook-addr "127.0.0.1:$WEBHOOK_PORT" --metrics-addr "127.0.0.1:$METRICS_PORT" --probe-addr 127.0.0.1:0 --stats-interval 2s \
    --shutdown-delay 0s
}
operator_ready() { http_ok "http://127.0.0.1:$METRICS_PORT/readyz"; }
operator_ports() { echo "$WEBHOOK_PORT $METRICS_PORT"; }
start_retrying operator 60 launch_operator operator_ready operator_ports
echo "operator ready: webhook https://127.0.0.1:$WEBHOOK_PORT/validate, metrics http://127.0.0.1:$METRICS_PORT/metrics (log: $ENV_DIR/operator.log)"

step "A stream for the samples' subjects (the platform's job; Settle makes consumers, never streams)"
js_api STREAM.CREATE.DEMO '{"name":"DEMO","subjects":["orders.>","metrics.*","reports.generate","images.uploaded"],"storage":"file"}'

step "Apply the samples: all admitted; the nats Backend pointed at the local nats-server"
# The sample's server is set before the apply, never patched after it: the operator would have
# looked its name (nats.messaging) up in the machine's resolver in between.
kubectl kustomize config/samples/ | sed "s|nats://nats.messaging:4222|$SETTLE_NATS_URL|" | kubectl apply -n "$NS" -f -

step "The operator connects to the Backend and makes a consumer for each Subscription"
kubectl wait -n "$NS" --for=condition=Ready --timeout=60s backend/nats subscription/orders subscription/metrics subscription/reports
kubectl get backends,subscriptions -n "$NS"
echo "The consumers, listed from NATS:"
consumers

step "A consumer deleted on the broker is made again within about a second"
js_api CONSUMER.DELETE.DEMO.orders '{}'
sleep 1
consumers
kubectl get events -n "$NS" --field-selector involvedObject.name=orders -o custom-columns=REASON:.reason,MESSAGE:.message | tail -n 3

step "AtLeastOnce without durableName: refused, naming the field and the fix"
kubectl apply -n "$NS" -f - <<'YAML' || true
apiVersion: messaging.settle.dev/v1alpha1
kind: Subscription
metadata: {name: payments}
spec:
  backendRef: {name: nats}
  pattern: "payments.>"
  mode: AtLeastOnce
  maxDeliver: 5
YAML

step "Changing the mode of an existing Subscription: refused (the broker cannot change it in place)"
kubectl patch subscription metrics -n "$NS" --type=merge -p '{"spec":{"mode":"AtLeastOnce","durableName":"metrics"}}' || true

step "Redeliver without ackWait: admitted, with a warning"
kubectl delete subscription thumbnails -n "$NS" --ignore-not-found >/dev/null
kubectl apply -n "$NS" -f - <<'YAML'
apiVersion: messaging.settle.dev/v1alpha1
kind: Subscription
metadata: {name: thumbnails}
spec:
  backendRef: {name: nats}
  pattern: "images.uploaded"
  mode: AtLeastOnce
  durableName: thumbnails
  slowHandler: Redeliver
YAML

step "A malformed duration never reaches the webhook: the API server's own CEL check refuses it"
kubectl apply -n "$NS" -f - <<'YAML' || true
apiVersion: messaging.settle.dev/v1alpha1
kind: Subscription
metadata: {name: typo}
spec:
  backendRef: {name: nats}
  pattern: "orders.>"
  ackWait: 30 seconds
YAML

step "The same rules offline, for CI: settle check (against RabbitMQ, which cannot delay a redelivery)"
"$SETTLE" check -f config/samples --backend-kind rabbitmq || true

step "An application on the runtime consumes orders from the operator's consumer"
# The handler acks orders, declines a body containing "bad" (back with the backoff, until
# maxDeliver 5 is spent: Exhausted), and returns once without settling on "slow" (Silent).
kubectl patch subscription orders -n "$NS" --type=merge \
  -p '{"spec":{"backoff":{"initial":"200ms","max":"1s","multiplier":2}}}' >/dev/null
kubectl wait -n "$NS" --for=condition=Ready --timeout=60s subscription/orders >/dev/null
kubectl get subscription orders -n "$NS" -o yaml >"$ENV_DIR/demo-orders.yaml"
stop_one demo-app
SETTLE_NATS_URL="$SETTLE_NATS_URL" SETTLE_SUBSCRIPTION_FILE="$ENV_DIR/demo-orders.yaml" \
  SETTLE_APP_HANDLER=demo SETTLE_REPORT_INTERVAL=500ms spawn demo-app "$APP"
wait_for demo-app 60 grep -q '^ready' "$ENV_DIR/demo-app.log"
echo "application running (log: $ENV_DIR/demo-app.log)"

step "Publish 300 orders: 20 bad ones, 10 slow ones"
python3 - "$SETTLE_NATS_URL" <<'PY'
import socket, sys
host, port = sys.argv[1].split("//")[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)), timeout=5)
f = s.makefile("rb")
f.readline()  # INFO
out = [b'CONNECT {"verbose":false}\r\n']
for i in range(1, 301):
    body = (b"bad order %d" % i) if i % 15 == 0 else (b"slow order %d" % i) if i % 30 == 1 else (b'{"id": %d}' % i)
    out.append(b"PUB orders.%d %d\r\n%s\r\n" % (i, len(body), body))
out.append(b"PING\r\n")
s.sendall(b"".join(out))
while not f.readline().startswith(b"PONG"):
    pass
print("  published 300 orders on orders.<n>")
PY

step "The account reaches status (written at most every --stats-interval, only on change)"
expect_exhausted=20
for i in $(seq 1 120); do
  got="$(kubectl get subscription orders -n "$NS" -o jsonpath='{.status.stats.exhausted}/{.status.stats.settlement.acked}/{.status.stats.settlement.silent}/{.status.stats.settlement.nacked}')"
  printf '  %3ss exhausted/acked/silent/nacked: %s\n' "$i" "${got:-none yet}"
  [ "$got" = "$expect_exhausted/280/10/100" ] && break
  [ "$i" = 120 ] && { echo "error: the account did not reach 20 exhausted, 280 acked, 10 silent, 100 nacked in 120 s (operator log: $ENV_DIR/operator.log)" >&2; exit 1; }
  sleep 1
done
kubectl get subscriptions -n "$NS"
kubectl describe subscription orders -n "$NS" | sed -n '/^Status:/,/^Events:/p'
stop_one demo-app

step "The same account on SQS (ElasticMQ): a Subscription invoices, the same application, 30 invoices (3 bad, 3 slow)"
# The operator makes the queue, its dead-letter queue and the account's report and ledger queues;
# the application reports to the report queue, the operator counts what the redrive moves to the
# dead-letter queue too (without taking it).
# A queue prefix of this run's own: an earlier run's dead-letter queue is kept (it holds messages).
kubectl delete subscription invoices -n "$NS" --ignore-not-found --timeout=60s >/dev/null
kubectl create secret generic demo-aws -n "$NS" --from-literal=accessKeyId=demo --from-literal=secretAccessKey=demo \
  --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl label secret demo-aws -n "$NS" settle.dev/backend-credentials=true --overwrite >/dev/null
kubectl apply -n "$NS" -f - <<YAML
apiVersion: messaging.settle.dev/v1alpha1
kind: Backend
metadata: {name: sqs}
spec:
  sqs:
    region: elasticmq
    endpoint: "$SETTLE_SQS_ENDPOINT"
    queuePrefix: "settle-demo-$$-"
    credentialsSecretRef: {name: demo-aws}
---
apiVersion: messaging.settle.dev/v1alpha1
kind: Subscription
metadata: {name: invoices}
spec:
  backendRef: {name: sqs}
  pattern: invoices
  mode: AtLeastOnce
  durableName: invoices
  maxDeliver: 3
  ackWait: 5s
YAML
kubectl wait -n "$NS" --for=condition=Ready --timeout=60s backend/sqs subscription/invoices >/dev/null
kubectl get subscription invoices -n "$NS" -o yaml >"$ENV_DIR/demo-invoices.yaml"
stop_one demo-sqs-app

SETTLE_SQS_ENDPOINT="$SETTLE_SQS_ENDPOINT" SETTLE_SQS_QUEUE_PREFIX="settle-demo-$$-" \
  SETTLE_SUBSCRIPTION_FILE="$ENV_DIR/demo-invoices.yaml" SETTLE_APP_HANDLER=demo SETTLE_REPORT_INTERVAL=500ms \
  spawn demo-sqs-app env -u SETTLE_NATS_URL -u SETTLE_RABBITMQ_URL "$APP"
wait_for demo-sqs-app 60 grep -q '^ready' "$ENV_DIR/demo-sqs-app.log"
python3 - "$SETTLE_SQS_ENDPOINT" "settle-demo-$$-invoices" <<'PY'
import sys, urllib.parse, urllib.request
endpoint, queue = sys.argv[1], sys.argv[2]
def call(url, **params):
    data = urllib.parse.urlencode(params).encode()
    return urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=10).read().decode()
answer = call(endpoint, Action="GetQueueUrl", QueueName=queue)
url = answer.split("<QueueUrl>")[1].split("</QueueUrl>")[0]
for i in range(1, 31):
    body = f"bad invoice {i}" if i % 10 == 0 else f"slow invoice {i}" if i % 10 == 5 else '{"invoice": %d}' % i
    call(url, Action="SendMessage", MessageBody=body)
print("  sent 30 invoices to SQS queue " + queue)
PY
for i in $(seq 1 120); do
  got="$(kubectl get subscription invoices -n "$NS" -o jsonpath='{.status.stats.exhausted}/{.status.stats.settlement.acked}/{.status.stats.settlement.silent}/{.status.stats.settlement.nacked}')"
  printf '  %3ss invoices exhausted/acked/silent/nacked: %s\n' "$i" "${got:-none yet}"
  [ "$got" = "3/27/3/9" ] && break
  [ "$i" = 120 ] && { echo "error: the SQS account did not reach 3 exhausted, 27 acked, 3 silent, 9 nacked in 120 s (operator log: $ENV_DIR/operator.log)" >&2; exit 1; }
  sleep 1
done
echo "The NATS and the SQS Subscription side by side:"
kubectl get subscriptions orders invoices -n "$NS"
kubectl describe subscription invoices -n "$NS" | sed -n '/^Status:/,/^Events:/p'
stop_one demo-sqs-app

step "The whole account in one command: kubectl settle status (the plugin, found on PATH)"
PATH="${CARGO_TARGET_DIR:-$ROOT/target}/debug:$PATH" kubectl settle status -n "$NS"

step "The same account at full resolution on /metrics, with admission and reconcile counters"
python3 -c "import urllib.request; print(''.join(l for l in urllib.request.urlopen('http://127.0.0.1:$METRICS_PORT/metrics').read().decode().splitlines(True) if l.startswith(('settle_admission_requests_total', 'settle_reconcile_total', 'settle_consumer_operations_total', 'settle_status_writes_total', 'settle_subscription_exhausted_total', 'settle_subscription_acked_total', 'settle_subscription_nacked_total', 'settle_subscription_exhausting', 'settle_account_status_writes_total'))))"

step "Done. Still running: kube-apiserver+etcd, nats-server, RabbitMQ, ElasticMQ and settle operator (log: $ENV_DIR/operator.log)"
echo "  source $ENV_DIR/settle.env && kubectl get subscriptions -A"
echo "  RabbitMQ: $SETTLE_RABBITMQ_URL (management $SETTLE_RABBITMQ_MANAGEMENT_URL, guest/guest)"
echo "  SQS (ElasticMQ): $SETTLE_SQS_ENDPOINT"
echo "  make env-down    # stops the operator, kube-apiserver+etcd, nats-server, RabbitMQ and ElasticMQ"
