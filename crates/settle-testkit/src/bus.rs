//! The handler runtime's test scenes, shared by the `bus_*` suites: what a handler saw
//! ([`Seen`]), how many handlers ran at once ([`Concurrency`]), waiting for a condition ([`until`]), the policies the suites start from, and the
//! scenarios every broker runs, each written once against [`BusScene`] (what differs per
//! broker: how a bus is built, what an AtLeastOnce policy and a subject are, how a message is
//! published). A scenario asserts what every broker that runs it must show, and returns what
//! the broker's own suite goes on to assert (what went on the wire, what a queue holds).
//!
//! It must not know any broker: no broker type, no broker client, no broker-specific assertion.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use settle::api::{ConsumerStats, DeliveryPolicy, Mode};
use settle::bus::{self, Bus, BusBuilder, BusError, Delivery, Subscriber, handler};
use tokio::time::Instant;

/// How many handlers run at once, and the most that ever did (maxInFlight tests): a handler
/// holds what [`Concurrency::enter`] returns while it works.
#[derive(Clone, Default)]
pub struct Concurrency {
    now: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
}

impl Concurrency {
    pub fn enter(&self) -> Running {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(n, Ordering::SeqCst);
        Running(Arc::clone(&self.now))
    }

    /// Handlers running now.
    pub fn now(&self) -> usize {
        self.now.load(Ordering::SeqCst)
    }

    /// The most handlers that ran at once.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }
}

/// One running handler; dropped when it is done.
pub struct Running(Arc<AtomicUsize>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Every attempt a handler saw: (payload, attempt, when).
#[derive(Clone, Default)]
pub struct Seen(Arc<Mutex<Vec<(String, u32, Instant)>>>);

impl Seen {
    pub fn record(&self, d: &Delivery) {
        self.0.lock().unwrap().push((
            String::from_utf8_lossy(d.payload()).into_owned(),
            d.attempt(),
            Instant::now(),
        ));
    }
    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// (payload, attempt) of every attempt, in order.
    pub fn all(&self) -> Vec<(String, u32)> {
        let v = self.0.lock().unwrap();
        v.iter().map(|e| (e.0.clone(), e.1)).collect()
    }
    pub fn attempts(&self) -> Vec<u32> {
        self.0.lock().unwrap().iter().map(|e| e.1).collect()
    }
    pub fn times(&self) -> Vec<Instant> {
        self.0.lock().unwrap().iter().map(|e| e.2).collect()
    }
    /// The time between one attempt and the next.
    pub fn gaps(&self) -> Vec<Duration> {
        let t = self.times();
        t.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

/// Waits until `f` holds, looking every 20 ms; panics with `what` after a minute (a real
/// broker's suites).
pub async fn until(what: &str, f: impl Fn() -> bool) {
    until_within(Duration::from_secs(60), Duration::from_millis(20), what, f).await;
}

/// Waits on Tokio's paused clock until `f` holds, looking every 5 ms of virtual time; panics with
/// `what` after ten minutes of virtual time (the in-memory suite).
pub async fn until_paused(what: &str, f: impl Fn() -> bool) {
    until_within(Duration::from_secs(600), Duration::from_millis(5), what, f).await;
}

async fn until_within(limit: Duration, every: Duration, what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(every).await;
    }
}

pub fn stats(bus: &Bus, name: &str) -> ConsumerStats {
    bus.stats(name).expect("subscription exists")
}

pub fn sub<F, Fut>(name: &str, policy: DeliveryPolicy, f: F) -> Subscriber
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), bus::HandlerError>> + Send + 'static,
{
    Subscriber::new(name, policy, handler(f))
}

/// An AtLeastOnce policy on `pattern` with durable name `durable`, five attempts.
pub fn at_least_once(pattern: &str, durable: &str) -> DeliveryPolicy {
    DeliveryPolicy {
        pattern: pattern.into(),
        mode: Mode::AtLeastOnce,
        durable_name: Some(durable.into()),
        max_deliver: Some(5),
        ..DeliveryPolicy::default()
    }
}

/// What differs per broker in a shared scenario.
// The scenes run in the test binaries only: no caller needs Send bounds on these futures.
#[allow(async_fn_in_trait)]
pub trait BusScene {
    /// A bus builder on this scene's broker, without reports. Two builders of one scene reach
    /// the same messages (a second bus takes over what the first gave up).
    fn builder(&self) -> impl std::future::Future<Output = BusBuilder>;

    /// The AtLeastOnce policy of subscription `name`, five attempts.
    fn alo(&self, name: &str) -> DeliveryPolicy;

    /// Publishes `m` to the subject subscription `m.name` listens on.
    fn send(&self, bus: &Bus, m: Message<'_>) -> impl std::future::Future<Output = ()>;

    /// How long the scene waits for a condition, and how often it looks ([`until`] or
    /// [`until_paused`]).
    fn until(&self, what: &str, f: impl Fn() -> bool) -> impl std::future::Future<Output = ()> {
        until(what, f)
    }

    fn bus(&self) -> impl std::future::Future<Output = Bus> {
        async { self.builder().await.build() }
    }

    /// Publishes message `n` of subscription `name`, without headers.
    async fn publish(&self, bus: &Bus, name: &str, n: usize, body: &str) {
        let headers = Vec::new();
        let m = Message {
            name,
            n,
            headers,
            body,
        };
        self.send(bus, m).await;
    }
}

/// Message `n` (from 0 or 1, as a scenario counts) of subscription `name`.
pub struct Message<'a> {
    pub name: &'a str,
    pub n: usize,
    pub headers: Vec<(String, String)>,
    pub body: &'a str,
}

/// Subscribes `name` on `bus` with a handler that records every attempt, then does what `then`
/// says with it; returns what the handler saw.
async fn watched<Fut>(
    bus: &Bus,
    name: &str,
    policy: DeliveryPolicy,
    then: impl Fn(Delivery) -> Fut + Send + Sync + 'static,
) -> Seen
where
    Fut: std::future::Future<Output = Result<(), bus::HandlerError>> + Send + 'static,
{
    let seen = Seen::default();
    let s = seen.clone();
    bus.subscribe(sub(name, policy, move |d| {
        s.record(&d);
        then(d)
    }))
    .await
    .unwrap();
    seen
}

/// Declines every attempt.
async fn nack(d: Delivery) -> Result<(), bus::HandlerError> {
    d.nack().await?;
    Ok(())
}

/// Accepts every attempt.
async fn ack(d: Delivery) -> Result<(), bus::HandlerError> {
    d.ack().await?;
    Ok(())
}

/// semantics M3: under AtLeastOnce a subscription without a durable name is refused by the bus,
/// the field named. Returns the refusal.
pub async fn refused_without_a_durable_name<S: BusScene>(scene: &S, name: &str) -> BusError {
    let bus = scene.bus().await;
    let mut p = scene.alo(name);
    p.durable_name = None;
    let err = bus
        .subscribe(sub(name, p, |_d| async { Ok(()) }))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, BusError::Refused { reason, .. } if reason.contains("spec.durableName")),
        "{err}"
    );
    err
}

/// semantics M2, C7: a handler that always nacks, `n` messages (bodies `0`..`n`) under `policy`:
/// waits until all `n` are Exhausted. Returns the bus (still running) and what the handler saw.
pub async fn always_nack_until_exhausted<S: BusScene>(
    scene: &S,
    name: &str,
    policy: DeliveryPolicy,
    n: usize,
) -> (Bus, Seen) {
    let bus = scene.bus().await;
    let seen = watched(&bus, name, policy, nack).await;
    for i in 0..n {
        scene.publish(&bus, name, i, &i.to_string()).await;
    }
    let what = format!("{n} exhausted");
    scene
        .until(&what, || stats(&bus, name).exhausted == n as u64)
        .await;
    (bus, seen)
}

/// semantics M1: under AtMostOnce (`policy`) a handler nacks each of `n` messages; once all are
/// delivered and `quiet` has passed, each was seen once (a Nack brings nothing back) and every
/// Nack is counted. Returns the bus (still running) and what the handler saw.
pub async fn at_most_once_nacks_bring_nothing_back<S: BusScene>(
    scene: &S,
    name: &str,
    policy: DeliveryPolicy,
    n: usize,
    quiet: Duration,
) -> (Bus, Seen) {
    let bus = scene.bus().await;
    let seen = watched(&bus, name, policy, nack).await;
    let bodies = ["a", "b", "c", "d"];
    for (i, body) in bodies.iter().enumerate().take(n) {
        scene.publish(&bus, name, i + 1, body).await;
    }
    scene
        .until("all delivered", || stats(&bus, name).delivered == n as u64)
        .await;
    tokio::time::sleep(quiet).await;
    assert_eq!(seen.len(), n, "not redelivered: {:?}", seen.all());
    assert_eq!(stats(&bus, name).settlement.nacked, n as u64);
    (bus, seen)
}

/// semantics H1, H4: a handler that runs `run` under `policy` (a slow-handler setting) is not
/// handed on while it runs: one attempt, acked, no LeaseExpired. Returns the bus (still running)
/// and what the handler saw.
pub async fn a_slow_handler_keeps_its_message<S: BusScene>(
    scene: &S,
    name: &str,
    policy: DeliveryPolicy,
    run: Duration,
) -> (Bus, Seen) {
    let bus = scene.bus().await;
    let seen = watched(&bus, name, policy, move |d| async move {
        tokio::time::sleep(run).await;
        d.ack().await?;
        Ok(())
    })
    .await;
    scene.publish(&bus, name, 1, "a").await;
    scene
        .until("acked", || stats(&bus, name).settlement.acked >= 1)
        .await;
    assert_eq!(seen.attempts(), [1], "the broker did not hand it on");
    assert_eq!(stats(&bus, name).lease_expired, 0);
    (bus, seen)
}

/// semantics C3: an attempt given up at close (a handler still running after `grace`) is
/// Released, and the broker owes it back: a second bus on the same durable gets it as a later
/// attempt. `between` runs after the first bus closed, with its stats (a broker's own checks of
/// the release). Returns the attempts the second bus saw.
pub async fn released_at_close_comes_back<S: BusScene>(
    scene: &S,
    name: &str,
    policy: DeliveryPolicy,
    grace: Duration,
    between: impl AsyncFnOnce(ConsumerStats),
) -> Vec<u32> {
    let bus1 = scene.builder().await.close_grace(grace).build();
    bus1.subscribe(sub(name, policy.clone(), |_d| async move {
        tokio::time::sleep(Duration::from_secs(3600)).await;
        Ok(())
    }))
    .await
    .unwrap();
    scene.publish(&bus1, name, 1, "a").await;
    scene
        .until("offered", || stats(&bus1, name).offered == 1)
        .await;
    bus1.close().await;
    let st = stats(&bus1, name);
    assert_eq!((st.released, st.delivered), (1, 0), "{st:?}");
    assert!(st.balanced());
    between(st).await;

    // The same durable on a new bus gets it back, with a higher attempt.
    let bus2 = scene.bus().await;
    let seen = watched(&bus2, name, policy, ack).await;
    scene.until("redelivered", || seen.len() == 1).await;
    bus2.close().await;
    seen.attempts()
}

/// semantics C11: a transport correlation-id header that differs from the MassTransit envelope's
/// correlationId is a ForeignConflict; the event keeps the envelope's, the header is in the
/// foreign view.
pub async fn a_masstransit_envelope_contradicted_by_a_header_is_a_foreign_conflict<S: BusScene>(
    scene: &S,
) {
    let bus = scene.bus().await;
    let got = Arc::new(Mutex::new(None));
    let g = got.clone();
    bus.subscribe(sub("f", scene.alo("f"), move |d| {
        let g = g.clone();
        async move {
            *g.lock().unwrap() = Some((
                d.event().correlation_id.clone(),
                d.foreign().get("correlation-id").map(str::to_string),
            ));
            d.ack().await?;
            Ok(())
        }
    }))
    .await
    .unwrap();
    let body =
        r#"{"messageId":"m","correlationId":"from-envelope","messageType":["x"],"message":{}}"#;
    let headers = vec![
        (
            "content-type".into(),
            "application/vnd.masstransit+json".into(),
        ),
        ("correlation-id".into(), "from-broker".into()),
    ];
    let m = Message {
        name: "f",
        n: 1,
        headers,
        body,
    };
    scene.send(&bus, m).await;
    scene
        .until("handled", || got.lock().unwrap().is_some())
        .await;
    assert_eq!(
        got.lock().unwrap().clone().unwrap(),
        (Some("from-envelope".into()), Some("from-broker".into()))
    );
    assert_eq!(stats(&bus, "f").foreign_conflicts, 1);
    bus.close().await;
}

/// semantics P3: with maxInFlight 1 a forgotten ack would stop a consumer after one message; in
/// Settle each is counted Silent and redelivered (maxDeliver 2), so all `n` messages are
/// Exhausted and every forgotten ack is visible. Returns the bus (still running) and how many
/// times the handler ran.
pub async fn a_forgotten_ack_with_prefetch_one_never_stalls<S: BusScene>(
    scene: &S,
    name: &str,
    n: usize,
) -> (Bus, u32) {
    let bus = scene.bus().await;
    let runs = Arc::new(AtomicU32::new(0));
    let r = runs.clone();
    let mut p = scene.alo(name);
    p.max_in_flight = Some(1);
    p.max_deliver = Some(2);
    bus.subscribe(sub(name, p, move |_d| {
        let r = r.clone();
        async move {
            r.fetch_add(1, Ordering::SeqCst);
            Ok(()) // forgot to ack
        }
    }))
    .await
    .unwrap();
    for i in 0..n {
        scene.publish(&bus, name, i, "x").await;
    }
    scene
        .until("all exhausted", || stats(&bus, name).exhausted == n as u64)
        .await;
    let st = stats(&bus, name);
    assert_eq!(
        st.settlement.silent,
        2 * n as u64,
        "every forgotten ack is visible"
    );
    (bus, runs.load(Ordering::SeqCst))
}
