//! The account: every Subscription's delivery counters, folded from the runtime's stats reports
//! and the broker's own observations into `status.stats`, exact and never decreasing.
//!
//! - [`ledger`]: the pure arithmetic of one Subscription's account (which source counts what,
//!   restarts, folding, the never-backwards floor), tested directly with many cases.
//! - [`status`]: the pure part of what is written (stats, `Exhausting`, `Stranding`) and when.
//! - [`stall`]: the pure stall watch (`Stalled`: messages owed, no handler returned within the
//!   window).
//! - [`nats`]: one loop per NATS Backend: reads the reports and the advisory capture, keeps the
//!   ledgers (persisted on the broker), reads the gauges, asks the writer to write.
//! - [`rabbitmq`]: one loop per RabbitMQ Backend: consumes each Subscription's report queue,
//!   keeps the ledgers (a snapshot per Subscription on the broker), reads the gauges; its
//!   `dead_letters` counts the Backend's dead letters from a copy of its dead-letter exchange.
//! - [`sqs`]: one loop per SQS Backend: receives each Subscription's report queue, keeps the
//!   ledgers (a snapshot per Subscription in its ledger queue), reads the gauges;
//!   its `dead_letters` counts what the redrive moved to the dead-letter queue.
//! - [`early`]: reports held for Subscriptions not in the cache yet, within one budget for the
//!   process.
//! - [`queue_keeper`]: what the two report-queue keepers (`rabbitmq`, `sqs`) share, written once.
//! - [`show`]: what a keeper hands the writer, and when (shared by every keeper).
//! - [`writer`]: the one status writer (server-side apply, field manager `settle-account`),
//!   within the cluster-wide budget of [`budget`] (pure: which waiting patch goes next, and when).
//! - [`metrics`]: `settle_subscription_*` at full resolution.
//!
//! [`run`] keeps a keeper per Backend for as long as a leadership term lasts. This module
//! must not create or change consumers (that is `reconcile`), and must not import `reconcile` or
//! `admission` (siblings); it reads the broker through `backend`, and is handed the controllers'
//! caches and connections by the operator.

pub mod budget;
pub mod early;
pub mod ledger;
pub mod metrics;
pub mod nats;
pub mod queue_keeper;
pub mod rabbitmq;
pub mod show;
pub mod sqs;
pub mod stall;
pub mod status;
pub mod writer;

mod run;

pub use metrics::Metrics;
pub use run::*;
