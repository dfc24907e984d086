//! The account on a real SQS-compatible server (ElasticMQ), end to end: `settle operator` as a
//! process against the real API server, the test application (`examples/account_app.rs`) on SQS
//! as another process, messages sent straight to the Subscription's queue, and `status.stats`
//! read back through the API (and `kubectl describe`, and /metrics). The runtime's reports
//! travel through the Subscription's report queue (`<queue>-settle-stats.fifo`) and the
//! operator keeps its ledger in `<queue>-settle-ledger.fifo`: counters are exact, survive the
//! operator's SIGKILL and the application's replacement (the scenario every broker runs,
//! `common::account::always_nack_scenario`), never go down in any status observed; a report
//! queue deleted on the server is made again and the reports flow again; forged reports
//! (misfiled, sequence_jump) are dropped; messages the redrive moved to the dead-letter queue
//! after a crash are counted once, through the broker side, and stay there for the user; the
//! account queues go with the Subscription; a handler blocked forever raises `Stalled` (the
//! scenario every broker runs, `common::account::stalled_scenario`).

use settle_testkit as common;

use std::time::Duration;

use common::account::{
    Halfway, Patience, STALL_SPEC, always_nack_scenario, assert_always_nack_shown, bodies,
    held_last_attempts_scenario, stall_flags, stalled_scenario,
};
use common::operator::{condition, poll};
use common::sqs::{SQS_OPERATOR_FLAGS, SqsScene, message_ids, url};
use settle::backend::sqs::report::{ledger_queue, report_queue};

const NACK: &str = "  mode: AtLeastOnce\n  maxDeliver: 3\n  ackWait: 2s\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn always_nack_on_sqs_is_counted_exactly_and_raises_exhausting() {
    let mut scene = SqsScene::new("acctsqs-nack", NACK, &[]).await;
    let s = always_nack_scenario(&mut scene, Halfway::Nothing).await;
    println!("always-nack on SQS: {s:?}");
    let (st, message) = assert_always_nack_shown(&scene).await;
    assert!(
        message.contains("counted where the broker dead-letters them"),
        "the broker side is watched on SQS: {message}"
    );
    let (status, reason, _) = condition(&st.conditions, "Accounted").expect("Accounted");
    assert_eq!((status.as_str(), reason.as_str()), ("True", "Kept"));
    let labels = [("namespace", scene.ns.as_str()), ("subscription", "orders")];
    assert_eq!(
        scene
            .op
            .metric("settle_subscription_delivered_total", &labels),
        30.0,
        "settle_subscription_delivered_total"
    );
    // The dead-letter queue still holds all ten: the operator only looked.
    let dlq = format!("{}-dlq", scene.queue());
    assert_eq!(message_ids(&scene.sqs, &dlq).await.len(), 10);
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_killed_three_times_while_reports_arrive_on_sqs_loses_and_doubles_nothing() {
    let mut scene = SqsScene::new("acctsqs-kill-mid", NACK, &[]).await;
    let s = always_nack_scenario(&mut scene, Halfway::OperatorKilledWhileReporting).await;
    println!("always-nack on SQS, operator SIGKILLed three times while reports arrive: {s:?}");
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_sigkilled_and_an_application_replaced_halfway_lose_and_double_nothing() {
    let mut scene = SqsScene::new("acctsqs-kill", NACK, &[]).await;
    let s = always_nack_scenario(&mut scene, Halfway::OperatorKilledAppReplaced).await;
    println!("always-nack on SQS, operator SIGKILLed and application replaced: {s:?}");
    // The ledger queue keeps the newest snapshot (older ones deleted as each is saved).
    let held = common::sqs::depth(&scene.sqs, &ledger_queue(&scene.queue())).await;
    assert!(
        (1..=2).contains(&held),
        "snapshots in the ledger queue: {held}"
    );
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_silent_and_delay_shortened_on_sqs_are_exact() {
    // Silence declines after the 3 s backoff; the application's hold limit is 5 s from the first
    // receive (SQS's 12 h, made short): the second decline cannot wait 3 s, so it is shortened.
    let scene = SqsScene::new(
        "acctsqs-silent",
        "  mode: AtLeastOnce\n  maxDeliver: 3\n  backoff: {initial: 3s, max: 3s, multiplier: 1}\n",
        &[("SETTLE_SQS_HOLD_LIMIT", "5s")],
    )
    .await;
    let app = scene.app("ack-even-silent-odd");
    app.wait_ready().await;
    scene.publish(bodies(10)).await;
    let s = scene
        .settled(
            "5 acked, 15 silent and 5 exhausted in status",
            Duration::from_secs(90),
            // delivered too: one report can show a settlement before the delivery it ends.
            |s| {
                s.settlement.acked >= 5
                    && s.settlement.silent >= 15
                    && s.exhausted >= 5
                    && s.delivered >= 20
            },
        )
        .await;
    println!("ack-even/silent-odd on SQS: {s:?}");
    assert_eq!(s.settlement.acked, 5, "{s:?}");
    assert_eq!(s.settlement.silent, 15, "{s:?}");
    assert_eq!(s.settlement.nacked, 0, "{s:?}");
    assert_eq!(s.delivered, 20, "{s:?}");
    assert_eq!(s.exhausted, 5, "{s:?}");
    assert_eq!(
        s.delay_shortened, 5,
        "each odd message's second decline: {s:?}"
    );
    // The report queue deleted on the server: made again at the next drift check (an Event
    // names it; `Accounted` says ReportQueueMissing while the keeper finds it gone, a moment
    // too short to wait for here), and the running application's reports reach status again.
    let reports = report_queue(&scene.queue());
    let u = url(&scene.sqs, &reports).await.expect("the report queue");
    scene
        .sqs
        .delete_queue()
        .queue_url(&u)
        .send()
        .await
        .expect("delete the report queue");
    poll(
        "the report queue made again by the operator",
        Duration::from_secs(60),
        || async {
            match url(&scene.sqs, &reports).await {
                Some(_) => Ok(()),
                None => Err("not yet".to_string()),
            }
        },
    )
    .await;
    let note = common::subs::wait_event(&scene.ns, "orders", "Recreated").await;
    assert!(note.contains(&reports), "{note}");
    assert!(
        url(&scene.sqs, &ledger_queue(&scene.queue()))
            .await
            .is_some()
    );
    scene.publish(["12".to_string(), "14".to_string()]).await;
    let s = scene
        .settled(
            "two more acked, through the report queue made again",
            Duration::from_secs(60),
            |s| s.settlement.acked >= 7 && s.delivered >= 22,
        )
        .await;
    assert_eq!(s.settlement.acked, 7, "{s:?}");
    assert_eq!(s.delivered, 22, "{s:?}");
    common::subs::wait_condition(
        &scene.api,
        "orders",
        "Accounted",
        "True",
        "Kept",
        Duration::from_secs(30),
    )
    .await;
    scene.assert_never_decreased();
    drop(app);
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_attempts_spent_by_a_crash_count_once_through_the_dead_letter_queue() {
    let scene = SqsScene::new("acctsqs-crash", NACK, &[]).await;
    // The process dies holding four messages on their last attempt: the runtime never counts
    // them. Their visibility runs out (ackWait), and the replacement's next receive finds them
    // past maxReceiveCount: the redrive moves them to the dead-letter queue, where the operator
    // counts each once.
    let (replacement, later) = held_last_attempts_scenario(
        &scene,
        Patience {
            limit: Duration::from_secs(60),
            quiet: Duration::from_secs(5),
            from: "the dead-letter queue",
        },
    )
    .await;
    println!("crash holding 4 last attempts on SQS: {later:?}");
    let dlq = format!("{}-dlq", scene.queue());
    assert_eq!(
        message_ids(&scene.sqs, &dlq).await.len(),
        4,
        "the user's dead-letter queue still holds all four"
    );
    drop(replacement);
    scene.finish().await;
}

/// A report as a runtime writes it (docs/stats-report.md), for Subscription `orders`.
fn report(ns: &str, instance: &str, sequence: u64, acked: u64) -> String {
    let now = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis(),
    )
    .expect("ms");
    // One life for the whole test (a new startedAtMs would be a new life of the name).
    static STARTED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let started = *STARTED.get_or_init(|| now - 1000);
    serde_json::json!({
        "version": 1, "namespace": ns, "subscription": "orders", "instance": instance,
        "backend": "sqs", "mode": "AtLeastOnce", "startedAtMs": started, "reportedAtMs": now,
        "sequence": sequence,
        "stats": {"offered": acked, "delivered": acked, "released": 0, "lost": 0,
                  "settlement": {"acked": acked, "nacked": 0, "silent": 0, "refused": 0},
                  "exhausted": 0, "stranded": 0, "leaseExpired": 0, "delayShortened": 0,
                  "foreignConflicts": 0},
        "runtime": {"handlerErrors": 0, "panics": 0}
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_report_is_dropped_and_the_account_queues_go_with_the_subscription() {
    let scene = SqsScene::new("acctsqs-forge", NACK, &[]).await;
    let reports = url(&scene.sqs, &report_queue(&scene.queue()))
        .await
        .expect("the report queue");
    let send = |body: String, group: &'static str| {
        let (c, u) = (scene.sqs.clone(), reports.clone());
        async move {
            c.send_message()
                .queue_url(u)
                .message_body(body)
                .message_group_id(group)
                .send()
                .await
                .expect("send a report");
        }
    };
    send(report(&scene.ns, "i1", 1, 1), "i1").await;
    scene
        .wait_stats("the real report counted", Duration::from_secs(30), |s| {
            s.settlement.acked == 1
        })
        .await;
    // Into this Subscription's report queue, naming another namespace's: misfiled (C18).
    send(report("elsewhere", "i1", 2, 100), "i1").await;
    common::account::wait_dropped(&scene.op, "misfiled", 1.0).await;
    // The same instance, its sequence far past the last one counted: sequence_jump (C19).
    send(report(&scene.ns, "i1", 1_000_000, 100), "i1").await;
    common::account::wait_dropped(&scene.op, "sequence_jump", 1.0).await;
    // The next real report still counts: nothing froze the instance.
    send(report(&scene.ns, "i1", 2, 2), "i1").await;
    let s = scene
        .wait_stats(
            "the next real report counted",
            Duration::from_secs(30),
            |s| s.settlement.acked == 2,
        )
        .await;
    println!("forged reports on SQS dropped; status: {s:?}");
    assert_eq!(s.settlement.acked, 2, "{s:?}");
    scene.assert_never_decreased();
    // Deleting the Subscription deletes its account queues with its queue (and its empty
    // dead-letter queue).
    scene.delete_orders(Duration::from_secs(60)).await;
    for q in [
        scene.queue(),
        format!("{}-dlq", scene.queue()),
        report_queue(&scene.queue()),
        ledger_queue(&scene.queue()),
    ] {
        assert!(url(&scene.sqs, &q).await.is_none(), "{q} is deleted");
    }
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_queue_holding_more_than_can_be_remembered_is_said_in_exhausting() {
    let scene = SqsScene::new("acctsqs-deep", NACK, &[]).await;
    let app = scene.app("nack");
    app.wait_ready().await;
    scene.publish(bodies(1)).await;
    scene
        .wait_stats("one message exhausted", Duration::from_secs(60), |s| {
            s.exhausted == 1 && s.settlement.nacked == 3
        })
        .await;
    // 1030 more sent straight to the dead-letter queue (no redrive moved them: never counted),
    // so it holds more than the 1024 ids the account remembers.
    let dlq = format!("{}-dlq", scene.queue());
    let dlq_url = url(&scene.sqs, &dlq).await.expect("the dead-letter queue");
    for batch in 0..103 {
        let entries: Vec<_> = (0..10)
            .map(|i| {
                aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                    .id(format!("m{i}"))
                    .message_body(format!("straight {batch}-{i}"))
                    .build()
                    .expect("an entry")
            })
            .collect();
        scene
            .sqs
            .send_message_batch()
            .queue_url(&dlq_url)
            .set_entries(Some(entries))
            .send()
            .await
            .expect("send a batch");
    }
    common::subs::wait_condition(
        &scene.api,
        "orders",
        "Exhausting",
        "True",
        "MessagesExhausted",
        Duration::from_secs(30),
    )
    .await;
    let message = poll(
        "Exhausting to say the dead-letter queue holds too many to count",
        Duration::from_secs(30),
        || async {
            let s = scene.api.get("orders").await.map_err(|e| e.to_string())?;
            let st = s.status.unwrap_or_default();
            let (_, _, m) = condition(&st.conditions, "Exhausting").ok_or("no Exhausting")?;
            if m.contains("holds 1031 messages") {
                Ok(m)
            } else {
                Err(m)
            }
        },
    )
    .await;
    assert!(message.contains("may undercount"), "{message}");
    let s = scene.stats().await;
    println!("dead-letter queue of 1031 on SQS: {s:?}; {message}");
    assert_eq!(s.exhausted, 1, "nothing sent straight there counts: {s:?}");
    drop(app);
    // Emptied, so the cleanup deletes it with the Subscription.
    scene
        .sqs
        .purge_queue()
        .queue_url(&dlq_url)
        .send()
        .await
        .expect("purge");
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_blocked_forever_on_sqs_raises_stalled_until_one_acks() {
    let scene = SqsScene::with_flags(
        "acctsqs-stall",
        STALL_SPEC,
        &[],
        &stall_flags(&SQS_OPERATOR_FLAGS),
    )
    .await;
    stalled_scenario(&scene).await;
    scene.finish().await;
}

/// A takeover under a running application (the scenario every broker runs): the new object
/// counts the new messages without a restart, and none of the old one's history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_on_sqs_under_a_running_application_counts_on_the_new_object_without_history() {
    let scene = SqsScene::new("acctsqs-takeover", NACK, &[]).await;
    common::account::takeover_under_a_running_app_scenario(&scene).await;
    scene.finish().await;
}

/// Delete and apply on SQS while five slow handlers run: their completions stay the old
/// object's, and the new one balances at rest (I1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_and_apply_on_sqs_across_slow_handlers_leaves_the_new_object_balanced() {
    let scene = SqsScene::new(
        "acctsqs-recreate-slow",
        &format!("{}  ackWait: 60s\n", common::account::SLOW_SPEC),
        &[],
    )
    .await;
    common::account::recreate_under_slow_handlers_scenario(&scene).await;
    scene.finish().await;
}
