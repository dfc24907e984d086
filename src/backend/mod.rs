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
