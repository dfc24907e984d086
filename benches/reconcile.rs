//! Benchmark of the controllers on real parts: 1,000 Subscriptions in one `kubectl apply -f` of a
//! multi-document file, through the registered webhook, against the environment's
//! kube-apiserver and nats-server, with `settle operator` (built by `cargo bench`, so optimised)
//! running as a process. Prints, asserts nothing:
//!
//! - seconds from the start of the apply until all are Ready (and how long the apply took);
//! - the lag from each object's creation to its Ready (p50/p95/max), timed by one watch (API
//!   timestamps have 1 s resolution);
//! - seconds to repair 10 consumers deleted on the broker;
//! - API requests and consumer-API calls per Subscription (the operator's own counters);
//! - status writes during 60 s of steady state;
//! - the operator's peak RSS.
//!
//! Run with `make bench` (or `make env-up && cargo bench --bench reconcile`).

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::free_port;
use common::operator::{Operator, TestStream};
use common::subs::{apply, backend_yaml};
use futures::StreamExt;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use settle::api::Subscription;
use settle::backend::nats::jsapi;

const N: usize = 1_000;
const REPAIRS: usize = 10;
const STEADY: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Seen {
    created: HashMap<String, Instant>,
    ready: HashMap<String, Instant>,
}

fn ready(s: &Subscription) -> bool {
    s.status
        .as_ref()
        .and_then(|st| common::operator::condition(&st.conditions, "Ready"))
        .is_some_and(|c| c.0 == "True")
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn peak_rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    common::install_crds();
    let env = common::env();
    let ns = common::namespace("bench-reconcile");
    let label = format!("settle.dev/bench-reconcile={}", std::process::id());
    common::kubectl_ok(&["label", "namespace", &ns, &label], None);

    // The webhook, registered for this namespace only, reached by url:.
    let webhook_port = free_port();
    let configuration = format!("settle-bench-{}", std::process::id());
    let mut vwc = common::install::shipped_webhook_configuration();
    vwc["metadata"]["name"] = serde_json::json!(configuration);
    let hook = &mut vwc["webhooks"][0];
    let path = hook["clientConfig"]["service"]["path"]
        .as_str()
        .unwrap_or("/validate")
        .to_string();
    hook["clientConfig"] =
        serde_json::json!({"url": format!("https://127.0.0.1:{webhook_port}{path}")});
    hook["namespaceSelector"] = serde_json::json!({
        "matchLabels": {"settle.dev/bench-reconcile": std::process::id().to_string()}
    });
    common::kubectl_ok(&["apply", "-f", "-"], Some(&vwc.to_string()));

    let stream = TestStream::new(&env.nats_url, "bench").await;
    let op = Operator::start_with(
        "bench",
        &ns,
        &[
            "--leader-election=false",
            "--webhook-addr",
            &format!("127.0.0.1:{webhook_port}"),
            "--webhook-configuration",
            &configuration,
        ],
    );
    // The webhook answers once the API server trusts its CA (the operator patched the caBundle).
    let probe = format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: probe}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{}.probe.>\"\n",
        stream.prefix
    );
    let start = Instant::now();
    while !common::kubectl(
        &["apply", "-n", &ns, "--dry-run=server", "-f", "-"],
        Some(&probe),
    )
    .status
    .success()
    {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the webhook never answered"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    let kube = common::kube_client().await;
    let backends: Api<settle::api::Backend> = Api::namespaced(kube.clone(), &ns);
    let start = Instant::now();
    loop {
        let b = backends.get("nats").await.expect("Backend");
        let up = b
            .status
            .as_ref()
            .and_then(|s| common::operator::condition(&s.conditions, "Ready"))
            .is_some_and(|c| c.0 == "True");
        if up {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the Backend never got Ready"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // One watch times every object: first seen, and first seen Ready.
    let seen = Arc::new(Mutex::new(Seen::default()));
    let api: Api<Subscription> = Api::namespaced(kube.clone(), &ns);
    let watch = {
        let seen = seen.clone();
        tokio::spawn(
            watcher(api.clone(), watcher::Config::default())
                .touched_objects()
                .for_each(move |ev| {
                    if let Ok(s) = ev {
                        let now = Instant::now();
                        let name = s.metadata.name.clone().unwrap_or_default();
                        let mut seen = seen.lock().expect("seen");
                        seen.created.entry(name.clone()).or_insert(now);
                        if ready(&s) {
                            seen.ready.entry(name).or_insert(now);
                        }
                    }
                    futures::future::ready(())
                }),
        )
    };
    tokio::time::sleep(Duration::from_secs(1)).await;

    let mut all = String::new();
    for i in 0..N {
        all.push_str(&format!(
            "---\napiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: s{i}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{}.s{i}.>\"\n  mode: AtLeastOnce\n  durableName: d{i}\n  maxDeliver: 5\n",
            stream.prefix
        ));
    }
    let file = common::root().join(format!(
        "target/bench-reconcile-{}.yaml",
        std::process::id()
    ));
    std::fs::write(&file, all).expect("manifests");

    let kube_before = op.metric("settle_kube_requests_total", &[]);
    let js_before = op.metric("settle_consumer_api_calls_total", &[]);
    let t0 = Instant::now();
    let out = common::kubectl(&["apply", "-n", &ns, "-f", common::path_str(&file)], None);
    let applied = t0.elapsed();
    assert!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    loop {
        if seen.lock().expect("seen").ready.len() >= N {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(600),
            "not all Ready after 600 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let all_ready = t0.elapsed();
    // Let the last status writes and advisories land before counting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let kube_calls = op.metric("settle_kube_requests_total", &[]) - kube_before;
    let js_calls = op.metric("settle_consumer_api_calls_total", &[]) - js_before;
    let mut lags: Vec<Duration> = {
        let s = seen.lock().expect("seen");
        s.ready
            .iter()
            .filter_map(|(n, r)| s.created.get(n).map(|c| r.saturating_duration_since(*c)))
            .collect()
    };
    lags.sort();

    // Repair: 10 consumers deleted on the broker.
    let mut before = HashMap::new();
    for i in 0..REPAIRS {
        let name = format!("d{i}");
        let info = stream.consumer(&name).await.expect("consumer exists");
        before.insert(name, info.created);
    }
    let t1 = Instant::now();
    for name in before.keys() {
        jsapi::delete_consumer(&stream.js, &stream.name, name)
            .await
            .expect("delete");
    }
    loop {
        let mut done = 0;
        for (name, created) in &before {
            if stream
                .consumer(name)
                .await
                .is_some_and(|i| i.created != *created)
            {
                done += 1;
            }
        }
        if done == REPAIRS {
            break;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(600),
            "not repaired after 600 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let repaired = t1.elapsed();

    // Steady state.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let writes_before = op.metric("settle_status_writes_total", &[]);
    let ops_before = op.metric("settle_consumer_operations_total", &[]);
    tokio::time::sleep(STEADY).await;
    let steady_writes = op.metric("settle_status_writes_total", &[]) - writes_before;
    let steady_ops = op.metric("settle_consumer_operations_total", &[]) - ops_before;
    let rss = peak_rss_mib(op.pid());

    println!("reconcile benchmark: {N} Subscriptions in one kubectl apply -f (webhook registered)");
    println!(
        "  kubectl apply took                 {:.2} s",
        applied.as_secs_f64()
    );
    println!(
        "  all Ready after the apply started  {:.2} s",
        all_ready.as_secs_f64()
    );
    println!(
        "  lag creation -> Ready (watch)      p50 {:.3} s, p95 {:.3} s, max {:.3} s ({} objects)",
        pct(&lags, 0.50).as_secs_f64(),
        pct(&lags, 0.95).as_secs_f64(),
        lags.last().copied().unwrap_or_default().as_secs_f64(),
        lags.len()
    );
    println!(
        "  repair of {REPAIRS} consumers deleted on the broker  {:.3} s",
        repaired.as_secs_f64()
    );
    println!(
        "  per Subscription: {:.2} API requests, {:.2} consumer-API calls",
        kube_calls / N as f64,
        js_calls / N as f64
    );
    println!(
        "  steady state, {} s: {steady_writes} status writes, {steady_ops} consumer operations",
        STEADY.as_secs()
    );
    println!("  operator peak RSS                  {rss:.1} MiB");

    watch.abort();
    stream.delete().await;
    common::kubectl_ok(
        &[
            "delete",
            "subscriptions",
            "--all",
            "-n",
            &ns,
            "--timeout=300s",
        ],
        None,
    );
    common::kubectl_ok(
        &["delete", "validatingwebhookconfiguration", &configuration],
        None,
    );
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
    let _ = std::fs::remove_file(&file);
    drop(op);
}
