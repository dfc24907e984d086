//! The handler runtime on a real SQS-compatible server (ElasticMQ): the conformance suite, and the
//! rules of docs/semantics.md that involve what SQS is sent or does (Q1–Q6). Each test uses its own
//! queue prefix, so the tests share one server and run in parallel.
//!
//! Needs the environment (`make env-up`); never skips.

use settle_testkit as common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::bus::{BusScene, Message, Seen, at_least_once, stats, sub, until};
use settle::api::{self, DeliveryPolicy};
use settle::backend::sqs::hold::{HOLD_LIMIT, Hold, hold};
use settle::backend::sqs::mapping::parse_redrive;
use settle::backend::sqs::{SqsBroker, SqsCredentials, SqsSettings};
use settle::bus::{self, Bus, BusBuilder, BusError, Delivery, Subscriber, handler};
use tokio::time::Instant;

// ---------------------------------------------------------------- helpers

static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// A private queue prefix on the environment's ElasticMQ; `cleanup` deletes its queues.
struct Scope {
    prefix: String,
}

impl Scope {
    fn new(test: &str) -> Scope {
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Scope {
            prefix: format!("{test}-{}-{n}-", std::process::id()),
        }
    }

    async fn broker(&self) -> SqsBroker {
        let env = common::env();
        SqsBroker::connect(SqsSettings {
            region: Some("elasticmq".into()),
            endpoint: Some(env.sqs_endpoint.clone()),
            credentials: SqsCredentials::Static {
                access_key_id: "test".into(),
                secret_access_key: "test".into(),
            },
            queue_prefix: self.prefix.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("connect to ElasticMQ at {}: {e}", env.sqs_endpoint))
    }

    async fn bus(&self) -> Bus {
        Bus::builder(self.broker().await).without_reports().build()
    }

    /// The attributes of a queue of this scope (`name` after the prefix).
    async fn attributes(&self, broker: &SqsBroker, name: &str) -> BTreeMap<String, String> {
        let full = format!("{}{name}", self.prefix);
        let url = broker
            .queue_url(&full)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("queue {full} does not exist"));
        broker.queue_attributes(&url).await.unwrap()
    }

    async fn cleanup(&self) {
        let broker = self.broker().await;
        let listed = broker
            .client()
            .list_queues()
            .queue_name_prefix(&self.prefix)
            .send()
            .await
            .unwrap();
        for url in listed.queue_urls.unwrap_or_default() {
            let _ = broker.client().delete_queue().queue_url(url).send().await;
        }
    }
}

/// An AtLeastOnce policy whose pattern is its durable name (a queue's name, semantics A12).
fn alo(name: &str) -> DeliveryPolicy {
    at_least_once(name, name)
}

/// The shared scenarios' view of a scope: subscription `name` consumes queue `name` (the
/// subject is the queue's name), so message `n` is published to `name` whatever `n` is.
impl BusScene for Scope {
    async fn builder(&self) -> BusBuilder {
        Bus::builder(self.broker().await).without_reports()
    }

    fn alo(&self, name: &str) -> DeliveryPolicy {
        alo(name)
    }

    async fn send(&self, bus: &Bus, m: Message<'_>) {
        let body = m.body.to_string();
        bus.publish_with_headers(m.name, m.headers, body)
            .await
            .unwrap();
    }
}

// ---------------------------------------------------------------- conformance

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_conformance_suite_passes_on_elasticmq() {
    // semantics T1–T5, the delay row included (SQS declares delaysRedelivery).
    let scope = Scope::new("conformance");
    let broker = scope.broker().await;
    let rows = bus::conformance::run(&broker, "unused")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(rows, bus::conformance::ROWS.to_vec());
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_shared_scenes_hold_on_elasticmq() {
    // conformance/scenes.json, the scenes the Go runtime runs too: each under a queue prefix
    // of its own.
    let scopes: Vec<Scope> = (0..common::scenes::count())
        .map(|_| Scope::new("scenes"))
        .collect();
    let ran = common::scenes::run_all("sqs", true, &scopes).await;
    assert_eq!(ran, common::scenes::count());
    for s in scopes {
        s.cleanup().await;
    }
}

// ---------------------------------------------------------------- the queue Settle makes

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_code_defined_subscription_declares_its_queue_and_dead_letter_queue() {
    // semantics Q1: VisibilityTimeout = ackWait; RedrivePolicy to <name>-dlq with
    // maxReceiveCount = maxDeliver; and a changed policy brings the queue in line.
    let scope = Scope::new("declare");
    let broker = scope.broker().await;
    let bus = Bus::builder(broker.clone()).without_reports().build();
    let mut p = alo("orders");
    p.ack_wait = Some(api::Duration::from_secs(7));
    p.max_deliver = Some(4);
    bus.subscribe(sub("orders", p.clone(), |_d| async { Ok(()) }))
        .await
        .unwrap();
    let q = scope.attributes(&broker, "orders").await;
    assert_eq!(q["VisibilityTimeout"], "7", "{q:?}");
    let redrive = parse_redrive(&q["RedrivePolicy"]).unwrap_or_else(|| panic!("{q:?}"));
    assert_eq!(redrive.max_receive_count, 4);
    assert_eq!(
        redrive.dead_letter_queue,
        format!("{}orders-dlq", scope.prefix)
    );
    // The dead-letter queue exists and is the one the redrive names. (Its MessageRetentionPeriod,
    // 14 days, is set but ElasticMQ does not report it.)
    let dlq = scope.attributes(&broker, "orders-dlq").await;
    assert!(
        dlq["QueueArn"].ends_with(&format!(":{}orders-dlq", scope.prefix)),
        "{dlq:?}"
    );
    bus.unsubscribe("orders").await.unwrap();

    p.ack_wait = Some(api::Duration::from_secs(9));
    p.max_deliver = Some(6);
    bus.subscribe(sub("orders", p, |_d| async { Ok(()) }))
        .await
        .unwrap();
    let q = scope.attributes(&broker, "orders").await;
    assert_eq!(q["VisibilityTimeout"], "9", "{q:?}");
    assert_eq!(
        parse_redrive(&q["RedrivePolicy"]).map(|r| r.max_receive_count),
        Some(6)
    );
    bus.close().await;
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn publishing_to_a_subject_without_a_queue_says_what_a_subject_is() {
    let scope = Scope::new("nosuch");
    let bus = scope.bus().await;
    let err = bus.publish("nobody", "x").await.unwrap_err();
    assert!(matches!(err, BusError::Broker { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("no SQS queue named \"{}nobody\"", scope.prefix))
            && text.contains("on SQS a subject is a queue's name"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_least_once_requires_a_durable_name_on_sqs() {
    // semantics M3: durableName is required under AtLeastOnce, on every backend; a refused
    // subscription makes no queue.
    let scope = Scope::new("durable");
    let broker = scope.broker().await;
    common::bus::refused_without_a_durable_name(&scope, "x").await;
    let name = format!("{}x", scope.prefix);
    assert_eq!(broker.queue_url(&name).await.unwrap(), None);
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wildcard_pattern_is_refused_when_the_bus_is_built() {
    // semantics A12: the same rule as admission.
    let scope = Scope::new("wild");
    let bus = scope.bus().await;
    let mut p = alo("orders");
    p.pattern = "orders.>".into();
    let err = bus
        .subscribe(sub("orders", p, |_d| async { Ok(()) }))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, BusError::Refused { reason, .. } if reason.contains("spec.pattern") && reason.contains("wildcard")),
        "{err}"
    );
}

// ---------------------------------------------------------------- settlements

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn always_nack_with_max_deliver_3_exhausts_every_message_into_the_dead_letter_queue() {
    // semantics M2, C7, Q3: 10 messages, each declined 3 times, Exhausted on the third; the
    // redrive moves them to the dead-letter queue, and none is offered a fourth time.
    let scope = Scope::new("exhaust");
    let broker = scope.broker().await;
    let mut p = alo("nack3");
    p.max_deliver = Some(3);
    p.max_in_flight = Some(20);
    let (bus, seen) = common::bus::always_nack_until_exhausted(&scope, "nack3", p, 10).await;
    let dlq = || async {
        scope.attributes(&broker, "nack3-dlq").await["ApproximateNumberOfMessages"]
            .parse::<u64>()
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while dlq().await != 10 {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for 10 messages in the dead-letter queue"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let st = stats(&bus, "nack3");
    assert_eq!(st.exhausted, 10, "{st:?}");
    assert_eq!(st.settlement.nacked, 30, "{st:?}");
    assert_eq!(st.offered, 30, "{st:?}");
    assert!(
        seen.attempts().iter().all(|a| (1..=3).contains(a)),
        "{:?}",
        seen.attempts()
    );
    bus.close().await;
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attempt_given_up_at_close_is_released_and_comes_back_on_sqs() {
    // semantics C3: an attempt given up before its handler returned is Released; SQS owes it
    // back, and a second bus on the same queue gets it as a later attempt (its receive count).
    // ackWait is 2 s: on ElasticMQ the released message stays invisible until its visibility
    // timeout runs out (the queue reads NotVisible 1 right after close), so with the default
    // 30 s this test would wait 30 s for it.
    let scope = Scope::new("release");
    let mut p = alo("rel");
    p.ack_wait = Some(api::Duration::from_secs(2));
    let attempts = common::bus::released_at_close_comes_back(
        &scope,
        "rel",
        p,
        Duration::from_millis(200),
        async |st| assert_eq!((st.released, st.delivered, st.lost), (1, 0, 0)),
    )
    .await;
    assert!(
        attempts[0] >= 2,
        "comes back as a later attempt: {attempts:?}"
    );
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nack_after_two_seconds_is_not_offered_again_before_two_seconds() {
    // semantics B3, B5: ChangeMessageVisibility to the delay.
    let scope = Scope::new("later");
    let bus = scope.bus().await;
    let mut p = alo("later");
    p.max_nack_delay = Some(api::Duration::from_secs(10));
    let seen = Seen::default();
    let s = seen.clone();
    bus.subscribe(sub("later", p, move |d| {
        let s = s.clone();
        async move {
            s.record(&d);
            if d.attempt() == 1 {
                d.nack_after(Duration::from_secs(2)).await?;
            } else {
                d.ack().await?;
            }
            Ok(())
        }
    }))
    .await
    .unwrap();
    bus.publish("later", "m").await.unwrap();
    until("acked", || stats(&bus, "later").settlement.acked == 1).await;
    assert_eq!(seen.attempts(), [1, 2]);
    let gap = seen.gaps()[0];
    assert!(gap >= Duration::from_secs(2), "offered again after {gap:?}");
    assert_eq!(stats(&bus, "later").delay_shortened, 0);
    bus.close().await;
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn extend_lease_keeps_a_three_second_handler_with_ack_wait_one_second() {
    // semantics H1, Q5: the visibility is extended while the handler runs; no duplicate.
    let scope = Scope::new("extend");
    let mut p = alo("slow");
    p.ack_wait = Some(api::Duration::from_secs(1));
    p.max_processing_time = Some(api::Duration::from_secs(20));
    let (bus, seen) =
        common::bus::a_slow_handler_keeps_its_message(&scope, "slow", p, Duration::from_secs(3))
            .await;
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert_eq!(
        seen.attempts(),
        [1],
        "SQS handed the message on while its handler ran"
    );
    let st = stats(&bus, "slow");
    assert_eq!((st.offered, st.lease_expired), (1, 0), "{st:?}");
    bus.close().await;
    scope.cleanup().await;
}

// ---------------------------------------------------------------- the hold limit

#[test]
fn delay_shortened_arithmetic_just_under_at_and_past_the_limit() {
    // semantics C10, Q4: what is left of twelve hours from the first receive.
    let first = 1_700_000_000_000u64;
    let limit_ms = HOLD_LIMIT.as_millis() as u64;
    let ask = Duration::from_secs(60);
    // Just under: 61 s left, a 60 s wait fits.
    assert_eq!(
        hold(first, first + limit_ms - 61_000, ask, HOLD_LIMIT),
        Hold {
            seconds: 60,
            shortened: false
        }
    );
    // Just under, but not enough: 30 s left.
    assert_eq!(
        hold(first, first + limit_ms - 30_000, ask, HOLD_LIMIT),
        Hold {
            seconds: 30,
            shortened: true
        }
    );
    // At the limit: nothing left.
    assert_eq!(
        hold(first, first + limit_ms, ask, HOLD_LIMIT),
        Hold {
            seconds: 0,
            shortened: true
        }
    );
    // Past it.
    assert_eq!(
        hold(first, first + limit_ms + 3_600_000, ask, HOLD_LIMIT),
        Hold {
            seconds: 0,
            shortened: true
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_real_message_is_held_from_its_first_receive_as_the_server_reports_it() {
    // semantics C10, Q4, with a hold limit of 4 s instead of 12 h: the first decline of 10 s is
    // cut to what is left of 4 s after the first receive, the second to nothing. Both count
    // DelayShortened, once each. Were the limit counted from each receive instead of the first
    // (ApproximateFirstReceiveTimestamp), the second decline would wait about 3 s more.
    let scope = Scope::new("held");
    let broker = scope.broker().await.with_hold_limit(Duration::from_secs(4));
    let bus = Bus::builder(broker).without_reports().build();
    let mut p = alo("held");
    p.max_nack_delay = Some(api::Duration::from_secs(10));
    let seen = Seen::default();
    let s = seen.clone();
    bus.subscribe(sub("held", p, move |d| {
        let s = s.clone();
        async move {
            s.record(&d);
            if d.attempt() < 3 {
                d.nack_after(Duration::from_secs(10)).await?;
            } else {
                d.ack().await?;
            }
            Ok(())
        }
    }))
    .await
    .unwrap();
    bus.publish("held", "m").await.unwrap();
    until("acked", || stats(&bus, "held").settlement.acked == 1).await;
    assert_eq!(seen.attempts(), [1, 2, 3]);
    let gaps = seen.gaps();
    assert!(
        gaps[0] >= Duration::from_millis(1500) && gaps[0] < Duration::from_secs(8),
        "first decline: {:?}",
        gaps[0]
    );
    assert!(
        gaps[1] < Duration::from_millis(1500),
        "second decline: {:?}",
        gaps[1]
    );
    // The second decline's outcome is recorded once its visibility call returns, which is also
    // when the message shows again: the third attempt's ack can be counted first (CI saw 1).
    until("both declines counted DelayShortened", || {
        stats(&bus, "held").delay_shortened >= 2
    })
    .await;
    assert_eq!(stats(&bus, "held").delay_shortened, 2);
    bus.close().await;
    scope.cleanup().await;
}

// ---------------------------------------------------------------- in flight, modes, owners

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forgotten_ack_with_prefetch_one_never_stalls_the_consumer_on_sqs() {
    // semantics P3, Q3: with maxInFlight 1 a forgotten ack would stop the consumer after one
    // message; in Settle each is counted Silent and offered again, and on its last attempt
    // (maxDeliver 2) Exhausted, so the consumer goes on and all four reach the dead-letter queue.
    let scope = Scope::new("forgotten");
    let broker = scope.broker().await;
    let (bus, runs) =
        common::bus::a_forgotten_ack_with_prefetch_one_never_stalls(&scope, "fg", 4).await;
    assert_eq!(runs, 8, "the consumer went past the first message");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let dlq = scope.attributes(&broker, "fg-dlq").await;
        if dlq["ApproximateNumberOfMessages"] == "4" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for 4 messages in the dead-letter queue: {dlq:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bus.close().await;
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_in_flight_bounds_what_is_received_and_held() {
    // semantics P1, Q3: receives ask for no more than the free slots, so SQS never holds more
    // than maxInFlight of this subscription's messages invisible at once.
    let scope = Scope::new("inflight");
    let broker = scope.broker().await;
    let bus = Bus::builder(broker.clone()).without_reports().build();
    let mut p = alo("work");
    p.max_in_flight = Some(2);
    let handlers = common::bus::Concurrency::default();
    let h = handlers.clone();
    bus.subscribe(sub("work", p, move |d| {
        let h = h.clone();
        async move {
            let running = h.enter();
            tokio::time::sleep(Duration::from_millis(700)).await;
            drop(running);
            d.ack().await?;
            Ok(())
        }
    }))
    .await
    .unwrap();
    for i in 0..6 {
        bus.publish("work", format!("m{i}")).await.unwrap();
    }
    // While the first two run, the other four stay visible in the queue.
    until("two handlers running", || handlers.now() == 2).await;
    let q = scope.attributes(&broker, "work").await;
    let invisible: u64 = q["ApproximateNumberOfMessagesNotVisible"].parse().unwrap();
    assert!(
        invisible <= 2,
        "{invisible} messages held for 2 slots: {q:?}"
    );
    until("6 acked", || stats(&bus, "work").settlement.acked == 6).await;
    assert_eq!(handlers.peak(), 2);
    bus.close().await;
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_most_once_deletes_on_delivery_and_nothing_comes_back() {
    // semantics M1, Q3: a nack is recorded, never acted on.
    let scope = Scope::new("amo");
    let broker = scope.broker().await;
    let p = DeliveryPolicy {
        pattern: "feed".into(),
        ack_wait: Some(api::Duration::from_secs(1)),
        ..DeliveryPolicy::default()
    };
    // Past ackWait (the quiet time): a message SQS still had would be visible again by then.
    let (bus, seen) = common::bus::at_most_once_nacks_bring_nothing_back(
        &scope,
        "feed",
        p,
        1,
        Duration::from_millis(2500),
    )
    .await;
    assert_eq!(seen.attempts(), [1]);
    let q = scope.attributes(&broker, "feed").await;
    assert_eq!(
        (
            q["ApproximateNumberOfMessages"].as_str(),
            q["ApproximateNumberOfMessagesNotVisible"].as_str()
        ),
        ("0", "0"),
        "{q:?}"
    );
    bus.close().await;
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_subscription_from_a_resource_waits_for_the_operators_queue_and_never_makes_it() {
    // The operator owns a Subscription's queue: the runtime binds to it, waiting while it does
    // not exist, and never creates it (so deleting the Subscription leaves no queue behind).
    let scope = Scope::new("owned");
    let broker = scope.broker().await;
    let bus = Bus::builder(broker.clone()).without_reports().build();
    let resource = api::SubscriptionSpec {
        backend_ref: api::BackendRef { name: "sqs".into() },
        stream: None,
        policy: alo("billing"),
        deletion_policy: Default::default(),
        adopt: Default::default(),
        paused: false,
        paused_until: None,
    };
    let seen = Seen::default();
    let s = seen.clone();
    let sub = Subscriber::from_resource(
        "billing",
        &resource,
        handler(move |d: Delivery| {
            let s = s.clone();
            async move {
                s.record(&d);
                d.ack().await
            }
        }),
    );
    let waiting = tokio::spawn({
        let bus = bus.clone();
        async move { bus.subscribe(sub).await }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !waiting.is_finished(),
        "subscribe must wait for the operator's queue"
    );
    let name = format!("{}billing", scope.prefix);
    assert_eq!(
        broker.queue_url(&name).await.unwrap(),
        None,
        "the runtime made the queue"
    );
    // The operator's part, by hand: the queue from the same mapping.
    broker
        .client()
        .create_queue()
        .queue_name(&name)
        .send()
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("subscribe returns once the queue exists")
        .unwrap()
        .unwrap();
    bus.publish("billing", "m").await.unwrap();
    until("acked", || stats(&bus, "billing").settlement.acked == 1).await;
    assert_eq!(seen.attempts(), [1]);
    bus.close().await;
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_attribute_contradicting_a_masstransit_envelope_is_a_foreign_conflict() {
    // semantics C11: transport headers travel as message attributes; a correlation-id attribute
    // that differs from the MassTransit envelope's correlationId is a ForeignConflict, and the
    // envelope's value is kept.
    let scope = Scope::new("foreign");
    common::bus::a_masstransit_envelope_contradicted_by_a_header_is_a_foreign_conflict(&scope)
        .await;
    scope.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn headers_and_a_binary_payload_survive_the_trip() {
    // Transport headers travel as message attributes; a payload SQS cannot carry as text goes
    // as base64 and comes back as it was.
    let scope = Scope::new("trip");
    let bus = scope.bus().await;
    /// Headers, payload and subject of the delivery.
    type Got = (Vec<(String, String)>, Vec<u8>, String);
    let got: Arc<Mutex<Option<Got>>> = Arc::default();
    let g = Arc::clone(&got);
    bus.subscribe(sub("trip", alo("trip"), move |d| {
        let g = Arc::clone(&g);
        async move {
            *g.lock().unwrap() = Some((
                d.headers().to_vec(),
                d.payload().to_vec(),
                d.subject().to_string(),
            ));
            d.ack().await?;
            Ok(())
        }
    }))
    .await
    .unwrap();
    let payload = vec![0u8, 159, 146, 150, b'\n'];
    bus.publish_with_headers(
        "trip",
        vec![
            ("ce-id".into(), "42".into()),
            ("ce-type".into(), "t".into()),
        ],
        payload.clone(),
    )
    .await
    .unwrap();
    until("acked", || stats(&bus, "trip").settlement.acked == 1).await;
    let (headers, body, subject) = got.lock().unwrap().clone().unwrap();
    assert_eq!(
        headers,
        [
            ("ce-id".to_string(), "42".to_string()),
            ("ce-type".to_string(), "t".to_string())
        ]
    );
    assert_eq!(body, payload);
    assert_eq!(subject, "trip");
    bus.close().await;
    scope.cleanup().await;
}
