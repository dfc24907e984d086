//! The Settle operator: admission that refuses at `kubectl apply` what the broker cannot honour,
//! the controllers that make the brokers' consumers, and the delivery account in status.
//!
//! Every import points down this order, and siblings on one level do not import each other; the
//! library below (`settle`: `backend → bus → policy → api`) is another crate, so an arrow into
//! this one does not compile:
//!
//! ```text
//! main → operator → {admission, reconcile, account} → settle::backend → … → settle::api
//! ```
//!
//! [`serve`] sits at the bottom: it imports nothing of the crate, so the webhook (`admission`)
//! and the metrics and probe ports (`operator`) share it. [`events`] sits there too, so the
//! controllers (`reconcile`) and the account share one way to publish Events, and
//! [`exposition`], so they write their per-Subscription series one way.
//!
//! - [`admission`]: the webhook and `settle check`, serving `settle::policy::validate`.
//! - [`account`]: the delivery account that fills `status.stats`: the pure ledger, a keeper per
//!   NATS, RabbitMQ and SQS Backend, the one status writer.
//! - [`reconcile`]: the controllers: Backend connections and status, Subscription → consumer.
//! - [`serve`]: bounded HTTP serving: the connection cap and every phase's deadline.
//! - [`events`]: Kubernetes Events, repeats folded into a series with a bounded memory of them.
//! - [`exposition`]: Prometheus text for series kept one row per Subscription, written when
//!   scraped.
//! - [`operator`]: the `settle operator` process (webhook, controllers, metrics, leader election).
//!
//! `settle import nack` is the `settle-import` crate; `kubectl settle` is `kubectl-settle`,
//! which reads this crate's condition names and nothing else of it.

// No unwrap() on a path a user or a broker can reach (unit tests may: clippy.toml).
#![warn(clippy::unwrap_used)]

pub mod account;
pub mod admission;
pub mod events;
pub mod exposition;
pub mod operator;
pub mod reconcile;
pub mod serve;
