//! The admission webhooks: `POST /validate`, `POST /mutate` (and `GET /healthz`) over HTTPS.
//!
//! [`review`] turns one AdmissionReview body into one answer without a network: it reads the
//! Subscription (and the stored one on UPDATE), looks up the Backend it names through a
//! [`BackendLookup`], and asks the one `policy::validate` for the verdict; a Backend is judged by
//! `policy::validate_backend`, with the labels of the Secrets it names (never their data); an UPDATE that leaves
//! the spec as it was, or of a Subscription being deleted, is allowed from the body alone, so the
//! webhook never blocks a cleanup (docs/semantics.md A14). [`Server`] serves
//! it over rustls with a certificate from `admission::certs`, with metrics and a log line per
//! decision. [`mutate`] answers the mutating webhook: it puts the operator's finalizer on a
//! Subscription at CREATE and UPDATE, and nothing else.
//!
//! This module must not write admission rules (they live in `policy::rules`), must not change
//! anything anywhere but the finalizer of the Subscription under review (both webhooks declare
//! `sideEffects: None`; `dryRun` requests are handled exactly like the others), and must never
//! panic or hang on what a client sends: malformed input gets a 400 or a denial that says why,
//! and a Backend it cannot read fails closed.
//!
//! The parts: `lookup` (finding Backends), `review` (one body, one answer), `mutate` (the
//! finalizer), `metrics` and `server` (HTTPS: the body limit and reading turns; the connection
//! cap and each connection's deadlines are `crate::serve`'s).

mod lookup;
mod metrics;
mod mutate;
mod review;
mod server;

use std::time::Duration;

pub use crate::serve::CLOSE_GRACE;
pub use lookup::{BackendLookup, LookupError, StaticLookup, StoreLookup};
pub use metrics::WebhookMetrics;
pub use review::{review, review_with};
pub use server::{DEFAULT_MAX_BODY_BYTES, Server, WebhookConfig, WebhookError};

/// How long a Backend lookup may take before the webhook gives up and denies (fail closed);
/// well inside the API server's 10 s webhook timeout.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(3);
