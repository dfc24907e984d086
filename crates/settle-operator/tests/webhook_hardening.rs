//! The webhook's deadlines and limits, against the running `settle operator` process (started
//! with short deadlines so this runs in seconds) and the real API server:
//!
//! - 20 TCP connections that never start TLS, 200 idle TLS connections, 50 idle HTTP/2
//!   connections (each answered one review first, and answers the server's pings) and 50
//!   HTTP/2 prefaces sent a byte a second are each closed by the server, no sooner than their
//!   deadline and not long after it, for the reason the metrics give;
//! - with all of them open, a review sent directly and one through `kubectl apply` are answered;
//! - past `--webhook-max-connections`, a new connection is refused at once and counted, and
//!   once a connection closes a new one is served again.
//!
//! - the metrics port: 10,000 idle TCP connections to it, with the operator
//!   limited to 4,096 file descriptors, leave a review answered and the probes (on their own
//!   port) answering, and what was refused is counted; under `--metrics-auth`, no token or an
//!   unknown one gets 401, a ServiceAccount token without the RBAC 403, with it 200; and
//!   `/lag/<namespace>/<subscription>` (for KEDA) answers a Subscription's
//!   `pending + ackPending` from its status only to a token allowed to get that Subscription.
//!
//! Every wait is a poll with a deadline; the operator is killed when its handle is dropped.

use settle_testkit as common;

use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_openapi::api::core::v1::Secret;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use settle_operator::admission::certs;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// The operator process; killed when dropped, so a failed assertion leaves nothing running.
struct Operator {
    child: Child,
    log: PathBuf,
    webhook_port: u16,
    metrics_port: u16,
    probe_port: u16,
}

impl Operator {
    /// Starts `settle operator` on ports it picks itself (read back from its log, so two tests
    /// never race for a port), with the self-managed certificate in `ns` and `flags` added.
    fn start(name: &str, ns: &str, configuration: &str, flags: &[&str]) -> Operator {
        Operator::start_with(name, ns, configuration, flags, None)
    }

    /// [`Operator::start`], with at most `open_files` file descriptors (RLIMIT_NOFILE, set by
    /// running it under `prlimit`, which execs it: the pid is the operator's).
    fn start_with(
        name: &str,
        ns: &str,
        configuration: &str,
        flags: &[&str],
        open_files: Option<u64>,
    ) -> Operator {
        let env = common::env();
        let log = common::root().join(format!(
            "target/webhook-hardening-{name}-{}.log",
            std::process::id()
        ));
        let file = std::fs::File::create(&log).expect("log file");
        let mut command = match open_files {
            Some(n) => {
                let mut c = Command::new("prlimit");
                c.arg(format!("--nofile={n}:{n}"))
                    .arg("--")
                    .arg(env!("CARGO_BIN_EXE_settle"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_settle")),
        };
        let child = command
            .args(["operator", "--log-format", "json"])
            .args(["--webhook-addr", "127.0.0.1:0"])
            .args(["--metrics-addr", "127.0.0.1:0"])
            .args(["--probe-addr", "127.0.0.1:0"])
            .args([
                "--namespace",
                ns,
                "--webhook-secret",
                "settle-hardening-tls",
            ])
            .args(["--webhook-configuration", configuration])
            .args(["--webhook-ips", "127.0.0.1"])
            // Its controllers watch its own namespace unless the test names others: test
            // binaries run side by side, and an operator watching every namespace would
            // reconcile (and connect to the brokers of) the other suites' objects.
            .args(
                if flags.iter().any(|f| f.starts_with("--watch-namespaces")) {
                    vec![]
                } else {
                    vec!["--watch-namespaces", ns]
                },
            )
            .args(flags)
            .env("KUBECONFIG", &env.kubeconfig)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start settle operator");
        let mut op = Operator {
            child,
            log,
            webhook_port: 0,
            metrics_port: 0,
            probe_port: 0,
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            op.webhook_port = op.logged_port("admission webhook bound").unwrap_or(0);
            op.metrics_port = op.logged_port("metrics and health listening").unwrap_or(0);
            op.probe_port = op.logged_port("probes listening").unwrap_or(0);
            if op.webhook_port != 0 && op.metrics_port != 0 && op.probe_port != 0 {
                break;
            }
            if let Ok(Some(status)) = op.child.try_wait() {
                panic!(
                    "settle operator exited ({status}); see {}",
                    op.log.display()
                );
            }
            assert!(
                std::time::Instant::now() < deadline,
                "settle operator did not report its ports within 60s; see {}",
                op.log.display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        while get_on(op.probe_port, "/readyz").is_none_or(|r| !r.starts_with("HTTP/1.1 200")) {
            assert!(
                std::time::Instant::now() < deadline,
                "settle operator not ready within 60s; see {}",
                op.log.display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        op
    }

    /// The port in the `addr` field of the JSON log line with this message.
    fn logged_port(&self, message: &str) -> Option<u16> {
        let file = std::fs::File::open(&self.log).ok()?;
        std::io::BufReader::new(file)
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| serde_json::from_str::<Value>(&l).ok())
            .find(|v| v["message"] == message)
            .and_then(|v| v["addr"].as_str()?.rsplit(':').next()?.parse().ok())
    }

    fn get(&self, path: &str) -> Option<String> {
        get_on(self.metrics_port, path)
    }

    /// The value of one sample, e.g. `settle_webhook_connections_open` or
    /// `settle_webhook_connections_closed_total{reason="idle_timeout"}`.
    fn metric(&self, sample: &str) -> Option<f64> {
        let text = self.get("/metrics")?;
        text.lines().find_map(|l| {
            l.strip_prefix(sample)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
    }

    /// Polls until `sample` satisfies `want`, or fails saying what it waited for.
    async fn wait_metric(&self, sample: &str, what: &str, want: impl Fn(f64) -> bool) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let got = self.metric(sample);
            if let Some(v) = got.filter(|v| want(*v)) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "waited 60s for {sample} to be {what}; last value {got:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// One plain HTTP/1.1 GET on a local port: the whole response, or `None` if the connection was
/// refused, closed without an answer, or slower than 5 s.
fn get_on(port: u16, path: &str) -> Option<String> {
    common::http_get(port, path).filter(|o| !o.is_empty())
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The webhook CA the operator stored in its Secret.
async fn webhook_ca(ns: &str) -> Vec<u8> {
    let client = common::kube_client().await;
    let secrets: kube::Api<Secret> = kube::Api::namespaced(client, ns);
    let secret = secrets
        .get("settle-hardening-tls")
        .await
        .expect("the operator made its Secret");
    secret
        .data
        .and_then(|d| d.get("ca.crt").cloned())
        .expect("ca.crt in the Secret")
        .0
}

fn tls_config(ca_pem: &[u8], alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        roots.add(cert.expect("CA PEM")).expect("CA added");
    }
    let mut config = rustls::ClientConfig::builder_with_provider(certs::crypto_provider())
        .with_safe_default_protocol_versions()
        .expect("protocols")
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

async fn tls_connect(port: u16, config: Arc<rustls::ClientConfig>) -> TlsStream<TcpStream> {
    let tcp = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("TCP connect");
    let name = ServerName::try_from("127.0.0.1").expect("IP name");
    TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .expect("TLS handshake")
}

fn review_body(uid: &str, ns: &str, spec: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "messaging.settle.dev", "version": "v1alpha1", "kind": "Subscription"},
            "resource": {"group": "messaging.settle.dev", "version": "v1alpha1", "resource": "subscriptions"},
            "name": "orders", "namespace": ns, "operation": "CREATE",
            "userInfo": {"username": "hardening"},
            "object": {
                "apiVersion": "messaging.settle.dev/v1alpha1", "kind": "Subscription",
                "metadata": {"name": "orders", "namespace": ns},
                "spec": spec,
            },
        }
    }))
    .expect("encode")
}

/// Sends one review over an HTTP/2 connection and returns the parsed answer.
async fn post_h2(
    sender: &mut hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    port: u16,
    body: Vec<u8>,
) -> Value {
    let req = http::Request::post(format!("https://127.0.0.1:{port}/validate"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    let resp = sender.send_request(req).await.expect("an answer");
    assert_eq!(resp.status(), http::StatusCode::OK);
    let bytes = resp
        .into_body()
        .collect()
        .await
        .expect("the body")
        .to_bytes();
    serde_json::from_slice(&bytes).expect("an AdmissionReview")
}

/// A fresh HTTP/2 connection: TLS with ALPN h2, the preface, SETTINGS. The returned task ends
/// when the server closes the connection.
async fn h2_connect(
    port: u16,
    config: Arc<rustls::ClientConfig>,
) -> (
    hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    tokio::task::JoinHandle<()>,
) {
    let tls = tls_connect(port, config).await;
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .expect("HTTP/2 handshake");
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    (sender, conn)
}

/// Reads until the server closes the connection (end of stream or an error).
async fn until_closed<R: tokio::io::AsyncRead + Unpin>(mut r: R) {
    let mut buf = [0u8; 512];
    while let Ok(n) = r.read(&mut buf).await {
        if n == 0 {
            return;
        }
    }
}

/// One attacking connection: how long it was left alone before the server closed it.
struct Held {
    kind: &'static str,
    deadline: Duration,
    ready: Instant,
    closed: Instant,
}

async fn kubectl(args: Vec<String>, stdin: Option<String>) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        common::kubectl(&args, stdin.as_deref())
    })
    .await
    .expect("kubectl ran")
}

async fn kubectl_ok(args: &[&str], stdin: Option<&str>) -> String {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let stdin = stdin.map(str::to_string);
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        common::kubectl_ok(&args, stdin.as_deref())
    })
    .await
    .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

/// A ValidatingWebhookConfiguration for Subscriptions in the namespaces labelled `label=value`,
/// pointing nowhere until [`point_webhook_at`] is called.
async fn register_webhook(configuration: &str, label: &str, value: &str) {
    let (configuration, label, value) = (
        configuration.to_string(),
        label.to_string(),
        value.to_string(),
    );
    tokio::task::spawn_blocking(move || {
        common::register_subscription_webhook(&configuration, &label, &value, 1)
    })
    .await
    .expect("kubectl ran");
}

async fn point_webhook_at(configuration: &str, port: u16) {
    let patch = format!(
        r#"[{{"op":"replace","path":"/webhooks/0/clientConfig/url","value":"https://127.0.0.1:{port}/validate"}}]"#
    );
    kubectl_ok(
        &[
            "patch",
            "validatingwebhookconfiguration",
            configuration,
            "--type=json",
            "-p",
            &patch,
        ],
        None,
    )
    .await;
}

// The deadlines this test gives the operator: long enough that opening 320 connections on a
// loaded 2-core machine stays well inside them, short enough to run in seconds.
const HANDSHAKE: Duration = Duration::from_secs(4);
const FIRST_REQUEST: Duration = Duration::from_secs(10);
const IDLE: Duration = Duration::from_secs(10);
/// How late after its deadline a connection may be seen closed (scheduling on a loaded
/// machine, and the graceful close of an HTTP/2 connection).
const LATE: Duration = Duration::from_secs(5);

/// The deadline test times connections and the flood test loads the machine: never both at once.
/// (A tokio Mutex: it is not poisoned when a test holding it fails.)
static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_trickling_connections_are_closed_within_their_deadlines() {
    let _alone = HEAVY.lock().await;
    common::install_crds();
    let ns = common::namespace("webhook-hardening");
    let label = format!("settle.dev/webhook-hardening={}", std::process::id());
    kubectl_ok(&["label", "namespace", &ns, &label], None).await;
    let configuration = format!("settle-hardening-{}", std::process::id());
    register_webhook(
        &configuration,
        "settle.dev/webhook-hardening",
        &std::process::id().to_string(),
    )
    .await;

    let op = Operator::start(
        "deadlines",
        &ns,
        &configuration,
        &[
            "--webhook-tls-handshake-timeout=4s",
            "--webhook-first-request-timeout=10s",
            "--webhook-idle-timeout=10s",
            "--webhook-h2-keepalive-interval=1s",
            "--webhook-h2-keepalive-timeout=2s",
            "--webhook-max-connections=400",
        ],
    );
    point_webhook_at(&configuration, op.webhook_port).await;
    let port = op.webhook_port;
    let ca = webhook_ca(&ns).await;
    let plain = tls_config(&ca, &[]);
    let h2 = tls_config(&ca, &[b"h2"]);

    let mut tasks = Vec::new();
    // Each connection says when it is open and left alone.
    let (up_tx, mut up_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    // A few TLS handshakes at a time, as a client pool would open them: 320 at once on a loaded
    // 2-core machine (both sides debug builds) can take the server longer than its deadline.
    let opening = Arc::new(tokio::sync::Semaphore::new(8));
    // TCP only: no TLS handshake ever starts.
    for _ in 0..20 {
        let up = up_tx.clone();
        tasks.push(tokio::spawn(async move {
            let tcp = TcpStream::connect(("127.0.0.1", port))
                .await
                .expect("connect");
            let ready = Instant::now();
            let _ = up.send(());
            until_closed(tcp).await;
            Held {
                kind: "TCP without TLS",
                deadline: HANDSHAKE,
                ready,
                closed: Instant::now(),
            }
        }));
    }
    // TLS done, then nothing.
    for _ in 0..200 {
        let (config, up, opening) = (plain.clone(), up_tx.clone(), opening.clone());
        tasks.push(tokio::spawn(async move {
            let turn = opening.acquire_owned().await.expect("open");
            let tls = tls_connect(port, config).await;
            drop(turn);
            let ready = Instant::now();
            let _ = up.send(());
            until_closed(tls).await;
            Held {
                kind: "idle TLS",
                deadline: FIRST_REQUEST,
                ready,
                closed: Instant::now(),
            }
        }));
    }
    // HTTP/2: one review answered, then idle (the client answers the server's pings).
    let ns_for_h2 = ns.clone();
    for i in 0..50 {
        let (config, ns, up) = (h2.clone(), ns_for_h2.clone(), up_tx.clone());
        let opening = opening.clone();
        tasks.push(tokio::spawn(async move {
            let turn = opening.acquire_owned().await.expect("open");
            let (mut sender, conn) = h2_connect(port, config).await;
            let answer = post_h2(
                &mut sender,
                port,
                review_body(
                    &format!("h2-{i}"),
                    &ns,
                    json!({"backendRef": {"name": "nats"}, "pattern": "a.>"}),
                ),
            )
            .await;
            assert_eq!(answer["response"]["allowed"], true, "{answer}");
            drop(turn);
            let ready = Instant::now();
            let _ = up.send(());
            let _ = conn.await;
            drop(sender);
            Held {
                kind: "idle HTTP/2",
                deadline: IDLE,
                ready,
                closed: Instant::now(),
            }
        }));
    }
    // HTTP/2 negotiated, its preface sent one byte a second.
    for _ in 0..50 {
        let (config, up, opening) = (h2.clone(), up_tx.clone(), opening.clone());
        tasks.push(tokio::spawn(async move {
            let turn = opening.acquire_owned().await.expect("open");
            let tls = tls_connect(port, config).await;
            drop(turn);
            let ready = Instant::now();
            let _ = up.send(());
            let (r, mut w) = tokio::io::split(tls);
            let trickle = async move {
                for byte in b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" {
                    if w.write_all(&[*byte]).await.is_err() || w.flush().await.is_err() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                // The whole preface went out: the server did not close in time. Wait anyway;
                // the assertion below says how late it was.
                std::future::pending::<()>().await;
            };
            tokio::select! {
                () = until_closed(r) => {},
                () = trickle => {},
            }
            Held {
                kind: "byte-a-second HTTP/2 preface",
                deadline: FIRST_REQUEST,
                ready,
                closed: Instant::now(),
            }
        }));
    }

    // With all of them open: the server still answers, directly and through the API server.
    drop(up_tx);
    let all_open_by = Instant::now() + Duration::from_secs(60);
    for n in 0..320 {
        match tokio::time::timeout_at(all_open_by, up_rx.recv()).await {
            Ok(Some(())) => {}
            _ => panic!("only {n} of 320 connections opened within 60s"),
        }
    }
    let open = op
        .metric("settle_webhook_connections_open")
        .unwrap_or_default();
    let asked = Instant::now();
    let (mut sender, _conn) = h2_connect(port, h2.clone()).await;
    let answer = post_h2(
        &mut sender,
        port,
        review_body(
            "while-open",
            &ns,
            json!({"backendRef": {"name": "nats"}, "pattern": "a.>", "mode": "AtLeastOnce"}),
        ),
    )
    .await;
    assert_eq!(answer["response"]["allowed"], false, "{answer}");
    assert!(
        answer["response"]["status"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("spec.durableName: required under mode AtLeastOnce")),
        "{answer}"
    );
    let direct = Instant::now();
    let manifest = "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {name: while-open}\nspec:\n  backendRef: {name: later}\n  pattern: a.>\n";
    let applied = kubectl(
        ["apply", "-n", &ns, "-f", "-"].map(String::from).to_vec(),
        Some(manifest.to_string()),
    )
    .await;
    let stderr = String::from_utf8_lossy(&applied.stderr);
    assert!(
        applied.status.success(),
        "kubectl apply through the webhook: {stderr}"
    );
    assert!(
        stderr.contains("Warning: spec.backendRef.name: Backend \"later\" does not exist"),
        "the webhook answered the API server (its warning is shown): {stderr}"
    );
    let answered = Instant::now();

    // Every one is closed by the server, no sooner than its deadline and not long after.
    let mut held = Vec::new();
    let all = futures::future::join_all(tasks);
    match tokio::time::timeout(FIRST_REQUEST + LATE + Duration::from_secs(30), all).await {
        Ok(results) => {
            for r in results {
                held.push(r.expect("a connection task"));
            }
        }
        Err(_) => panic!("some connections were still open long after their deadlines"),
    }
    let closed_by_server = op
        .get("/metrics")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("settle_webhook_connections_closed_total{"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut open_while_asked = 0;
    for h in &held {
        let lived = h.closed - h.ready;
        assert!(
            lived + Duration::from_secs(1) >= h.deadline && lived <= h.deadline + LATE,
            "{} closed after {lived:?}; its deadline is {:?} (the server's count: {closed_by_server})",
            h.kind,
            h.deadline
        );
        if h.closed >= direct {
            open_while_asked += 1;
        }
    }
    let slowest = held
        .iter()
        .map(|h| h.closed - h.ready)
        .max()
        .unwrap_or_default();
    for kind in [
        "TCP without TLS",
        "idle TLS",
        "idle HTTP/2",
        "byte-a-second HTTP/2 preface",
    ] {
        let lived: Vec<Duration> = held
            .iter()
            .filter(|h| h.kind == kind)
            .map(|h| h.closed - h.ready)
            .collect();
        println!(
            "{:>4} × {kind:<30} closed after {:.2?} to {:.2?}",
            lived.len(),
            lived.iter().min().copied().unwrap_or_default(),
            lived.iter().max().copied().unwrap_or_default(),
        );
    }
    let first = held.iter().map(|h| h.ready).min().unwrap_or(asked);
    let last = held.iter().map(|h| h.ready).max().unwrap_or(asked);
    println!(
        "{} connections opened in {:?}, closed by the server (slowest after {slowest:?}); {open} open when the reviews were asked {:?} later; direct answer in {:?} ({open_while_asked} open then), kubectl apply in {:?}",
        held.len(),
        last - first,
        asked - last,
        direct - asked,
        answered - direct,
    );
    assert!(
        open_while_asked >= 300,
        "the review must be answered with the 300 idle TLS and HTTP/2 connections open: only {open_while_asked} were"
    );

    // And the server says why it closed them.
    for (reason, want) in [
        ("tls_handshake_timeout", 20.0),
        ("first_request_timeout", 250.0),
    ] {
        op.wait_metric(
            &format!("settle_webhook_connections_closed_total{{reason=\"{reason}\"}}"),
            &format!("{want}"),
            |v| v == want,
        )
        .await;
    }
    op.wait_metric(
        "settle_webhook_connections_closed_total{reason=\"idle_timeout\"}",
        "at least 50",
        |v| v >= 50.0,
    )
    .await;
    assert_eq!(
        op.metric("settle_webhook_connections_refused_total"),
        Some(0.0)
    );

    drop(op);
    kubectl_ok(
        &["delete", "validatingwebhookconfiguration", &configuration],
        None,
    )
    .await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_cap_a_new_connection_is_refused_at_once_and_counted() {
    common::install_crds();
    let ns = common::namespace("webhook-cap");
    const CAP: usize = 20;
    // Long deadlines: only the cap can close anything here.
    let op = Operator::start(
        "cap",
        &ns,
        "",
        &[
            "--webhook-max-connections=20",
            "--webhook-first-request-timeout=5m",
            "--webhook-idle-timeout=5m",
        ],
    );
    let port = op.webhook_port;
    let ca = webhook_ca(&ns).await;
    let h2 = tls_config(&ca, &[b"h2"]);

    let mut held = Vec::new();
    for _ in 0..CAP {
        held.push(tls_connect(port, tls_config(&ca, &[])).await);
    }
    op.wait_metric("settle_webhook_connections_open", "20", |v| v == CAP as f64)
        .await;

    // One more: closed as soon as it is accepted, long before any deadline.
    let refused_at = Instant::now();
    let tcp = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("the kernel accepts the TCP connection");
    let name = ServerName::try_from("127.0.0.1").expect("IP name");
    let handshake = tokio::time::timeout(
        Duration::from_secs(30),
        TlsConnector::from(tls_config(&ca, &[])).connect(name, tcp),
    )
    .await
    .expect("the refused connection is closed, not left waiting");
    assert!(
        handshake.is_err(),
        "a connection past the cap must be refused, not served"
    );
    println!("refused after {:?}", refused_at.elapsed());
    op.wait_metric("settle_webhook_connections_refused_total", "1", |v| {
        v == 1.0
    })
    .await;
    assert_eq!(
        op.metric("settle_webhook_connections_open"),
        Some(CAP as f64)
    );

    // One closes; a new connection is served again.
    drop(held.pop());
    op.wait_metric("settle_webhook_connections_open", "19", |v| {
        v == (CAP - 1) as f64
    })
    .await;
    let (mut sender, _conn) = h2_connect(port, h2).await;
    let answer = post_h2(
        &mut sender,
        port,
        review_body(
            "after-cap",
            &ns,
            json!({"backendRef": {"name": "nats"}, "pattern": "a.>"}),
        ),
    )
    .await;
    assert_eq!(answer["response"]["uid"], "after-cap");
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    assert_eq!(
        op.metric("settle_webhook_connections_refused_total"),
        Some(1.0)
    );

    drop(held);
    drop(op);
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None).await;
}

/// A replica told to stop (the kubelet's SIGTERM in a rolling update) keeps answering reviews,
/// on the connections it has and on new ones, for its shutdown delay, while `/readyz` says 503
/// so the endpoints controller takes it out of the webhook's Service: closing at once would
/// fail the reviews the API server still routes to it, and with `failurePolicy: Fail` the
/// `kubectl apply` behind each. A second signal closes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_replica_answers_reviews_until_its_shutdown_delay_ends() {
    common::install_crds();
    let ns = common::namespace("webhook-drain");
    // Far longer than the test: only the second signal can end it early.
    let mut op = Operator::start("drain", &ns, "", &["--shutdown-delay=10m"]);
    let port = op.webhook_port;
    let ca = webhook_ca(&ns).await;
    let h2 = tls_config(&ca, &[b"h2"]);
    let spec = json!({"backendRef": {"name": "nats"}, "pattern": "a.>"});
    let (mut held, held_conn) = h2_connect(port, h2.clone()).await;
    let answer = post_h2(&mut held, port, review_body("before", &ns, spec.clone())).await;
    assert_eq!(answer["response"]["allowed"], true, "{answer}");

    let pid = op.child.id().to_string();
    let kill = |signal: &str| {
        let status = Command::new("kill")
            .args([signal, &pid])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal}");
    };
    kill("-TERM");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let readyz = get_on(op.probe_port, "/readyz").unwrap_or_default();
        if readyz.starts_with("HTTP/1.1 503") {
            assert!(readyz.contains("shutting down"), "{readyz}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "/readyz still answers {readyz:?} 30s after SIGTERM; see {}",
            op.log.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let healthz = get_on(op.probe_port, "/healthz").unwrap_or_default();
    assert!(
        healthz.starts_with("HTTP/1.1 200"),
        "a stopping replica is alive, not to be restarted: {healthz}"
    );
    // Reviews are still answered: on the connection the API server holds, and on a new one
    // (kube-proxy routes a new one to it until the endpoint is gone).
    let answer = post_h2(&mut held, port, review_body("held", &ns, spec.clone())).await;
    assert_eq!(answer["response"]["uid"], "held");
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    let (mut fresh, _fresh_conn) = h2_connect(port, h2).await;
    let answer = post_h2(&mut fresh, port, review_body("fresh", &ns, spec)).await;
    assert_eq!(answer["response"]["uid"], "fresh");
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    assert!(
        matches!(op.child.try_wait(), Ok(None)),
        "the operator runs on through its shutdown delay"
    );

    // A second signal: the ports close and the process ends, long before the delay would.
    kill("-TERM");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = op.child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the operator still runs 60s after a second SIGTERM; see {}",
            op.log.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        status.success(),
        "a stop on signals is a clean exit: {status}"
    );
    tokio::time::timeout(Duration::from_secs(10), held_conn)
        .await
        .expect("the held connection is closed with the process")
        .expect("connection task");
    let log = std::fs::read_to_string(&op.log).unwrap_or_default();
    assert!(log.contains("a second signal: closing at once"), "{log}");
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None).await;
}

/// Raises this test process's RLIMIT_NOFILE to `n` (soft and hard) with `prlimit`, or fails
/// saying what it has, if it is below `n` and cannot be raised.
fn raise_open_files(n: u64) {
    let _ = Command::new("prlimit")
        .arg(format!("--pid={}", std::process::id()))
        .arg(format!("--nofile={n}:{n}"))
        .status();
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let soft: u64 = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3)?.parse().ok())
        .unwrap_or(0);
    assert!(
        soft >= n,
        "this test needs {n} open files and could not raise its limit: {soft}"
    );
}

/// The RLIMIT_NOFILE (soft) of process `pid`.
fn open_files_limit(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/limits"))
        .ok()?
        .lines()
        .find(|l| l.starts_with("Max open files"))?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()
}

const IDLE_CONNECTIONS: usize = 10_000;
const METRICS_CAP: usize = 64;
/// The operator's own file-descriptor limit: below IDLE_CONNECTIONS, so without the metrics
/// port's cap the idle connections alone would leave the webhook nothing to accept with.
const OPERATOR_OPEN_FILES: u64 = 4096;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_idle_connections_to_the_metrics_port_leave_reviews_and_probes_answered() {
    let _alone = HEAVY.lock().await;
    common::install_crds();
    let ns = common::namespace("metrics-flood");
    raise_open_files(IDLE_CONNECTIONS as u64 + 10_000);
    // Long deadlines: only the cap stands between the flood and the operator's descriptors.
    let op = Operator::start_with(
        "metrics-flood",
        &ns,
        "",
        &[
            "--metrics-max-connections=64",
            "--metrics-first-request-timeout=10m",
            "--metrics-idle-timeout=10m",
        ],
        Some(OPERATOR_OPEN_FILES),
    );
    assert_eq!(
        open_files_limit(op.child.id()),
        Some(OPERATOR_OPEN_FILES),
        "the operator runs with a file-descriptor limit below the flood"
    );
    let (metrics_port, probe_port, webhook_port) =
        (op.metrics_port, op.probe_port, op.webhook_port);

    // 10,000 TCP connections that never send a byte, all held until `release`. At most 200 wait
    // for the server at once (a turn is given back when the server closes the connection), so
    // the listen backlog never overflows and every connection reaches the server; each says
    // when the server closed it (refused).
    let opening = Arc::new(tokio::sync::Semaphore::new(200));
    let started = Instant::now();
    let (release, released) = tokio::sync::watch::channel(false);
    let refused_seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut held = Vec::with_capacity(IDLE_CONNECTIONS);
    for _ in 0..IDLE_CONNECTIONS {
        let (opening, mut released, refused_seen) =
            (opening.clone(), released.clone(), refused_seen.clone());
        held.push(tokio::spawn(async move {
            let turn = opening.acquire_owned().await.expect("open");
            let mut tcp = TcpStream::connect(("127.0.0.1", metrics_port))
                .await
                .expect("the kernel accepts every TCP connection");
            let mut buf = [0u8; 64];
            let closed_by_server = tokio::select! {
                r = tcp.read(&mut buf) => matches!(r, Ok(0) | Err(_)),
                _ = released.wait_for(|r| *r) => false,
            };
            if closed_by_server {
                refused_seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                drop(turn);
                // Held (closed by the server) until the end, like the others.
                let _ = released.wait_for(|r| *r).await.map(|_| ());
            }
        }));
    }
    // The server has looked at every one: all but the cap were closed at once.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let seen = refused_seen.load(std::sync::atomic::Ordering::SeqCst);
        if seen == IDLE_CONNECTIONS - METRICS_CAP {
            break;
        }
        assert!(
            seen <= IDLE_CONNECTIONS - METRICS_CAP && Instant::now() < deadline,
            "{seen} of {IDLE_CONNECTIONS} connections closed by the server; want all but {METRICS_CAP}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "{IDLE_CONNECTIONS} idle connections opened, all but {METRICS_CAP} refused, in {:?}",
        started.elapsed()
    );

    // The port is full: one more connection is closed at once, unanswered.
    assert_eq!(
        tokio::task::spawn_blocking(move || get_on(metrics_port, "/metrics"))
            .await
            .expect("a GET"),
        None,
        "past --metrics-max-connections the metrics port must refuse, not serve"
    );

    // With all of them held: the probes answer on their own port ...
    for path in ["/healthz", "/readyz"] {
        let answer = tokio::task::spawn_blocking(move || get_on(probe_port, path))
            .await
            .expect("a GET");
        assert!(
            answer
                .as_deref()
                .is_some_and(|a| a.starts_with("HTTP/1.1 200")),
            "{path} on the probe port during the flood: {answer:?}"
        );
    }
    // ... and the webhook answers a review.
    let ca = webhook_ca(&ns).await;
    let (mut sender, _conn) = h2_connect(webhook_port, tls_config(&ca, &[b"h2"])).await;
    let answer = post_h2(
        &mut sender,
        webhook_port,
        review_body(
            "during-flood",
            &ns,
            json!({"backendRef": {"name": "nats"}, "pattern": "a.>", "mode": "AtLeastOnce"}),
        ),
    )
    .await;
    assert_eq!(answer["response"]["uid"], "during-flood", "{answer}");
    assert_eq!(answer["response"]["allowed"], false, "{answer}");
    assert!(
        answer["response"]["status"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("spec.durableName: required under mode AtLeastOnce")),
        "{answer}"
    );

    // The flood ends; the metrics port serves again and says what it refused.
    let _ = release.send(true);
    for h in held {
        let _ = h.await;
    }
    let refused = op
        .wait_metric(
            "settle_metrics_connections_refused_total",
            "every connection past the cap",
            |v| v >= (IDLE_CONNECTIONS - METRICS_CAP) as f64,
        )
        .await;
    println!("settle_metrics_connections_refused_total {refused}");
    op.wait_metric(
        "settle_metrics_connections_closed_total{reason=\"client\"}",
        "the 64 held connections, closed by the client",
        |v| v >= METRICS_CAP as f64,
    )
    .await;
    assert_eq!(
        op.metric("settle_webhook_connections_refused_total"),
        Some(0.0),
        "the webhook refused nothing"
    );
    assert_eq!(
        op.metric("settle_probe_connections_refused_total"),
        Some(0.0)
    );

    drop(op);
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None).await;
}

/// One HTTPS GET of `/metrics` (HTTP/1.1), with a bearer token if given: the status and body.
async fn https_metrics(port: u16, ca: &[u8], token: Option<&str>) -> (u16, String) {
    https_get(port, ca, "/metrics", token).await
}

/// `GET path` over HTTPS on the metrics port, with `token` as a bearer token.
async fn https_get(port: u16, ca: &[u8], path: &str, token: Option<&str>) -> (u16, String) {
    let tls = tls_connect(port, tls_config(ca, &[b"http/1.1"])).await;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .expect("HTTP/1.1 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = http::Request::get(path).header("host", "127.0.0.1");
    if let Some(token) = token {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    let resp = sender
        .send_request(req.body(Full::new(Bytes::new())).expect("request"))
        .await
        .expect("an answer");
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("the body")
        .to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// `GET path` with `token` until the RBAC just applied takes effect: 403 while the verdict
/// cached before it lasts, then 200 (within 60 s); its body.
async fn once_bound(port: u16, ca: &[u8], path: &str, token: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, body) = https_get(port, ca, path, Some(token)).await;
        if status == 200 {
            return body;
        }
        assert_eq!(status, 403, "{body}");
        assert!(
            Instant::now() < deadline,
            "still 403 60s after the binding: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_metrics_auth_only_a_token_allowed_to_get_metrics_reads_them() {
    common::install_crds();
    let ns = common::namespace("metrics-auth");
    let op = Operator::start(
        "metrics-auth",
        &ns,
        "",
        &["--metrics-auth", "--metrics-auth-cache-ttl=1s"],
    );
    let port = op.metrics_port;
    let ca = webhook_ca(&ns).await;

    // No token: 401.
    let (status, body) = https_metrics(port, &ca, None).await;
    assert_eq!(status, 401, "{body}");
    // A token the API server does not know: 401.
    let (status, body) = https_metrics(port, &ca, Some("not-a-token")).await;
    assert_eq!(status, 401, "{body}");

    // A real ServiceAccount token (TokenRequest) without the RBAC: 403, naming the user.
    kubectl_ok(&["create", "serviceaccount", "prometheus", "-n", &ns], None).await;
    let token = kubectl_ok(
        &["create", "token", "prometheus", "-n", &ns, "--duration=10m"],
        None,
    )
    .await;
    let token = token.trim().to_string();
    let (status, body) = https_metrics(port, &ca, Some(&token)).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body.contains(&format!("system:serviceaccount:{ns}:prometheus")),
        "{body}"
    );

    // Bound to a role that may get /metrics (the chart's settle-metrics-reader): 200, and the
    // metrics. The 403 above is cached for 1 s, so this polls.
    let role = format!("settle-metrics-reader-{ns}");
    let rbac = format!(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {{name: {role}}}\n\
         rules: [{{nonResourceURLs: [/metrics], verbs: [get]}}]\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {{name: {role}}}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: {role}}}\n\
         subjects: [{{kind: ServiceAccount, name: prometheus, namespace: {ns}}}]\n"
    );
    kubectl_ok(&["apply", "-f", "-"], Some(&rbac)).await;
    let body = once_bound(port, &ca, "/metrics", &token).await;
    assert!(
        body.contains("settle_metrics_auth_total{result=\"forbidden\"}"),
        "the metrics, counting the refusals: {}",
        &body[..body.len().min(2000)]
    );
    for (result, at_least) in [
        ("unauthenticated", 2.0),
        ("forbidden", 1.0),
        ("allowed", 1.0),
    ] {
        let line = format!("settle_metrics_auth_total{{result=\"{result}\"}} ");
        let got: Option<f64> = body
            .lines()
            .find_map(|l| l.strip_prefix(&line)?.trim().parse().ok());
        assert!(got.is_some_and(|v| v >= at_least), "{line}{got:?}");
    }
    // Plain HTTP is not served under --metrics-auth.
    assert!(
        get_on(port, "/metrics").is_none_or(|a| !a.starts_with("HTTP/1.1 200")),
        "plain HTTP must not be answered with the metrics"
    );

    drop(op);
    kubectl_ok(
        &[
            "delete",
            "clusterrolebinding,clusterrole",
            &role,
            "--ignore-not-found",
        ],
        None,
    )
    .await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_metrics_auth_a_subscriptions_lag_is_served_only_to_a_token_that_may_get_it() {
    common::install_crds();
    let ns = common::namespace("lag");
    let other = common::namespace("lag-other");
    // Its controllers watch a namespace with nothing in it: the status written below is the
    // test's alone (the endpoint reads the Subscription with a GET, not through a watch).
    let op = Operator::start(
        "lag",
        &ns,
        "",
        &[
            "--metrics-auth",
            "--metrics-auth-cache-ttl=1s",
            "--watch-namespaces",
            &format!("{ns}-unwatched"),
        ],
    );
    let port = op.metrics_port;
    let ca = webhook_ca(&ns).await;
    for namespace in [&ns, &other] {
        let sub = format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {namespace}}}\n\
             spec: {{backendRef: {{name: nats}}, pattern: orders.>}}\n"
        );
        kubectl_ok(&["apply", "-f", "-"], Some(&sub)).await;
    }
    // The gauges as the account writes them.
    kubectl_ok(
        &[
            "patch",
            "subscription",
            "orders",
            "-n",
            &ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"status":{"stats":{"pending":7,"ackPending":3}}}"#,
        ],
        None,
    )
    .await;
    let path = format!("/lag/{ns}/orders");

    let (status, body) = https_get(port, &ca, &path, None).await;
    assert_eq!(status, 401, "no token: {body}");
    kubectl_ok(&["create", "serviceaccount", "keda", "-n", &ns], None).await;
    let token = kubectl_ok(
        &["create", "token", "keda", "-n", &ns, "--duration=10m"],
        None,
    )
    .await;
    let token = token.trim().to_string();
    let (status, body) = https_get(port, &ca, &path, Some(&token)).await;
    assert_eq!(status, 403, "no RBAC yet: {body}");
    assert!(
        body.contains(&format!("system:serviceaccount:{ns}:keda"))
            && body.contains("get subscriptions"),
        "names the user and what it may not do: {body}"
    );

    // Allowed to get Subscriptions in its own namespace: the lag, from status.
    let rbac = format!(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: lag-reader, namespace: {ns}}}\n\
         rules: [{{apiGroups: [messaging.settle.dev], resources: [subscriptions], verbs: [get]}}]\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: lag-reader, namespace: {ns}}}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: lag-reader}}\n\
         subjects: [{{kind: ServiceAccount, name: keda, namespace: {ns}}}]\n"
    );
    kubectl_ok(&["apply", "-f", "-"], Some(&rbac)).await;
    let body = once_bound(port, &ca, &path, &token).await;
    let lag: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(lag["lag"], 10, "pending + ackPending: {lag}");
    assert_eq!(
        (lag["pending"].clone(), lag["ackPending"].clone()),
        (json!(7), json!(3)),
        "{lag}"
    );
    assert_eq!(lag["subscription"], "orders", "{lag}");

    // The same token reads no other namespace's lag, and nothing that is not a Subscription.
    let (status, body) = https_get(port, &ca, &format!("/lag/{other}/orders"), Some(&token)).await;
    assert_eq!(status, 403, "another team's Subscription: {body}");
    let (status, body) = https_get(port, &ca, &format!("/lag/{ns}/missing"), Some(&token)).await;
    assert_eq!(
        status, 404,
        "a Subscription it may get, that does not exist: {body}"
    );
    assert!(body.contains("not found"), "{body}");
    let (status, body) = https_get(port, &ca, &format!("/lag/{ns}"), Some(&token)).await;
    assert_eq!(status, 404, "a path naming no Subscription: {body}");
    assert!(body.contains("/lag/<namespace>/<subscription>"), "{body}");
    let (status, body) = https_metrics(port, &ca, Some(&token)).await;
    assert_eq!(status, 403, "the lag reader may not read /metrics: {body}");

    drop(op);
    for namespace in [&ns, &other] {
        kubectl_ok(&["delete", "namespace", namespace, "--wait=false"], None).await;
    }
}
