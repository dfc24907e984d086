//! The account: every Subscription's delivery counters, folded from the runtime's stats reports
//! and the broker's own observations into `status.stats`, exact and never decreasing.
//!
//! - [`ledger`]: the pure arithmetic of one Subscription's account (which source counts what,
//!   restarts, folding, the never-backwards floor), tested directly with many cases.
//!
//! This module must not create or change consumers (that is `reconcile`), and must not import
//! `reconcile` or `admission` (siblings); it reads the broker through `backend`.

pub mod ledger;
