//! What reconciling a Subscription concluded ([`SubOutcome`], one outcome per meaning for every
//! broker: ready, differs where the broker cannot change it, not this object's, ...) and the
//! status it means: the fields this writer owns on a Subscription (`observedGeneration`,
//! `consumer`, the `Accepted` and `Ready` conditions, and `Paused` once it was ever asked for),
//! built whole, compared with what the
//! object has, and turned into a server-side-apply body only when they differ.
//!
//! Pure: no I/O, no clock. It must not write the stats or conditions the account owns, nor
//! decide requeues (the pipeline, [`crate::reconcile::subscription`], does).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde::Serialize;

use super::broker::{BrokerError, broker_reason};
use super::object::{Holder, ObjectKind};
use crate::reconcile::conditions::{self, Status, Want, reasons, types};
use settle::api::{ConsumerRef, SubscriptionStatus};
use settle::policy::Pause;

/// What reconciling a Subscription concluded. `kind` says what the broker object is, `object`
/// names it as status shows it (a consumer's stream, a RabbitMQ queue's exchange, `sqs`).
#[derive(Clone, Debug, PartialEq)]
pub enum SubOutcome {
    /// The broker object exists and matches the spec.
    Ready {
        kind: ObjectKind,
        object: ConsumerRef,
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
    /// The live object differs where the broker cannot change it in place: each difference,
    /// naming the broker's field (or argument) and the spec's field it comes from.
    Immutable {
        kind: ObjectKind,
        object: ConsumerRef,
        fields: Vec<String>,
    },
    /// An object of that name (the queue, or its dead-letter queue) exists that is not this
    /// Subscription object's: neither used nor deleted (`owner`: whose it is, as far as Settle
    /// can tell).
    Conflict {
        kind: ObjectKind,
        object: ConsumerRef,
        owner: Holder,
    },
}

impl SubOutcome {
    /// The conditions this outcome means, before times are settled.
    pub fn wants(&self) -> [Want; 2] {
        let accepted = Want::new(types::ACCEPTED, Status::True, reasons::VALID, "");
        let ready =
            |status, reason, message: String| Want::new(types::READY, status, reason, message);
        match self {
            SubOutcome::Ready { kind, object } => [
                accepted,
                ready(
                    Status::True,
                    reasons::CONSUMER_READY,
                    kind.ready_message(object),
                ),
            ],
            SubOutcome::Immutable {
                kind,
                object,
                fields,
            } => [
                accepted,
                ready(
                    Status::False,
                    reasons::IMMUTABLE_FIELD,
                    kind.immutable_message(object, fields),
                ),
            ],
            SubOutcome::Conflict {
                kind,
                object,
                owner,
            } => [
                accepted,
                ready(
                    Status::False,
                    reasons::CONSUMER_CONFLICT,
                    kind.conflict_message(object, owner),
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
        }
    }

    /// The consumer (or queue) to show in status.
    pub fn consumer(&self) -> Option<&ConsumerRef> {
        match self {
            SubOutcome::Ready { object, .. } | SubOutcome::Immutable { object, .. } => Some(object),
            SubOutcome::Broker { consumer, .. } => consumer.as_ref(),
            // A conflicting object is not this Subscription's.
            _ => None,
        }
    }

    pub fn is_ready(&self) -> bool {
        matches!(self, SubOutcome::Ready { .. } | SubOutcome::InProcess)
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

/// The `Paused` condition for `outcome` while the spec asks for `pause`: written once a
/// Subscription asks for a pause, and from then on (so a resume shows `False`); `None` for one
/// never paused (no condition, and no write for it).
pub fn paused_want(outcome: &SubOutcome, pause: Pause, existing: &[Condition]) -> Option<Want> {
    let shown = conditions::find(existing, types::PAUSED).is_some();
    if !pause.is_paused() && !shown {
        return None;
    }
    let paused =
        |status, reason, message: String| Want::new(types::PAUSED, status, reason, message);
    Some(match outcome {
        _ if !pause.is_paused() => paused(
            Status::False,
            reasons::NOT_PAUSED,
            "delivery runs: spec.paused is false, or spec.pausedUntil has passed".into(),
        ),
        SubOutcome::Ready { kind, object } => paused(
            Status::True,
            reasons::PAUSED_BY_SPEC,
            kind.paused_message(object, pause),
        ),
        SubOutcome::InProcess => paused(
            Status::False,
            reasons::PAUSE_NOT_SUPPORTED,
            "the memory backend runs the consumer inside the application, where Settle cannot pause it: spec.paused has no effect there".into(),
        ),
        _ => paused(
            Status::False,
            reasons::PAUSE_NOT_APPLIED,
            format!(
                "spec.paused asks for a pause {}, and the consumer is not Ready (see Ready), so the broker may not hold it yet; it is applied once the consumer is Ready",
                pause.until_text()
            ),
        ),
    })
}

/// The status for `outcome` (the spec asking for `pause`), or `None` when the object already
/// shows exactly that.
pub fn subscription_status(
    existing: Option<&SubscriptionStatus>,
    generation: Option<i64>,
    outcome: &SubOutcome,
    pause: Pause,
    now: &Time,
) -> Option<SubStatusPatch> {
    let old_conditions = existing.map(|s| s.conditions.as_slice()).unwrap_or(&[]);
    let conditions: Vec<Condition> = outcome
        .wants()
        .into_iter()
        .chain(paused_want(outcome, pause, old_conditions))
        .map(|w| conditions::settle(old_conditions, &w, generation, now))
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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;
    use settle::backend::nats::admin::NatsError;
    use settle::backend::nats::mapping::FieldDiff;

    fn at(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).expect("time"))
    }

    fn consumer() -> ConsumerRef {
        ConsumerRef {
            stream: "ORDERS".into(),
            name: "orders".into(),
        }
    }

    fn ready(object: ConsumerRef) -> SubOutcome {
        SubOutcome::Ready {
            kind: ObjectKind::Consumer,
            object,
        }
    }

    fn exchange_queue() -> ConsumerRef {
        ConsumerRef {
            stream: "amq.topic".into(),
            name: "orders".into(),
        }
    }

    fn sqs_queue() -> ConsumerRef {
        ConsumerRef {
            stream: "sqs".into(),
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

    // Long on purpose: one of every outcome, a table the tests below run through whole.
    fn outcomes() -> Vec<SubOutcome> {
        vec![
            ready(consumer()),
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
            SubOutcome::Immutable {
                kind: ObjectKind::Consumer,
                object: consumer(),
                fields: vec![
                    FieldDiff {
                        field: "ack_policy",
                        spec_field: Some("spec.mode"),
                        desired: "Explicit".into(),
                        live: "None".into(),
                    }
                    .to_string(),
                ],
            },
            SubOutcome::Conflict {
                kind: ObjectKind::Consumer,
                object: consumer(),
                owner: Holder::Other("other/orders".into()),
            },
            SubOutcome::Conflict {
                kind: ObjectKind::Consumer,
                object: consumer(),
                owner: Holder::Unmarked,
            },
            SubOutcome::Ready {
                kind: ObjectKind::RabbitmqQueue,
                object: exchange_queue(),
            },
            SubOutcome::Ready {
                kind: ObjectKind::SqsQueue,
                object: sqs_queue(),
            },
            SubOutcome::Immutable {
                kind: ObjectKind::RabbitmqQueue,
                object: exchange_queue(),
                fields: vec!["x-delivery-limit (spec.maxDeliver): wants 4, the queue has 9".into()],
            },
            SubOutcome::Conflict {
                kind: ObjectKind::SqsQueue,
                object: sqs_queue(),
                owner: Holder::Other("other/orders".into()),
            },
            SubOutcome::Conflict {
                kind: ObjectKind::RabbitmqQueue,
                object: exchange_queue(),
                owner: Holder::Unmarked,
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
            SubOutcome::Conflict {
                kind: ObjectKind::RabbitmqQueue,
                object: exchange_queue(),
                owner: Holder::Unproven,
            },
            SubOutcome::Conflict {
                kind: ObjectKind::SqsQueue,
                object: sqs_queue(),
                owner: Holder::Earlier {
                    owner: "shop/orders".into(),
                    uid: "u-0".into(),
                },
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
            let first = subscription_status(None, Some(3), &o, Pause::Running, &at(10))
                .expect("a first write");
            let again =
                subscription_status(Some(&applied(&first)), Some(3), &o, Pause::Running, &at(20));
            assert_eq!(again, None, "{o:?} is written again at steady state");
        }
    }

    #[test]
    fn every_pair_of_different_outcomes_is_written() {
        let all = outcomes();
        for a in &all {
            let first = applied(
                &subscription_status(None, Some(1), a, Pause::Running, &at(10)).expect("first"),
            );
            for b in &all {
                let next = subscription_status(Some(&first), Some(1), b, Pause::Running, &at(20));
                assert_eq!(next.is_none(), a == b, "{a:?} then {b:?}");
            }
        }
    }

    #[test]
    fn a_new_generation_is_written_even_when_nothing_else_changed() {
        let o = ready(consumer());
        let s = applied(
            &subscription_status(None, Some(1), &o, Pause::Running, &at(1)).expect("first"),
        );
        let next = subscription_status(Some(&s), Some(2), &o, Pause::Running, &at(2))
            .expect("new generation");
        assert_eq!(next.observed_generation, Some(2));
        assert_eq!(
            next.conditions[1].last_transition_time,
            at(1),
            "Ready stayed True: its transition time stays"
        );
    }

    #[test]
    fn ready_false_then_true_moves_the_transition_time_each_time() {
        let up = ready(consumer());
        let down = SubOutcome::Broker {
            error: NatsError::Unreachable("x".into()).into(),
            consumer: Some(consumer()),
        };
        let s1 =
            applied(&subscription_status(None, Some(1), &up, Pause::Running, &at(1)).expect("1"));
        let s2 = applied(
            &subscription_status(Some(&s1), Some(1), &down, Pause::Running, &at(2)).expect("2"),
        );
        let s3 = applied(
            &subscription_status(Some(&s2), Some(1), &up, Pause::Running, &at(3)).expect("3"),
        );
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
        let o = ready(consumer());
        let mut s = applied(
            &subscription_status(None, Some(1), &o, Pause::Running, &at(1)).expect("first"),
        );
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
        assert_eq!(
            subscription_status(Some(&s), Some(1), &o, Pause::Running, &at(9)),
            None
        );
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
    fn paused_shows_once_asked_true_while_held_and_false_after_and_never_for_one_never_paused() {
        let o = ready(consumer());
        let forever = Pause::Paused { until: None };
        let until = Pause::Paused {
            until: Some(Timestamp::from_second(2_000_000_000).expect("time")),
        };
        // Never paused: no Paused condition at all.
        let s0 =
            applied(&subscription_status(None, Some(1), &o, Pause::Running, &at(1)).expect("0"));
        assert!(conditions::find(&s0.conditions, types::PAUSED).is_none());
        // Paused: True, saying until when.
        let s1 = applied(&subscription_status(Some(&s0), Some(2), &o, forever, &at(2)).expect("1"));
        let c = conditions::find(&s1.conditions, types::PAUSED).expect("Paused");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", reasons::PAUSED_BY_SPEC)
        );
        assert!(c.message.contains("consumer orders on stream ORDERS is paused on the server until spec.paused is set false"), "{}", c.message);
        let s1b = applied(&subscription_status(Some(&s1), Some(3), &o, until, &at(3)).expect("1b"));
        let c = conditions::find(&s1b.conditions, types::PAUSED).expect("Paused");
        assert!(
            c.message
                .contains("until 2033-05-18T03:33:20Z (spec.pausedUntil)"),
            "{}",
            c.message
        );
        assert_eq!(c.last_transition_time, at(2), "still True");
        // Not Ready while paused: not known to be held.
        let down = SubOutcome::Broker {
            error: NatsError::Unreachable("x".into()).into(),
            consumer: Some(consumer()),
        };
        let s2 =
            applied(&subscription_status(Some(&s1b), Some(3), &down, until, &at(4)).expect("2"));
        let c = conditions::find(&s2.conditions, types::PAUSED).expect("Paused");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", reasons::PAUSE_NOT_APPLIED)
        );
        // Resumed: False from then on, and nothing written again at steady state.
        let s3 = applied(
            &subscription_status(Some(&s2), Some(4), &o, Pause::Running, &at(5)).expect("3"),
        );
        let c = conditions::find(&s3.conditions, types::PAUSED).expect("Paused");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", reasons::NOT_PAUSED)
        );
        assert_eq!(
            subscription_status(Some(&s3), Some(4), &o, Pause::Running, &at(6)),
            None
        );
        // Memory cannot pause.
        let m = paused_want(&SubOutcome::InProcess, forever, &[]).expect("a condition");
        assert_eq!(
            (m.status, m.reason),
            (Status::False, reasons::PAUSE_NOT_SUPPORTED)
        );
    }

    #[test]
    fn an_invalid_spec_is_not_accepted_and_not_ready_and_shows_no_consumer() {
        let o = SubOutcome::Invalid("spec.backoff: not allowed".into());
        let s = subscription_status(None, Some(1), &o, Pause::Running, &at(1)).expect("first");
        assert_eq!(s.conditions[0].status, "False");
        assert_eq!(s.conditions[0].message, "spec.backoff: not allowed");
        assert_eq!(s.conditions[1].reason, reasons::NOT_ACCEPTED);
        assert_eq!(s.consumer, None);
    }
}
