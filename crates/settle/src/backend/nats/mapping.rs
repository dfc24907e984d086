//! The one mapping from a Subscription to a JetStream consumer: [`desired`] (the config Settle
//! wants, with the consumer name it derives), [`normalise`] (a live consumer's config with the
//! server's defaults filled in, in the same shape) and [`diff`] (what differs, split into what
//! the server can edit in place and what it cannot).
//!
//! The controller creates and updates consumers with it, the runtime creates (code-defined
//! subscriptions) or checks (operator-made ones) with it, and a test ties the admission rule on
//! immutable fields to [`diff`]. Pure: no I/O. It must not decide what to do about a difference
//! (the callers do), and no other file may build a consumer config.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use async_nats::jetstream::consumer::{self, AckPolicy, DeliverPolicy, ReplayPolicy};

use crate::api::{DeletionPolicy, Mode};
use crate::policy::{DEFAULT_ACK_WAIT, ResolvedPolicy};

/// The metadata key naming the Subscription (`namespace/name`) a consumer belongs to. It marks
/// the consumers the operator owns, so it never touches one it did not make.
pub const OWNER_KEY: &str = "settle.dev/subscription";
/// The metadata key holding the UID of the Subscription object a consumer was made for: a
/// consumer left over from an earlier object of the same name is not the new one's, and the
/// runtime reports the UID with its counts so the account counts them for that object only.
pub const UID_KEY: &str = "settle.dev/uid";
/// The metadata key holding that object's `deletionPolicy`: a consumer left over from an object
/// deleted while no operator ran is removed for the next object of its name only when that
/// object asked for `Delete`.
pub const DELETION_POLICY_KEY: &str = "settle.dev/deletion-policy";
/// The server's defaults for what Settle does not set (nats-server 2.10–2.15).
const SERVER_MAX_WAITING: i64 = 512;
const SERVER_MAX_ACK_PENDING: i64 = 1000;

/// A consumer as Settle manages it: the fields it sets, in the server's terms, with every default
/// spelled out so that two configs compare equal exactly when the server holds the same.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsumerConfig {
    /// The stream the consumer lives in (cannot change: a consumer belongs to one stream).
    pub stream: String,
    /// The consumer's name, which is also its durable name.
    pub name: String,
    pub description: String,
    /// Where a new consumer starts: all stored messages, or only new ones.
    pub deliver_policy: DeliverPolicy,
    pub ack_policy: AckPolicy,
    pub ack_wait: Duration,
    /// Attempts per message, the first included; -1 is unlimited.
    pub max_deliver: i64,
    pub filter_subject: String,
    pub max_ack_pending: i64,
    /// Never set by Settle: the server would lengthen every delayed nak by it.
    pub backoff: Vec<Duration>,
    pub replay_policy: ReplayPolicy,
    pub max_waiting: i64,
    /// A push consumer (`deliver_subject` set) cannot become a pull consumer in place.
    pub push: bool,
    pub headers_only: bool,
    pub inactive_threshold: Duration,
    pub sample_frequency: u8,
    /// User metadata (the server's own `_nats.*` keys are left out).
    pub metadata: BTreeMap<String, String>,
}

/// The consumer name Settle uses for a Subscription: its `durableName`, or, without one (only
/// possible under AtMostOnce), a stable name from namespace and Subscription name. Kubernetes
/// names contain no `_`, so `settle_<namespace>_<name>` (with `.` as `_`) never collides.
pub fn consumer_name(namespace: &str, subscription: &str, policy: &ResolvedPolicy) -> String {
    match &policy.durable_name {
        Some(durable) => durable.clone(),
        None => format!("settle_{namespace}_{}", subscription.replace('.', "_")),
    }
}

/// The consumer Settle wants for Subscription `namespace/subscription` on `stream`.
pub fn desired(
    namespace: &str,
    subscription: &str,
    stream: &str,
    policy: &ResolvedPolicy,
) -> ConsumerConfig {
    let alo = policy.mode == Mode::AtLeastOnce;
    ConsumerConfig {
        stream: stream.to_string(),
        name: consumer_name(namespace, subscription, policy),
        description: format!("settle subscription {namespace}/{subscription}"),
        // A named consumer replays what the stream holds; a derived AtMostOnce one starts now.
        deliver_policy: if policy.durable_name.is_some() {
            DeliverPolicy::All
        } else {
            DeliverPolicy::New
        },
        ack_policy: if alo {
            AckPolicy::Explicit
        } else {
            AckPolicy::None
        },
        // Under AtMostOnce nothing is acknowledged; the server's own defaults stand.
        ack_wait: if alo {
            policy.ack_wait
        } else {
            DEFAULT_ACK_WAIT
        },
        max_deliver: if alo {
            policy.max_deliver.map_or(-1, i64::from)
        } else {
            -1
        },
        filter_subject: policy.pattern.clone(),
        max_ack_pending: if alo {
            i64::try_from(policy.max_in_flight).unwrap_or(i64::MAX)
        } else {
            0
        },
        backoff: Vec::new(),
        replay_policy: ReplayPolicy::Instant,
        max_waiting: SERVER_MAX_WAITING,
        push: false,
        headers_only: false,
        inactive_threshold: Duration::ZERO,
        sample_frequency: 0,
        metadata: BTreeMap::from([(OWNER_KEY.to_string(), format!("{namespace}/{subscription}"))]),
    }
}

/// How long the server keeps a consumer that a code-defined subscription made under a derived
/// name once no instance reads it: no operator is there to delete it.
pub const CODE_DEFINED_INACTIVE_THRESHOLD: Duration = Duration::from_secs(300);

/// The consumer a runtime with no operator makes for itself: [`desired`], except that one under
/// a derived name is reaped by the server when the last instance has gone.
pub fn desired_by_runtime(
    namespace: &str,
    subscription: &str,
    stream: &str,
    policy: &ResolvedPolicy,
) -> ConsumerConfig {
    let mut c = desired(namespace, subscription, stream, policy);
    if policy.durable_name.is_none() {
        c.inactive_threshold = CODE_DEFINED_INACTIVE_THRESHOLD;
    }
    c
}

/// A live consumer's config in the shape of [`ConsumerConfig`], with the defaults the server
/// fills in when it was not sent a value, and without the server's own metadata.
pub fn normalise(stream: &str, name: &str, live: &consumer::Config) -> ConsumerConfig {
    let explicit = live.ack_policy != AckPolicy::None;
    let mut filter = live.filter_subject.clone();
    if filter.is_empty() && live.filter_subjects.len() == 1 {
        filter = live.filter_subjects[0].clone();
    }
    ConsumerConfig {
        stream: stream.to_string(),
        name: live
            .durable_name
            .clone()
            .or_else(|| live.name.clone())
            .unwrap_or_else(|| name.to_string()),
        description: live.description.clone().unwrap_or_default(),
        deliver_policy: live.deliver_policy,
        ack_policy: live.ack_policy,
        ack_wait: if live.ack_wait.is_zero() {
            DEFAULT_ACK_WAIT
        } else {
            live.ack_wait
        },
        max_deliver: if live.max_deliver == 0 {
            -1
        } else {
            live.max_deliver
        },
        filter_subject: filter,
        max_ack_pending: match live.max_ack_pending {
            0 if explicit => SERVER_MAX_ACK_PENDING,
            n if !explicit && n < 0 => 0,
            n => n,
        },
        backoff: live.backoff.clone(),
        replay_policy: live.replay_policy,
        max_waiting: match (live.max_waiting, live.deliver_subject.is_some()) {
            (0, false) => SERVER_MAX_WAITING,
            (n, _) => n,
        },
        push: live.deliver_subject.is_some(),
        headers_only: live.headers_only,
        inactive_threshold: live.inactive_threshold,
        sample_frequency: live.sample_frequency,
        metadata: live
            .metadata
            .iter()
            .filter(|(k, _)| !k.starts_with("_nats."))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    }
}

impl ConsumerConfig {
    /// The request body's config for creating or updating this consumer.
    pub fn to_server(&self) -> consumer::Config {
        consumer::Config {
            durable_name: Some(self.name.clone()),
            name: Some(self.name.clone()),
            description: Some(self.description.clone()),
            deliver_policy: self.deliver_policy,
            ack_policy: self.ack_policy,
            ack_wait: self.ack_wait,
            max_deliver: self.max_deliver,
            filter_subject: self.filter_subject.clone(),
            max_ack_pending: self.max_ack_pending,
            backoff: self.backoff.clone(),
            replay_policy: self.replay_policy,
            max_waiting: self.max_waiting,
            headers_only: self.headers_only,
            inactive_threshold: self.inactive_threshold,
            sample_frequency: self.sample_frequency,
            metadata: self
                .metadata
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            ..Default::default()
        }
    }

    /// The Subscription (`namespace/name`) this consumer belongs to, if Settle made it.
    pub fn owner(&self) -> Option<&str> {
        self.metadata.get(OWNER_KEY).map(String::as_str)
    }

    /// The UID of the Subscription object this consumer was made for, if marked.
    pub fn owner_uid(&self) -> Option<&str> {
        self.metadata.get(UID_KEY).map(String::as_str)
    }

    /// This config marked as made for Subscription object `uid` with `policy` (the
    /// controller's consumers).
    pub fn for_object(mut self, uid: Option<&str>, policy: DeletionPolicy) -> Self {
        if let Some(uid) = uid {
            self.metadata.insert(UID_KEY.to_string(), uid.to_string());
        }
        let policy = match policy {
            DeletionPolicy::Delete => "Delete",
            DeletionPolicy::Retain => "Retain",
        };
        self.metadata
            .insert(DELETION_POLICY_KEY.to_string(), policy.to_string());
        self
    }

    /// This config with the object marks `live` carries (what the runtime compares: the marks
    /// are the operator's, not the application's policy).
    pub fn marked_as(mut self, live: &ConsumerConfig) -> Self {
        for key in [UID_KEY, DELETION_POLICY_KEY] {
            match live.metadata.get(key) {
                Some(v) => self.metadata.insert(key.to_string(), v.clone()),
                None => self.metadata.remove(key),
            };
        }
        self
    }

    /// Whether this live consumer was made for an earlier object named `owner` (another UID)
    /// that asked for it to be deleted with it: the operator was not running when it went.
    pub fn left_over_for_deletion(&self, owner: &str, uid: Option<&str>) -> bool {
        self.owner() == Some(owner)
            && matches!((self.owner_uid(), uid), (Some(mine), Some(theirs)) if mine != theirs)
            && self.metadata.get(DELETION_POLICY_KEY).map(String::as_str) != Some("Retain")
    }

    /// Whether a live consumer is Subscription `namespace/name` (object `uid`)'s: marked with its
    /// name, and with its UID or none (made before consumers were marked with one).
    pub fn belongs_to(&self, owner: &str, uid: Option<&str>) -> bool {
        self.owner() == Some(owner)
            && match (self.owner_uid(), uid) {
                (Some(mine), Some(theirs)) => mine == theirs,
                _ => true,
            }
    }
}

/// Whether the server can change a field of an existing consumer in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Editable {
    InPlace,
    /// Only by deleting the consumer and creating it again (its unsettled deliveries go with it).
    Recreate,
}

/// One field that differs between the desired and the live consumer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldDiff {
    /// The consumer config field, as the server names it.
    pub field: &'static str,
    /// The Subscription field it comes from, when there is one.
    pub spec_field: Option<&'static str>,
    pub desired: String,
    pub live: String,
}

impl fmt::Display for FieldDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.spec_field {
            Some(spec) => write!(
                f,
                "{} ({spec}): wants {}, the consumer has {}",
                self.field, self.desired, self.live
            ),
            None => write!(
                f,
                "{}: wants {}, the consumer has {}",
                self.field, self.desired, self.live
            ),
        }
    }
}

/// What differs between a desired and a live consumer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Diff {
    /// Fields an update can change in place.
    pub editable: Vec<FieldDiff>,
    /// Fields only a new consumer can change.
    pub immutable: Vec<FieldDiff>,
}

impl Diff {
    pub fn is_empty(&self) -> bool {
        self.editable.is_empty() && self.immutable.is_empty()
    }
}

/// The fields Settle manages: the config field, the spec field it comes from, whether the server
/// can edit it in place, and how to show it. The one list both `diff` and its tests read.
type Show = fn(&ConsumerConfig) -> String;
const FIELDS: &[(&str, Option<&str>, Editable, Show)] = &[
    ("stream", Some("spec.stream"), Editable::Recreate, |c| {
        c.stream.clone()
    }),
    (
        "durable_name",
        Some("spec.durableName"),
        Editable::Recreate,
        |c| c.name.clone(),
    ),
    ("ack_policy", Some("spec.mode"), Editable::Recreate, |c| {
        format!("{:?}", c.ack_policy)
    }),
    (
        "deliver_policy",
        Some("spec.durableName"),
        Editable::Recreate,
        |c| format!("{:?}", c.deliver_policy),
    ),
    ("replay_policy", None, Editable::Recreate, |c| {
        format!("{:?}", c.replay_policy)
    }),
    ("max_waiting", None, Editable::Recreate, |c| {
        c.max_waiting.to_string()
    }),
    ("deliver_subject", None, Editable::Recreate, |c| {
        if c.push { "push" } else { "pull" }.to_string()
    }),
    ("ack_wait", Some("spec.ackWait"), Editable::InPlace, |c| {
        format!("{:?}", c.ack_wait)
    }),
    (
        "max_deliver",
        Some("spec.maxDeliver"),
        Editable::InPlace,
        |c| c.max_deliver.to_string(),
    ),
    (
        "max_ack_pending",
        Some("spec.maxInFlight"),
        Editable::InPlace,
        |c| c.max_ack_pending.to_string(),
    ),
    (
        "filter_subject",
        Some("spec.pattern"),
        Editable::InPlace,
        |c| c.filter_subject.clone(),
    ),
    ("backoff", None, Editable::InPlace, |c| {
        format!("{:?}", c.backoff)
    }),
    ("description", None, Editable::InPlace, |c| {
        c.description.clone()
    }),
    ("headers_only", None, Editable::InPlace, |c| {
        c.headers_only.to_string()
    }),
    ("inactive_threshold", None, Editable::InPlace, |c| {
        format!("{:?}", c.inactive_threshold)
    }),
    ("sample_freq", None, Editable::InPlace, |c| {
        c.sample_frequency.to_string()
    }),
    ("metadata", None, Editable::InPlace, |c| {
        format!("{:?}", c.metadata)
    }),
];

/// What differs between `desired` and `live` (both from this module: `desired` and `normalise`).
pub fn diff(desired: &ConsumerConfig, live: &ConsumerConfig) -> Diff {
    let mut d = Diff::default();
    for (field, spec_field, editable, show) in FIELDS {
        let (want, have) = (show(desired), show(live));
        if want != have {
            let fd = FieldDiff {
                field,
                spec_field: *spec_field,
                desired: want,
                live: have,
            };
            match editable {
                Editable::InPlace => d.editable.push(fd),
                Editable::Recreate => d.immutable.push(fd),
            }
        }
    }
    d
}

#[cfg(test)]
mod tests;
