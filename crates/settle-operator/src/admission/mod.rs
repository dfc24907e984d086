//! Admission: refuse at `kubectl apply` what the backend cannot honour.
//!
//! The rules themselves are `policy::validate` (pure, shared with the controller and the
//! runtime). Here: reading untrusted Subscriptions (`read`), `settle check` on files
//! (`offline`), the webhook that serves the rules to the API server over HTTPS (`webhook`), and
//! its serving certificate (`certs`). Nothing here may touch a broker.

pub mod certs;
pub mod offline;
mod read;
pub mod webhook;

pub use read::{
    MetadataUnderReview, SubscriptionUnderReview, read_subscription, read_subscription_under_review,
};
