//! The capability table: what each backend kind can honour (docs/semantics.md K1–K10).
//!
//! Settle drives every kind in the table: `nats`, `rabbitmq`, `sqs` and `memory`; `settle check
//! --backend-kind` can say what a spec would need on that broker.

use std::fmt;
use std::str::FromStr;

use crate::api::{AckTimeout, Backend, BackendSpec, Capabilities, Duration};

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
    /// RabbitMQ without plugins: no delayed redelivery; never hands a message on while the
    /// channel that received it lives; prefetch is a 16-bit count.
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
        match (&spec.nats, &spec.rabbitmq, &spec.sqs, &spec.memory) {
            (Some(_), None, None, None) => Some(BackendKind::Nats),
            (None, Some(_), None, None) => Some(BackendKind::Rabbitmq),
            (None, None, Some(_), None) => Some(BackendKind::Sqs),
            (None, None, None, Some(_)) => Some(BackendKind::Memory),
            _ => None,
        }
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

/// The largest `basic.qos` prefetch-count AMQP 0-9-1 can carry (a 16-bit field).
pub const RABBITMQ_MAX_PREFETCH: u32 = 65_535;

/// What a backend of this kind can honour.
pub fn capabilities_of(kind: BackendKind) -> Capabilities {
    match kind {
        BackendKind::Nats => Capabilities {
            delays_redelivery: true,
            max_redelivery_delay: None,
            restart_can_spend_unseen_attempt: true,
            subject_names_queue: false,
            ack_timeout: AckTimeout::PerSubscription,
            max_in_flight: None,
            max_deliver_fixed: false,
            named_streams: true,
        },
        BackendKind::Memory => Capabilities {
            delays_redelivery: true,
            max_redelivery_delay: None,
            restart_can_spend_unseen_attempt: false,
            subject_names_queue: false,
            ack_timeout: AckTimeout::Never,
            max_in_flight: None,
            max_deliver_fixed: false,
            named_streams: true,
        },
        BackendKind::Sqs => Capabilities {
            delays_redelivery: true,
            max_redelivery_delay: Some(Duration::from_secs(12 * 3600)),
            restart_can_spend_unseen_attempt: true,
            subject_names_queue: true,
            ack_timeout: AckTimeout::PerSubscription,
            max_in_flight: None,
            max_deliver_fixed: false,
            named_streams: false,
        },
        // Without plugins a nack requeues at once (no delay); the broker hands a message on only
        // when the channel that holds it closes (after its broker-wide consumer_timeout, 30 min
        // by default in 3.10); a quorum queue counts every return, the channel's close included,
        // so a restart can spend an unseen attempt; basic.qos prefetch-count is 16 bits.
        BackendKind::Rabbitmq => Capabilities {
            delays_redelivery: false,
            max_redelivery_delay: None,
            restart_can_spend_unseen_attempt: true,
            subject_names_queue: false,
            ack_timeout: AckTimeout::BrokerWide,
            max_in_flight: Some(RABBITMQ_MAX_PREFETCH),
            max_deliver_fixed: true,
            named_streams: false,
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
