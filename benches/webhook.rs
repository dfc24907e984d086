//! Benchmark of the admission webhook endpoint: the real HTTPS server on 127.0.0.1, a
//! self-made certificate, a map-backed Backend lookup, and concurrent AdmissionReview requests
//! (a mix of allowed, denied and warned). Prints p50/p99/max latency and throughput for
//! (1) `review` in process, (2) a paced run at 1,000 requests/s for 10 s, (3) an unthrottled run.
//!
//! Bounded in count and time; asserts nothing about timing (only that every answer is a 200
//! with the expected verdict). Run with `cargo bench --bench webhook`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use settle::admission::certs::{self, CertResolver, Sans};
use settle::admission::webhook::{Server, StaticLookup, WebhookConfig, review};
use settle::api::Backend;
use tokio::sync::Semaphore;

const NS: &str = "bench";
/// The paced run: this many requests per second, for this long.
const RATE: u64 = 1_000;
const PACED: Duration = Duration::from_secs(10);
/// The unthrottled run: this many concurrent clients, at most this many requests or this long.
const CONCURRENCY: usize = 64;
const UNTHROTTLED_MAX: usize = 100_000;
const UNTHROTTLED_TIME: Duration = Duration::from_secs(10);
/// Requests in flight at most during the paced run (beyond that the server is not keeping up).
const PACED_IN_FLIGHT: usize = 512;

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Expect {
    Allowed,
    Denied,
    Warned,
}

fn review_body(uid: usize, spec: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": format!("bench-{uid}"),
            "kind": {"group": "messaging.settle.dev", "version": "v1alpha1", "kind": "Subscription"},
            "resource": {"group": "messaging.settle.dev", "version": "v1alpha1", "resource": "subscriptions"},
            "name": "orders", "namespace": NS, "operation": "CREATE",
            "userInfo": {"username": "bench"},
            "object": {
                "apiVersion": "messaging.settle.dev/v1alpha1", "kind": "Subscription",
                "metadata": {"name": "orders", "namespace": NS, "labels": {"app": "orders"}},
                "spec": spec,
            },
            "oldObject": null,
            "dryRun": false,
        }
    }))
    .expect("encode")
}

/// Allowed, denied, warned, in turn.
fn bodies() -> Vec<(Bytes, Expect)> {
    vec![
        (
            review_body(0, json!({"backendRef": {"name": "nats"}, "pattern": "orders.>", "mode": "AtLeastOnce",
                "durableName": "orders", "backoff": {"initial": "1s", "max": "1m"}, "ackWait": "30s"})),
            Expect::Allowed,
        ),
        (
            review_body(1, json!({"backendRef": {"name": "nats"}, "pattern": "orders.>", "mode": "AtLeastOnce",
                "backoff": {"initial": "1s", "max": "1m", "multiplier": 0.5}})),
            Expect::Denied,
        ),
        (review_body(2, json!({"backendRef": {"name": "nats"}, "pattern": "orders.>", "maxDeliver": 5, "ackWait": "10s"})), Expect::Warned),
    ]
    .into_iter()
    .map(|(b, e)| (Bytes::from(b), e))
    .collect()
}

fn check(body: &[u8], expect: Expect) -> bool {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    let allowed = v["response"]["allowed"].as_bool();
    let warned = v["response"]["warnings"]
        .as_array()
        .is_some_and(|w| !w.is_empty());
    match expect {
        Expect::Allowed => allowed == Some(true) && !warned,
        Expect::Denied => allowed == Some(false),
        Expect::Warned => allowed == Some(true) && warned,
    }
}

fn lookup() -> StaticLookup {
    let backend: Backend = serde_json::from_value(json!({
        "apiVersion": "messaging.settle.dev/v1alpha1", "kind": "Backend",
        "metadata": {"name": "nats", "namespace": NS},
        "spec": {"nats": {"servers": ["nats://nats:4222"]}},
    }))
    .expect("backend");
    StaticLookup::new().with(backend)
}

fn client(ca_pem: &str) -> HttpsClient {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.expect("CA")).expect("root");
    }
    let tls = rustls::ClientConfig::builder_with_provider(certs::crypto_provider())
        .with_safe_default_protocol_versions()
        .expect("protocols")
        .with_root_certificates(roots)
        .with_no_client_auth();
    // Like the API server's client: no Nagle delay on small requests.
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.enforce_http(false);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(CONCURRENCY * 2)
        .build(https)
}

/// One POST; Ok(latency) if the answer was a 200 with the expected verdict.
async fn one(
    client: &HttpsClient,
    url: &str,
    body: Bytes,
    expect: Expect,
) -> Result<Duration, String> {
    let started = Instant::now();
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    let took = started.elapsed();
    if status != http::StatusCode::OK || !check(&body, expect) {
        return Err(format!(
            "unexpected answer {status}: {}",
            String::from_utf8_lossy(&body)
        ));
    }
    Ok(took)
}

struct Stats {
    latencies: Vec<Duration>,
    errors: usize,
    first_error: Option<String>,
    wall: Duration,
}

fn print(title: &str, mut s: Stats) {
    s.latencies.sort_unstable();
    let n = s.latencies.len();
    let pct = |p: f64| -> Duration {
        if n == 0 {
            return Duration::ZERO;
        }
        s.latencies[(((n as f64) * p).ceil() as usize).clamp(1, n) - 1]
    };
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{title:<34} n={n:>6} errors={:<3} p50={:>7.3} ms  p99={:>7.3} ms  max={:>8.3} ms  throughput={:>8.0} req/s",
        s.errors,
        ms(pct(0.50)),
        ms(pct(0.99)),
        ms(s.latencies.last().copied().unwrap_or_default()),
        n as f64 / s.wall.as_secs_f64(),
    );
    if let Some(e) = s.first_error {
        println!("    first error: {e}");
    }
}

async fn in_process(bodies: &[(Bytes, Expect)]) -> Stats {
    let lookup = lookup();
    let mut latencies = Vec::with_capacity(30_000);
    let mut errors = 0;
    let started = Instant::now();
    for i in 0..30_000 {
        let (body, expect) = &bodies[i % bodies.len()];
        let t = Instant::now();
        let (status, reply) = review(body, &lookup).await;
        latencies.push(t.elapsed());
        if status != http::StatusCode::OK || !check(&reply, *expect) {
            errors += 1;
        }
    }
    Stats {
        latencies,
        errors,
        first_error: None,
        wall: started.elapsed(),
    }
}

async fn paced(client: &HttpsClient, url: &str, bodies: &[(Bytes, Expect)]) -> Stats {
    let total = (RATE * PACED.as_secs()) as usize;
    let gate = Arc::new(Semaphore::new(PACED_IN_FLIGHT));
    let mut ticker = tokio::time::interval(Duration::from_nanos(1_000_000_000 / RATE));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::with_capacity(total);
    let started = Instant::now();
    for i in 0..total {
        ticker.tick().await;
        let Ok(permit) = gate.clone().acquire_owned().await else {
            break;
        };
        let (body, expect) = bodies[i % bodies.len()].clone();
        let (client, url) = (client.clone(), url.to_string());
        tasks.push(tokio::spawn(async move {
            let r = one(&client, &url, body, expect).await;
            drop(permit);
            r
        }));
    }
    collect(tasks, started).await
}

async fn unthrottled(client: &HttpsClient, url: &str, bodies: &[(Bytes, Expect)]) -> Stats {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let bodies = Arc::new(bodies.to_vec());
    let started = Instant::now();
    let deadline = started + UNTHROTTLED_TIME;
    let mut tasks = Vec::new();
    for _ in 0..CONCURRENCY {
        let (client, url, next, bodies) = (
            client.clone(),
            url.to_string(),
            next.clone(),
            bodies.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= UNTHROTTLED_MAX || Instant::now() >= deadline {
                    return out;
                }
                let (body, expect) = bodies[i % bodies.len()].clone();
                out.push(one(&client, &url, body, expect).await);
            }
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.extend(t.await.unwrap_or_default());
    }
    summarize(results, started.elapsed())
}

async fn collect(
    tasks: Vec<tokio::task::JoinHandle<Result<Duration, String>>>,
    started: Instant,
) -> Stats {
    let mut results = Vec::with_capacity(tasks.len());
    for t in tasks {
        results.push(t.await.unwrap_or_else(|e| Err(format!("task failed: {e}"))));
    }
    summarize(results, started.elapsed())
}

fn summarize(results: Vec<Result<Duration, String>>, wall: Duration) -> Stats {
    let mut s = Stats {
        latencies: Vec::with_capacity(results.len()),
        errors: 0,
        first_error: None,
        wall,
    };
    for r in results {
        match r {
            Ok(d) => s.latencies.push(d),
            Err(e) => {
                s.errors += 1;
                s.first_error.get_or_insert(e);
            }
        }
    }
    s
}

fn main() {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("could not start a runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = runtime.block_on(run()) {
        eprintln!("benchmark failed: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let sans = Sans {
        dns_names: vec!["localhost".into()],
        ip_addresses: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
    };
    let bundle = certs::issue_for(&sans, Duration::from_secs(3600))?;
    let resolver = Arc::new(CertResolver::from_pem(
        bundle.cert_pem.as_bytes(),
        bundle.key_pem.as_bytes(),
    )?);
    let registry = prometheus::Registry::new();
    let server = Server::bind(
        WebhookConfig::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))),
        Arc::new(lookup()),
        resolver,
        &registry,
    )
    .await?;
    let addr = server.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));

    let url = format!("https://127.0.0.1:{}/validate", addr.port());
    let bodies = bodies();
    let client = client(&bundle.ca_pem);
    println!(
        "admission webhook benchmark: {} CPUs, mix of allowed/denied/warned CREATEs, {} bytes per body",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        bodies[0].0.len()
    );

    print(
        "review() in process (no network)",
        in_process(&bodies).await,
    );
    // Warm up connections and caches.
    let _ = unthrottled_warmup(&client, &url, &bodies).await;
    print(
        &format!("HTTPS paced at {RATE} req/s for {}s", PACED.as_secs()),
        paced(&client, &url, &bodies).await,
    );
    print(
        &format!("HTTPS unthrottled, {CONCURRENCY} concurrent"),
        unthrottled(&client, &url, &bodies).await,
    );

    let _ = stop.send(());
    serving.await??;
    Ok(())
}

async fn unthrottled_warmup(
    client: &HttpsClient,
    url: &str,
    bodies: &[(Bytes, Expect)],
) -> Vec<Result<Duration, String>> {
    let mut out = Vec::new();
    for i in 0..200 {
        let (body, expect) = bodies[i % bodies.len()].clone();
        out.push(one(client, url, body, expect).await);
    }
    out
}
