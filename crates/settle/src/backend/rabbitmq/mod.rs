//! The RabbitMQ backend (AMQP 0-9-1, on `lapin`, no broker plugins): [`RabbitBroker`], the
//! `bus::Broker` that binds a subscription to a quorum queue on a topic exchange, turns each AMQP
//! delivery into a `Delivery`, settles with AMQP's acknowledgements (docs/semantics.md R1–R7),
//! and publishes.
//!
//! Publishing sends to the exchange with the subject as routing key, with publisher confirms.
//! The transport headers `content-type`, `correlation-id` and `message-id` travel as AMQP
//! properties, every other header in the headers table; a delivery shows both as headers, so the
//! envelope reader sees a `correlation_id` property that contradicts a MassTransit envelope (a
//! ForeignConflict).
//!
//! Its files, the same as every broker's: [`connect`] (an application's URL, and a Backend's
//! settings, to a connection), `consume` (the queue consumed from, each delivery and its
//! settlement), [`mapping`] (the one spec → queue mapping) and [`admin`] (the operator's calls:
//! declare, bind, unbind, delete a managed queue over AMQP). Beside them: `management` (the
//! management API, read-only: arguments, bindings, version, gauges), [`report`] (the stats
//! reports' per-Subscription queues: the runtime's `StatsSink`, the arguments both sides
//! declare), `dead_letters` (the operator's copy of a Backend's dead letters, R9–R12) and
//! [`pause`] (the marker exchange that says a Subscription is paused, W3).
//!
//! It must not count anything (the settle path does) nor build queue arguments (that is
//! [`mapping`], the one mapping); it declares queues only for code-defined subscriptions.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;

pub mod admin;
pub mod connect;
mod consume;
#[cfg(feature = "admin")]
pub mod dead_letters;
#[cfg(feature = "admin")]
pub mod management;
pub mod mapping;
pub mod pause;
pub mod report;

pub use consume::{attempt, transport_headers};

use crate::bus::{Broker, BusError, Consumer, StatsSink, SubscriptionCtx};
use crate::policy::BackendKind;
use mapping::Exchanges;

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

/// How a broker made from a URL dials its connection again.
type Dial = Arc<dyn Fn() -> BoxFuture<'static, Result<Connection, lapin::Error>> + Send + Sync>;

/// The broker's connection, dialled again when it was lost (the broker restarted, the network
/// failed) by a broker made from a URL: lapin does not reconnect, and a runtime that kept a dead
/// connection would stop consuming and reporting for good. One made from a connection keeps it.
struct Link {
    current: std::sync::Mutex<Arc<Connection>>,
    dial: Option<Dial>,
    /// Held while dialling, so the tasks that find the connection lost dial it once.
    dialling: Mutex<()>,
}

impl Link {
    fn current(&self) -> Arc<Connection> {
        match self.current.lock() {
            Ok(c) => Arc::clone(&c),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }
}

/// RabbitMQ as a backend. Clones share one connection.
#[derive(Clone)]
pub struct RabbitBroker {
    conn: Arc<Link>,
    exchanges: Exchanges,
    publisher: Arc<Mutex<Option<Channel>>>,
    tags: Arc<AtomicU64>,
    /// Report queues this process declared (each once, before its first report).
    reports_declared: report::Declared,
    /// The user this connection authenticated as: its reports carry it as `user_id`, which
    /// RabbitMQ validates, so the operator knows who wrote them (docs/stats-report.md).
    user: Option<String>,
    /// How often a consumer of an operator-made queue checks its pause marker.
    pause_poll: std::time::Duration,
}

impl RabbitBroker {
    /// Uses an existing connection (never dialled again: [`RabbitBroker::connect`] does).
    pub fn from_connection(conn: Connection) -> RabbitBroker {
        RabbitBroker::with_link(conn, None)
    }

    fn with_link(conn: Connection, dial: Option<Dial>) -> RabbitBroker {
        RabbitBroker {
            conn: Arc::new(Link {
                current: std::sync::Mutex::new(Arc::new(conn)),
                dial,
                dialling: Mutex::new(()),
            }),
            exchanges: Exchanges::default(),
            publisher: Arc::default(),
            tags: Arc::default(),
            reports_declared: Arc::default(),
            user: None,
            pause_poll: crate::backend::pause::poll_interval_from_env(),
        }
    }

    /// How often each consumer of an operator-made queue checks whether its Subscription is
    /// paused (the marker `settle.paused.<queue>`, [`pause`]); default `SETTLE_PAUSE_POLL_INTERVAL`,
    /// else 5s, at least 100ms.
    pub fn with_pause_poll(mut self, every: std::time::Duration) -> RabbitBroker {
        self.pause_poll = every.max(crate::backend::pause::MIN_POLL);
        self
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

    /// The connection as it is now (perhaps lost: [`RabbitBroker::conn`] dials it again).
    pub fn connection(&self) -> Arc<Connection> {
        self.conn.current()
    }

    /// Whether the connection is down and will be dialled again (a broker made from a URL):
    /// what a consumer waits out.
    fn redialling(&self) -> bool {
        self.conn.dial.is_some() && !self.conn.current().status().connected()
    }

    /// The connection, dialled again first if it was lost and this broker was made from a
    /// URL; the error says the broker is still unreachable.
    pub(crate) async fn conn(&self) -> Result<Arc<Connection>, BusError> {
        let now = self.conn.current();
        let Some(dial) = self
            .conn
            .dial
            .as_ref()
            .filter(|_| !now.status().connected())
        else {
            return Ok(now);
        };
        let _one = self.conn.dialling.lock().await;
        let now = self.conn.current();
        if now.status().connected() {
            return Ok(now);
        }
        let dialled = tokio::time::timeout(connect::CONNECT_TIMEOUT, dial())
            .await
            .map_err(|_| {
                BusError::backend(
                    BackendKind::Rabbitmq,
                    format!(
                        "the connection was lost and dialling again got no answer within {:?}",
                        connect::CONNECT_TIMEOUT
                    ),
                )
            })?
            .map_err(amqp("the connection was lost and dialling again failed"))?;
        let dialled = Arc::new(dialled);
        if let Ok(mut c) = self.conn.current.lock() {
            *c = Arc::clone(&dialled);
        }
        tracing::info!("connected to RabbitMQ again after the connection was lost");
        Ok(dialled)
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
            .conn()
            .await?
            .create_channel()
            .await
            .map_err(amqp("cannot open a publishing channel"))?;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(amqp("cannot turn on publisher confirms"))?;
        *slot = Some(ch.clone());
        Ok(ch)
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
        self.consume(ctx).boxed()
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

    fn read_mark<'a>(&'a self, ctx: &'a SubscriptionCtx) -> BoxFuture<'a, Option<String>> {
        async move {
            if ctx.binding().owner != crate::bus::ConsumerOwner::Operator {
                return None;
            }
            let conn = self.conn().await.ok()?;
            report::read_object(&conn, &ctx.binding().namespace, ctx.name()).await
        }
        .boxed()
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
}
