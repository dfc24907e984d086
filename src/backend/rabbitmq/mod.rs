//! The RabbitMQ backend (AMQP 0-9-1, on `lapin`, no broker plugins): binds a subscription to a
//! quorum queue on a topic exchange, turns each AMQP delivery into a `Delivery`, and performs
//! settlements with AMQP's acknowledgements.
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
//! - Publishing sends to the exchange with the subject as routing key, with publisher confirms.
//!   The transport headers `content-type`, `correlation-id` and `message-id` travel as AMQP
//!   properties, every other header in the headers table; a delivery shows both as headers, so
//!   the envelope reader sees a `correlation_id` property that contradicts a MassTransit
//!   envelope (a ForeignConflict).
//!
//! It must not count anything (the settle path does) nor build queue arguments (that is
//! [`queue`], the one mapping); it declares queues only for code-defined subscriptions.
//!
//! Beside it, for the operator: [`connect`] (a Backend's settings to a connection), [`admin`]
//! (declare, bind, unbind, delete a managed queue over AMQP) and `management` (the management
//! API, read-only: arguments, bindings, version, gauges). Beside both, [`report`]: the stats
//! reports' per-Subscription queues (the runtime's `StatsSink`, the arguments both sides declare),
//! and `deadletter`: the operator's copy of a Backend's dead letters (R9–R12).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use tokio::sync::Mutex;

pub mod admin;
pub mod connect;
#[cfg(feature = "operator")]
pub mod deadletter;
#[cfg(feature = "operator")]
pub mod management;
pub mod queue;
pub mod report;

use crate::bus::{
    Broker, BrokerAction, BusError, Consumer, ConsumerOwner, Delivery, DeliveryOptions, OnSettle,
    Performed, Refusal, StatsSink, SubscriptionCtx,
};
use crate::policy::{BackendKind, RABBITMQ_MAX_PREFETCH};
use queue::{Exchanges, QueueSpec};

/// Why the broker refused or failed an operation.
#[derive(Debug, thiserror::Error)]
pub enum RabbitError {
    #[error("cannot connect to {url}: {source}")]
    Connect {
        url: String,
        #[source]
        source: lapin::Error,
    },
    /// A queue of that name exists with arguments the mapping does not give it; RabbitMQ cannot
    /// change a queue's arguments in place.
    #[error(
        "queue {queue:?} exists with other arguments than this subscription's ({reason}): \
         delete the queue, or choose another durableName"
    )]
    QueueDiffers { queue: String, reason: String },
    #[error("{what}: {source}")]
    Amqp {
        what: String,
        #[source]
        source: lapin::Error,
    },
}

fn broker_err(e: RabbitError) -> BusError {
    BusError::Broker {
        backend: BackendKind::Rabbitmq,
        source: Box::new(e),
    }
}

fn amqp(what: impl Into<String>) -> impl FnOnce(lapin::Error) -> BusError {
    let what = what.into();
    move |source| broker_err(RabbitError::Amqp { what, source })
}

/// The AMQP reply code of a channel or connection error (404 not found, 406 precondition
/// failed, ...), if the broker sent one.
fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => Some(p.get_id()),
        _ => None,
    }
}

/// RabbitMQ as a backend. Clones share one connection.
#[derive(Clone)]
pub struct RabbitBroker {
    conn: Arc<Connection>,
    exchanges: Exchanges,
    publisher: Arc<Mutex<Option<Channel>>>,
    tags: Arc<AtomicU64>,
    /// Report queues this process declared (each once, before its first report).
    reports_declared: report::Declared,
    /// The user this connection authenticated as: its reports carry it as `user_id`, which
    /// RabbitMQ validates, so the operator knows who wrote them (docs/stats-report.md).
    user: Option<String>,
}

/// The user an AMQP URL authenticates as (RabbitMQ's default `guest` when it names none).
fn url_user(url: &str) -> String {
    url.parse::<lapin::uri::AMQPUri>()
        .map(|u| u.authority.userinfo.username)
        .unwrap_or_else(|_| "guest".to_string())
}

impl RabbitBroker {
    /// Connects to a broker (for example `amqp://guest:guest@127.0.0.1:5672/%2f`; the path is
    /// the vhost), publishing to and binding on `amq.topic`.
    pub async fn connect(url: &str) -> Result<RabbitBroker, BusError> {
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .map_err(|source| {
                broker_err(RabbitError::Connect {
                    url: redact(url),
                    source,
                })
            })?;
        Ok(RabbitBroker::from_connection(conn).with_user(url_user(url)))
    }

    /// Connects over TLS (`amqps://`), trusting the CA certificate(s) in `ca_pem`.
    pub async fn connect_with_ca(url: &str, ca_pem: &str) -> Result<RabbitBroker, BusError> {
        let runtime = lapin::runtime::default_runtime().map_err(amqp("no async runtime"))?;
        let tls = lapin::tcp::OwnedTLSConfig {
            identity: None,
            cert_chain: Some(ca_pem.to_string()),
        };
        let conn =
            Connection::connect_with_config(url, ConnectionProperties::default(), tls, runtime)
                .await
                .map_err(|source| {
                    broker_err(RabbitError::Connect {
                        url: redact(url),
                        source,
                    })
                })?;
        Ok(RabbitBroker::from_connection(conn).with_user(url_user(url)))
    }

    /// Uses an existing connection.
    pub fn from_connection(conn: Connection) -> RabbitBroker {
        RabbitBroker {
            conn: Arc::new(conn),
            exchanges: Exchanges::default(),
            publisher: Arc::default(),
            tags: Arc::default(),
            reports_declared: Arc::default(),
            user: None,
        }
    }

    /// The user the connection authenticated as (set by [`RabbitBroker::connect`] from the
    /// URL): stats reports carry it as their validated `user_id`. A connection made elsewhere
    /// ([`RabbitBroker::from_connection`]) names it here, or its reports carry none.
    pub fn with_user(mut self, user: impl Into<String>) -> RabbitBroker {
        self.user = Some(user.into());
        self
    }

    /// Publish to and bind on this topic exchange instead of `amq.topic`.
    pub fn with_exchange(mut self, exchange: impl Into<String>) -> RabbitBroker {
        self.exchanges.exchange = exchange.into();
        self
    }

    /// Queues this runtime declares send exhausted messages to this exchange.
    pub fn with_dead_letter_exchange(mut self, exchange: impl Into<String>) -> RabbitBroker {
        self.exchanges.dead_letter = Some(exchange.into());
        self
    }

    pub fn exchanges(&self) -> &Exchanges {
        &self.exchanges
    }

    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The publishing channel (publisher confirms on), opened again if it was closed.
    async fn publisher(&self) -> Result<Channel, BusError> {
        let mut slot = self.publisher.lock().await;
        if let Some(ch) = slot.as_ref()
            && ch.status().connected()
        {
            return Ok(ch.clone());
        }
        let ch = self
            .conn
            .create_channel()
            .await
            .map_err(amqp("cannot open a publishing channel"))?;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(amqp("cannot turn on publisher confirms"))?;
        *slot = Some(ch.clone());
        Ok(ch)
    }

    /// Opens a channel with the queue this subscription consumes from, declared (code-defined)
    /// or found (operator-made), bound, and consuming.
    async fn bind(&self, ctx: &SubscriptionCtx) -> Result<(Channel, lapin::Consumer), BusError> {
        let b = ctx.binding();
        let p = ctx.policy();
        let want = match b.owner {
            ConsumerOwner::Runtime => {
                let want = queue::desired_by_runtime(&b.namespace, ctx.name(), p, &self.exchanges);
                self.declare(&want).await?;
                want
            }
            ConsumerOwner::Operator => {
                let want = self.await_operator(ctx).await;
                // The object the operator made this queue for: the counts from here on are its.
                ctx.bound_to(
                    report::read_object(&self.conn, &b.namespace, ctx.name())
                        .await
                        .as_deref(),
                );
                want
            }
        };
        let ch = self
            .conn
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
        let tag = format!(
            "settle-{}-{}-{}",
            ctx.name(),
            std::process::id(),
            self.tags.fetch_add(1, Ordering::Relaxed)
        );
        let consumer = ch
            .basic_consume(
                ShortString::from(want.name.as_str()),
                ShortString::from(tag.as_str()),
                BasicConsumeOptions {
                    no_ack: !alo,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(amqp(format!("cannot consume from queue {:?}", want.name)))?;
        tracing::info!(subscription = %ctx.name(), queue = %want.name, routing_key = %want.binding.routing_key, exchange = %want.binding.exchange, owner = ?b.owner, ack = if alo { "manual" } else { "none" }, "consuming from a RabbitMQ queue");
        Ok((ch, consumer))
    }

    /// A code-defined subscription's queue: declared from the mapping (RabbitMQ refuses, with
    /// 406, a queue of that name with other arguments) and bound by the pattern.
    async fn declare(&self, want: &QueueSpec) -> Result<(), BusError> {
        // A failed declare closes its channel: use one of its own.
        let ch = self
            .conn
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
        let want = queue::desired(&b.namespace, ctx.name(), ctx.policy(), &self.exchanges);
        let mut wait = Duration::from_millis(250);
        let mut said = String::new();
        loop {
            let why = match self.conn.create_channel().await {
                Err(e) => format!("cannot open a channel: {e}"),
                Ok(ch) => {
                    let found = ch
                        .queue_declare(
                            ShortString::from(want.name.as_str()),
                            QueueDeclareOptions {
                                passive: true,
                                ..QueueDeclareOptions::default()
                            },
                            FieldTable::default(),
                        )
                        .await;
                    match found {
                        Ok(_) => {
                            let _ = ch.close(200, ShortString::from("found")).await;
                            return want;
                        }
                        Err(e) if reply_code(&e) == Some(404) => format!(
                            "queue {} does not exist yet: the operator creates it from Subscription {}/{} (kubectl describe subscription {} -n {})",
                            want.name,
                            b.namespace,
                            ctx.name(),
                            ctx.name(),
                            b.namespace
                        ),
                        Err(e) => format!("cannot look up queue {}: {e}", want.name),
                    }
                }
            };
            if why != said {
                tracing::info!(subscription = %ctx.name(), reason = %why, "waiting for the operator's queue");
                said = why;
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(5));
        }
    }
}

/// The URL without its password, for error messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

impl Broker for RabbitBroker {
    fn kind(&self) -> BackendKind {
        BackendKind::Rabbitmq
    }

    /// RabbitMQ never hands a message on while the channel that received it lives.
    fn hands_on_slow_handlers(&self) -> bool {
        false
    }

    fn open(
        &self,
        ctx: Arc<SubscriptionCtx>,
    ) -> BoxFuture<'_, Result<Box<dyn Consumer>, BusError>> {
        async move {
            let (channel, consumer) = self.bind(&ctx).await?;
            Ok(Box::new(RabbitConsumer {
                broker: self.clone(),
                acks: ctx.policy().at_least_once(),
                ctx,
                channel,
                consumer: Some(consumer),
                retired: Arc::default(),
            }) as Box<dyn Consumer>)
        }
        .boxed()
    }

    fn publish(
        &self,
        subject: String,
        headers: Vec<(String, String)>,
        payload: Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>> {
        async move {
            let ch = self.publisher().await?;
            let confirm = ch
                .basic_publish(
                    ShortString::from(self.exchanges.exchange.as_str()),
                    ShortString::from(subject.as_str()),
                    BasicPublishOptions::default(),
                    &payload,
                    properties(headers),
                )
                .await
                .map_err(amqp(format!("cannot publish on {subject:?}")))?;
            let confirmation = confirm
                .await
                .map_err(amqp(format!("publish on {subject:?} not confirmed")))?;
            if confirmation.is_nack() {
                return Err(BusError::backend(
                    BackendKind::Rabbitmq,
                    format!("the broker refused the message on {subject:?} (basic.nack)"),
                ));
            }
            Ok(())
        }
        .boxed()
    }

    /// Reports go to each Subscription's report queue (see [`report`]).
    fn stats_sink(&self) -> Option<Arc<dyn StatsSink>> {
        Some(Arc::new(self.clone()))
    }
}

/// Transport headers as AMQP properties: `content-type`, `correlation-id` and `message-id` as
/// the properties of those names, the rest in the headers table.
pub fn properties(headers: Vec<(String, String)>) -> BasicProperties {
    let mut props = BasicProperties::default();
    let mut table = FieldTable::default();
    for (k, v) in headers {
        match k.to_ascii_lowercase().as_str() {
            "content-type" => props = props.with_content_type(ShortString::from(v)),
            "correlation-id" => props = props.with_correlation_id(ShortString::from(v)),
            "message-id" => props = props.with_message_id(ShortString::from(v)),
            _ => {
                table.insert(
                    ShortString::from(k),
                    AMQPValue::LongString(LongString::from(v)),
                );
            }
        }
    }
    if !table.inner().is_empty() {
        props = props.with_headers(table);
    }
    props
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
}

impl Consumer for RabbitConsumer {
    fn next(&mut self) -> BoxFuture<'_, Option<Delivery>> {
        async move {
            loop {
                let consumer = self.consumer.as_mut()?;
                match consumer.next().await {
                    Some(Ok(m)) => return Some(self.delivery(m)),
                    Some(Err(e)) => {
                        tracing::warn!(subscription = %self.ctx.name(), error = %e, "consuming from RabbitMQ");
                    }
                    None => {
                        self.consumer = None;
                        if self.ctx.binding().owner == ConsumerOwner::Operator
                            && !self.retired.load(Ordering::Acquire)
                        {
                            // The operator repairs a deleted queue while its Subscription
                            // exists: consume again when it is back.
                            tracing::warn!(subscription = %self.ctx.name(), "the operator's queue is gone or the channel closed; waiting for it to come back");
                            match self.broker.bind(&self.ctx).await {
                                Ok((ch, c)) => {
                                    self.channel = ch;
                                    self.consumer = Some(c);
                                    continue;
                                }
                                Err(e) => {
                                    tracing::error!(subscription = %self.ctx.name(), error = %e, "cannot consume again")
                                }
                            }
                            return None;
                        }
                        tracing::error!(subscription = %self.ctx.name(), "the RabbitMQ consumer was cancelled or its channel closed");
                        return None;
                    }
                }
            }
        }
        .boxed()
    }

    fn stop(&mut self) -> BoxFuture<'_, ()> {
        async move {
            if let Some(c) = self.consumer.take() {
                // Settlements still work on the channel; what was sent but not taken stays
                // unsettled until retire closes the channel, which requeues it.
                let _ = self
                    .channel
                    .basic_cancel(c.tag(), BasicCancelOptions::default())
                    .await;
            }
        }
        .boxed()
    }

    fn retire(&mut self) -> BoxFuture<'_, ()> {
        async move {
            self.retired.store(true, Ordering::Release);
            self.consumer = None;
            // Closing the channel requeues every unsettled delivery on it (semantics R5).
            if let Err(e) = self.channel.close(200, ShortString::from("retired")).await {
                tracing::debug!(subscription = %self.ctx.name(), error = %e, "closing the consumer's channel");
            }
        }
        .boxed()
    }
}

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
                && let Err(r) = self.requeue().await
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
    fn properties_and_headers_round_trip_as_transport_headers() {
        let sent = vec![
            ("content-type".to_string(), "application/json".to_string()),
            ("Correlation-Id".to_string(), "c-1".to_string()),
            ("message-id".to_string(), "m-1".to_string()),
            ("tenant".to_string(), "eu".to_string()),
        ];
        let props = properties(sent);
        assert_eq!(
            props.correlation_id().as_ref().map(|s| s.as_str()),
            Some("c-1")
        );
        let got = transport_headers(&props);
        assert_eq!(
            got,
            [
                ("content-type", "application/json"),
                ("correlation-id", "c-1"),
                ("message-id", "m-1"),
                ("tenant", "eu"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
        );
    }

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

    #[test]
    fn urls_lose_their_password_in_messages() {
        assert_eq!(
            redact("amqp://guest:secret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact("amqp://127.0.0.1:5672"), "amqp://127.0.0.1:5672");
    }
}
