//! A broker call that failed ([`BrokerError`], by kind) and the `Ready` reason and message it
//! means: what to do, not the raw error. Both writers' outcomes use it (a Subscription's step
//! that failed, a Backend whose JetStream does not answer).
//!
//! Pure: no I/O. It must not retry or decide requeues (the controllers do).

use crate::reconcile::conditions::reasons;
use settle::backend::limit::BrokerLimit;
use settle::backend::nats::admin::NatsError;
use settle::backend::{Classify, Failure};

/// A broker call that failed, by kind.
#[derive(Clone, Debug, PartialEq)]
pub enum BrokerError {
    Nats(NatsError),
    /// RabbitMQ or SQS did not answer (down, reconnecting, timed out): tried again.
    Unreachable(String),
    /// RabbitMQ or SQS refused the credentials.
    AuthFailed(String),
    /// RabbitMQ or SQS refused the call (its words).
    Refused(String),
    /// RabbitMQ refused a create for one of its limits.
    Limit(BrokerLimit),
    /// RabbitMQ lists the queue but runs nothing for it.
    Unavailable(String),
}

impl From<NatsError> for BrokerError {
    fn from(e: NatsError) -> Self {
        BrokerError::Nats(e)
    }
}

impl std::fmt::Display for BrokerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BrokerError::Nats(e) => e.fmt(f),
            BrokerError::Limit(l) => l.fmt(f),
            BrokerError::Unreachable(m)
            | BrokerError::AuthFailed(m)
            | BrokerError::Refused(m)
            | BrokerError::Unavailable(m) => f.write_str(m),
        }
    }
}

impl BrokerError {
    /// A RabbitMQ or SQS error (a connection, an AMQP or management call, an SQS call), by the
    /// class it names. A NATS error goes in whole ([`BrokerError::Nats`]): its reasons are finer.
    pub fn of<E: Classify + std::fmt::Display>(e: E) -> BrokerError {
        if let Some(l) = e.limit() {
            return BrokerError::Limit(l);
        }
        let message = e.to_string();
        match e.class() {
            Failure::Unreachable => BrokerError::Unreachable(message),
            Failure::AuthFailed => BrokerError::AuthFailed(message),
            Failure::Refused => BrokerError::Refused(message),
        }
    }

    /// The limit that refused a create, if that is why it failed.
    pub fn limit(&self) -> Option<&BrokerLimit> {
        match self {
            BrokerError::Nats(e) => e.limit(),
            BrokerError::Limit(l) => Some(l),
            _ => None,
        }
    }

    /// Whether the broker could not be asked at all (what it holds is then not known).
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            BrokerError::Nats(NatsError::Unreachable(_)) | BrokerError::Unreachable(_)
        )
    }
}

/// The Ready reason and message for a failed broker call: what to do, not the raw error.
pub fn broker_reason(e: &BrokerError) -> (&'static str, String) {
    if let Some(l) = e.limit() {
        return (reasons::BROKER_LIMIT, limit_message(l));
    }
    let e = match e {
        BrokerError::Nats(e) => e,
        BrokerError::Unreachable(m) => {
            return (
                reasons::UNREACHABLE,
                format!("{m}; Settle retries, and re-converges the queue when the broker is back"),
            );
        }
        BrokerError::AuthFailed(m) => {
            return (
                reasons::AUTH_FAILED,
                format!("{m}; fix the Backend's credentials Secret, Settle picks up the change"),
            );
        }
        BrokerError::Limit(l) => return (reasons::BROKER_LIMIT, limit_message(l)),
        BrokerError::Unavailable(m) => {
            return (
                reasons::QUEUE_UNAVAILABLE,
                format!(
                    "{m}: publishes to it are refused and its consumers wait. A quorum queue made just before its node crashed can stay so: restart the node, or delete the queue on the broker (what it holds is lost) and Settle makes it again"
                ),
            );
        }
        BrokerError::Refused(m) => {
            return (
                reasons::BROKER_REFUSED,
                format!(
                    "{m}; check the Subscription against the broker's limits, and the operator's log"
                ),
            );
        }
    };
    match e {
        NatsError::Unreachable(_) => (
            reasons::UNREACHABLE,
            format!("{e}; Settle retries, and re-converges the consumer when the server is back"),
        ),
        NatsError::JetStreamDisabled => (reasons::JETSTREAM_DISABLED, e.to_string()),
        NatsError::StreamNotFound(_) | NatsError::NoStreamFor(_) => {
            (reasons::STREAM_NOT_FOUND, e.to_string())
        }
        NatsError::StreamAmbiguous { .. } => (reasons::STREAM_AMBIGUOUS, e.to_string()),
        NatsError::Limit(l) => (reasons::BROKER_LIMIT, limit_message(l)),
        NatsError::Api { .. } => (
            reasons::BROKER_REFUSED,
            format!(
                "{e}; check the Subscription against the broker's limits, and the operator's log"
            ),
        ),
    }
}

/// A limit's message: which limit, what to change, and when Settle asks again (the gate's most,
/// not its current delay: the message stays the same while the delay grows, so the refused
/// Subscriptions' status is not rewritten at each try).
fn limit_message(l: &BrokerLimit) -> String {
    format!(
        "{l}; Settle asks the broker again after a growing delay (at most {} min), and at once {}",
        crate::reconcile::gate::MOST.as_secs() / 60,
        l.freed_by()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_map_from_broker_errors() {
        let cases = [
            (NatsError::Unreachable("x".into()), reasons::UNREACHABLE),
            (NatsError::JetStreamDisabled, reasons::JETSTREAM_DISABLED),
            (
                NatsError::StreamNotFound("S".into()),
                reasons::STREAM_NOT_FOUND,
            ),
            (
                NatsError::NoStreamFor("a".into()),
                reasons::STREAM_NOT_FOUND,
            ),
            (
                NatsError::StreamAmbiguous {
                    pattern: "a".into(),
                    streams: vec![],
                },
                reasons::STREAM_AMBIGUOUS,
            ),
            (
                NatsError::Api {
                    code: 1,
                    description: "d".into(),
                },
                reasons::BROKER_REFUSED,
            ),
            (
                NatsError::Limit(BrokerLimit::StreamConsumers {
                    stream: "ORDERS".into(),
                    max: Some(1000),
                    set_by: settle::backend::limit::SetBy::Stream,
                }),
                reasons::BROKER_LIMIT,
            ),
        ];
        for (e, want) in cases {
            let (reason, message) = broker_reason(&BrokerError::from(e.clone()));
            assert_eq!(reason, want, "{e:?}");
            assert!(!message.is_empty());
        }
    }

    #[test]
    fn a_limit_names_itself_what_to_change_and_when_settle_asks_again() {
        let l = BrokerLimit::StreamConsumers {
            stream: "ORDERS".into(),
            max: Some(1000),
            set_by: settle::backend::limit::SetBy::Stream,
        };
        for e in [
            BrokerError::from(NatsError::Limit(l.clone())),
            BrokerError::Limit(l),
        ] {
            let (reason, m) = broker_reason(&e);
            assert_eq!(reason, reasons::BROKER_LIMIT);
            assert_eq!(
                m,
                "the stream ORDERS allows at most 1000 consumers (max_consumers); raise it on the stream (nats stream edit ORDERS --max-consumers) or spread Subscriptions over streams; Settle asks the broker again after a growing delay (at most 5 min), and at once when a consumer on this stream is deleted or the stream changes"
            );
        }
    }
}
