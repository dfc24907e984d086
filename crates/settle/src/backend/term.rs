//! What one leadership term hands from the controllers (`reconcile`) to the work that runs beside
//! them (the account): the API client, the controllers' caches of Subscriptions and Backends,
//! and each Backend's live broker handles by namespace and name. One type, here below both, so
//! neither sibling imports the other and nothing is copied field by field between them.
//!
//! It only carries handles: it must not call the API server or a broker, nor decide anything.

use kube::Client;
use kube::runtime::reflector::Store;

use super::{AmqpLookup, NatsLookup, PlacesFreed, QueueLookup};
use crate::api::{Backend, Subscription};

/// The controllers' caches and connections for one leadership term.
#[derive(Clone)]
pub struct Term {
    pub client: Client,
    pub subscriptions: Store<Subscription>,
    pub backends: Store<Backend>,
    /// A NATS Backend's connection.
    pub nats: NatsLookup,
    /// A RabbitMQ or SQS Backend's queue gauges.
    pub queues: QueueLookup,
    /// A RabbitMQ Backend's AMQP connection.
    pub rabbitmq: AmqpLookup,
    /// The account deleted queues of a Backend: the controllers' limit gates open.
    pub freed: PlacesFreed,
}
