//! The matrix on JetStream: one memory stream per cell holding `n_each` messages; each
//! Subscription is a durable consumer of the whole stream, made anew each round (so a round
//! replays the stream instead of refilling it). Bare: async-nats pull consumers
//! (`max_ack_pending` = maxInFlight, the pull batch the same but at least `MIN_PULL_BATCH`, as
//! the runtime's: smaller pulls stall now and then; the pull's bytes bounded as the
//! runtime's, semantics J11; each message acked). Settle: `NatsBroker`.

use async_nats::jetstream::{self, consumer::AckPolicy, consumer::pull};
use futures::StreamExt;
use settle::backend::nats::{MIN_PULL_BATCH, NatsBroker};

use super::{Cell, Harness, Side, Stopwatch, Taken, settle_round};

pub struct Nats {
    url: String,
    js: jetstream::Context,
    /// The runtime's bound on a pull's bytes, which the bare consumers use too.
    pull_bytes: usize,
}

impl Nats {
    pub async fn connect(url: &str) -> Nats {
        let client = async_nats::connect(url)
            .await
            .unwrap_or_else(|e| panic!("connect to NATS at {url}: {e}"));
        Nats {
            url: url.to_string(),
            pull_bytes: NatsBroker::from_client(client.clone()).pull_bytes(),
            js: jetstream::new(client),
        }
    }

    fn stream(cell: &Cell) -> String {
        cell.name(Side::Bare, 0).replace('-', "_").to_uppercase()
    }

    fn subject(cell: &Cell) -> String {
        format!("mx.{}", Self::stream(cell).to_lowercase())
    }
}

impl Harness for Nats {
    fn pid_file(&self) -> &'static str {
        "nats.pid"
    }

    fn broker(&self) -> &'static str {
        "JetStream"
    }

    fn bare(&self) -> &'static str {
        "bare async-nats pull consumers"
    }

    fn warm_up(&self, cell: &Cell) -> u64 {
        if cell.in_flight == 1 { 2_000 } else { 20_000 }
    }

    fn max_each(&self, cell: &Cell) -> u64 {
        // At most 2 GiB in the (memory) stream.
        (2u64 << 30) / cell.payload as u64
    }

    async fn prepare(&mut self, cell: &Cell, n_each: u64) {
        let (stream, subject) = (Self::stream(cell), Self::subject(cell));
        let _ = self.js.delete_stream(&stream).await;
        self.js
            .create_stream(jetstream::stream::Config {
                name: stream.clone(),
                subjects: vec![subject.clone()],
                storage: jetstream::stream::StorageType::Memory,
                ..Default::default()
            })
            .await
            .expect("stream");
        let body = cell.body();
        let mut acks = Vec::with_capacity(1000);
        for _ in 0..n_each {
            acks.push(
                self.js
                    .publish(subject.clone(), body.clone())
                    .await
                    .expect("publish"),
            );
            if acks.len() == 1000 {
                for a in acks.drain(..) {
                    a.await.expect("publish ack");
                }
            }
        }
        for a in acks {
            a.await.expect("publish ack");
        }
    }

    async fn round(&mut self, cell: &Cell, side: Side, round: usize, n_each: u64) -> Taken {
        let names: Vec<String> = (0..cell.subs)
            .map(|i| cell.name(side, round * 100 + i))
            .collect();
        let subject = Self::subject(cell);
        match side {
            Side::Bare => {
                let stream = self
                    .js
                    .get_stream(Self::stream(cell))
                    .await
                    .expect("stream");
                let clock = Stopwatch::start();
                let tasks: Vec<_> = names
                    .into_iter()
                    .map(|durable| {
                        let (stream, subject, cell) = (stream.clone(), subject.clone(), *cell);
                        let pull_bytes = self.pull_bytes;
                        tokio::spawn(async move {
                            bare(&stream, &subject, &durable, &cell, pull_bytes, n_each).await
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.expect("bare consumer");
                }
                clock.stop()
            }
            Side::Settle => {
                let broker = NatsBroker::connect(&self.url).await.expect("connect");
                let client = broker.client().clone();
                let subs = names.into_iter().map(|d| (subject.clone(), d)).collect();
                let took = settle_round(broker, cell, subs, n_each * cell.subs as u64).await;
                client.flush().await.expect("flush");
                took
            }
        }
    }

    async fn finish(&mut self, cell: &Cell) {
        let _ = self.js.delete_stream(Self::stream(cell)).await;
    }
}

async fn bare(
    stream: &jetstream::stream::Stream,
    subject: &str,
    durable: &str,
    cell: &Cell,
    pull_bytes: usize,
    n: u64,
) {
    let consumer: jetstream::consumer::PullConsumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(durable.into()),
            ack_policy: AckPolicy::Explicit,
            filter_subject: subject.into(),
            max_ack_pending: i64::from(cell.in_flight),
            ..Default::default()
        })
        .await
        .expect("consumer");
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(usize::from(cell.in_flight).max(MIN_PULL_BATCH))
        .max_bytes_per_batch(pull_bytes)
        .messages()
        .await
        .expect("messages");
    for _ in 0..n {
        let m = messages
            .next()
            .await
            .expect("stream open")
            .expect("message");
        super::handicap();
        m.ack().await.expect("ack");
    }
}
