//! The one spec → consumer mapping (`backend::nats::mapping`) and its typed JetStream calls
//! (`backend::nats::admin`) against a real nats-server: what `desired` creates is exactly what
//! the server holds (after `normalise`), editable fields change in place, identity fields are
//! refused by the server, streams resolve or fail with a typed reason, and the runtime binds to
//! an operator's consumer without ever creating one.

use settle_testkit as common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy};
use settle::api::{self, BackendRef, DeliveryPolicy, Mode, SubscriptionSpec};
use settle::backend::nats::NatsBroker;
use settle::backend::nats::admin::{self, NatsError};
use settle::backend::nats::mapping::{self, ConsumerConfig};
use settle::bus::{Bus, Subscriber, handler};
use settle::policy::ResolvedPolicy;
use tokio::time::Instant;

static SEQ: AtomicUsize = AtomicUsize::new(0);

/// A private stream on the environment's nats-server, deleted when the test ends.
struct Stream {
    js: async_nats::jetstream::Context,
    name: String,
    prefix: String,
}

impl Stream {
    async fn new(test: &str) -> Stream {
        let url = common::env().nats_url;
        let client = async_nats::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
        let js = async_nats::jetstream::new(client);
        let tag = format!(
            "{test}_{}_{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let name = format!("MAP_{}", tag.to_uppercase());
        let prefix = format!("map.{tag}");
        js.create_stream(async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{prefix}.>")],
            storage: async_nats::jetstream::stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .expect("create stream");
        Stream { js, name, prefix }
    }

    fn policy(&self, f: impl FnOnce(&mut DeliveryPolicy)) -> DeliveryPolicy {
        let mut p = DeliveryPolicy {
            pattern: format!("{}.>", self.prefix),
            mode: Mode::AtLeastOnce,
            durable_name: Some("orders".into()),
            ..DeliveryPolicy::default()
        };
        f(&mut p);
        p
    }

    /// A Subscription on this stream with `policy`, whose consumer the operator owns.
    fn resource(&self, policy: DeliveryPolicy) -> SubscriptionSpec {
        SubscriptionSpec {
            backend_ref: BackendRef {
                name: "nats".into(),
            },
            stream: Some(self.name.clone()),
            deletion_policy: Default::default(),
            adopt: Default::default(),
            paused: false,
            paused_until: None,
            policy,
        }
    }

    fn desired(&self, p: &DeliveryPolicy) -> ConsumerConfig {
        mapping::desired("shop", "orders", &self.name, &ResolvedPolicy::resolve(p))
    }

    async fn live(&self, name: &str) -> Option<async_nats::jetstream::consumer::Info> {
        admin::consumer_info(&self.js, &self.name, name)
            .await
            .expect("consumer info")
    }

    async fn drop_it(self) {
        let _ = self.js.delete_stream(&self.name).await;
    }
}

#[tokio::test]
async fn what_desired_creates_is_exactly_what_the_server_holds() {
    let s = Stream::new("exact").await;
    let policies = [
        s.policy(|_| {}),
        s.policy(|p| {
            p.durable_name = Some("tuned".into());
            p.max_deliver = Some(3);
            p.ack_wait = Some(api::Duration::from_secs(7));
            p.max_in_flight = Some(11);
        }),
        s.policy(|p| {
            p.mode = Mode::AtMostOnce;
            p.durable_name = None;
        }),
        s.policy(|p| {
            p.mode = Mode::AtMostOnce;
            p.durable_name = Some("metrics".into());
        }),
    ];
    for p in policies {
        let want = s.desired(&p);
        admin::create_consumer(&s.js, &want)
            .await
            .unwrap_or_else(|e| panic!("create {}: {e}", want.name));
        let info = s.live(&want.name).await.expect("the consumer exists");
        let live = mapping::normalise(&s.name, &want.name, &info.config);
        assert_eq!(live, want, "the server holds exactly the mapped config");
        assert!(mapping::diff(&want, &live).is_empty());
        // Every field, as the server reports it.
        let c = &info.config;
        assert_eq!(c.durable_name.as_deref(), Some(want.name.as_str()));
        assert_eq!(c.ack_policy, want.ack_policy);
        assert_eq!(c.deliver_policy, want.deliver_policy);
        assert_eq!(c.filter_subject, want.filter_subject);
        assert!(c.backoff.is_empty(), "never a backoff list");
        assert_eq!(
            c.metadata.get(mapping::OWNER_KEY).map(String::as_str),
            Some("shop/orders")
        );
        if p.mode == Mode::AtLeastOnce {
            assert_eq!(c.ack_policy, AckPolicy::Explicit);
            assert_eq!(c.ack_wait, ResolvedPolicy::resolve(&p).ack_wait);
            assert_eq!(c.max_ack_pending, want.max_ack_pending);
            assert_eq!(c.max_deliver, want.max_deliver);
        } else {
            assert_eq!(c.ack_policy, AckPolicy::None);
        }
        // Creating the same consumer again is accepted and changes nothing (idempotent).
        admin::create_consumer(&s.js, &want)
            .await
            .expect("an identical create is idempotent");
    }
    s.drop_it().await;
}

#[tokio::test]
async fn editable_fields_change_in_place_on_the_same_consumer() {
    let s = Stream::new("edit").await;
    let before = s.desired(&s.policy(|_| {}));
    admin::create_consumer(&s.js, &before).await.unwrap();
    let created = s.live("orders").await.unwrap().created;
    let after = s.desired(&s.policy(|p| {
        p.max_deliver = Some(4);
        p.ack_wait = Some(api::Duration::from_secs(12));
        p.max_in_flight = Some(5);
        p.pattern = format!("{}.eu.>", s.prefix);
    }));
    let d = mapping::diff(
        &after,
        &mapping::normalise(&s.name, "orders", &s.live("orders").await.unwrap().config),
    );
    assert!(d.immutable.is_empty(), "{d:?}");
    assert_eq!(
        d.editable.iter().map(|f| f.field).collect::<Vec<_>>(),
        [
            "ack_wait",
            "max_deliver",
            "max_ack_pending",
            "filter_subject"
        ]
    );
    admin::update_consumer(&s.js, &after)
        .await
        .expect("update in place");
    let info = s.live("orders").await.unwrap();
    assert_eq!(info.created, created, "the same consumer, not a new one");
    assert!(mapping::diff(&after, &mapping::normalise(&s.name, "orders", &info.config)).is_empty());
    s.drop_it().await;
}

#[tokio::test]
async fn the_server_refuses_in_place_what_diff_calls_immutable() {
    let s = Stream::new("immutable").await;
    let base = s.desired(&s.policy(|_| {}));
    admin::create_consumer(&s.js, &base).await.unwrap();
    let mut ack_none = base.clone();
    ack_none.ack_policy = AckPolicy::None;
    let mut from_new = base.clone();
    from_new.deliver_policy = DeliverPolicy::New;
    for changed in [ack_none, from_new] {
        let d = mapping::diff(&changed, &base);
        assert_eq!(d.immutable.len(), 1, "{d:?}");
        let e = admin::update_consumer(&s.js, &changed)
            .await
            .expect_err("the server must refuse to change an identity field in place");
        assert!(
            matches!(e, NatsError::Api { .. }),
            "{} must be a refusal, got {e:?}",
            d.immutable[0].field
        );
    }
    s.drop_it().await;
}

#[tokio::test]
async fn streams_resolve_or_fail_with_a_reason_the_status_can_name() {
    let s = Stream::new("streams").await;
    let pattern = format!("{}.>", s.prefix);
    assert_eq!(
        admin::resolve_stream(&s.js, None, &pattern).await.unwrap(),
        s.name
    );
    assert_eq!(
        admin::resolve_stream(&s.js, Some(&s.name), "anything.>")
            .await
            .unwrap(),
        s.name
    );
    assert_eq!(
        admin::resolve_stream(&s.js, Some("NO_SUCH_STREAM_XYZ"), &pattern).await,
        Err(NatsError::StreamNotFound("NO_SUCH_STREAM_XYZ".into()))
    );
    assert_eq!(
        admin::resolve_stream(&s.js, None, "nobody.carries.this.>").await,
        Err(NatsError::NoStreamFor("nobody.carries.this.>".into()))
    );
    // A second stream whose subjects overlap the pattern too makes it ambiguous.
    let second = format!("{}_EU", s.name);
    s.js.create_stream(async_nats::jetstream::stream::Config {
        name: second.clone(),
        subjects: vec![format!("{}_eu.>", s.prefix)],
        storage: async_nats::jetstream::stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .unwrap();
    match admin::resolve_stream(&s.js, None, "map.*.>").await {
        Err(NatsError::StreamAmbiguous { streams, .. }) => assert!(
            streams.contains(&s.name) && streams.contains(&second),
            "{streams:?}"
        ),
        other => panic!("expected StreamAmbiguous, got {other:?}"),
    }
    let _ = s.js.delete_stream(&second).await;
    s.drop_it().await;
}

#[tokio::test]
async fn a_code_defined_subscription_updates_its_consumer_and_refuses_an_incompatible_one() {
    let s = Stream::new("own").await;
    let broker = NatsBroker::connect(&common::env().nats_url).await.unwrap();
    let bus = Bus::builder(broker).without_reports().build();
    // Someone left a consumer named `orders` with another maxDeliver: the runtime updates it.
    let stale = s.desired(&s.policy(|p| p.max_deliver = Some(9)));
    admin::create_consumer(&s.js, &stale).await.unwrap();
    let p = s.policy(|p| p.max_deliver = Some(2));
    bus.subscribe(
        Subscriber::new(
            "orders",
            p.clone(),
            handler(|d| async move { d.ack().await }),
        )
        .with_stream(&s.name),
    )
    .await
    .expect("subscribe");
    let live = s.live("orders").await.unwrap();
    assert_eq!(
        live.config.max_deliver, 2,
        "updated to the subscription's policy"
    );
    bus.close().await;

    // One with another ack policy cannot be changed in place: refused, never silently bound.
    let other = Stream::new("own2").await;
    let mut amo = other.desired(&other.policy(|_| {}));
    amo.ack_policy = AckPolicy::None;
    admin::create_consumer(&other.js, &amo).await.unwrap();
    let bus = Bus::builder(NatsBroker::connect(&common::env().nats_url).await.unwrap())
        .without_reports()
        .build();
    let err = bus
        .subscribe(Subscriber::new(
            "orders",
            other.policy(|_| {}),
            handler(|d| async move { d.ack().await }),
        ))
        .await
        .expect_err("an incompatible consumer is refused");
    let text = err.to_string();
    assert!(
        text.contains("ack_policy (spec.mode)") && text.contains("cannot change in place"),
        "{text}"
    );
    bus.close().await;
    s.drop_it().await;
    other.drop_it().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_built_from_a_resource_waits_for_the_operators_consumer_and_never_creates_one() {
    let s = Stream::new("bind").await;
    let resource = s.resource(s.policy(|_| {}));
    let seen = Arc::new(AtomicUsize::new(0));
    let bus = Bus::builder(NatsBroker::connect(&common::env().nats_url).await.unwrap())
        .namespace("shop")
        .without_reports()
        .build();
    let counter = Arc::clone(&seen);
    let sub = Subscriber::from_resource(
        "orders",
        &resource,
        handler(move |d| {
            let counter = Arc::clone(&counter);
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                d.ack().await
            }
        }),
    );
    let waiting = tokio::spawn({
        let bus = bus.clone();
        async move { bus.subscribe(sub).await }
    });
    // It waits: no consumer appears by the runtime's hand.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !waiting.is_finished(),
        "subscribe must wait for the operator's consumer"
    );
    assert!(
        s.live("orders").await.is_none(),
        "the runtime must not create an operator's consumer"
    );

    // The operator makes it (through the same mapping): the runtime binds and consumes.
    admin::create_consumer(&s.js, &s.desired(&resource.policy))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !waiting.is_finished() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for subscribe to bind"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    waiting.await.unwrap().expect("bound");
    s.js.publish(format!("{}.a", s.prefix), "x".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while seen.load(Ordering::SeqCst) == 0 {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for the message"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The Subscription is deleted (the operator deletes its consumer): the running app must not
    // bring it back.
    assert!(
        admin::delete_consumer(&s.js, &s.name, "orders")
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        s.live("orders").await.is_none(),
        "a running app recreated a deleted Subscription's consumer"
    );
    bus.close().await;
    s.drop_it().await;
}

/// The account's gauges come from a stream's listing, in the server's pages of 256: 300
/// consumers, each with its own pending and unacknowledged counts, are all read; a stream that
/// does not exist is `None`.
#[tokio::test]
async fn a_streams_consumers_are_listed_with_their_gauges_across_pages() {
    use async_nats::jetstream::consumer::pull;
    use futures::StreamExt;

    let s = Stream::new("gauges").await;
    let stream = s.js.get_stream(&s.name).await.expect("stream");
    for i in 0..300 {
        stream
            .create_consumer(pull::Config {
                durable_name: Some(format!("c{i}")),
                ack_policy: AckPolicy::Explicit,
                ..Default::default()
            })
            .await
            .expect("create consumer");
    }
    for i in 0..3 {
        s.js.publish(format!("{}.m{i}", s.prefix), "x".into())
            .await
            .expect("publish")
            .await
            .expect("stored");
    }
    // One consumer holds two of the three unacknowledged.
    let c7: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer("c7").await.expect("c7");
    let batch = c7.fetch().max_messages(2).messages().await.expect("fetch");
    let held: Vec<_> = batch.collect().await;
    assert_eq!(held.len(), 2);

    let listed = admin::consumer_gauges(&s.js, &s.name)
        .await
        .expect("listing")
        .expect("the stream exists");
    assert_eq!(listed.len(), 300, "every page read");
    assert_eq!(listed["c7"], (1, 2), "pending, unacknowledged");
    assert_eq!(listed["c0"], (3, 0));
    assert_eq!(listed["c299"], (3, 0));
    assert_eq!(
        admin::consumer_gauges(&s.js, "NO_SUCH_STREAM_XYZ").await,
        Ok(None)
    );
    drop(held);
    s.drop_it().await;
}

/// Semantics J3: an ack subject names a consumer only by stream and name, so a settlement of a
/// delivery from a consumer that was deleted and made again under that name would settle the
/// message the new one offers afresh. The runtime refuses it instead: the delivery held while
/// the consumer is made again is refused when its handler acks, and the new consumer offers
/// the message again from attempt 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_of_a_consumer_made_again_is_refused_and_the_message_offered_afresh() {
    let s = Stream::new("again").await;
    // Room for the new consumer's delivery while the old one is held.
    let resource = s.resource(s.policy(|p| p.max_in_flight = Some(4)));
    admin::create_consumer(&s.js, &s.desired(&resource.policy))
        .await
        .unwrap();
    let bus = Bus::builder(NatsBroker::connect(&common::env().nats_url).await.unwrap())
        .namespace("shop")
        .without_reports()
        .build();
    // The first delivery is held until the consumer was made again, then acked; every later
    // one is acked at once. Each records its attempt and what its ack returned.
    let release = Arc::new(tokio::sync::Notify::new());
    let seen: Arc<std::sync::Mutex<Vec<(u32, String)>>> = Arc::default();
    let (hold, record) = (Arc::clone(&release), Arc::clone(&seen));
    let first = Arc::new(AtomicUsize::new(0));
    let calls = Arc::clone(&first);
    let sub = Subscriber::from_resource(
        "orders",
        &resource,
        handler(move |d| {
            let (hold, record, first) =
                (Arc::clone(&hold), Arc::clone(&record), Arc::clone(&calls));
            async move {
                if first.fetch_add(1, Ordering::SeqCst) == 0 {
                    hold.notified().await;
                }
                let attempt = d.attempt();
                let r = d.ack().await;
                record
                    .lock()
                    .expect("the record")
                    .push((attempt, format!("{r:?}")));
                r
            }
        }),
    );
    bus.subscribe(sub).await.expect("bound");
    s.js.publish(format!("{}.a", s.prefix), "x".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while first.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the first delivery never came");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The consumer deleted and made again (as the operator does), the first still held.
    assert!(
        admin::delete_consumer(&s.js, &s.name, "orders")
            .await
            .unwrap()
    );
    admin::create_consumer(&s.js, &s.desired(&resource.policy))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.lock().expect("the record").is_empty() {
        assert!(
            Instant::now() < deadline,
            "the consumer made again never offered the message afresh"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    release.notify_one();
    let deadline = Instant::now() + Duration::from_secs(20);
    while seen.lock().expect("the record").len() < 2 {
        assert!(Instant::now() < deadline, "the held ack never returned");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen = seen.lock().expect("the record").clone();
    assert_eq!(seen[0].0, 1, "offered afresh, from attempt 1: {seen:?}");
    assert!(seen[0].1.starts_with("Ok"), "{seen:?}");
    assert!(
        seen[1].1.contains("deleted and made again"),
        "the held delivery's ack is refused, not sent to the new consumer: {seen:?}"
    );
    bus.close().await;
    s.drop_it().await;
}
