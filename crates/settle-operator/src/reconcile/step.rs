//! What the Subscription pipeline ([`super::subscription`]) and its broker steps
//! ([`super::nats`], [`super::rabbitmq`], [`super::sqs`]) share: the [`Target`] the pipeline
//! builds once from a validated Subscription and hands to a step, the [`Change`]s a step made on
//! the broker, and what the cleanup's broker call did ([`Removal`]). A step returns these; the
//! pipeline alone writes the Events and counts the operations.
//!
//! It must not call a broker or the API server, and imports nothing from the pipeline or the
//! steps.

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use super::conditions::events;
use super::status::{ADOPT_ANNOTATION, SubOutcome};
use settle::api::{Adopt, ConsumerRef, Subscription};
use settle::policy::{Pause, ResolvedPolicy};

/// `status.consumer.stream` of an SQS queue (SQS has no streams or exchanges).
pub const SQS_STREAM: &str = "sqs";

/// One Subscription as every step needs it, derived once.
pub struct Target<'a> {
    /// The object itself, for the spec's fields no step shares.
    pub sub: &'a Subscription,
    pub namespace: String,
    pub name: String,
    /// `namespace/name`: the owner mark every broker object of this Subscription carries.
    pub owner: String,
    pub uid: Option<String>,
    /// The spec's policy with every default filled in.
    pub policy: ResolvedPolicy,
    /// The consumer or queue status shows from before.
    pub known: Option<ConsumerRef>,
    /// The UID annotation `settle.dev/adopt` names, if any (C15).
    pub adopt: Option<String>,
    /// The pause the spec asks for now (`spec.paused`, `spec.pausedUntil`).
    pub pause: Pause,
    /// The `Paused` condition's status as status shows it (`None`: never paused).
    pub pause_shown: Option<String>,
}

impl<'a> Target<'a> {
    /// The target of `sub` at `now` (which decides whether a `pausedUntil` has passed).
    pub fn of(sub: &'a Subscription, now: Timestamp) -> Target<'a> {
        let namespace = sub.namespace().unwrap_or_default();
        let name = sub.name_any();
        Target {
            owner: format!("{namespace}/{name}"),
            namespace,
            name,
            uid: sub.metadata.uid.clone(),
            policy: ResolvedPolicy::resolve(&sub.spec.policy),
            known: sub.status.as_ref().and_then(|s| s.consumer.clone()),
            adopt: sub.annotations().get(ADOPT_ANNOTATION).cloned(),
            pause: Pause::of(&sub.spec, now),
            pause_shown: sub
                .status
                .as_ref()
                .and_then(|s| {
                    super::conditions::find(&s.conditions, super::conditions::types::PAUSED)
                })
                .map(|c| c.status.clone()),
            sub,
        }
    }

    pub fn uid(&self) -> Option<&str> {
        self.uid.as_deref()
    }

    pub fn adopt(&self) -> Option<&str> {
        self.adopt.as_deref()
    }

    /// What `spec.adopt` lets this Subscription do with a consumer or queue of its name that
    /// Settle did not make (no owner mark), in a namespace `allowed` may or may not list.
    pub fn adoption(&self, allowed: &AdoptNamespaces) -> Adoption {
        match self.sub.spec.adopt {
            Adopt::Never => Adoption::Never,
            Adopt::IfCompatible if allowed.allows(&self.namespace) => Adoption::IfCompatible,
            Adopt::IfCompatible => Adoption::NotAllowed,
        }
    }
}

/// The namespaces whose Subscriptions may take over, by `spec.adopt: IfCompatible`, a consumer or
/// queue Settle did not make (`--adopt-namespaces`; `*`: every namespace). On a broker several
/// namespaces reach with the same credentials, a durableName reaches another team's consumer
/// of that name: only the namespaces listed may take one over (docs/semantics.md J9).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdoptNamespaces(Vec<String>);

impl AdoptNamespaces {
    pub fn new(list: &[String]) -> Self {
        AdoptNamespaces(
            list.iter()
                .map(|n| n.trim().to_string())
                .filter(|n| !n.is_empty())
                .collect(),
        )
    }

    pub fn allows(&self, namespace: &str) -> bool {
        self.0.iter().any(|n| n == "*" || n == namespace)
    }
}

/// What a Subscription may do with a consumer or queue of its name Settle did not make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adoption {
    /// `spec.adopt: Never`: leave it alone.
    Never,
    /// `spec.adopt: IfCompatible`, in a namespace `--adopt-namespaces` does not list.
    NotAllowed,
    /// Take it over when it equals the spec where the broker cannot change it in place.
    IfCompatible,
}

/// What a step did on the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    /// Made for the first time.
    Created,
    /// Made again: it was missing (deleted on the broker, or lost), or left over for deletion.
    Recreated,
    /// Changed in place.
    Updated,
    /// Taken over: from an earlier object of this name, as the adopt annotation asked, or one
    /// Settle did not make, as `spec.adopt: IfCompatible` asked.
    Adopted,
    /// Paused on the broker as the spec asks (JetStream's pause; a marker on RabbitMQ and SQS).
    Paused,
    /// Resumed on the broker as the spec asks.
    Resumed,
}

impl ChangeKind {
    /// `settle_operations_total{op}`.
    pub fn op(self) -> &'static str {
        match self {
            ChangeKind::Created => "create",
            ChangeKind::Recreated => "recreate",
            ChangeKind::Updated => "update",
            ChangeKind::Adopted => "adopt",
            ChangeKind::Paused => "pause",
            ChangeKind::Resumed => "resume",
        }
    }

    /// The Event's reason.
    pub fn reason(self) -> &'static str {
        match self {
            ChangeKind::Created => events::CREATED,
            ChangeKind::Recreated => events::RECREATED,
            ChangeKind::Updated => events::UPDATED,
            ChangeKind::Adopted => events::ADOPTED,
            ChangeKind::Paused => events::PAUSED,
            ChangeKind::Resumed => events::RESUMED,
        }
    }
}

/// One change, with the Event's note.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub kind: ChangeKind,
    pub note: String,
}

/// What a step returns: what the broker now holds, and what it changed to get there (in order;
/// a step that fails halfway still reports what it had changed).
pub struct Converged {
    pub outcome: SubOutcome,
    pub changes: Vec<Change>,
}

/// The changes of one step, collected as it goes.
#[derive(Default)]
pub struct Changes(Vec<Change>);

impl Changes {
    pub fn push(&mut self, kind: ChangeKind, note: String) {
        self.0.push(Change { kind, note });
    }

    pub fn with(self, outcome: SubOutcome) -> Converged {
        Converged {
            outcome,
            changes: self.0,
        }
    }
}

/// What the cleanup's broker call did.
#[derive(Debug)]
pub enum Removal {
    /// Deleted; the Event's note.
    Deleted(String),
    /// Nothing of this Subscription's was there (gone already, or not its own).
    Nothing,
    /// The broker cannot be asked now: deletion waits.
    Wait(String),
    /// The broker refused: tried again.
    Failed(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use settle::api::{BackendRef, DeliveryPolicy, SubscriptionSpec};

    fn sub(ns: &str, adopt: Adopt) -> Subscription {
        let mut s = Subscription::new(
            "orders",
            SubscriptionSpec {
                backend_ref: BackendRef {
                    name: "nats".into(),
                },
                stream: None,
                deletion_policy: Default::default(),
                adopt,
                paused: false,
                paused_until: None,
                policy: DeliveryPolicy {
                    pattern: "orders.>".into(),
                    ..Default::default()
                },
            },
        );
        s.metadata.namespace = Some(ns.into());
        s
    }

    #[test]
    fn a_namespace_adopts_only_when_it_asks_and_the_operator_lists_it() {
        let none = AdoptNamespaces::new(&[]);
        let listed = AdoptNamespaces::new(&[" shop".into(), "".into(), "ops".into()]);
        let all = AdoptNamespaces::new(&["*".into()]);
        let now = Timestamp::now();
        let (shop, other) = (
            sub("shop", Adopt::IfCompatible),
            sub("team-b", Adopt::IfCompatible),
        );
        assert_eq!(Target::of(&shop, now).adoption(&none), Adoption::NotAllowed);
        assert_eq!(
            Target::of(&shop, now).adoption(&listed),
            Adoption::IfCompatible
        );
        assert_eq!(
            Target::of(&other, now).adoption(&listed),
            Adoption::NotAllowed
        );
        assert_eq!(
            Target::of(&other, now).adoption(&all),
            Adoption::IfCompatible
        );
        let never = sub("shop", Adopt::Never);
        for allowed in [&none, &listed, &all] {
            assert_eq!(Target::of(&never, now).adoption(allowed), Adoption::Never);
        }
    }
}
