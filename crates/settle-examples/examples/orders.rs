//! A small application on the handler runtime: an `orders` subscription under AtLeastOnce with a
//! backoff, a handler that decodes, acks good orders, nacks malformed ones and asks for a later
//! retry when "throttled"; then prints the account.
//!
//! Three ways to run it:
//! - `cargo run --example orders`: on the in-memory backend.
//! - with `SETTLE_NATS_URL`: on NATS JetStream, a code-defined subscription that makes its own
//!   consumer (and a stream `EXAMPLE_ORDERS` for `example.orders.>` if missing).
//! - with `SETTLE_NATS_URL` and `SETTLE_SUBSCRIPTION_FILE` (a Subscription manifest with its
//!   namespace, as applied to the cluster): the policy comes from the resource, and the runtime
//!   binds to the consumer `settle operator` made for it (waiting until it exists, never making
//!   one). It publishes three orders under the resource's pattern.
//!
//! `SETTLE_RUN_FOR` (a duration such as `2s` or `1m`; default 2s) is how long it consumes before
//! it prints the account.

use std::time::Duration;

use settle::api::{self, Backoff, DeliveryPolicy, Mode};
use settle::backend::memory::MemoryBroker;
use settle::backend::nats::NatsBroker;
use settle::bus::{Bus, Delivery, HandlerError, Subscriber, handler};

#[derive(serde::Deserialize)]
struct Order {
    id: u32,
    throttled: Option<bool>,
}

async fn handle(d: Delivery) -> Result<(), HandlerError> {
    let order: Order = match d.decode() {
        Ok(o) => o,
        Err(e) => {
            d.nack().await?; // malformed: decline it (comes back until maxDeliver, then Exhausted)
            return Err(e.into()); // the error is counted and logged; it does not settle
        }
    };
    if order.throttled == Some(true) && d.attempt() == 1 {
        return Ok(d.nack_after(Duration::from_millis(300)).await?);
    }
    println!("order {} processed on attempt {}", order.id, d.attempt());
    Ok(d.ack().await?)
}

fn policy(pattern: &str) -> DeliveryPolicy {
    DeliveryPolicy {
        pattern: pattern.into(),
        mode: Mode::AtLeastOnce,
        durable_name: Some("example-orders".into()),
        max_deliver: Some(3),
        backoff: Some(Backoff {
            initial: api::Duration::from_millis(100),
            max: api::Duration::from_secs(1),
            multiplier: 2.0,
        }),
        max_nack_delay: Some(api::Duration::from_secs(10)),
        ..DeliveryPolicy::default()
    }
}

/// The Subscription resource named by SETTLE_SUBSCRIPTION_FILE, if any.
fn resource() -> Result<Option<api::Subscription>, Box<dyn std::error::Error>> {
    let Ok(path) = std::env::var("SETTLE_SUBSCRIPTION_FILE") else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    let sub: api::Subscription = serde_yaml::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
    Ok(Some(sub))
}

/// A subject the pattern covers, for order `id` (`orders.>` gives `orders.<id>`).
fn subject(pattern: &str, id: u32) -> String {
    let base = pattern.trim_end_matches(".>").trim_end_matches(".*");
    format!("{base}.{id}")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let run_for: api::Duration = std::env::var("SETTLE_RUN_FOR")
        .unwrap_or_else(|_| "2s".into())
        .parse()?;
    let (bus, name, pattern) = match (std::env::var("SETTLE_NATS_URL"), resource()?) {
        (Ok(url), Some(sub)) => {
            let name = sub
                .metadata
                .name
                .clone()
                .ok_or("the manifest has no metadata.name")?;
            let ns = sub
                .metadata
                .namespace
                .clone()
                .ok_or("the manifest has no metadata.namespace")?;
            let bus = Bus::builder(NatsBroker::connect(&url).await?)
                .namespace(ns)
                .build();
            println!("binding to the operator's consumer for Subscription {name}");
            let pattern = sub.spec.policy.pattern.clone();
            bus.subscribe(Subscriber::from_resource(&name, &sub.spec, handler(handle)))
                .await?;
            (bus, name, pattern)
        }
        (Ok(url), None) => {
            let backend = NatsBroker::connect(&url).await?;
            let js = backend.jetstream().clone();
            js.get_or_create_stream(async_nats::jetstream::stream::Config {
                name: "EXAMPLE_ORDERS".into(),
                subjects: vec!["example.orders.>".into()],
                ..Default::default()
            })
            .await?;
            let bus = Bus::new(backend);
            bus.subscribe(Subscriber::new(
                "orders",
                policy("example.orders.>"),
                handler(handle),
            ))
            .await?;
            (bus, "orders".to_string(), "example.orders.>".to_string())
        }
        (Err(_), _) => {
            let bus = Bus::new(MemoryBroker::new());
            bus.subscribe(Subscriber::new(
                "orders",
                policy("example.orders.>"),
                handler(handle),
            ))
            .await?;
            (bus, "orders".to_string(), "example.orders.>".to_string())
        }
    };
    bus.publish(&subject(&pattern, 1), r#"{"id": 1}"#).await?;
    bus.publish(&subject(&pattern, 2), r#"{"id": 2, "throttled": true}"#)
        .await?;
    bus.publish(&subject(&pattern, 3), "not json").await?;
    // Run for a while, or until asked to stop (a pod's SIGTERM): then close gracefully, so
    // handlers in flight finish and the last counts reach the operator.
    tokio::select! {
        _ = tokio::time::sleep(run_for.get()) => {}
        _ = settle::bus::stop_signal() => {}
    }
    bus.close().await;
    let st = bus.stats(&name).unwrap_or_default();
    println!("{}", serde_json::to_string_pretty(&st)?);
    Ok(())
}
