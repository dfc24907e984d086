//! Consuming from RabbitMQ: the queue a subscription consumes from (declared and bound from the
//! mapping for a code-defined subscription, waited for when the operator makes it), the AMQP
//! consumer with its prefetch and acknowledgement mode, each delivery turned into a `Delivery`,
//! and its settlement with AMQP's acknowledgements.
//!
//! What it sends, and why (docs/semantics.md R1–R7):
//! - AtMostOnce consumes with automatic acknowledgement (`no_ack`, RabbitMQ's `none`): the
//!   broker forgets a message once it is sent, and nothing is ever acked or nacked.
//! - AtLeastOnce consumes with manual acknowledgement (RabbitMQ's `manual`, never `auto`), with
//!   `basic.qos` prefetch = maxInFlight. Ack: `basic.ack`. A decline (a Nack, or silence: the
//!   forgotten ack is settled by the runtime): `basic.nack` with requeue, at once (RabbitMQ has
//!   no delayed requeue). The last declined attempt (attempt == maxDeliver, counted Exhausted by
//!   the runtime): `basic.reject` without requeue, so the queue's dead-letter exchange gets it
//!   when one is set. Release at close: `basic.nack` with requeue.
//! - The attempt is the quorum queue's `x-delivery-count` header + 1.
//! - Retiring closes the consumer's channel: the broker requeues everything unsettled on it, so
//!   a later settlement is Refused and never Stranded.
//! - Paused (W3: the operator's marker exchange `settle.paused.<queue>` is there and
//!   `settle.running.<queue>` is not, checked every pause poll interval by `backend::pause`): `basic.cancel`, so the broker sends nothing more;
//!   what it had sent (the prefetch) is still handed out, and every delivery taken settles on
//!   the channel as before. Once the marker is gone, the queue's object mark is read again
//!   (the queue may have been made again for a new object meanwhile), then `basic.consume`
//!   again on the same channel.
//! - The close's broker calls (`basic.cancel`, a release's `basic.nack`, `channel.close`) wait
//!   at most [`CLOSE_STEP`] each, so a graceful stop ends whatever the broker does.
//!
//! It must not count anything (the settle path does), build queue arguments (that is
//! [`super::mapping`]) nor declare or bind a queue the operator owns.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    BasicRejectOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel};

use super::admin::{self, reply_code};
use super::mapping::{self, QueueSpec};
use super::pause;
use super::{RabbitBroker, RabbitError, amqp, broker_err, report};
use crate::backend::pause::PauseWatch;
use crate::bus::{
    self, BrokerAction, BusError, Consumer, ConsumerOwner, Delivery, DeliveryOptions, OnSettle,
    Performed, Refusal, SubscriptionCtx,
};
use crate::policy::{BackendKind, RABBITMQ_MAX_PREFETCH};

/// How long a consume waits for RabbitMQ's answer before the bind is tried again.
const CONSUME_ANSWER: std::time::Duration = std::time::Duration::from_secs(15);

impl RabbitBroker {
    /// A consumer on the subscription's queue (see [`RabbitBroker::bind`]).
    pub(super) async fn consume(
        &self,
        ctx: Arc<SubscriptionCtx>,
    ) -> Result<Box<dyn Consumer>, BusError> {
        let (channel, consumer) = self.bind(&ctx).await?;
        let consumer_queue = consumer.queue().as_str().to_string();
        // Only the operator pauses a Subscription: an operator-made queue's marker is checked.
        let pause = match ctx.binding().owner {
            ConsumerOwner::Operator => {
                let broker = self.clone();
                let queue = consumer_queue.clone();
                let seen = Arc::new(AtomicBool::new(false));
                PauseWatch::start(
                    BackendKind::Rabbitmq,
                    ctx.name(),
                    self.pause_poll,
                    move || {
                        let (broker, queue, seen) =
                            (broker.clone(), queue.clone(), Arc::clone(&seen));
                        async move {
                            let was = seen.load(Ordering::Relaxed);
                            let conn = broker.conn().await.map_err(|e| e.to_string())?;
                            let now = pause::is_paused(&conn, &queue, was)
                                .await
                                .map_err(|e| e.to_string())?;
                            seen.store(now, Ordering::Relaxed);
                            Ok(now)
                        }
                    },
                )
            }
            ConsumerOwner::Runtime => PauseWatch::never(),
        };
        Ok(Box::new(RabbitConsumer {
            broker: self.clone(),
            acks: ctx.policy().at_least_once(),
            ctx,
            channel,
            consumer: Some(consumer),
            retired: Arc::default(),
            queue: consumer_queue,
            pause,
            flow: Flow::Consuming,
        }))
    }

    /// Opens a channel with the queue this subscription consumes from, declared (code-defined)
    /// or found (operator-made), bound, and consuming.
    async fn bind(&self, ctx: &SubscriptionCtx) -> Result<(Channel, lapin::Consumer), BusError> {
        let b = ctx.binding();
        let p = ctx.policy();
        let want = match b.owner {
            ConsumerOwner::Runtime => {
                let want =
                    mapping::desired_by_runtime(&b.namespace, ctx.name(), p, &self.exchanges);
                self.declare(&want).await?;
                want
            }
            ConsumerOwner::Operator => {
                let want = self.await_operator(ctx).await;
                // The object the operator made this queue for: the counts from here on are its.
                ctx.bound_to(
                    report::read_object(&*self.conn().await?, &b.namespace, ctx.name())
                        .await
                        .as_deref(),
                );
                want
            }
        };
        let ch = self
            .conn()
            .await?
            .create_channel()
            .await
            .map_err(amqp("cannot open a channel"))?;
        let alo = p.at_least_once();
        if alo {
            // P1: maxInFlight is the prefetch (admission refuses more than 16 bits hold).
            let prefetch = u16::try_from(p.max_in_flight.min(RABBITMQ_MAX_PREFETCH as usize))
                .unwrap_or(u16::MAX);
            ch.basic_qos(prefetch, BasicQosOptions { global: false })
                .await
                .map_err(amqp("basic.qos"))?;
        }
        let consumer = self.start(&ch, ctx, &want.name).await?;
        tracing::info!(subscription = %ctx.name(), queue = %want.name, routing_key = %want.binding.routing_key, exchange = %want.binding.exchange, owner = ?b.owner, ack = if alo { "manual" } else { "none" }, "consuming from a RabbitMQ queue");
        Ok((ch, consumer))
    }

    /// Starts consuming `queue` on `ch` (again after a pause: on the same channel, so the
    /// deliveries taken before it still settle).
    async fn start(
        &self,
        ch: &Channel,
        ctx: &SubscriptionCtx,
        queue: &str,
    ) -> Result<lapin::Consumer, BusError> {
        let alo = ctx.policy().at_least_once();
        let tag = format!(
            "settle-{}-{}-{}",
            ctx.name(),
            std::process::id(),
            self.tags.fetch_add(1, Ordering::Relaxed)
        );
        let consume = ch.basic_consume(
            ShortString::from(queue),
            ShortString::from(tag.as_str()),
            BasicConsumeOptions {
                no_ack: !alo,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        );
        // RabbitMQ never answers a consume on a queue it lists but runs nothing for (a quorum
        // queue made just before its node crashed): the bind is tried again instead (R14).
        match tokio::time::timeout(CONSUME_ANSWER, consume).await {
            Ok(r) => r.map_err(amqp(format!("cannot consume from queue {queue:?}"))),
            Err(_) => Err(BusError::backend(
                BackendKind::Rabbitmq,
                format!(
                    "RabbitMQ did not answer a consume from queue {queue:?} within {} s: it lists the queue but may run nothing for it",
                    CONSUME_ANSWER.as_secs()
                ),
            )),
        }
    }

    /// A code-defined subscription's queue: declared from the mapping (RabbitMQ refuses, with
    /// 406, a queue of that name with other arguments) and bound by the pattern.
    async fn declare(&self, want: &QueueSpec) -> Result<(), BusError> {
        // A failed declare closes its channel: use one of its own.
        let ch = self
            .conn()
            .await?
            .create_channel()
            .await
            .map_err(amqp("cannot open a channel"))?;
        let declared = ch
            .queue_declare(
                ShortString::from(want.name.as_str()),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                want.arguments_table(),
            )
            .await;
        match declared {
            Ok(_) => {}
            Err(e) if reply_code(&e) == Some(406) => {
                return Err(broker_err(RabbitError::QueueDiffers {
                    queue: want.name.clone(),
                    reason: e.to_string(),
                }));
            }
            Err(e) => return Err(amqp(format!("cannot declare queue {:?}", want.name))(e)),
        }
        ch.queue_bind(
            ShortString::from(want.name.as_str()),
            ShortString::from(want.binding.exchange.as_str()),
            ShortString::from(want.binding.routing_key.as_str()),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(amqp(format!(
            "cannot bind queue {:?} to exchange {:?}",
            want.name, want.binding.exchange
        )))?;
        let _ = ch.close(200, ShortString::from("declared")).await;
        Ok(())
    }

    /// An operator-made queue: waits, logging why, until it exists (a passive declare), and
    /// never declares or binds it itself.
    async fn await_operator(&self, ctx: &SubscriptionCtx) -> QueueSpec {
        let b = ctx.binding();
        let want = mapping::desired(&b.namespace, ctx.name(), ctx.policy(), &self.exchanges);
        let name = want.name.as_str();
        bus::await_operator(ctx.name(), "queue", move || async move {
            let conn = self.conn().await.map_err(|e| e.to_string())?;
            match admin::exists(&conn, name).await {
                Ok(true) => Ok(()),
                Ok(false) => Err(format!(
                    "queue {name} does not exist yet: the operator creates it from Subscription {}/{} (kubectl describe subscription {} -n {})",
                    b.namespace,
                    ctx.name(),
                    ctx.name(),
                    b.namespace
                )),
                Err(e) => Err(e.to_string()),
            }
        })
        .await;
        want
    }
}

/// An AMQP delivery's properties and headers as transport headers (the inverse of
/// [`properties`]): the properties first, then the headers table, values as text.
pub fn transport_headers(props: &BasicProperties) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (name, value) in [
        ("content-type", props.content_type()),
        ("correlation-id", props.correlation_id()),
        ("message-id", props.message_id()),
    ] {
        if let Some(v) = value {
            out.push((name.to_string(), v.as_str().to_string()));
        }
    }
    if let Some(table) = props.headers() {
        for (k, v) in table.inner() {
            out.push((k.as_str().to_string(), text(v)));
        }
    }
    out
}

fn text(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Timestamp(n) => n.to_string(),
        other => format!("{other:?}"),
    }
}

/// The attempt of a delivery: the quorum queue's `x-delivery-count` (returns so far) + 1; a
/// redelivery without the header (a classic queue) is at least the second attempt.
pub fn attempt(props: &BasicProperties, redelivered: bool) -> u32 {
    let count = props.headers().as_ref().and_then(|t| {
        t.inner()
            .get(&ShortString::from("x-delivery-count"))
            .and_then(|v| text(v).parse::<u32>().ok())
    });
    match count {
        Some(n) => n.saturating_add(1),
        None if redelivered => 2,
        None => 1,
    }
}

struct RabbitConsumer {
    broker: RabbitBroker,
    ctx: Arc<SubscriptionCtx>,
    channel: Channel,
    consumer: Option<lapin::Consumer>,
    retired: Arc<AtomicBool>,
    acks: bool,
    /// The queue consumed from.
    queue: String,
    /// The operator's pause marker, as last checked.
    pause: PauseWatch,
    flow: Flow,
}

/// Where a consumer stands with a pause (semantics W3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flow {
    /// Consuming (or not paused).
    Consuming,
    /// Paused: `basic.cancel` sent; what the broker sent before it is still handed out.
    Draining,
    /// Paused and the consumer cancelled: nothing is fetched until the marker goes.
    Paused,
    /// Stopped or retired: never consumes again.
    Stopped,
}

impl RabbitConsumer {
    fn delivery(&self, m: lapin::message::Delivery) -> Delivery {
        let attempt = attempt(&m.properties, m.redelivered);
        let headers = transport_headers(&m.properties);
        Delivery::new(
            &self.ctx,
            DeliveryOptions {
                subject: m.routing_key.as_str().to_string(),
                headers,
                payload: Bytes::from(m.data),
                attempt,
                on_settle: Box::new(RabbitSettler {
                    acker: m.acker,
                    retired: Arc::clone(&self.retired),
                    acks: self.acks,
                }),
            },
        )
    }

    /// Paused: waits until the marker is gone, then consumes again on the same channel (or, if
    /// it closed meanwhile, a new one); on failure, waits 1s so the caller tries again. `false`
    /// when the pause watch ended (the consumer is done).
    async fn resume(&mut self) -> bool {
        // Resumed once the marker is gone: consume again on the same channel.
        let mut rx = self.pause.receiver();
        if !crate::backend::pause::until(&mut rx, false).await {
            return false;
        }
        let queue = self.queue.clone();
        if self.ctx.binding().owner == ConsumerOwner::Operator {
            // The queue may have been deleted and made again for a new object while nothing
            // consumed it (the Subscription deleted and applied again during the pause): its
            // mark is read before anything more is taken, or what this instance handles next
            // would count for the old object until the next read (semantics C15).
            match self.broker.conn().await {
                Ok(conn) => {
                    let b = self.ctx.binding();
                    let mark = report::read_object(&conn, &b.namespace, self.ctx.name()).await;
                    self.ctx.bound_to(mark.as_deref());
                }
                Err(e) => {
                    tracing::warn!(subscription = %self.ctx.name(), error = %e, "cannot read the queue's mark after the pause; trying again in 1s");
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    return true;
                }
            }
        }
        let again = match self.broker.start(&self.channel, &self.ctx, &queue).await {
            Ok(c) => Ok(c),
            // The channel closed meanwhile: a new one (what it held was requeued).
            Err(_) => self.broker.bind(&self.ctx).await.map(|(ch, c)| {
                self.channel = ch;
                c
            }),
        };
        match again {
            Ok(c) => {
                self.consumer = Some(c);
                self.flow = Flow::Consuming;
                self.ctx.set_paused(false);
                crate::backend::pause::shown(BackendKind::Rabbitmq, self.ctx.name(), false);
                tracing::info!(subscription = %self.ctx.name(), %queue, "resumed: consuming again");
            }
            Err(e) => {
                tracing::warn!(subscription = %self.ctx.name(), error = %e, "cannot consume again after the pause; trying again in 1s");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
        true
    }

    /// A pause was asked: `basic.cancel` the consumer `tag` and drain.
    async fn cancel_for_pause(&mut self, tag: ShortString) {
        // Paused: the broker sends nothing more; what it sent already (the prefetch)
        // still comes out of the stream, then the stream ends.
        self.flow = Flow::Draining;
        if let Err(e) = self
            .channel
            .basic_cancel(tag, BasicCancelOptions::default())
            .await
        {
            tracing::warn!(subscription = %self.ctx.name(), error = %e, "basic.cancel for the pause");
        }
    }

    /// The stream ended after a pause's `basic.cancel`: everything sent was handed out.
    fn drained(&mut self) {
        self.consumer = None;
        self.flow = Flow::Paused;
        self.ctx.set_paused(true);
        crate::backend::pause::shown(BackendKind::Rabbitmq, self.ctx.name(), true);
        tracing::info!(subscription = %self.ctx.name(), "paused: fetching stopped until the Subscription is resumed (deliveries already taken finish)");
    }

    /// The stream ended otherwise (consumer cancelled, channel or connection closed). An
    /// operator-made queue of a consumer not retired is waited for and consumed again, and any
    /// queue once the lost connection is dialled again (tried every second while the broker is
    /// unreachable): `true`. Otherwise `false`: the consumer is done.
    async fn consume_again_after_end(&mut self) -> bool {
        self.consumer = None;
        let lost = self.broker.redialling();
        if (self.ctx.binding().owner == ConsumerOwner::Operator || lost)
            && !self.retired.load(Ordering::Acquire)
        {
            // The operator repairs a deleted queue while its Subscription exists, and a
            // broker restart keeps every durable queue: consume again when it is back.
            tracing::warn!(subscription = %self.ctx.name(), connection_lost = lost, "the queue is gone or the channel closed; waiting for it to come back");
            let mut tries = 0u32;
            loop {
                if self.retired.load(Ordering::Acquire) {
                    return false;
                }
                match self.broker.bind(&self.ctx).await {
                    Ok((ch, c)) => {
                        self.channel = ch;
                        self.consumer = Some(c);
                        return true;
                    }
                    // An operator-made queue deleted between the look and the consume, or one
                    // RabbitMQ does not answer for: the operator makes or says it; wait.
                    Err(e)
                        if self.broker.redialling()
                            || self.ctx.binding().owner == ConsumerOwner::Operator =>
                    {
                        if tries.is_multiple_of(30) {
                            tracing::warn!(subscription = %self.ctx.name(), error = %e, "cannot consume yet; trying again every second");
                        }
                        tries = tries.saturating_add(1);
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    }
                    Err(e) => {
                        tracing::error!(subscription = %self.ctx.name(), error = %e, "cannot consume again");
                        return false;
                    }
                }
            }
        }
        tracing::error!(subscription = %self.ctx.name(), "the RabbitMQ consumer was cancelled or its channel closed");
        false
    }
}

impl Consumer for RabbitConsumer {
    fn next(&mut self) -> BoxFuture<'_, Option<Delivery>> {
        async move {
            loop {
                if self.flow == Flow::Paused {
                    if !self.resume().await {
                        return None;
                    }
                    continue;
                }
                if self.flow == Flow::Consuming
                    && self.pause.is_paused()
                    && let Some(tag) = self.consumer.as_ref().map(|c| c.tag())
                {
                    self.cancel_for_pause(tag).await;
                    continue;
                }
                let consumer = self.consumer.as_mut()?;
                let mut rx = self.pause.receiver();
                let watching = self.flow == Flow::Consuming;
                // `None`: a pause was asked while waiting.
                let next = tokio::select! {
                    m = consumer.next() => Some(m),
                    true = async { watching && crate::backend::pause::until(&mut rx, true).await } => None,
                };
                let Some(got) = next else { continue };
                match got {
                    Some(Ok(m)) => return Some(self.delivery(m)),
                    Some(Err(e)) => {
                        tracing::warn!(subscription = %self.ctx.name(), error = %e, "consuming from RabbitMQ");
                    }
                    None if self.flow == Flow::Draining => self.drained(),
                    None => {
                        if !self.consume_again_after_end().await {
                            return None;
                        }
                    }
                }
            }
        }
        .boxed()
    }

    fn stop(&mut self) -> BoxFuture<'_, ()> {
        async move {
            self.flow = Flow::Stopped;
            if let Some(c) = self.consumer.take() {
                // Settlements still work on the channel; what was sent but not taken stays
                // unsettled until retire closes the channel, which requeues it.
                let cancel = self
                    .channel
                    .basic_cancel(c.tag(), BasicCancelOptions::default());
                if tokio::time::timeout(CLOSE_STEP, cancel).await.is_err() {
                    tracing::warn!(subscription = %self.ctx.name(), "basic.cancel unanswered after {CLOSE_STEP:?}: going on with the close");
                }
            }
        }
        .boxed()
    }

    fn retire(&mut self) -> BoxFuture<'_, ()> {
        async move {
            self.retired.store(true, Ordering::Release);
            self.flow = Flow::Stopped;
            self.consumer = None;
            // Closing the channel requeues every unsettled delivery on it (semantics R5); so
            // does the connection's end, should the broker not answer the close.
            let close = self.channel.close(200, ShortString::from("retired"));
            match tokio::time::timeout(CLOSE_STEP, close).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(subscription = %self.ctx.name(), error = %e, "closing the consumer's channel");
                }
                Err(_) => {
                    tracing::warn!(subscription = %self.ctx.name(), "channel.close unanswered after {CLOSE_STEP:?}: going on with the close");
                }
            }
        }
        .boxed()
    }
}

/// The longest one broker call of the close (`basic.cancel`, a release's `basic.nack`,
/// `channel.close`) is waited for: the graceful stop must end within a pod's grace period
/// whatever the broker does, and what is left unsettled is requeued when the channel or its
/// connection ends anyway.
pub const CLOSE_STEP: std::time::Duration = std::time::Duration::from_secs(5);

struct RabbitSettler {
    acker: lapin::Acker,
    retired: Arc<AtomicBool>,
    acks: bool,
}

impl RabbitSettler {
    fn check(&self) -> Result<(), Refusal> {
        if self.retired.load(Ordering::Acquire) {
            return Err(Refusal {
                reason: "the consumer that offered this delivery was retired and its channel closed; the broker requeued the message".into(),
                stranded: false,
            });
        }
        if !self.acks {
            return Err(Refusal {
                reason: "the consumer takes no acknowledgements (automatic acknowledgement)".into(),
                stranded: false,
            });
        }
        Ok(())
    }

    /// The broker's answer to a settlement, as the settle path needs it.
    fn done(what: &str, r: Result<bool, lapin::Error>) -> Result<(), Refusal> {
        match r {
            Ok(true) => Ok(()),
            // Already used, or the channel closed: the broker requeued the message itself.
            Ok(false) => Err(Refusal {
                reason: format!(
                    "{what} not sent: the channel that received the delivery is closed, and the broker requeued the message"
                ),
                stranded: false,
            }),
            Err(e) => Err(Refusal {
                reason: format!(
                    "{what} failed: {e} (the broker requeues the message when the channel closes)"
                ),
                stranded: false,
            }),
        }
    }

    async fn requeue(&self) -> Result<(), Refusal> {
        let r = self
            .acker
            .nack(BasicNackOptions {
                multiple: false,
                requeue: true,
            })
            .await;
        Self::done("basic.nack", r)
    }
}

impl OnSettle for RabbitSettler {
    fn settle(&self, action: BrokerAction) -> BoxFuture<'_, Result<Performed, Refusal>> {
        async move {
            self.check()?;
            match action {
                BrokerAction::Ack => {
                    Self::done(
                        "basic.ack",
                        self.acker.ack(BasicAckOptions::default()).await,
                    )?;
                    Ok(Performed::AsAsked)
                }
                BrokerAction::Decline(delay) => {
                    self.requeue().await?;
                    // No delayed requeue on RabbitMQ (admission refuses schedules here).
                    Ok(if delay.is_zero() {
                        Performed::AsAsked
                    } else {
                        Performed::DelayShortened
                    })
                }
                BrokerAction::Terminate => {
                    let r = self
                        .acker
                        .reject(BasicRejectOptions { requeue: false })
                        .await;
                    Self::done("basic.reject", r)?;
                    Ok(Performed::AsAsked)
                }
            }
        }
        .boxed()
    }

    fn progress(&self) -> BoxFuture<'_, Result<(), Refusal>> {
        // Nothing to extend: the broker never hands the message on while the channel lives.
        futures::future::ready(Ok(())).boxed()
    }

    fn release(&self) -> BoxFuture<'_, ()> {
        async move {
            if self.check().is_ok()
                && let Err(r) = tokio::time::timeout(CLOSE_STEP, self.requeue())
                    .await
                    .unwrap_or_else(|_| {
                        Err(Refusal {
                            reason: format!("basic.nack not sent within {CLOSE_STEP:?}"),
                            stranded: false,
                        })
                    })
            {
                tracing::debug!(reason = %r.reason, "release not sent; the broker requeues the message when the channel closes");
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attempt_is_the_delivery_count_plus_one() {
        let with = |v: AMQPValue| {
            let mut t = FieldTable::default();
            t.insert(ShortString::from("x-delivery-count"), v);
            BasicProperties::default().with_headers(t)
        };
        assert_eq!(attempt(&BasicProperties::default(), false), 1);
        assert_eq!(attempt(&BasicProperties::default(), true), 2);
        assert_eq!(attempt(&with(AMQPValue::LongLongInt(0)), false), 1);
        assert_eq!(attempt(&with(AMQPValue::LongLongInt(2)), true), 3);
        assert_eq!(attempt(&with(AMQPValue::LongInt(4)), true), 5);
    }
}
