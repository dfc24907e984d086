//! The cluster-wide status budget (docs/semantics.md C21): `settle
//! operator` as a process on the real API server and nats-server, with
//! `--status-writes-per-second 2` and `--stats-interval 1s`, and twelve Subscriptions whose
//! counters move every second (their runtime's reports put into `settle-stats`, the documented
//! wire format, as twelve application instances would): they want twelve writes a second, the
//! budget gives two. The test proves that the writes stay within the budget, that a loss
//! (Exhausted growing) reaches status while the others' writes wait, and that at rest every
//! Subscription shows its exact counts, none having stepped down on the way.

use settle_testkit as common;

use std::time::{Duration, Instant};

use common::account::{assert_never_decreased, report_of, watch};
use common::operator::{Operator, TestStream, poll};
use common::subs::{apply, backend_yaml, subs, wait_ready};
use settle::api::{ConsumerStats, Settlement};

const SUBSCRIPTIONS: usize = 12;
const RATE: f64 = 2.0;

fn counts(seq: u64, exhausted: u64) -> ConsumerStats {
    ConsumerStats {
        offered: seq,
        delivered: seq,
        settlement: Settlement {
            acked: seq - exhausted,
            nacked: exhausted,
            ..Default::default()
        },
        exhausted,
        ..Default::default()
    }
}

#[tokio::test]
async fn under_the_budget_a_loss_goes_first_writes_stay_within_it_and_status_ends_exact() {
    common::install_crds();
    let env = common::env();
    let ns = common::namespace("account-budget");
    let stream = TestStream::new(&env.nats_url, "account_budget").await;
    // Before the operator starts: its whole life is within this time.
    let born = Instant::now();
    let op = Operator::start_with(
        "account-budget",
        &ns,
        &[
            "--leader-election=false",
            "--stats-interval",
            "1s",
            "--status-writes-per-second",
            "2",
        ],
    );
    apply(&ns, &backend_yaml("nats", &env.nats_url));
    let names: Vec<String> = (0..SUBSCRIPTIONS).map(|i| format!("s{i}")).collect();
    for name in &names {
        apply(
            &ns,
            &format!(
                "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: {name}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{}.{name}.>\"\n  mode: AtLeastOnce\n  durableName: {name}\n  maxDeliver: 3\n",
                stream.prefix
            ),
        );
    }
    let api = subs(&ns).await;
    for name in &names {
        wait_ready(&api, name).await;
    }
    let watchers: Vec<_> = names.iter().map(|n| watch(&api, n)).collect();
    let kv = settle::backend::nats::capture::reports(&stream.js, Default::default(), 1)
        .await
        .expect("the report bucket");
    let instance = settle::bus::report::default_instance();
    let put = |name: &str, seq: u64, exhausted: u64| {
        let (key, body) = report_of(&ns, name, name, &instance, seq, counts(seq, exhausted));
        let kv = kv.clone();
        async move { kv.put(key, body.into()).await.expect("put a report") }
    };

    // Every counter moves every second until the budget has a backlog.
    let mut seq = 0;
    let backlog = || op.metric("settle_account_status_backlog", &[]);
    loop {
        seq += 1;
        for name in &names {
            put(name, seq, 0).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        if backlog() >= 3.0 {
            break;
        }
        assert!(
            seq < 60,
            "no backlog after {seq} s of twelve Subscriptions moving"
        );
    }

    // s0 loses a message; the others move once more. s0's loss reaches status while their
    // writes still wait: judged by the order the API server gives the namespace's status
    // writes in one watch (the order they were made), not by reading twelve objects after.
    let order: std::sync::Arc<std::sync::Mutex<Vec<(String, u64, u64)>>> = Default::default();
    let recorder = {
        use futures::StreamExt;
        use kube::runtime::watcher::{self, Event};
        let (api, order) = (api.clone(), order.clone());
        tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher::watcher(api, watcher::Config::default()));
            while let Some(event) = events.next().await {
                if let Ok(Event::Apply(sub)) = event {
                    let c = sub.status.and_then(|s| s.stats).map(|s| s.counters);
                    let (acked, exhausted) =
                        c.map_or((0, 0), |c| (c.settlement.acked, c.exhausted));
                    let name = sub.metadata.name.unwrap_or_default();
                    if let Ok(mut order) = order.lock() {
                        order.push((name, acked, exhausted));
                    }
                }
            }
        })
    };
    // The watch has listed before anything moves again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    seq += 1;
    for name in &names[1..] {
        put(name, seq, 0).await;
    }
    put(&names[0], seq, 1).await;
    let waiting = poll(
        "s0's loss to reach status",
        Duration::from_secs(60),
        || async {
            let s0 = api.get("s0").await.map_err(|e| e.to_string())?;
            let exhausted = s0
                .status
                .and_then(|s| s.stats)
                .map_or(0, |s| s.counters.exhausted);
            if exhausted == 0 {
                return Err("exhausted 0".to_string());
            }
            // Read at the moment status shows the loss: what still waits.
            Ok(backlog())
        },
    )
    .await;
    // Every other Subscription's last counts written, then: which came after s0's loss.
    poll(
        "every Subscription's last counts in the watch",
        Duration::from_secs(60),
        || async {
            let order = order.lock().map(|o| o.clone()).unwrap_or_default();
            let done = names[1..]
                .iter()
                .all(|n| order.iter().any(|(m, acked, _)| m == n && *acked >= seq));
            if done {
                Ok(())
            } else {
                Err(format!("not yet: {} events", order.len()))
            }
        },
    )
    .await;
    recorder.abort();
    let order = order.lock().map(|o| o.clone()).unwrap_or_default();
    let loss = order
        .iter()
        .position(|(n, _, exhausted)| n == "s0" && *exhausted > 0)
        .expect("s0's loss in the watch");
    let behind = names[1..]
        .iter()
        .filter(|n| {
            order
                .iter()
                .position(|(m, acked, _)| m == *n && *acked >= seq)
                .is_some_and(|at| at > loss)
        })
        .count();
    assert!(
        waiting > 0.0,
        "the backlog was empty when the loss reached status"
    );
    assert!(
        behind > 0,
        "every other Subscription showed its last counts before s0's loss: it did not go first"
    );
    assert!(op.metric("settle_account_status_urgent_writes_total", &[]) >= 1.0);
    assert!(
        op.metric(
            "settle_account_status_writes_deferred_total",
            &[("reason", "budget")]
        ) > 0.0
    );
    assert!(
        op.metric(
            "settle_account_status_writes_deferred_total",
            &[("reason", "coalesced")]
        ) > 0.0
    );

    // At rest: every Subscription shows exactly its last report, s0 its one loss.
    let last = seq;
    for name in &names {
        let want = counts(last, u64::from(name == "s0"));
        common::account::wait_until(
            &format!("{name} to show {want:?} at rest"),
            Duration::from_secs(90),
            || async {
                api.get(name)
                    .await
                    .ok()
                    .and_then(|s| s.status?.stats)
                    .map(|s| s.counters)
                    .unwrap_or_default()
            },
            |s| *s == want,
        )
        .await;
    }
    poll("the backlog to empty", Duration::from_secs(30), || async {
        match backlog() {
            0.0 => Ok(()),
            v => Err(format!("{v}")),
        }
    })
    .await;

    // Within the budget the whole time: the bucket's burst (1 at 2/s) plus 2 a second.
    let writes = op.metric("settle_account_status_writes_total", &[]);
    let bound = RATE * born.elapsed().as_secs_f64() + 1.0;
    assert!(
        writes <= bound,
        "{writes} status writes in {:.1} s, past the budget's {bound:.0}",
        born.elapsed().as_secs_f64()
    );
    assert!(writes > 0.0);
    println!(
        "{writes} writes in {:.1} s; at the loss {waiting} waited, {behind} of 11 behind",
        born.elapsed().as_secs_f64()
    );
    for (seen, task) in &watchers {
        task.abort();
        assert_never_decreased(seen);
    }
    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
    stream.delete().await;
}
