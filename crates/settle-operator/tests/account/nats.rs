//! The account end to end: `settle operator` as a process against the real API server and a real
//! nats-server, an application built on the `settle` library (`examples/account_app.rs`) as
//! another process, messages published to the broker, and `status.stats` read back through the
//! API (and `kubectl describe`). Every counter is asserted exactly, and every status observed
//! during a run is checked to never go down. A handler blocked forever raises `Stalled` (the
//! scenario every broker runs, `common::account::stalled_scenario`).

use settle_testkit as common;

use std::time::Duration;

use common::account::{
    Halfway, NACK_SPEC, OPERATOR_FLAGS, Patience, STALL_SPEC, Scene, always_nack_scenario,
    assert_always_nack_shown, bodies, held_last_attempts_scenario, stall_flags, stalled_scenario,
};
use common::operator::condition;

/// Always nack, maxDeliver 3, 10 messages in two halves, with `halfway` between them (the
/// scenario every broker runs, `common::account::always_nack_scenario`): the final account is
/// the same whatever happened.
async fn always_nack(test: &str, halfway: Halfway) -> Scene {
    let mut scene = Scene::new(test, NACK_SPEC).await;
    always_nack_scenario(&mut scene, halfway).await;
    if halfway == Halfway::OperatorKilled {
        // The runtime's own count hides the broker's: the restarted operator must have read
        // the five terminate advisories captured while it was down (more when acknowledgements
        // sent just before the kill were lost: those come again and the ledger skips them).
        let read = scene
            .op
            .metric("settle_account_advisories_total", &[("kind", "terminated")]);
        assert!(
            read >= 5.0,
            "the advisories captured while the operator was down are read: {read}"
        );
    }
    scene
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn always_nack_exhausts_every_message_and_raises_exhausting() {
    let scene = always_nack("acct-nack", Halfway::Nothing).await;
    let (st, _) = assert_always_nack_shown(&scene).await;
    let (status, reason, _) =
        condition(&st.conditions, "Stranding").expect("a Stranding condition");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "NoneStranded")
    );
    assert!(st.stats_updated_at.is_some(), "statsUpdatedAt is set");
    // The controllers' conditions are still there beside the account's.
    assert_eq!(
        condition(&st.conditions, "Ready").map(|c| c.0),
        Some("True".into())
    );

    let labels = [("namespace", scene.ns.as_str()), ("subscription", "orders")];
    assert_eq!(
        scene.op.metric("settle_subscription_nacked_total", &labels),
        30.0
    );
    assert_eq!(
        scene.op.metric("settle_subscription_exhausting", &labels),
        1.0
    );
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_killed_halfway_loses_and_doubles_nothing() {
    always_nack("acct-opkill", Halfway::OperatorKilled)
        .await
        .finish()
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_killed_three_times_while_reports_arrive_loses_and_doubles_nothing() {
    always_nack("acct-opkill-mid", Halfway::OperatorKilledWhileReporting)
        .await
        .finish()
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_restarted_halfway_loses_and_doubles_nothing() {
    always_nack("acct-apprestart", Halfway::AppRestarted)
        .await
        .finish()
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_and_silent_are_exact() {
    let scene = Scene::new(
        "acct-silent",
        "  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 2\n",
    )
    .await;
    let app = scene.app("ack-even-silent-odd");
    app.wait_ready().await;
    scene.publish(bodies(10)).await;
    // Evens acked once; odds silent twice (silence declines, S4), then Exhausted.
    let s = scene
        .wait_stats(
            "5 acked and 10 silent in status",
            Duration::from_secs(60),
            |s| s.settlement.acked >= 5 && s.settlement.silent >= 10 && s.exhausted >= 5,
        )
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(scene.stats().await, s, "nothing more arrives");
    assert_eq!(s.settlement.acked, 5, "{s:?}");
    assert_eq!(s.settlement.silent, 10, "{s:?}");
    assert_eq!(s.settlement.nacked, 0, "{s:?}");
    assert_eq!(s.delivered, 15, "{s:?}");
    assert_eq!(s.exhausted, 5, "{s:?}");
    scene.assert_never_decreased();
    drop(app);
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_last_attempt_no_handler_finished_counts_exhausted_once_through_the_broker() {
    let scene = Scene::new(
        "acct-sigkill",
        "  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 3\n  ackWait: 2s\n",
    )
    .await;
    // The process dies holding four messages on their last attempt: the runtime never counts them.
    // nats-server notices that their attempts ran out when their ack wait does while a pull
    // waits (the replacement's, as a Deployment would start it), and says so once. That can be
    // within two seconds of the consumer's making, before the controller's status naming it
    // reaches the operator's cache under load (CI once): the advisories wait for it.
    let (_replacement, _) = held_last_attempts_scenario(
        &scene,
        Patience {
            limit: Duration::from_secs(40),
            quiet: Duration::from_secs(4),
            from: "the broker's advisories",
        },
    )
    .await;
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_blocked_forever_raises_stalled_until_one_acks() {
    let scene = Scene::with_flags(
        "acct-stall",
        &format!("  durableName: orders\n{STALL_SPEC}"),
        &stall_flags(&OPERATOR_FLAGS),
    )
    .await;
    stalled_scenario(&scene).await;
    scene.finish().await;
}

/// Five Subscriptions on one stream, three messages waiting for each: every status shows its
/// own consumer's gauges, read by listing the stream's consumers once an interval, never by
/// asking each consumer (one call per Subscription per interval had been 1,000 calls a second
/// at rest at 10,000 Subscriptions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gauges_of_a_streams_subscriptions_are_read_in_one_listing_an_interval() {
    use common::operator::poll;
    use common::subs::{apply, wait_ready};

    let scene = Scene::new(
        "acct-gauges",
        "  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 5\n",
    )
    .await;
    let names = ["g1", "g2", "g3", "g4"];
    for name in names {
        let text = scene
            .manifest_text
            .replace("name: orders,", &format!("name: {name},"))
            .replace("durableName: orders", &format!("durableName: {name}"));
        apply(&scene.ns, &text);
        wait_ready(&scene.api, name).await;
    }
    // Nobody consumes: each consumer (Fanout) holds the three as pending.
    scene.publish(bodies(3)).await;
    for name in names.iter().chain(&["orders"]) {
        poll(
            "status to show the three pending",
            Duration::from_secs(30),
            || async {
                let gauges = scene
                    .api
                    .get(name)
                    .await
                    .ok()
                    .and_then(|s| s.status)
                    .and_then(|s| s.stats);
                match gauges {
                    Some(g) if g.pending == 3 && g.ack_pending == 0 => Ok(()),
                    other => Err(format!("{name}: {other:?}")),
                }
            },
        )
        .await;
    }
    let calls = |call: &str| {
        scene
            .op
            .metric("settle_account_gauge_calls_total", &[("call", call)])
    };
    let (list, info) = (calls("list"), calls("info"));
    // Five intervals of 1 s.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (listed, asked) = (calls("list") - list, calls("info") - info);
    assert_eq!(asked, 0.0, "no consumer asked alone once listed");
    assert!(
        (3.0..=7.0).contains(&listed),
        "one listing of the stream an interval (5 in 5 s), not one call per Subscription: {listed}"
    );
    scene.finish().await;
}
