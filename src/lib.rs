//! Settle: message subscriptions as Kubernetes resources, with admission that refuses what the
//! broker cannot honour and an honest delivery account in status.
//!
//! - [`api`]: the CRD types and the wire types they share with the runtime.
//! - [`backend`]: backend kinds and their capabilities.
//! - [`admission`]: the one `validate` of what a backend can honour.
//! - [`operator`]: the `settle operator` process (webhook, metrics, leader election; controllers
//!   to come).
//! - [`bus`]: the handler runtime of seed 000 (settlement, modes, backoff, counters, conformance).

pub mod admission;
pub mod api;
pub mod backend;
pub mod bus;
#[cfg(feature = "operator")]
pub mod operator;
