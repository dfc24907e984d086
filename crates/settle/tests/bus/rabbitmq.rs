//! The handler runtime on a real RabbitMQ (3.10, no plugins but management): the conformance
//! suite, and the rules of docs/semantics.md that involve what the broker is sent or does
//! (R1–R7, P3, P4). Each test uses its own topic exchange and queues, so the tests share one
//! broker and run in parallel; what a queue holds is read back over the management API.
//!
//! Needs the environment (`make env-up`); never skips.

use settle_testkit as common;

use std::time::Duration;

use common::bus::{BusScene, Message, Seen, at_least_once, stats, sub, until};
use common::rabbitmq::{bindings, encode, management, management_json};
use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use serde_json::Value;
use settle::api::{self, Backoff, DeliveryPolicy, SlowHandler};
use settle::backend::rabbitmq::RabbitBroker;
use settle::backend::rabbitmq::mapping::{self, Binding, Exchanges, LiveQueue};
use settle::bus::{self, Bus, BusBuilder, BusError, Delivery, Subscriber, handler};
use settle::policy::ResolvedPolicy;
use tokio::time::Instant;

// ---------------------------------------------------------------- helpers

static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// A private topic exchange for one test; its queues and the exchange are deleted by `cleanup`.
struct Scope {
    conn: Connection,
    exchange: String,
    tag: String,
}

impl Scope {
    async fn new(test: &str) -> Scope {
        let env = common::env();
        let conn = Connection::connect(&env.rabbitmq_url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", env.rabbitmq_url));
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("{test}-{}-{n}", std::process::id());
        let exchange = format!("settle.test.{tag}");
        let ch = conn.create_channel().await.unwrap();
        ch.exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        Scope {
            conn,
            exchange,
            tag,
        }
    }

    async fn backend(&self) -> RabbitBroker {
        RabbitBroker::connect(&common::env().rabbitmq_url)
            .await
            .unwrap()
            .with_exchange(self.exchange.clone())
    }

    async fn bus(&self) -> Bus {
        Bus::builder(self.backend().await).without_reports().build()
    }

    /// A durable (queue) name unique to this test.
    fn durable(&self, name: &str) -> String {
        format!("{name}-{}", self.tag)
    }

    fn alo(&self, durable: &str) -> DeliveryPolicy {
        at_least_once("orders.>", &self.durable(durable))
    }

    async fn publish(&self, bus: &Bus, subject: &str, body: &str) {
        bus.publish(subject, body.to_string()).await.unwrap();
    }

    /// Deletes every queue bound to the exchange, then the exchange.
    async fn cleanup(self) {
        let bindings = management_json(
            "GET",
            &format!(
                "/api/exchanges/%2f/{}/bindings/source",
                encode(&self.exchange)
            ),
        );
        for b in bindings.as_array().cloned().unwrap_or_default() {
            if b["destination_type"] == "queue" {
                let q = b["destination"].as_str().unwrap_or_default();
                mgmt_status("DELETE", &format!("/api/queues/%2f/{}", encode(q)));
            }
        }
        let ch = self.conn.create_channel().await.unwrap();
        let _ = ch
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
        let _ = self.conn.close(200, "done".into()).await;
    }
}

fn mgmt_status(method: &str, path: &str) -> u16 {
    management(method, path).0
}

fn queue_info(name: &str) -> Value {
    management_json("GET", &format!("/api/queues/%2f/{}", encode(name)))
}

/// The shared scenarios' view of a scope: subscription `name` listens on `orders.>` with a
/// durable name of this test's own, and message `n` is published to `orders.n` through the bus.
impl BusScene for Scope {
    async fn builder(&self) -> BusBuilder {
        Bus::builder(self.backend().await).without_reports()
    }

    fn alo(&self, name: &str) -> DeliveryPolicy {
        Scope::alo(self, name)
    }

    async fn send(&self, bus: &Bus, m: Message<'_>) {
        let subject = format!("orders.{}", m.n);
        bus.publish_with_headers(subject, m.headers, m.body.to_string())
            .await
            .unwrap();
    }
}

/// Polls the management API (its figures lag by a few seconds) until `f` holds of the queue.
async fn until_queue(name: &str, what: &str, f: impl Fn(&Value) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let q = queue_info(name);
        if f(&q) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for queue {name}: {what}: {q}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The consumer on queue `name`, as the management API lists it (after its next stats tick).
async fn consumer_of(name: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let all = management_json("GET", "/api/consumers/%2f");
        if let Some(c) = all
            .as_array()
            .and_then(|a| a.iter().find(|c| c["queue"]["name"] == name))
        {
            return c.clone();
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for a consumer on {name}: {all}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

// ---------------------------------------------------------------- conformance

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_conformance_suite_passes_on_real_rabbitmq() {
    // semantics T1–T4: redelivery with an increasing attempt, MaxDeliver and Exhausted,
    // per-message acknowledgement, a refused settlement after retirement. T5 (a declined
    // message waits out its delay) does not apply: RabbitMQ does not declare delaysRedelivery.
    let scope = Scope::new("conformance").await;
    let backend = scope.backend().await;
    let rows = bus::conformance::run(&backend, "conformance")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(rows, bus::conformance::ROWS[..4].to_vec());
    assert!(!rows.contains(&"a declined message waits out its delay"));
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_shared_scenes_hold_on_real_rabbitmq() {
    // conformance/scenes.json, the scenes the Go runtime runs too: each on an exchange of its
    // own. The delay scene needs delaysRedelivery, which RabbitMQ does not declare.
    let scopes =
        futures::future::join_all((0..common::scenes::count()).map(|_| Scope::new("scenes"))).await;
    let ran = common::scenes::run_all("rabbitmq", false, &scopes).await;
    assert_eq!(ran, common::scenes::count() - 1);
    for s in scopes {
        s.cleanup().await;
    }
}

// ---------------------------------------------------------------- the queue Settle declares

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_code_defined_subscription_declares_exactly_the_mapped_quorum_queue_and_binding() {
    // semantics R1: a quorum queue named durableName, x-delivery-limit = maxDeliver - 1, the
    // owner argument, bound to the exchange by the pattern (`>` as `#`); P1: prefetch is
    // maxInFlight.
    let scope = Scope::new("declare").await;
    let bus = scope.bus().await;
    let mut p = scope.alo("decl");
    p.pattern = "orders.*.>".into();
    p.max_deliver = Some(3);
    p.max_in_flight = Some(7);
    bus.subscribe(sub("decl", p.clone(), |d| async move {
        d.ack().await?;
        Ok(())
    }))
    .await
    .unwrap();

    let name = scope.durable("decl");
    let q = queue_info(&name);
    assert_eq!(q["type"], "quorum", "{q}");
    assert_eq!(q["durable"], true);
    assert_eq!(q["auto_delete"], false);
    assert_eq!(q["exclusive"], false);
    let arguments = q["arguments"].as_object().unwrap();
    assert_eq!(arguments["x-delivery-limit"], 2, "{q}");
    assert_eq!(arguments["x-queue-type"], "quorum");
    assert_eq!(arguments["x-settle-subscription"], "default/decl");
    let bindings: Vec<Binding> = bindings(&name)
        .into_iter()
        .map(|(exchange, routing_key)| Binding {
            exchange,
            routing_key,
        })
        .collect();
    assert_eq!(
        bindings,
        [Binding {
            exchange: scope.exchange.clone(),
            routing_key: "orders.*.#".into()
        }]
    );
    // Exactly the mapping: nothing more, nothing less.
    let want = mapping::desired_by_runtime(
        "default",
        "decl",
        &ResolvedPolicy::resolve(&p),
        &Exchanges {
            exchange: scope.exchange.clone(),
            dead_letter: None,
        },
    );
    let live = LiveQueue {
        arguments: mapping::normalise(arguments),
        bindings,
        state: q["state"].as_str().map(str::to_string),
    };
    let d = mapping::diff(&want, &live);
    assert!(d.is_empty(), "{d:?}");
    // The consumer's prefetch is maxInFlight, with manual acknowledgement.
    let mine = consumer_of(&name).await;
    assert_eq!(mine["prefetch_count"], 7, "{mine}");
    assert_eq!(mine["ack_required"], true, "{mine}");
    bus.close().await;
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_least_once_requires_a_durable_name_on_rabbitmq() {
    // semantics M3: durableName is required under AtLeastOnce, on every backend; on RabbitMQ it
    // is the queue's name, so without one no queue is declared.
    let scope = Scope::new("durable").await;
    common::bus::refused_without_a_durable_name(&scope, "x").await;
    assert_eq!(
        mgmt_status(
            "GET",
            &format!("/api/queues/%2f/{}", encode(&scope.durable("x")))
        ),
        404,
        "a refused subscription declares nothing"
    );
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queue_with_other_arguments_is_refused_not_silently_reused() {
    // semantics R1: RabbitMQ cannot change a queue's arguments in place; the runtime says so and
    // names the way out instead of consuming with the old limit.
    let scope = Scope::new("differs").await;
    let bus = scope.bus().await;
    let p = scope.alo("diff");
    bus.subscribe(sub("diff", p.clone(), |d| async move {
        d.ack().await?;
        Ok(())
    }))
    .await
    .unwrap();
    bus.close().await;
    let mut changed = p.clone();
    changed.max_deliver = Some(9);
    let err = scope
        .bus()
        .await
        .subscribe(sub("diff", changed, |_d| async { Ok(()) }))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("x-delivery-limit") && text.contains("delete the queue"),
        "{text}"
    );
    let typed = err.broker_error::<settle::backend::rabbitmq::RabbitError>();
    assert!(
        matches!(
            typed,
            Some(settle::backend::rabbitmq::RabbitError::QueueDiffers { .. })
        ),
        "{err:?}"
    );
    scope.cleanup().await;
}

// ---------------------------------------------------------------- settlements on the broker

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn always_nack_with_max_deliver_three_exhausts_every_message_after_three_attempts() {
    // semantics M2, C7, R3: each decline is a requeue; the third is the last attempt, counted
    // Exhausted and rejected without requeue, so nothing comes back and the queue is empty.
    let scope = Scope::new("exhaust").await;
    let mut p = scope.alo("ex");
    p.max_deliver = Some(3);
    let (bus, seen) = common::bus::always_nack_until_exhausted(&scope, "ex", p, 10).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let st = stats(&bus, "ex");
    assert_eq!((st.exhausted, st.settlement.nacked), (10, 30), "{st:?}");
    assert_eq!((st.offered, st.delivered), (30, 30));
    assert_eq!((st.settlement.refused, st.stranded), (0, 0));
    for i in 0..10 {
        let mut attempts: Vec<u32> = seen
            .all()
            .into_iter()
            .filter(|(b, _)| *b == i.to_string())
            .map(|(_, a)| a)
            .collect();
        attempts.sort();
        assert_eq!(attempts, [1, 2, 3], "message {i}");
    }
    until_queue(&scope.durable("ex"), "empty", |q| {
        q["messages"] == 0 && q["messages_unacknowledged"] == 0
    })
    .await;
    bus.close().await;
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forgotten_ack_with_prefetch_five_never_stalls_and_is_counted_silent_exactly() {
    // semantics P3: with prefetch 5, a handler that forgets to settle would stop the consumer
    // after 5 messages (the broker sends no more). In Settle each forgotten ack is counted
    // Silent and its message requeued, so all 50 are handled.
    let scope = Scope::new("forgotten").await;
    let bus = scope.bus().await;
    let seen = Seen::default();
    let s = seen.clone();
    let mut p = scope.alo("fg");
    p.max_in_flight = Some(5);
    bus.subscribe(sub("fg", p, move |d| {
        let s = s.clone();
        async move {
            s.record(&d);
            // Forgets the ack on every first attempt (and takes a little time, as real work
            // does, so the five slots are really held).
            tokio::time::sleep(Duration::from_millis(5)).await;
            if d.attempt() >= 2 {
                d.ack().await?;
            }
            Ok(())
        }
    }))
    .await
    .unwrap();
    for i in 0..50 {
        scope
            .publish(&bus, &format!("orders.{i}"), &i.to_string())
            .await;
    }
    // Delivered counts an attempt when its handler returns, just after the ack inside it.
    until("all 50 acked and every attempt returned", || {
        let st = stats(&bus, "fg");
        st.settlement.acked == 50 && st.delivered == 100
    })
    .await;
    let st = stats(&bus, "fg");
    assert_eq!(st.settlement.silent, 50, "{st:?}");
    assert_eq!(st.delivered, 100);
    assert_eq!(st.exhausted, 0);
    let mut handled: Vec<String> = seen
        .all()
        .into_iter()
        .filter(|(_, a)| *a >= 2)
        .map(|(b, _)| b)
        .collect();
    handled.sort();
    handled.dedup();
    assert_eq!(
        handled.len(),
        50,
        "every message handled after its forgotten ack"
    );
    until_queue(&scope.durable("fg"), "drained", |q| {
        q["messages"] == 0 && q["messages_unacknowledged"] == 0
    })
    .await;
    bus.close().await;
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forgotten_ack_with_prefetch_one_never_stalls_the_consumer_on_rabbitmq() {
    // semantics P3: with maxInFlight 1 (prefetch 1) a forgotten ack would stop the consumer
    // after one message; in Settle each is counted Silent and requeued, and on its last attempt
    // (maxDeliver 2) Exhausted and rejected, so the consumer goes on and the queue drains.
    let scope = Scope::new("forgottenone").await;
    let (bus, runs) =
        common::bus::a_forgotten_ack_with_prefetch_one_never_stalls(&scope, "fg1", 4).await;
    assert_eq!(runs, 8, "the consumer went past the first message");
    let name = scope.durable("fg1");
    let mine = consumer_of(&name).await;
    assert_eq!(mine["prefetch_count"], 1, "prefetch is maxInFlight: {mine}");
    until_queue(&name, "drained", |q| {
        q["messages"] == 0 && q["messages_unacknowledged"] == 0
    })
    .await;
    bus.close().await;
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_most_once_consumes_with_automatic_ack_and_a_nack_brings_nothing_back() {
    // semantics M1, P4, R2: AtMostOnce is RabbitMQ's `none`: the broker forgets each message
    // when it sends it. A Nack is counted and changes nothing.
    let scope = Scope::new("amo").await;
    let p = DeliveryPolicy {
        pattern: "orders.>".into(),
        durable_name: Some(scope.durable("amo")),
        ..DeliveryPolicy::default()
    };
    let (bus, _) = common::bus::at_most_once_nacks_bring_nothing_back(
        &scope,
        "amo",
        p,
        2,
        Duration::from_millis(700),
    )
    .await;
    let st = stats(&bus, "amo");
    assert_eq!(
        (st.settlement.nacked, st.exhausted, st.settlement.refused),
        (2, 0, 0)
    );
    let name = scope.durable("amo");
    let mine = consumer_of(&name).await;
    assert_eq!(
        mine["ack_required"], false,
        "automatic acknowledgement: {mine}"
    );
    until_queue(&name, "nothing kept", |q| {
        q["messages"] == 0 && q["messages_unacknowledged"] == 0
    })
    .await;
    bus.close().await;
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_never_hands_a_message_on_while_its_handler_runs_whatever_the_slow_handler_settings()
 {
    // semantics H4, K6, A10: RabbitMQ has no per-subscription ack timeout; it hands a message on
    // only when the channel that received it closes. ackWait 1 s and maxProcessingTime 2 s are
    // warned of as having no effect, and have none: a handler of 4 s keeps its message, once,
    // under either slowHandler setting, with no LeaseExpired.
    let scope = Scope::new("slow").await;
    for slow in [SlowHandler::ExtendLease, SlowHandler::Redeliver] {
        let name = format!("slow-{slow:?}").to_lowercase();
        let mut p = scope.alo(&name);
        p.slow_handler = Some(slow);
        p.ack_wait = Some(api::Duration::from_secs(1));
        p.max_processing_time = Some(api::Duration::from_secs(2));
        let (bus, _) =
            common::bus::a_slow_handler_keeps_its_message(&scope, &name, p, Duration::from_secs(4))
                .await;
        assert_eq!(stats(&bus, &name).settlement.acked, 1, "{slow:?}");
        bus.close().await;
    }
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn closing_with_a_handler_still_running_releases_and_the_broker_redelivers() {
    // semantics C3, R5: an attempt given up at close is Released; the broker requeues it, and it
    // comes back to the next consumer as a later attempt.
    let scope = Scope::new("release").await;
    let attempts = common::bus::released_at_close_comes_back(
        &scope,
        "rel",
        scope.alo("rel"),
        Duration::from_millis(200),
        async |st| assert_eq!((st.released, st.delivered, st.stranded), (1, 0, 0)),
    )
    .await;
    assert!(attempts[0] >= 2, "a later attempt: {attempts:?}");
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_close_ends_while_the_broker_answers_nothing() {
    // The close's broker calls (basic.cancel, the release's basic.nack, channel.close) wait at
    // most CLOSE_STEP each: a graceful stop ends, and its handler's attempt is Released, while the
    // broker holds every call unanswered (a node cut off, on a node of the test's own: the
    // environment's is shared). A close that waited for the broker would hang here until the
    // node came back, which it does only after the assertion.
    let server = tokio::task::block_in_place(common::rabbitmq_server::RabbitServer::start);
    let bus = Bus::builder(RabbitBroker::connect(&server.url()).await.unwrap())
        .without_reports()
        .close_grace(Duration::from_millis(500))
        .build();
    let started = std::sync::Arc::new(tokio::sync::Notify::new());
    let seen = started.clone();
    bus.subscribe(sub(
        "frozen",
        at_least_once("orders.>", "frozen"),
        move |_d| {
            let seen = seen.clone();
            async move {
                seen.notify_one();
                tokio::time::sleep(Duration::from_secs(600)).await;
                Ok(())
            }
        },
    ))
    .await
    .unwrap();
    bus.publish("orders.1", "held".to_string()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), started.notified())
        .await
        .expect("the handler started");
    server.freeze();
    let began = Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(120), bus.close()).await;
    let took = began.elapsed();
    server.thaw();
    assert!(
        closed.is_ok(),
        "the close did not end within 120 s of the broker going silent"
    );
    eprintln!("closed {took:?} after the broker went silent");
    assert_eq!(stats(&bus, "frozen").released, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_correlation_id_property_contradicting_a_masstransit_envelope_is_a_foreign_conflict() {
    // semantics C11, R6: the AMQP correlation_id property is a transport header; when it differs
    // from the MassTransit envelope's correlationId the envelope wins and the attempt counts a
    // ForeignConflict.
    let scope = Scope::new("foreign").await;
    common::bus::a_masstransit_envelope_contradicted_by_a_header_is_a_foreign_conflict(&scope)
        .await;
    scope.cleanup().await;
}

// ---------------------------------------------------------------- what RabbitMQ cannot honour

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backoff_on_rabbitmq_is_refused_by_the_bus_and_by_settle_check_with_the_field_named() {
    // semantics B7, A3, K5: RabbitMQ without plugins cannot hold a declined message back.
    let scope = Scope::new("backoff").await;
    let bus = scope.bus().await;
    let mut p = scope.alo("bo");
    p.backoff = Some(Backoff {
        initial: settle::api::Duration::from_secs(1),
        max: settle::api::Duration::from_secs(60),
        multiplier: 2.0,
    });
    let err = bus
        .subscribe(sub("bo", p, |_d| async { Ok(()) }))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, BusError::Refused { reason, .. } if reason.contains("spec.backoff") && reason.contains("cannot delay a redelivery")),
        "{err}"
    );
    assert_eq!(
        mgmt_status(
            "GET",
            &format!("/api/queues/%2f/{}", encode(&scope.durable("bo")))
        ),
        404,
        "a refused subscription declares nothing"
    );

    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("sub.yaml");
    std::fs::write(
        &f,
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {name: orders, namespace: shop}\n\
         spec:\n  backendRef: {name: rabbit}\n  pattern: orders.>\n  mode: AtLeastOnce\n  durableName: orders\n  \
         backoff: {initial: 1s, max: 1m}\n",
    )
    .unwrap();
    let out = std::process::Command::new(common::bin("settle"))
        .args([
            "check",
            "-f",
            f.to_str().unwrap(),
            "--backend-kind",
            "rabbitmq",
        ])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("error: spec.backoff: this backend cannot delay a redelivery"),
        "{text}"
    );
    assert!(!text.contains("does not drive it yet"), "{text}");
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_from_the_resource_is_refused_by_the_bus_in_the_admission_rules_words() {
    // semantics A15, K10: RabbitMQ has no named streams; the runtime's refusal is the policy's
    // (validate_runtime, the same words as the webhook's), and nothing is declared or awaited.
    let scope = Scope::new("stream").await;
    let bus = Bus::builder(scope.backend().await)
        .without_reports()
        .namespace("shop")
        .build();
    let spec = settle::api::SubscriptionSpec {
        backend_ref: settle::api::BackendRef {
            name: "rabbit".into(),
        },
        stream: Some("ORDERS".into()),
        policy: scope.alo("st"),
        deletion_policy: Default::default(),
        adopt: Default::default(),
        paused: false,
        paused_until: None,
    };
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        bus.subscribe(Subscriber::from_resource(
            "st",
            &spec,
            handler(|_d: Delivery| async { Ok::<(), bus::HandlerError>(()) }),
        )),
    )
    .await
    .expect("refused at once, not waiting for a queue")
    .unwrap_err();
    let want = settle::policy::validate(
        &spec,
        None,
        settle::policy::BackendView::Known {
            name: "rabbit",
            capabilities: &settle::policy::capabilities_of(settle::policy::BackendKind::Rabbitmq),
        },
    )
    .error_text();
    assert!(want.starts_with("spec.stream: "), "{want}");
    assert!(
        matches!(&err, BusError::Refused { reason, .. } if *reason == want),
        "{err}"
    );
    assert_eq!(
        mgmt_status(
            "GET",
            &format!("/api/queues/%2f/{}", encode(&scope.durable("st")))
        ),
        404,
        "a refused subscription declares nothing"
    );
    bus.close().await;
    scope.cleanup().await;
}

// ---------------------------------------------------------------- the operator's queue

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_runtime_built_from_the_resource_waits_for_the_operators_queue_and_never_declares_it() {
    // semantics R1: a subscription from a Subscription resource binds to the queue the operator
    // made; while it does not exist the runtime waits (and logs why), declaring nothing.
    let scope = Scope::new("operator").await;
    let bus = Bus::builder(scope.backend().await)
        .without_reports()
        .namespace("shop")
        .build();
    let policy = scope.alo("op");
    let spec = settle::api::SubscriptionSpec {
        backend_ref: settle::api::BackendRef {
            name: "rabbit".into(),
        },
        stream: None,
        policy: policy.clone(),
        deletion_policy: Default::default(),
        adopt: Default::default(),
        paused: false,
        paused_until: None,
    };
    let seen = Seen::default();
    let s = seen.clone();
    let subscriber = Subscriber::from_resource(
        "op",
        &spec,
        handler(move |d: Delivery| {
            let s = s.clone();
            async move {
                s.record(&d);
                d.ack().await?;
                Ok::<(), bus::HandlerError>(())
            }
        }),
    );
    let b = bus.clone();
    let subscribing = tokio::spawn(async move { b.subscribe(subscriber).await });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!subscribing.is_finished(), "waits for the operator's queue");
    let name = scope.durable("op");
    assert_eq!(
        mgmt_status("GET", &format!("/api/queues/%2f/{}", encode(&name))),
        404,
        "the runtime declares nothing for an operator-owned subscription"
    );

    // The operator makes the queue from the same mapping.
    let want = mapping::desired(
        "shop",
        "op",
        &ResolvedPolicy::resolve(&policy),
        &Exchanges {
            exchange: scope.exchange.clone(),
            dead_letter: None,
        },
    );
    let ch = scope.conn.create_channel().await.unwrap();
    ch.queue_declare(
        want.name.as_str().into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        want.arguments_table(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        want.name.as_str().into(),
        want.binding.exchange.as_str().into(),
        want.binding.routing_key.as_str().into(),
        lapin::options::QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !subscribing.is_finished() {
        assert!(
            Instant::now() < deadline,
            "subscribe did not return after the queue appeared"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    subscribing.await.unwrap().unwrap();
    scope.publish(&bus, "orders.1", "a").await;
    until("handled", || seen.len() == 1).await;
    assert_eq!(stats(&bus, "op").settlement.acked, 1);
    bus.close().await;
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exhausted_message_goes_to_the_dead_letter_exchange_when_one_is_set() {
    // semantics R3: the last declined attempt is rejected without requeue; the queue's
    // x-dead-letter-exchange (the Backend's deadLetterExchange) receives it.
    let scope = Scope::new("dlx").await;
    let dlx = format!("{}.dead", scope.exchange);
    let dead = scope.durable("dead");
    let ch = scope.conn.create_channel().await.unwrap();
    ch.exchange_declare(
        dlx.as_str().into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_declare(
        dead.as_str().into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        dead.as_str().into(),
        dlx.as_str().into(),
        "".into(),
        lapin::options::QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let bus = Bus::builder(scope.backend().await.with_dead_letter_exchange(dlx.clone()))
        .without_reports()
        .build();
    let mut p = scope.alo("dl");
    p.max_deliver = Some(2);
    bus.subscribe(sub("dl", p, |d| async move {
        d.nack().await?;
        Ok(())
    }))
    .await
    .unwrap();
    assert_eq!(
        queue_info(&scope.durable("dl"))["arguments"]["x-dead-letter-exchange"],
        dlx.as_str()
    );
    scope.publish(&bus, "orders.1", "a").await;
    until("exhausted", || stats(&bus, "dl").exhausted == 1).await;
    until_queue(&dead, "the exhausted message dead-lettered", |q| {
        q["messages"] == 1
    })
    .await;
    assert_eq!(stats(&bus, "dl").settlement.nacked, 2);
    bus.close().await;
    mgmt_status("DELETE", &format!("/api/queues/%2f/{}", encode(&dead)));
    let _ = ch
        .exchange_delete(dlx.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    scope.cleanup().await;
}

/// A Subscription's applications read its object mark at once when the broker comes back, and
/// a read takes the one message and puts it back: each of sixteen readers at once, on two
/// connections, still finds the mark (one that found the queue empty would go on counting for
/// the object it was bound to before, semantics C15).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readers_at_once_each_find_the_object_mark() {
    use settle::backend::rabbitmq::report::{mark_object, object_queue, read_object};
    let scope = Scope::new("marks").await;
    let (ns, name) = (scope.tag.clone(), "orders");
    mark_object(&scope.conn, &ns, name, "uid-1")
        .await
        .expect("the mark");
    let mut conns = Vec::new();
    for _ in 0..2 {
        conns.push(std::sync::Arc::new(
            Connection::connect(&common::env().rabbitmq_url, ConnectionProperties::default())
                .await
                .expect("a connection"),
        ));
    }
    let reads = (0..16).map(|i| {
        let (conn, ns) = (conns[i % 2].clone(), ns.clone());
        tokio::spawn(async move { read_object(&conn, &ns, name).await })
    });
    let found: Vec<Option<String>> = futures::future::join_all(reads)
        .await
        .into_iter()
        .map(|r| r.expect("a read"))
        .collect();
    mgmt_status(
        "DELETE",
        &format!("/api/queues/%2f/{}", encode(&object_queue(&ns, name))),
    );
    scope.cleanup().await;
    assert!(
        found.iter().all(|f| f.as_deref() == Some("uid-1")),
        "every reader finds the mark: {found:?}"
    );
}
