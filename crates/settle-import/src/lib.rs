//! `settle import nack` (and `kubectl settle import nack`): moving consumers from NATS's own
//! controller, NACK, to Settle without losing their position.
//!
//! NACK's `Consumer` resources (`jetstream.nats.io`) become Subscriptions with
//! `adopt: IfCompatible`, so Settle takes over the very consumer NACK made, and NACK's servers,
//! credentials and `Account` references become Backends. Every NACK field is accounted for: carried
//! over, flagged as one of NACK's unsafe defaults, or named as something Settle cannot express,
//! with why and the fix.
//!
//! - [`nack`]: the conversion, pure: NACK's resources in, a [`Migration`] out; each Subscription
//!   and Backend it writes has passed `policy::validate` / `policy::validate_backend`, so what it
//!   writes is never refused at admission.
//! - [`render`]: the Migration as YAML with the findings as comments, and as lines for stderr.
//! - [`cluster`]: NACK's resources read from an API server (`--from-cluster`).
//! - [`run_nack`]: the command both binaries call: reads the input, converts, writes, and says
//!   how it went in its exit status.
//!
//! A crate of its own: it uses the library's `policy` and `api` only, and both binaries (the
//! operator's `settle` and `kubectl-settle`) call it. It must not write to the cluster or talk
//! to a broker: the user reviews and applies what it writes, and Settle's operator does the
//! taking over.

// No unwrap() on a path a user or a broker can reach (unit tests may: clippy.toml).
#![warn(clippy::unwrap_used)]

pub mod cluster;
pub mod nack;
pub mod render;
mod run;

use std::fmt;

use settle::api::{BackendSpec, SubscriptionSpec};

/// How serious a finding is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Something to know or to do (a Secret to create, a setting Settle writes its own way);
    /// delivery behaves as before.
    Note,
    /// A NACK setting (often its default) that risks losing or flooding messages, carried over as
    /// it is: delivery behaves as before, and the message says what to change.
    Unsafe,
    /// The Subscription would not behave as the NACK consumer did (or Settle cannot take the
    /// consumer over): written only with `--allow-changes`.
    Change,
    /// No Subscription can be written for it (admission would refuse it, or Settle cannot express
    /// it at all).
    Refused,
}

impl Severity {
    pub fn label(self) -> &'static str {
        match self {
            Severity::Note => "note",
            Severity::Unsafe => "unsafe",
            Severity::Change => "change",
            Severity::Refused => "refused",
        }
    }
}

/// One thing the conversion found about one field of a NACK resource.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub severity: Severity,
    /// The NACK field, e.g. `spec.ackWait` (or Settle's, prefixed `settle `, for what admission said).
    pub field: String,
    /// What it is, why it matters, and what to do.
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<7} {}: {}",
            self.severity.label(),
            self.field,
            self.message
        )
    }
}

/// One NACK Consumer and the Subscription made of it.
#[derive(Clone, Debug, PartialEq)]
pub struct SubscriptionPlan {
    pub namespace: String,
    pub name: String,
    /// The JetStream stream and consumer NACK made (`STREAM/CONSUMER`), as far as known.
    pub consumer: String,
    /// `None` when a finding is [`Severity::Refused`].
    pub spec: Option<SubscriptionSpec>,
    pub findings: Vec<Finding>,
}

impl SubscriptionPlan {
    /// The most serious finding's severity (Note when there is none).
    pub fn worst(&self) -> Severity {
        self.findings
            .iter()
            .map(|f| f.severity)
            .max()
            .unwrap_or(Severity::Note)
    }

    /// Whether it is written as a manifest (rather than only as a comment).
    pub fn written(&self, allow_changes: bool) -> bool {
        self.spec.is_some()
            && match self.worst() {
                Severity::Refused => false,
                Severity::Change => allow_changes,
                Severity::Note | Severity::Unsafe => true,
            }
    }
}

/// One Backend: a NATS server set with its credentials, or a NACK Account.
#[derive(Clone, Debug, PartialEq)]
pub struct BackendPlan {
    pub namespace: String,
    pub name: String,
    pub spec: BackendSpec,
    /// What it was made from, e.g. `NACK Account shop/orders-account`.
    pub from: String,
    /// Commands to run before applying it (the Secrets it names), one a line.
    pub steps: Vec<String>,
    pub findings: Vec<Finding>,
}

impl BackendPlan {
    pub fn refused(&self) -> bool {
        self.findings
            .iter()
            .any(|f| f.severity == Severity::Refused)
    }
}

/// Everything the conversion made and found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Migration {
    pub backends: Vec<BackendPlan>,
    pub subscriptions: Vec<SubscriptionPlan>,
    /// What applies to the whole migration (Streams not migrated, stopping NACK first).
    pub notes: Vec<String>,
}

impl Migration {
    /// Whether everything found can be written as it is asked: no Subscription or Backend refused,
    /// and no change of behaviour unless `allow_changes`.
    pub fn clean(&self, allow_changes: bool) -> bool {
        self.subscriptions.iter().all(|s| s.written(allow_changes))
            && self.backends.iter().all(|b| !b.refused())
    }
}

pub use run::{ClusterFlags, EXIT_INPUT, EXIT_NOT_ALL, EXIT_OK, NackArgs, connect, run_nack};
