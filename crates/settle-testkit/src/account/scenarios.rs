//! The account scenarios written once for every broker: always-nack, held last attempts,
//! stalled, and the lifecycle under a running application (a takeover; a delete and apply
//! across slow handlers), with their specs, flags and the messages they publish.

use std::time::Duration;

use settle::api::{ConsumerStats, SubscriptionStatus};

use super::app::App;
use super::base::{AccountScene, Base};
use super::wait::wait_for;
use crate::kubectl_ok;
use crate::operator::poll;

pub fn bodies(n: usize) -> Vec<String> {
    (1..=n).map(|i| i.to_string()).collect()
}

/// Always-nack's Subscription: AtLeastOnce, three attempts.
pub const NACK_SPEC: &str = "  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 3\n";

/// What may happen halfway through the always-nack scenario.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Halfway {
    Nothing,
    /// The operator SIGKILLed, the second half published while it is down, then started again.
    OperatorKilled,
    /// The application replaced by a new instance ([`AccountScene::replace_app`]).
    AppRestarted,
    /// Both: the operator SIGKILLed and the application replaced, so the first instance's counts
    /// live only in what the operator saved; the second half published while it is down.
    OperatorKilledAppReplaced,
    /// The operator SIGKILLed while the second half's reports arrive (each attempt takes 6 s),
    /// and started again, over [`KILL_ROUNDS`] rounds 3 s apart: kills that land between a
    /// report's reading and its saving.
    OperatorKilledWhileReporting,
}

/// The operator kills of [`Halfway::OperatorKilledWhileReporting`].
pub const KILL_ROUNDS: usize = 3;

/// Always nack, maxDeliver 3, 10 messages in two halves, with `halfway` between them: the final
/// account is the same whatever happened (exhausted 10, nacked 30, delivered 30, offered 30),
/// settled, balanced, and no status observed ever went down. Returns it.
pub async fn always_nack_scenario<S: AccountScene>(
    scene: &mut S,
    halfway: Halfway,
) -> ConsumerStats {
    let reporting = halfway == Halfway::OperatorKilledWhileReporting;
    let mut app = scene.app(if reporting { "nack-slow" } else { "nack" });
    app.wait_ready().await;
    scene.publish(bodies(5)).await;
    wait_for(scene, "the first five messages exhausted in status", |s| {
        s.exhausted == 5 && s.settlement.nacked == 15
    })
    .await;
    let down = matches!(
        halfway,
        Halfway::OperatorKilled | Halfway::OperatorKilledAppReplaced
    );
    if down {
        scene.op.kill9();
    }
    if matches!(
        halfway,
        Halfway::AppRestarted | Halfway::OperatorKilledAppReplaced
    ) {
        app = scene.replace_app(app).await;
        app.wait_ready().await;
    }
    scene.publish(bodies(5)).await;
    let published = std::time::Instant::now();
    if down {
        // Reports and losses while the operator is down wait on the broker.
        tokio::time::sleep(Duration::from_secs(2)).await;
        scene.restart_operator();
    }
    if reporting {
        kill_while_reporting(scene, published).await;
    }
    let s = wait_for(scene, "all ten messages exhausted in status", |s| {
        s.exhausted >= 10 && s.settlement.nacked >= 30 && s.delivered >= 30
    })
    .await;
    // Settle a little longer: nothing more may arrive.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let s2 = scene.stats().await;
    assert_eq!(s, s2, "the account kept moving after the work was done");
    assert_eq!(s.exhausted, 10, "{halfway:?}: {s:?}");
    assert_eq!(s.settlement.nacked, 30, "{halfway:?}: {s:?}");
    assert_eq!(s.delivered, 30, "{halfway:?}: {s:?}");
    assert_eq!(s.offered, 30, "{halfway:?}: {s:?}");
    assert_eq!(s.settlement.acked, 0, "{halfway:?}: {s:?}");
    assert!(
        s.balanced(),
        "offered == delivered + released + lost: {s:?}"
    );
    scene.assert_never_decreased();
    drop(app);
    s
}

/// [`KILL_ROUNDS`] times, 3 s apart from `published` (when the second half was published): the
/// operator SIGKILLed and started again. Each attempt holds its message 6 s and the three
/// attempts follow each other, so the second half's reports arrive for at least 18 s: a kill
/// within 12 s of `published` lands while they arrive (asserted, so a slow machine fails
/// loudly instead of killing after the work was done).
async fn kill_while_reporting<S: AccountScene>(scene: &mut S, published: std::time::Instant) {
    for round in 1..=KILL_ROUNDS {
        let at = published + Duration::from_secs(3 * round as u64);
        tokio::time::sleep_until(at.into()).await;
        let into = published.elapsed();
        assert!(
            into < Duration::from_secs(12),
            "round {round}: {into:?} after the second half was published, past the traffic's window"
        );
        scene.op.kill9();
        println!("round {round}: operator SIGKILLed {into:?} into the second half");
        tokio::time::sleep(Duration::from_millis(500)).await;
        scene.restart_operator();
    }
}

/// What every broker shows a user after [`always_nack_scenario`] ran with [`Halfway::Nothing`]:
/// `Exhausting` True (MessagesExhausted), its message saying ten messages ran out of attempts;
/// `kubectl describe` with the counts and the condition; ten exhausted on /metrics. Returns the
/// status and that message, for what each broker asserts of its own.
pub async fn assert_always_nack_shown(base: &Base) -> (SubscriptionStatus, String) {
    let st = base.sub().await.status.expect("status");
    let (status, reason, message) =
        crate::operator::condition(&st.conditions, "Exhausting").expect("an Exhausting condition");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "MessagesExhausted"),
        "{message}"
    );
    assert!(
        message.starts_with("10 message(s) ran out of attempts"),
        "{message}"
    );
    let described = kubectl_ok(
        &["describe", "subscription", "orders", "-n", &base.ns],
        None,
    );
    let flat: String = described.split_whitespace().collect::<Vec<_>>().join(" ");
    for want in [
        "Delivered: 30",
        "Exhausted: 10",
        "Nacked: 30",
        "Type: Exhausting",
        "Reason: MessagesExhausted",
    ] {
        assert!(
            flat.contains(want),
            "kubectl describe lacks {want:?}:\n{described}"
        );
    }
    // The same numbers at full resolution on /metrics.
    let labels = [("namespace", base.ns.as_str()), ("subscription", "orders")];
    assert_eq!(
        base.op
            .metric("settle_subscription_exhausted_total", &labels),
        10.0,
        "settle_subscription_exhausted_total"
    );
    (st, message)
}

/// How long [`held_last_attempts_scenario`] waits on a broker, and what counts the exhausted.
pub struct Patience {
    /// For the four last attempts to be held, and then for them to be counted exhausted.
    pub limit: Duration,
    /// How long nothing more may arrive once they are.
    pub quiet: Duration,
    /// Where the exhausted are counted from, as the wait names it.
    pub from: &'static str,
}

/// An application that nacks twice, then holds the last attempt (maxDeliver 3), dies (SIGKILL)
/// holding four: the runtime never counts them. The broker finds their attempts spent when the
/// replacement (started as a Deployment would) next takes from it, and the operator counts each
/// exhausted once: exhausted 4, nacked 8, delivered 8, and no status observed ever went down.
/// Returns the replacement and the final counts.
pub async fn held_last_attempts_scenario<S: AccountScene>(
    scene: &S,
    patience: Patience,
) -> (App, ConsumerStats) {
    let mut app = scene.app("nack-then-hold");
    app.wait_ready().await;
    scene.publish(bodies(4)).await;
    poll(
        "the application to hold four last attempts",
        patience.limit,
        || async {
            match app.count("held") {
                4 => Ok(()),
                n => Err(format!("{n} held")),
            }
        },
    )
    .await;
    scene
        .wait_stats(
            "the first two attempts' nacks in status",
            Duration::from_secs(30),
            |s| s.settlement.nacked == 8,
        )
        .await;
    app.kill9();
    let replacement = scene.app("nack-then-hold");
    replacement.wait_ready().await;
    let s = scene
        .wait_stats(
            &format!("four messages exhausted, from {}", patience.from),
            patience.limit,
            |s| s.exhausted >= 4,
        )
        .await;
    tokio::time::sleep(patience.quiet).await;
    let later = scene.stats().await;
    assert_eq!(
        later.exhausted, 4,
        "counted once each: {s:?} then {later:?}"
    );
    assert_eq!(later.settlement.nacked, 8);
    assert_eq!(
        later.delivered, 8,
        "the held attempts never returned: {later:?}"
    );
    scene.assert_never_decreased();
    (replacement, later)
}

/// The stall window the stall scenario's operator runs with, as `--stall-window` gives it.
pub const STALL_WINDOW: &str = "3s";

/// The stall scenario's operator flags: `--stall-window` beside a scene's own `flags`.
pub fn stall_flags(flags: &[&'static str]) -> Vec<&'static str> {
    let mut all = flags.to_vec();
    all.extend(["--stall-window", STALL_WINDOW]);
    all
}

/// The stall scenario's policy: ackWait 1s, so three ackWaits are within [`STALL_WINDOW`] and
/// the window is the flag's.
pub const STALL_SPEC: &str = "  mode: AtLeastOnce\n  ackWait: 1s\n";

/// Waits until the scene's Subscription shows `Stalled` with `status`; returns its reason and
/// message.
pub async fn wait_stalled<S: AccountScene>(scene: &S, status: &str) -> (String, String) {
    poll(
        &format!("Stalled={status}"),
        Duration::from_secs(60),
        || async {
            let sub = scene.api.get("orders").await.map_err(|e| e.to_string())?;
            let conditions = sub.status.map(|s| s.conditions).unwrap_or_default();
            match crate::operator::condition(&conditions, "Stalled") {
                Some((s, reason, message)) if s == status => Ok((reason, message)),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await
}

/// A handler that blocks forever with three messages pending (semantics C22): once
/// `--stall-window` passed without a handler returning, `Stalled` is True (reason
/// `NothingDelivered`), its message names the three messages and the window, and
/// `settle_subscription_stalled` reads 1; the blocked application replaced by one that acks,
/// the three are acked and `Stalled` turns False, the gauge 0. Delivered stays 0 while blocked,
/// and no status observed ever went down.
pub async fn stalled_scenario<S: AccountScene>(scene: &S) {
    let held = scene.app("hold");
    held.wait_ready().await;
    scene.publish(bodies(3)).await;
    // All three handed to handlers that never return.
    held.wait_count("held", 3, Duration::from_secs(60)).await;
    let (reason, message) = wait_stalled(scene, "True").await;
    println!("Stalled=True ({reason}): {message}");
    assert_eq!(reason, "NothingDelivered", "{message}");
    assert!(
        message.starts_with("3 message(s) pending, nothing delivered since "),
        "the message names what is pending: {message}"
    );
    assert!(
        message.contains(&format!("(window {STALL_WINDOW})")),
        "the message names the window: {message}"
    );
    let labels = [("namespace", scene.ns.as_str()), ("subscription", "orders")];
    assert_eq!(
        scene.op.metric("settle_subscription_stalled", &labels),
        1.0,
        "settle_subscription_stalled while Stalled=True"
    );
    assert_eq!(
        scene.stats().await.delivered,
        0,
        "no handler returned while they were held"
    );

    // Unblocked: the holder goes (SIGKILL), an application that acks takes the three.
    drop(held);
    let acking = scene.app("ack");
    acking.wait_ready().await;
    wait_for(scene, "the three messages acked in status", |s| {
        s.settlement.acked >= 3
    })
    .await;
    let (reason, message) = wait_stalled(scene, "False").await;
    println!("Stalled=False ({reason}): {message}");
    assert!(
        matches!(reason.as_str(), "Delivering" | "NothingPending"),
        "{reason}: {message}"
    );
    poll(
        "settle_subscription_stalled to read 0",
        Duration::from_secs(30),
        || async {
            let v = scene.op.metric("settle_subscription_stalled", &labels);
            if v == 0.0 {
                Ok(())
            } else {
                Err(format!("{v}"))
            }
        },
    )
    .await;
    scene.assert_never_decreased();
}

/// What a running application logs when its Subscription's mark names a new object.
pub const NEW_OBJECT_LOG: &str = "bound to a new Subscription object";

/// A takeover under a running application (always-nack's Subscription): two messages exhausted,
/// then the Subscription patched to `deletionPolicy: Retain`, deleted, applied again and
/// annotated `settle.dev/adopt=<old uid>`, the same process running throughout. The
/// application reads the new mark within `settle::bus::MARK_RECHECK` of the takeover, without
/// a restart; three messages published then count exactly on the new object, and no status of
/// the new object ever shows the old one's history (exhausted 2, nacked 6). Returns the new
/// object's account and how long after Ready the application took the mark.
pub async fn takeover_under_a_running_app_scenario<S: AccountScene>(
    scene: &S,
) -> (ConsumerStats, Duration) {
    let app = scene.app("nack");
    app.wait_ready().await;
    scene.publish(bodies(2)).await;
    wait_for(scene, "the old object's two messages exhausted", |s| {
        s.exhausted == 2 && s.settlement.nacked == 6
    })
    .await;
    // Kubernetes times have whole seconds: a dead letter sent within the second before the
    // new object's creation cannot be told from one sent just after it (SQS counts dead
    // letters sent since the object's creation, docs/guide/reconcile.md), so the takeover
    // comes two seconds after the old object's last message.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let old = scene.sub().await.metadata.uid.expect("a UID");
    kubectl_ok(
        &[
            "patch",
            "subscription",
            "orders",
            "-n",
            &scene.ns,
            "--type=merge",
            "-p",
            r#"{"spec":{"deletionPolicy":"Retain"}}"#,
        ],
        None,
    );
    scene.delete_orders(Duration::from_secs(60)).await;
    let text = std::fs::read_to_string(&scene.manifest).expect("the manifest");
    crate::subs::apply(&scene.ns, &text);
    kubectl_ok(
        &[
            "annotate",
            "subscription",
            "orders",
            "-n",
            &scene.ns,
            &format!("settle.dev/adopt={old}"),
        ],
        None,
    );
    crate::subs::wait_ready(&scene.api, "orders").await;
    let ready = std::time::Instant::now();
    let new = scene.sub().await.metadata.uid.expect("a UID");
    assert_ne!(new, old, "a new object");
    app.wait_log(NEW_OBJECT_LOG, Duration::from_secs(20)).await;
    let took = ready.elapsed();
    scene.publish(bodies(3)).await;
    let published = std::time::Instant::now();
    let s = wait_for(scene, "the new object's three messages exhausted", |s| {
        s.exhausted == 3 && s.settlement.nacked == 9
    })
    .await;
    println!(
        "takeover: the running application took the new mark {took:?} after Ready; the new \
         object counted the new messages {:?} after they were published",
        published.elapsed()
    );
    let s = scene
        .settled(
            "the new object's account at rest",
            Duration::from_secs(30),
            |t| t == &s,
        )
        .await;
    assert_eq!(
        (s.offered, s.delivered, s.exhausted, s.released, s.lost),
        (9, 9, 3, 0, 0),
        "{s:?}"
    );
    let history: Vec<ConsumerStats> = scene
        .seen
        .lock()
        .expect("seen")
        .iter()
        .filter(|(uid, _)| uid == &new)
        .map(|(_, c)| *c)
        .filter(|c| c.exhausted > 3 || c.settlement.nacked > 9)
        .collect();
    assert!(
        history.is_empty(),
        "the new object showed history: {history:?}"
    );
    scene.assert_never_decreased();
    (s, took)
}

/// The recreate scenario's Subscription: AtLeastOnce, three attempts, ten in flight.
pub const SLOW_SPEC: &str = "  mode: AtLeastOnce\n  maxDeliver: 3\n  maxInFlight: 10\n";

/// A delete and apply while five handlers run (`ack-when-released`): they are released only
/// once the new object's epoch began, so they finish inside it whatever the delete and apply
/// took, and their completions stay the old object's (a delivery belongs to the epoch it was
/// offered in). Two more messages, then at rest the new
/// object balances: offered = delivered + released + lost, every delivery settled once.
pub async fn recreate_under_slow_handlers_scenario<S: AccountScene>(scene: &S) -> ConsumerStats {
    let app = scene.app("ack-when-released");
    app.wait_ready().await;
    scene.publish(bodies(5)).await;
    app.wait_count("working", 5, Duration::from_secs(60)).await;
    let old = scene.sub().await.metadata.uid.expect("a UID");
    scene.delete_orders(Duration::from_secs(60)).await;
    let text = std::fs::read_to_string(&scene.manifest).expect("the manifest");
    crate::subs::apply(&scene.ns, &text);
    crate::subs::wait_ready(&scene.api, "orders").await;
    let new = scene.sub().await.metadata.uid.expect("a UID");
    assert_ne!(new, old, "a new object");
    app.wait_log(NEW_OBJECT_LOG, Duration::from_secs(20)).await;
    // The new epoch began while the five handlers ran: only now may they finish.
    assert_eq!(
        app.count("released") + app.count("unreleased"),
        0,
        "no handler may end before the new object's epoch began"
    );
    app.release();
    app.wait_count("released", 5, Duration::from_secs(60)).await;
    scene.publish(bodies(2)).await;
    let s = scene
        .settled(
            "the new object balanced at rest, every delivery settled",
            Duration::from_secs(120),
            |s| {
                s.offered >= 2
                    && s.offered == s.delivered + s.released + s.lost
                    && s.delivered == s.settlement.acked + s.settlement.nacked + s.settlement.silent
            },
        )
        .await;
    println!("recreate under slow handlers: the new object shows {s:?}");
    scene.assert_never_decreased();
    s
}
