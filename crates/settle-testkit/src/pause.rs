//! The pause scenario (docs/semantics.md W1–W6), written once and run on every broker by
//! `crates/settle-operator/tests/pause.rs`: an application that acks, three messages delivered, the Subscription paused
//! with a merge patch of `spec.paused` (as `kubectl settle pause` makes it), ten messages
//! published while paused and none delivered for 10 s (no handler sees one, status shows
//! `Paused=True`, and `Stalled` stays False although messages are pending and the stall window
//! is 3 s), then resumed: all ten delivered, the counts exact.

use std::time::Duration;

use super::account::{AccountScene, App, OPERATOR_FLAGS, bodies, settled_at, stall_flags};
use super::kubectl_ok;
use super::operator::{condition, poll};

/// How often the test's applications look at the pause signal (`SETTLE_PAUSE_POLL_INTERVAL`).
pub const POLL: &str = "500ms";

/// The scenario's policy (after durableName, which each scene sets): ackWait 1s, so the stall
/// window is the 3 s of [`flags`], well inside the 10 s paused.
pub const PAUSE_SPEC: &str = "  mode: AtLeastOnce\n  ackWait: 1s\n";

/// The operator flags of the pause scenes: the account's, and a stall window of 3 s.
pub fn flags() -> Vec<&'static str> {
    stall_flags(&OPERATOR_FLAGS)
}

/// What differs by broker in the scenario.
pub trait PauseScene: AccountScene {
    /// Whether the runtime stops fetching itself (RabbitMQ, SQS: it prints `paused` once it
    /// has), rather than the server holding the consumer (JetStream).
    const RUNTIME_STOPS: bool;
    /// Whether a consumer made for a new object is offered what the broker held before it
    /// (JetStream: every message the stream holds, semantics J1), rather than only what is
    /// published after (a RabbitMQ or SQS queue deleted takes its messages with it).
    const NEW_CONSUMER_REPLAYS: bool;
}

/// A merge patch of Subscription `orders`' spec, as `kubectl settle pause|resume` sends it.
pub fn patch_spec(ns: &str, spec: serde_json::Value) {
    let body = serde_json::json!({ "spec": spec }).to_string();
    kubectl_ok(
        &[
            "patch",
            "subscription",
            "orders",
            "-n",
            ns,
            "--type=merge",
            "-p",
            &body,
        ],
        None,
    );
}

/// Waits until `orders` shows `type_` with `status` for its current generation; returns its
/// reason and message.
pub async fn wait_shown<S: AccountScene>(scene: &S, type_: &str, status: &str) -> (String, String) {
    poll(
        &format!("{type_}={status}"),
        Duration::from_secs(60),
        || async {
            let sub = scene.api.get("orders").await.map_err(|e| e.to_string())?;
            let st = sub.status.unwrap_or_default();
            if st.observed_generation != sub.metadata.generation {
                return Err(format!(
                    "observedGeneration {:?} of {:?}",
                    st.observed_generation, sub.metadata.generation
                ));
            }
            match condition(&st.conditions, type_) {
                Some((s, reason, message)) if s == status => Ok((reason, message)),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await
}

/// The scenario; `app` is an application with handler `ack` started by the scene with
/// `SETTLE_PAUSE_POLL_INTERVAL` set to [`POLL`].
pub async fn pause_scenario<S: PauseScene>(scene: &S, app: &App) {
    app.wait_ready().await;
    scene.publish(bodies(3)).await;
    app.wait_count("acked ", 3, Duration::from_secs(60)).await;
    scene
        .wait_stats(
            "the first three acked in status",
            Duration::from_secs(60),
            |s| s.settlement.acked == 3,
        )
        .await;

    // Pause.
    patch_spec(&scene.ns, serde_json::json!({"paused": true}));
    let (reason, message) = wait_shown(scene, "Paused", "True").await;
    println!("Paused=True ({reason}): {message}");
    assert_eq!(reason, "PausedBySpec", "{message}");
    assert!(
        message.contains("until spec.paused is set false"),
        "the message says until when: {message}"
    );
    if S::RUNTIME_STOPS {
        app.wait_count("paused", 1, Duration::from_secs(30)).await;
    }
    scene.publish(bodies(10)).await;
    // Nothing is delivered for 10 s while ten messages wait.
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        app.count("acked "),
        3,
        "a handler saw a message while paused: {:?}",
        app.lines("acked ")
    );
    let sub = scene.sub().await;
    let st = sub.status.clone().unwrap_or_default();
    let stats = st.stats.clone().unwrap_or_default();
    assert_eq!(
        stats.counters.delivered, 3,
        "nothing delivered while paused: {stats:?}"
    );
    assert_eq!(
        stats.counters.offered, 3,
        "nothing offered while paused: {stats:?}"
    );
    let stalled = condition(&st.conditions, "Stalled");
    assert!(
        matches!(&stalled, Some((s, reason, _)) if s == "False" && reason == "Paused"),
        "a pause is no stall, with ten messages pending past the 3 s window: {stalled:?}"
    );
    let paused = condition(&st.conditions, "Paused");
    assert!(
        matches!(&paused, Some((s, _, _)) if s == "True"),
        "{paused:?}"
    );

    // Resume: everything comes, once each.
    patch_spec(
        &scene.ns,
        serde_json::json!({"paused": null, "pausedUntil": null}),
    );
    let (reason, message) = wait_shown(scene, "Paused", "False").await;
    println!("Paused=False ({reason}): {message}");
    assert_eq!(reason, "NotPaused", "{message}");
    if S::RUNTIME_STOPS {
        app.wait_count("resumed", 1, Duration::from_secs(30)).await;
    }
    app.wait_count("acked ", 13, Duration::from_secs(60)).await;
    // Both counters: a handler settles before it returns, so a report between the two (acked
    // 13, delivered 12) can reach status, and the next one moves on from it.
    let s = settled_at(
        "all thirteen acked and delivered in status",
        Duration::from_secs(60),
        || scene.stats(),
        |s| s.settlement.acked >= 13 && s.delivered >= 13,
    )
    .await;
    assert_eq!(s.settlement.acked, 13, "{s:?}");
    assert_eq!(s.delivered, 13, "{s:?}");
    assert_eq!(s.offered, 13, "none offered twice: {s:?}");
    assert_eq!(app.count("acked "), 13, "each handled once");
    assert!(s.balanced(), "{s:?}");
    scene.assert_never_decreased();
}

/// semantics C15 across a pause: Subscription `orders` paused, deleted and applied again
/// (unpaused) while its application runs. Nothing consumed the queue while it was made again
/// for the new object, so the application's first sign of it is the resume: every delivery
/// after it counts for the new object, none for the old (before the runtime read the mark
/// when it resumed, RabbitMQ's counted up to 5 s of them for the old object: the RabbitMQ
/// campaign of seed 1796666591402080080, 40 attempts short).
pub async fn recreate_while_paused_scenario<S: PauseScene>(scene: &S, app: &App) {
    app.wait_ready().await;
    scene.publish(bodies(2)).await;
    app.wait_count("acked ", 2, Duration::from_secs(60)).await;
    let old = scene.sub().await.metadata.uid.expect("a UID");
    patch_spec(&scene.ns, serde_json::json!({"paused": true}));
    wait_shown(scene, "Paused", "True").await;
    if S::RUNTIME_STOPS {
        app.wait_count("paused", 1, Duration::from_secs(30)).await;
    }
    scene.delete_orders(Duration::from_secs(60)).await;
    let text = std::fs::read_to_string(&scene.manifest).expect("the manifest");
    crate::subs::apply(&scene.ns, &text);
    crate::subs::wait_ready(&scene.api, "orders").await;
    let new = scene.sub().await.metadata.uid.expect("a UID");
    assert_ne!(new, old, "a new object");
    // Published at once: the application takes them within a second of its resume, well
    // inside the 5 s between two reads of the mark. On NATS the new consumer is offered the
    // first two again too (the stream holds them).
    scene.publish(bodies(20)).await;
    let want: u64 = if S::NEW_CONSUMER_REPLAYS { 22 } else { 20 };
    app.wait_count("acked ", 2 + want as usize, Duration::from_secs(60))
        .await;
    let s = settled_at(
        "the new object's deliveries acked and delivered in status",
        Duration::from_secs(60),
        || scene.stats(),
        |s| s.settlement.acked >= want && s.delivered >= want,
    )
    .await;
    assert_eq!(
        s.offered, want,
        "the new object's deliveries, no other: {s:?}"
    );
    assert_eq!(s.settlement.acked, want, "{s:?}");
    assert!(s.balanced(), "{s:?}");
    scene.assert_never_decreased();
}

// Whether the runtime itself stops fetching while paused: on NATS the server pauses the
// consumer; on RabbitMQ and SQS the runtime polls the broker's signal (settle::backend::pause).
impl PauseScene for super::account::Scene {
    const RUNTIME_STOPS: bool = false;
    const NEW_CONSUMER_REPLAYS: bool = true;
}

impl PauseScene for super::rabbit_scene::RabbitScene {
    const RUNTIME_STOPS: bool = true;
    const NEW_CONSUMER_REPLAYS: bool = false;
}

impl PauseScene for super::sqs::SqsScene {
    const RUNTIME_STOPS: bool = true;
    const NEW_CONSUMER_REPLAYS: bool = false;
}
