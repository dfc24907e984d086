//! Secrets and identities by opt-in (docs/semantics.md A16–A21), on the real API server with
//! `settle operator` as a process:
//!
//! - through the shipped webhook and real `kubectl apply`: a Backend naming a Secret without the
//!   `settle.dev/backend-credentials=true` label is refused naming the field and the label; so
//!   are credentials in a URL (never repeated), a host outside `--allowed-broker-hosts` and SQS
//!   without a Secret outside `--sqs-pod-identity-namespaces`; the labelled Secret is admitted
//!   with a plaintext warning; a change of kind is refused naming the field; a label on a stored
//!   Backend whose Secret lost its label still goes through (A14);
//! - with no webhook (a Backend that got in while it was not registered): the controller never
//!   sends an unlabelled Secret. The Backend points at a listener the test owns, speaking just
//!   enough NATS to be sent a CONNECT: no connection arrives while the Secret is unlabelled and
//!   status says why (Ready=False SecretNotLabelled, a Warning Event); once labelled, the
//!   operator connects and the listener sees the password, so the first half could fail. A host
//!   outside the allow-list is never connected to either, and SQS pod identity is refused.

use settle_testkit as common;

use std::io::{BufRead, BufReader, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::operator::{Operator, condition, poll};
use common::subs::{backends, wait_backend, wait_event};
use common::{free_port, install_crds, kubectl, kubectl_ok, namespace};

const LABEL: &str = "settle.dev/backend-credentials=true";

/// A listener that plays a NATS server up to the client's CONNECT: it records every connection
/// and the first line each one sends after INFO (the CONNECT, which carries the credentials).
struct Trap {
    port: u16,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Trap {
    fn start() -> Trap {
        // Never a port another test of this binary was handed (its webhook would call the trap).
        let listener = common::listen();
        let port = listener.local_addr().expect("addr").port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let record = record.clone();
                std::thread::spawn(move || {
                    record.lock().expect("lock").push("<connected>".to_string());
                    let info = "INFO {\"server_id\":\"trap\",\"server_name\":\"trap\",\"version\":\"2.10.0\",\"proto\":1,\"host\":\"127.0.0.1\",\"port\":4222,\"max_payload\":1048576,\"auth_required\":true}\r\n";
                    if conn.write_all(info.as_bytes()).is_err() {
                        return;
                    }
                    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
                    let mut line = String::new();
                    if BufReader::new(&conn).read_line(&mut line).is_ok() {
                        record.lock().expect("lock").push(line);
                    }
                });
            }
        });
        Trap { port, seen }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().expect("lock").clone()
    }
}

fn secret(ns: &str, name: &str, password: &str) {
    kubectl_ok(
        &[
            "create",
            "secret",
            "generic",
            name,
            "-n",
            ns,
            "--from-literal=user=alice",
            &format!("--from-literal=password={password}"),
        ],
        None,
    );
}

fn nats_backend(name: &str, server: &str, secret: Option<&str>) -> String {
    let creds = secret
        .map(|s| format!(", credentialsSecretRef: {{name: {s}}}"))
        .unwrap_or_default();
    format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: {name}}}\nspec:\n  nats: {{servers: [\"{server}\"]{creds}}}\n"
    )
}

/// config/webhook/validating-webhook.yaml, reached by url: at `port`, for namespaces labelled
/// `settle.dev/backend-secrets=<pid>` only.
fn shipped_configuration(name: &str, port: u16) -> serde_json::Value {
    let mut vwc = common::install::shipped_webhook_configuration();
    common::install::assert_settle_webhook("config/webhook/validating-webhook.yaml", &vwc);
    vwc["metadata"]["name"] = serde_json::json!(name);
    for hook in vwc["webhooks"].as_array_mut().expect("webhooks") {
        hook["clientConfig"] =
            serde_json::json!({"url": format!("https://127.0.0.1:{port}/validate")});
        hook["namespaceSelector"] = serde_json::json!({
            "matchLabels": {"settle.dev/backend-secrets": std::process::id().to_string()}
        });
    }
    vwc
}

fn refused(out: &std::process::Output) -> String {
    assert!(
        !out.status.success(),
        "admitted: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_naming_an_unlabelled_secret_is_refused_at_apply_and_so_is_a_change_of_kind() {
    install_crds();
    let ns = namespace("backend-admission");
    kubectl_ok(
        &[
            "label",
            "namespace",
            &ns,
            &format!("settle.dev/backend-secrets={}", std::process::id()),
        ],
        None,
    );
    let configuration = format!("settle-backend-secrets-{}", std::process::id());
    let port = free_port();
    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&shipped_configuration(&configuration, port).to_string()),
    );
    let addr = format!("127.0.0.1:{port}");
    // Admission only: the controllers watch a namespace that does not exist.
    let _op = Operator::start_with(
        "backend-admission",
        &format!("{ns}-no-controllers"),
        &[
            "--leader-election=false",
            "--namespace",
            &ns,
            "--webhook-addr",
            &addr,
            "--webhook-configuration",
            &configuration,
            "--webhook-secret",
            "settle-backend-secrets-tls",
            "--allowed-broker-hosts",
            "127.0.0.1,*.messaging.svc",
        ],
    );
    let hook = "admission webhook \"backends.messaging.settle.dev\" denied the request: ";

    // A Secret without the opt-in label: refused, naming the field and the label to add.
    secret(&ns, "creds", "s3cr3t");
    let out = kubectl(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&nats_backend(
            "nats",
            "nats://127.0.0.1:4222",
            Some("creds"),
        )),
    );
    let stderr = refused(&out);
    assert!(
        stderr.contains(&format!(
            "{hook}spec.nats.credentialsSecretRef.name: Secret \"creds\" does not carry the label {LABEL}"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("kubectl label secret creds -n {ns} {LABEL}")),
        "{stderr}"
    );

    // Credentials in a URL: refused, and the password is not repeated.
    let out = kubectl(
        &["apply", "-n", &ns, "-f", "-"],
        Some(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: rabbit}\nspec:\n  rabbitmq: {urls: [\"amqp://guest:hunter2@127.0.0.1:5672/%2f\"]}\n",
        ),
    );
    let stderr = refused(&out);
    assert!(
        stderr.contains(&format!("{hook}spec.rabbitmq.urls[0]: holds credentials")),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");

    // A host outside the allow-list.
    let out = kubectl(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&nats_backend("far", "nats://nats.example.com:4222", None)),
    );
    let stderr = refused(&out);
    assert!(
        stderr.contains(&format!("{hook}spec.nats.servers[0]: host \"nats.example.com\" is not among the broker hosts this installation allows (127.0.0.1, *.messaging.svc")),
        "{stderr}"
    );

    // SQS as the operator pod's own identity: not in this namespace.
    let out = kubectl(
        &["apply", "-n", &ns, "-f", "-"],
        Some(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: sqs}\nspec:\n  sqs: {endpoint: \"http://127.0.0.1:9324\"}\n",
        ),
    );
    let stderr = refused(&out);
    assert!(
        stderr.contains(&format!(
            "{hook}spec.sqs.credentialsSecretRef: required in namespace {ns}"
        )),
        "{stderr}"
    );

    // Labelled: admitted, with the warning that nats:// carries the credentials in plaintext.
    common::label_backend_secret(&ns, "creds");
    let out = kubectl(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&nats_backend(
            "nats",
            "nats://127.0.0.1:4222",
            Some("creds"),
        )),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "Warning: spec.nats.servers[0]: sends the credentials Secret's credentials unencrypted"
        ),
        "{stderr}"
    );

    // A change of kind: refused at apply, naming the field (the API server's CEL rule).
    let out = kubectl(
        &["apply", "-n", &ns, "-f", "-"],
        Some(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: nats}\nspec:\n  rabbitmq: {urls: [\"amqp://127.0.0.1:5672\"]}\n",
        ),
    );
    let stderr = refused(&out);
    assert!(
        stderr.contains("The Backend \"nats\" is invalid: spec: Invalid value: the backend kind (nats, rabbitmq, sqs, memory) cannot change; delete the Backend and create a new one"),
        "{stderr}"
    );
    let kind = kubectl_ok(
        &[
            "get",
            "backend",
            "nats",
            "-n",
            &ns,
            "-o",
            "jsonpath={.spec}",
        ],
        None,
    );
    assert!(
        kind.contains("\"nats\"") && !kind.contains("rabbitmq"),
        "{kind}"
    );

    // A14: the Secret loses its label; a label on the stored Backend (spec unchanged) still
    // goes through, and a change of its spec is judged again.
    kubectl_ok(
        &[
            "label",
            "secret",
            "creds",
            "-n",
            &ns,
            "settle.dev/backend-credentials-",
        ],
        None,
    );
    kubectl_ok(&["label", "backend", "nats", "-n", &ns, "team=a"], None);
    let out = kubectl(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&nats_backend("nats", "tls://127.0.0.1:4222", Some("creds"))),
    );
    let stderr = refused(&out);
    assert!(stderr.contains("does not carry the label"), "{stderr}");

    kubectl_ok(
        &["delete", "validatingwebhookconfiguration", &configuration],
        None,
    );
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_never_sends_an_unlabelled_secret_nor_connects_to_a_host_not_allowed() {
    install_crds();
    let ns = namespace("backend-secrets");
    let trap = Trap::start();
    let elsewhere = Trap::start();
    let password = format!("pw-{}-never-sent", std::process::id());
    secret(&ns, "creds", &password);
    secret(&ns, "creds2", &password);
    common::label_backend_secret(&ns, "creds2");

    // Stored with no webhook registered for this namespace, as if it got in while it was down.
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&nats_backend("trap", &trap.url(), Some("creds"))),
    );
    // localhost is not 127.0.0.1 to the allow-list: a host is compared by name.
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&nats_backend(
            "elsewhere",
            &format!("nats://localhost:{}", elsewhere.port),
            Some("creds2"),
        )),
    );
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: sqs}\nspec:\n  sqs: {endpoint: \"http://127.0.0.1:9324\"}\n",
        ),
    );
    let _op = Operator::start_with(
        "backend-secrets",
        &ns,
        &[
            "--leader-election=false",
            "--allowed-broker-hosts",
            "127.0.0.1",
        ],
    );
    let api = backends(&ns).await;

    let b = wait_backend(&api, "trap", "False", "SecretNotLabelled").await;
    let (_, _, m) = condition(&b.status.expect("status").conditions, "Ready").expect("Ready");
    assert!(
        m.contains(&format!("kubectl label secret creds -n {ns} {LABEL}")),
        "{m}"
    );
    let note = wait_event(&ns, "trap", "SecretNotLabelled").await;
    assert!(
        note.contains("spec.nats.credentialsSecretRef.name"),
        "{note}"
    );

    let b = wait_backend(&api, "elsewhere", "False", "HostNotAllowed").await;
    let (_, _, m) = condition(&b.status.expect("status").conditions, "Ready").expect("Ready");
    assert!(
        m.contains("spec.nats.servers[0]: host \"localhost\" is not among the broker hosts"),
        "{m}"
    );
    wait_backend(&api, "sqs", "False", "PodIdentityNotAllowed").await;

    // Status was written after the decision, which comes before any connection: none came.
    assert_eq!(
        trap.seen(),
        Vec::<String>::new(),
        "the unlabelled Secret's Backend connected"
    );
    assert_eq!(
        elsewhere.seen(),
        Vec::<String>::new(),
        "a host not allowed was connected to"
    );

    // Labelled: the operator connects and sends it, so the silence above was the rule's doing.
    common::label_backend_secret(&ns, "creds");
    poll(
        "the labelled Secret's credentials to reach the trap",
        Duration::from_secs(60),
        || async {
            let seen = trap.seen();
            if seen
                .iter()
                .any(|l| l.starts_with("CONNECT ") && l.contains(&password))
            {
                Ok(())
            } else {
                Err(format!("seen: {seen:?}"))
            }
        },
    )
    .await;
    assert_eq!(elsewhere.seen(), Vec::<String>::new());

    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}
