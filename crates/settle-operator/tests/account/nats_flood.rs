//! A tenant floods the account: anyone who can write to the report
//! bucket writes 500 reports of 1 MiB and 10,000 instance names under one Subscription. The
//! operator must drop what is past its bounds (counted), keep the Subscription's real counters
//! exact, stay under the chart's memory limit, and go on admitting `kubectl apply` meanwhile:
//! its webhook lives in the same process, so an operator taken down by the account would take
//! every Subscription write in the cluster with it (docs/semantics.md C20).
//!
//! The bucket here takes values of up to 2 MiB (`--report-bucket-max-value-bytes`, on a
//! nats-server of the test's own with a 2 MiB payload limit), so the flood reaches the operator
//! and only its own bounds stand in the way; with the shipped defaults the broker refuses such
//! values outright, which the second test shows.

use settle_testkit as common;

use std::time::Duration;

use futures::StreamExt;

use common::account::{NACK_SPEC, Scene, bodies};
use common::operator::{NatsServer, poll};
use common::{free_port, kubectl, kubectl_ok};

/// The chart's memory limit, in bytes (`resources.limits.memory` in values.yaml, in Mi).
fn chart_memory_limit() -> u64 {
    let values = std::fs::read_to_string(common::root().join("charts/settle/values.yaml"))
        .expect("the chart's values");
    let limits = values
        .lines()
        .find(|l| l.trim_start().starts_with("limits:") && l.contains("memory"))
        .expect("resources.limits in values.yaml");
    let mi = limits
        .split("memory:")
        .nth(1)
        .and_then(|rest| rest.trim().split(['M', ',', '}']).next())
        .and_then(|n| n.trim().parse::<u64>().ok())
        .expect("a memory limit in Mi");
    mi * 1024 * 1024
}

/// The most resident memory process `pid` ever had (VmHWM), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the process's status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmHWM")
        * 1024
}

/// A report of `instance` for Subscription `orders` in `ns`, padded to about `padding` bytes.
fn report(ns: &str, instance: &str, padding: usize) -> Vec<u8> {
    report_of(ns, "orders", instance, padding)
}

/// A report of `instance` for Subscription `subscription` in `ns`, padded to about `padding`
/// bytes.
fn report_of(ns: &str, subscription: &str, instance: &str, padding: usize) -> Vec<u8> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    serde_json::to_vec(&serde_json::json!({
        "version": 1, "namespace": ns, "subscription": subscription,
        "instance": instance, "backend": "nats", "mode": "AtLeastOnce",
        "startedAtMs": 1, "reportedAtMs": now, "sequence": 1,
        "stats": {"offered": 900_000, "delivered": 900_000, "exhausted": 900_000,
                  "settlement": {"nacked": 900_000}},
        "runtime": {}, "padding": "x".repeat(padding),
    }))
    .expect("json")
}

/// `kubectl apply` of Subscription `name` in `ns`: whether it was admitted, and what kubectl said.
async fn apply_subscription(ns: &str, name: &str, spec: &str) -> (bool, String) {
    let yaml = format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"flood.{name}.>\"\n{spec}"
    );
    let out = tokio::task::spawn_blocking(move || kubectl(&["apply", "-f", "-"], Some(&yaml)))
        .await
        .expect("kubectl ran");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_report_flood_is_dropped_counted_and_leaves_admission_and_memory_within_bounds() {
    let config = tempfile::NamedTempFile::new().expect("a config file");
    std::fs::write(config.path(), "max_payload: 2MB\n").expect("write the config");
    let config_path = config.path().display().to_string();
    let nats = NatsServer::start(&["-c", &config_path]);
    let webhook_port = free_port();
    let configuration = format!("settle-flood-{}", std::process::id());
    let webhook_addr = format!("127.0.0.1:{webhook_port}");
    let flags = [
        "--leader-election=false",
        "--stats-interval",
        "1s",
        "--report-bucket-max-value-bytes",
        "2097152",
        "--webhook-addr",
        &webhook_addr,
        "--webhook-configuration",
        &configuration,
    ];
    // Registered before the operator starts, so it writes its CA in at once; it serves the
    // scene's namespace (named as `common::namespace` names it) once that is labelled.
    common::register_subscription_webhook(
        &configuration,
        "settle-flood",
        &format!("flood-{}", std::process::id()),
        webhook_port,
    );
    let scene = Scene::build("flood", NACK_SPEC, &flags, &[], Some(nats.url())).await;
    kubectl_ok(
        &[
            "label",
            "namespace",
            &scene.ns,
            &format!("settle-flood={}", scene.ns),
        ],
        None,
    );
    // The webhook is in the path: a spec it refuses is refused at apply.
    poll(
        "the webhook refusing a bad spec",
        Duration::from_secs(60),
        || async {
            let (admitted, said) =
                apply_subscription(&scene.ns, "refused", "  mode: AtLeastOnce\n").await;
            if !admitted && said.contains("denied the request") {
                Ok(())
            } else {
                Err(said)
            }
        },
    )
    .await;

    // Real work first: 4 messages nacked out, counted exactly.
    let app = scene.app("nack");
    app.wait_ready().await;
    scene.publish(bodies(4)).await;
    let before = scene
        // Every counter, not exhausted alone: the broker's advisories can show 4 exhausted
        // before the runtime's last report says the 12th delivery (CI saw delivered 11 then 12).
        .settled("4 messages nacked out", Duration::from_secs(90), |s| {
            s.exhausted == 4 && s.delivered == 12 && s.settlement.nacked == 12
        })
        .await;
    drop(app);

    // The flood: 500 reports of 1 MiB, then 10,000 instance names, while Subscriptions are
    // applied.
    let js = &scene.stream.js;
    let reports = js
        .get_key_value("settle-stats")
        .await
        .expect("the report bucket");
    let ns = scene.ns.clone();
    let applying = {
        let ns = ns.clone();
        tokio::spawn(async move {
            let mut said = Vec::new();
            for i in 0..20 {
                said.push(apply_subscription(&ns, &format!("late-{i}"), "").await);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            said
        })
    };
    let big = futures::stream::iter(0..500)
        .map(|i| {
            let (reports, ns) = (reports.clone(), ns.clone());
            async move {
                let key = settle::bus::report::report_key(&ns, "orders", &format!("big-{i}"));
                reports
                    .put(key, report(&ns, &format!("big-{i}"), 1 << 20).into())
                    .await
                    .expect("a 1 MiB report is taken by this bucket");
            }
        })
        .buffer_unordered(8)
        .count()
        .await;
    let names = futures::stream::iter(0..10_000)
        .map(|i| {
            let (reports, ns) = (reports.clone(), ns.clone());
            async move {
                let key = settle::bus::report::report_key(&ns, "orders", &format!("n-{i}"));
                reports
                    .put(key, report(&ns, &format!("n-{i}"), 0).into())
                    .await
                    .expect("a small report");
            }
        })
        .buffer_unordered(64)
        .count()
        .await;
    assert_eq!((big, names), (500, 10_000));
    let applied = applying.await.expect("the applies ran");
    for (i, (admitted, said)) in applied.iter().enumerate() {
        assert!(
            admitted,
            "late-{i} was not admitted during the flood: {said}"
        );
    }

    // Every report was seen and judged: the big ones dropped unread, the names past the
    // instance cap dropped, the first 1,000 names counted (each its own 900,000).
    let dropped = |why: &str| {
        scene
            .op
            .metric("settle_account_reports_total", &[("outcome", why)])
    };
    poll(
        "every flooded report judged",
        Duration::from_secs(180),
        || async {
            let (large, many) = (dropped("too_large"), dropped("too_many_instances"));
            if large >= 500.0 && many >= 9_000.0 {
                Ok(())
            } else {
                Err(format!("too_large {large}, too_many_instances {many}"))
            }
        },
    )
    .await;
    let peak = peak_rss(scene.op.pid());
    let limit = chart_memory_limit();
    println!(
        "operator peak RSS {} MiB during the flood (chart limit {} MiB)",
        peak >> 20,
        limit >> 20
    );
    assert!(
        peak < limit,
        "the operator would be OOM-killed: peak RSS {peak} bytes past the chart's {limit}"
    );
    assert!(
        scene
            .op
            .get("/readyz")
            .is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    );
    // The real counters are still there, under what the flood added (status is a floor).
    let after = scene.stats().await;
    assert!(after.exhausted >= before.exhausted, "{after:?}");
    scene.assert_never_decreased();
    kubectl(
        &["delete", "validatingwebhookconfiguration", &configuration],
        None,
    );
    scene.finish().await;
}

/// With the shipped bounds, a report past 64 KiB is refused by the broker itself: nothing
/// holds it, not even the bucket.
#[tokio::test]
async fn the_report_bucket_refuses_a_value_past_its_bound() {
    let nats = NatsServer::start(&[]);
    let scene = Scene::build(
        "flood-bucket",
        NACK_SPEC,
        &common::account::OPERATOR_FLAGS,
        &[],
        Some(nats.url()),
    )
    .await;
    let js = &scene.stream.js;
    let reports = poll("the bucket bounded", Duration::from_secs(30), || async {
        let mut stream = js
            .get_stream("KV_settle-stats")
            .await
            .map_err(|e| e.to_string())?;
        let info = stream.info().await.map_err(|e| e.to_string())?;
        if info.config.max_message_size == 65_536 && info.config.max_bytes == 1 << 30 {
            js.get_key_value("settle-stats")
                .await
                .map_err(|e| e.to_string())
        } else {
            Err(format!(
                "{:?}",
                (info.config.max_message_size, info.config.max_bytes)
            ))
        }
    })
    .await;
    let key = settle::bus::report::report_key(&scene.ns, "orders", "big");
    let refused = reports
        .put(key.clone(), report(&scene.ns, "big", 100_000).into())
        .await;
    assert!(
        refused.is_err(),
        "a 100 kB report must be refused by the broker"
    );
    reports
        .put(key, report(&scene.ns, "big", 0).into())
        .await
        .expect("a small report is taken");
    scene.finish().await;
}

/// Ghost reports (for Subscriptions that do not exist) held by many Backends' keepers share one
/// budget for the process: with 16 NATS Backends in one namespace, each keeper reading the same
/// 256 reports of about 63 KiB, what the operator holds never passes `--max-early-report-bytes`
/// (16 MiB; it was 16 MiB a keeper, 256 MiB in all), the rest is dropped and counted, and
/// `kubectl apply` is admitted meanwhile. Prints the operator's peak RSS.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ghost_reports_read_by_many_backends_are_held_within_one_budget_for_the_process() {
    const BACKENDS: usize = 16;
    const GHOSTS: usize = 256;
    const BUDGET: f64 = 16.0 * 1024.0 * 1024.0;
    let nats = NatsServer::start(&[]);
    let webhook_port = free_port();
    let configuration = format!("settle-ghosts-{}", std::process::id());
    let webhook_addr = format!("127.0.0.1:{webhook_port}");
    let flags = [
        "--leader-election=false",
        "--stats-interval",
        "1s",
        "--webhook-addr",
        &webhook_addr,
        "--webhook-configuration",
        &configuration,
    ];
    common::register_subscription_webhook(
        &configuration,
        "settle-ghosts",
        &format!("ghosts-{}", std::process::id()),
        webhook_port,
    );
    let scene = Scene::build("ghosts", NACK_SPEC, &flags, &[], Some(nats.url())).await;
    kubectl_ok(
        &[
            "label",
            "namespace",
            &scene.ns,
            &format!("settle-ghosts={}", scene.ns),
        ],
        None,
    );
    for i in 1..BACKENDS {
        common::subs::apply(
            &scene.ns,
            &common::subs::backend_yaml(&format!("nats-{i}"), &nats.url()),
        );
    }
    let backends = common::subs::backends(&scene.ns).await;
    for i in 1..BACKENDS {
        common::subs::wait_backend(&backends, &format!("nats-{i}"), "True", "Connected").await;
    }
    let early_bytes = || scene.op.metric("settle_account_early_report_bytes", &[]);
    assert!(
        scene.op.exports("settle_account_early_report_bytes"),
        "the gauge is exported"
    );
    let reports = scene
        .stream
        .js
        .get_key_value("settle-stats")
        .await
        .expect("the report bucket");
    let ns = scene.ns.clone();
    let applying = {
        let ns = ns.clone();
        tokio::spawn(async move {
            let mut said = Vec::new();
            for i in 0..10 {
                said.push(apply_subscription(&ns, &format!("late-{i}"), "").await);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            said
        })
    };
    let written = futures::stream::iter(0..GHOSTS)
        .map(|i| {
            let (reports, ns) = (reports.clone(), ns.clone());
            async move {
                let ghost = format!("ghost-{i}");
                let key = settle::bus::report::report_key(&ns, &ghost, "pod-0");
                reports
                    .put(key, report_of(&ns, &ghost, "pod-0", 63 * 1024).into())
                    .await
                    .expect("a report under the bucket's 64 KiB");
            }
        })
        .buffer_unordered(16)
        .count()
        .await;
    assert_eq!(written, GHOSTS);
    let dropped = || {
        scene.op.metric(
            "settle_account_reports_total",
            &[("outcome", "early_dropped")],
        )
    };
    let mut most: f64 = 0.0;
    // Each keeper reads every ghost: what one budget cannot hold, 263 reports at most, is dropped.
    let least_dropped = (BACKENDS * GHOSTS) as f64 - (BUDGET / (63.0 * 1024.0)).ceil();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        most = most.max(early_bytes());
        let d = dropped();
        if d >= least_dropped {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "waited for {least_dropped} early reports dropped: {d} (holding {} bytes)",
            early_bytes()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for _ in 0..30 {
        most = most.max(early_bytes());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let applied = applying.await.expect("the applies ran");
    for (i, (admitted, said)) in applied.iter().enumerate() {
        assert!(admitted, "late-{i} was not admitted meanwhile: {said}");
    }
    let peak = peak_rss(scene.op.pid());
    println!(
        "{BACKENDS} Backends, {GHOSTS} ghost reports of 63 KiB: held at most {:.1} MiB, dropped {}, operator peak RSS {} MiB",
        most / 1024.0 / 1024.0,
        dropped(),
        peak >> 20
    );
    assert!(most > 0.0, "the ghosts were held while the budget allowed");
    assert!(
        most <= BUDGET,
        "held {most} bytes, past the process's budget of {BUDGET}"
    );
    assert!(
        peak < chart_memory_limit(),
        "peak RSS {peak} bytes past the chart's limit"
    );
    kubectl(
        &["delete", "validatingwebhookconfiguration", &configuration],
        None,
    );
    scene.finish().await;
}
