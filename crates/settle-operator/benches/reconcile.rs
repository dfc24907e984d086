//! Benchmark of the controllers on real parts, and their cost curve: N Subscriptions (1,000
//! unless `cargo bench --bench reconcile -- N`) server-side applied in chunks of 250, four at a
//! time (as a GitOps tool syncs a folder), through the registered webhook, against the environment's
//! kube-apiserver and nats-server, with `settle operator` (built by `cargo bench`, so optimised)
//! running as a process. Beyond 1,000 Subscriptions they are spread over streams of 1,000 (a
//! nats-server allows 1,000 consumers per stream by default: past it the curve would measure
//! that limit, not Settle). Prints, asserts nothing, per N:
//!
//! - seconds from the start of the apply until all are Ready (and how long the apply took);
//! - the lag from each object's creation to its Ready (p50/p95/max), timed by one watch (API
//!   timestamps have 1 s resolution);
//! - an update of every spec (maxDeliver 5 -> 6, in place): seconds until all show it;
//! - seconds to repair 10 consumers deleted on the broker;
//! - API requests (the controllers', and the account's status writes, which follow Ready at
//!   the account's budget: the create phase ends when all of them landed) and consumer-API
//!   calls per Subscription on create and on update (the operator's own counters);
//! - status writes (the controllers' and the account's), consumer operations and the account's
//!   gauge calls to the broker during 60 s of steady state;
//! - the operator's resident memory before, after the update phase and at its peak, the growth
//!   per Subscription, and its CPU seconds per phase.
//!
//! Run with `make bench` (or `make env-up && cargo bench --bench reconcile -- 10000`).

use settle_testkit as common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::free_port;
use common::measure::{cpu_seconds, load_average, pct, peak_rss_mib, rss_mib, rss_parts_mib};
use common::operator::{Operator, TestStream, metric_exported, metric_sum};
use common::subs::{apply, backend_yaml};
use futures::StreamExt;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use settle::api::Subscription;
use settle::backend::nats::admin;

/// Consumers deleted on the broker for the repair (at most N).
const REPAIRS: usize = 10;
const STEADY: Duration = Duration::from_secs(60);
/// Subscriptions per stream beyond which they are spread over more streams.
const PER_STREAM: usize = 1000;
/// Objects per server-side apply.
const CHUNK: usize = 250;
/// Applies at once.
const APPLIERS: usize = 4;

#[derive(Default)]
struct Seen {
    created: HashMap<String, Instant>,
    ready: HashMap<String, Instant>,
    /// First seen Ready at generation 2 (the update).
    updated: HashMap<String, Instant>,
}

fn ready(s: &Subscription) -> bool {
    s.status
        .as_ref()
        .and_then(|st| common::operator::condition(&st.conditions, "Ready"))
        .is_some_and(|c| c.0 == "True")
}

fn observed(s: &Subscription) -> i64 {
    s.status
        .as_ref()
        .and_then(|st| st.observed_generation)
        .unwrap_or(0)
}

/// The N Subscriptions' manifests with `max_deliver`, server-side applied in chunks, `APPLIERS`
/// at a time (as a GitOps tool syncs a folder); returns how long it took.
fn apply_all(ns: &str, prefixes: &[String], n: usize, max_deliver: u32) -> Duration {
    let t = Instant::now();
    let chunks: Vec<usize> = (0..n).step_by(CHUNK).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..APPLIERS {
            scope.spawn(|| {
                loop {
                    let c = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&start) = chunks.get(c) else { break };
                    apply_chunk(ns, prefixes, start, (start + CHUNK).min(n), max_deliver, c);
                }
            });
        }
    });
    t.elapsed()
}

fn apply_chunk(ns: &str, prefixes: &[String], from: usize, to: usize, max_deliver: u32, c: usize) {
    let mut docs = String::new();
    for i in from..to {
        docs.push_str(&format!(
            "---\napiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: s{i}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{}.s{i}.>\"\n  mode: AtLeastOnce\n  durableName: d{i}\n  maxDeliver: {max_deliver}\n",
            prefixes[i / PER_STREAM]
        ));
    }
    let file = common::root().join(format!(
        "target/bench-reconcile-{}-{c}.yaml",
        std::process::id()
    ));
    std::fs::write(&file, docs).expect("manifests");
    let out = common::kubectl(
        &[
            "apply",
            "--server-side",
            "--field-manager=bench-gitops",
            "-n",
            ns,
            "-f",
            common::path_str(&file),
        ],
        None,
    );
    let _ = std::fs::remove_file(&file);
    assert!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The account's status writes so far (`settle_account_status_writes_total`, ok and error)
/// and the Subscriptions whose write waits (`settle_account_status_backlog`), from one scrape:
/// at 10,000 Subscriptions a scrape is itself work the operator's CPU figures would count.
fn account_progress(op: &Operator) -> (f64, f64) {
    let text = op.get("/metrics").unwrap_or_default();
    assert!(
        metric_exported(&text, "settle_account_status_writes_total"),
        "the operator exports settle_account_status_writes_total"
    );
    (
        metric_sum(&text, "settle_account_status_writes_total", &[]),
        metric_sum(&text, "settle_account_status_backlog", &[]),
    )
}

/// Waits until the account wrote at least `writes` statuses in all and none waits; returns
/// when, from `since`, to the second (at most 30 min).
async fn account_settled(op: &Operator, writes: f64, since: Instant) -> Duration {
    loop {
        let (written, waiting) = account_progress(op);
        if written >= writes && waiting == 0.0 {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < Duration::from_secs(1800),
            "the account's writes not all in status after 30 min"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Waits until `count(seen)` reaches `n` (at most 30 min).
async fn until(seen: &Mutex<Seen>, n: usize, since: Instant, count: impl Fn(&Seen) -> usize) {
    while count(&seen.lock().expect("seen")) < n {
        assert!(
            since.elapsed() < Duration::from_secs(1800),
            "not all there after 30 min"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let numbers = common::measure::numbers();
    let n = numbers.first().map_or(1000, |&n| n as usize).max(1);
    // `-- N 0` skips the update phase (it takes as long as the create).
    let update = numbers.get(1).is_none_or(|&u| u != 0);
    common::install_crds();
    let env = common::env();
    let ns = common::namespace("bench-reconcile");
    let label = format!("settle.dev/bench-reconcile={}", std::process::id());
    common::kubectl_ok(&["label", "namespace", &ns, &label], None);

    // The webhooks, registered for this namespace only, reached by url:: the validating one and
    // the mutating one that puts the finalizer on as a Subscription is stored.
    let webhook_port = free_port();
    let configuration = format!("settle-bench-{}", std::process::id());
    let pid = std::process::id().to_string();
    for shipped in [
        common::install::shipped_webhook_configuration(),
        common::install::shipped_mutating_configuration(),
    ] {
        let registered = common::install::by_url(
            shipped,
            &configuration,
            webhook_port,
            "settle.dev/bench-reconcile",
            &pid,
        );
        common::kubectl_ok(&["apply", "-f", "-"], Some(&registered.to_string()));
    }

    let mut streams = Vec::new();
    for _ in 0..n.div_ceil(PER_STREAM) {
        streams.push(TestStream::new(&env.nats_url, "bench").await);
    }
    let prefixes: Vec<String> = streams.iter().map(|s| s.prefix.clone()).collect();
    let stream = &streams[0];
    let webhook_addr = format!("127.0.0.1:{webhook_port}");
    let flags = [
        "--leader-election=false",
        "--webhook-addr",
        &webhook_addr,
        "--webhook-configuration",
        &configuration,
    ];
    let op = Operator::start_with("bench", &ns, &flags);
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
                            if observed(&s) >= 2 {
                                seen.updated.entry(name.clone()).or_insert(now);
                            }
                            seen.ready.entry(name).or_insert(now);
                        }
                    }
                    futures::future::ready(())
                }),
        )
    };
    tokio::time::sleep(Duration::from_secs(1)).await;

    let pid = op.pid();
    let (rss_before, cpu_before) = (rss_mib(pid), cpu_seconds(pid));
    let parts_before = rss_parts_mib(pid);
    let kube_before = op.metric("settle_kube_requests_total", &[]);
    let js_before = op.metric("settle_consumer_api_calls_total", &[]);
    let account_before = account_progress(&op).0;
    let t0 = Instant::now();
    let applied = apply_all(&ns, &prefixes, n, 5);
    until(&seen, n, t0, |s| s.ready.len()).await;
    let all_ready = t0.elapsed();
    // Let the last status writes and advisories land before counting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let kube_calls = op.metric("settle_kube_requests_total", &[]) - kube_before;
    let js_calls = op.metric("settle_consumer_api_calls_total", &[]) - js_before;
    let by_call: Vec<String> = ["stream", "info", "create", "update", "delete"]
        .iter()
        .map(|c| {
            format!(
                "{c} {:.2}",
                op.metric("settle_consumer_api_calls_total", &[("call", c)]) / n as f64
            )
        })
        .collect();
    // The account writes each new Subscription's status once (its counters at zero, its
    // gauges and conditions), paced by its budget (`--status-writes-per-second`): an API
    // request per Subscription on create too, after Ready. Counted until every one has landed.
    let account_shown = account_settled(&op, account_before + n as f64, t0).await;
    let account_calls = account_progress(&op).0 - account_before;
    let (rss_created, cpu_created) = (rss_mib(pid), cpu_seconds(pid));
    let mut lags: Vec<Duration> = {
        let s = seen.lock().expect("seen");
        s.ready
            .iter()
            .filter_map(|(n, r)| s.created.get(n).map(|c| r.saturating_duration_since(*c)))
            .collect()
    };
    lags.sort();

    // Update: every spec changed in place.
    let (kube_before, js_before, account_before) = (
        op.metric("settle_kube_requests_total", &[]),
        op.metric("settle_consumer_api_calls_total", &[]),
        account_progress(&op).0,
    );
    let t2 = Instant::now();
    let (mut update_applied, mut all_updated) = (Duration::ZERO, Duration::ZERO);
    if update {
        update_applied = apply_all(&ns, &prefixes, n, 6);
        until(&seen, n, t2, |s| s.updated.len()).await;
        all_updated = t2.elapsed();
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let kube_update = op.metric("settle_kube_requests_total", &[]) - kube_before;
    let account_update = account_progress(&op).0 - account_before;
    let js_update = op.metric("settle_consumer_api_calls_total", &[]) - js_before;
    let (rss_updated, cpu_updated) = (rss_mib(pid), cpu_seconds(pid));

    // Repair: 10 consumers deleted on the broker.
    let mut before = HashMap::new();
    let repairs = REPAIRS.min(n);
    for i in 0..repairs {
        let name = format!("d{i}");
        let info = stream.consumer(&name).await.expect("consumer exists");
        before.insert(name, info.created);
    }
    let t1 = Instant::now();
    for name in before.keys() {
        admin::delete_consumer(&stream.js, &stream.name, name)
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
        if done == repairs {
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
    let account_before = account_progress(&op).0;
    let ops_before = op.metric("settle_consumer_operations_total", &[]);
    let gauges_before = op.metric("settle_account_gauge_calls_total", &[]);
    tokio::time::sleep(STEADY).await;
    let steady_writes = op.metric("settle_status_writes_total", &[]) - writes_before;
    let steady_account = account_progress(&op).0 - account_before;
    let steady_ops = op.metric("settle_consumer_operations_total", &[]) - ops_before;
    // The account's broker calls at rest: its consumers' gauges, once a stats interval.
    let steady_gauges = op.metric("settle_account_gauge_calls_total", &[]) - gauges_before;
    let (rss_steady, cpu_steady) = (rss_mib(pid), cpu_seconds(pid));
    let peak = peak_rss_mib(pid);
    let parts_steady = rss_parts_mib(pid);
    let heap = |part: &str| op.metric("settle_memory_heap_bytes", &[("part", part)]) / 1048576.0;
    let (heap_used, heap_free) = (heap("in_use") + heap("mapped"), heap("free"));

    println!(
        "reconcile benchmark: {n} Subscriptions on {} stream(s), server-side applied in chunks of {CHUNK}, {APPLIERS} at once (validating and mutating webhooks registered; load average {})",
        streams.len(),
        load_average()
    );
    println!(
        "  apply took {:.1} s; all Ready {:.1} s after it started",
        applied.as_secs_f64(),
        all_ready.as_secs_f64()
    );
    println!(
        "  lag creation -> Ready (watch)      p50 {:.3} s, p95 {:.3} s, max {:.3} s ({} objects)",
        pct(&lags, 0.50).as_secs_f64(),
        pct(&lags, 0.95).as_secs_f64(),
        lags.last().copied().unwrap_or_default().as_secs_f64(),
        lags.len()
    );
    if update {
        println!(
            "  update of every spec: apply {:.1} s; all Ready at generation 2 {:.1} s after it started",
            update_applied.as_secs_f64(),
            all_updated.as_secs_f64()
        );
    } else {
        println!("  update phase skipped (-- N 0)");
    }
    println!(
        "  repair of {repairs} consumers deleted on the broker  {:.3} s",
        repaired.as_secs_f64()
    );
    println!(
        "  the account's status writes on create: {:.2} per Subscription, the last in status {:.1} s after the apply started",
        account_calls / n as f64,
        account_shown.as_secs_f64()
    );
    println!(
        "  per Subscription on create: {:.2} API requests ({:.2} by the controllers, {:.2} the account's writes), {:.2} consumer-API calls; on update: {:.2} ({:.2}, {:.2}), {:.2}",
        (kube_calls + account_calls) / n as f64,
        kube_calls / n as f64,
        account_calls / n as f64,
        js_calls / n as f64,
        (kube_update + account_update) / n as f64,
        kube_update / n as f64,
        account_update / n as f64,
        js_update / n as f64
    );
    println!(
        "  consumer-API calls per Subscription by call, operator start to all Ready: {}",
        by_call.join(", ")
    );
    println!(
        "  steady state, {} s: {steady_writes} status writes by the controllers and {steady_account} by the account, {steady_ops} consumer operations, {steady_gauges} gauge calls to the broker, {:.2} CPU s",
        STEADY.as_secs(),
        cpu_steady - cpu_updated
    );
    println!(
        "  CPU seconds: create {:.1}, update {:.1}",
        cpu_created - cpu_before,
        cpu_updated - cpu_created
    );
    println!(
        "  RSS: {rss_before:.1} MiB before, {rss_created:.1} after create, {rss_updated:.1} after update, {rss_steady:.1} at rest, peak {peak:.1}; {:.1} KiB per Subscription (at rest - before)",
        (rss_steady - rss_before) * 1024.0 / n as f64
    );
    println!(
        "  RSS by kind: anonymous (heap, stacks) {:.1} MiB before, {:.1} at rest; file-backed (the binary as mapped) {:.1} before, {:.1} at rest",
        parts_before.0, parts_steady.0, parts_before.1, parts_steady.1
    );
    println!(
        "  heap at rest (settle_memory_heap_bytes): {heap_used:.1} MiB in use, {heap_free:.1} MiB free in the allocator; {:.1} KiB in use per Subscription",
        heap_used * 1024.0 / n as f64
    );
    // The same figures as one machine-readable line, the columns of docs/img/cost-curve.tsv:
    // `hack/charts.py --from-bench FILE` puts it in the row for this N.
    println!(
        "bench-row\tcost-curve\tn={n}\trss_rest_mib={rss_steady:.1}\trss_per_sub_kib={:.1}\tlag_p50_s={:.3}\tlag_p95_s={:.3}\tlag_max_s={:.3}\tapi_per_sub={:.2}\tall_ready_s={:.1}\tcpu_rest_s_per_min={:.2}",
        (rss_steady - rss_before) * 1024.0 / n as f64,
        pct(&lags, 0.50).as_secs_f64(),
        pct(&lags, 0.95).as_secs_f64(),
        lags.last().copied().unwrap_or_default().as_secs_f64(),
        (kube_calls + account_calls) / n as f64,
        all_ready.as_secs_f64(),
        (cpu_steady - cpu_updated) * 60.0 / STEADY.as_secs_f64()
    );

    // A profiler's view of the heap at rest (`SETTLE_BENCH_PROFILE_AT_REST=1` with
    // `SETTLE_OPERATOR_WRAPPER="heaptrack ..."`): the profiled operator ends here, before the
    // delete, and another one, on the same webhook address and not profiled, removes the
    // Subscriptions' finalizers.
    let op = if std::env::var_os("SETTLE_BENCH_PROFILE_AT_REST").is_some() {
        // The profiler writes what it saw in batches: the last scrape's frees are in before the
        // kill.
        tokio::time::sleep(Duration::from_secs(3)).await;
        drop(op);
        Operator::start_unwrapped("bench-delete", &ns, &flags)
    } else {
        op
    };
    watch.abort();
    for s in streams {
        s.delete().await;
    }
    // Deleted without kubectl's wait, which at 3,000 and more ran out of its client's rate
    // limit before its timeout; the operator takes each finalizer off, and a list of one says
    // when none is left.
    common::kubectl_ok(
        &[
            "delete",
            "subscriptions",
            "--all",
            "-n",
            &ns,
            "--wait=false",
        ],
        None,
    );
    let left = Instant::now();
    loop {
        let page = api
            .list_metadata(&kube::api::ListParams::default().limit(1))
            .await;
        if page.is_ok_and(|p| p.items.is_empty()) {
            break;
        }
        assert!(
            left.elapsed() < Duration::from_secs(1800),
            "the Subscriptions not all gone 30 min after their delete"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    common::kubectl_ok(
        &[
            "delete",
            "validatingwebhookconfiguration,mutatingwebhookconfiguration",
            &configuration,
        ],
        None,
    );
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
    drop(op);
}
