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
use crate::policy::BackendKind;

/// What reconciling a Subscription concluded.
#[derive(Clone, Debug, PartialEq)]
pub enum SubOutcome {
    /// The consumer exists and matches the spec.
    Ready(ConsumerRef),
    /// The Backend runs consumers inside the application: nothing to make on a broker.
    InProcess,
    /// The Backend's kind is driven by the runtime only: the operator makes nothing there yet.
    NotManagedYet(BackendKind),
    /// The spec breaks an admission rule: the verdict's error text.
    Invalid(String),
    BackendNotFound(String),
    /// The Backend exists, with no working connection: why.
    BackendNotReady(String),
    /// A broker call failed; `consumer` is the consumer known from before, if any.
    Broker {
        error: NatsError,
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
}

/// The Ready reason and message for a failed broker call: what to do, not the raw error.
pub fn broker_reason(e: &NatsError) -> (&'static str, String) {
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
            SubOutcome::InProcess => [
                accepted,
                ready(
                    Status::True,
                    reasons::IN_PROCESS,
                    "the memory backend runs the consumer inside the application; nothing to make on a broker".into(),
                ),
            ],
            SubOutcome::NotManagedYet(kind) => [
                accepted,
                ready(
                    Status::False,
                    reasons::NOT_MANAGED_YET,
                    format!(
                        "the operator does not make {kind} queues yet: the spec is checked against {kind}'s capabilities, \
                         and an application declares its own queue with a subscription defined in code (Subscriber::new)"
                    ),
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
            SubOutcome::Broker { consumer, .. } => consumer.as_ref(),
            SubOutcome::ImmutableField { consumer, .. } => Some(consumer),
            // A conflicting consumer is not this Subscription's.
            _ => None,
        }
    }

    pub fn is_ready(&self) -> bool {
        matches!(self, SubOutcome::Ready(_) | SubOutcome::InProcess)
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
    /// The memory backend: nothing to connect to.
    InProcess,
    /// A kind the runtime drives but the operator does not connect to yet (rabbitmq, sqs).
    NotManagedYet(BackendKind),
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
            BackendOutcome::InProcess => r(
                Status::True,
                reasons::IN_PROCESS,
                "the memory backend runs inside each application; nothing to connect to".into(),
            ),
            BackendOutcome::NotManagedYet(kind) => r(
                Status::False,
                reasons::NOT_MANAGED_YET,
                format!(
                    "the operator does not connect to {kind} yet: Settle's runtime drives it, and admission checks \
                     Subscriptions against {kind}'s capabilities (shown here)"
                ),
            ),
            BackendOutcome::SecretMissing(m) => {
                r(Status::False, reasons::SECRET_MISSING, m.clone())
            }
            BackendOutcome::Connect(f) => match f {
                ConnectFailure::Unreachable { .. } => r(
                    Status::False,
                    reasons::UNREACHABLE,
                    format!(
                        "{f}: check spec.nats.servers and that the server runs; Settle keeps trying"
                    ),
                ),
                ConnectFailure::AuthFailed(_) => r(
                    Status::False,
                    reasons::AUTH_FAILED,
                    format!(
                        "{f}: fix the credentials Secret (spec.nats.credentialsSecretRef); Settle picks up the change"
                    ),
                ),
                ConnectFailure::BadConfig(_) => r(
                    Status::False,
                    reasons::SECRET_MISSING,
                    format!("{f}: fix the Secret or spec.nats"),
                ),
            },
            BackendOutcome::Broker { error, .. } => {
                let (reason, message) = broker_reason(error);
                r(Status::False, reason, message)
            }
        }
    }

    pub fn version(&self) -> Option<&String> {
        match self {
            BackendOutcome::Connected { version } | BackendOutcome::Broker { version, .. } => {
                version.as_ref()
            }
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
        .filter(|_| {
            !matches!(
                outcome,
                BackendOutcome::InProcess | BackendOutcome::NotManagedYet(_)
            )
        });
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
                error: NatsError::Unreachable("timed out".into()),
                consumer: Some(consumer()),
            },
            SubOutcome::Broker {
                error: NatsError::StreamNotFound("X".into()),
                consumer: None,
            },
            SubOutcome::Broker {
                error: NatsError::NoStreamFor("a.>".into()),
                consumer: None,
            },
            SubOutcome::Broker {
                error: NatsError::StreamAmbiguous {
                    pattern: "a.>".into(),
                    streams: vec!["A".into(), "B".into()],
                },
                consumer: None,
            },
            SubOutcome::Broker {
                error: NatsError::JetStreamDisabled,
                consumer: None,
            },
            SubOutcome::Broker {
                error: NatsError::Api {
                    code: 10_012,
                    description: "insufficient resources".into(),
                },
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
        ]
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
            error: NatsError::Unreachable("x".into()),
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
            let (reason, message) = broker_reason(&e);
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
