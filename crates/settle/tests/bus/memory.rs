//! The handler runtime on the in-memory backend: one test per rule of docs/semantics.md that the
//! runtime implements, each citing its rule. Time is Tokio's paused clock, so "at once" and
//! "after one second" are exact and the suite runs in milliseconds of wall time. The scenarios
//! every broker runs are `common::bus`'s; this suite runs them on [`Memory`].

use settle_testkit as common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::bus::{BusScene, Message, Seen, stats, sub, until_paused as until};
use futures::future::BoxFuture;
use settle::api::{self, Backoff, Capabilities, ConsumerStats, DeliveryPolicy, Mode, SlowHandler};
use settle::backend::memory::MemoryBroker;
use settle::bus::{
    self, Broker, Bus, BusBuilder, BusError, Consumer, Decision, Delivery, Format, SettleError,
    StatsSink, Subscriber, SubscriptionCtx, handler,
};
use settle::policy::{self, BackendKind};

// ---------------------------------------------------------------- helpers

fn alo(pattern: &str) -> DeliveryPolicy {
    let durable = format!("d-{}", pattern.replace(['.', '>', '*'], "_"));
    common::bus::at_least_once(pattern, &durable)
}

fn amo(pattern: &str) -> DeliveryPolicy {
    DeliveryPolicy {
        pattern: pattern.into(),
        ..DeliveryPolicy::default()
    }
}

fn backoff(initial_ms: u64, max_ms: u64, multiplier: f64) -> Option<Backoff> {
    Some(Backoff {
        initial: api::Duration::from_millis(initial_ms),
        max: api::Duration::from_millis(max_ms),
        multiplier,
    })
}

fn bus(backend: &MemoryBroker) -> Bus {
    Bus::builder(backend.clone()).without_reports().build()
}

/// Lets the bus run for a while of virtual time.
async fn settle_for(d: Duration) {
    tokio::time::sleep(d).await;
}

/// The shared scenarios' view of one in-memory broker: subscription `name` listens on
/// `name.>` (its durable name from [`alo`]), and message `n` is published to `name.n`.
struct Memory(MemoryBroker);

impl BusScene for Memory {
    async fn builder(&self) -> BusBuilder {
        Bus::builder(self.0.clone()).without_reports()
    }

    fn alo(&self, name: &str) -> DeliveryPolicy {
        alo(&format!("{name}.>"))
    }

    async fn send(&self, bus: &Bus, m: Message<'_>) {
        let subject = format!("{}.{}", m.name, m.n);
        bus.publish_with_headers(subject, m.headers, m.body.to_string())
            .await
            .unwrap();
    }

    async fn until(&self, what: &str, f: impl Fn() -> bool) {
        until(what, f).await;
    }
}

// ---------------------------------------------------------------- the shared scenes

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_shared_scenes_hold_in_memory() {
    // conformance/scenes.json, the scenes the Go runtime runs too: each on a broker of its own,
    // on the real clock (the scenes time their handlers).
    let scopes: Vec<Memory> = (0..common::scenes::count())
        .map(|_| Memory(MemoryBroker::new()))
        .collect();
    let ran = common::scenes::run_all("memory", true, &scopes).await;
    assert_eq!(ran, common::scenes::count());
}

// ---------------------------------------------------------------- spec and defaults

#[test]
fn spec_is_built_from_the_crd_type_with_the_documented_defaults() {
    // semantics M1: AtMostOnce is the default mode. H1: ExtendLease is the default, for up to
    // maxProcessingTime, 5m unless set; ackWait 30s unless set. P2: maxInFlight 250 unless set.
    let crd: api::SubscriptionSpec = serde_json::from_value(serde_json::json!({
        "backendRef": {"name": "nats"}, "pattern": "orders.>"
    }))
    .unwrap();
    let spec = Subscriber::from_resource(
        "orders",
        &crd,
        handler(|_d| async { Ok::<_, bus::HandlerError>(()) }),
    );
    assert_eq!(spec.policy, crd.policy);
    let p = policy::ResolvedPolicy::resolve(&spec.policy);
    assert_eq!(p.mode, Mode::AtMostOnce);
    assert_eq!(p.slow_handler, SlowHandler::ExtendLease);
    assert_eq!(p.max_processing_time, Duration::from_secs(300));
    assert_eq!(p.ack_wait, Duration::from_secs(30));
    assert_eq!(p.max_in_flight, 250);
    assert_eq!(p.max_deliver, None);
}

#[test]
fn backoff_schedule_doubles_and_is_capped() {
    // semantics B2: initial × multiplier^(n−1) after the decline of attempt n, capped at max:
    // 1s, 2s, 4s, … 1m.
    let s = policy::Schedule {
        initial: Duration::from_secs(1),
        max: Duration::from_secs(60),
        multiplier: 2.0,
    };
    let waits: Vec<u64> = (1..=8).map(|a| s.delay_after(a).as_secs()).collect();
    assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60]);
    assert_eq!(s.delay_after(10_000), Duration::from_secs(60));
}

// ---------------------------------------------------------------- say what happened

#[tokio::test(start_paused = true)]
async fn ack_accepts_and_is_counted_acked() {
    // semantics S1: ack() accepts an attempt.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let seen = Seen::default();
    let s = seen.clone();
    bus.subscribe(sub("orders", alo("orders.>"), move |d| {
        let s = s.clone();
        async move {
            s.record(&d);
            d.ack().await?;
            Ok(())
        }
    }))
    .await
    .unwrap();
    bus.publish("orders.1", "a").await.unwrap();
    until("acked", || stats(&bus, "orders").settlement.acked == 1).await;
    settle_for(Duration::from_secs(5)).await;
    assert_eq!(seen.attempts(), [1], "an acked message does not come back");
    let st = stats(&bus, "orders");
    assert_eq!(
        (
            st.offered,
            st.delivered,
            st.settlement.acked,
            st.settlement.nacked,
            st.settlement.silent
        ),
        (1, 1, 1, 0, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn nack_declines_and_is_counted_nacked() {
    // semantics S1: nack() declines an attempt.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    bus.subscribe(sub("orders", alo("orders.>"), |d| async move {
        if d.attempt() == 1 {
            d.nack().await?
        } else {
            d.ack().await?
        }
        Ok(())
    }))
    .await
    .unwrap();
    bus.publish("orders.1", "a").await.unwrap();
    until("acked on attempt 2", || {
        stats(&bus, "orders").settlement.acked == 1
    })
    .await;
    let st = stats(&bus, "orders");
    assert_eq!(
        (st.settlement.nacked, st.settlement.acked, st.delivered),
        (1, 1, 2)
    );
}

#[tokio::test(start_paused = true)]
async fn returning_without_settling_is_silence_not_consent() {
    // semantics S1: a handler that returns without settling is silent; the runtime settles the
    // attempt as Silent, never as acceptance.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let seen = Seen::default();
    let s = seen.clone();
    bus.subscribe(sub("orders", alo("orders.>"), move |d| {
        let s = s.clone();
        async move {
            s.record(&d);
            if d.attempt() == 2 {
                d.ack().await?;
            }
            Ok(())
        }
    }))
    .await
    .unwrap();
    bus.publish("orders.1", "a").await.unwrap();
    until("acked", || stats(&bus, "orders").settlement.acked == 1).await;
    let st = stats(&bus, "orders");
    assert_eq!(st.settlement.silent, 1, "silence is recorded");
    assert_eq!(
        seen.attempts(),
        [1, 2],
        "silence is not consent: the message came back"
    );
}

// ---------------------------------------------------------------- modes

#[tokio::test(start_paused = true)]
async fn at_most_once_acts_on_nothing_and_records_everything() {
    // semantics M1: under AtMostOnce (the default) every settlement is counted and none is acted
    // on: a Nack does not bring the message back.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let seen = Seen::default();
    let s = seen.clone();
    bus.subscribe(sub("metrics", amo("metrics.>"), move |d| {
        let s = s.clone();
        async move {
            s.record(&d);
            match d.payload().as_ref() {
                b"ack" => d.ack().await?,
                b"nack" => d.nack().await?,
                _ => {}
            }
            Ok(())
        }
    }))
    .await
    .unwrap();
    for body in ["ack", "nack", "silent"] {
        bus.publish("metrics.x", body).await.unwrap();
    }
    until("three delivered", || stats(&bus, "metrics").delivered == 3).await;
    settle_for(Duration::from_secs(10)).await;
    assert_eq!(seen.len(), 3, "nothing comes back under AtMostOnce");
    let st = stats(&bus, "metrics");
    assert_eq!(
        (
            st.settlement.acked,
            st.settlement.nacked,
            st.settlement.silent
        ),
        (1, 1, 1)
    );
    assert_eq!(st.exhausted, 0);
}

#[tokio::test(start_paused = true)]
async fn at_most_once_a_nack_brings_nothing_back_on_memory_as_on_every_broker() {
    // semantics M1, the shared scene: four messages, each declined once under AtMostOnce; ten
    // seconds on, none came back and every decline is counted, with no Exhausted.
    let scene = Memory(MemoryBroker::new());
    let (bus, seen) = common::bus::at_most_once_nacks_bring_nothing_back(
        &scene,
        "metrics",
        amo("metrics.>"),
        4,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(seen.attempts(), [1, 1, 1, 1]);
    let st = stats(&bus, "metrics");
    assert_eq!((st.exhausted, st.settlement.refused), (0, 0), "{st:?}");
    assert!(st.balanced(), "{st:?}");
}

#[tokio::test(start_paused = true)]
async fn at_most_once_still_refuses_a_second_settlement() {
    // semantics M1, S2: under AtMostOnce too, a second settlement is refused and records nothing.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let second = Arc::new(Mutex::new(None));
    let s2 = second.clone();
    bus.subscribe(sub("m", amo("m.>"), move |d| {
        let s2 = s2.clone();
        async move {
            d.ack().await?;
            *s2.lock().unwrap() = Some(d.nack().await);
            Ok(())
        }
    }))
    .await
    .unwrap();
    bus.publish("m.1", "x").await.unwrap();
    until("handled", || second.lock().unwrap().is_some()).await;
    assert_eq!(
        second.lock().unwrap().clone().unwrap(),
        Err(SettleError::AlreadySettled)
    );
    let st = stats(&bus, "m");
    assert_eq!(
        (st.settlement.acked, st.settlement.nacked),
        (1, 0),
        "the refused second settlement records nothing"
    );
}

#[tokio::test(start_paused = true)]
async fn at_least_once_redelivers_nack_and_silence_with_higher_attempts_up_to_max_deliver() {
    // semantics M2: under AtLeastOnce a Nack or silence brings the message back, each time with
    // a higher attempt, up to maxDeliver attempts in all.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let seen = Seen::default();
    let s = seen.clone();
    let mut p = alo("orders.>");
    p.max_deliver = Some(4);
    bus.subscribe(sub("orders", p, move |d| {
        let s = s.clone();
        async move {
            s.record(&d);
            if d.attempt() % 2 == 1 {
                d.nack().await?;
            } // even attempts: silence
            Ok(())
        }
    }))
    .await
    .unwrap();
    bus.publish("orders.1", "a").await.unwrap();
    until("exhausted", || stats(&bus, "orders").exhausted == 1).await;
    settle_for(Duration::from_secs(10)).await;
    assert_eq!(
        seen.attempts(),
        [1, 2, 3, 4],
        "up to MaxDeliver attempts, each higher"
    );
    let st = stats(&bus, "orders");
    assert_eq!((st.settlement.nacked, st.settlement.silent), (2, 2));
}

#[tokio::test(start_paused = true)]
async fn exhausted_is_counted_once_per_message() {
    // semantics C7: a message declined on its last attempt is Exhausted, once per message
    // (message grain): real data loss.
    let scene = Memory(MemoryBroker::new());
    let mut p = alo("orders.>");
    p.max_deliver = Some(3);
    let (bus, _) = common::bus::always_nack_until_exhausted(&scene, "orders", p, 2).await;
    settle_for(Duration::from_secs(10)).await;
    let st = stats(&bus, "orders");
    assert_eq!(
        st.exhausted, 2,
        "two messages, six declined attempts: Exhausted counts messages"
    );
    assert_eq!(st.settlement.nacked, 6);
    assert_eq!(
        st.stranded, 0,
        "Stranded is zero where the broker will try again"
    );
}

#[tokio::test(start_paused = true)]
async fn at_least_once_requires_a_durable_name_on_the_memory_backend_too() {
    // semantics M3: durableName is required under AtLeastOnce on every backend, memory included,
    // so the spec tested against memory is the spec run against a broker.
    let mem = MemoryBroker::new();
    let mut p = alo("orders.>");
    p.durable_name = None;
    let expected = settle::policy::validate_policy(&p, &mem.capabilities()).error_text();
    let err = common::bus::refused_without_a_durable_name(&Memory(mem), "orders").await;
    match &err {
        BusError::Refused {
            reason, backend, ..
        } => {
            assert_eq!(*backend, BackendKind::Memory);
            assert_eq!(
                reason, &expected,
                "the bus uses the admission rules' own words"
            );
            assert!(reason.contains("spec.durableName"), "{reason}");
        }
        other => panic!("expected Refused, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn the_same_handler_is_correct_in_both_modes() {
    // semantics M4: one handler is correct in both modes; only what the runtime does with its
    // answer differs.
    async fn handle(d: Delivery) -> Result<(), bus::HandlerError> {
        if d.payload().as_ref() == b"bad" {
            d.nack().await?;
        } else {
            d.ack().await?;
        }
        Ok(())
    }
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let mut p = alo("a.>");
    p.max_deliver = Some(2);
    bus.subscribe(Subscriber::new("alo", p, handler(handle)))
        .await
        .unwrap();
    bus.subscribe(Subscriber::new("amo", amo("a.>"), handler(handle)))
        .await
        .unwrap();
    bus.publish("a.1", "good").await.unwrap();
    bus.publish("a.2", "bad").await.unwrap();
    until("alo exhausted", || stats(&bus, "alo").exhausted == 1).await;
    until("amo delivered", || stats(&bus, "amo").delivered == 2).await;
    settle_for(Duration::from_secs(5)).await;
    assert_eq!(
        stats(&bus, "alo").delivered,
        3,
        "under AtLeastOnce the declined one came back once"
    );
    assert_eq!(
        stats(&bus, "amo").delivered,
        2,
        "under AtMostOnce it did not"
    );
}

// ---------------------------------------------------------------- backoff and nack_after

#[tokio::test(start_paused = true)]
async fn without_backoff_a_nack_comes_back_at_once() {
    // semantics B1: without a schedule, a declined message is offered again at once.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let seen = Seen::default();
    let s = seen.clone();
    let mut p = alo("o.>");
    p.max_deliver = Some(3);
    bus.subscribe(sub("o", p, move |d| {
        let s = s.clone();
        async move {
            s.record(&d);
            d.nack().await?;
            Ok(())
        }
    }))
    .await
    .unwrap();
    bus.publish("o.1", "a").await.unwrap();
    until("exhausted", || stats(&bus, "o").exhausted == 1).await;
    assert_eq!(
        seen.gaps(),
        [Duration::ZERO, Duration::ZERO],
        "no virtual time passes between attempts"
    );
}

#[tokio::test(start_paused = true)]
async fn with_backoff_each_decline_waits_the_schedule() {
    // semantics B2: with a backoff, each decline waits the schedule before the next attempt:
    // 1s, 2s, 4s, … capped at max.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let seen = Seen::default();
    let s = seen.clone();
    let mut p = alo("o.>");
    p.max_deliver = Some(9);
    p.backoff = backoff(1000, 60_000, 2.0);
    bus.subscribe(sub("o", p, move |d| {
        let s = s.clone();
        async move {
            s.record(&d);
            d.nack().await?;
            Ok(())
        }
    }))
    .await
    .unwrap();
    bus.publish("o.1", "a").await.unwrap();
    until("exhausted", || stats(&bus, "o").exhausted == 1).await;
    let secs: Vec<u64> = seen.gaps().iter().map(|g| g.as_secs()).collect();
    assert_eq!(secs, [1, 2, 4, 8, 16, 32, 60, 60]);
}

#[tokio::test(start_paused = true)]
async fn silence_and_a_returned_error_wait_the_same_schedule() {
    // semantics S3, S4, B2: silence declines, and so does a returned error without a settlement;
    // both wait the same schedule as a Nack.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let seen = Seen::default();
    let s = seen.clone();
    let mut p = alo("o.>");
    p.max_deliver = Some(4);
    p.backoff = backoff(1000, 60_000, 2.0);
    bus.subscribe(sub("o", p, move |d| {
        let s = s.clone();
        async move {
            s.record(&d);
            Err("dependency down".into())
        }
    }))
    .await
    .unwrap();
    bus.publish("o.1", "a").await.unwrap();
    until("exhausted", || stats(&bus, "o").exhausted == 1).await;
    let secs: Vec<u64> = seen.gaps().iter().map(|g| g.as_secs()).collect();
    assert_eq!(secs, [1, 2, 4]);
    assert_eq!(stats(&bus, "o").settlement.silent, 4);
    assert_eq!(
        bus.runtime_stats("o").unwrap().handler_errors,
        4,
        "each error is counted"
    );
}

#[tokio::test(start_paused = true)]
async fn nack_after_zero_is_an_immediate_retry_even_with_a_backoff() {
    // semantics B4: nack_after(0) is an immediate retry, also on a subscription with a schedule.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let seen = Seen::default();
    let s = seen.clone();
    let mut p = alo("o.>");
    p.max_deliver = Some(3);
    p.backoff = backoff(1000, 60_000, 2.0);
    bus.subscribe(sub("o", p, move |d| {
        let s = s.clone();
        async move {
            s.record(&d);
            d.nack_after(Duration::ZERO).await?;
            Ok(())
        }
    }))
    .await
    .unwrap();
    bus.publish("o.1", "a").await.unwrap();
    until("exhausted", || stats(&bus, "o").exhausted == 1).await;
    assert_eq!(seen.gaps(), [Duration::ZERO, Duration::ZERO]);
}

#[tokio::test(start_paused = true)]
async fn nack_after_waits_its_delay_never_less_and_the_attempt_is_spent() {
    // semantics B5: a delay is a floor: the message is not offered again before it has passed.
    // B3: a delay is never turned into an immediate retry. B6: the declined attempt is spent and
    // counts towards maxDeliver.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let seen = Seen::default();
    let s = seen.clone();
    let mut p = alo("o.>");
    p.max_deliver = Some(2);
    p.max_nack_delay = Some(api::Duration::from_secs(600));
    bus.subscribe(sub("o", p, move |d| {
        let s = s.clone();
        async move {
            s.record(&d);
            d.nack_after(Duration::from_secs(7)).await?;
            Ok(())
        }
    }))
    .await
    .unwrap();
    bus.publish("o.1", "a").await.unwrap();
    until("exhausted", || stats(&bus, "o").exhausted == 1).await;
    assert_eq!(seen.gaps(), [Duration::from_secs(7)]);
    assert_eq!(
        seen.attempts(),
        [1, 2],
        "the delayed decline spent attempt 1 of MaxDeliver 2"
    );
}

#[tokio::test(start_paused = true)]
async fn nack_after_ceiling_is_max_nack_delay_else_backoff_max() {
    // semantics B3: the ceiling of nack_after is maxNackDelay, else backoff.max.
    let mem = MemoryBroker::new();
    let mut with_max = alo("a.>");
    with_max.max_nack_delay = Some(api::Duration::from_secs(10));
    with_max.backoff = backoff(1000, 60_000, 2.0);
    let mut schedule_only = alo("b.>");
    schedule_only.backoff = backoff(1000, 60_000, 2.0);
    for (name, p, ok, too_long, ceiling) in [
        ("a", with_max, 10u64, 11u64, 10u64),
        ("b", schedule_only, 60, 61, 60),
    ] {
        let ctx = SubscriptionCtx::new(name, &p);
        let mut c = mem.open(ctx.clone()).await.unwrap();
        mem.publish(format!("{name}.1"), vec![], "x".into())
            .await
            .unwrap();
        let d = c.next().await.unwrap();
        assert_eq!(
            d.nack_after(Duration::from_secs(too_long)).await,
            Err(SettleError::DelayTooLong {
                requested: Duration::from_secs(too_long),
                ceiling: Duration::from_secs(ceiling)
            })
        );
        assert_eq!(
            d.nack_after(Duration::from_secs(ok)).await,
            Ok(()),
            "{name}: up to the ceiling is allowed"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn nack_after_refused_records_nothing_and_the_handler_can_still_nack() {
    // semantics B3: with no ceiling, or for a negative delay or one above the ceiling, nack_after
    // returns an error and records nothing, so the handler can still nack().
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let results = Arc::new(Mutex::new(Vec::new()));
    let r = results.clone();
    let mut neither = alo("n.>");
    neither.max_deliver = Some(1);
    bus.subscribe(sub("neither", neither, move |d| {
        let r = r.clone();
        async move {
            let a = d.nack_after(Duration::from_millis(1)).await;
            let b = d.nack_after_millis(-5).await;
            r.lock().unwrap().extend([a, b]);
            d.nack().await?;
            Ok(())
        }
    }))
    .await
    .unwrap();
    let results2 = Arc::new(Mutex::new(Vec::new()));
    let r2 = results2.clone();
    let mut capped = alo("c.>");
    capped.max_deliver = Some(1);
    capped.max_nack_delay = Some(api::Duration::from_secs(5));
    bus.subscribe(sub("capped", capped, move |d| {
        let r2 = r2.clone();
        async move {
            let a = d.nack_after(Duration::from_secs(6)).await;
            let b = d.nack_after_millis(-1).await;
            r2.lock().unwrap().extend([a, b]);
            d.nack().await?;
            Ok(())
        }
    }))
    .await
    .unwrap();
    bus.publish("n.1", "x").await.unwrap();
    bus.publish("c.1", "x").await.unwrap();
    until("both handled", || {
        stats(&bus, "neither").delivered == 1 && stats(&bus, "capped").delivered == 1
    })
    .await;
    let r = results.lock().unwrap().clone();
    assert!(matches!(r[0], Err(SettleError::NoDelayAllowed(_))), "{r:?}");
    assert_eq!(r[1], Err(SettleError::NegativeDelay(-5)));
    let r2 = results2.lock().unwrap().clone();
    assert!(
        matches!(r2[0], Err(SettleError::DelayTooLong { .. })),
        "{r2:?}"
    );
    assert_eq!(r2[1], Err(SettleError::NegativeDelay(-1)));
    for name in ["neither", "capped"] {
        let st = stats(&bus, name);
        assert_eq!(
            (
                st.settlement.nacked,
                st.settlement.silent,
                st.settlement.acked
            ),
            (1, 0, 0),
            "{name}: only the Nack was recorded"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn delays_are_refused_when_the_bus_is_built_on_a_backend_that_cannot_hold_them() {
    // semantics B7: delays need delaysRedelivery and must not exceed maxRedeliveryDelay; a
    // subscription that asks otherwise is refused when a bus is built on the backend.
    let no_delays = Limited(
        MemoryBroker::new(),
        Capabilities {
            delays_redelivery: false,
            ..Capabilities::default()
        },
    );
    let mut p = alo("o.>");
    p.backoff = backoff(1000, 2000, 2.0);
    let err = Bus::builder(no_delays)
        .without_reports()
        .build()
        .subscribe(sub("o", p.clone(), |_d| async { Ok(()) }))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, BusError::Refused { reason, .. } if reason.contains("spec.backoff") && reason.contains("delaysRedelivery")),
        "{err}"
    );

    let short = Limited(
        MemoryBroker::new(),
        Capabilities {
            delays_redelivery: true,
            max_redelivery_delay: Some(api::Duration::from_secs(60)),
            restart_can_spend_unseen_attempt: false,
            ..Capabilities::default()
        },
    );
    let mut p2 = alo("o.>");
    p2.max_nack_delay = Some(api::Duration::from_secs(3600));
    let err = Bus::builder(short)
        .without_reports()
        .build()
        .subscribe(sub("o", p2, |_d| async { Ok(()) }))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, BusError::Refused { reason, .. } if reason.contains("spec.maxNackDelay")),
        "{err}"
    );
}

#[tokio::test(start_paused = true)]
async fn delays_are_not_allowed_under_at_most_once() {
    // semantics B7, A2: no backoff and no maxNackDelay under AtMostOnce, where nothing comes back.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let mut p = amo("o.>");
    p.backoff = backoff(1000, 2000, 2.0);
    let err = bus
        .subscribe(sub("o", p, |_d| async { Ok(()) }))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, BusError::Refused { reason, .. } if reason.contains("AtMostOnce")),
        "{err}"
    );
    let mut p = amo("o.>");
    p.max_nack_delay = Some(api::Duration::from_secs(1));
    assert!(
        bus.subscribe(sub("o", p, |_d| async { Ok(()) }))
            .await
            .is_err()
    );
}

// ---------------------------------------------------------------- slow handlers

#[tokio::test(start_paused = true)]
async fn the_memory_backend_never_hands_a_message_on_while_its_handler_runs() {
    // semantics H4: the in-memory backend never hands a message on while its handler runs, so
    // neither slowHandler setting does anything there.
    for slow in [SlowHandler::ExtendLease, SlowHandler::Redeliver] {
        let mut p = alo("o.>");
        p.slow_handler = Some(slow);
        p.ack_wait = Some(api::Duration::from_secs(1));
        p.max_processing_time = Some(api::Duration::from_secs(2));
        let scene = Memory(MemoryBroker::new());
        let (bus, _) =
            common::bus::a_slow_handler_keeps_its_message(&scene, "o", p, Duration::from_secs(30))
                .await;
        assert_eq!(stats(&bus, "o").settlement.acked, 1, "{slow:?}");
    }
}

// ---------------------------------------------------------------- exactly one settlement

#[tokio::test(start_paused = true)]
async fn the_first_settlement_wins_even_through_clones_in_other_tasks() {
    // semantics S2: exactly one settlement per attempt. The first wins; a later one returns
    // AlreadySettled, also from a clone held by another task, struct or closure, because every
    // clone shares one settlement state.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let o = outcomes.clone();
    bus.subscribe(sub("o", alo("o.>"), move |d| {
        let o = o.clone();
        async move {
            struct Holder {
                d: Delivery,
            }
            let held = Holder { d: d.clone() };
            let mut tasks = Vec::new();
            for i in 0..8 {
                let c = held.d.clone();
                tasks.push(tokio::spawn(async move {
                    if i % 2 == 0 {
                        c.ack().await
                    } else {
                        c.nack().await
                    }
                }));
            }
            for t in tasks {
                let r = t.await.unwrap();
                o.lock().unwrap().push(r);
            }
            let last = d.ack().await;
            o.lock().unwrap().push(last);
            Ok(())
        }
    }))
    .await
    .unwrap();
    bus.publish("o.1", "a").await.unwrap();
    until("handled", || outcomes.lock().unwrap().len() == 9).await;
    let o = outcomes.lock().unwrap().clone();
    assert_eq!(o.iter().filter(|r| r.is_ok()).count(), 1, "{o:?}");
    assert_eq!(
        o.iter()
            .filter(|r| **r == Err(SettleError::AlreadySettled))
            .count(),
        8
    );
    let st = stats(&bus, "o");
    assert_eq!(
        st.settlement.acked + st.settlement.nacked + st.settlement.silent,
        1
    );
}

#[tokio::test(start_paused = true)]
async fn the_returned_error_never_decides_settlement() {
    // semantics S3: the returned error never settles; it is counted and logged. Ack then return
    // an error: acked. Nack then return success: nacked.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let seen = Seen::default();
    let s = seen.clone();
    bus.subscribe(sub("o", alo("o.>"), move |d| {
        let s = s.clone();
        async move {
            s.record(&d);
            match (d.payload().as_ref(), d.attempt()) {
                (b"ack-then-err", _) => {
                    d.ack().await?;
                    Err("logged, not a nack".into())
                }
                (b"nack-then-ok", 1) => {
                    d.nack().await?;
                    Ok(())
                }
                _ => {
                    d.ack().await?;
                    Ok(())
                }
            }
        }
    }))
    .await
    .unwrap();
    bus.publish("o.1", "ack-then-err").await.unwrap();
    bus.publish("o.2", "nack-then-ok").await.unwrap();
    until("three runs", || stats(&bus, "o").delivered == 3).await;
    settle_for(Duration::from_secs(5)).await;
    let st = stats(&bus, "o");
    assert_eq!((st.settlement.acked, st.settlement.nacked), (2, 1));
    assert_eq!(bus.runtime_stats("o").unwrap().handler_errors, 1);
    let runs: Vec<String> = seen.all().into_iter().map(|e| e.0).collect();
    assert_eq!(
        runs.iter().filter(|r| *r == "ack-then-err").count(),
        1,
        "an acked message that returned an error is not redelivered"
    );
    assert_eq!(
        runs.iter().filter(|r| *r == "nack-then-ok").count(),
        2,
        "a nacked message that returned Ok is redelivered"
    );
}

#[tokio::test(start_paused = true)]
async fn a_panicking_handler_is_contained_counted_and_treated_as_silence() {
    // semantics S5: a panicking handler is contained and counted, its attempt is settled as
    // Silent, and the subscription keeps running.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let mut p = alo("o.>");
    p.max_deliver = Some(2);
    bus.subscribe(sub("o", p, |d| async move {
        if d.payload().as_ref() == b"boom" && d.attempt() == 1 {
            panic!("handler bug");
        }
        d.ack().await?;
        Ok(())
    }))
    .await
    .unwrap();
    bus.publish("o.1", "boom").await.unwrap();
    bus.publish("o.2", "fine").await.unwrap();
    until("both acked", || stats(&bus, "o").settlement.acked == 2).await;
    let st = stats(&bus, "o");
    assert_eq!(st.settlement.silent, 1, "the panic was silence");
    assert_eq!(bus.runtime_stats("o").unwrap().panics, 1);
    assert_eq!(st.delivered, 3);
}

// ---------------------------------------------------------------- counters

#[tokio::test(start_paused = true)]
async fn acked_nacked_silent_partition_delivered_and_the_identity_holds_at_rest() {
    // semantics C5: Acked, Nacked and Silent partition Delivered. I1: at rest, offered ==
    // delivered + released + lost.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let mut p = alo("o.>");
    p.max_deliver = Some(3);
    bus.subscribe(sub("o", p, |d| async move {
        match (d.payload()[0] % 3, d.attempt()) {
            (0, _) => d.ack().await?,
            (1, a) if a < 2 => d.nack().await?,
            (1, _) => d.ack().await?,
            _ => {}
        }
        Ok(())
    }))
    .await
    .unwrap();
    for i in 0..30u8 {
        bus.publish(format!("o.{i}"), vec![i]).await.unwrap();
    }
    until("at rest", || {
        let st = stats(&bus, "o");
        st.settlement.acked == 20 && st.exhausted == 10
    })
    .await;
    let st = stats(&bus, "o");
    assert_eq!(
        st.settlement.acked + st.settlement.nacked + st.settlement.silent,
        st.delivered
    );
    assert!(st.balanced(), "{st:?}");
    assert_eq!((st.offered, st.released, st.lost), (60, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_refused_nack_moves_nacked_and_refused() {
    // semantics C6: Refused is a different axis: a nack the backend could not perform counts in
    // both Nacked and Refused.
    let mem = MemoryBroker::new();
    let bus = Bus::builder(mem.clone())
        .without_reports()
        .close_grace(Duration::from_secs(1))
        .build();
    let kept: Arc<Mutex<Option<Delivery>>> = Arc::default();
    let k = kept.clone();
    bus.subscribe(sub("o", alo("o.>"), move |d| {
        let k = k.clone();
        async move {
            // Hand the delivery to "another task" that settles it later, after the bus retired the consumer.
            *k.lock().unwrap() = Some(d.clone());
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(())
        }
    }))
    .await
    .unwrap();
    bus.publish("o.1", "a").await.unwrap();
    until("handler running", || kept.lock().unwrap().is_some()).await;
    bus.unsubscribe("o").await.unwrap();
    let d = kept.lock().unwrap().clone().unwrap();
    assert!(matches!(d.nack().await, Err(SettleError::Refused(_))));
    let st = stats(&bus, "o");
    assert_eq!((st.settlement.nacked, st.settlement.refused), (1, 1));
    assert_eq!(st.released, 1, "the running attempt was given up at close");
    assert!(st.balanced(), "{st:?}");
}

#[tokio::test(start_paused = true)]
async fn released_attempts_are_owed_back_and_redelivered_under_at_least_once() {
    // semantics C3: Released counts attempts given up before their handler returned; the backend
    // owes them back.
    let attempts = common::bus::released_at_close_comes_back(
        &Memory(MemoryBroker::new()),
        "o",
        alo("o.>"),
        Duration::from_millis(100),
        async |st| assert_eq!((st.released, st.delivered, st.lost), (1, 0, 0)),
    )
    .await;
    assert_eq!(attempts, [2]);
}

#[tokio::test(start_paused = true)]
async fn under_at_most_once_an_attempt_given_up_at_close_is_lost() {
    // semantics C4: under AtMostOnce an attempt given up before its handler returned is Lost.
    let mem = MemoryBroker::new();
    let bus = Bus::builder(mem.clone())
        .without_reports()
        .close_grace(Duration::from_millis(100))
        .build();
    bus.subscribe(sub("o", amo("o.>"), |_d| async move {
        tokio::time::sleep(Duration::from_secs(3600)).await;
        Ok(())
    }))
    .await
    .unwrap();
    bus.publish("o.1", "a").await.unwrap();
    until("offered", || stats(&bus, "o").offered == 1).await;
    bus.close().await;
    let st = stats(&bus, "o");
    assert_eq!((st.lost, st.released, st.delivered), (1, 0, 0));
    assert!(st.balanced());
}

#[tokio::test(start_paused = true)]
async fn lease_expired_and_delay_shortened_stay_zero_on_memory() {
    // semantics C10: DelayShortened is zero except on a backend with a maxRedeliveryDelay. C9, H4:
    // LeaseExpired counts attempts handed on, which memory never does. Memory holds any delay, so
    // zero is all DelayShortened can be here: this shows the runtime does not count one by itself.
    // That it counts one when a backend shortens a delay is the next test.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let mut p = alo("o.>");
    p.max_nack_delay = Some(api::Duration::from_secs(3600));
    p.ack_wait = Some(api::Duration::from_secs(1));
    p.max_processing_time = Some(api::Duration::from_secs(1));
    bus.subscribe(sub("o", p, |d| async move {
        tokio::time::sleep(Duration::from_secs(5)).await;
        if d.attempt() == 1 {
            d.nack_after(Duration::from_secs(3600)).await?
        } else {
            d.ack().await?
        }
        Ok(())
    }))
    .await
    .unwrap();
    bus.publish("o.1", "a").await.unwrap();
    tokio::time::sleep(Duration::from_secs(3700)).await;
    until("acked", || stats(&bus, "o").settlement.acked == 1).await;
    let st = stats(&bus, "o");
    assert_eq!(
        (st.lease_expired, st.delay_shortened, st.stranded),
        (0, 0, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn a_delay_the_backend_shortens_is_counted_delay_shortened_and_comes_back_at_the_cap() {
    // semantics C10: a decline offered again sooner than its delay asked, because the backend
    // could not hold it that long, is counted DelayShortened. A backend that holds a declined
    // message at most 10 s.
    let capped = CappedDelay(MemoryBroker::new(), Duration::from_secs(10));
    let bus = Bus::builder(capped).without_reports().build();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let mut p = alo("c.>");
    p.max_nack_delay = Some(api::Duration::from_secs(3600));
    bus.subscribe(sub("c", p, move |d| {
        let s = s.clone();
        async move {
            s.lock()
                .unwrap()
                .push((d.attempt(), tokio::time::Instant::now()));
            match d.attempt() {
                1 => d.nack_after(Duration::from_secs(3600)).await?, // shortened to 10 s
                2 => d.nack_after(Duration::from_secs(5)).await?,    // held as asked
                _ => d.ack().await?,
            }
            Ok(())
        }
    }))
    .await
    .unwrap();
    bus.publish("c.1", "a").await.unwrap();
    until("acked on attempt 3", || {
        stats(&bus, "c").settlement.acked == 1
    })
    .await;
    let st = stats(&bus, "c");
    assert_eq!(
        (
            st.delay_shortened,
            st.settlement.nacked,
            st.stranded,
            st.exhausted
        ),
        (1, 2, 0, 0),
        "one decline shortened, one held as asked: {st:?}"
    );
    let seen = seen.lock().unwrap().clone();
    let gaps: Vec<Duration> = seen.windows(2).map(|w| w[1].1 - w[0].1).collect();
    assert_eq!(seen.iter().map(|e| e.0).collect::<Vec<_>>(), [1, 2, 3]);
    assert!(
        gaps[0] >= Duration::from_secs(10) && gaps[0] < Duration::from_secs(60),
        "back at the cap, not after the hour asked: {gaps:?}"
    );
    assert!(gaps[1] >= Duration::from_secs(5), "held as asked: {gaps:?}");
    bus.close().await;
}

#[tokio::test(start_paused = true)]
async fn counters_never_go_backwards_across_resubscribe() {
    // semantics C14: counters are cumulative and never decrease, also across a resubscribe.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    for round in 1..=2u64 {
        bus.subscribe(sub("o", alo("o.>"), |d| async move {
            d.ack().await?;
            Ok(())
        }))
        .await
        .unwrap();
        bus.publish(format!("o.{round}"), "x").await.unwrap();
        until("acked", || stats(&bus, "o").settlement.acked == round).await;
        bus.unsubscribe("o").await.unwrap();
        assert_eq!(
            stats(&bus, "o").settlement.acked,
            round,
            "readable after unsubscribe, and not reset"
        );
    }
}

// ---------------------------------------------------------------- envelopes and foreign headers

#[derive(serde::Deserialize, Debug, PartialEq)]
struct Order {
    id: u32,
}

async fn one_delivery(headers: Vec<(&str, &str)>, payload: &str) -> (Delivery, ConsumerStats) {
    let mem = MemoryBroker::new();
    let ctx = SubscriptionCtx::new("o", &amo("o.>"));
    let mut c = mem.open(ctx.clone()).await.unwrap();
    let headers = headers
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    mem.publish("o.1".into(), headers, payload.to_string().into())
        .await
        .unwrap();
    let d = c.next().await.unwrap();
    (d, ctx.stats())
}

#[tokio::test(start_paused = true)]
async fn cloudevents_binary_and_structured_decode_and_never_raise_a_foreign_conflict() {
    // semantics C11: CloudEvents in binary and structured mode never raise a ForeignConflict.
    let (d, st) = one_delivery(
        vec![
            ("ce-specversion", "1.0"),
            ("ce-id", "e1"),
            ("ce-type", "order.created"),
            ("ce-source", "/shop"),
            ("correlation-id", "other"),
        ],
        r#"{"id": 7}"#,
    )
    .await;
    assert_eq!(d.event().format, Format::CloudEventsBinary);
    assert_eq!(d.event().id.as_deref(), Some("e1"));
    assert_eq!(d.decode::<Order>().unwrap(), Order { id: 7 });
    assert_eq!(st.foreign_conflicts, 0);
    assert!(d.foreign().is_empty());

    let (d, st) = one_delivery(
        vec![("content-type", "application/cloudevents+json"), ("correlation-id", "other")],
        r#"{"specversion":"1.0","id":"e2","type":"order.created","source":"/shop","data":{"id":8}}"#,
    )
    .await;
    assert_eq!(d.event().format, Format::CloudEventsStructured);
    assert_eq!(d.event().event_type.as_deref(), Some("order.created"));
    assert_eq!(d.decode::<Order>().unwrap(), Order { id: 8 });
    assert_eq!(st.foreign_conflicts, 0);
}

#[tokio::test(start_paused = true)]
async fn a_masstransit_envelope_contradicted_by_a_transport_header_counts_one_foreign_conflict() {
    // semantics C11: ForeignConflicts counts, in any mode, attempts whose transport headers
    // contradict the event's envelope, such as a correlation-id header that differs from a
    // MassTransit envelope's correlationId. The event stays the envelope's; the contradicting
    // headers are in d.foreign().
    let envelope = r#"{"messageId":"m-1","correlationId":"c-envelope","messageType":["urn:message:Shop:OrderCreated"],"message":{"id":9}}"#;
    let (d, st) = one_delivery(
        vec![
            ("content-type", "application/vnd.masstransit+json"),
            ("correlation-id", "c-broker"),
        ],
        envelope,
    )
    .await;
    assert_eq!(d.event().format, Format::MassTransit);
    assert_eq!(
        d.event().correlation_id.as_deref(),
        Some("c-envelope"),
        "the envelope's value is kept"
    );
    assert_eq!(
        d.foreign().get("correlation-id"),
        Some("c-broker"),
        "the transport's value is in the foreign view"
    );
    assert_eq!(d.decode::<Order>().unwrap(), Order { id: 9 });
    assert_eq!(st.foreign_conflicts, 1);
    assert_eq!(
        d.header("Correlation-ID"),
        Some("c-broker"),
        "headers are read case-insensitively"
    );

    // Agreeing headers are no conflict.
    let (d, st) = one_delivery(
        vec![("correlation-id", "c-envelope"), ("message-id", "m-1")],
        envelope,
    )
    .await;
    assert_eq!(st.foreign_conflicts, 0);
    assert!(d.foreign().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_masstransit_envelope_contradicted_by_a_header_through_the_bus_is_a_foreign_conflict() {
    // semantics C11, the shared scene: the same contradiction published through the bus and
    // handled by a subscription (not read off a bare consumer, as above) counts one
    // ForeignConflict and keeps the envelope's correlationId.
    common::bus::a_masstransit_envelope_contradicted_by_a_header_is_a_foreign_conflict(&Memory(
        MemoryBroker::new(),
    ))
    .await;
}

#[tokio::test(start_paused = true)]
async fn foreign_conflicts_are_counted_per_attempt_under_at_least_once() {
    // semantics C11, I2: ForeignConflicts is attempt grain and outside the identity.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let mut p = alo("o.>");
    p.max_deliver = Some(3);
    bus.subscribe(sub("o", p, |d| async move {
        d.nack().await?;
        Ok(())
    }))
    .await
    .unwrap();
    bus.publish_with_headers(
        "o.1",
        vec![("correlation-id".into(), "broker".into())],
        r#"{"messageId":"m","correlationId":"env","messageType":["x"],"message":{}}"#,
    )
    .await
    .unwrap();
    until("exhausted", || stats(&bus, "o").exhausted == 1).await;
    let st = stats(&bus, "o");
    assert_eq!(st.foreign_conflicts, 3);
    assert!(st.balanced());
}

#[tokio::test(start_paused = true)]
async fn decode_reads_a_raw_json_payload_and_reports_a_malformed_one() {
    // A handler decodes first; a malformed payload is an error it can decline (semantics S1).
    let (d, _) = one_delivery(vec![], r#"{"id": 1}"#).await;
    assert_eq!(d.event().format, Format::Raw);
    assert_eq!(d.decode::<Order>().unwrap(), Order { id: 1 });
    let (d, _) = one_delivery(vec![], "not json").await;
    assert!(d.decode::<Order>().is_err());
}

// ------------------------------------------------ prefetch and the forgotten ack (semantics P1–P4)

#[tokio::test(start_paused = true)]
async fn max_in_flight_bounds_concurrent_handlers() {
    // semantics P1: maxInFlight is how many unsettled attempts a subscription holds; the runtime
    // runs at most that many handlers at once.
    let mem = MemoryBroker::new();
    let bus = bus(&mem);
    let handlers = common::bus::Concurrency::default();
    let h = handlers.clone();
    let mut p = alo("o.>");
    p.max_in_flight = Some(2);
    bus.subscribe(sub("o", p, move |d| {
        let h = h.clone();
        async move {
            let running = h.enter();
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(running);
            d.ack().await?;
            Ok(())
        }
    }))
    .await
    .unwrap();
    for i in 0..10 {
        bus.publish(format!("o.{i}"), "x").await.unwrap();
    }
    until("all acked", || stats(&bus, "o").settlement.acked == 10).await;
    assert_eq!(handlers.peak(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_forgotten_ack_is_counted_silent_and_never_stalls_the_consumer() {
    // semantics P3: a forgotten ack does not hold its slot (with a prefetch of 1 a consumer would
    // otherwise stop after one message): it is counted Silent and, under AtLeastOnce,
    // redelivered, so it never stalls a consumer unseen.
    let scene = Memory(MemoryBroker::new());
    let (_bus, runs) =
        common::bus::a_forgotten_ack_with_prefetch_one_never_stalls(&scene, "o", 5).await;
    assert_eq!(runs, 10, "the consumer went past the first message");
}

// ---------------------------------------------------------------- the seam and conformance

#[tokio::test(start_paused = true)]
async fn the_conformance_suite_passes_on_the_memory_backend() {
    // semantics T1–T5: four rows for any AtLeastOnce backend, and a fifth, a declined message
    // waiting out its delay, on a backend declaring delaysRedelivery.
    let mem = MemoryBroker::new();
    let rows = bus::conformance::run(&mem, "conformance")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(rows, bus::conformance::ROWS.to_vec());
}

#[tokio::test(start_paused = true)]
async fn the_conformance_suite_skips_the_delay_row_where_delays_are_not_declared() {
    // semantics T5: the delay row runs only on a backend declaring delaysRedelivery.
    let limited = Limited(
        MemoryBroker::new(),
        Capabilities {
            delays_redelivery: false,
            ..Capabilities::default()
        },
    );
    let rows = bus::conformance::run(&limited, "conformance")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(rows, bus::conformance::ROWS[..4].to_vec());
}

#[tokio::test(start_paused = true)]
async fn the_conformance_suite_catches_a_backend_that_redelivers_early() {
    // The suite must fail a backend that turns a delay into an immediate retry
    // (semantics B3, B5, T5).
    let rows = bus::conformance::run(&Hasty(MemoryBroker::new()), "conformance").await;
    let err = rows.unwrap_err();
    assert_eq!(err.row, bus::conformance::ROWS[4], "{err}");
}

#[tokio::test(start_paused = true)]
async fn settle_is_the_one_path_at_the_seam() {
    // semantics T6, S6: at the seam every exchange is completed with bus::settle (or
    // bus::settle_with for a delayed decline), the same functions the bus uses.
    let mem = MemoryBroker::new();
    let mut p = alo("o.>");
    p.max_nack_delay = Some(api::Duration::from_secs(1));
    let ctx = SubscriptionCtx::new("o", &p);
    let mut c = mem.open(ctx.clone()).await.unwrap();
    mem.publish("o.1".into(), vec![], "x".into()).await.unwrap();
    let d = c.next().await.unwrap();
    bus::settle(&d, Decision::Silent).await.unwrap();
    let d = c.next().await.unwrap();
    assert_eq!(d.attempt(), 2);
    bus::settle_with(&d, Duration::from_millis(10))
        .await
        .unwrap();
    assert_eq!(
        bus::settle(&d, Decision::Ack).await,
        Err(SettleError::AlreadySettled)
    );
    let d = c.next().await.unwrap();
    bus::settle(&d, Decision::Ack).await.unwrap();
    let st = ctx.stats();
    assert_eq!(
        (
            st.offered,
            st.settlement.silent,
            st.settlement.nacked,
            st.settlement.acked
        ),
        (3, 1, 1, 1)
    );
}

// ---------------------------------------------------------------- test backends

/// Memory with other declared capabilities.
struct Limited(MemoryBroker, Capabilities);

impl Broker for Limited {
    fn kind(&self) -> BackendKind {
        BackendKind::Memory
    }
    fn capabilities(&self) -> Capabilities {
        self.1.clone()
    }
    fn hands_on_slow_handlers(&self) -> bool {
        false
    }
    fn open(
        &self,
        ctx: Arc<SubscriptionCtx>,
    ) -> BoxFuture<'_, Result<Box<dyn Consumer>, BusError>> {
        self.0.open(ctx)
    }
    fn publish(
        &self,
        subject: String,
        headers: Vec<(String, String)>,
        payload: bytes::Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>> {
        self.0.publish(subject, headers, payload)
    }
    fn stats_sink(&self) -> Option<Arc<dyn StatsSink>> {
        None
    }
}

/// A broken backend: ignores delays (redelivers at once). Its consumer hands out deliveries of
/// the caller's context whose settler declines the inner memory delivery without any delay.
struct Hasty(MemoryBroker);

impl Broker for Hasty {
    fn kind(&self) -> BackendKind {
        BackendKind::Memory
    }
    fn hands_on_slow_handlers(&self) -> bool {
        false
    }
    fn open(
        &self,
        ctx: Arc<SubscriptionCtx>,
    ) -> BoxFuture<'_, Result<Box<dyn Consumer>, BusError>> {
        Box::pin(async move {
            let inner_policy = DeliveryPolicy {
                pattern: ctx.policy().pattern.clone(),
                mode: Mode::AtLeastOnce,
                durable_name: ctx.policy().durable_name.clone(),
                ..DeliveryPolicy::default()
            };
            let inner = self
                .0
                .open(SubscriptionCtx::new("inner", &inner_policy))
                .await?;
            Ok(Box::new(Rewrap(inner, ctx, None)) as Box<dyn Consumer>)
        })
    }
    fn publish(
        &self,
        subject: String,
        headers: Vec<(String, String)>,
        payload: bytes::Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>> {
        self.0.publish(subject, headers, payload)
    }
}

/// Memory's consumer under another context; each delivery settled through `ZeroDelay`, or
/// through `Capped` when a cap is given.
struct Rewrap(Box<dyn Consumer>, Arc<SubscriptionCtx>, Option<Duration>);

/// A backend that holds a declined message at most `cap` (as SQS holds one at most 12 h from its
/// first receive): a longer delay is shortened to the cap, and it says so.
struct CappedDelay(MemoryBroker, Duration);

impl Broker for CappedDelay {
    fn kind(&self) -> BackendKind {
        BackendKind::Memory
    }
    fn hands_on_slow_handlers(&self) -> bool {
        false
    }
    fn open(
        &self,
        ctx: Arc<SubscriptionCtx>,
    ) -> BoxFuture<'_, Result<Box<dyn Consumer>, BusError>> {
        Box::pin(async move {
            let inner_policy = DeliveryPolicy {
                pattern: ctx.policy().pattern.clone(),
                mode: Mode::AtLeastOnce,
                durable_name: ctx.policy().durable_name.clone(),
                max_nack_delay: Some(api::Duration::from_secs(24 * 3600)),
                ..DeliveryPolicy::default()
            };
            let inner = self
                .0
                .open(SubscriptionCtx::new("inner", &inner_policy))
                .await?;
            Ok(Box::new(Rewrap(inner, ctx, Some(self.1))) as Box<dyn Consumer>)
        })
    }
    fn publish(
        &self,
        subject: String,
        headers: Vec<(String, String)>,
        payload: bytes::Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>> {
        self.0.publish(subject, headers, payload)
    }
}

struct Capped(Delivery, Duration);

impl bus::OnSettle for Capped {
    fn settle(
        &self,
        action: bus::BrokerAction,
    ) -> BoxFuture<'_, Result<bus::Performed, bus::Refusal>> {
        Box::pin(async move {
            let r = match action {
                bus::BrokerAction::Ack | bus::BrokerAction::Terminate => {
                    bus::settle(&self.0, Decision::Ack)
                        .await
                        .map(|()| bus::Performed::AsAsked)
                }
                bus::BrokerAction::Decline(d) if d > self.1 => bus::settle_with(&self.0, self.1)
                    .await
                    .map(|()| bus::Performed::DelayShortened),
                bus::BrokerAction::Decline(d) => bus::settle_with(&self.0, d)
                    .await
                    .map(|()| bus::Performed::AsAsked),
            };
            r.map_err(|e| bus::Refusal {
                reason: e.to_string(),
                stranded: false,
            })
        })
    }
    fn progress(&self) -> BoxFuture<'_, Result<(), bus::Refusal>> {
        Box::pin(async { Ok(()) })
    }
    fn release(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

struct ZeroDelay(Delivery);

impl bus::OnSettle for ZeroDelay {
    fn settle(
        &self,
        action: bus::BrokerAction,
    ) -> BoxFuture<'_, Result<bus::Performed, bus::Refusal>> {
        Box::pin(async move {
            let r = match action {
                bus::BrokerAction::Ack | bus::BrokerAction::Terminate => {
                    bus::settle(&self.0, Decision::Ack).await
                }
                bus::BrokerAction::Decline(_) => bus::settle(&self.0, Decision::Nack).await,
            };
            r.map(|()| bus::Performed::AsAsked)
                .map_err(|e| bus::Refusal {
                    reason: e.to_string(),
                    stranded: false,
                })
        })
    }
    fn progress(&self) -> BoxFuture<'_, Result<(), bus::Refusal>> {
        Box::pin(async { Ok(()) })
    }
    fn release(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

impl Consumer for Rewrap {
    fn next(&mut self) -> BoxFuture<'_, Option<Delivery>> {
        Box::pin(async move {
            let d = self.0.next().await?;
            Some(Delivery::new(
                &self.1,
                bus::DeliveryOptions {
                    subject: d.subject().to_string(),
                    headers: d.headers().to_vec(),
                    payload: d.payload().clone(),
                    attempt: d.attempt(),
                    on_settle: match self.2 {
                        Some(cap) => Box::new(Capped(d, cap)),
                        None => Box::new(ZeroDelay(d)),
                    },
                },
            ))
        })
    }
    fn retire(&mut self) -> BoxFuture<'_, ()> {
        self.0.retire()
    }
}

// ---------------------------------------------------------- the stats report (docs/stats-report.md)

/// Counts every put, keeps the last value per key.
#[derive(Clone, Default)]
struct CountingSink(Arc<Mutex<Vec<(String, bytes::Bytes)>>>);

impl StatsSink for CountingSink {
    fn put(&self, key: String, value: bytes::Bytes) -> BoxFuture<'_, Result<(), BusError>> {
        self.0.lock().unwrap().push((key, value));
        Box::pin(async { Ok(()) })
    }
}

#[tokio::test(start_paused = true)]
async fn the_stats_report_is_versioned_json_keyed_by_namespace_subscription_and_instance() {
    // docs/stats-report.md: {"version":1,"namespace","subscription","instance",...,"stats":ConsumerStats}
    let mem = MemoryBroker::new();
    let bus = Bus::builder(mem.clone())
        .namespace("shop")
        .instance("pod-a")
        .report_interval(Duration::from_secs(1))
        .build();
    bus.subscribe(sub("orders", alo("orders.>"), |d| async move {
        d.ack().await?;
        Ok(())
    }))
    .await
    .unwrap();
    bus.publish("orders.1", "x").await.unwrap();
    until("acked", || stats(&bus, "orders").settlement.acked == 1).await;
    bus.close().await;
    let reports = mem.reports();
    let body = reports
        .get("shop.orders.pod-a")
        .unwrap_or_else(|| panic!("no report under shop.orders.pod-a: {:?}", reports.keys()));
    let v: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert_eq!(v["version"], 1);
    assert_eq!(v["namespace"], "shop");
    assert_eq!(v["subscription"], "orders");
    assert_eq!(v["instance"], "pod-a");
    assert_eq!(v["backend"], "memory");
    assert_eq!(v["mode"], "AtLeastOnce");
    assert_eq!(v["durableName"], "d-orders__");
    assert_eq!(v["stats"]["settlement"]["acked"], 1);
    assert_eq!(v["stats"]["offered"], 1);
    assert!(
        v["stats"].get("leaseExpired").is_some(),
        "counters use the CRD's camelCase names"
    );
    let report: bus::report::StatsReport = serde_json::from_slice(body).unwrap();
    assert_eq!(
        report.stats,
        stats(&bus, "orders"),
        "the last report is the final account"
    );
}

#[tokio::test(start_paused = true)]
async fn the_stats_report_is_published_at_a_bounded_rate_and_only_when_something_changed() {
    // docs/stats-report.md, "When": at most once per interval per subscription, and only when a
    // counter changed.
    let mem = MemoryBroker::new();
    let sink = CountingSink::default();
    let bus = Bus::builder(mem.clone())
        .instance("i")
        .report_interval(Duration::from_secs(1))
        .stats_sink(Arc::new(sink.clone()))
        .build();
    bus.subscribe(sub("busy", alo("busy.>"), |d| async move {
        d.ack().await?;
        Ok(())
    }))
    .await
    .unwrap();
    // 10 s of traffic: 100 messages a second.
    for i in 0..1000 {
        bus.publish(format!("busy.{i}"), "x").await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    until("all acked", || stats(&bus, "busy").settlement.acked == 1000).await;
    let during = sink.0.lock().unwrap().len();
    assert!(
        during <= 12,
        "at most one report per interval: {during} reports in ~10 s"
    );
    // And no fewer: something changed in every one of the ten intervals, so each one reports
    // (time is paused, so this is exact, not a timing guess).
    assert!(
        during >= 9,
        "a report in every interval with changes: {during} reports in ~10 s"
    );
    // Nothing changes for 10 s: nothing more is sent beyond the one that carries the last change.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let idle = sink.0.lock().unwrap().len();
    assert!(
        idle <= during + 1,
        "idle subscriptions are not re-reported: {during} -> {idle}"
    );
    bus.close().await;
    let all = sink.0.lock().unwrap().clone();
    let seqs: Vec<u64> = all
        .iter()
        .map(|(_, b)| {
            serde_json::from_slice::<bus::report::StatsReport>(b)
                .unwrap()
                .sequence
        })
        .collect();
    assert!(
        seqs.windows(2).all(|w| w[1] > w[0]),
        "sequence increases: {seqs:?}"
    );
    let counts: Vec<u64> = all
        .iter()
        .map(|(_, b)| {
            serde_json::from_slice::<bus::report::StatsReport>(b)
                .unwrap()
                .stats
                .settlement
                .acked
        })
        .collect();
    assert!(
        counts.windows(2).all(|w| w[1] >= w[0]),
        "reported counters never go backwards: {counts:?}"
    );
    assert_eq!(
        *counts.last().unwrap(),
        1000,
        "the report at close carries the final account"
    );
}

#[test]
fn report_keys_stay_in_the_kv_key_alphabet() {
    assert_eq!(
        bus::report::report_key("shop", "orders", "pod-7f9c"),
        "shop.orders.pod-7f9c"
    );
    assert_eq!(bus::report::report_key("a b", "x.y", ""), "a_b.x_y._");
}

#[tokio::test(start_paused = true)]
async fn a_delivery_belongs_to_the_epoch_it_was_offered_in() {
    // semantics C15: a Subscription object taken over mid-work (a new UID in the mark) starts
    // at zero, and what deliveries offered before it do afterwards stays out of its counts, so
    // offered = delivered + released + lost holds for the new object whatever ran across.
    let mem = MemoryBroker::new();
    let ctx = SubscriptionCtx::new("o", &alo("o.>"));
    ctx.bound_to(Some("uid-1"));
    let mut c = mem.open(ctx.clone()).await.unwrap();
    for i in 0..3 {
        mem.publish(format!("o.{i}"), vec![], "x".into())
            .await
            .unwrap();
    }
    let early: Vec<Delivery> = vec![
        c.next().await.unwrap(),
        c.next().await.unwrap(),
        c.next().await.unwrap(),
    ];
    early[0].ack().await.unwrap();

    ctx.bound_to(Some("uid-2"));
    let fresh = ctx.epoch();
    assert_eq!(fresh.uid.as_deref(), Some("uid-2"));
    assert_eq!(fresh.stats, ConsumerStats::default(), "{fresh:?}");
    // The two still in flight finish in the new epoch: left out of it.
    early[1].ack().await.unwrap();
    early[2].nack().await.unwrap();
    assert_eq!(ctx.epoch().stats, ConsumerStats::default());
    // A delivery offered now counts there.
    mem.publish("o.3".into(), vec![], "x".into()).await.unwrap();
    let mut now = c.next().await.unwrap();
    while now.attempt() > 1 {
        // The nacked one came back first: a new offer, so the new epoch's.
        now.ack().await.unwrap();
        now = c.next().await.unwrap();
    }
    now.ack().await.unwrap();
    let after = ctx.epoch().stats;
    assert_eq!(after.offered, after.settlement.acked, "{after:?}");
    assert!(after.offered >= 1, "{after:?}");
    assert_eq!(after.settlement.nacked, 0, "{after:?}");
    // The process's own counts keep everything.
    let all = ctx.stats();
    assert_eq!(all.settlement.acked, 2 + after.settlement.acked, "{all:?}");
    assert_eq!(all.settlement.nacked, 1, "{all:?}");
}
