//! Benchmark of the account on real parts: N Subscriptions (500 unless `cargo bench --bench
//! account -- N`) on the environment's kube-apiserver and nats-server, `settle operator` (built
//! by `cargo bench`, so optimised) as a process with its default status budget
//! (`--status-writes-per-second 20`, or `-- N RATE`), and every Subscription's counters rising
//! every second for a minute, one of them losing a message each second (round robin), or with a
//! third number L the first L of them each losing a message every second (an incident, or a
//! tenant with `maxDeliver: 1` on purpose: every one of them urgent at every interval). The
//! runtime's side is its documented wire format (docs/stats-report.md): one report per
//! Subscription per second, put into the `settle-stats` bucket as N application instances would.
//! Beyond 1,000 Subscriptions they are spread over streams of 1,000 (one nats-server's
//! default limit of consumers per stream is what would be measured otherwise). Prints, asserts
//! nothing:
//!
//! - status writes per second over the minute (bounded by the budget, and by N / 10 s);
//! - the lag from a loss (Exhausted growing: its report put) to status showing it: p50, p99,
//!   max (it goes before every other write);
//! - the lag from any other counter's change to status showing it: p50, p99, max (bounded by
//!   the interval, 10 s, plus the keeper's 1 s tick, and, past the budget, by N / rate);
//! - with L losing, the worst wait of the others (a change of a Subscription that loses nothing
//!   to status showing it) beside the bound the budget states for it: `--stats-interval` + the
//!   keeper's tick + 4 x the others waiting / rate (urgent writes go at most three in a row while
//!   others wait, so the others keep a quarter of the budget);
//! - the peak of `settle_account_status_backlog`, and the operator's peak RSS.
//!
//! Run with `make bench` (or `make env-up && cargo bench --bench account -- 1000`; 200 losing of
//! 400: `-- 400 20 200`).

use settle_testkit as common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::measure::{pct, peak_rss_mib};
use common::operator::{Operator, TestStream};
use common::subs::{apply, backend_yaml};
use futures::StreamExt;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use settle::api::{ConsumerStats, Subscription};

const STEADY: Duration = Duration::from_secs(60);
const WARMUP: Duration = Duration::from_secs(15);

/// Per Subscription: the values put (acked, or exhausted for losses) and when, not yet seen in
/// status.
type Sent = Arc<Mutex<HashMap<String, Vec<(u64, Instant)>>>>;

/// The positional numbers after `--`: N (500), the budget, then how many lose a message every
/// second (none: one loss a second, round robin).
fn args() -> (usize, Option<u32>, Option<usize>) {
    let nums = common::measure::numbers();
    let n = nums.first().map_or(500, |&n| n as usize).max(1);
    let rate = nums.get(1).and_then(|&r| u32::try_from(r).ok());
    let losing = nums.get(2).map(|&l| (l as usize).min(n));
    (n, rate, losing)
}

/// Subscriptions per stream beyond which they are spread over more streams.
const PER_STREAM: usize = 1000;

/// Sees `value` of each Subscription's `read` in status, and records the lag of every put it
/// covers.
fn seen(sent: &Sent, lags: &Mutex<Vec<Duration>>, on: bool, name: &str, value: u64, now: Instant) {
    let mut sent = sent.lock().expect("sent");
    if let Some(list) = sent.get_mut(name) {
        list.retain(|(v, at)| {
            if *v <= value {
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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (n, rate, losing) = args();
    common::install_crds();
    let env = common::env();
    let ns = common::namespace("bench-account");
    let mut streams = Vec::new();
    for _ in 0..n.div_ceil(PER_STREAM).max(1) {
        streams.push(TestStream::new(&env.nats_url, "bench_account").await);
    }
    let rate_flag = rate.map(|r| r.to_string());
    let mut flags = vec!["--leader-election=false"];
    if let Some(r) = &rate_flag {
        flags.extend(["--status-writes-per-second", r.as_str()]);
    }
    let budget = rate.unwrap_or(20);
    let op = Operator::start_with("bench-account", &ns, &flags);
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    let mut all = String::new();
    for i in 0..n {
        all.push_str(&format!(
            "---\napiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: s{i}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{}.s{i}.>\"\n  mode: AtLeastOnce\n  durableName: d{i}\n  maxDeliver: 5\n",
            streams[i / PER_STREAM].prefix
        ));
    }
    let file = common::root().join(format!("target/bench-account-{}.yaml", std::process::id()));
    std::fs::write(&file, all).expect("manifests");
    let applied = Instant::now();
    let out = common::kubectl(
        &[
            "apply",
            "--server-side",
            "-n",
            &ns,
            "-f",
            common::path_str(&file),
        ],
        None,
    );
    assert!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "  ({n} Subscriptions applied in {:.1} s)",
        applied.elapsed().as_secs_f64()
    );

    let kube = common::kube_client().await;
    let api: Api<Subscription> = Api::namespaced(kube.clone(), &ns);
    let sent: Sent = Arc::default();
    let losses: Sent = Arc::default();
    let lags = Arc::new(Mutex::new(Vec::<Duration>::new()));
    let loss_lags = Arc::new(Mutex::new(Vec::<Duration>::new()));
    let measuring = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch = {
        let (sent, losses, lags, loss_lags, measuring) = (
            sent.clone(),
            losses.clone(),
            lags.clone(),
            loss_lags.clone(),
            measuring.clone(),
        );
        tokio::spawn(
            watcher(api.clone(), watcher::Config::default())
                .touched_objects()
                .for_each(move |ev| {
                    if let Ok(s) = ev {
                        let now = Instant::now();
                        let name = s.metadata.name.clone().unwrap_or_default();
                        let stats = s.status.and_then(|st| st.stats).unwrap_or_default();
                        let on = measuring.load(std::sync::atomic::Ordering::Relaxed);
                        seen(
                            &sent,
                            &lags,
                            on,
                            &name,
                            stats.counters.settlement.acked,
                            now,
                        );
                        seen(
                            &losses,
                            &loss_lags,
                            on,
                            &name,
                            stats.counters.exhausted,
                            now,
                        );
                    }
                    futures::future::ready(())
                }),
        )
    };

    let kv = settle::backend::nats::capture::reports(&streams[0].js, Default::default(), 1)
        .await
        .expect("the report bucket");
    let started = settle::bus::report::default_instance();
    let t0 = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let mut exhausted = vec![0u64; n];
    let mut writes_before = 0.0;
    let mut measured_from = None;
    let mut peak_backlog = 0.0f64;
    let mut late_rounds = 0;
    while t0.elapsed() < WARMUP + STEADY {
        tick.tick().await;
        let round = Instant::now();
        seq += 1;
        if measured_from.is_none() && t0.elapsed() >= WARMUP {
            measuring.store(true, std::sync::atomic::Ordering::Relaxed);
            writes_before = op.metric("settle_account_status_writes_total", &[]);
            measured_from = Some(Instant::now());
        }
        if measured_from.is_some() {
            peak_backlog = peak_backlog.max(op.metric("settle_account_status_backlog", &[]));
        }
        // The losing Subscriptions lose a message each this second, or one does (round robin).
        let loses = |i: usize| match losing {
            Some(l) => i < l,
            None => i == (seq as usize) % n,
        };
        for (i, e) in exhausted.iter_mut().enumerate() {
            if loses(i) {
                *e += 1;
            }
        }
        let puts = (0..n).map(|i| {
            let stats = ConsumerStats {
                offered: seq,
                delivered: seq,
                settlement: settle::api::Settlement {
                    acked: seq - exhausted[i],
                    nacked: exhausted[i],
                    ..Default::default()
                },
                exhausted: exhausted[i],
                ..Default::default()
            };
            let name = format!("s{i}");
            let (key, body) =
                common::account::report_of(&ns, &name, &format!("d{i}"), &started, seq, stats);
            let now = Instant::now();
            if loses(i) {
                losses
                    .lock()
                    .expect("losses")
                    .entry(name.clone())
                    .or_default()
                    .push((exhausted[i], now));
            } else {
                sent.lock()
                    .expect("sent")
                    .entry(name)
                    .or_default()
                    .push((seq - exhausted[i], now));
            }
            let kv = kv.clone();
            async move { kv.put(key, body.into()).await.expect("put a report") }
        });
        futures::stream::iter(puts)
            .buffer_unordered(64)
            .collect::<Vec<_>>()
            .await;
        if round.elapsed() > Duration::from_secs(1) {
            late_rounds += 1;
        }
    }
    let window = measured_from.map_or(STEADY, |t| t.elapsed());
    let writes = op.metric("settle_account_status_writes_total", &[]) - writes_before;
    // Let the last changes land.
    tokio::time::sleep(Duration::from_secs(13)).await;
    watch.abort();
    let sorted = |v: &Mutex<Vec<Duration>>| {
        let mut v = v.lock().expect("lags").clone();
        v.sort();
        v
    };
    let (lags, loss_lags) = (sorted(&lags), sorted(&loss_lags));
    let unseen = |s: &Sent| {
        s.lock()
            .expect("sent")
            .values()
            .filter(|l| !l.is_empty())
            .count()
    };
    let losers = match losing {
        Some(l) => format!("{l} of them losing a message every second"),
        None => "one loss a second".to_string(),
    };
    println!(
        "account, {n} Subscriptions, every counter rising every second, {losers}, --stats-interval 10s, --status-writes-per-second {budget}:"
    );
    println!(
        "  status writes: {writes:.0} in {:.1} s = {:.1}/s (budget {budget}/s; interval bound {n} / 10 s = {:.0}/s)",
        window.as_secs_f64(),
        writes / window.as_secs_f64(),
        n as f64 / 10.0
    );
    let line = |what: &str, l: &[Duration]| {
        println!(
            "  {what} -> status: p50 {:.2} s, p99 {:.2} s, max {:.2} s ({} seen)",
            pct(l, 0.50).as_secs_f64(),
            pct(l, 0.99).as_secs_f64(),
            l.last().copied().unwrap_or_default().as_secs_f64(),
            l.len()
        );
    };
    line("loss (exhausted grew)", &loss_lags);
    line("other counter change", &lags);
    if let Some(l) = losing {
        // Every other Subscription changes every interval: at worst all of them wait at once.
        let others = (n - l) as f64;
        let bound = 10.0 + 1.0 + 4.0 * others / f64::from(budget);
        println!(
            "  worst wait of the {} that lose nothing: {:.1} s (stated bound: interval 10 s + tick 1 s + 4 x {others:.0} / {budget} = {bound:.0} s)",
            n - l,
            lags.last().copied().unwrap_or_default().as_secs_f64(),
        );
    }
    println!(
        "  peak backlog {peak_backlog:.0} Subscriptions; Subscriptions whose last change was not in status 13 s after the end: {} (losses: {})",
        unseen(&sent),
        unseen(&losses)
    );
    if late_rounds > 0 {
        println!("  ({late_rounds} rounds of puts took longer than their second)");
    }
    println!("  operator peak RSS {:.1} MiB", peak_rss_mib(op.pid()));
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
    let _ = std::fs::remove_file(&file);
    for stream in streams {
        stream.delete().await;
    }
}
