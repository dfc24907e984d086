//! Backends: the brokers the runtime drives, each behind the `bus::Broker` seam.
//!
//! `memory` (in process, for tests and local development), `nats` (JetStream), `rabbitmq`
//! (AMQP 0-9-1) and `sqs` (Amazon SQS and compatible servers; the `sqs` feature). Anything that
//! names a broker's subject, header or config field lives under its folder here. This module must
//! not decide policy (that is `policy`) nor talk to Kubernetes.

pub mod memory;
pub mod nats;
pub mod rabbitmq;
#[cfg(feature = "sqs")]
pub mod sqs;
#[cfg(feature = "operator")]
pub mod term;

#[cfg(feature = "operator")]
pub use term::Term;

/// The controllers' live handle on a Backend's broker, by the Backend's namespace and name, as
/// they hand it to the account each leadership term: a NATS connection.
#[cfg(feature = "operator")]
pub type NatsLookup =
    std::sync::Arc<dyn Fn(&str, &str) -> Option<async_nats::Client> + Send + Sync>;

/// The same for a RabbitMQ or SQS Backend's queue gauges.
#[cfg(feature = "operator")]
pub type QueueLookup = std::sync::Arc<dyn Fn(&str, &str) -> Option<QueueGauges> + Send + Sync>;

/// The same for a RabbitMQ Backend's AMQP connection (made again first when it dropped); `None`
/// while the Backend has no working connection.
#[cfg(feature = "operator")]
pub type AmqpLookup = std::sync::Arc<
    dyn Fn(
            &str,
            &str,
        )
            -> futures::future::BoxFuture<'static, Option<std::sync::Arc<lapin::Connection>>>
        + Send
        + Sync,
>;

/// Where the account reads a managed queue's gauges on brokers without consumer info: a
/// RabbitMQ Backend's management API (and vhost), or an SQS Backend's client.
#[cfg(feature = "operator")]
#[derive(Clone)]
pub enum QueueGauges {
    Rabbitmq {
        management: Box<rabbitmq::management::Management>,
        vhost: String,
    },
    Sqs(aws_sdk_sqs::Client),
}

#[cfg(feature = "operator")]
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
