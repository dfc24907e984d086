//! Benchmark of the handler runtime (figures in the README's Benchmarks section).
//!
//! 1. JetStream: N messages in one stream, consumed and acked one by one (a) by a bare async-nats
//!    pull consumer and (b) by `settle::bus` (AtLeastOnce, handler acks), each with its own
//!    durable consumer on the same server, same max ack pending (250). Prints both rates and
//!    runtime/bare. Alternates the two, three rounds each, and reports the best of each.
//! 2. Memory: the settle path alone (`settle(Ack)` on deliveries already handed out), the seam
//!    (`next` + `settle`), and the whole bus (publish → handler → ack), in ns per message.
//!
//! 3. `-- matrix [nats|rabbitmq|sqs]...` instead: the runtime against each broker's bare client
//!    as a matrix (payload × maxInFlight × Subscriptions; the scenario is `matrix`'s), each
//!    broker named or all three. SETTLE_MATRIX_ONLY keeps the cells whose label contains it
//!    (e.g. "64 KiB"), SETTLE_MATRIX_ROUNDS sets the rounds (default 5), and
//!    SETTLE_MATRIX_CALIBRATE=1 runs the bare client in both columns (an A/A run: the spread two
//!    identical sides show here); with SETTLE_MATRIX_CALIBRATE_SPIN_US=N the second column's
//!    loop spends N µs of CPU a message more (what extra client work alone costs a ratio).
//!
//! Uses SETTLE_NATS_URL (from the environment or $SETTLE_ENV_DIR/settle.env, default
//! target/env/settle.env), or starts its own nats-server from SETTLE_NATS_SERVER on a free
//! 127.0.0.1 port; the matrix also SETTLE_RABBITMQ_URL and SETTLE_SQS_ENDPOINT (`make env-up`).
//! N from SETTLE_BENCH_N (default 50,000). Prints figures; asserts nothing about timing.
//! Run: `cargo bench --bench runtime`, `cargo bench --bench runtime -- matrix nats`.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::AckPolicy, consumer::pull};
use futures::StreamExt;
use settle::api::{DeliveryPolicy, Mode};
use settle::backend::memory::MemoryBroker;
use settle::backend::nats::NatsBroker;
use settle::bus::{self, Broker, Bus, Decision, Subscriber, SubscriptionCtx, handler};
use tokio::sync::Notify;

mod matrix;
use matrix::env_value;
#[allow(dead_code)]
use settle_testkit::measure;

const IN_FLIGHT: i64 = 250;
const ROUNDS: usize = 3;

/// A nats-server this benchmark started (and its store, removed with it); killed on drop.
struct OwnServer {
    child: Child,
    _store: tempfile::TempDir,
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn server() -> (String, Option<OwnServer>) {
    if let Some(url) = env_value("SETTLE_NATS_URL")
        && async_nats::connect(&url).await.is_ok()
    {
        return (url, None);
    }
    let bin = env_value("SETTLE_NATS_SERVER")
        .unwrap_or_else(|| panic!("neither a reachable SETTLE_NATS_URL nor SETTLE_NATS_SERVER: start the environment with `make env-up`"));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let dir = tempfile::tempdir().expect("a temp dir");
    let own = OwnServer {
        child: Command::new(&bin)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {bin}: {e}")),
        _store: dir,
    };
    let url = format!("nats://127.0.0.1:{port}");
    for _ in 0..100 {
        if async_nats::connect(&url).await.is_ok() {
            return (url, Some(own));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("nats-server at {url} did not come up");
}

fn rate(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

async fn bare(
    js: &jetstream::Context,
    stream: &str,
    subject: &str,
    durable: &str,
    n: u64,
) -> Duration {
    let stream = js.get_stream(stream).await.expect("stream");
    let consumer: jetstream::consumer::PullConsumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(durable.into()),
            ack_policy: AckPolicy::Explicit,
            filter_subject: subject.into(),
            max_ack_pending: IN_FLIGHT,
            ..Default::default()
        })
        .await
        .expect("consumer");
    let start = Instant::now();
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(IN_FLIGHT as usize)
        .messages()
        .await
        .expect("messages");
    let mut got = 0;
    while got < n {
        let m = messages
            .next()
            .await
            .expect("stream open")
            .expect("message");
        m.ack().await.expect("ack");
        got += 1;
    }
    start.elapsed()
}

async fn runtime(url: &str, subject: &str, durable: &str, n: u64) -> Duration {
    let backend = NatsBroker::connect(url).await.expect("connect");
    let client = backend.client().clone();
    let bus = Bus::builder(backend).without_reports().build();
    let acked = Arc::new(AtomicU64::new(0));
    let done = Arc::new(Notify::new());
    let (a, d) = (acked.clone(), done.clone());
    let policy = DeliveryPolicy {
        pattern: subject.into(),
        mode: Mode::AtLeastOnce,
        durable_name: Some(durable.into()),
        max_in_flight: Some(IN_FLIGHT as i32),
        ..DeliveryPolicy::default()
    };
    let start = Instant::now();
    bus.subscribe(Subscriber::new(
        durable,
        policy,
        handler(move |del| {
            let (a, d) = (a.clone(), d.clone());
            async move {
                del.ack().await?;
                if a.fetch_add(1, Ordering::Relaxed) + 1 == n {
                    d.notify_one();
                }
                Ok::<_, bus::HandlerError>(())
            }
        }),
    ))
    .await
    .expect("subscribe");
    done.notified().await;
    let elapsed = start.elapsed();
    client.flush().await.expect("flush");
    bus.close().await;
    elapsed
}

async fn jetstream_bench(n: u64) {
    let (url, _own) = server().await;
    let client = async_nats::connect(&url).await.expect("connect");
    let js = jetstream::new(client.clone());
    let tag = format!("{}", std::process::id());
    let stream = format!("BENCH_RUNTIME_{tag}");
    let subject = format!("bench.runtime.{tag}");
    let _ = js.delete_stream(&stream).await;
    js.create_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
        storage: jetstream::stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .expect("stream");
    let payload = bytes::Bytes::from(vec![b'x'; 128]);
    let mut acks = Vec::with_capacity(1000);
    for _ in 0..n {
        acks.push(
            js.publish(subject.clone(), payload.clone())
                .await
                .expect("publish"),
        );
        if acks.len() == 1000 {
            for a in acks.drain(..) {
                a.await.expect("publish ack");
            }
        }
    }
    for a in acks.drain(..) {
        a.await.expect("publish ack");
    }
    println!(
        "JetStream: {n} messages of 128 bytes in stream {stream} on {url}; max ack pending {IN_FLIGHT}; ack every message"
    );
    let (mut best_bare, mut best_rt) = (0f64, 0f64);
    for round in 0..ROUNDS {
        let b = bare(&js, &stream, &subject, &format!("bare{round}"), n).await;
        let r = runtime(&url, &subject, &format!("runtime{round}"), n).await;
        let (rb, rr) = (rate(n, b), rate(n, r));
        println!(
            "  round {}: bare async-nats {:>9.0} msg/s ({:?})   settle::bus {:>9.0} msg/s ({:?})   ratio {:.2}",
            round + 1,
            rb,
            b,
            rr,
            r,
            rr / rb
        );
        best_bare = best_bare.max(rb);
        best_rt = best_rt.max(rr);
    }
    println!(
        "  best: bare {best_bare:.0} msg/s, runtime {best_rt:.0} msg/s, runtime/bare = {:.2}",
        best_rt / best_bare
    );
    let _ = js.delete_stream(&stream).await;
}

async fn memory_bench(n: u64) {
    println!("Memory backend: {n} messages");
    let policy = DeliveryPolicy {
        pattern: "m.>".into(),
        mode: Mode::AtLeastOnce,
        durable_name: Some("m".into()),
        ..DeliveryPolicy::default()
    };

    // The settle path alone: deliveries already handed out, then settle(Ack) on each.
    let mem = MemoryBroker::new();
    let ctx = SubscriptionCtx::new("m", &policy);
    let mut c = mem.open(ctx.clone()).await.expect("open");
    for _ in 0..n {
        mem.publish("m.1".into(), vec![], bytes::Bytes::from_static(b"x"))
            .await
            .expect("publish");
    }
    let mut ds = Vec::with_capacity(n as usize);
    let start = Instant::now();
    for _ in 0..n {
        ds.push(c.next().await.expect("delivery"));
    }
    let take = start.elapsed();
    let start = Instant::now();
    for d in &ds {
        bus::settle(d, Decision::Ack).await.expect("settle");
    }
    let settle_only = start.elapsed();
    // A second settlement of each (the AlreadySettled refusal): the cost of the guard itself.
    let start = Instant::now();
    for d in &ds {
        let _ = bus::settle(d, Decision::Ack).await;
    }
    let refused = start.elapsed();
    let per = |d: Duration| d.as_nanos() as f64 / n as f64;
    println!(
        "  settle(Ack) on a handed-out delivery:      {:>8.0} ns/msg",
        per(settle_only)
    );
    println!(
        "  second settle (AlreadySettled guard):      {:>8.0} ns/msg",
        per(refused)
    );
    println!(
        "  consumer.next() incl. Delivery::new:       {:>8.0} ns/msg",
        per(take)
    );

    // The whole bus: publish, handler, ack.
    let mem = MemoryBroker::new();
    let b = Bus::builder(mem.clone()).without_reports().build();
    let acked = Arc::new(AtomicU64::new(0));
    let done = Arc::new(Notify::new());
    let (a, dn) = (acked.clone(), done.clone());
    b.subscribe(Subscriber::new(
        "m",
        policy.clone(),
        handler(move |d| {
            let (a, dn) = (a.clone(), dn.clone());
            async move {
                d.ack().await?;
                if a.fetch_add(1, Ordering::Relaxed) + 1 == n {
                    dn.notify_one();
                }
                Ok::<_, bus::HandlerError>(())
            }
        }),
    ))
    .await
    .expect("subscribe");
    let start = Instant::now();
    for _ in 0..n {
        b.publish("m.1", bytes::Bytes::from_static(b"x"))
            .await
            .expect("publish");
    }
    done.notified().await;
    let whole = start.elapsed();
    b.close().await;
    println!(
        "  bus end to end (publish→handler→ack):      {:>8.0} ns/msg ({:.0} msg/s)",
        per(whole),
        rate(n, whole)
    );
}

async fn matrix_bench(brokers: &[String]) {
    let all = brokers.is_empty();
    let wants = |b: &str| all || brokers.iter().any(|x| x == b);
    if wants("nats") {
        let (url, _own) = server().await;
        matrix::run(&mut matrix::nats::Nats::connect(&url).await).await;
    }
    if wants("rabbitmq") {
        let url = env_value("SETTLE_RABBITMQ_URL").unwrap_or_else(|| {
            panic!("SETTLE_RABBITMQ_URL is not set: start the environment with `make env-up`")
        });
        let mut rabbit = matrix::rabbitmq::Rabbit::connect(&url).await;
        matrix::run(&mut rabbit).await;
        rabbit.close().await;
    }
    #[cfg(feature = "sqs")]
    if wants("sqs") {
        let endpoint = env_value("SETTLE_SQS_ENDPOINT").unwrap_or_else(|| {
            panic!("SETTLE_SQS_ENDPOINT is not set: start the environment with `make env-up`")
        });
        matrix::run(&mut matrix::sqs::Sqs::connect(&endpoint).await).await;
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let n: u64 = std::env::var("SETTLE_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        if args.first().is_some_and(|a| a == "matrix") {
            matrix_bench(&args[1..]).await;
        } else {
            jetstream_bench(n).await;
            memory_bench(n).await;
        }
    });
}
