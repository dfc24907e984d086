//! What a reconcile concluded ([`SubOutcome`], [`BackendOutcome`]) and the status it means: the
//! fields this writer owns (`observedGeneration`, `consumer`, `serverVersion`, `capabilities`,
//! the `Accepted` and `Ready` conditions), built whole, compared with what the object has, and
//! turned into a server-side-apply body only when they differ.
//!
//! Pure: no I/O, no clock. It must not write the stats or conditions the account owns.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde::Serialize;

use super::conditions::{self, Status, Want, reasons, types};
use crate::api::{BackendStatus, Capabilities, ConsumerRef, SubscriptionStatus};
use crate::backend::nats::connect::ConnectFailure;
use crate::backend::nats::consumer::FieldDiff;
use crate::backend::nats::jsapi::NatsError;
use crate::backend::{Classify, Failure};
use crate::policy::BackendKind;

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
            BrokerError::Unreachable(m) | BrokerError::AuthFailed(m) | BrokerError::Refused(m) => {
                f.write_str(m)
            }
        }
    }
}

impl BrokerError {
    /// A RabbitMQ or SQS error (a connection, an AMQP or management call, an SQS call), by the
    /// class it names. A NATS error goes in whole ([`BrokerError::Nats`]): its reasons are finer.
    pub fn of<E: Classify + std::fmt::Display>(e: E) -> BrokerError {
        let message = e.to_string();
        match e.class() {
            Failure::Unreachable => BrokerError::Unreachable(message),
            Failure::AuthFailed => BrokerError::AuthFailed(message),
            Failure::Refused => BrokerError::Refused(message),
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

/// What reconciling a Subscription concluded.
#[derive(Clone, Debug, PartialEq)]
pub enum SubOutcome {
    /// The consumer exists and matches the spec.
    Ready(ConsumerRef),
    /// The queue (RabbitMQ, SQS) exists and matches the spec; `queue.stream` is the exchange it
    /// is bound on (RabbitMQ) or `sqs`, `queue.name` the queue's name.
    QueueReady {
        kind: BackendKind,
        queue: ConsumerRef,
    },
    /// The Backend runs consumers inside the application: nothing to make on a broker.
    InProcess,
    /// The spec breaks an admission rule: the verdict's error text.
    Invalid(String),
    BackendNotFound(String),
    /// The Backend exists, with no working connection: why.
    BackendNotReady(String),
    /// A broker call failed; `consumer` is the consumer (or queue) known from before, if any.
    Broker {
        error: BrokerError,
        consumer: Option<ConsumerRef>,
    },
    /// The live consumer differs where the broker cannot change it in place.
    ImmutableField {
        consumer: ConsumerRef,
        fields: Vec<FieldDiff>,
    },
    /// A consumer of that name exists, made by someone else (`owner` is its marker, if any).
    Conflict {
        consumer: ConsumerRef,
        owner: Option<String>,
    },
    /// The live RabbitMQ queue's arguments differ from the mapping's, which RabbitMQ cannot
    /// change in place: each difference, naming the argument and the field it comes from.
    QueueImmutable {
        queue: ConsumerRef,
        fields: Vec<String>,
    },
    /// A queue (or dead-letter queue) of that name exists that is not this Subscription
    /// object's: neither bound nor deleted (`holder`: whose it is, as far as Settle can tell).
    QueueConflict {
        kind: BackendKind,
        queue: String,
        holder: QueueHolder,
    },
}

/// Whose a queue Settle leaves alone is (docs/semantics.md R8, Q7), and so the way out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QueueHolder {
    /// Another Subscription (`namespace/name`, its owner argument or tag).
    Other(String),
    /// No Subscription: it carries no owner mark, so Settle did not make it.
    Unmarked,
    /// RabbitMQ without the management API: the queue exists and no mark says Settle made it
    /// for this object; its owner argument cannot be read.
    Unproven,
    /// An earlier object of this Subscription's name (its UID) made it and left it behind.
    Earlier(String),
}

/// The annotation by which a Subscription takes over the queues an earlier object of its name
/// left behind (a queue or a kept consumer): its value is that object's UID (docs/semantics.md
/// J8, R8, Q7).
pub const ADOPT_ANNOTATION: &str = "settle.dev/adopt";

/// The Ready reason and message for a failed broker call: what to do, not the raw error.
pub fn broker_reason(e: &BrokerError) -> (&'static str, String) {
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
        NatsError::Api { .. } => (
            reasons::BROKER_REFUSED,
            format!(
                "{e}; check the Subscription against the broker's limits, and the operator's log"
            ),
        ),
    }
}

impl SubOutcome {
    /// The conditions this outcome means, before times are settled.
    pub fn wants(&self) -> [Want; 2] {
        let accepted = Want::new(types::ACCEPTED, Status::True, reasons::VALID, "");
        let ready =
            |status, reason, message: String| Want::new(types::READY, status, reason, message);
        match self {
            SubOutcome::Ready(c) => [
                accepted,
                ready(
                    Status::True,
                    reasons::CONSUMER_READY,
                    format!("consumer {} on stream {} matches the spec", c.name, c.stream),
                ),
            ],
            SubOutcome::QueueReady { kind, queue } => [
                accepted,
                ready(
                    Status::True,
                    reasons::CONSUMER_READY,
                    match kind {
                        BackendKind::Sqs => format!("SQS queue {} matches the spec", queue.name),
                        _ => format!(
                            "{kind} queue {} bound on exchange {} matches the spec",
                            queue.name, queue.stream
                        ),
                    },
                ),
            ],
            SubOutcome::QueueImmutable { queue, fields } => [
                accepted,
                ready(
                    Status::False,
                    reasons::IMMUTABLE_FIELD,
                    format!(
                        "queue {} differs where RabbitMQ cannot change it in place ({}); Settle leaves it as it is: \
                         delete the queue (its messages go with it) and Settle makes it again, or give the \
                         Subscription another durableName",
                        queue.name,
                        fields.join("; "),
                    ),
                ),
            ],
            SubOutcome::QueueConflict {
                kind,
                queue,
                holder,
            } => [
                accepted,
                ready(
                    Status::False,
                    reasons::CONSUMER_CONFLICT,
                    match holder {
                        QueueHolder::Other(o) => format!(
                            "{kind} queue {queue} belongs to Subscription {o}: choose another durableName"
                        ),
                        QueueHolder::Unmarked => format!(
                            "{kind} queue {queue} exists and Settle did not make it: choose another durableName, \
                             or delete that queue so Settle can make its own"
                        ),
                        QueueHolder::Unproven => format!(
                            "{kind} queue {queue} exists and nothing shows Settle made it for this Subscription \
                             (without the Backend's spec.rabbitmq.managementUrl its owner argument cannot be read): \
                             it is neither bound nor deleted. Choose another durableName, or set \
                             spec.rabbitmq.managementUrl on the Backend so Settle can read whose queue it is"
                        ),
                        QueueHolder::Earlier(uid) => format!(
                            "{kind} queue {queue} was made for an earlier Subscription of this name (uid {uid}) \
                             and left behind (deletionPolicy Retain, or deleted while no operator ran): it is \
                             neither used nor deleted. To take it over with what it holds, annotate this \
                             Subscription {ADOPT_ANNOTATION}: \"{uid}\"; or choose another durableName"
                        ),
                    },
                ),
            ],
            SubOutcome::InProcess => [
                accepted,
                ready(
                    Status::True,
                    reasons::IN_PROCESS,
                    "the memory backend runs the consumer inside the application; nothing to make on a broker".into(),
                ),
            ],
            SubOutcome::Invalid(text) => [
                Want::new(types::ACCEPTED, Status::False, reasons::INVALID, text.clone()),
                ready(
                    Status::False,
                    reasons::NOT_ACCEPTED,
                    "no consumer is made for a spec that is not accepted: fix the spec (see Accepted)".into(),
                ),
            ],
            SubOutcome::BackendNotFound(name) => [
                accepted,
                ready(
                    Status::False,
                    reasons::BACKEND_NOT_FOUND,
                    format!("Backend {name:?} does not exist in this namespace: create it, or fix spec.backendRef.name"),
                ),
            ],
            SubOutcome::BackendNotReady(why) => [
                accepted,
                ready(Status::False, reasons::BACKEND_NOT_READY, why.clone()),
            ],
            SubOutcome::Broker { error, .. } => {
                let (reason, message) = broker_reason(error);
                [accepted, ready(Status::False, reason, message)]
            }
            SubOutcome::ImmutableField { consumer, fields } => [
                accepted,
                ready(
                    Status::False,
                    reasons::IMMUTABLE_FIELD,
                    format!(
                        "consumer {} on stream {} differs where JetStream cannot change it in place ({}); \
                         Settle leaves it as it is: delete the consumer (nats consumer rm {} {}) and Settle makes it again \
                         (its unsettled messages are redelivered from the stream), or recreate the Subscription",
                        consumer.name,
                        consumer.stream,
                        fields.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "),
                        consumer.stream,
                        consumer.name,
                    ),
                ),
            ],
            SubOutcome::Conflict { consumer, owner } => [
                accepted,
                ready(
                    Status::False,
                    reasons::CONSUMER_CONFLICT,
                    match owner {
                        Some(o) => format!(
                            "consumer {} on stream {} belongs to Subscription {o}: choose another durableName",
                            consumer.name, consumer.stream
                        ),
                        None => format!(
                            "consumer {} on stream {} exists and Settle did not make it: choose another durableName, \
                             or delete that consumer so Settle can make its own",
                            consumer.name, consumer.stream
                        ),
                    },
                ),
            ],
        }
    }

    /// The consumer to show in status.
    pub fn consumer(&self) -> Option<&ConsumerRef> {
        match self {
            SubOutcome::Ready(c) => Some(c),
            SubOutcome::QueueReady { queue, .. } | SubOutcome::QueueImmutable { queue, .. } => {
                Some(queue)
            }
            SubOutcome::Broker { consumer, .. } => consumer.as_ref(),
            SubOutcome::ImmutableField { consumer, .. } => Some(consumer),
            // A conflicting consumer is not this Subscription's.
            _ => None,
        }
    }

    pub fn is_ready(&self) -> bool {
        matches!(
            self,
            SubOutcome::Ready(_) | SubOutcome::QueueReady { .. } | SubOutcome::InProcess
        )
    }
}

/// The part of a Subscription's status the reconcile writer owns, as it applies it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SubStatusPatch {
    pub observed_generation: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consumer: Option<ConsumerRef>,
    pub conditions: Vec<Condition>,
}

/// The status for `outcome`, or `None` when the object already shows exactly that.
pub fn subscription_status(
    existing: Option<&SubscriptionStatus>,
    generation: Option<i64>,
    outcome: &SubOutcome,
    now: &Time,
) -> Option<SubStatusPatch> {
    let old_conditions = existing.map(|s| s.conditions.as_slice()).unwrap_or(&[]);
    let conditions: Vec<Condition> = outcome
        .wants()
        .iter()
        .map(|w| conditions::settle(old_conditions, w, generation, now))
        .collect();
    let patch = SubStatusPatch {
        observed_generation: generation,
        consumer: outcome.consumer().cloned(),
        conditions,
    };
    let current = existing.is_some_and(|s| {
        s.observed_generation == patch.observed_generation
            && s.consumer == patch.consumer
            && conditions::conditions_current(&s.conditions, &patch.conditions)
    });
    (!current).then_some(patch)
}

/// What reconciling a Backend concluded.
#[derive(Clone, Debug, PartialEq)]
pub enum BackendOutcome {
    /// Connected and JetStream answers.
    Connected {
        version: Option<String>,
    },
    /// Connected to RabbitMQ (a broker that answers), or SQS answered a call with the
    /// credentials; `detail` says what was checked.
    Reached {
        kind: BackendKind,
        version: Option<String>,
        detail: String,
    },
    /// RabbitMQ or SQS: not reached (`reason` Unreachable, AuthFailed or SecretMissing), why.
    Down {
        reason: &'static str,
        message: String,
    },
    /// Connected (as Connected or Reached say), but the credentials travel unencrypted (A21):
    /// Ready, with a reason that says so.
    Plaintext {
        version: Option<String>,
        message: String,
    },
    /// The memory backend: nothing to connect to.
    InProcess,
    SecretMissing(String),
    Connect(ConnectFailure),
    /// Connected, but JetStream does not answer as it should.
    Broker {
        error: NatsError,
        version: Option<String>,
    },
}

impl BackendOutcome {
    pub fn want(&self) -> Want {
        let r = |status, reason, message: String| Want::new(types::READY, status, reason, message);
        match self {
            BackendOutcome::Connected { version } => r(
                Status::True,
                reasons::CONNECTED,
                format!(
                    "connected to nats-server {} with JetStream",
                    version.as_deref().unwrap_or("(version not announced)")
                ),
            ),
            BackendOutcome::Reached {
                kind,
                version,
                detail,
            } => r(
                Status::True,
                reasons::CONNECTED,
                match version {
                    Some(v) => format!("connected to {kind} {v}: {detail}"),
                    None => format!("connected to {kind}: {detail}"),
                },
            ),
            BackendOutcome::Down { reason, message } => r(Status::False, reason, message.clone()),
            BackendOutcome::Plaintext { message, .. } => r(
                Status::True,
                reasons::PLAINTEXT_CREDENTIALS,
                message.clone(),
            ),
            BackendOutcome::InProcess => r(
                Status::True,
                reasons::IN_PROCESS,
                "the memory backend runs inside each application; nothing to connect to".into(),
            ),
            BackendOutcome::SecretMissing(m) => {
                r(Status::False, reasons::SECRET_MISSING, m.clone())
            }
            BackendOutcome::Connect(f) => match f.class() {
                Failure::Unreachable => r(
                    Status::False,
                    reasons::UNREACHABLE,
                    format!(
                        "{f}: check spec.nats.servers and that the server runs; Settle keeps trying"
                    ),
                ),
                Failure::AuthFailed => r(
                    Status::False,
                    reasons::AUTH_FAILED,
                    format!(
                        "{f}: fix the credentials Secret (spec.nats.credentialsSecretRef); Settle picks up the change"
                    ),
                ),
                Failure::Refused => r(
                    Status::False,
                    reasons::SECRET_MISSING,
                    format!("{f}: fix the Secret or spec.nats"),
                ),
            },
            BackendOutcome::Broker { error, .. } => {
                let (reason, message) = broker_reason(&BrokerError::Nats(error.clone()));
                r(Status::False, reason, message)
            }
        }
    }

    pub fn version(&self) -> Option<&String> {
        match self {
            BackendOutcome::Connected { version }
            | BackendOutcome::Reached { version, .. }
            | BackendOutcome::Plaintext { version, .. }
            | BackendOutcome::Broker { version, .. } => version.as_ref(),
            _ => None,
        }
    }
}

/// The part of a Backend's status the reconcile writer owns.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BackendStatusPatch {
    pub observed_generation: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_version: Option<String>,
    pub capabilities: Capabilities,
    pub conditions: Vec<Condition>,
}

/// The Backend status for `outcome`, or `None` when the object already shows exactly that. A
/// version seen before is kept while the server cannot be reached.
pub fn backend_status(
    existing: Option<&BackendStatus>,
    generation: Option<i64>,
    capabilities: Capabilities,
    outcome: &BackendOutcome,
    now: &Time,
) -> Option<BackendStatusPatch> {
    let old_conditions = existing.map(|s| s.conditions.as_slice()).unwrap_or(&[]);
    let server_version = outcome
        .version()
        .cloned()
        .or_else(|| existing.and_then(|s| s.server_version.clone()))
        .filter(|_| !matches!(outcome, BackendOutcome::InProcess));
    let patch = BackendStatusPatch {
        observed_generation: generation,
        server_version,
        capabilities,
        conditions: vec![conditions::settle(
            old_conditions,
            &outcome.want(),
            generation,
            now,
        )],
    };
    let current = existing.is_some_and(|s| {
        s.observed_generation == patch.observed_generation
            && s.server_version == patch.server_version
            && s.capabilities.as_ref() == Some(&patch.capabilities)
            && conditions::conditions_current(&s.conditions, &patch.conditions)
    });
    (!current).then_some(patch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn at(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).expect("time"))
    }

    fn consumer() -> ConsumerRef {
        ConsumerRef {
            stream: "ORDERS".into(),
            name: "orders".into(),
        }
    }

    /// The status an object has after `patch` was applied.
    fn applied(patch: &SubStatusPatch) -> SubscriptionStatus {
        SubscriptionStatus {
            observed_generation: patch.observed_generation,
            consumer: patch.consumer.clone(),
            conditions: patch.conditions.clone(),
            ..Default::default()
        }
    }

    fn outcomes() -> Vec<SubOutcome> {
        vec![
            SubOutcome::Ready(consumer()),
            SubOutcome::InProcess,
            SubOutcome::Invalid("spec.durableName: required".into()),
            SubOutcome::BackendNotFound("nats".into()),
            SubOutcome::BackendNotReady("AuthFailed".into()),
            SubOutcome::Broker {
                error: NatsError::Unreachable("timed out".into()).into(),
                consumer: Some(consumer()),
            },
            SubOutcome::Broker {
                error: NatsError::StreamNotFound("X".into()).into(),
                consumer: None,
            },
            SubOutcome::Broker {
                error: NatsError::NoStreamFor("a.>".into()).into(),
                consumer: None,
            },
            SubOutcome::Broker {
                error: NatsError::StreamAmbiguous {
                    pattern: "a.>".into(),
                    streams: vec!["A".into(), "B".into()],
                }
                .into(),
                consumer: None,
            },
            SubOutcome::Broker {
                error: NatsError::JetStreamDisabled.into(),
                consumer: None,
            },
            SubOutcome::Broker {
                error: NatsError::Api {
                    code: 10_012,
                    description: "insufficient resources".into(),
                }
                .into(),
                consumer: None,
            },
            SubOutcome::ImmutableField {
                consumer: consumer(),
                fields: vec![FieldDiff {
                    field: "ack_policy",
                    spec_field: Some("spec.mode"),
                    desired: "Explicit".into(),
                    live: "None".into(),
                }],
            },
            SubOutcome::Conflict {
                consumer: consumer(),
                owner: Some("other/orders".into()),
            },
            SubOutcome::Conflict {
                consumer: consumer(),
                owner: None,
            },
            SubOutcome::QueueReady {
                kind: BackendKind::Rabbitmq,
                queue: ConsumerRef {
                    stream: "amq.topic".into(),
                    name: "orders".into(),
                },
            },
            SubOutcome::QueueReady {
                kind: BackendKind::Sqs,
                queue: ConsumerRef {
                    stream: "sqs".into(),
                    name: "orders".into(),
                },
            },
            SubOutcome::QueueImmutable {
                queue: ConsumerRef {
                    stream: "amq.topic".into(),
                    name: "orders".into(),
                },
                fields: vec!["x-delivery-limit (spec.maxDeliver): wants 4, the queue has 9".into()],
            },
            SubOutcome::QueueConflict {
                kind: BackendKind::Sqs,
                queue: "orders".into(),
                holder: QueueHolder::Other("other/orders".into()),
            },
            SubOutcome::QueueConflict {
                kind: BackendKind::Rabbitmq,
                queue: "orders".into(),
                holder: QueueHolder::Unmarked,
            },
            SubOutcome::Broker {
                error: BrokerError::Unreachable("connection refused".into()),
                consumer: None,
            },
            SubOutcome::Broker {
                error: BrokerError::AuthFailed("InvalidClientTokenId".into()),
                consumer: None,
            },
            SubOutcome::Broker {
                error: BrokerError::Refused("CreateQueue: bad name".into()),
                consumer: None,
            },
            SubOutcome::QueueConflict {
                kind: BackendKind::Rabbitmq,
                queue: "orders".into(),
                holder: QueueHolder::Unproven,
            },
            SubOutcome::QueueConflict {
                kind: BackendKind::Sqs,
                queue: "orders".into(),
                holder: QueueHolder::Earlier("u-0".into()),
            },
        ]
    }

    #[test]
    fn queue_outcomes_say_what_is_wrong_and_what_to_do() {
        let text = |o: &SubOutcome| {
            let [_, r] = o.wants();
            (r.status, r.reason, r.message)
        };
        let all = outcomes();
        let (status, reason, m) = text(&all[14]);
        assert_eq!((status, reason), (Status::True, reasons::CONSUMER_READY));
        assert!(
            m.contains("queue orders bound on exchange amq.topic"),
            "{m}"
        );
        let (_, _, m) = text(&all[15]);
        assert!(m.contains("SQS queue orders"), "{m}");
        let (status, reason, m) = text(&all[16]);
        assert_eq!((status, reason), (Status::False, reasons::IMMUTABLE_FIELD));
        assert!(m.contains("x-delivery-limit (spec.maxDeliver)"), "{m}");
        assert_eq!(all[16].consumer().map(|c| c.name.as_str()), Some("orders"));
        let (_, reason, m) = text(&all[17]);
        assert_eq!(reason, reasons::CONSUMER_CONFLICT);
        assert!(m.contains("belongs to Subscription other/orders"), "{m}");
        assert_eq!(
            all[17].consumer(),
            None,
            "a queue that is not ours is not shown"
        );
        let (_, _, m) = text(&all[18]);
        assert!(m.contains("Settle did not make it"), "{m}");
        for (i, want) in [
            (19, reasons::UNREACHABLE),
            (20, reasons::AUTH_FAILED),
            (21, reasons::BROKER_REFUSED),
        ] {
            assert_eq!(text(&all[i]).1, want, "{:?}", all[i]);
        }
        let (_, reason, m) = text(&all[22]);
        assert_eq!(reason, reasons::CONSUMER_CONFLICT);
        assert!(
            m.contains("spec.rabbitmq.managementUrl") && m.contains("another durableName"),
            "{m}"
        );
        let (_, reason, m) = text(&all[23]);
        assert_eq!(reason, reasons::CONSUMER_CONFLICT);
        assert!(m.contains("settle.dev/adopt: \"u-0\""), "{m}");
        assert_eq!(all[23].consumer(), None, "a leftover is not shown as ours");
    }

    #[test]
    fn every_outcome_once_applied_is_not_written_again() {
        for o in outcomes() {
            let first = subscription_status(None, Some(3), &o, &at(10)).expect("a first write");
            let again = subscription_status(Some(&applied(&first)), Some(3), &o, &at(20));
            assert_eq!(again, None, "{o:?} is written again at steady state");
        }
    }

    #[test]
    fn every_pair_of_different_outcomes_is_written() {
        let all = outcomes();
        for a in &all {
            let first = applied(&subscription_status(None, Some(1), a, &at(10)).expect("first"));
            for b in &all {
                let next = subscription_status(Some(&first), Some(1), b, &at(20));
                assert_eq!(next.is_none(), a == b, "{a:?} then {b:?}");
            }
        }
    }

    #[test]
    fn a_new_generation_is_written_even_when_nothing_else_changed() {
        let o = SubOutcome::Ready(consumer());
        let s = applied(&subscription_status(None, Some(1), &o, &at(1)).expect("first"));
        let next = subscription_status(Some(&s), Some(2), &o, &at(2)).expect("new generation");
        assert_eq!(next.observed_generation, Some(2));
        assert_eq!(
            next.conditions[1].last_transition_time,
            at(1),
            "Ready stayed True: its transition time stays"
        );
    }

    #[test]
    fn ready_false_then_true_moves_the_transition_time_each_time() {
        let up = SubOutcome::Ready(consumer());
        let down = SubOutcome::Broker {
            error: NatsError::Unreachable("x".into()).into(),
            consumer: Some(consumer()),
        };
        let s1 = applied(&subscription_status(None, Some(1), &up, &at(1)).expect("1"));
        let s2 = applied(&subscription_status(Some(&s1), Some(1), &down, &at(2)).expect("2"));
        let s3 = applied(&subscription_status(Some(&s2), Some(1), &up, &at(3)).expect("3"));
        assert_eq!(s2.conditions[1].last_transition_time, at(2));
        assert_eq!(s3.conditions[1].last_transition_time, at(3));
        assert_eq!(
            s3.conditions[0].last_transition_time,
            at(1),
            "Accepted never changed"
        );
        assert_eq!(
            s2.consumer,
            Some(consumer()),
            "the known consumer stays shown while the broker is down"
        );
    }

    #[test]
    fn the_accountants_fields_do_not_make_a_write() {
        let o = SubOutcome::Ready(consumer());
        let mut s = applied(&subscription_status(None, Some(1), &o, &at(1)).expect("first"));
        s.stats = Some(Default::default());
        s.stats_updated_at = Some(at(5));
        s.conditions.push(Condition {
            type_: "Exhausting".into(),
            status: "True".into(),
            reason: "Exhausted".into(),
            message: "lost".into(),
            observed_generation: Some(1),
            last_transition_time: at(4),
        });
        assert_eq!(subscription_status(Some(&s), Some(1), &o, &at(9)), None);
    }

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
        ];
        for (e, want) in cases {
            let (reason, message) = broker_reason(&BrokerError::from(e.clone()));
            assert_eq!(reason, want, "{e:?}");
            assert!(!message.is_empty());
        }
    }

    #[test]
    fn an_immutable_difference_names_the_field_and_the_way_out() {
        let o = &outcomes()[11];
        let [_, ready] = o.wants();
        assert_eq!(ready.reason, reasons::IMMUTABLE_FIELD);
        assert!(
            ready.message.contains("ack_policy (spec.mode)"),
            "{}",
            ready.message
        );
        assert!(
            ready.message.contains("nats consumer rm ORDERS orders"),
            "{}",
            ready.message
        );
    }

    #[test]
    fn an_invalid_spec_is_not_accepted_and_not_ready_and_shows_no_consumer() {
        let o = SubOutcome::Invalid("spec.backoff: not allowed".into());
        let s = subscription_status(None, Some(1), &o, &at(1)).expect("first");
        assert_eq!(s.conditions[0].status, "False");
        assert_eq!(s.conditions[0].message, "spec.backoff: not allowed");
        assert_eq!(s.conditions[1].reason, reasons::NOT_ACCEPTED);
        assert_eq!(s.consumer, None);
    }

    #[test]
    fn rabbitmq_and_sqs_backends_are_connected_or_down_with_a_reason() {
        let up = BackendOutcome::Reached {
            kind: BackendKind::Rabbitmq,
            version: Some("3.10.8".into()),
            detail: "AMQP and the management API answer".into(),
        };
        let p = backend_status(None, Some(1), caps(), &up, &at(1)).expect("first");
        assert_eq!(p.conditions[0].status, "True");
        assert_eq!(p.conditions[0].reason, reasons::CONNECTED);
        assert_eq!(p.server_version.as_deref(), Some("3.10.8"));
        assert!(
            p.conditions[0].message.contains("rabbitmq 3.10.8"),
            "{}",
            p.conditions[0].message
        );
        let down = BackendOutcome::Down {
            reason: reasons::AUTH_FAILED,
            message: "refused".into(),
        };
        let s = backend_applied(&p);
        let p = backend_status(Some(&s), Some(1), caps(), &down, &at(2)).expect("second");
        assert_eq!(p.conditions[0].reason, reasons::AUTH_FAILED);
        assert_eq!(
            p.server_version.as_deref(),
            Some("3.10.8"),
            "the known version stays"
        );
    }

    fn caps() -> Capabilities {
        crate::policy::capabilities_of(crate::policy::BackendKind::Nats)
    }

    fn backend_applied(p: &BackendStatusPatch) -> BackendStatus {
        BackendStatus {
            observed_generation: p.observed_generation,
            server_version: p.server_version.clone(),
            capabilities: Some(p.capabilities.clone()),
            conditions: p.conditions.clone(),
        }
    }

    #[test]
    fn backend_outcomes_map_to_reasons_and_settle() {
        let cases = [
            (
                BackendOutcome::Connected {
                    version: Some("2.15.3".into()),
                },
                "True",
                reasons::CONNECTED,
            ),
            (BackendOutcome::InProcess, "True", reasons::IN_PROCESS),
            (
                BackendOutcome::SecretMissing("Secret \"x\" not found".into()),
                "False",
                reasons::SECRET_MISSING,
            ),
            (
                BackendOutcome::Connect(ConnectFailure::Unreachable {
                    servers: "nats://127.0.0.1:1".into(),
                    detail: "refused".into(),
                }),
                "False",
                reasons::UNREACHABLE,
            ),
            (
                BackendOutcome::Connect(ConnectFailure::AuthFailed(
                    "authorization violation".into(),
                )),
                "False",
                reasons::AUTH_FAILED,
            ),
            (
                BackendOutcome::Broker {
                    error: NatsError::JetStreamDisabled,
                    version: Some("2.15.3".into()),
                },
                "False",
                reasons::JETSTREAM_DISABLED,
            ),
        ];
        for (o, status, reason) in cases {
            let p = backend_status(None, Some(1), caps(), &o, &at(1)).expect("first");
            assert_eq!(p.conditions[0].status, status, "{o:?}");
            assert_eq!(p.conditions[0].reason, reason, "{o:?}");
            let again = backend_status(Some(&backend_applied(&p)), Some(1), caps(), &o, &at(2));
            assert_eq!(again, None, "{o:?} written twice");
        }
    }

    #[test]
    fn a_backend_keeps_its_known_version_while_unreachable() {
        let up = BackendOutcome::Connected {
            version: Some("2.15.3".into()),
        };
        let s = backend_applied(&backend_status(None, Some(1), caps(), &up, &at(1)).expect("1"));
        let down = BackendOutcome::Connect(ConnectFailure::Unreachable {
            servers: "x".into(),
            detail: "y".into(),
        });
        let p = backend_status(Some(&s), Some(1), caps(), &down, &at(2)).expect("2");
        assert_eq!(p.server_version.as_deref(), Some("2.15.3"));
    }
}
