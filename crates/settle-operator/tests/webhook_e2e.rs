//! Admission through the real API server: `settle operator` runs as a local process, makes its
//! own CA, patches the caBundle of a ValidatingWebhookConfiguration that reaches it by `url:`,
//! and a table of manifests goes through real `kubectl apply` (and `--dry-run=server`). Then the
//! webhook goes down and the API server fails closed for Settle's resources only. And the webhook
//! never blocks a cleanup (A14): a Subscription that no longer passes, with the controllers
//! running, still takes its finalizer and labels, and is deleted, alone and with its namespace.
//! The shipped MutatingWebhookConfiguration is registered too: a Subscription is stored with the
//! operator's finalizer already on, though no controller runs for it.

use settle_testkit as common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, install_crds, kubectl, kubectl_ok};

const WEBHOOK: &str = "subscriptions.messaging.settle.dev";

/// The operator process; killed when dropped, so a failed assertion leaves nothing running.
struct Operator {
    child: Child,
    metrics_port: u16,
}

impl Operator {
    fn start(webhook_port: u16, secret_ns: &str, configuration: &str) -> Operator {
        let env = common::env();
        let metrics_port = free_port();
        let log = std::fs::File::create(
            common::root().join(format!("target/webhook-e2e-operator-{webhook_port}.log")),
        )
        .expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_settle"))
            .args(["operator", "--log-format", "text"])
            .args(["--webhook-addr", &format!("127.0.0.1:{webhook_port}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--probe-addr", "127.0.0.1:0"])
            .args([
                "--namespace",
                secret_ns,
                "--webhook-secret",
                "settle-e2e-tls",
            ])
            .args([
                "--webhook-configuration",
                configuration,
                "--webhook-ips",
                "127.0.0.1",
            ])
            // Admission only: its controllers watch a namespace that does not exist, so the
            // Backend status this test writes by hand stays as written and no other test's
            // objects are touched.
            .args(["--watch-namespaces", &format!("{secret_ns}-no-controllers")])
            // The table's sqs Backend has no Secret: pod identity is allowed here (A20).
            .args(["--sqs-pod-identity-namespaces", secret_ns])
            .env("KUBECONFIG", &env.kubeconfig)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start settle operator");
        let op = Operator {
            child,
            metrics_port,
        };
        op.wait_ready();
        op
    }

    fn get(&self, path: &str) -> Option<String> {
        common::http_get(self.metrics_port, path)
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if self
                .get("/readyz")
                .is_some_and(|r| r.starts_with("HTTP/1.1 200"))
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("settle operator not ready after 30s; see target/webhook-e2e-operator-*.log");
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// config/webhook/validating-webhook.yaml, asserted as shipped, then changed only where a test
/// must: clientConfig (a `url:` to this process, at the shipped path), the namespace selector
/// (this test's namespace) and the name (one of this test's own).
fn shipped_configuration(name: &str, port: u16) -> serde_json::Value {
    let vwc = common::install::shipped_webhook_configuration();
    common::install::assert_settle_webhook("config/webhook/validating-webhook.yaml", &vwc);
    let pid = std::process::id().to_string();
    common::install::by_url(vwc, name, port, "settle.dev/webhook-e2e", &pid)
}

/// config/webhook/mutating-webhook.yaml, asserted as shipped, then changed as
/// [`shipped_configuration`] changes the validating one.
fn shipped_mutating_configuration(name: &str, port: u16) -> serde_json::Value {
    let mwc = common::install::shipped_mutating_configuration();
    common::install::assert_settle_mutating_webhook("config/webhook/mutating-webhook.yaml", &mwc);
    let pid = std::process::id().to_string();
    common::install::by_url(mwc, name, port, "settle.dev/webhook-e2e", &pid)
}

/// What the API server must answer.
enum Want {
    Allowed(&'static [&'static str]),
    Denied(&'static str, &'static [&'static str]),
}

struct Row {
    name: &'static str,
    /// The spec (indented two spaces) of Subscription `name`.
    spec: &'static str,
    /// For updates: the spec stored first.
    before: Option<&'static str>,
    want: Want,
}

fn manifest(name: &str, spec: &str) -> String {
    format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: {name}}}\nspec:\n{spec}"
    )
}

fn rows() -> Vec<Row> {
    use Want::*;
    vec![
        Row {
            name: "amo-default",
            spec: "  backendRef: {name: nats}\n  pattern: a.>\n",
            before: None,
            want: Allowed(&[]),
        },
        Row {
            name: "alo-full",
            spec: "  backendRef: {name: nats}\n  pattern: orders.>\n  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 5\n  backoff: {initial: 1s, max: 1m, multiplier: 2}\n  maxNackDelay: 10m\n  ackWait: 30s\n  maxProcessingTime: 5m\n  maxInFlight: 250\n",
            before: None,
            want: Allowed(&[]),
        },
        Row {
            name: "alo-no-durable",
            spec: "  backendRef: {name: nats}\n  pattern: a.>\n  mode: AtLeastOnce\n",
            before: None,
            want: Denied(
                "spec.durableName: required under mode AtLeastOnce, on every backend: set spec.durableName to a stable name (for example the Subscription's name) so redeliveries survive a restart",
                &[],
            ),
        },
        Row {
            name: "amo-backoff",
            spec: "  backendRef: {name: nats}\n  pattern: a.>\n  backoff: {initial: 1s, max: 1m}\n",
            before: None,
            want: Denied(
                "spec.backoff: not allowed under mode AtMostOnce, where nothing comes back: remove spec.backoff, or set spec.mode: AtLeastOnce",
                &[],
            ),
        },
        Row {
            name: "amo-max-nack-delay",
            spec: "  backendRef: {name: nats}\n  pattern: a.>\n  maxNackDelay: 1m\n",
            before: None,
            want: Denied(
                "spec.maxNackDelay: not allowed under mode AtMostOnce, where nothing comes back: remove spec.maxNackDelay, or set spec.mode: AtLeastOnce",
                &[],
            ),
        },
        Row {
            name: "amo-no-effect",
            spec: "  backendRef: {name: nats}\n  pattern: a.>\n  maxDeliver: 3\n  ackWait: 10s\n",
            before: None,
            want: Allowed(&[
                "spec.maxDeliver: has no effect under mode AtMostOnce (nothing is acknowledged or redelivered); remove it, or set spec.mode: AtLeastOnce",
                "spec.ackWait: has no effect under mode AtMostOnce (nothing is acknowledged or redelivered); remove it, or set spec.mode: AtLeastOnce",
            ]),
        },
        Row {
            name: "backoff-rabbitmq",
            spec: "  backendRef: {name: rabbit}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: d\n  backoff: {initial: 1s, max: 1m}\n",
            before: None,
            want: Denied(
                "spec.backoff: this backend cannot delay a redelivery (it does not declare delaysRedelivery): remove the field, or use a backend that can, such as nats",
                &[],
            ),
        },
        Row {
            name: "maxinflight-rabbitmq",
            spec: "  backendRef: {name: rabbit}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: d\n  maxInFlight: 70000\n",
            before: None,
            want: Denied(
                "spec.maxInFlight: 70000 is more than this backend can hold unsettled per consumer (65535): set it to 65535 or less",
                &[],
            ),
        },
        Row {
            name: "stream-rabbitmq",
            spec: "  backendRef: {name: rabbit}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: d\n  stream: ORDERS\n",
            before: None,
            want: Denied(
                "spec.stream: \"ORDERS\" names a JetStream stream, and this backend has no named streams (it does not declare namedStreams): its queue is the Subscription's own (on RabbitMQ bound to the Backend's exchange by spec.pattern, on SQS named by spec.durableName). Remove spec.stream",
                &[],
            ),
        },
        Row {
            name: "stream-sqs",
            spec: "  backendRef: {name: sqs}\n  pattern: jobs\n  mode: AtLeastOnce\n  durableName: jobs\n  stream: ORDERS\n",
            before: None,
            want: Denied(
                "spec.stream: \"ORDERS\" names a JetStream stream, and this backend has no named streams (it does not declare namedStreams): its queue is the Subscription's own (on RabbitMQ bound to the Backend's exchange by spec.pattern, on SQS named by spec.durableName). Remove spec.stream",
                &[],
            ),
        },
        Row {
            name: "backoff-nodelay",
            spec: "  backendRef: {name: nodelay}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: d\n  backoff: {initial: 1s, max: 1m}\n",
            before: None,
            want: Denied(
                "spec.backoff: this backend cannot delay a redelivery (it does not declare delaysRedelivery): remove the field, or use a backend that can, such as nats",
                &[],
            ),
        },
        Row {
            name: "nack-delay-limited",
            spec: "  backendRef: {name: limited}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: d\n  maxNackDelay: 2m\n",
            before: None,
            want: Denied(
                "spec.maxNackDelay: 2m0s is longer than this backend can hold a message back (1m0s): set it to 1m0s or less",
                &[],
            ),
        },
        Row {
            name: "backoff-limited",
            spec: "  backendRef: {name: limited}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: d\n  backoff: {initial: 1s, max: 5m}\n",
            before: None,
            want: Denied(
                "spec.backoff.max: 5m0s is longer than this backend can hold a message back (1m0s): set it to 1m0s or less",
                &[],
            ),
        },
        Row {
            name: "backoff-within-limit",
            spec: "  backendRef: {name: limited}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: d\n  maxDeliver: 3\n  backoff: {initial: 1s, max: 1m}\n",
            before: None,
            want: Allowed(&[]),
        },
        Row {
            name: "backoff-inverted",
            spec: "  backendRef: {name: nats}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: d\n  backoff: {initial: 1m, max: 1s}\n",
            before: None,
            want: Denied(
                "spec.backoff.max: 1s is shorter than spec.backoff.initial 1m0s: set max to at least initial",
                &[],
            ),
        },
        Row {
            name: "backoff-shrinking",
            spec: "  backendRef: {name: nats}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: d\n  backoff: {initial: 1s, max: 1m, multiplier: 0.5}\n",
            before: None,
            want: Denied(
                "spec.backoff.multiplier: 0.5 is below 1: a multiplier of at least 1 keeps waits from shrinking; use 2 to double each wait",
                &[],
            ),
        },
        Row {
            name: "redeliver-no-ackwait",
            spec: "  backendRef: {name: nats}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: d\n  slowHandler: Redeliver\n",
            before: None,
            want: Allowed(&[
                "spec.ackWait: slowHandler Redeliver without an explicit ackWait: under Redeliver, ackWait is a correctness setting; set it longer than your slowest handler run, or duplicate work is routine",
            ]),
        },
        Row {
            name: "redeliver-ackwait",
            spec: "  backendRef: {name: nats}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: d\n  slowHandler: Redeliver\n  ackWait: 10m\n",
            before: None,
            want: Allowed(&[]),
        },
        Row {
            name: "missing-backend",
            spec: "  backendRef: {name: later}\n  pattern: a.>\n",
            before: None,
            want: Allowed(&[
                "spec.backendRef.name: Backend \"later\" does not exist in this namespace yet; the Subscription is admitted, its capability checks run when the Backend exists, and until then it is not Ready",
            ]),
        },
        Row {
            name: "memory-alo",
            spec: "  backendRef: {name: memory}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: m\n  backoff: {initial: 100ms, max: 1s}\n",
            before: None,
            want: Allowed(&[]),
        },
        Row {
            name: "two-errors",
            spec: "  backendRef: {name: nodelay}\n  pattern: a.>\n  mode: AtLeastOnce\n  maxNackDelay: 1m\n",
            before: None,
            want: Denied(
                "spec.durableName: required under mode AtLeastOnce, on every backend: set spec.durableName to a stable name (for example the Subscription's name) so redeliveries survive a restart; spec.maxNackDelay: this backend cannot delay a redelivery (it does not declare delaysRedelivery): remove the field, or use a backend that can, such as nats",
                &[],
            ),
        },
        // ---- updates
        Row {
            name: "upd-maxdeliver-rabbitmq",
            before: Some(
                "  backendRef: {name: rabbit}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: q\n  maxDeliver: 3\n",
            ),
            spec: "  backendRef: {name: rabbit}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: q\n  maxDeliver: 5\n",
            want: Denied(
                "spec.maxDeliver: cannot change from 3 to 5 on this backend: a RabbitMQ quorum queue's delivery limit (x-delivery-limit) is fixed when the queue is made. Keep maxDeliver, or delete this Subscription and create it again with the new value (its queue and the messages in it go with it)",
                &[],
            ),
        },
        Row {
            name: "upd-mode",
            before: Some("  backendRef: {name: nats}\n  pattern: a.>\n  durableName: u\n"),
            spec: "  backendRef: {name: nats}\n  pattern: a.>\n  durableName: u\n  mode: AtLeastOnce\n",
            want: Denied(
                "spec.mode: cannot change from AtMostOnce to AtLeastOnce: the broker cannot change a consumer's ack policy in place. Delete this Subscription and create it again with the new value (its consumer and unsettled deliveries go with it)",
                &[],
            ),
        },
        Row {
            name: "upd-durable",
            before: Some(
                "  backendRef: {name: nats}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: one\n",
            ),
            spec: "  backendRef: {name: nats}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: two\n",
            want: Denied(
                "spec.durableName: cannot change from \"one\" to \"two\": the broker cannot change a consumer's durable name in place. Delete this Subscription and create it again with the new value (its consumer and unsettled deliveries go with it)",
                &[],
            ),
        },
        Row {
            name: "upd-backend",
            before: Some("  backendRef: {name: nats}\n  pattern: a.>\n"),
            spec: "  backendRef: {name: memory}\n  pattern: a.>\n",
            want: Denied(
                "spec.backendRef.name: cannot change from \"nats\" to \"memory\": the broker cannot change a consumer's backend in place. Delete this Subscription and create it again with the new value (its consumer and unsettled deliveries go with it)",
                &[],
            ),
        },
        Row {
            name: "upd-stream",
            before: Some("  backendRef: {name: nats}\n  pattern: a.>\n"),
            spec: "  backendRef: {name: nats}\n  pattern: a.>\n  stream: ORDERS\n",
            want: Denied(
                "spec.stream: cannot change from unset to \"ORDERS\": the broker cannot change a consumer's stream in place. Delete this Subscription and create it again with the new value (its consumer and unsettled deliveries go with it)",
                &[],
            ),
        },
        Row {
            name: "upd-editable",
            before: Some(
                "  backendRef: {name: nats}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: e\n  maxDeliver: 3\n",
            ),
            spec: "  backendRef: {name: nats}\n  pattern: a.*\n  mode: AtLeastOnce\n  durableName: e\n  maxDeliver: 9\n  ackWait: 1m\n  maxInFlight: 1\n",
            want: Allowed(&[]),
        },
        Row {
            name: "upd-redeliver",
            before: Some(
                "  backendRef: {name: nats}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: r\n",
            ),
            spec: "  backendRef: {name: nats}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: r\n  slowHandler: Redeliver\n",
            want: Allowed(&[
                "spec.ackWait: slowHandler Redeliver without an explicit ackWait: under Redeliver, ackWait is a correctness setting; set it longer than your slowest handler run, or duplicate work is routine",
            ]),
        },
    ]
}

/// kubectl prints each admission warning as a `Warning: ` line on stderr.
fn warnings(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("Warning: "))
        .map(str::to_string)
        .collect()
}

fn check_row(ns: &str, row: &Row, dry_run: bool) {
    let mut args = vec!["apply", "-n", ns, "-f", "-"];
    if dry_run {
        args.push("--dry-run=server");
    }
    let out = kubectl(&args, Some(&manifest(row.name, row.spec)));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let mode = if dry_run { "dry-run" } else { "apply" };
    let (want_ok, want_warnings) = match &row.want {
        Want::Allowed(w) => (true, *w),
        Want::Denied(msg, w) => {
            let expected = format!("admission webhook \"{WEBHOOK}\" denied the request: {msg}\n");
            assert!(
                stderr.ends_with(&expected),
                "{mode} {}: wanted the denial\n  {expected}got:\n  {stderr}",
                row.name
            );
            (false, *w)
        }
    };
    assert_eq!(
        out.status.success(),
        want_ok,
        "{mode} {}: stdout {stdout} stderr {stderr}",
        row.name
    );
    let got: Vec<String> = warnings(&stderr);
    let want: Vec<String> = want_warnings.iter().map(|s| s.to_string()).collect();
    assert_eq!(got, want, "{mode} {}: warnings", row.name);
    if want_ok && dry_run {
        assert!(
            stdout.contains("(server dry run)"),
            "{mode} {}: {stdout}",
            row.name
        );
    }
}

/// What the operator's log says it denied, as (operation, object). One write can be judged more
/// than once: the API server retries a webhook call whose answer it lost (same review uid), and
/// when it judged a write against a cached copy of the object that turns out stale (the operator
/// wrote the object meanwhile) it reads the object again and asks again, under a new uid. Each
/// (operation, object) is therefore read once, however often it was judged.
fn denied_requests(log: &std::path::Path) -> std::collections::BTreeSet<(String, String)> {
    let text = std::fs::read_to_string(log).expect("the operator's log");
    let mut denied = std::collections::BTreeSet::new();
    for line in text.lines().filter(|l| l.contains("admission denied")) {
        // Strip the colours of the text format, then read `name=value` fields.
        let mut plain = String::new();
        let mut chars = line.chars();
        while let Some(c) = chars.next() {
            if c == '\u{1b}' {
                for c in chars.by_ref() {
                    if c == 'm' {
                        break;
                    }
                }
            } else {
                plain.push(c);
            }
        }
        let field = |name: &str| {
            plain
                .split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{name}=")))
                .unwrap_or_else(|| panic!("field {name} in {plain}"))
                .to_string()
        };
        denied.insert((field("operation"), field("object")));
    }
    denied
}

/// `settle_admission_requests_total` by (operation, allowed), from Prometheus text.
fn admission_counts(metrics: &str) -> std::collections::BTreeMap<(String, String), u64> {
    let mut out = std::collections::BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("settle_admission_requests_total{") else {
            continue;
        };
        let (labels, value) = rest.split_once("} ").expect("a sample line");
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or_else(|| panic!("label {name} in {line}"))
                .to_string()
        };
        let n: u64 = value.trim().parse().expect("a count");
        out.insert((label("operation"), label("allowed")), n);
    }
    out
}

#[test]
fn admission_through_the_real_api_server() {
    install_crds();
    let ns = common::namespace("webhook-e2e");
    let label = format!("settle.dev/webhook-e2e={}", std::process::id());
    kubectl_ok(&["label", "namespace", &ns, &label], None);
    let configuration = format!("settle-e2e-{}", std::process::id());
    let port = free_port();

    // The shipped webhook configuration, reached by url:, scoped to this test's namespace so
    // parallel tests are unaffected: the fail-closed and "only Subscriptions" checks below are
    // checks of what we ship.
    let vwc = shipped_configuration(&configuration, port);
    kubectl_ok(&["apply", "-f", "-"], Some(&vwc.to_string()));
    let stored = kubectl_ok(
        &[
            "get",
            "validatingwebhookconfiguration",
            &configuration,
            "-o",
            "json",
        ],
        None,
    );
    common::install::assert_settle_webhook(
        "the configuration as the API server stored it",
        &serde_json::from_str(&stored).expect("json"),
    );
    // And the mutating one, of the same name: the operator trusts it with the same CA.
    let mwc = shipped_mutating_configuration(&configuration, port);
    kubectl_ok(&["apply", "-f", "-"], Some(&mwc.to_string()));

    // The operator first: Backends are behind the webhook too, which fails closed.
    let operator = Operator::start(port, &ns, &configuration);
    // Backends: nats, memory, rabbitmq and sqs by kind; two whose status narrows their capabilities.
    let backends = "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: nats}\nspec: {nats: {servers: [\"nats://127.0.0.1:4222\"]}}\n---\n\
                    apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: memory}\nspec: {memory: {}}\n---\n\
                    apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: rabbit}\nspec: {rabbitmq: {urls: [\"amqp://127.0.0.1:5672\"]}}\n---\n\
                    apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: sqs}\nspec: {sqs: {region: eu-west-1}}\n---\n\
                    apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: nodelay}\nspec: {nats: {servers: [\"nats://127.0.0.1:4222\"]}}\n---\n\
                    apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: limited}\nspec: {nats: {servers: [\"nats://127.0.0.1:4222\"]}}\n";
    kubectl_ok(&["apply", "-n", &ns, "-f", "-"], Some(backends));
    for (name, caps) in [
        (
            "nodelay",
            r#"{"delaysRedelivery":false,"restartCanSpendUnseenAttempt":true}"#,
        ),
        (
            "limited",
            r#"{"delaysRedelivery":true,"maxRedeliveryDelay":"1m","restartCanSpendUnseenAttempt":true}"#,
        ),
    ] {
        let patch = format!(r#"{{"status":{{"capabilities":{caps}}}}}"#);
        kubectl_ok(
            &[
                "patch",
                "backend",
                name,
                "-n",
                &ns,
                "--subresource=status",
                "--type=merge",
                "-p",
                &patch,
            ],
            None,
        );
    }

    let ca_bundle = kubectl_ok(
        &[
            "get",
            "validatingwebhookconfiguration",
            &configuration,
            "-o",
            "jsonpath={.webhooks[0].clientConfig.caBundle}",
        ],
        None,
    );
    let secret_ca = kubectl_ok(
        &[
            "get",
            "secret",
            "settle-e2e-tls",
            "-n",
            &ns,
            "-o",
            "jsonpath={.data.ca\\.crt}",
        ],
        None,
    );
    assert!(!secret_ca.is_empty(), "the operator stored its CA");
    assert_eq!(
        ca_bundle, secret_ca,
        "the operator patched caBundle with the CA in its Secret"
    );

    let rows = rows();
    assert!(rows.len() >= 20, "the table holds at least 20 manifests");
    for row in &rows {
        if let Some(before) = row.before {
            kubectl_ok(
                &["apply", "-n", &ns, "-f", "-"],
                Some(&manifest(row.name, before)),
            );
        }
    }
    // Same verdicts with --dry-run=server, and nothing is stored by it.
    for row in &rows {
        check_row(&ns, row, true);
    }
    let stored = kubectl_ok(&["get", "subscriptions", "-n", &ns, "-o", "name"], None);
    for row in rows.iter().filter(|r| r.before.is_none()) {
        assert!(
            !stored.contains(&format!("/{}\n", row.name)),
            "dry run stored {}: {stored}",
            row.name
        );
    }
    for row in &rows {
        check_row(&ns, row, false);
    }
    // A Backend created a moment ago (perhaps not yet in the operator's watch cache) is found,
    // not reported missing: its capabilities are checked and nothing is warned.
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: fresh}\nspec: {memory: {}}\n",
        ),
    );
    let fresh = Row {
        name: "fresh-backend",
        spec: "  backendRef: {name: fresh}\n  pattern: a.>\n  mode: AtLeastOnce\n  durableName: f\n  backoff: {initial: 100ms, max: 1s}\n",
        before: None,
        want: Want::Allowed(&[]),
    };
    check_row(&ns, &fresh, false);

    // An update the webhook refused left the stored object as it was.
    let mode = kubectl_ok(
        &[
            "get",
            "subscription",
            "upd-mode",
            "-n",
            &ns,
            "-o",
            "jsonpath={.spec.mode}",
        ],
        None,
    );
    assert_eq!(mode, "AtMostOnce");

    // Decisions are counted, each exactly once: the table fixes how many of each this process
    // answered (every `before` created, then each row with --dry-run=server and for real, then
    // `fresh-backend`).
    let mut want = std::collections::BTreeMap::new();
    for row in &rows {
        let op = if row.before.is_some() {
            *want.entry(("CREATE", "true")).or_insert(0u64) += 1;
            "UPDATE"
        } else {
            "CREATE"
        };
        let allowed = if matches!(row.want, Want::Allowed(_)) {
            "true"
        } else {
            "false"
        };
        *want.entry((op, allowed)).or_insert(0) += 2;
    }
    // And the Backends: the table's six and `fresh`.
    *want.entry(("CREATE", "true")).or_insert(0) += 1 + 7;
    let metrics = operator.get("/metrics").expect("metrics answer");
    let got = admission_counts(&metrics);
    let want: std::collections::BTreeMap<(String, String), u64> = want
        .into_iter()
        .map(|((op, allowed), n)| ((op.to_string(), allowed.to_string()), n))
        .collect();
    assert_eq!(got, want, "settle_admission_requests_total; {metrics}");
    let total: u64 = want.values().sum();
    assert!(
        metrics
            .lines()
            .any(|l| l == format!("settle_admission_duration_seconds_count {total}")),
        "every answer is timed: {total} in {metrics}"
    );

    // The webhook goes down: Settle's resources fail closed with a clear message; others don't care.
    drop(operator);
    let out = kubectl(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&manifest(
            "while-down",
            "  backendRef: {name: nats}\n  pattern: a.>\n",
        )),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a Subscription must not be admitted unchecked"
    );
    assert!(
        stderr.contains(&format!("failed calling webhook \"{WEBHOOK}\"")),
        "{stderr}"
    );
    assert!(stderr.contains("connection refused"), "{stderr}");
    kubectl_ok(
        &[
            "create",
            "configmap",
            "unaffected",
            "-n",
            &ns,
            "--from-literal=a=b",
        ],
        None,
    );
    kubectl_ok(&["get", "subscriptions", "-n", &ns], None);
    let backend_update = kubectl(
        &["label", "backend", "nats", "-n", &ns, "touched=yes"],
        None,
    );
    let stderr = String::from_utf8_lossy(&backend_update.stderr);
    assert!(
        !backend_update.status.success()
            && stderr.contains("failed calling webhook \"backends.messaging.settle.dev\""),
        "Backends are behind the webhook too, and it fails closed: {stderr}"
    );

    // And it comes back: the same Secret is reused, so the caBundle still matches.
    let operator = Operator::start(port, &ns, &configuration);
    let again = kubectl_ok(
        &[
            "get",
            "validatingwebhookconfiguration",
            &configuration,
            "-o",
            "jsonpath={.webhooks[0].clientConfig.caBundle}",
        ],
        None,
    );
    assert_eq!(again, ca_bundle, "a restart reuses the stored CA");
    let mutating_ca_bundle = kubectl_ok(
        &[
            "get",
            "mutatingwebhookconfiguration",
            &configuration,
            "-o",
            "jsonpath={.webhooks[0].clientConfig.caBundle}",
        ],
        None,
    );
    assert_eq!(
        mutating_ca_bundle, ca_bundle,
        "the mutating webhook trusts the same CA"
    );
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&manifest(
            "after-restart",
            "  backendRef: {name: nats}\n  pattern: a.>\n",
        )),
    );
    // No controller runs for this namespace: the finalizer is the mutating webhook's, put on
    // before the Subscription was stored; a label (an UPDATE) keeps it and adds no second one.
    let finalizers = || {
        kubectl_ok(
            &[
                "get",
                "subscription",
                "after-restart",
                "-n",
                &ns,
                "-o",
                "jsonpath={.metadata.finalizers}",
            ],
            None,
        )
    };
    assert_eq!(finalizers(), r#"["messaging.settle.dev/consumer"]"#);
    kubectl_ok(
        &[
            "label",
            "subscription",
            "after-restart",
            "-n",
            &ns,
            "team=a",
        ],
        None,
    );
    assert_eq!(finalizers(), r#"["messaging.settle.dev/consumer"]"#);
    let metrics = operator.get("/metrics").unwrap_or_default();
    assert!(
        metrics.lines().any(|l| l
            .starts_with(r#"settle_admission_mutations_total{finalizer_added="true"} "#)
            && !l.ends_with(" 0")),
        "the mutating webhook counted the finalizer it put on:\n{}",
        metrics
            .lines()
            .filter(|l| l.contains("mutations"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    drop(operator);

    kubectl_ok(
        &["delete", "validatingwebhookconfiguration", &configuration],
        None,
    );
    kubectl_ok(
        &["delete", "mutatingwebhookconfiguration", &configuration],
        None,
    );
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

/// A Subscription refused on every backend (A2: a backoff under AtMostOnce), so it can only be
/// stored while the webhook is not registered.
const INVALID: &str =
    "  backendRef: {name: nats}\n  pattern: orders.>\n  backoff: {initial: 1s, max: 1m}\n";
const INVALID_MSG: &str = "spec.backoff: not allowed under mode AtMostOnce, where nothing comes back: remove spec.backoff, or set spec.mode: AtLeastOnce";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_never_blocks_the_cleanup_of_a_subscription_that_no_longer_passes() {
    use common::operator::{Operator, poll};
    use common::subs::{subs, wait_condition};

    install_crds();
    let env = common::env();
    let ns = common::namespace("webhook-cleanup");
    // A label of its own: the other test's configuration (same process id) must not match here.
    let label = format!("settle.dev/webhook-cleanup={}", std::process::id());
    kubectl_ok(&["label", "namespace", &ns, &label], None);

    // Stored while no webhook is registered: one on NATS (a broker to clean up on), one on the
    // memory backend, left for the namespace's deletion.
    let backends = format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: nats}}\nspec: {{nats: {{servers: [\"{}\"]}}}}\n---\n\
         apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: memory}}\nspec: {{memory: {{}}}}\n",
        env.nats_url
    );
    kubectl_ok(&["apply", "-n", &ns, "-f", "-"], Some(&backends));
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&manifest("orders", INVALID)),
    );
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&manifest(
            "audit",
            &INVALID.replace("{name: nats}", "{name: memory}"),
        )),
    );

    // Now the shipped webhook, for this namespace, and the operator with its controllers.
    let configuration = format!("settle-cleanup-{}", std::process::id());
    let port = free_port();
    let mut vwc = shipped_configuration(&configuration, port);
    for hook in vwc["webhooks"].as_array_mut().expect("webhooks") {
        hook["namespaceSelector"] = serde_json::json!({
            "matchLabels": {"settle.dev/webhook-cleanup": std::process::id().to_string()}
        });
    }
    kubectl_ok(&["apply", "-f", "-"], Some(&vwc.to_string()));
    let webhook_addr = format!("127.0.0.1:{port}");
    let operator = Operator::start_with(
        "webhook-cleanup",
        &ns,
        &[
            "--leader-election=false",
            "--webhook-addr",
            &webhook_addr,
            "--webhook-configuration",
            &configuration,
            "--webhook-secret",
            "settle-cleanup-tls",
        ],
    );
    let api = subs(&ns).await;

    // The controller's re-check marks both not accepted; to write that it first put its
    // finalizer on, an UPDATE of the unchanged spec the webhook let through.
    for name in ["orders", "audit"] {
        let s = wait_condition(
            &api,
            name,
            "Accepted",
            "False",
            "Invalid",
            Duration::from_secs(60),
        )
        .await;
        assert!(
            s.metadata
                .finalizers
                .as_ref()
                .is_some_and(|f| f.iter().any(|f| f == "messaging.settle.dev/consumer")),
            "{name}: {:?}",
            s.metadata.finalizers
        );
    }

    // The webhook judges this namespace: a new Subscription like them is refused ...
    let out = kubectl(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&manifest("fresh", INVALID)),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let denied = format!("admission webhook \"{WEBHOOK}\" denied the request: {INVALID_MSG}\n");
    assert!(
        !out.status.success(),
        "a new invalid Subscription was admitted"
    );
    assert!(
        stderr.ends_with(&denied),
        "wanted\n  {denied}got\n  {stderr}"
    );
    // ... a label on a stored one is not (its spec is unchanged) ...
    let out = kubectl(
        &["label", "subscription", "orders", "-n", &ns, "team=a"],
        None,
    );
    assert!(
        out.status.success(),
        "labelling an unchanged spec: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // ... and a change of its spec still is, to something as invalid as before.
    let out = kubectl(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&manifest(
            "orders",
            &INVALID.replace("orders.>", "orders.eu.>"),
        )),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a changed invalid spec was admitted");
    assert!(
        stderr.ends_with(&denied),
        "wanted\n  {denied}got\n  {stderr}"
    );

    // kubectl delete completes: the operator's finalizer removal is an UPDATE the webhook allows.
    let out = kubectl(
        &[
            "delete",
            "subscription",
            "orders",
            "-n",
            &ns,
            "--timeout=60s",
        ],
        None,
    );
    assert!(
        out.status.success(),
        "kubectl delete subscription orders: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    common::subs::wait_gone(&api, "orders", Duration::from_secs(10)).await;

    // kubectl delete namespace. This environment runs no kube-controller-manager, so the test
    // plays the namespace controller's part as it does it: once the namespace is Terminating,
    // delete every object in it, wait until none is left (here the operator's finalizer removal
    // must pass the webhook), then finalize the namespace.
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
    common::subs::delete_all_at_once(&ns);
    poll(
        "every Subscription in the Terminating namespace to be gone",
        Duration::from_secs(60),
        || async {
            let left = api
                .list(&Default::default())
                .await
                .map_err(|e| e.to_string())?;
            if left.items.is_empty() {
                Ok(())
            } else {
                Err(left
                    .items
                    .iter()
                    .map(|s| {
                        format!(
                            "{} (finalizers {:?})",
                            s.metadata.name.as_deref().unwrap_or(""),
                            s.metadata.finalizers
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(", "))
            }
        },
    )
    .await;
    let finalize = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": ns},
        "spec": {"finalizers": []},
    });
    kubectl_ok(
        &[
            "replace",
            "--raw",
            &format!("/api/v1/namespaces/{ns}/finalize"),
            "-f",
            "-",
        ],
        Some(&finalize.to_string()),
    );
    let out = kubectl(
        &[
            "wait",
            "--for=delete",
            &format!("namespace/{ns}"),
            "--timeout=30s",
        ],
        None,
    );
    assert!(
        out.status.success(),
        "namespace {ns} is gone: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = kubectl(&["get", "namespace", &ns], None);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("NotFound"),
        "namespace {ns} still there"
    );

    // Every refusal was one of the two above (a CREATE, a spec change): no finalizer write, and
    // no label, was ever denied.
    let metrics = operator.get("/metrics").unwrap_or_default();
    let counts = admission_counts(&metrics);
    let refused = |op: &str| {
        counts
            .get(&(op.to_string(), "false".to_string()))
            .copied()
            .unwrap_or(0)
    };
    // The API server can judge one write twice (a lost answer, or a stale cached copy of the
    // object; see `denied_requests`): the metric counts answers, the log names what was denied.
    // Exactly two writes were denied, and which.
    assert!(
        refused("CREATE") >= 1 && refused("UPDATE") >= 1,
        "{counts:?}"
    );
    let denied = denied_requests(&operator.log);
    assert_eq!(
        denied,
        [
            ("CREATE".to_string(), format!("{ns}/fresh")),
            ("UPDATE".to_string(), format!("{ns}/orders")),
        ]
        .into_iter()
        .collect(),
        "the writes denied (operation, object); metrics {counts:?}"
    );
    let allowed_updates = counts
        .get(&("UPDATE".to_string(), "true".to_string()))
        .copied()
        .unwrap_or(0);
    // Two finalizers on, one label, two finalizers off, at least.
    assert!(allowed_updates >= 5, "{counts:?}");
    drop(operator);
    kubectl_ok(
        &["delete", "validatingwebhookconfiguration", &configuration],
        None,
    );
}
