//! The matrix on RabbitMQ: each Subscription its own quorum queue, declared as the runtime's
//! mapping does and filled with `n_each` messages before each round (a round drains it). Bare:
//! lapin consumers, one channel each, `basic.qos` = maxInFlight, up to maxInFlight acks under
//! way at once (the stronger of the two bare loops of `cargo bench --bench rabbitmq`). Settle:
//! `RabbitBroker`.

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use settle::backend::rabbitmq::RabbitBroker;
use settle::backend::rabbitmq::mapping::{self, Exchanges};
use settle::policy::ResolvedPolicy;

use super::{Cell, Harness, Side, Stopwatch, Taken, policy, settle_round};

pub struct Rabbit {
    url: String,
    conn: Connection,
    ch: Channel,
    exchange: String,
}

impl Rabbit {
    pub async fn connect(url: &str) -> Rabbit {
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("connect to RabbitMQ: {e}"));
        let ch = conn.create_channel().await.expect("channel");
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirms");
        let exchange = format!("settle.matrix.{}", std::process::id());
        ch.exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("exchange");
        Rabbit {
            url: url.to_string(),
            conn,
            ch,
            exchange,
        }
    }

    pub async fn close(self) {
        let _ = self
            .ch
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
        let _ = self.conn.close(200, "done".into()).await;
    }

    fn queues(cell: &Cell, side: Side) -> Vec<String> {
        (0..cell.subs).map(|i| cell.name(side, i)).collect()
    }

    /// Publishes `n` messages for `queue` and waits for every confirm.
    async fn fill(&self, cell: &Cell, queue: &str, n: u64) {
        let (key, body) = (format!("{queue}.m"), cell.body());
        let mut confirms = Vec::with_capacity(1000);
        for _ in 0..n {
            confirms.push(
                self.ch
                    .basic_publish(
                        self.exchange.as_str().into(),
                        key.as_str().into(),
                        BasicPublishOptions::default(),
                        &body,
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
}

impl Harness for Rabbit {
    fn pid_file(&self) -> &'static str {
        "rabbitmq.pid"
    }

    fn broker(&self) -> &'static str {
        "RabbitMQ (quorum queues)"
    }

    fn bare(&self) -> &'static str {
        "bare lapin consumers, acks pipelined"
    }

    fn warm_up(&self, cell: &Cell) -> u64 {
        if cell.in_flight == 1 { 1_000 } else { 5_000 }
    }

    fn max_each(&self, cell: &Cell) -> u64 {
        // At most 1 GiB in the queues of one round.
        (1u64 << 30) / cell.payload as u64 / cell.subs as u64
    }

    async fn prepare(&mut self, cell: &Cell, _n_each: u64) {
        for side in [Side::Bare, Side::Settle] {
            for q in Self::queues(cell, side) {
                let want = mapping::desired_by_runtime(
                    "default",
                    &q,
                    &ResolvedPolicy::resolve(&policy(&format!("{q}.>"), &q, cell)),
                    &Exchanges {
                        exchange: self.exchange.clone(),
                        dead_letter: None,
                    },
                );
                self.ch
                    .queue_declare(
                        want.name.as_str().into(),
                        QueueDeclareOptions {
                            durable: true,
                            ..Default::default()
                        },
                        want.arguments_table(),
                    )
                    .await
                    .expect("declare queue");
                self.ch
                    .queue_bind(
                        want.name.as_str().into(),
                        self.exchange.as_str().into(),
                        want.binding.routing_key.as_str().into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .expect("bind queue");
            }
        }
    }

    async fn round(&mut self, cell: &Cell, side: Side, _round: usize, n_each: u64) -> Taken {
        let queues = Self::queues(cell, side);
        for q in &queues {
            self.fill(cell, q, n_each).await;
        }
        match side {
            Side::Bare => {
                let mut channels = Vec::new();
                for q in queues {
                    let ch = self.conn.create_channel().await.expect("channel");
                    ch.basic_qos(cell.in_flight, BasicQosOptions::default())
                        .await
                        .expect("qos");
                    channels.push((ch, q));
                }
                let clock = Stopwatch::start();
                let tasks: Vec<_> = channels
                    .into_iter()
                    .map(|(ch, q)| tokio::spawn(async move { bare(ch, &q, n_each).await }))
                    .collect();
                for t in tasks {
                    t.await.expect("bare consumer");
                }
                clock.stop()
            }
            Side::Settle => {
                let broker = RabbitBroker::connect(&self.url)
                    .await
                    .expect("connect")
                    .with_exchange(&self.exchange);
                let subs = queues.into_iter().map(|q| (format!("{q}.>"), q)).collect();
                settle_round(broker, cell, subs, n_each * cell.subs as u64).await
            }
        }
    }

    async fn finish(&mut self, cell: &Cell) {
        for side in [Side::Bare, Side::Settle] {
            for q in Self::queues(cell, side) {
                let _ = self
                    .ch
                    .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
        }
    }
}

/// Consumes and acks `n` messages from `queue`, up to the prefetch's worth of acks under way.
async fn bare(ch: Channel, queue: &str, n: u64) {
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "matrix-bare".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let (mut acked, mut pending) = (0, FuturesUnordered::new());
    while acked < n {
        tokio::select! {
            Some(r) = pending.next(), if !pending.is_empty() => {
                let r: Result<bool, lapin::Error> = r;
                r.expect("ack");
                acked += 1;
            }
            d = consumer.next() => {
                let d = d.expect("open").expect("delivery");
                super::handicap();
                pending.push(async move { d.ack(BasicAckOptions::default()).await });
            }
        }
    }
    let _ = ch.close(200, "done".into()).await;
}
