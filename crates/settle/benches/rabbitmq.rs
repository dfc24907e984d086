//! Benchmark of the handler runtime on RabbitMQ (figures in the README's Benchmarks section).
//!
//! N messages in a quorum queue, consumed and acked one by one (a) by a bare `lapin` consumer
//! (manual acknowledgement, `basic.qos` 250, `basic.ack` per message), both as lapin's examples
//! write it (each ack awaited before the next delivery) and with up to 250 acks under way (the
//! stronger baseline, which the ratio uses), and (b) by `settle::bus` (AtLeastOnce,
//! maxInFlight 250, the handler acks), each from its own queue with the same arguments on the
//! same broker. The queue is filled before the clock starts. Prints both
//! rates and runtime/bare; alternates the two, three rounds each, and reports the best of each.
//!
//! Uses SETTLE_RABBITMQ_URL (from the environment, or $SETTLE_ENV_DIR/settle.env, default
//! target/env/settle.env): start the environment with `make env-up`. N from SETTLE_BENCH_N
//! (default 20,000). Prints figures; asserts nothing about timing.
//! Run: `cargo bench --bench rabbitmq`.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use settle::api::{DeliveryPolicy, Mode};
use settle::backend::rabbitmq::RabbitBroker;
use settle::backend::rabbitmq::mapping::{self, Exchanges};
use settle::bus::{Bus, Subscriber, handler};
use settle::policy::ResolvedPolicy;
use tokio::sync::Notify;

const IN_FLIGHT: u16 = 250;
const ROUNDS: usize = 3;

fn env_value(key: &str) -> Option<String> {
    if let Ok(v) = std::env::var(key) {
        return Some(v);
    }
    let dir = std::env::var_os("SETTLE_ENV_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| settle_testkit::root().join("target/env"));
    let text = std::fs::read_to_string(dir.join("settle.env")).ok()?;
    text.lines()
        .filter_map(|l| l.strip_prefix("export "))
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.to_string())
}

fn rate(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

fn policy(queue: &str) -> DeliveryPolicy {
    DeliveryPolicy {
        pattern: format!("{queue}.>"),
        mode: Mode::AtLeastOnce,
        durable_name: Some(queue.to_string()),
        max_in_flight: Some(i32::from(IN_FLIGHT)),
        ..DeliveryPolicy::default()
    }
}

/// Declares `queue` exactly as the runtime's mapping does, bound to `exchange` by its pattern.
async fn declare(ch: &Channel, exchange: &str, queue: &str) {
    let want = mapping::desired_by_runtime(
        "default",
        queue,
        &ResolvedPolicy::resolve(&policy(queue)),
        &Exchanges {
            exchange: exchange.to_string(),
            dead_letter: None,
        },
    );
    ch.queue_declare(
        want.name.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        want.arguments_table(),
    )
    .await
    .expect("declare queue");
    ch.queue_bind(
        want.name.as_str().into(),
        exchange.into(),
        want.binding.routing_key.as_str().into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("bind queue");
}

/// Publishes n messages for `queue` and waits for every confirm.
async fn fill(ch: &Channel, exchange: &str, queue: &str, n: u64) {
    let key = format!("{queue}.m");
    let mut confirms = Vec::with_capacity(1000);
    for i in 0..n {
        confirms.push(
            ch.basic_publish(
                exchange.into(),
                key.as_str().into(),
                BasicPublishOptions::default(),
                format!("{i}").as_bytes(),
                BasicProperties::default(),
            )
            .await
            .expect("publish"),
        );
        if confirms.len() == 1000 {
            for c in confirms.drain(..) {
                c.await.expect("confirm");
            }
        }
    }
    for c in confirms {
        c.await.expect("confirm");
    }
}

/// A bare lapin consumer: `pipelined` keeps up to the prefetch's worth of `basic.ack`s under
/// way at once (as a tuned application would); otherwise each ack is awaited before the next
/// delivery is taken (the plain loop of lapin's examples).
async fn bare(conn: &Connection, queue: &str, n: u64, pipelined: bool) -> Duration {
    let ch = conn.create_channel().await.expect("channel");
    ch.basic_qos(IN_FLIGHT, BasicQosOptions::default())
        .await
        .expect("qos");
    let start = Instant::now();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "bench-bare".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let mut acked = 0;
    if pipelined {
        let mut pending = FuturesUnordered::new();
        while acked < n {
            tokio::select! {
                Some(r) = pending.next(), if !pending.is_empty() => {
                    let r: Result<bool, lapin::Error> = r;
                    r.expect("ack");
                    acked += 1;
                }
                d = consumer.next() => {
                    let d = d.expect("open").expect("delivery");
                    pending.push(async move { d.ack(BasicAckOptions::default()).await });
                }
            }
        }
    } else {
        while acked < n {
            let d = consumer.next().await.expect("open").expect("delivery");
            d.ack(BasicAckOptions::default()).await.expect("ack");
            acked += 1;
        }
    }
    let took = start.elapsed();
    let _ = ch.close(200, "done".into()).await;
    took
}

async fn runtime(url: &str, exchange: &str, queue: &str, n: u64) -> Duration {
    let backend = RabbitBroker::connect(url)
        .await
        .expect("connect")
        .with_exchange(exchange);
    let bus = Bus::builder(backend).without_reports().build();
    let acked = Arc::new(AtomicU64::new(0));
    let done = Arc::new(Notify::new());
    let (a, d) = (acked.clone(), done.clone());
    let start = Instant::now();
    bus.subscribe(Subscriber::new(
        queue,
        policy(queue),
        handler(move |m| {
            let (a, d) = (a.clone(), d.clone());
            async move {
                m.ack().await?;
                if a.fetch_add(1, Ordering::Relaxed) + 1 == n {
                    d.notify_one();
                }
                Ok::<(), settle::bus::HandlerError>(())
            }
        }),
    ))
    .await
    .expect("subscribe");
    done.notified().await;
    let took = start.elapsed();
    bus.close().await;
    took
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let url = env_value("SETTLE_RABBITMQ_URL").unwrap_or_else(|| {
        panic!("SETTLE_RABBITMQ_URL is not set: start the environment with `make env-up`")
    });
    let n: u64 = std::env::var("SETTLE_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("connect to RabbitMQ: {e}"));
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let exchange = format!("settle.bench.{}", std::process::id());
    ch.exchange_declare(
        exchange.as_str().into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("exchange");
    let (bare_q, runtime_q) = (
        format!("bench-bare-{}", std::process::id()),
        format!("bench-runtime-{}", std::process::id()),
    );
    declare(&ch, &exchange, &bare_q).await;
    declare(&ch, &exchange, &runtime_q).await;

    println!(
        "RabbitMQ: {n} messages in a quorum queue, consumed with manual acknowledgement, prefetch {IN_FLIGHT}"
    );
    let (mut best_plain, mut best_bare, mut best_rt) = (0f64, 0f64, 0f64);
    for round in 1..=ROUNDS {
        fill(&ch, &exchange, &bare_q, n).await;
        let plain = rate(n, bare(&conn, &bare_q, n, false).await);
        fill(&ch, &exchange, &bare_q, n).await;
        let b = rate(n, bare(&conn, &bare_q, n, true).await);
        fill(&ch, &exchange, &runtime_q, n).await;
        let r = rate(n, runtime(&url, &exchange, &runtime_q, n).await);
        best_plain = best_plain.max(plain);
        best_bare = best_bare.max(b);
        best_rt = best_rt.max(r);
        println!(
            "  round {round}: bare lapin, each ack awaited {plain:>8.0} msg/s   bare lapin, acks pipelined {b:>8.0} msg/s   settle::bus {r:>8.0} msg/s   ratio bus/pipelined {:.2}",
            r / b
        );
    }
    println!(
        "best of each: bare lapin (each ack awaited) {best_plain:.0} msg/s, bare lapin (acks pipelined) {best_bare:.0} msg/s, settle::bus {best_rt:.0} msg/s"
    );
    println!(
        "ratio settle::bus / bare lapin (pipelined) = {:.2} (goal >= 0.9); / bare lapin (each ack awaited) = {:.2}",
        best_rt / best_bare,
        best_rt / best_plain
    );
    for q in [&bare_q, &runtime_q] {
        let _ = ch
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = ch
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    let _ = conn.close(200, "done".into()).await;
}
