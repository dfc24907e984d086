//! Policy: everything pure about what a Subscription may ask and what a backend can honour.
//!
//! - [`capabilities`](BackendKind): the one capability table, and [`effective_capabilities`], the
//!   one resolver every caller uses (the webhook, `settle check`, the runtime, the controller).
//! - [`validate`] / [`validate_policy`] / [`validate_runtime`]: the one set of admission rules;
//!   [`unchanged`], the one that admits an update leaving the spec as it was (A14) before any
//!   Backend is looked up.
//! - [`validate_backend`] / [`backend_access`]: the Backend rules (URLs, Secret names, the Secret
//!   opt-in label, the broker host allow-list, SQS pod identity), for the webhook, `settle check`
//!   and the controller.
//! - [`ResolvedPolicy`]: a delivery policy with every default filled in, and the backoff schedule.
//! - [`Pause`]: what `spec.paused` / `spec.pausedUntil` ask at a given moment (the moment is
//!   the caller's: no clock here).
//!
//! This module must stay pure: no I/O, no clock, no Kubernetes or broker client. It imports only
//! `api`; everything else imports it.

mod backend;
mod capabilities;
mod pause;
mod resolved;
mod rules;

pub use backend::{
    BackendRules, CREDENTIALS_LABEL, CREDENTIALS_LABEL_VALUE, HostPattern, SecretView, URL_MAX,
    URLS_MAX, backend_access, backend_unchanged, plaintext_with_credentials, secrets_named,
    validate_backend,
};
pub use capabilities::{
    BackendKind, RABBITMQ_MAX_PREFETCH, capabilities_of, effective_capabilities,
};
pub use pause::Pause;
pub use resolved::{
    DEFAULT_ACK_WAIT, DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_PROCESSING_TIME, ResolvedPolicy, Schedule,
    schedule_delay,
};
pub use rules::{
    BackendView, FieldIssue, Verdict, unchanged, validate, validate_policy, validate_runtime,
};
