//! Settle's library: what an application links to consume messages with Settle's semantics, and
//! what the operator builds on.
//!
//! Every import points down this order, and siblings on one level do not import each other:
//!
//! ```text
//! backend → bus → policy → api
//! ```
//!
//! - [`api`]: the CRD types and the wire types they share with the runtime.
//! - [`policy`]: pure rules: the capability table, the one `validate`, resolved defaults.
//! - [`bus`]: the handler runtime (settlement, modes, backoff, counters, conformance).
//! - [`backend`]: the brokers the runtime drives (memory, NATS JetStream, RabbitMQ, and SQS with
//!   the `sqs` feature); with the `admin` feature, also the calls only the operator makes.
//!
//! This crate must not run a Kubernetes controller, parse a command line, serve HTTP or install
//! a global tracing subscriber: that is the operator's (`settle-operator`), and an application
//! that links this crate compiles none of it.

// No unwrap() on a path a user or a broker can reach (unit tests may: clippy.toml).
#![warn(clippy::unwrap_used)]

pub mod api;
pub mod backend;
pub mod bus;
pub mod policy;
