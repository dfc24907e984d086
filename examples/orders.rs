//! A small application on the handler runtime: an `orders` subscription under AtLeastOnce with a
//! backoff, a handler that decodes, acks good orders, nacks malformed ones and asks for a later
//! retry when "throttled"; then prints the account.
//!
//! Runs on the in-memory backend, or on NATS JetStream when SETTLE_NATS_URL is set (it then
//! creates a stream `EXAMPLE_ORDERS` for `example.orders.>` if missing).
//! Run: `cargo run --example orders`.

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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let bus = match std::env::var("SETTLE_NATS_URL") {
        Ok(url) => {
            let backend = NatsBroker::connect(&url).await?;
            let js = backend.jetstream().clone();
            js.get_or_create_stream(async_nats::jetstream::stream::Config {
                name: "EXAMPLE_ORDERS".into(),
                subjects: vec!["example.orders.>".into()],
                ..Default::default()
            })
            .await?;
            Bus::new(backend)
        }
        Err(_) => Bus::new(MemoryBroker::new()),
    };
    bus.subscribe(Subscriber::new(
        "orders",
        policy("example.orders.>"),
        handler(handle),
    ))
    .await?;
    bus.publish("example.orders.1", r#"{"id": 1}"#).await?;
    bus.publish("example.orders.2", r#"{"id": 2, "throttled": true}"#)
        .await?;
    bus.publish("example.orders.3", "not json").await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    bus.close().await;
    let st = bus.stats("orders").unwrap_or_default();
    println!("{}", serde_json::to_string_pretty(&st)?);
    Ok(())
}
