//! What a reconcile concluded, and the status it means, for the fields this writer owns. Split by
//! what each part builds:
//!
//! - [`object`]: what a Subscription's broker object is and whose ([`ObjectKind`], [`Holder`]),
//!   and the sentences `Ready` says about it;
//! - [`broker`]: a failed broker call ([`BrokerError`]) and the reason and message it means;
//! - [`subscription`]: a Subscription's outcome ([`SubOutcome`]) and its status patch
//!   (`observedGeneration`, `consumer`, `Accepted`, `Ready`);
//! - [`backend`]: a Backend's outcome ([`BackendOutcome`]) and its status patch
//!   (`observedGeneration`, `serverVersion`, `capabilities`, `Ready`).
//!
//! Pure: no I/O, no clock (callers pass `now`). It must not write the stats or conditions the
//! account owns, nor decide what a broker step does or when to reconcile again.

pub mod backend;
pub mod broker;
pub mod object;
pub mod subscription;

pub use backend::{BackendOutcome, BackendStatusPatch, backend_status};
pub use broker::{BrokerError, broker_reason};
pub use object::{ADOPT_ANNOTATION, Holder, ObjectKind, Unadoptable};
pub use subscription::{SubOutcome, SubStatusPatch, subscription_status};
