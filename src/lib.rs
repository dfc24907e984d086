//! Settle: message subscriptions as Kubernetes resources, with admission that refuses what the
//! broker cannot honour and an honest delivery account in status.
//!
//! Every import points down this order, and siblings on one level do not import each other:
//!
//! ```text
//! main → operator → {admission, reconcile, account} → backend → bus → policy → api
//! ```
//!
//! [`plugin`] (`kubectl settle`) is a top-level like `main`, beside `operator`: it reads what the
//! lower layers define and neither of the two imports the other.
//!
//! [`migrate`] (`settle import nack`) sits beside `admission`: it uses `policy` and `api`, and
//! `main` and `plugin` call it.
//!
//! [`serve`] sits at the bottom beside `api`: it imports nothing of the crate, so the webhook
//! (`admission`) and the metrics and probe ports (`operator`) share it. [`events`] sits there
//! too, so the controllers (`reconcile`) and the account share one way to publish Events, and
//! [`exposition`], so they write their per-Subscription series one way.
//!
//! - [`api`]: the CRD types and the wire types they share with the runtime.
//! - [`policy`]: pure rules: the capability table, the one `validate`, resolved defaults.
//! - [`bus`]: the handler runtime (settlement, modes, backoff, counters, conformance).
//! - [`backend`]: the brokers the runtime drives (memory, NATS JetStream, RabbitMQ, SQS) and the
//!   operator's calls to them.
//! - [`admission`]: the webhook and `settle check`, serving `policy::validate`.
//! - [`account`]: the delivery account that fills `status.stats`: the pure ledger, a keeper per
//!   NATS, RabbitMQ and SQS Backend, the one status writer.
//! - [`reconcile`]: the controllers: Backend connections and status, Subscription → consumer.
//! - [`serve`]: bounded HTTP serving: the connection cap and every phase's deadline.
//! - [`events`]: Kubernetes Events, repeats folded into a series with a bounded memory of them.
//! - [`exposition`]: Prometheus text for series kept one row per Subscription, written when
//!   scraped.
//! - [`operator`]: the `settle operator` process (webhook, controllers, metrics, leader election).
//! - [`migrate`]: `settle import nack`: NACK's Consumers as Subscriptions and Backends.
//! - [`plugin`]: `kubectl settle` (`status`, `explain`), rendering what status already says.

// No unwrap() on a path a user or a broker can reach (unit tests may: clippy.toml).
#![warn(clippy::unwrap_used)]

pub mod account;
pub mod admission;
pub mod api;
pub mod backend;
pub mod bus;
#[cfg(feature = "operator")]
pub mod events;
pub mod exposition;
#[cfg(feature = "operator")]
pub mod migrate;
#[cfg(feature = "operator")]
pub mod operator;
#[cfg(feature = "operator")]
pub mod plugin;
pub mod policy;
#[cfg(feature = "operator")]
pub mod reconcile;
#[cfg(feature = "operator")]
pub mod serve;
