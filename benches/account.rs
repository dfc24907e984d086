//! Benchmark of the account on real parts: 500 Subscriptions on the environment's kube-apiserver
//! and nats-server, `settle operator` (built by `cargo bench`, so optimised) as a process, and
//! every Subscription's counters rising every second for a minute. The runtime's side is its
//! documented wire format (docs/stats-report.md): one report per Subscription per second, put
//! into the `settle-stats` bucket as 500 application instances would. Prints, asserts nothing:
//!
//! - status writes per second over the minute (the interval bounds it at 500 / 10 s = 50/s);
//! - the lag from a counter's change (its report put) to status showing it: p50, p99, max
//!   (bounded by the interval, 10 s, plus the keeper's 1 s tick);
//! - the operator's peak RSS.
//!
//! Run with `make bench` (or `make env-up && cargo bench --bench account`).

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::operator::{Operator, TestStream};
use common::subs::{apply, backend_yaml};
use futures::StreamExt;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use settle::api::{ConsumerStats, Mode, Subscription};
use settle::bus::report::{REPORT_VERSION, StatsReport};

const N: usize = 500;
const STEADY: Duration = Duration::from_secs(60);
const WARMUP: Duration = Duration::from_secs(15);

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

/// Per Subscription: the acked values put and when, not yet seen in status.
type Sent = Arc<Mutex<HashMap<String, Vec<(u64, Instant)>>>>;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    common::install_crds();
    let env = common::env();
    let ns = common::namespace("bench-account");
    let stream = TestStream::new(&env.nats_url, "bench_account").await;
    let op = Operator::start_with("bench-account", &ns, &["--leader-election=false"]);
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    let mut all = String::new();
    for i in 0..N {
        all.push_str(&format!(
            "---\napiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: s{i}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{}.s{i}.>\"\n  mode: AtLeastOnce\n  durableName: d{i}\n  maxDeliver: 5\n",
            stream.prefix
        ));
    }
    let file = common::root().join(format!("target/bench-account-{}.yaml", std::process::id()));
    std::fs::write(&file, all).expect("manifests");
    let out = common::kubectl(&["apply", "-n", &ns, "-f", common::path_str(&file)], None);
    assert!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let kube = common::kube_client().await;
    let api: Api<Subscription> = Api::namespaced(kube.clone(), &ns);
    let sent: Sent = Arc::default();
    let lags = Arc::new(Mutex::new(Vec::<Duration>::new()));
    let measuring = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch = {
        let (sent, lags, measuring) = (sent.clone(), lags.clone(), measuring.clone());
        tokio::spawn(
            watcher(api.clone(), watcher::Config::default())
                .touched_objects()
                .for_each(move |ev| {
                    if let Ok(s) = ev {
                        let now = Instant::now();
                        let name = s.metadata.name.clone().unwrap_or_default();
                        let acked = s
                            .status
                            .and_then(|st| st.stats)
                            .map_or(0, |st| st.counters.settlement.acked);
                        let mut sent = sent.lock().expect("sent");
                        if let Some(list) = sent.get_mut(&name) {
                            let on = measuring.load(std::sync::atomic::Ordering::Relaxed);
                            list.retain(|(v, at)| {
                                if *v <= acked {
                                    if on {
                                        lags.lock().expect("lags").push(now - *at);
                                    }
                                    false
                                } else {
                                    true
                                }
                            });
                        }
                    }
                    futures::future::ready(())
                }),
        )
    };

    let kv = settle::backend::nats::capture::reports(&stream.js, Default::default())
        .await
        .expect("the report bucket");
    let started = settle::bus::report::default_instance();
    let t0 = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut seq = 0u64;
    let mut writes_before = 0.0;
    let mut measured_from = None;
    while t0.elapsed() < WARMUP + STEADY {
        tick.tick().await;
        seq += 1;
        if measured_from.is_none() && t0.elapsed() >= WARMUP {
            measuring.store(true, std::sync::atomic::Ordering::Relaxed);
            writes_before = op.metric("settle_account_status_writes_total", &[]);
            measured_from = Some(Instant::now());
        }
        for i in 0..N {
            let stats = ConsumerStats {
                offered: seq,
                delivered: seq,
                settlement: settle::api::Settlement {
                    acked: seq,
                    ..Default::default()
                },
                ..Default::default()
            };
            let report = StatsReport {
                version: REPORT_VERSION,
                namespace: ns.clone(),
                subscription: format!("s{i}"),
                subscription_uid: None,
                durable_name: Some(format!("d{i}")),
                instance: started.clone(),
                backend: "nats".into(),
                mode: Mode::AtLeastOnce,
                started_at_ms: 0,
                reported_at_ms: 0,
                sequence: seq,
                stats,
                runtime: Default::default(),
            };
            let body = serde_json::to_vec(&report).expect("json");
            sent.lock()
                .expect("sent")
                .entry(format!("s{i}"))
                .or_default()
                .push((seq, Instant::now()));
            kv.put(report.key(), body.into())
                .await
                .expect("put a report");
        }
    }
    let window = measured_from.map_or(STEADY, |t| t.elapsed());
    let writes = op.metric("settle_account_status_writes_total", &[]) - writes_before;
    // Let the last changes land.
    tokio::time::sleep(Duration::from_secs(13)).await;
    watch.abort();
    let mut lags = lags.lock().expect("lags").clone();
    lags.sort();
    println!(
        "account, {N} Subscriptions, every counter rising every second, --stats-interval 10s:"
    );
    println!(
        "  status writes: {writes:.0} in {:.1} s = {:.1}/s (bound: {N} / 10 s = {:.0}/s)",
        window.as_secs_f64(),
        writes / window.as_secs_f64(),
        N as f64 / 10.0
    );
    println!(
        "  counter change -> status: p50 {:.2} s, p99 {:.2} s, max {:.2} s ({} changes seen)",
        pct(&lags, 0.50).as_secs_f64(),
        pct(&lags, 0.99).as_secs_f64(),
        lags.last().copied().unwrap_or_default().as_secs_f64(),
        lags.len()
    );
    println!("  operator peak RSS {:.1} MiB", peak_rss_mib(op.pid()));
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
    let _ = std::fs::remove_file(&file);
    stream.delete().await;
}
