//! The conditions this writer owns (`Accepted`, `Ready`, `Paused`) and their reasons as constants in one
//! place (code, tests, README and the alerts read these). The arithmetic (keep
//! `lastTransitionTime` when a condition did not change, compare ignoring times) is
//! `api::condition`'s, shared with the account's writer.
//!
//! Pure: no I/O and no clock (callers pass `now`). It must not decide when to reconcile.

/// Condition types.
pub mod types {
    /// The spec is valid for its backend (the admission rules, checked again by the controller).
    pub const ACCEPTED: &str = "Accepted";
    /// The broker holds what the spec asks for (a Subscription's consumer; a Backend's connection).
    pub const READY: &str = "Ready";
    /// Delivery is paused as `spec.paused` asks (written once a Subscription was ever paused).
    pub const PAUSED: &str = "Paused";
}

/// Reasons, each one a person can act on (the README's table says what to do for each).
pub mod reasons {
    // Accepted
    /// The spec passes the admission rules for its backend.
    pub const VALID: &str = "Valid";
    /// The spec breaks an admission rule (it got in while the webhook was not running).
    pub const INVALID: &str = "Invalid";

    // Ready, Subscription
    /// The consumer (or queue, with its binding or dead-letter queue) exists and matches the spec.
    pub const CONSUMER_READY: &str = "ConsumerReady";
    /// The spec is not accepted, so no consumer is made.
    pub const NOT_ACCEPTED: &str = "NotAccepted";
    /// The Backend named by spec.backendRef does not exist.
    pub const BACKEND_NOT_FOUND: &str = "BackendNotFound";
    /// The Backend exists but Settle has no working connection to it.
    pub const BACKEND_NOT_READY: &str = "BackendNotReady";
    /// The named stream does not exist, or no stream carries the pattern.
    pub const STREAM_NOT_FOUND: &str = "StreamNotFound";
    /// More than one stream carries the pattern.
    pub const STREAM_AMBIGUOUS: &str = "StreamAmbiguous";
    /// The live consumer (or RabbitMQ queue) differs in a field the broker cannot change in place.
    pub const IMMUTABLE_FIELD: &str = "ImmutableField";
    /// A consumer (or queue) of that name exists and belongs to something else.
    pub const CONSUMER_CONFLICT: &str = "ConsumerConflict";
    /// The broker refused a call for a reason not listed here (the message carries its words).
    pub const BROKER_REFUSED: &str = "BrokerRefused";
    /// RabbitMQ lists the queue but runs nothing for it (no state in its management API past
    /// its statistics interval, or down or crashed): it refuses what is published to it and
    /// never answers a consumer.
    pub const QUEUE_UNAVAILABLE: &str = "QueueUnavailable";
    /// The broker refused to make the consumer (or queue) for one of its limits (a stream's
    /// `max_consumers`, the account's resources, a vhost's `max-queues`): the message names it
    /// and what to change. Settle asks again after a growing delay, once per Backend and limit.
    pub const BROKER_LIMIT: &str = "BrokerLimit";
    /// The Backend's kind runs its consumers inside the application (memory).
    pub const IN_PROCESS: &str = "InProcess";

    // Paused, Subscription
    /// Paused=True: the broker holds the pause the spec asks for; nothing is offered.
    pub const PAUSED_BY_SPEC: &str = "PausedBySpec";
    /// Paused=False: delivery runs (`spec.paused` false, or `pausedUntil` reached).
    pub const NOT_PAUSED: &str = "NotPaused";
    /// Paused=Unknown: the spec asks for a pause, and the consumer is not Ready, so whether the
    /// broker holds it is not known (see Ready).
    pub const PAUSE_NOT_APPLIED: &str = "PauseNotApplied";
    /// Paused=False: the memory backend runs in the application, where Settle cannot pause it.
    pub const PAUSE_NOT_SUPPORTED: &str = "PauseNotSupported";

    // Ready, Backend (and Subscription, when the broker is the problem)
    /// Connected, and the broker answers (JetStream; RabbitMQ's AMQP and management API; SQS's
    /// ListQueues).
    pub const CONNECTED: &str = "Connected";
    /// No server answered.
    pub const UNREACHABLE: &str = "Unreachable";
    /// The server refused the credentials.
    pub const AUTH_FAILED: &str = "AuthFailed";
    /// The server answers but runs without JetStream.
    pub const JETSTREAM_DISABLED: &str = "JetStreamDisabled";
    /// A Secret the Backend names does not exist, cannot be read, or lacks the keys it needs.
    pub const SECRET_MISSING: &str = "SecretMissing";
    /// Ready=False: a Secret the Backend names lacks the opt-in label (A18); never read.
    pub const SECRET_NOT_LABELLED: &str = "SecretNotLabelled";
    /// Ready=False: a broker host is not in `--allowed-broker-hosts` (A19); not connected.
    pub const HOST_NOT_ALLOWED: &str = "HostNotAllowed";
    /// Ready=False: its namespace has more Backends than `--max-backends-per-namespace`, and
    /// this one is not among the oldest that many; not connected.
    pub const BACKEND_LIMIT: &str = "BackendLimit";
    /// Ready=False: a RabbitMQ Backend on a vhost an older Backend of another namespace uses,
    /// and not both consent (`spec.rabbitmq.sharedVhost`); not connected. Ready=True: both
    /// consent; connected, and the message says what a shared vhost leaves unprotected.
    pub const SHARED_VHOST: &str = "SharedVhost";
    /// Ready=False: SQS without a Secret outside `--sqs-pod-identity-namespaces` (A20).
    pub const POD_IDENTITY_NOT_ALLOWED: &str = "PodIdentityNotAllowed";
    /// Ready=True: connected, but the credentials travel unencrypted (A21); also a Warning Event.
    pub const PLAINTEXT_CREDENTIALS: &str = "PlaintextCredentials";
    /// The Backend's settings cannot be used (an URL that does not parse, no SQS region, a
    /// management API that answers something else).
    pub const BAD_CONFIG: &str = "BadConfig";
}

/// Kubernetes Event reasons.
pub mod events {
    pub const CREATED: &str = "Created";
    pub const UPDATED: &str = "Updated";
    pub const DELETED: &str = "Deleted";
    /// The consumer was gone from the broker (deleted there, or lost) and was made again.
    pub const RECREATED: &str = "Recreated";
    pub const RETAINED: &str = "Retained";
    /// A Warning: the Subscription (deletionPolicy Delete) was deleted after its Backend, so its
    /// consumer or queue stays on the broker (also counted in `settle_consumers_left_total`).
    pub const LEFT_ON_BROKER: &str = "LeftOnBroker";
    /// A queue an earlier object of the Subscription's name left was taken over, as its
    /// `settle.dev/adopt` annotation asked.
    pub const ADOPTED: &str = "Adopted";
    /// The broker object was paused as `spec.paused` asks (JetStream's pause, or the marker the
    /// RabbitMQ and SQS runtimes poll), or paused again after someone resumed it by hand.
    pub const PAUSED: &str = "Paused";
    /// The pause was lifted on the broker (`spec.paused` false, or `pausedUntil` reached).
    pub const RESUMED: &str = "Resumed";
    pub const INVALID: &str = "InvalidSpec";
    pub const FAILED: &str = "ReconcileFailed";
}

pub use settle::api::condition::{Status, Want, conditions_current, find, settle};

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    use k8s_openapi::jiff::Timestamp;

    fn at(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).expect("a valid time"))
    }

    fn cond(type_: &str, status: &str, reason: &str, message: &str, t: i64) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: message.into(),
            observed_generation: Some(1),
            last_transition_time: at(t),
        }
    }

    #[test]
    fn a_new_condition_transitions_now() {
        let w = Want::new(types::READY, Status::True, reasons::CONSUMER_READY, "ok");
        let c = settle(&[], &w, Some(1), &at(100));
        assert_eq!(c.last_transition_time, at(100));
        assert_eq!(c.status, "True");
        assert_eq!(c.reason, "ConsumerReady");
    }

    #[test]
    fn the_transition_time_moves_only_when_the_status_changes() {
        let existing = vec![cond("Ready", "False", "Unreachable", "down", 50)];
        let cases = [
            // (status, reason, keeps the old time)
            (Status::False, reasons::UNREACHABLE, true),
            (Status::False, reasons::STREAM_NOT_FOUND, true),
            (Status::True, reasons::CONSUMER_READY, false),
        ];
        for (status, reason, keeps) in cases {
            let w = Want::new(types::READY, status, reason, "m");
            let c = settle(&existing, &w, Some(2), &at(100));
            let want = if keeps { at(50) } else { at(100) };
            assert_eq!(c.last_transition_time, want, "{status:?} {reason}");
            assert_eq!(c.observed_generation, Some(2));
        }
    }

    #[test]
    fn another_writers_condition_does_not_count() {
        let existing = vec![cond("Exhausting", "False", "NoLoss", "", 50)];
        let w = Want::new(types::READY, Status::False, reasons::UNREACHABLE, "");
        assert_eq!(
            settle(&existing, &w, Some(1), &at(100)).last_transition_time,
            at(100)
        );
    }

    #[test]
    fn current_conditions_compare_equal_whatever_their_time() {
        let existing = vec![
            cond("Accepted", "True", "Valid", "", 10),
            cond("Ready", "True", "ConsumerReady", "ok", 20),
            cond("Stranding", "False", "None", "", 30),
        ];
        let ours = vec![
            cond("Accepted", "True", "Valid", "", 99),
            cond("Ready", "True", "ConsumerReady", "ok", 99),
        ];
        assert!(conditions_current(&existing, &ours));
        for (i, field) in ["status", "reason", "message", "generation"]
            .iter()
            .enumerate()
        {
            let mut changed = ours.clone();
            match i {
                0 => changed[1].status = "False".into(),
                1 => changed[1].reason = "Other".into(),
                2 => changed[1].message = "other".into(),
                _ => changed[1].observed_generation = Some(2),
            }
            assert!(!conditions_current(&existing, &changed), "{field}");
        }
        assert!(
            !conditions_current(&existing[..1], &ours),
            "a missing condition is not current"
        );
    }

    #[test]
    fn reasons_are_pascal_case_and_distinct() {
        let all = [
            reasons::VALID,
            reasons::INVALID,
            reasons::CONSUMER_READY,
            reasons::NOT_ACCEPTED,
            reasons::BACKEND_NOT_FOUND,
            reasons::BACKEND_NOT_READY,
            reasons::STREAM_NOT_FOUND,
            reasons::STREAM_AMBIGUOUS,
            reasons::IMMUTABLE_FIELD,
            reasons::CONSUMER_CONFLICT,
            reasons::BROKER_REFUSED,
            reasons::BROKER_LIMIT,
            reasons::IN_PROCESS,
            reasons::PAUSED_BY_SPEC,
            reasons::NOT_PAUSED,
            reasons::PAUSE_NOT_APPLIED,
            reasons::PAUSE_NOT_SUPPORTED,
            reasons::CONNECTED,
            reasons::UNREACHABLE,
            reasons::AUTH_FAILED,
            reasons::JETSTREAM_DISABLED,
            reasons::SECRET_MISSING,
        ];
        let mut seen = std::collections::BTreeSet::new();
        for r in all {
            assert!(
                r.chars().next().is_some_and(|c| c.is_ascii_uppercase()),
                "{r}"
            );
            assert!(r.chars().all(|c| c.is_ascii_alphanumeric()), "{r}");
            assert!(seen.insert(r), "{r} twice");
        }
    }
}
