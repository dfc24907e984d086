//! The conformance suite (docs/semantics.md T1–T6): holds any AtLeastOnce backend to its rows,
//! driving it at the seam with no bus above it, completing each exchange with [`settle`] /
//! [`settle_with`] (the same path the bus uses).
//!
//! Rows: redelivery with an increasing attempt; MaxDeliver and Exhausted; per-message
//! acknowledgement; a refused settlement after retirement (refused by the backend's own
//! bookkeeping, then still owed by the broker to a new consumer); and, on a backend declaring
//! `delaysRedelivery`, a declined message waiting out its delay, never early. It must not use
//! any backend-specific call: what it cannot see through `Broker`/`Consumer` it does not judge.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::api::{self, DeliveryPolicy, Mode};

use super::{
    Broker, Consumer, Decision, Delivery, SettleError, SubscriptionCtx, settle, settle_with,
};

/// How long a row waits for a delivery it expects.
const EXPECT: Duration = Duration::from_secs(10);
/// How long a row watches for a delivery that must not come.
const QUIET: Duration = Duration::from_millis(700);
/// The delay of the delay row.
const DELAY: Duration = Duration::from_millis(600);

/// A row that did not hold.
#[derive(Debug, thiserror::Error)]
#[error("conformance row {row:?} failed: {what}")]
pub struct Failure {
    pub row: &'static str,
    pub what: String,
}

/// The rows, by name, as `run` reports them.
pub const ROWS: [&str; 5] = [
    "redelivery with an increasing attempt",
    "MaxDeliver and Exhausted",
    "per-message acknowledgement",
    "refused settlement after retirement",
    "a declined message waits out its delay",
];

/// Runs every row that applies to `backend`. Subjects are `<subject_prefix>.<row>.<run>`; the
/// backend must carry them (for JetStream, a stream whose subjects cover `<subject_prefix>.>`).
/// On a backend whose subjects name queues (SQS), a row's subject is its durable name,
/// `conformance-<row>-<run>`, and `subject_prefix` is not used.
/// Returns the rows that ran.
pub async fn run(backend: &dyn Broker, subject_prefix: &str) -> Result<Vec<&'static str>, Failure> {
    let run_id = format!(
        "{}{}",
        std::process::id(),
        super::report::now_ms() % 1_000_000_000
    );
    let mut ran = vec![
        redelivery(backend, subject_prefix, &run_id).await?,
        max_deliver(backend, subject_prefix, &run_id).await?,
        per_message(backend, subject_prefix, &run_id).await?,
        retirement(backend, subject_prefix, &run_id).await?,
    ];
    if backend.capabilities().delays_redelivery {
        ran.push(delay(backend, subject_prefix, &run_id).await?);
    }
    Ok(ran)
}

struct Row {
    name: &'static str,
    ctx: Arc<SubscriptionCtx>,
    consumer: Box<dyn Consumer>,
    subject: String,
    policy: DeliveryPolicy,
}

impl Row {
    async fn open(
        backend: &dyn Broker,
        name: &'static str,
        prefix: &str,
        run_id: &str,
        tag: &str,
        tune: impl FnOnce(&mut DeliveryPolicy),
    ) -> Result<Row, Failure> {
        let durable = format!("conformance-{tag}-{run_id}");
        // Where a subject names a queue (SQS), the subscription's pattern is its queue's name.
        let subject = if backend.capabilities().subject_names_queue {
            durable.clone()
        } else {
            format!("{prefix}.{tag}.{run_id}")
        };
        let mut policy = DeliveryPolicy {
            pattern: subject.clone(),
            mode: Mode::AtLeastOnce,
            durable_name: Some(durable),
            max_deliver: Some(10),
            ack_wait: Some(api::Duration::from_secs(30)),
            ..DeliveryPolicy::default()
        };
        tune(&mut policy);
        let verdict = crate::policy::validate_policy(&policy, &backend.capabilities());
        if !verdict.allowed() {
            return Err(Failure {
                row: name,
                what: format!("the row's own policy was refused: {}", verdict.error_text()),
            });
        }
        let ctx = SubscriptionCtx::new(format!("conformance-{tag}"), &policy);
        let kept = policy.clone();
        let consumer = backend.open(Arc::clone(&ctx)).await.map_err(|e| Failure {
            row: name,
            what: format!("open: {e}"),
        })?;
        Ok(Row {
            name,
            ctx,
            consumer,
            subject,
            policy: kept,
        })
    }

    fn fail(&self, what: impl Into<String>) -> Failure {
        Failure {
            row: self.name,
            what: what.into(),
        }
    }

    async fn publish(&self, backend: &dyn Broker, body: &str) -> Result<(), Failure> {
        backend
            .publish(
                self.subject.clone(),
                Vec::new(),
                Bytes::from(body.to_string()),
            )
            .await
            .map_err(|e| self.fail(format!("publish: {e}")))
    }

    async fn expect(&mut self, what: &str) -> Result<Delivery, Failure> {
        match tokio::time::timeout(EXPECT, self.consumer.next()).await {
            Ok(Some(d)) => Ok(d),
            Ok(None) => Err(self.fail(format!("the consumer ended while waiting for {what}"))),
            Err(_) => Err(self.fail(format!(
                "nothing arrived within {EXPECT:?} while waiting for {what}"
            ))),
        }
    }

    async fn expect_none(&mut self, what: &str) -> Result<(), Failure> {
        match tokio::time::timeout(QUIET, self.consumer.next()).await {
            Ok(Some(d)) => Err(self.fail(format!(
                "{what}, but {:?} (attempt {}) arrived",
                String::from_utf8_lossy(d.payload()),
                d.attempt()
            ))),
            Ok(None) | Err(_) => Ok(()),
        }
    }

    async fn settle(&self, d: &Delivery, how: Decision) -> Result<(), Failure> {
        settle(d, how)
            .await
            .map_err(|e| self.fail(format!("settle {how:?}: {e}")))
    }

    async fn done(mut self) {
        self.consumer.retire().await;
    }
}

/// Semantics T1: a declined message comes back each time with a higher attempt; once acked, it
/// stays away.
async fn redelivery(b: &dyn Broker, prefix: &str, run_id: &str) -> Result<&'static str, Failure> {
    let mut row = Row::open(b, ROWS[0], prefix, run_id, "redelivery", |_| {}).await?;
    row.publish(b, "m").await?;
    let mut last = 0;
    for (i, how) in [Decision::Nack, Decision::Silent, Decision::Ack]
        .into_iter()
        .enumerate()
    {
        let d = row.expect(&format!("attempt {}", i + 1)).await?;
        if d.attempt() <= last {
            return Err(row.fail(format!(
                "attempt {} after attempt {last}: a redelivery must arrive with a higher attempt",
                d.attempt()
            )));
        }
        last = d.attempt();
        row.settle(&d, how).await?;
    }
    row.expect_none("an acked message must not come back")
        .await?;
    row.done().await;
    Ok(row_name(0))
}

/// Semantics T2: declined on its last attempt, a message is counted Exhausted once and stays away.
async fn max_deliver(b: &dyn Broker, prefix: &str, run_id: &str) -> Result<&'static str, Failure> {
    let mut row = Row::open(b, ROWS[1], prefix, run_id, "maxdeliver", |p| {
        p.max_deliver = Some(2)
    })
    .await?;
    row.publish(b, "m").await?;
    for attempt in 1..=2 {
        let d = row.expect(&format!("attempt {attempt} of 2")).await?;
        if d.attempt() != attempt {
            return Err(row.fail(format!("expected attempt {attempt}, got {}", d.attempt())));
        }
        row.settle(&d, Decision::Nack).await?;
    }
    let exhausted = row.ctx.stats().exhausted;
    if exhausted != 1 {
        return Err(row.fail(format!(
            "declined on its last attempt: Exhausted should be 1, is {exhausted}"
        )));
    }
    row.expect_none("a message past MaxDeliver must not come back")
        .await?;
    row.done().await;
    Ok(row_name(1))
}

/// Semantics T3: each message is settled on its own: acking one neither acks nor declines another.
async fn per_message(b: &dyn Broker, prefix: &str, run_id: &str) -> Result<&'static str, Failure> {
    let mut row = Row::open(b, ROWS[2], prefix, run_id, "permessage", |_| {}).await?;
    for body in ["a", "b", "c"] {
        row.publish(b, body).await?;
    }
    let mut got = Vec::new();
    for i in 0..3 {
        got.push(row.expect(&format!("message {} of 3", i + 1)).await?);
    }
    for d in &got {
        let how = if d.payload().as_ref() == b"b" {
            Decision::Ack
        } else {
            Decision::Nack
        };
        row.settle(d, how).await?;
    }
    let mut back = Vec::new();
    for _ in 0..2 {
        let d = row.expect("a nacked message back").await?;
        back.push(String::from_utf8_lossy(d.payload()).into_owned());
        row.settle(&d, Decision::Ack).await?;
    }
    back.sort();
    if back != ["a", "c"] {
        return Err(row.fail(format!("expected a and c back (b was acked), got {back:?}")));
    }
    row.expect_none("acked messages must not come back").await?;
    row.done().await;
    Ok(row_name(2))
}

/// Semantics T4: a settlement the backend cannot perform, because the consumer was retired, is Refused (and
/// still counts as the settlement it was), and the message is not lost by it: the broker still
/// owes it, and a new consumer of the same durable gets it again as a later attempt.
///
/// What decides the refusal is the backend's own bookkeeping: on JetStream a flag `retire` sets
/// in this process (the server would have taken the nack; nothing is sent). The broker's part
/// is the second half: the message it was never told about comes back after ackWait. (The
/// server itself refusing a settlement, once the consumer is deleted, is a NATS test of its
/// own, `a_nack_the_broker_cannot_act_on_is_refused_and_stranded`, outside this suite.)
async fn retirement(b: &dyn Broker, prefix: &str, run_id: &str) -> Result<&'static str, Failure> {
    let mut row = Row::open(b, ROWS[3], prefix, run_id, "retirement", |p| {
        // The broker hands an unsettled message on after ackWait: keep the wait short.
        p.ack_wait = Some(api::Duration(Duration::from_secs(2)))
    })
    .await?;
    row.publish(b, "m").await?;
    let d = row.expect("the message").await?;
    row.consumer.retire().await;
    match settle(&d, Decision::Nack).await {
        Err(SettleError::Refused(_)) => {}
        other => {
            return Err(row.fail(format!(
                "a nack after retirement should be refused, got {other:?}"
            )));
        }
    }
    let st = row.ctx.stats();
    if st.settlement.refused != 1 || st.settlement.nacked != 1 {
        return Err(row.fail(format!(
            "a refused nack moves Nacked and Refused: nacked {}, refused {}",
            st.settlement.nacked, st.settlement.refused
        )));
    }
    // The broker's part: the message is still owed.
    let again_ctx = SubscriptionCtx::new("conformance-retirement-again", &row.policy);
    row.consumer = b
        .open(Arc::clone(&again_ctx))
        .await
        .map_err(|e| row.fail(format!("open a new consumer of the same durable: {e}")))?;
    row.ctx = again_ctx;
    let again = row
        .expect("the message whose nack was refused, on a new consumer")
        .await?;
    if again.attempt() <= d.attempt() {
        return Err(row.fail(format!(
            "the message comes back as a later attempt: attempt {} after {}",
            again.attempt(),
            d.attempt()
        )));
    }
    row.settle(&again, Decision::Ack).await?;
    row.done().await;
    Ok(row_name(3))
}

/// Semantics T5 (B5, B6): the message is not offered again before its delay has passed, and the
/// declined attempt is spent: it comes back with the next attempt number.
async fn delay(b: &dyn Broker, prefix: &str, run_id: &str) -> Result<&'static str, Failure> {
    let mut row = Row::open(b, ROWS[4], prefix, run_id, "delay", |p| {
        p.max_nack_delay = Some(api::Duration(Duration::from_secs(10)))
    })
    .await?;
    row.publish(b, "m").await?;
    let d = row.expect("the message").await?;
    let declined_at = Instant::now();
    settle_with(&d, DELAY)
        .await
        .map_err(|e| row.fail(format!("settle_with: {e}")))?;
    let again = row.expect("the delayed message").await?;
    let waited = declined_at.elapsed();
    if waited < DELAY {
        return Err(row.fail(format!(
            "offered again after {waited:?}, before its delay of {DELAY:?}"
        )));
    }
    if again.attempt() != d.attempt() + 1 {
        return Err(row.fail(format!(
            "the declined attempt is spent: expected attempt {}, got {}",
            d.attempt() + 1,
            again.attempt()
        )));
    }
    row.settle(&again, Decision::Ack).await?;
    row.done().await;
    Ok(row_name(4))
}

fn row_name(i: usize) -> &'static str {
    ROWS[i]
}
