//! The `Backend` resource: where a broker is, and what it can do (its `Capabilities`).
//!
//! Types only. What a backend kind can do is decided in `policy` (the capability table), not here.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Duration;

/// Where a broker is and how to reach it. Exactly one backend kind must be set, and it cannot
/// change: a Backend of another kind is a new Backend.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "messaging.settle.dev",
    version = "v1alpha1",
    kind = "Backend",
    namespaced,
    status = "BackendStatus",
    shortname = "sbe",
    category = "settle",
    printcolumn = r#"{"name":"Version","type":"string","jsonPath":".status.serverVersion"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
// The second rule is a transition rule (`oldSelf`, on update only): what a Subscription was
// admitted against, and what its consumer or queue was made on, is the Backend's kind, so a
// kind never changes under them.
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "(has(self.nats) ? 1 : 0) + (has(self.rabbitmq) ? 1 : 0) + (has(self.sqs) ? 1 : 0) + (has(self.memory) ? 1 : 0) == 1",
    "message": "exactly one backend kind must be set: nats, rabbitmq, sqs or memory"
}, {
    "rule": "has(self.nats) == has(oldSelf.nats) && has(self.rabbitmq) == has(oldSelf.rabbitmq) && has(self.sqs) == has(oldSelf.sqs) && has(self.memory) == has(oldSelf.memory)",
    "message": "the backend kind (nats, rabbitmq, sqs, memory) cannot change; delete the Backend and create a new one"
}]))]
#[serde(rename_all = "camelCase")]
pub struct BackendSpec {
    /// A NATS JetStream server or cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nats: Option<NatsBackendSpec>,
    /// A RabbitMQ broker (AMQP 0-9-1, no plugins needed): each Subscription becomes a quorum
    /// queue bound to a topic exchange.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rabbitmq: Option<RabbitmqBackendSpec>,
    /// The in-memory backend of the handler runtime: for tests and local development only;
    /// nothing survives a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryBackendSpec>,
    /// Amazon SQS, or an SQS-compatible server (ElasticMQ): one queue per Subscription.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sqs: Option<SqsBackendSpec>,
}

/// How to reach NATS JetStream.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NatsBackendSpec {
    /// Server URLs, e.g. nats://nats.messaging:4222 (tls:// for TLS). One to 16, each at most
    /// 512 characters; no credentials in them (use credentialsSecretRef).
    #[schemars(length(min = 1, max = 16), inner(length(min = 1, max = 512)))]
    pub servers: Vec<String>,
    /// A Secret in the Backend's namespace holding credentials: key `creds` (a .creds file),
    /// `nkey` (an nkey seed), `token`, or `user` and `password`. Optional. The Secret must carry
    /// the label `settle.dev/backend-credentials: "true"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<SecretRef>,
    /// TLS settings. Optional; without them the connection follows the URL scheme.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<NatsTlsSpec>,
}

/// TLS settings for NATS.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NatsTlsSpec {
    /// A Secret with key `ca.crt`: the CA that signed the server's certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretRef>,
}

/// How to reach RabbitMQ.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RabbitmqBackendSpec {
    /// AMQP URLs, e.g. amqp://rabbitmq.messaging:5672 (amqps:// for TLS), tried in order. At
    /// least one, at most 16, each at most 512 characters. No credentials in them: use
    /// credentialsSecretRef.
    #[schemars(length(min = 1, max = 16), inner(length(min = 1, max = 512)))]
    pub urls: Vec<String>,
    /// The virtual host. `/` unless set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub vhost: Option<String>,
    /// The topic exchange messages are published to and queues are bound to, by the
    /// Subscription's pattern (`*` stays `*`, `>` becomes `#`). `amq.topic` unless set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub exchange: Option<String>,
    /// Where a message declined on its last attempt (counted Exhausted) goes: the queues get
    /// this `x-dead-letter-exchange`. Unset: it is dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub dead_letter_exchange: Option<String>,
    /// A Secret in the Backend's namespace with keys `username` and `password`, carrying the
    /// label `settle.dev/backend-credentials: "true"`. Optional: without it, RabbitMQ's default
    /// user guest (which only connects locally).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<SecretRef>,
    /// TLS settings. Optional; without them the connection follows the URL scheme.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<RabbitmqTlsSpec>,
    /// The management API's URL, e.g. http://rabbitmq.messaging:15672 (the `rabbitmq_management`
    /// plugin), reached with the same credentials (and CA) as AMQP. Optional, but without it
    /// the operator cannot read a queue's arguments, bindings or owner, nor the server's
    /// version and the queue gauges: it then only makes missing queues and re-binds them, and a
    /// differing argument shows as the broker's refusal to redeclare the queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub management_url: Option<String>,
    /// The RabbitMQ users whose stats reports count for this Backend's Subscriptions: a report
    /// (and an instance's registration) counts only if its `user_id`, which RabbitMQ checks
    /// against the connection's user, is one of them; any other is dropped (counted in
    /// `settle_account_reports_total{outcome="wrong_writer"}`). Set it on a broker shared by
    /// tenants: on one vhost anyone who may publish to the default exchange can reach any queue.
    /// Empty: every report counts, whoever wrote it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub report_users: Vec<String>,
    /// Consent to share this vhost with Backends of other namespaces. On one vhost anyone who
    /// may publish through the default exchange can write the operator's ledger and mark queues
    /// of every Subscription on it, which no permission regex can prevent; so a Backend on a
    /// vhost that an older Backend of another namespace uses is refused (`Ready=False
    /// SharedVhost`) unless both set this, and then says what is not protected. Give each
    /// namespace a vhost of its own instead where tenants do not trust each other.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_vhost: Option<bool>,
}

/// TLS settings for RabbitMQ.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RabbitmqTlsSpec {
    /// A Secret with key `ca.crt`: the CA that signed the broker's certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretRef>,
}

/// How to reach SQS.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SqsBackendSpec {
    /// The AWS region, e.g. eu-west-1. Optional: by default the pod's (AWS_REGION).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub region: Option<String>,
    /// The endpoint URL, replacing the region's: an SQS-compatible server
    /// (http://elasticmq.messaging:9324) or a VPC endpoint. Optional.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub endpoint: Option<String>,
    /// A Secret in the Backend's namespace with keys `accessKeyId` and `secretAccessKey`,
    /// carrying the label `settle.dev/backend-credentials: "true"`. Optional only in the
    /// namespaces the installer lists (`--sqs-pod-identity-namespaces`): without it, the
    /// operator pod's own identity (the AWS SDK's default credential chain: IRSA, EKS Pod
    /// Identity, instance profile, environment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<SecretRef>,
    /// Put before every queue name Settle makes or publishes to, e.g. `team-a-`. A queue name
    /// (prefix, name and the `-dlq` of a dead-letter queue) has at most 80 characters:
    /// letters, digits, `-` and `_`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 60), regex(pattern = r"^[A-Za-z0-9_-]*$"))]
    pub queue_prefix: Option<String>,
}

/// The in-memory backend takes no settings.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MemoryBackendSpec {}

/// A reference to a Secret in the same namespace. The Secret must carry the label
/// `settle.dev/backend-credentials: "true"` before a Backend may use it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SecretRef {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// What a backend can honour (docs/semantics.md K1–K3, K6–K10). Shown in Backend status,
/// used by admission to refuse specs the backend cannot honour.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Capabilities {
    /// The backend can hold a declined message back for a while (needed by backoff and maxNackDelay).
    pub delays_redelivery: bool,
    /// The longest the backend can hold a message back; unset means no limit.
    #[serde(default)]
    pub max_redelivery_delay: Option<Duration>,
    /// A restart can spend a message's last attempt where no handler saw it, so Exhausted can undercount.
    pub restart_can_spend_unseen_attempt: bool,
    /// A subject names one queue (SQS, which has no subjects): a pattern is one literal subject,
    /// the name of the subscription's own queue, so it must equal the durableName (K8).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub subject_names_queue: bool,
    /// What the broker does with a message whose handler has not settled it after a while:
    /// PerSubscription (unless set) honours ackWait, slowHandler and maxProcessingTime.
    #[serde(default)]
    pub ack_timeout: AckTimeout,
    /// The most unsettled deliveries one consumer can hold (the largest maxInFlight it can
    /// honour); unset means no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<u32>,
    /// maxDeliver is fixed when the consumer is made (a RabbitMQ quorum queue's delivery limit
    /// is an argument that cannot change in place): a change is refused at admission (K9).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub max_deliver_fixed: bool,
    /// A subscription can name the stream it consumes from (`spec.stream`; JetStream). Without
    /// it (RabbitMQ, SQS) the queue is the Subscription's own, and `spec.stream` is refused at
    /// admission (K10). A status written before this field existed said nothing about streams:
    /// read as true.
    #[serde(default = "named_streams_unless_said")]
    pub named_streams: bool,
}

fn named_streams_unless_said() -> bool {
    true
}

/// What a broker does with a message whose handler has not settled it (docs/semantics.md K6).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum AckTimeout {
    /// After the subscription's ackWait the broker hands the message on, unless the runtime
    /// extends the lease (JetStream, SQS): ackWait, slowHandler and maxProcessingTime apply.
    #[default]
    PerSubscription,
    /// The broker never hands a message on while the channel that received it lives; one
    /// broker-wide timeout (RabbitMQ's `consumer_timeout`) closes the channel instead, and every
    /// unsettled message on it goes back to the queue. ackWait, slowHandler and
    /// maxProcessingTime have no effect.
    BrokerWide,
    /// Nothing ever hands the message on (the in-memory backend). The fields do nothing, and
    /// admission says nothing, so a spec tested on memory runs unchanged on a broker.
    Never,
}

/// What Settle observed of the backend.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackendStatus {
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The broker's version, as it reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_version: Option<String>,
    /// What this backend can honour, from its kind and its live version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<Capabilities>,
    /// Ready: Settle can reach the broker. A list-map keyed by `type`, so each of Settle's status writers server-side-applies its
    /// own conditions without erasing another's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}
