//! Backends: the brokers the runtime drives, each behind the `bus::Broker` seam.
//!
//! `memory` (in process, for tests and local development), `nats` (JetStream), `rabbitmq`
//! (AMQP 0-9-1) and `sqs` (Amazon SQS and compatible servers; the `sqs` feature). Anything that
//! names a broker's subject, header or config field lives under its folder here. Each broker's
//! folder has the same files: `mod.rs` (the `Broker`), `connect.rs` (connecting, TLS,
//! credentials), `consume.rs` (fetching and settling deliveries), its one spec → consumer
//! mapping (`nats/mapping.rs`, `rabbitmq/mapping.rs`, `sqs/mapping.rs`) and the operator's calls
//! (`nats/admin.rs`, the typed JetStream API both sides call; `rabbitmq/admin.rs`,
//! `sqs/admin.rs`). Every broker error names its [`Failure`] class ([`Classify`]), so the
//! controllers map no broker's error by hand; a refusal for a broker's limit (a stream's
//! `max_consumers`, a vhost's `max-queues`) is typed once, in [`limit`]; the runtime's poll of a
//! pause signal on brokers without a pause of their own (RabbitMQ, SQS), in [`pause`]. The
//! same names in the operator's wings: `reconcile/<broker>/` (the controller's step) and
//! `account/<broker>/` (the keeper) of `settle-operator`.
//!
//! This module must not decide policy (that is `policy`) nor talk to Kubernetes (with the
//! `admin` feature, [`Term`] only carries the controllers' caches to the account).

pub mod limit;
pub mod memory;
pub mod nats;
pub mod pause;
pub mod rabbitmq;
#[cfg(feature = "sqs")]
pub mod sqs;
#[cfg(feature = "admin")]
pub mod term;

/// A fingerprint of a value (a connection's settings, credentials included; what a keeper or a
/// controller last looked at), to tell a changed one apart; the same in one process only (the
/// std hasher's keys are fixed, its algorithm is not).
pub fn fingerprint<T: std::hash::Hash>(settings: &T) -> u64 {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    settings.hash(&mut h);
    h.finish()
}

#[cfg(feature = "admin")]
pub use term::Term;

/// The class of a failed connection or broker call, whatever the broker: what a status reason
/// and a retry depend on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Failure {
    /// Nothing answered (down, refused the connection, timed out, unresolvable, reconnecting):
    /// tried again.
    Unreachable,
    /// The broker refused the credentials (or their permissions, or the vhost).
    AuthFailed,
    /// The broker answered and refused the call, or the settings cannot be used at all.
    Refused,
}

/// A broker error that names its [`Failure`] class.
pub trait Classify {
    fn class(&self) -> Failure;

    /// The limit that refused the call, when that is why it failed (a [`Failure::Refused`]
    /// that asking again will not help until a place frees).
    fn limit(&self) -> Option<limit::BrokerLimit> {
        None
    }

    /// Whether the broker could not be asked at all.
    fn is_unreachable(&self) -> bool {
        self.class() == Failure::Unreachable
    }
}

/// The controllers' live handle on a Backend's broker, by the Backend's namespace and name, as
/// they hand it to the account each leadership term: a NATS connection, and its serial number
/// (another once the controllers made a new connection: credentials, servers or TLS changed).
#[cfg(feature = "admin")]
pub type NatsLookup =
    std::sync::Arc<dyn Fn(&str, &str) -> Option<(async_nats::Client, u64)> + Send + Sync>;

/// The same for a RabbitMQ or SQS Backend's queue gauges.
#[cfg(feature = "admin")]
pub type QueueLookup = std::sync::Arc<dyn Fn(&str, &str) -> Option<QueueGauges> + Send + Sync>;

/// The same for a RabbitMQ Backend's AMQP connection (made again first when it dropped); `None`
/// while the Backend has no working connection.
#[cfg(feature = "admin")]
pub type AmqpLookup = std::sync::Arc<
    dyn Fn(
            &str,
            &str,
        )
            -> futures::future::BoxFuture<'static, Option<std::sync::Arc<lapin::Connection>>>
        + Send
        + Sync,
>;

/// How the account tells the controllers that it deleted queues of a Backend, by the Backend's
/// namespace and name: places under a broker's limit (a vhost's `max-queues`) are free again, so
/// a create that limit refused may go at once.
#[cfg(feature = "admin")]
pub type PlacesFreed = std::sync::Arc<dyn Fn(&str, &str) + Send + Sync>;

/// Where the account reads a managed queue's gauges on brokers without consumer info: a
/// RabbitMQ Backend's management API (and vhost), or an SQS Backend's client.
#[cfg(feature = "admin")]
#[derive(Clone)]
pub enum QueueGauges {
    Rabbitmq {
        management: Box<rabbitmq::management::Management>,
        vhost: String,
    },
    Sqs(aws_sdk_sqs::Client),
}

#[cfg(feature = "admin")]
impl QueueGauges {
    /// Queue `name`'s `(pending, ack_pending)`: RabbitMQ's ready and unacknowledged messages,
    /// SQS's visible and not-visible ones. `None` when the queue does not exist.
    pub async fn read(&self, name: &str) -> Result<Option<(u64, u64)>, String> {
        match self {
            QueueGauges::Rabbitmq { management, vhost } => {
                rabbitmq::management::queue_gauges(management, vhost, name)
                    .await
                    .map_err(|e| e.to_string())
            }
            QueueGauges::Sqs(client) => sqs::admin::queue_gauges(client, name)
                .await
                .map_err(|e| e.to_string()),
        }
    }

    /// The names of every queue there (RabbitMQ's vhost; none listed on SQS).
    pub async fn names(&self) -> Result<Vec<String>, String> {
        match self {
            QueueGauges::Rabbitmq { management, vhost } => management
                .queue_names(vhost)
                .await
                .map_err(|e| e.to_string()),
            QueueGauges::Sqs(_) => Ok(Vec::new()),
        }
    }
}

#[cfg(all(test, feature = "admin"))]
mod tests {
    use super::{Classify, Failure};

    // Long on purpose: a table, one row per broker error variant and the class it names.
    /// What the Backends' and Subscriptions' reasons were matched on, variant by variant, before
    /// each error named its class: a credentials refusal is AuthFailed, settings that cannot be
    /// used and a broker's refusal are Refused, silence is Unreachable.
    #[test]
    fn every_broker_error_names_the_class_it_was_mapped_to() {
        use super::nats::admin::NatsError;
        use super::nats::connect::ConnectFailure as Nats;
        use super::rabbitmq::admin::AdminError as Amqp;
        use super::rabbitmq::connect::ConnectFailure as Rabbit;
        use super::rabbitmq::management::ManagementError as Mgmt;
        use super::sqs::admin::AdminError as Sqs;
        let s = String::new;
        let classes: Vec<(Box<dyn Classify>, Failure)> = vec![
            (
                Box::new(Nats::Unreachable {
                    servers: s(),
                    detail: s(),
                }),
                Failure::Unreachable,
            ),
            (Box::new(Nats::AuthFailed(s())), Failure::AuthFailed),
            (Box::new(Nats::BadConfig(s())), Failure::Refused),
            (
                Box::new(Rabbit::Unreachable {
                    urls: s(),
                    detail: s(),
                }),
                Failure::Unreachable,
            ),
            (Box::new(Rabbit::AuthFailed(s())), Failure::AuthFailed),
            (Box::new(Rabbit::BadConfig(s())), Failure::Refused),
            (Box::new(Amqp::Unreachable(s())), Failure::Unreachable),
            (
                Box::new(Amqp::Differs {
                    queue: s(),
                    text: s(),
                }),
                Failure::Refused,
            ),
            (
                Box::new(Amqp::Refused {
                    what: s(),
                    text: s(),
                }),
                Failure::Refused,
            ),
            (
                Box::new(Mgmt::Unreachable {
                    url: s(),
                    detail: s(),
                }),
                Failure::Unreachable,
            ),
            (
                Box::new(Mgmt::Unauthorized {
                    url: s(),
                    status: 401,
                }),
                Failure::AuthFailed,
            ),
            (
                Box::new(Mgmt::Status {
                    path: s(),
                    status: 500,
                    detail: s(),
                }),
                Failure::Refused,
            ),
            (Box::new(Mgmt::BadConfig(s())), Failure::Refused),
            (
                Box::new(Sqs::Unreachable {
                    operation: "ListQueues",
                    detail: s(),
                }),
                Failure::Unreachable,
            ),
            (
                Box::new(Sqs::AuthFailed {
                    operation: "ListQueues",
                    detail: s(),
                }),
                Failure::AuthFailed,
            ),
            (
                Box::new(Sqs::Refused {
                    operation: "ListQueues",
                    detail: s(),
                }),
                Failure::Refused,
            ),
            (Box::new(NatsError::Unreachable(s())), Failure::Unreachable),
            (Box::new(NatsError::JetStreamDisabled), Failure::Refused),
            (Box::new(NatsError::StreamNotFound(s())), Failure::Refused),
        ];
        for (i, (e, class)) in classes.iter().enumerate() {
            assert_eq!(e.class(), *class, "row {i}");
            assert_eq!(
                e.is_unreachable(),
                *class == Failure::Unreachable,
                "row {i}"
            );
        }
    }
}
