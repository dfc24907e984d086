//! The capability table: what each backend kind can honour (docs/semantics.md K1–K6).
//!
//! Settle drives `nats`, `memory` and `sqs`; `rabbitmq` is listed so that `settle check
//! --backend-kind` can say what a spec would need on that broker.

use std::fmt;
use std::str::FromStr;

use crate::api::{Backend, BackendSpec, Capabilities, Duration};

/// A kind of backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// NATS JetStream: holds a declined message for any delay (`-NAK {"delay":…}`); a restart
    /// can spend an attempt no handler saw (the server counts a delivery when it sends it).
    Nats,
    /// The in-memory runtime backend: delays in process, never loses an unseen attempt.
    Memory,
    /// Amazon SQS: delays by visibility timeout, at most 12 h from first receive; a subject is a
    /// queue's name.
    Sqs,
    /// RabbitMQ without plugins (not driven yet): no delayed redelivery.
    Rabbitmq,
}

impl BackendKind {
    pub const ALL: [BackendKind; 4] = [
        BackendKind::Nats,
        BackendKind::Memory,
        BackendKind::Sqs,
        BackendKind::Rabbitmq,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Nats => "nats",
            BackendKind::Memory => "memory",
            BackendKind::Sqs => "sqs",
            BackendKind::Rabbitmq => "rabbitmq",
        }
    }

    /// The kind a Backend spec names, if exactly one is set (the API server enforces that).
    pub fn of(spec: &BackendSpec) -> Option<BackendKind> {
        match (&spec.nats, &spec.memory, &spec.sqs) {
            (Some(_), None, None) => Some(BackendKind::Nats),
            (None, Some(_), None) => Some(BackendKind::Memory),
            (None, None, Some(_)) => Some(BackendKind::Sqs),
            _ => None,
        }
    }

    /// Whether Settle can run a consumer on this kind today.
    pub fn driven(self) -> bool {
        matches!(
            self,
            BackendKind::Nats | BackendKind::Memory | BackendKind::Sqs
        )
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        BackendKind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                format!("unknown backend kind {s:?}: expected one of nats, memory, sqs, rabbitmq")
            })
    }
}

/// What a backend of this kind can honour.
pub fn capabilities_of(kind: BackendKind) -> Capabilities {
    match kind {
        BackendKind::Nats => Capabilities {
            delays_redelivery: true,
            max_redelivery_delay: None,
            restart_can_spend_unseen_attempt: true,
            subject_names_queue: false,
        },
        BackendKind::Memory => Capabilities {
            delays_redelivery: true,
            max_redelivery_delay: None,
            restart_can_spend_unseen_attempt: false,
            subject_names_queue: false,
        },
        BackendKind::Sqs => Capabilities {
            delays_redelivery: true,
            max_redelivery_delay: Some(Duration::from_secs(12 * 3600)),
            restart_can_spend_unseen_attempt: true,
            subject_names_queue: true,
        },
        BackendKind::Rabbitmq => Capabilities {
            delays_redelivery: false,
            max_redelivery_delay: None,
            restart_can_spend_unseen_attempt: true,
            subject_names_queue: false,
        },
    }
}

/// The capabilities of a Backend, as every caller must resolve them: what its status says (the
/// controller's view of the live broker and its version) first, else its kind's row in the table.
/// `None` when the spec does not name exactly one kind (the API server refuses such a spec).
pub fn effective_capabilities(backend: &Backend) -> Option<Capabilities> {
    backend
        .status
        .as_ref()
        .and_then(|s| s.capabilities.clone())
        .or_else(|| BackendKind::of(&backend.spec).map(capabilities_of))
}
