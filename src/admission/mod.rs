//! Admission: refuse at `kubectl apply` what the backend cannot honour.
//!
//! `rules` holds the one pure `validate` that the webhook, `settle check`, the controller and the
//! runtime all call. Nothing here may touch a broker. `webhook` serves `validate` to the API
//! server over HTTPS; `certs` provides and rotates its serving certificate.

#[cfg(feature = "operator")]
pub mod certs;
pub mod offline;
mod read;
mod rules;
#[cfg(feature = "operator")]
pub mod webhook;

pub use read::{
    NameAndNamespace, SubscriptionUnderReview, read_subscription, read_subscription_under_review,
};
pub use rules::{BackendView, FieldIssue, Verdict, validate, validate_policy};
