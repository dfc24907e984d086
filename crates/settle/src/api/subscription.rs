//! The `Subscription` resource: one consumer, its delivery policy, and its account.
//!
//! Types only. `DeliveryPolicy` is the part the handler runtime needs too (`bus::Subscriber`
//! embeds it), so every policy field is written once. The rules about which combinations a
//! backend can honour, and the defaults, live in `policy`, not here.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{ConsumerStats, Duration};

/// A message subscription: Settle creates and keeps a broker consumer matching this spec, and
/// reports every delivery's outcome in status.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "messaging.settle.dev",
    version = "v1alpha1",
    kind = "Subscription",
    namespaced,
    status = "SubscriptionStatus",
    shortname = "sub",
    shortname = "subs",
    category = "settle",
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".spec.mode"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Delivered","type":"integer","jsonPath":".status.stats.delivered"}"#,
    printcolumn = r#"{"name":"Exhausted","type":"integer","jsonPath":".status.stats.exhausted"}"#,
    printcolumn = r#"{"name":"Stranded","type":"integer","jsonPath":".status.stats.stranded"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SubscriptionSpec {
    /// The Backend (in this namespace) whose broker carries the messages. Cannot change after creation.
    pub backend_ref: BackendRef,
    /// The JetStream stream to consume from. Optional: by default, the stream whose subjects
    /// cover `pattern`. Cannot change after creation. A stream name: at most 255 characters,
    /// without whitespace, `.`, `*`, `>`, `/` or `\\`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255), regex(pattern = r"^[^.*>/\\\s]+$"))]
    pub stream: Option<String>,
    /// What happens to the broker consumer when this Subscription is deleted. Delete (the
    /// default) removes it; Retain leaves it on the broker (its stored position and unsettled
    /// messages with it), for a consumer that must outlive the resource.
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,
    /// Whether Settle takes over a consumer (or queue) of this name that it did not make. Never
    /// (the default): such a consumer is left alone (ConsumerConflict). IfCompatible: taken over,
    /// with its position and what it holds, when it equals what this spec maps to where the
    /// broker cannot change it in place (what can change is then brought to the spec); one that
    /// differs stays ConsumerConflict, its differing fields named. Never one another
    /// Subscription made. May change at any time: it is read only while the consumer is not yet
    /// this Subscription's.
    #[serde(default, skip_serializing_if = "Adopt::is_never")]
    pub adopt: Adopt,
    /// Pause delivery without deleting anything: the consumer (or queue) and its messages stay,
    /// nothing is offered to handlers, and the account keeps counting. On NATS the consumer is
    /// paused on the server (JetStream's pause, nats-server 2.11+); on RabbitMQ and SQS every
    /// application stops fetching. False (the default) resumes; delivery picks up where it
    /// stopped.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// When a pause ends by itself (RFC 3339, e.g. 2026-12-01T10:00:00Z). Only with
    /// `paused: true`; unset, the pause lasts until `paused` is set false. A time already
    /// passed means resumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_until: Option<Time>,
    /// The delivery policy.
    #[serde(flatten)]
    pub policy: DeliveryPolicy,
}

/// The delivery policy of a subscription: the part of the spec the handler runtime honours.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryPolicy {
    /// The subject pattern to receive, e.g. `orders.>` (`*` matches one token, `>` the rest).
    #[schemars(length(min = 1, max = 255))]
    pub pattern: String,
    /// How deliveries are shared. Fanout (the default): each Subscription sees every message.
    #[serde(default)]
    pub shape: Shape,
    /// What the bus does with a handler's settlement. AtMostOnce (the default): every
    /// settlement is recorded and none is acted on; nothing comes back. AtLeastOnce: a Nack, or
    /// silence, brings the message back, up to maxDeliver attempts; requires durableName.
    /// Cannot change after creation.
    #[serde(default)]
    pub mode: Mode,
    /// The identity that outlives the process (the broker's durable consumer name). Required
    /// under AtLeastOnce, on every backend. Cannot change after creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255), regex(pattern = r"^[A-Za-z0-9_-]+$"))]
    pub durable_name: Option<String>,
    /// Attempts per message under AtLeastOnce, the first included. A message declined on its
    /// last attempt is counted Exhausted: real data loss. Unset means the backend's limit (unlimited on JetStream).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_deliver: Option<i64>,
    /// How long a declined (nacked or silent) message waits before its next attempt: `initial`
    /// after the first decline, multiplied by `multiplier` after each further one, capped at
    /// `max` (1s, 2s, 4s … 1m). Without it a Nack brings the message back at once. AtLeastOnce
    /// only; needs a backend that can delay redelivery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<Backoff>,
    /// The longest delay a handler may ask for with NackAfter. Unset means backoff.max.
    /// AtLeastOnce only; needs a backend that can delay redelivery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_nack_delay: Option<Duration>,
    /// What happens when a handler runs past ackWait. ExtendLease (the default) keeps the
    /// message for up to maxProcessingTime (handlers must be idempotent). Redeliver lets the
    /// broker hand it on while the handler may still run (handlers must tolerate concurrent
    /// execution of one message, and ackWait becomes a correctness setting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slow_handler: Option<SlowHandler>,
    /// How long the broker waits for a settlement before it assumes the handler is dead
    /// (30s unless set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ack_wait: Option<Duration>,
    /// Under ExtendLease, how long a message stays with a running handler before it is handed
    /// on and counted LeaseExpired (5m unless set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_processing_time: Option<Duration>,
    /// How many unsettled deliveries one subscription may hold (RabbitMQ's prefetch; JetStream's
    /// max ack pending). 250 unless set; use 1 for expensive, unevenly sized work. A handler that
    /// forgets to settle is counted Silent, so it never stalls the consumer unseen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub max_in_flight: Option<i32>,
}

/// The Backend a Subscription uses.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BackendRef {
    /// The Backend's name, in the Subscription's namespace.
    #[schemars(length(min = 1))]
    pub name: String,
}

/// The redelivery schedule of declined messages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Backoff {
    /// The wait after the first decline, e.g. 1s.
    pub initial: Duration,
    /// The longest wait, e.g. 1m. Must not be shorter than initial.
    pub max: Duration,
    /// The factor between consecutive waits; at least 1. Defaults to 2.
    #[serde(default = "default_multiplier")]
    pub multiplier: f64,
}

fn default_multiplier() -> f64 {
    2.0
}

/// What happens to a Subscription's consumer when the Subscription is deleted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum DeletionPolicy {
    /// The consumer is deleted with the Subscription.
    #[default]
    Delete,
    /// The consumer stays on the broker.
    Retain,
}

/// Whether a Subscription takes over a consumer or queue of its name that Settle did not make.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Adopt {
    /// Never: one Settle did not make is left alone (ConsumerConflict).
    #[default]
    Never,
    /// Taken over when it equals the spec where the broker cannot change it in place.
    IfCompatible,
}

impl Adopt {
    pub fn is_never(&self) -> bool {
        *self == Adopt::Never
    }
}

/// How deliveries are shared between subscriptions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Shape {
    /// Each Subscription sees every message.
    #[default]
    Fanout,
}

/// What the bus does with a settlement.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Mode {
    /// Nothing is acted on; every settlement is still recorded.
    #[default]
    AtMostOnce,
    /// A Nack, or silence, brings the message back, up to maxDeliver.
    AtLeastOnce,
}

/// What happens to a message whose handler runs past ackWait.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum SlowHandler {
    /// Keep the message with its handler for up to maxProcessingTime.
    #[default]
    ExtendLease,
    /// Let the broker hand it on after ackWait.
    Redeliver,
}

/// Where the subscription's consumer lives on the broker.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ConsumerRef {
    /// The stream.
    pub stream: String,
    /// The consumer's name.
    pub name: String,
}

/// The account: the consumer Settle made, and every delivery's outcome so far.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SubscriptionStatus {
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The broker consumer this subscription is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumer: Option<ConsumerRef>,
    /// Cumulative delivery counters (never decreasing) and the broker's gauges.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats: Option<SubscriptionStats>,
    /// When stats were last written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats_updated_at: Option<Time>,
    /// Accepted, Ready, Exhausting, Stranding. A list-map keyed by `type`, so each of Settle's status writers server-side-applies its
    /// own conditions without erasing another's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// ConsumerStats plus the broker's gauges.
#[derive(Clone, Debug, Default, PartialEq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SubscriptionStats {
    /// The cumulative counters (docs/semantics.md C1–C11).
    #[serde(flatten)]
    pub counters: ConsumerStats,
    /// Messages in the stream not yet delivered to this consumer (a gauge).
    #[serde(default)]
    pub pending: u64,
    /// Messages delivered and not yet settled (a gauge).
    #[serde(default)]
    pub ack_pending: u64,
}
