//! Benchmark of the admission webhook endpoint. Prints figures; asserts nothing about timing or
//! memory (only that every answer is a 200 with the expected verdict).
//!
//! In process (the real HTTPS server on 127.0.0.1, on a tokio runtime of its own as in `settle
//! operator` (`SETTLE_BENCH_SERVER_RUNTIME=shared`: on the client's), a self-made certificate, a map-backed Backend lookup; a mix of allowed, denied and
//! warned reviews): p50/p99/max latency and throughput for (1) `review` without a network, (2) a
//! paced run at 1,000 requests/s (or the rate given after `paced`, e.g. `-- paced 5000`) for
//! 10 s over one HTTP/2 connection, as the API server sends them, evenly spaced (vegeta's way;
//! `SETTLE_BENCH_PACING=tick`: a tokio interval, five at once each millisecond at 5,000/s),
//! (3) an unthrottled run (HTTP/1.1 or HTTP/2, as negotiated). SETTLE_BENCH_RUNS repeats the
//! paced run and prints the median of each figure.
//!
//! Burst (needs the environment, `make env-up`: it runs `settle operator` as a process against
//! the API server): eight 3 MiB reviews holding about 200,000 annotations each, sent at once,
//! then 1,000 normal ones; prints the operator's RSS before, at its peak (VmHWM) and after, from
//! /proc/<pid>/status, and the latencies.
//!
//! `cargo bench --bench webhook` runs both; `-- paced [RATE]` or `-- burst` runs one.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use settle::api::Backend;
use settle_operator::admission::certs::{self, CertResolver, Sans};
use settle_operator::admission::webhook::{Server, StaticLookup, WebhookConfig, review};
use tokio::sync::Semaphore;

const NS: &str = "bench";
/// The paced run: this many requests per second (unless given after `paced`), for this long.
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
    client_with(ca_pem, false)
}

/// A client of `ca_pem`'s server; `h2_only`: every request over one HTTP/2 connection.
fn client_with(ca_pem: &str, h2_only: bool) -> HttpsClient {
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
        .http2_only(h2_only)
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

/// p50, p99 and max in ms, and the errors, of a run.
fn figures_of(s: &Stats) -> [f64; 4] {
    let mut l = s.latencies.clone();
    l.sort_unstable();
    let n = l.len();
    let pct = |p: f64| -> f64 {
        if n == 0 {
            return 0.0;
        }
        l[(((n as f64) * p).ceil() as usize).clamp(1, n) - 1].as_secs_f64() * 1e3
    };
    [
        pct(0.50),
        pct(0.99),
        l.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        s.errors as f64,
    ]
}

fn print(title: &str, s: Stats) {
    let [p50, p99, max, _] = figures_of(&s);
    let n = s.latencies.len();
    println!(
        "{title:<34} n={n:>6} errors={:<3} p50={p50:>7.3} ms  p99={p99:>7.3} ms  max={max:>8.3} ms  throughput={:>8.0} req/s",
        s.errors,
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

/// How the paced run spaces its requests.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pacing {
    /// From an OS thread that sleeps until each request's time (its timer slack set to 1 µs):
    /// evenly spaced, as vegeta paces (the issue's measure) and as an API server's requests
    /// arrive, one by one.
    Even,
    /// A tokio `interval`: its timer ticks in whole milliseconds, so at 5,000 a second it sends
    /// five at once each millisecond (`SETTLE_BENCH_PACING=tick`, to compare).
    Tick,
}

impl Pacing {
    fn from_env() -> Pacing {
        match std::env::var("SETTLE_BENCH_PACING").as_deref() {
            Ok("tick") => Pacing::Tick,
            _ => Pacing::Even,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Pacing::Even => "evenly",
            Pacing::Tick => "by 1 ms ticks",
        }
    }
}

/// Linux wakes a sleeping thread up to 50 µs late by default (its timer slack): 1 µs for the
/// calling thread.
#[allow(unsafe_code)]
fn tight_timer_slack() {
    // SAFETY: prctl(PR_SET_TIMERSLACK) takes plain integers and changes only the calling
    // thread's slack.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1u64, 0u64, 0u64, 0u64);
    }
}

/// The request numbers, each at its time: `rate` a second, `total` in all.
fn pace(pacing: Pacing, rate: u64, total: usize) -> tokio::sync::mpsc::UnboundedReceiver<usize> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let period = Duration::from_nanos(1_000_000_000 / rate);
    match pacing {
        Pacing::Even => {
            std::thread::spawn(move || {
                tight_timer_slack();
                let start = Instant::now();
                for i in 0..total {
                    let due = start + period.saturating_mul(u32::try_from(i).unwrap_or(u32::MAX));
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                    if tx.send(i).is_err() {
                        return;
                    }
                }
            });
        }
        Pacing::Tick => {
            tokio::spawn(async move {
                let mut ticker = tokio::time::interval(period);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                for i in 0..total {
                    ticker.tick().await;
                    if tx.send(i).is_err() {
                        return;
                    }
                }
            });
        }
    }
    rx
}

async fn paced(
    client: &HttpsClient,
    url: &str,
    bodies: &[(Bytes, Expect)],
    rate: u64,
    pacing: Pacing,
) -> Stats {
    let total = (rate * PACED.as_secs()) as usize;
    let gate = Arc::new(Semaphore::new(PACED_IN_FLIGHT));
    let mut due = pace(pacing, rate, total);
    let mut tasks = Vec::with_capacity(total);
    let started = Instant::now();
    while let Some(i) = due.recv().await {
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
    let args: Vec<String> = std::env::args().skip(1).collect();
    let only = |mode: &str| {
        let picked: Vec<&String> = args
            .iter()
            .filter(|a| ["paced", "burst"].contains(&a.as_str()))
            .collect();
        picked.is_empty() || picked.iter().any(|a| *a == mode)
    };
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
    let rate = args
        .iter()
        .skip_while(|a| *a != "paced")
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(RATE);
    let runs = std::env::var("SETTLE_BENCH_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(1usize)
        .max(1);
    if only("paced")
        && let Err(e) = runtime.block_on(run(rate, runs))
    {
        eprintln!("benchmark failed: {e}");
        std::process::exit(1);
    }
    if only("burst")
        && let Err(e) = runtime.block_on(burst::run())
    {
        eprintln!("burst benchmark failed: {e}");
        std::process::exit(1);
    }
}

async fn run(rate: u64, runs: usize) -> Result<(), Box<dyn std::error::Error>> {
    let sans = Sans {
        dns_names: vec!["localhost".into()],
        ip_addresses: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
    };
    let bundle = certs::issue_for(&sans, Duration::from_secs(3600))?;
    let resolver = Arc::new(CertResolver::from_pem(
        bundle.cert_pem.as_bytes(),
        bundle.key_pem.as_bytes(),
    )?);
    // The server on a runtime of its own, as in `settle operator` (a worker per core): the
    // client's tasks do not queue in the server's scheduler (they share the two cores still).
    let (addr, stop, serving) = serve(resolver).await?;

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
    let h2 = client_with(&bundle.ca_pem, true);
    let _ = unthrottled_warmup(&h2, &url, &bodies).await;
    let pacing = Pacing::from_env();
    let mut figures = Vec::new();
    for run in 1..=runs {
        let s = paced(&h2, &url, &bodies, rate, pacing).await;
        figures.push(figures_of(&s));
        print(
            &format!(
                "HTTP/2 paced at {rate} req/s ({}) for {}s{}",
                pacing.name(),
                PACED.as_secs(),
                if runs > 1 {
                    format!(" ({run}/{runs})")
                } else {
                    String::new()
                }
            ),
            s,
        );
    }
    if runs > 1 {
        let med = |i: usize| {
            let mut v: Vec<f64> = figures.iter().map(|f: &[f64; 4]| f[i]).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        println!(
            "median of {runs} paced runs: p50={:.3} ms  p99={:.3} ms  max={:.3} ms  errors={:.0}; load average {}",
            med(0),
            med(1),
            med(2),
            med(3),
            std::fs::read_to_string("/proc/loadavg")
                .unwrap_or_default()
                .trim()
        );
    }
    print(
        &format!("HTTPS unthrottled, {CONCURRENCY} concurrent"),
        unthrottled(&client, &url, &bodies).await,
    );

    let _ = stop.send(());
    serving
        .join()
        .await
        .map_err(|e| format!("the webhook server: {e}").into())
}

type ServerResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Where the server runs.
enum Serving {
    /// Its own runtime, in a thread.
    Thread(std::thread::JoinHandle<ServerResult>),
    /// The client's runtime (`SETTLE_BENCH_SERVER_RUNTIME=shared`, as before 2026-12-05).
    Task(tokio::task::JoinHandle<ServerResult>),
}

impl Serving {
    async fn join(self) -> ServerResult {
        match self {
            Serving::Thread(t) => t
                .join()
                .unwrap_or_else(|_| Err("the webhook server's thread panicked".into())),
            Serving::Task(t) => t
                .await
                .unwrap_or_else(|e| Err(format!("the webhook server's task: {e}").into())),
        }
    }
}

async fn bind_and_serve(
    resolver: Arc<CertResolver>,
    bound: std::sync::mpsc::Sender<SocketAddr>,
    stopped: tokio::sync::oneshot::Receiver<()>,
) -> ServerResult {
    let registry = prometheus::Registry::new();
    let server = Server::bind(
        WebhookConfig::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))),
        Arc::new(lookup()),
        resolver,
        &registry,
    )
    .await?;
    let _ = bound.send(server.local_addr()?);
    server
        .run(async {
            let _ = stopped.await;
        })
        .await?;
    Ok(())
}

/// Starts the webhook server, on a multi-thread runtime of its own in a thread unless
/// `SETTLE_BENCH_SERVER_RUNTIME=shared`; its address, how to stop it, and where it runs.
async fn serve(
    resolver: Arc<CertResolver>,
) -> Result<(SocketAddr, tokio::sync::oneshot::Sender<()>, Serving), Box<dyn std::error::Error>> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (bound, addr) = std::sync::mpsc::channel();
    let serving = if std::env::var("SETTLE_BENCH_SERVER_RUNTIME").as_deref() == Ok("shared") {
        let serving = Serving::Task(tokio::spawn(bind_and_serve(resolver, bound, stopped)));
        tokio::task::yield_now().await;
        serving
    } else {
        Serving::Thread(std::thread::spawn(move || {
            tokio::runtime::Runtime::new()?.block_on(bind_and_serve(resolver, bound, stopped))
        }))
    };
    let addr = tokio::task::spawn_blocking(move || addr.recv()).await?;
    match addr {
        Ok(addr) => Ok((addr, stop, serving)),
        Err(_) => Err(match serving.join().await {
            Err(e) => format!("the webhook server did not start: {e}").into(),
            Ok(()) => "the webhook server did not start".into(),
        }),
    }
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

/// Eight 3 MiB reviews at once against `settle operator`, then 1,000 normal ones; the
/// operator's memory from /proc.
mod burst {
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use hyper::body::Bytes;
    use serde_json::{Value, json};

    use super::{Expect, HttpsClient, Stats, client, one, print, summarize};

    /// Reviews of about 3 MiB: the API server's request limit.
    const BIG_BYTES: usize = 3 << 20;
    const BIG: usize = 8;
    const NORMAL: usize = 1_000;
    /// Normal reviews in flight at once.
    const NORMAL_CONCURRENCY: usize = 8;

    type Error = Box<dyn std::error::Error>;

    /// The operator process, killed when dropped.
    struct Operator {
        child: Child,
        log: PathBuf,
    }

    impl Drop for Operator {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    impl Operator {
        fn logged_addr(&self, message: &str) -> Option<String> {
            std::fs::read_to_string(&self.log)
                .ok()?
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|v| v["message"] == message)
                .and_then(|v| v["addr"].as_str().map(str::to_string))
        }

        /// (VmRSS, VmHWM) in KiB.
        fn memory(&self) -> Result<(u64, u64), Error> {
            let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
            let field = |name: &str| -> Result<u64, Error> {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                    .ok_or_else(|| format!("no {name} in /proc/{}/status", self.child.id()).into())
            };
            Ok((field("VmRSS:")?, field("VmHWM:")?))
        }
    }

    fn mib(kib: u64) -> f64 {
        kib as f64 / 1024.0
    }

    /// KUBECONFIG from the environment, or from the env file `make env-up` writes.
    fn kubeconfig() -> Result<PathBuf, Error> {
        if let Some(k) = std::env::var_os("KUBECONFIG") {
            return Ok(PathBuf::from(k));
        }
        let dir = std::env::var_os("SETTLE_ENV_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| settle_testkit::root().join("target/env"));
        let file = dir.join("settle.env");
        let text = std::fs::read_to_string(&file).map_err(|e| {
            format!(
                "the burst benchmark runs settle operator against the API server: start the environment with `make env-up` ({}: {e})",
                file.display()
            )
        })?;
        text.lines()
            .find_map(|l| l.strip_prefix("export KUBECONFIG="))
            .map(PathBuf::from)
            .ok_or_else(|| format!("{} sets no KUBECONFIG", file.display()).into())
    }

    fn kubectl(kubeconfig: &PathBuf, args: &[&str]) -> Result<String, Error> {
        let out = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args)
            .output()?;
        if !out.status.success() {
            return Err(
                format!("kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr)).into(),
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// A CREATE review of a valid Subscription (allowed, no warnings) carrying `annotations`
    /// tiny annotations.
    fn review(uid: &str, ns: &str, annotations: usize) -> Vec<u8> {
        let annotations: serde_json::Map<String, Value> = (0..annotations)
            .map(|i| (format!("a{i:07}"), json!("v")))
            .collect();
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": {"group": "messaging.settle.dev", "version": "v1alpha1", "kind": "Subscription"},
                "resource": {"group": "messaging.settle.dev", "version": "v1alpha1", "resource": "subscriptions"},
                "name": "orders", "namespace": ns, "operation": "CREATE",
                "userInfo": {"username": "bench"},
                "object": {
                    "apiVersion": "messaging.settle.dev/v1alpha1", "kind": "Subscription",
                    "metadata": {"name": "orders", "namespace": ns, "annotations": annotations},
                    "spec": {"backendRef": {"name": "nats"}, "pattern": "orders.>", "mode": "AtLeastOnce",
                             "durableName": "orders", "ackWait": "30s"},
                },
                "dryRun": false,
            }
        }))
        .expect("encode")
    }

    /// A big review: as many annotations as fit in [`BIG_BYTES`].
    fn big_review(uid: &str, ns: &str) -> Vec<u8> {
        // Each annotation `"a0000000":"v",` is 15 bytes.
        let base = review(uid, ns, 0).len();
        review(uid, ns, (BIG_BYTES - base) / 15)
    }

    pub async fn run() -> Result<(), Error> {
        let kubeconfig = kubeconfig()?;
        let crds = settle_testkit::root().join("crds/settle.yaml");
        kubectl(
            &kubeconfig,
            &[
                "apply",
                "--server-side",
                "--force-conflicts",
                "-f",
                &crds.display().to_string(),
            ],
        )?;
        kubectl(
            &kubeconfig,
            &[
                "wait",
                "--for=condition=Established",
                "--timeout=60s",
                "crd/backends.messaging.settle.dev",
                "crd/subscriptions.messaging.settle.dev",
            ],
        )?;
        let ns = format!("settle-bench-{}", std::process::id());
        kubectl(&kubeconfig, &["create", "namespace", &ns])?;
        // The Backend the reviews name, so each lookup is answered from the operator's cache.
        let backend = std::env::temp_dir().join(format!("{ns}-backend.yaml"));
        std::fs::write(
            &backend,
            format!(
                "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: nats, namespace: {ns}}}\nspec: {{nats: {{servers: [\"nats://127.0.0.1:4222\"]}}}}\n"
            ),
        )?;
        let applied = kubectl(
            &kubeconfig,
            &["apply", "-f", &backend.display().to_string()],
        );
        let _ = std::fs::remove_file(&backend);
        applied?;
        let result = measure(&kubeconfig, &ns).await;
        let _ = kubectl(&kubeconfig, &["delete", "namespace", &ns, "--wait=false"]);
        result
    }

    async fn measure(kubeconfig: &PathBuf, ns: &str) -> Result<(), Error> {
        let log = settle_testkit::root().join(format!(
            "target/bench-webhook-operator-{}.log",
            std::process::id()
        ));
        let child = Command::new(env!("CARGO_BIN_EXE_settle"))
            .args(["operator", "--log-format", "json"])
            .args([
                "--webhook-addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "127.0.0.1:0",
                "--probe-addr",
                "127.0.0.1:0",
            ])
            .args(["--namespace", ns, "--webhook-secret", "settle-bench-tls"])
            .args(["--webhook-configuration", "", "--webhook-ips", "127.0.0.1"])
            .env("KUBECONFIG", kubeconfig)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        let operator = Operator { child, log };
        let started = Instant::now();
        let addr = loop {
            if let Some(addr) = operator.logged_addr("admission webhook listening") {
                break addr;
            }
            if started.elapsed() > Duration::from_secs(60) {
                return Err(format!(
                    "settle operator did not start listening within 60s; see {}",
                    operator.log.display()
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let ca = kubectl(
            kubeconfig,
            &[
                "get",
                "secret",
                "settle-bench-tls",
                "-n",
                ns,
                "-o",
                "jsonpath={.data.ca\\.crt}",
            ],
        )?;
        let ca = String::from_utf8(base64_decode(ca.trim())?)?;
        let client = client(&ca);
        let url = format!("https://{addr}/validate");

        // Warm up: connections, and the Backend in the operator's cache (a review naming a
        // Backend the cache lacks is still answered, after a GET; poll until it is cached).
        let normal = Bytes::from(review("warm", ns, 3));
        let warm_until = Instant::now() + Duration::from_secs(30);
        while let Err(e) = one(&client, &url, normal.clone(), Expect::Allowed).await {
            if Instant::now() > warm_until {
                return Err(format!("the warm-up review never came back allowed: {e}").into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for _ in 0..50 {
            one(&client, &url, normal.clone(), Expect::Allowed).await?;
        }
        let (start_rss, start_hwm) = operator.memory()?;

        let bodies: Vec<Bytes> = (0..BIG)
            .map(|i| Bytes::from(big_review(&format!("big-{i}"), ns)))
            .collect();
        println!(
            "burst against settle operator (pid {}): {BIG} reviews of {:.2} MiB ({} annotations each) at once, then {NORMAL} normal ones, {NORMAL_CONCURRENCY} at a time",
            operator.child.id(),
            bodies[0].len() as f64 / (1024.0 * 1024.0),
            (bodies[0].len() - review("x", ns, 0).len()) / 15,
        );
        let burst_started = Instant::now();
        let tasks: Vec<_> = bodies
            .into_iter()
            .map(|body| {
                let (client, url) = (client.clone(), url.clone());
                tokio::spawn(async move { one(&client, &url, body, Expect::Allowed).await })
            })
            .collect();
        let mut results = Vec::new();
        for t in tasks {
            results.push(t.await.unwrap_or_else(|e| Err(format!("task failed: {e}"))));
        }
        let burst = summarize(results, burst_started.elapsed());
        let (after_burst_rss, peak) = operator.memory()?;

        let normal_started = Instant::now();
        let normal = normal_run(&client, &url, ns).await;
        let normal_wall = normal_started.elapsed();
        // Let the allocator give back what it will.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (final_rss, final_hwm) = operator.memory()?;

        print(&format!("{BIG} × 3 MiB at once"), burst);
        print(
            &format!("then {NORMAL} normal reviews"),
            Stats {
                wall: normal_wall,
                ..normal
            },
        );
        println!(
            "operator RSS: start {:.1} MiB (high-water {:.1} MiB before the burst), peak {:.1} MiB (VmHWM), after the burst {:.1} MiB, final {:.1} MiB ({:+.1} MiB from the start; VmHWM {:.1} MiB)",
            mib(start_rss),
            mib(start_hwm),
            mib(peak),
            mib(after_burst_rss),
            mib(final_rss),
            mib(final_rss) - mib(start_rss),
            mib(final_hwm),
        );
        println!("    goals: peak under 100 MiB, final within 20 MiB of the start");
        Ok(())
    }

    async fn normal_run(client: &HttpsClient, url: &str, ns: &str) -> Stats {
        let body = Bytes::from(review("normal", ns, 3));
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..NORMAL_CONCURRENCY {
            let (client, url, body, next) =
                (client.clone(), url.to_string(), body.clone(), next.clone());
            tasks.push(tokio::spawn(async move {
                let mut out = Vec::new();
                while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < NORMAL {
                    out.push(one(&client, &url, body.clone(), Expect::Allowed).await);
                }
                out
            }));
        }
        let mut results = Vec::new();
        for t in tasks {
            results.extend(t.await.unwrap_or_default());
        }
        summarize(results, Duration::ZERO)
    }

    /// Standard base64, as kubectl prints Secret data.
    fn base64_decode(text: &str) -> Result<Vec<u8>, Error> {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = Vec::with_capacity(text.len() * 3 / 4);
        let (mut acc, mut bits) = (0u32, 0u32);
        for c in text.bytes().filter(|c| *c != b'=') {
            let v = ALPHABET
                .iter()
                .position(|a| *a == c)
                .ok_or("the Secret's ca.crt is not base64")? as u32;
            acc = (acc << 6) | v;
            bits += 6;
            if bits >= 8 {
                bits -= 8;
                out.push((acc >> bits) as u8);
                acc &= (1 << bits) - 1;
            }
        }
        Ok(out)
    }
}
