//! What reconciling a Backend concluded ([`BackendOutcome`], one per meaning for every kind) and
//! the status it means: the fields this writer owns on a Backend (`observedGeneration`,
//! `serverVersion`, `capabilities`, the `Ready` condition), built whole, compared with what the
//! object has, and turned into a server-side-apply body only when they differ.
//!
//! Pure: no I/O, no clock. It must not connect, nor say why a connection failed in the
//! broker's words (the Backend controller, [`crate::reconcile::backend`], turns each failure
//! into a reason and a message).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde::Serialize;

use crate::reconcile::conditions::{self, Status, Want, reasons, types};
use settle::api::{BackendStatus, Capabilities};
use settle::policy::BackendKind;

/// What reconciling a Backend concluded, the same for every kind.
#[derive(Clone, Debug, PartialEq)]
pub enum BackendOutcome {
    /// Connected, and the broker answers (`detail`: what was checked — JetStream; RabbitMQ's
    /// AMQP and management API; SQS's ListQueues with the credentials).
    Connected {
        kind: BackendKind,
        version: Option<String>,
        detail: String,
    },
    /// Connected (as Connected says), with something to say: the credentials travel
    /// unencrypted (A21, `PlaintextCredentials`), or the vhost is shared (`SharedVhost`). Ready,
    /// with that reason.
    Warned {
        reason: &'static str,
        version: Option<String>,
        message: String,
    },
    /// The memory backend: nothing to connect to.
    InProcess,
    /// Not usable: `reason` (Unreachable, AuthFailed, SecretMissing, BadConfig, JetStreamDisabled,
    /// one of the access refusals, ...) and `message`, what to do; `version`, the server's when
    /// it was reached and answered wrong.
    Down {
        reason: &'static str,
        message: String,
        version: Option<String>,
    },
}

impl BackendOutcome {
    /// Not usable, and no server was reached.
    pub fn down(reason: &'static str, message: String) -> BackendOutcome {
        BackendOutcome::Down {
            reason,
            message,
            version: None,
        }
    }

    pub fn want(&self) -> Want {
        let r = |status, reason, message: String| Want::new(types::READY, status, reason, message);
        match self {
            BackendOutcome::Connected {
                kind: BackendKind::Nats,
                version,
                detail,
            } => r(
                Status::True,
                reasons::CONNECTED,
                format!(
                    "connected to nats-server {} {detail}",
                    version.as_deref().unwrap_or("(version not announced)")
                ),
            ),
            BackendOutcome::Connected {
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
            BackendOutcome::Down {
                reason, message, ..
            } => r(Status::False, reason, message.clone()),
            BackendOutcome::Warned {
                reason, message, ..
            } => r(Status::True, reason, message.clone()),
            BackendOutcome::InProcess => r(
                Status::True,
                reasons::IN_PROCESS,
                "the memory backend runs inside each application; nothing to connect to".into(),
            ),
        }
    }

    pub fn version(&self) -> Option<&String> {
        match self {
            BackendOutcome::Connected { version, .. }
            | BackendOutcome::Warned { version, .. }
            | BackendOutcome::Down { version, .. } => version.as_ref(),
            BackendOutcome::InProcess => None,
        }
    }

    /// Whether the Backend is usable (Ready=True).
    pub fn is_ready(&self) -> bool {
        !matches!(self, BackendOutcome::Down { .. })
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
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn at(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).expect("time"))
    }

    #[test]
    fn rabbitmq_and_sqs_backends_are_connected_or_down_with_a_reason() {
        let up = BackendOutcome::Connected {
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
        let down = BackendOutcome::down(reasons::AUTH_FAILED, "refused".into());
        let s = backend_applied(&p);
        let p = backend_status(Some(&s), Some(1), caps(), &down, &at(2)).expect("second");
        assert_eq!(p.conditions[0].reason, reasons::AUTH_FAILED);
        assert_eq!(
            p.server_version.as_deref(),
            Some("3.10.8"),
            "the known version stays"
        );
    }

    pub(crate) fn caps() -> Capabilities {
        settle::policy::capabilities_of(settle::policy::BackendKind::Nats)
    }

    pub(crate) fn backend_applied(p: &BackendStatusPatch) -> BackendStatus {
        BackendStatus {
            observed_generation: p.observed_generation,
            server_version: p.server_version.clone(),
            capabilities: Some(p.capabilities.clone()),
            conditions: p.conditions.clone(),
        }
    }

    /// Each outcome has its status and reason, and once applied is not written again.
    pub(crate) fn assert_maps_and_settles(cases: Vec<(BackendOutcome, &str, &str)>) {
        for (o, status, reason) in cases {
            let p = backend_status(None, Some(1), caps(), &o, &at(1)).expect("first");
            assert_eq!(p.conditions[0].status, status, "{o:?}");
            assert_eq!(p.conditions[0].reason, reason, "{o:?}");
            let again = backend_status(Some(&backend_applied(&p)), Some(1), caps(), &o, &at(2));
            assert_eq!(again, None, "{o:?} written twice");
        }
    }

    #[test]
    fn backend_outcomes_map_to_reasons_and_settle() {
        assert_maps_and_settles(vec![
            (
                BackendOutcome::Connected {
                    kind: BackendKind::Nats,
                    version: Some("2.15.3".into()),
                    detail: "with JetStream".into(),
                },
                "True",
                reasons::CONNECTED,
            ),
            (BackendOutcome::InProcess, "True", reasons::IN_PROCESS),
            (
                BackendOutcome::down(reasons::SECRET_MISSING, "Secret \"x\" not found".into()),
                "False",
                reasons::SECRET_MISSING,
            ),
        ]);
    }

    #[test]
    fn a_backend_keeps_its_known_version_while_unreachable() {
        let up = BackendOutcome::Connected {
            kind: BackendKind::Nats,
            version: Some("2.15.3".into()),
            detail: "with JetStream".into(),
        };
        let s = backend_applied(&backend_status(None, Some(1), caps(), &up, &at(1)).expect("1"));
        let down = BackendOutcome::down(reasons::UNREACHABLE, "x: y".into());
        let p = backend_status(Some(&s), Some(1), caps(), &down, &at(2)).expect("2");
        assert_eq!(p.server_version.as_deref(), Some("2.15.3"));
    }

    #[test]
    fn a_connected_backend_says_what_it_reached_word_for_word() {
        let [with, without] = [Some("2.15.3".to_string()), None].map(|version| {
            BackendOutcome::Connected {
                kind: BackendKind::Nats,
                version,
                detail: "with JetStream".into(),
            }
            .want()
            .message
        });
        assert_eq!(with, "connected to nats-server 2.15.3 with JetStream");
        let [rabbitmq, sqs] = [
            (
                BackendKind::Rabbitmq,
                Some("3.10.8".to_string()),
                "AMQP and the management API answer",
            ),
            (BackendKind::Sqs, None, "ListQueues answers at http://x"),
        ]
        .map(|(kind, version, detail)| {
            BackendOutcome::Connected {
                kind,
                version,
                detail: detail.into(),
            }
            .want()
            .message
        });
        assert_eq!(
            rabbitmq,
            "connected to rabbitmq 3.10.8: AMQP and the management API answer"
        );
        assert_eq!(sqs, "connected to sqs: ListQueues answers at http://x");
        assert_eq!(
            without,
            "connected to nats-server (version not announced) with JetStream"
        );
    }
}
