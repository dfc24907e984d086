//! The backend seam: what a broker must provide for the runtime to drive it (open a consumer,
//! hand over deliveries, publish, keep stats reports).
//!
//! Traits and the error type only. Implementations live in `backend/memory.rs`,
//! `backend/nats/`, `backend/rabbitmq/` and `backend/sqs/`; nothing here may know a particular broker.

use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;

use crate::api::Capabilities;
use crate::policy::{BackendKind, capabilities_of};

use super::{Delivery, SubscriptionCtx};

/// Why the bus or a backend could not do something.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// The subscription asks for what the backend cannot honour (the admission rules).
    #[error("subscription {name:?} cannot run on the {backend} backend: {reason}")]
    Refused {
        name: String,
        backend: BackendKind,
        reason: String,
    },
    #[error("a subscription named {0:?} is already running on this bus")]
    Duplicate(String),
    #[error("no subscription named {0:?} on this bus")]
    Unknown(String),
    #[error("the bus is closed")]
    Closed,
    /// The broker failed or refused an operation. `source` is the broker's own typed error
    /// (for example `backend::nats::admin::NatsError`), so a caller can tell causes apart.
    #[error("{backend} backend: {source}")]
    Broker {
        backend: BackendKind,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

impl BusError {
    /// A broker failure described by a message only.
    pub fn backend(backend: BackendKind, message: impl std::fmt::Display) -> BusError {
        BusError::Broker {
            backend,
            source: message.to_string().into(),
        }
    }

    /// The broker's typed error, if it is one of type `E`.
    pub fn broker_error<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            BusError::Broker { source, .. } => source.downcast_ref::<E>(),
            _ => None,
        }
    }
}

/// A broker the runtime can drive.
pub trait Broker: Send + Sync + 'static {
    fn kind(&self) -> BackendKind;
    /// What this backend can honour; the admission rules judge subscriptions against it.
    fn capabilities(&self) -> Capabilities {
        capabilities_of(self.kind())
    }
    /// Whether the broker hands a message on after AckWait while its handler still runs (then the
    /// bus keeps leases under ExtendLease). The memory backend never does.
    fn hands_on_slow_handlers(&self) -> bool;
    /// Opens (or binds to) the consumer of one subscription.
    fn open(&self, ctx: Arc<SubscriptionCtx>)
    -> BoxFuture<'_, Result<Box<dyn Consumer>, BusError>>;
    /// Publishes one message.
    fn publish(
        &self,
        subject: String,
        headers: Vec<(String, String)>,
        payload: Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>>;
    /// Where this backend keeps stats reports, if it can (see `docs/stats-report.md`).
    fn stats_sink(&self) -> Option<Arc<dyn StatsSink>> {
        None
    }
    /// The Subscription object (UID) the operator's mark names now for the consumer or queue
    /// `ctx` is bound to, read again while it runs: a takeover (the object deleted with
    /// `Retain`, applied again and adopting it) marks it anew under running applications.
    /// `None`: not bound to an operator's consumer, not marked, or not readable now.
    fn read_mark<'a>(&'a self, ctx: &'a SubscriptionCtx) -> BoxFuture<'a, Option<String>> {
        let _ = ctx;
        Box::pin(async { None })
    }
}

/// One subscription's consumer: hands out deliveries, one at a time.
pub trait Consumer: Send {
    /// The next delivery, built with `Delivery::new`; `None` once the consumer has ended.
    /// Must be cancel-safe: dropping the future loses no delivery.
    fn next(&mut self) -> BoxFuture<'_, Option<Delivery>>;
    /// Stops taking deliveries (the bus is closing); settlements still work until `retire`.
    fn stop(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
    /// Retires the consumer: no more deliveries; later settlements of its deliveries are refused.
    fn retire(&mut self) -> BoxFuture<'_, ()>;
}

/// Where stats reports go: last value per key.
pub trait StatsSink: Send + Sync + 'static {
    fn put(&self, key: String, value: Bytes) -> BoxFuture<'_, Result<(), BusError>>;
}
