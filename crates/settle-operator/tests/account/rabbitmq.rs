//! The account on a real RabbitMQ, end to end: `settle operator` as a process against the real
//! API server, the test application (`examples/account_app.rs`) on RabbitMQ as another process,
//! messages published to `amq.topic`, and `status.stats` read back through the API (and
//! `kubectl describe`). The runtime's reports travel through the Subscription's own report queue
//! (`settle.stats.<namespace>.<subscription>`) and the operator keeps its ledger in
//! `settle.ledger.<namespace>.<subscription>`: counters are exact, survive the operator's
//! SIGKILL, never go down in any status observed, an instance's report queue deleted on the broker while it runs is made
//! and consumed again, and both queues go with the Subscription. With a dead-letter exchange on
//! the Backend, the operator counts what the quorum queue dead-letters from a copy of it
//! (semantics R9–R12): a last attempt a crash spent is counted once, the user's own dead-letter
//! queue keeps every message, and the runtime's rejected last attempts are not counted twice. A
//! handler blocked forever raises `Stalled` (the scenario every broker runs,
//! `common::account::stalled_scenario`).

use settle_testkit as common;

use std::time::Duration;

use common::account::{
    AccountScene, App, Base, Halfway, OPERATOR_FLAGS, STALL_SPEC, always_nack_scenario,
    assert_always_nack_shown, stall_flags, stalled_scenario,
};
use common::operator::{Operator, condition, poll};
use common::rabbitmq::{env_backend_yaml, management, management_with, publish_topic, queue};
use common::subs::{apply, backends, delete_by_hand, wait_backend, wait_gone, wait_ready};
use common::{install_crds, namespace};
use kube::api::DeleteParams;
use lapin::options::BasicPublishOptions;
use serde_json::Value;
use settle::backend::rabbitmq::dead_letters::copy_queue;
use settle::backend::rabbitmq::report::{ledger_queue, report_queue};

/// A namespace, a RabbitMQ Backend, the operator, and Subscription `orders` (always nack,
/// maxDeliver 3) on a routing key of this test's own.
pub(super) struct Scene {
    base: Base,
    pub(super) tag: String,
    pub(super) amqp: lapin::Connection,
    /// The Backend's dead-letter exchange (a topic exchange of this test's) and the user's own
    /// dead-letter queue bound to it with `#`, when the scene has them.
    dead: Option<(String, String)>,
}

impl std::ops::Deref for Scene {
    type Target = Base;
    fn deref(&self) -> &Base {
        &self.base
    }
}

impl std::ops::DerefMut for Scene {
    fn deref_mut(&mut self) -> &mut Base {
        &mut self.base
    }
}

/// The scenes' policy: always-nack's, three attempts.
const NACK_POLICY: &str = "  mode: AtLeastOnce\n  maxDeliver: 3\n";

impl Scene {
    pub(super) async fn new(test: &str) -> Scene {
        Scene::build(test, false, NACK_POLICY, &OPERATOR_FLAGS).await
    }

    /// With a dead-letter exchange on the Backend, and the user's dead-letter queue on it.
    pub(super) async fn with_dead_letters(test: &str) -> Scene {
        Scene::build(test, true, NACK_POLICY, &OPERATOR_FLAGS).await
    }

    /// Subscription `orders` with `policy` (after its durableName), the operator with `flags`,
    /// with a dead-letter exchange on the Backend when `with_dead`.
    pub(super) async fn build(
        test: &str,
        with_dead: bool,
        policy: &str,
        flags: &[&'static str],
    ) -> Scene {
        install_crds();
        let ns = namespace(test);
        let env = common::env();
        let tag = format!("{}{}", test.replace('-', ""), std::process::id());
        let dead = with_dead.then(|| {
            let (dlx, dlq) = (format!("{tag}.dead"), format!("{tag}.dlq"));
            for (path, body) in [
                (
                    format!("/api/exchanges/%2f/{dlx}"),
                    r#"{"type":"topic","durable":true}"#.to_string(),
                ),
                (
                    format!("/api/queues/%2f/{dlq}"),
                    r#"{"durable":true,"arguments":{"x-queue-type":"quorum"}}"#.to_string(),
                ),
                (
                    format!("/api/bindings/%2f/e/{dlx}/q/{dlq}"),
                    r##"{"routing_key":"#"}"##.to_string(),
                ),
            ] {
                let method = if path.contains("/bindings/") {
                    "POST"
                } else {
                    "PUT"
                };
                let (status, text) = management_with(method, &path, &body);
                assert!(
                    matches!(status, 201 | 204),
                    "{method} {path}: {status} {text}"
                );
            }
            (dlx, dlq)
        });
        let op = Operator::start_with(test, &ns, flags);
        let dead_line = dead
            .as_ref()
            .map(|(dlx, _)| format!("    deadLetterExchange: {dlx}\n"))
            .unwrap_or_default();
        apply(&ns, &env_backend_yaml("rabbit", &dead_line));
        wait_backend(&backends(&ns).await, "rabbit", "True", "Connected").await;
        let manifest_text = format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {ns}}}\nspec:\n  backendRef: {{name: rabbit}}\n  pattern: \"{tag}.>\"\n  durableName: {tag}\n{policy}"
        );
        let base = Base::subscribe(test, ns, op, flags, &manifest_text).await;
        let amqp =
            lapin::Connection::connect(&env.rabbitmq_url, lapin::ConnectionProperties::default())
                .await
                .expect("connect to RabbitMQ");
        Scene {
            base,
            tag,
            amqp,
            dead,
        }
    }

    pub(super) fn app(&self) -> App {
        self.app_with("nack")
    }

    fn app_with(&self, handler: &str) -> App {
        let url = common::env().rabbitmq_url;
        App::start(
            &[("SETTLE_RABBITMQ_URL", url.as_str())],
            &self.manifest,
            handler,
        )
    }

    /// Publishes `n` messages (bodies 1..=n) to `amq.topic` on this test's routing keys.
    pub(super) async fn publish(&self, n: usize) {
        self.publish_bodies((1..=n).map(|i| i.to_string()).collect())
            .await;
    }

    /// Publishes `bodies` to `amq.topic` on this test's routing keys (publisher confirms).
    async fn publish_bodies(&self, bodies: Vec<String>) {
        let keys = (1..).map(|i| format!("{}.m{i}", self.tag));
        publish_topic(&self.amqp, keys.zip(bodies)).await;
    }

    /// The user's dead-letter queue: its messages, read and put back (management API), once it
    /// holds `n`.
    pub(super) async fn dead_letters(&self, n: usize) -> Vec<Value> {
        let (_, dlq) = self.dead.as_ref().expect("a scene with dead letters");
        poll(
            &format!("{n} message(s) in the user's dead-letter queue {dlq}"),
            Duration::from_secs(60),
            || async {
                let (status, body) = management_with(
                    "POST",
                    &format!("/api/queues/%2f/{dlq}/get"),
                    r#"{"count":1000,"ackmode":"reject_requeue_true","encoding":"auto"}"#,
                );
                let got: Vec<Value> = serde_json::from_str(&body).unwrap_or_default();
                if status == 200 && got.len() == n {
                    Ok(got)
                } else {
                    Err(format!("{status}: {} message(s)", got.len()))
                }
            },
        )
        .await
    }

    /// The newest `x-death` reason of each dead letter, and the queue it names.
    fn deaths(letters: &[Value]) -> Vec<(String, String)> {
        letters
            .iter()
            .map(|m| {
                let d = &m["properties"]["headers"]["x-death"][0];
                (
                    d["reason"].as_str().unwrap_or("?").to_string(),
                    d["queue"].as_str().unwrap_or("?").to_string(),
                )
            })
            .collect()
    }

    pub(super) fn dead_letter_metric(&self, outcome: &str) -> f64 {
        self.op
            .metric("settle_account_dead_letters_total", &[("outcome", outcome)])
    }

    pub(super) async fn finish(self) {
        if let Some((dlx, dlq)) = &self.dead {
            management("DELETE", &format!("/api/queues/%2f/{dlq}"));
            management("DELETE", &format!("/api/exchanges/%2f/{dlx}"));
            management(
                "DELETE",
                &format!("/api/queues/%2f/{}", copy_queue(&self.ns, "rabbit")),
            );
        }
        self.base.finish();
    }
}

impl AccountScene for Scene {
    fn app(&self, handler: &str) -> App {
        Scene::app_with(self, handler)
    }

    async fn publish(&self, bodies: Vec<String>) {
        Scene::publish_bodies(self, bodies).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn always_nack_on_rabbitmq_is_counted_exactly_and_raises_exhausting() {
    let mut scene = Scene::new("acctrq-nack").await;
    always_nack_scenario(&mut scene, Halfway::Nothing).await;
    let (st, message) = assert_always_nack_shown(&scene).await;
    assert!(
        !message.contains("advisories"),
        "RabbitMQ has no advisories: {message}"
    );
    assert!(
        message.contains("set the Backend's spec.rabbitmq.deadLetterExchange"),
        "without a dead-letter exchange the condition says how to count a crash's losses: {message}"
    );
    assert!(st.stats_updated_at.is_some(), "statsUpdatedAt is set");

    // The report queue was consumed and acknowledged to the end; the ledger queue holds one
    // snapshot; both are bounded drop-head queues.
    let reports = report_queue(&scene.ns, "orders");
    let ledger = ledger_queue(&scene.ns, "orders");
    poll(
        "every report acknowledged and one snapshot kept",
        Duration::from_secs(30),
        || async {
            let r = queue(&reports).ok_or("no report queue")?;
            let l = queue(&ledger).ok_or("no ledger queue")?;
            let (rm, lm) = (r["messages"].as_u64(), l["messages"].as_u64());
            if rm == Some(0) && lm == Some(1) {
                Ok((r, l))
            } else {
                Err(format!("report queue {rm:?}, ledger queue {lm:?}"))
            }
        },
    )
    .await;
    for (name, max) in [(&reports, 10_000), (&ledger, 1)] {
        let q = queue(name).expect("queue");
        assert_eq!(q["durable"], true, "{name}: {q}");
        assert_eq!(q["arguments"]["x-max-length"], max, "{name}: {q}");
        assert_eq!(q["arguments"]["x-overflow"], "drop-head", "{name}: {q}");
    }

    // An instance's report queue deleted on the broker while the instance runs: its next
    // report comes back (mandatory), and it declares and registers the queue again; counting
    // goes on.
    let prefix = format!("settle.report.{}.orders.", scene.ns);
    let instance_queues = || {
        let (status, body) = management("GET", "/api/queues/%2f?columns=name,arguments,consumers");
        assert_eq!(status, 200, "{body}");
        let all: Vec<Value> = serde_json::from_str(&body).expect("JSON");
        all.into_iter()
            .filter(|q| q["name"].as_str().is_some_and(|n| n.starts_with(&prefix)))
            .collect::<Vec<_>>()
    };
    // The earlier instances' queues (killed, not folded yet: still consumed); then a new one.
    let before: Vec<String> = instance_queues()
        .iter()
        .filter_map(|q| q["name"].as_str().map(str::to_string))
        .collect();
    let app = scene.app();
    app.wait_ready().await;
    let running = poll(
        "the running instance's report queue registered and consumed",
        Duration::from_secs(30),
        || async {
            let consumed: Vec<Value> = instance_queues()
                .into_iter()
                .filter(|q| {
                    q["consumers"].as_u64() == Some(1)
                        && q["name"]
                            .as_str()
                            .is_some_and(|n| !before.iter().any(|b| b == n))
                })
                .collect();
            match consumed.as_slice() {
                [q] => Ok(q.clone()),
                other => Err(format!("{} consumed", other.len())),
            }
        },
    )
    .await;
    assert_eq!(running["arguments"]["x-max-length"], 1, "{running}");
    assert_eq!(running["arguments"]["x-overflow"], "drop-head", "{running}");
    let index = queue(&format!("settle.instances.{}.orders", scene.ns)).expect("the index");
    assert_eq!(
        index["arguments"]["x-overflow"], "reject-publish",
        "{index}"
    );
    let name = running["name"].as_str().expect("name").to_string();
    let (status, body) = management("DELETE", &format!("/api/queues/%2f/{name}"));
    assert_eq!(status, 204, "DELETE {name}: {body}");
    scene.publish(2).await;
    let s = scene
        .wait_stats(
            "two more messages exhausted after the instance's report queue was deleted",
            Duration::from_secs(60),
            |s| s.exhausted >= 12 && s.settlement.nacked >= 36,
        )
        .await;
    assert_eq!(
        (s.exhausted, s.settlement.nacked, s.delivered),
        (12, 36, 36),
        "{s:?}"
    );
    poll(
        "the instance's report queue declared and consumed again",
        Duration::from_secs(30),
        || async {
            let found: Vec<String> = instance_queues()
                .iter()
                .map(|q| format!("{} ({} consumer(s))", q["name"], q["consumers"]))
                .collect();
            match queue(&name) {
                Some(q) if q["consumers"].as_u64() == Some(1) => Ok(()),
                _ => Err(format!("instance queues now: {found:?}")),
            }
        },
    )
    .await;
    scene.assert_never_decreased();
    drop(app);

    // Deleting the Subscription deletes both queues.
    scene
        .api
        .delete("orders", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&scene.api, "orders", Duration::from_secs(60)).await;
    poll(
        "the report, index, instance and ledger queues deleted with the Subscription",
        Duration::from_secs(30),
        || async {
            let index = queue(&format!("settle.instances.{}.orders", scene.ns));
            let left = instance_queues().len();
            match (queue(&reports), queue(&ledger), index, left) {
                (None, None, None, 0) => Ok(()),
                (r, l, i, n) => Err(format!(
                    "report queue there: {}, ledger queue there: {}, index there: {}, {n} instance queue(s)",
                    r.is_some(),
                    l.is_some(),
                    i.is_some()
                )),
            }
        },
    )
    .await;
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_killed_halfway_on_rabbitmq_loses_and_doubles_nothing() {
    let mut scene = Scene::new("acctrq-opkill").await;
    always_nack_scenario(&mut scene, Halfway::OperatorKilledAppReplaced).await;
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_killed_three_times_while_reports_arrive_on_rabbitmq_loses_and_doubles_nothing()
{
    let mut scene = Scene::new("acctrq-opkill-mid").await;
    always_nack_scenario(&mut scene, Halfway::OperatorKilledWhileReporting).await;
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_deleted_and_applied_again_on_rabbitmq_starts_at_zero_while_its_application_runs()
 {
    let scene = Scene::new("acctrq-recreate").await;
    let app = scene.app();
    app.wait_ready().await;
    scene.publish(5).await;
    scene
        .wait_stats("five exhausted", Duration::from_secs(60), |s| {
            s.exhausted == 5 && s.settlement.nacked == 15
        })
        .await;
    let old = scene.api.get("orders").await.expect("get").metadata.uid;
    scene
        .api
        .delete("orders", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&scene.api, "orders", Duration::from_secs(30)).await;
    let text = std::fs::read_to_string(&scene.manifest).expect("manifest");
    apply(&scene.ns, &text);
    let sub = wait_ready(&scene.api, "orders").await;
    assert_ne!(sub.metadata.uid, old, "a new object");
    // The application ran throughout: it binds to the queue made for the new object.
    scene.publish(2).await;
    let s = scene
        .wait_stats(
            "the new object's two messages exhausted",
            Duration::from_secs(60),
            |s| s.exhausted >= 2 && s.settlement.nacked >= 6,
        )
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(scene.reported().await, Some(s), "nothing more arrives");
    assert_eq!(
        (s.exhausted, s.settlement.nacked, s.delivered, s.offered),
        (2, 6, 6, 6),
        "only the new object's messages: {s:?}"
    );
    let st = scene
        .api
        .get("orders")
        .await
        .expect("get")
        .status
        .unwrap_or_default();
    let (_, _, message) = condition(&st.conditions, "Exhausting").expect("Exhausting");
    assert!(
        message.starts_with("2 message(s)") && message.contains("(2 in all)"),
        "{message}"
    );
    scene.assert_never_decreased();
    drop(app);
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instances_final_report_survives_a_flood_of_other_reports_while_the_operator_is_down() {
    let mut scene = Scene::new("acctrq-flood").await;
    let mut app = scene.app();
    app.wait_ready().await;
    scene.publish(3).await;
    scene
        .wait_stats("three exhausted", Duration::from_secs(60), |s| {
            s.exhausted == 3 && s.settlement.nacked == 9
        })
        .await;
    scene.op.kill9();
    // Two more lost while no operator runs, then the instance stops for good: its last report
    // is the only place those counts are.
    scene.publish(2).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    app.sigterm();
    assert!(app.wait_exit(Duration::from_secs(30)), "closed gracefully");
    // Meanwhile other instances report, many times over the shared report queue's bound (as
    // runtimes report there that predate instance queues).
    let ch = scene.amqp.create_channel().await.expect("channel");
    ch.confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let shared = report_queue(&scene.ns, "orders");
    let mut confirms = Vec::new();
    let flood = settle::backend::rabbitmq::report::REPORTS_MAX_LENGTH + 2_000;
    for i in 1..=flood {
        let body = serde_json::json!({
            "version": 1, "namespace": scene.ns, "subscription": "orders",
            "instance": "flood-0", "backend": "rabbitmq", "mode": "AtLeastOnce",
            "startedAtMs": 1, "reportedAtMs": 2, "sequence": i,
            "stats": {}, "runtime": {},
        });
        confirms.push(
            ch.basic_publish(
                "".into(),
                shared.as_str().into(),
                BasicPublishOptions::default(),
                &serde_json::to_vec(&body).expect("json"),
                lapin::BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .expect("publish"),
        );
    }
    for c in confirms {
        assert!(c.await.expect("confirmed").is_ack());
    }
    let _ = ch.close(200, "flooded".into()).await;
    scene.op = Operator::start_with(&scene.test, &scene.ns, &OPERATOR_FLAGS);
    let s = scene
        .wait_stats(
            "the stopped instance's final counts",
            Duration::from_secs(90),
            |s| s.exhausted >= 5 && s.settlement.nacked >= 15,
        )
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(scene.reported().await, Some(s), "nothing more arrives");
    assert_eq!(
        (s.exhausted, s.settlement.nacked, s.delivered, s.offered),
        (5, 15, 15, 15),
        "{s:?}"
    );
    assert!(s.balanced(), "{s:?}");
    scene.assert_never_decreased();
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_account_queues_of_a_subscription_deleted_while_no_operator_ran_are_swept() {
    let mut scene = Scene::new("acctrq-sweep").await;
    let app = scene.app();
    app.wait_ready().await;
    scene.publish(2).await;
    scene
        .wait_stats("two exhausted", Duration::from_secs(60), |s| {
            s.exhausted == 2
        })
        .await;
    scene.op.kill9();
    drop(app);
    // No operator: the finalizer is taken off by hand.
    delete_by_hand(&scene.ns, "orders");
    wait_gone(&scene.api, "orders", Duration::from_secs(30)).await;
    let ns = scene.ns.clone();
    let left = || {
        let (status, body) = management("GET", "/api/queues/%2f?columns=name");
        assert_eq!(status, 200, "{body}");
        let all: Vec<Value> = serde_json::from_str(&body).expect("JSON");
        all.iter()
            .filter_map(|q| q["name"].as_str().map(str::to_string))
            .filter(|n| {
                ["stats", "ledger", "instances", "object", "report"]
                    .iter()
                    .any(|k| n.starts_with(&format!("settle.{k}.{ns}.orders")))
            })
            .collect::<Vec<_>>()
    };
    assert!(!left().is_empty(), "the account's queues are there before");
    scene.op = Operator::start_with(&scene.test, &scene.ns, &OPERATOR_FLAGS);
    poll(
        "the deleted Subscription's account queues swept",
        Duration::from_secs(30),
        || async {
            match left() {
                l if l.is_empty() => Ok(()),
                l => Err(format!("{l:?}")),
            }
        },
    )
    .await;
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_attempts_a_crash_spent_on_rabbitmq_are_counted_once_from_the_dead_letters_the_user_keeps()
 {
    let mut scene = Scene::with_dead_letters("acctrq-crash").await;
    let (_, dlq) = scene.dead.clone().expect("dead letters");
    let mut app = scene.app_with("nack-then-hold");
    app.wait_ready().await;
    scene.publish(4).await;
    // Attempts 1 and 2 declined, attempt 3 (the last) held by a handler that never returns.
    app.wait_count("held", 4, Duration::from_secs(60)).await;
    scene
        .wait_stats(
            "the eight declines reported",
            Duration::from_secs(30),
            |s| s.settlement.nacked == 8,
        )
        .await;
    assert_eq!(scene.reported().await.map(|s| s.exhausted), Some(0));
    // Killed holding four last attempts: the runtime never saw them end. The channel's close
    // returns them, past x-delivery-limit, so the quorum queue dead-letters them.
    app.kill9();
    let s = scene
        .wait_stats(
            "the four last attempts counted exhausted from the dead letters",
            Duration::from_secs(60),
            |s| s.exhausted >= 4,
        )
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(scene.reported().await, Some(s), "nothing more arrives");
    assert_eq!(
        (s.exhausted, s.settlement.nacked, s.delivered, s.offered),
        (4, 8, 8, 12),
        "{s:?}"
    );
    assert_eq!(scene.dead_letter_metric("counted"), 4.0);
    // The user's own dead-letter queue holds all four: the operator's is a copy.
    let letters = scene.dead_letters(4).await;
    for death in Scene::deaths(&letters) {
        assert_eq!(death, ("delivery_limit".to_string(), scene.tag.clone()));
    }
    let st = scene
        .api
        .get("orders")
        .await
        .expect("get")
        .status
        .unwrap_or_default();
    let (status, _, message) = condition(&st.conditions, "Exhausting").expect("Exhausting");
    assert_eq!(status, "True", "{message}");
    assert!(
        message.starts_with("4 message(s)")
            && message.contains("where the broker dead-letters them"),
        "{message}"
    );
    let (status, reason, message) = condition(&st.conditions, "Accounted").expect("Accounted");
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "Kept"),
        "{message}"
    );
    // The copy queue: bounded, drop-head, tagged with its Backend, every copy acknowledged.
    let copy = copy_queue(&scene.ns, "rabbit");
    let q = poll(
        "every copy acknowledged",
        Duration::from_secs(30),
        || async {
            let q = queue(&copy).ok_or("no copy queue")?;
            match q["messages"].as_u64() {
                Some(0) => Ok(q),
                m => Err(format!("{m:?} in the copy queue")),
            }
        },
    )
    .await;
    assert_eq!(q["arguments"]["x-max-length"], 100_000, "{q}");
    assert_eq!(q["arguments"]["x-overflow"], "drop-head", "{q}");
    assert_eq!(
        q["arguments"]["x-settle-backend"],
        format!("{}/rabbit", scene.ns),
        "{q}"
    );

    // The operator SIGKILLed after it saved the count and before it acknowledged the copies:
    // the broker hands the same four copies again (redelivered) to the next operator, which
    // counts none again. Made here: the same four copies put back in the copy queue, taken
    // and not acknowledged (as the killed operator had), so the broker redelivers them.
    scene.op.kill9();
    let ch = scene.amqp.create_channel().await.expect("channel");
    ch.confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let mut tags = Vec::new();
    for _ in 0..4 {
        let got = ch
            .basic_get(
                dlq.as_str().into(),
                lapin::options::BasicGetOptions { no_ack: false },
            )
            .await
            .expect("basic.get")
            .expect("a dead letter");
        ch.basic_publish(
            "".into(),
            copy.as_str().into(),
            BasicPublishOptions::default(),
            &got.delivery.data,
            got.delivery.properties.clone(),
        )
        .await
        .expect("publish")
        .await
        .expect("confirmed");
        tags.push(got.delivery.delivery_tag);
    }
    for tag in tags {
        ch.basic_reject(tag, lapin::options::BasicRejectOptions { requeue: true })
            .await
            .expect("put back");
    }
    let _ = ch.close(200, "copied".into()).await;
    let holder = scene.amqp.create_channel().await.expect("channel");
    for _ in 0..4 {
        holder
            .basic_get(
                copy.as_str().into(),
                lapin::options::BasicGetOptions { no_ack: false },
            )
            .await
            .expect("basic.get")
            .expect("a copy");
    }
    // Closed unacknowledged: the broker requeues the four, redelivered.
    let _ = holder.close(200, "stopped".into()).await;
    scene.op = Operator::start_with(&scene.test, &scene.ns, &OPERATOR_FLAGS);
    poll(
        "the four copies seen again as counted before",
        Duration::from_secs(60),
        || async {
            match scene.dead_letter_metric("duplicate") {
                4.0 => Ok(()),
                n => Err(format!("{n} duplicate(s)")),
            }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = scene.reported().await.expect("stats");
    assert_eq!(
        (after.exhausted, after.settlement.nacked),
        (4, 8),
        "{after:?}"
    );
    assert_eq!(
        scene.dead_letter_metric("counted"),
        0.0,
        "the new operator counted nothing"
    );
    assert_eq!(
        scene.dead_letters(4).await.len(),
        4,
        "the user's queue still holds all four"
    );
    scene.assert_never_decreased();
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_last_attempts_on_rabbitmq_count_once_from_the_runtime_and_the_dead_letters() {
    let mut scene = Scene::with_dead_letters("acctrq-dlxnack").await;
    // Exhausted exactly 10 (not 20): the runtime's count and the copy's are of the same messages.
    let s = always_nack_scenario(&mut scene, Halfway::Nothing).await;
    assert_eq!(s.exhausted, 10, "{s:?}");
    poll(
        "the copy counted the ten rejected last attempts too",
        Duration::from_secs(30),
        || async {
            match scene.dead_letter_metric("counted") {
                10.0 => Ok(()),
                n => Err(format!("{n} counted")),
            }
        },
    )
    .await;
    let letters = scene.dead_letters(10).await;
    for death in Scene::deaths(&letters) {
        assert_eq!(death, ("rejected".to_string(), scene.tag.clone()));
    }

    // The copy queue deleted on the broker: made again and consumed, and the gap said.
    let copy = copy_queue(&scene.ns, "rabbit");
    let (status, body) = management("DELETE", &format!("/api/queues/%2f/{copy}"));
    assert_eq!(status, 204, "DELETE {copy}: {body}");
    poll(
        "the copy queue made again and consumed",
        Duration::from_secs(30),
        || async {
            match queue(&copy) {
                Some(q) if q["consumers"].as_u64() == Some(1) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let message = poll(
        "Accounted says dead letters may be missing",
        Duration::from_secs(30),
        || async {
            let st = scene.api.get("orders").await.map_err(|e| e.to_string())?;
            let conds = st.status.unwrap_or_default().conditions;
            match condition(&conds, "Accounted") {
                Some((s, r, m)) if s == "False" && r == "DeadLettersMissed" => Ok(m),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert!(message.contains("deleted on the broker"), "{message}");
    assert_eq!(scene.dead_letter_metric("copy_queue_lost"), 1.0);
    // Counting goes on through the new copy queue: the same 10, and no more.
    assert_eq!(scene.reported().await.map(|s| s.exhausted), Some(10));
    scene.assert_never_decreased();

    // The Backend's last AtLeastOnce Subscription deleted: its copy queue goes too; the
    // user's dead-letter queue stays with all ten.
    scene
        .api
        .delete("orders", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&scene.api, "orders", Duration::from_secs(60)).await;
    poll(
        "the copy queue deleted with the last Subscription",
        Duration::from_secs(30),
        || async {
            match queue(&copy) {
                None => Ok(()),
                Some(q) => Err(format!("{} message(s)", q["messages"])),
            }
        },
    )
    .await;
    assert_eq!(scene.dead_letters(10).await.len(), 10);
    scene.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_copy_queue_is_bound_to_receive_what_each_type_of_dead_letter_exchange_routes() {
    use settle::backend::rabbitmq::dead_letters::{Copy, Kind, ensure_copy, exchange_kind};
    let env = common::env();
    let amqp =
        lapin::Connection::connect(&env.rabbitmq_url, lapin::ConnectionProperties::default())
            .await
            .expect("connect to RabbitMQ");
    let ns = format!("dlxkinds{}", std::process::id());
    let keys = ["orders.created".to_string(), "orders.#".to_string()];
    assert_eq!(
        exchange_kind(&amqp, &format!("{ns}.missing"), None)
            .await
            .expect("ask"),
        None
    );
    assert!(matches!(
        ensure_copy(&amqp, &ns, "missing", &format!("{ns}.missing"), &keys, 10, None).await,
        Ok((Copy::None(why), None)) if why.contains("does not exist")
    ));
    for (kind, want) in [
        ("fanout", Kind::Fanout),
        ("topic", Kind::Topic),
        ("headers", Kind::Headers),
        ("direct", Kind::Direct),
    ] {
        let dlx = format!("{ns}.{kind}");
        let (status, body) = management_with(
            "PUT",
            &format!("/api/exchanges/%2f/{dlx}"),
            &format!(r#"{{"type":"{kind}","durable":true}}"#),
        );
        assert!(matches!(status, 201 | 204), "{status} {body}");
        // Learned with AMQP alone, and the exchange is left as it was.
        assert_eq!(
            exchange_kind(&amqp, &dlx, None).await.expect("ask"),
            Some(want.clone())
        );
        let (copy, learned) = ensure_copy(&amqp, &ns, kind, &dlx, &keys, 10, None)
            .await
            .expect("copy");
        assert_eq!(learned.as_ref(), Some(&want));
        match kind {
            // A direct exchange: the literal key is copied, the wildcard one cannot be.
            "direct" => assert!(
                matches!(&copy, Copy::Partial { made: true, why } if why.contains("orders.#")),
                "{copy:?}"
            ),
            _ => assert_eq!(copy, Copy::Whole { made: true }),
        }
        let (_, body) = management("GET", &format!("/api/exchanges/%2f/{dlx}"));
        let x: Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(x["type"], kind, "{x}");
        // A dead letter routed by that exchange with a Subscription's literal key reaches the copy.
        let (status, body) = management_with(
            "POST",
            &format!("/api/exchanges/%2f/{dlx}/publish"),
            r#"{"properties":{},"routing_key":"orders.created","payload":"x","payload_encoding":"string"}"#,
        );
        assert!(
            status == 200 && body.contains(r#""routed":true"#),
            "{kind}: {status} {body}"
        );
        let q = copy_queue(&ns, kind);
        let (status, body) = management_with(
            "POST",
            &format!("/api/queues/%2f/{q}/get"),
            r#"{"count":10,"ackmode":"ack_requeue_false","encoding":"auto"}"#,
        );
        let got: Vec<Value> = serde_json::from_str(&body).unwrap_or_default();
        assert_eq!((status, got.len()), (200, 1), "{kind}: {body}");
        // A type known from an earlier look is not learned again (no declare refused to learn
        // it): what the caller kept comes back while the exchange is there.
        let kept = Kind::Other("kept".into());
        assert_eq!(
            exchange_kind(&amqp, &dlx, Some(&kept)).await.expect("ask"),
            Some(kept)
        );
        // Made once: the next look, with the type known, finds it and binds again, harmlessly.
        let (again, kept) = ensure_copy(&amqp, &ns, kind, &dlx, &keys, 10, Some(&want))
            .await
            .expect("copy");
        assert_eq!(kept, Some(want.clone()));
        assert!(
            matches!(
                again,
                Copy::Whole { made: false } | Copy::Partial { made: false, .. }
            ),
            "{again:?}"
        );
        management("DELETE", &format!("/api/queues/%2f/{q}"));
        management("DELETE", &format!("/api/exchanges/%2f/{dlx}"));
        // A known type does not outlive its exchange.
        assert_eq!(
            exchange_kind(&amqp, &dlx, Some(&want)).await.expect("ask"),
            None
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_blocked_forever_on_rabbitmq_raises_stalled_until_one_acks() {
    let scene = Scene::build(
        "acctrq-stall",
        false,
        STALL_SPEC,
        &stall_flags(&OPERATOR_FLAGS),
    )
    .await;
    stalled_scenario(&scene).await;
    scene.finish().await;
}
