//! Admission: refuse at `kubectl apply` what the backend cannot honour.
//!
//! `rules` holds the one pure `validate` that the webhook, `settle check`, the controller and the
//! runtime all call. Nothing here may touch a broker.

pub mod offline;
mod rules;

pub use rules::{BackendView, FieldIssue, Verdict, validate, validate_policy};
