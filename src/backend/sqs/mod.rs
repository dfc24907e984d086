//! The SQS backend (Amazon SQS or an SQS-compatible server such as ElasticMQ): one queue per
//! subscription, long-polled, each received message a `Delivery`, settlements performed with
//! visibility timeouts (docs/semantics.md Q1–Q6).
//!
//! What it sends, and why:
//! - Receive: a long poll for at most as many messages as the subscription has free slots
//!   (maxInFlight), hiding each for ackWait; the attempt is `ApproximateReceiveCount`.
//! - Ack: DeleteMessage. Decline: ChangeMessageVisibility to the delay (0: at once), cut to what
//!   is left of twelve hours from the message's first receive (`hold`), and then reported as
//!   `Performed::DelayShortened`. Last attempt declined: visible again at once, and the queue's
//!   redrive policy (maxReceiveCount = maxDeliver) moves it to the dead-letter queue instead of
//!   offering it again; a queue without one deletes it.
//! - ExtendLease: ChangeMessageVisibility to ackWait, bounded by the same twelve hours;
//!   Redeliver: nothing. Release at close: visible again at once.
//! - AtMostOnce: DeleteMessage as the message is handed out (SQS forgets it on delivery).
//! - Publish: SendMessage to the queue `<prefix><subject>`: a subject is a queue's name.
//! - Stats reports: SendMessage to the Subscription's report queue, which the operator makes
//!   beside its queue ([`report`]); the object's UID is read from the queue's `settle-object` tag.
//!
//! It must not count anything (the settle path does) nor make an operator-owned queue: it creates
//! (or brings in line) only the queue of a code-defined subscription, through `queue::desired`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::ProvideErrorMetadata;
use aws_sdk_sqs::types::{
    Message, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
};
use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinHandle;

pub mod admin;
pub mod hold;
pub mod queue;
pub mod report;

use crate::bus::{
    Broker, BrokerAction, BusError, Consumer, ConsumerOwner, Delivery, DeliveryOptions, OnSettle,
    Performed, Refusal, StatsSink, SubscriptionCtx,
};
use crate::policy::BackendKind;

use hold::{HOLD_LIMIT, hold};

/// SQS's largest batch of one receive.
const MAX_BATCH: usize = 10;
/// The message attribute that says a body is base64 (the payload was not text SQS can carry).
pub const BODY_ENCODING_ATTRIBUTE: &str = "settle-body-encoding";

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What went wrong talking to SQS.
#[derive(Debug, thiserror::Error)]
pub enum SqsError {
    #[error("no SQS queue named {name:?}{hint}")]
    QueueMissing { name: String, hint: String },
    #[error("SQS {operation}: {message}")]
    Api {
        operation: &'static str,
        message: String,
    },
    #[error(transparent)]
    Mapping(#[from] queue::QueueError),
    #[error("{0}")]
    Config(String),
}

impl From<SqsError> for BusError {
    fn from(e: SqsError) -> BusError {
        BusError::Broker {
            backend: BackendKind::Sqs,
            source: Box::new(e),
        }
    }
}

fn api(operation: &'static str, e: impl std::error::Error) -> SqsError {
    // The SDK's Display is terse; its source chain says what the server answered.
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        message = format!("{message}: {s}");
        source = s.source();
    }
    SqsError::Api { operation, message }
}

/// Whether SQS answered that the queue does not exist. Matched by code: ElasticMQ and SQS spell
/// it differently across protocols, and the SDK models only one spelling.
fn queue_missing(e: &impl ProvideErrorMetadata) -> bool {
    e.code().is_some_and(|c| {
        c == "QueueDoesNotExist"
            || c == "AWS.SimpleQueueService.NonExistentQueue"
            || c.ends_with("#QueueDoesNotExist")
    })
}

/// Credentials for SQS. `Debug` shows the access key id, never the secret key.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub enum SqsCredentials {
    /// The pod's identity: the AWS SDK's default chain (environment, IRSA web identity, EKS Pod
    /// Identity, instance profile).
    #[default]
    DefaultChain,
    /// An access key (from the Backend's Secret: `accessKeyId`, `secretAccessKey`).
    Static {
        access_key_id: String,
        secret_access_key: String,
    },
}

impl std::fmt::Debug for SqsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SqsCredentials::DefaultChain => f.write_str("DefaultChain"),
            SqsCredentials::Static { access_key_id, .. } => f
                .debug_struct("Static")
                .field("access_key_id", access_key_id)
                .field("secret_access_key", &"<redacted>")
                .finish(),
        }
    }
}

/// Where SQS is and how to reach it: the Backend's `spec.sqs`, with its Secret read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct SqsSettings {
    /// The region; `None`: the SDK's (AWS_REGION, the profile, the instance).
    pub region: Option<String>,
    /// An endpoint replacing the region's (ElasticMQ, a VPC endpoint).
    pub endpoint: Option<String>,
    pub credentials: SqsCredentials,
    /// Put before every queue name.
    pub queue_prefix: String,
}

impl SqsSettings {
    /// A fingerprint of the settings (credentials included), to tell a changed Secret apart.
    pub fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.hash(&mut h);
        h.finish()
    }

    /// From a Backend's `spec.sqs` and, when it names a Secret, the Secret's two keys.
    pub fn from_spec(spec: &crate::api::SqsBackendSpec, credentials: SqsCredentials) -> Self {
        SqsSettings {
            region: spec.region.clone(),
            endpoint: spec.endpoint.clone(),
            credentials,
            queue_prefix: spec.queue_prefix.clone().unwrap_or_default(),
        }
    }
}

/// SQS as a backend. Clones share one client.
#[derive(Clone)]
pub struct SqsBroker {
    client: Client,
    prefix: String,
    hold_limit: Duration,
    long_poll: Duration,
    urls: Arc<Mutex<HashMap<String, String>>>,
    /// Where each bound subscription's stats reports go (by subscription name).
    reports: Arc<Mutex<HashMap<String, report::ReportsTo>>>,
}

impl SqsBroker {
    /// A client for these settings, over rustls (ring).
    pub async fn connect(settings: SqsSettings) -> Result<SqsBroker, BusError> {
        use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
            .build_https();
        let mut loader =
            aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(http);
        if let Some(region) = settings.region.clone() {
            loader = loader.region(aws_config::Region::new(region));
        }
        if let Some(endpoint) = settings.endpoint.clone() {
            loader = loader.endpoint_url(endpoint);
        }
        if let SqsCredentials::Static {
            access_key_id,
            secret_access_key,
        } = settings.credentials
        {
            loader = loader.credentials_provider(aws_sdk_sqs::config::Credentials::new(
                access_key_id,
                secret_access_key,
                None,
                None,
                "settle-backend-secret",
            ));
        }
        let config = loader.load().await;
        if config.region().is_none() {
            return Err(SqsError::Config(
                "no AWS region: set spec.sqs.region on the Backend (or AWS_REGION in the pod)"
                    .into(),
            )
            .into());
        }
        Ok(SqsBroker::from_client(
            Client::new(&config),
            settings.queue_prefix,
        ))
    }

    /// Uses an existing client; every queue name gets `prefix` in front.
    pub fn from_client(client: Client, prefix: impl Into<String>) -> SqsBroker {
        SqsBroker {
            client,
            prefix: prefix.into(),
            hold_limit: HOLD_LIMIT,
            long_poll: Duration::from_secs(20),
            urls: Arc::default(),
            reports: Arc::default(),
        }
    }

    /// Holds messages at most this long from their first receive instead of SQS's twelve hours
    /// (an SQS-compatible server with another limit; tests).
    pub fn with_hold_limit(mut self, limit: Duration) -> SqsBroker {
        self.hold_limit = limit;
        self
    }

    /// How long one receive waits for messages (1–20 s; default 20 s).
    pub fn with_long_poll(mut self, wait: Duration) -> SqsBroker {
        self.long_poll = wait.clamp(Duration::from_secs(1), Duration::from_secs(20));
        self
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn queue_prefix(&self) -> &str {
        &self.prefix
    }

    /// The URL of the queue `name` (the full name, prefix included), if it exists.
    pub async fn queue_url(&self, name: &str) -> Result<Option<String>, SqsError> {
        if let Some(u) = lock(&self.urls).get(name) {
            return Ok(Some(u.clone()));
        }
        match self.client.get_queue_url().queue_name(name).send().await {
            Ok(out) => {
                let url = out.queue_url.unwrap_or_default();
                lock(&self.urls).insert(name.to_string(), url.clone());
                Ok(Some(url))
            }
            Err(e) if queue_missing(&e) => Ok(None),
            Err(e) => Err(api("GetQueueUrl", e)),
        }
    }

    fn forget_url(&self, name: &str) {
        lock(&self.urls).remove(name);
    }

    /// Every attribute of a queue, by SQS's names.
    pub async fn queue_attributes(&self, url: &str) -> Result<BTreeMap<String, String>, SqsError> {
        let out = self
            .client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::All)
            .send()
            .await
            .map_err(|e| api("GetQueueAttributes", e))?;
        Ok(out
            .attributes
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k.as_str().to_string(), v))
            .collect())
    }

    async fn create_queue(
        &self,
        name: &str,
        attributes: BTreeMap<String, String>,
    ) -> Result<String, SqsError> {
        let attrs: HashMap<QueueAttributeName, String> = attributes
            .into_iter()
            .map(|(k, v)| (QueueAttributeName::from(k.as_str()), v))
            .collect();
        let out = self
            .client
            .create_queue()
            .queue_name(name)
            .set_attributes(Some(attrs))
            .send()
            .await
            .map_err(|e| api("CreateQueue", e))?;
        let url = out.queue_url.unwrap_or_default();
        lock(&self.urls).insert(name.to_string(), url.clone());
        Ok(url)
    }

    /// A code-defined subscription's queue (and dead-letter queue): created from the mapping, or
    /// brought in line with it. Returns the queue's URL and whether it redrives.
    async fn converge_own(&self, ctx: &SubscriptionCtx) -> Result<(String, bool), SqsError> {
        let want = queue::desired(&self.prefix, ctx.policy())?;
        let dlq_arn = match &want.redrive {
            None => None,
            Some(r) => {
                let url = match self.queue_url(&r.dead_letter_queue).await? {
                    Some(u) => u,
                    None => {
                        self.create_queue(&r.dead_letter_queue, queue::dead_letter_attributes())
                            .await?
                    }
                };
                let attrs = self.queue_attributes(&url).await?;
                Some(
                    attrs
                        .get("QueueArn")
                        .cloned()
                        .ok_or_else(|| SqsError::Api {
                            operation: "GetQueueAttributes",
                            message: format!("queue {} has no QueueArn", r.dead_letter_queue),
                        })?,
                )
            }
        };
        let attributes = queue::attributes(&want, dlq_arn.as_deref());
        let url = match self.queue_url(&want.name).await? {
            None => {
                tracing::info!(subscription = %ctx.name(), queue = %want.name, "creating the subscription's SQS queue");
                self.create_queue(&want.name, attributes).await?
            }
            Some(url) => {
                let live = self.queue_attributes(&url).await?;
                let changes = queue::diff(&want, &live);
                if !changes.is_empty() {
                    tracing::info!(subscription = %ctx.name(), queue = %want.name, changes = %changes.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "), "updating the queue to the subscription's policy");
                    let mut set = attributes.clone();
                    if want.redrive.is_none() {
                        // An empty RedrivePolicy removes it.
                        set.insert(queue::REDRIVE_POLICY.to_string(), String::new());
                    }
                    self.client
                        .set_queue_attributes()
                        .queue_url(&url)
                        .set_attributes(Some(
                            set.into_iter()
                                .map(|(k, v)| (QueueAttributeName::from(k.as_str()), v))
                                .collect(),
                        ))
                        .send()
                        .await
                        .map_err(|e| api("SetQueueAttributes", e))?;
                }
                url
            }
        };
        Ok((url, want.redrive.is_some()))
    }

    /// An operator-owned queue: waits, logging why, until it exists; warns (never silently) when
    /// it differs from the policy this runtime runs.
    async fn await_operator(&self, ctx: &SubscriptionCtx) -> Result<(String, bool), SqsError> {
        let want = queue::desired(&self.prefix, ctx.policy())?;
        let b = ctx.binding();
        let mut wait = Duration::from_millis(250);
        let mut said = String::new();
        loop {
            let why = match self.queue_url(&want.name).await {
                Ok(Some(url)) => match self.queue_attributes(&url).await {
                    Ok(live) => {
                        let changes = queue::diff(&want, &live);
                        if !changes.is_empty() {
                            tracing::warn!(subscription = %ctx.name(), queue = %want.name, differences = %changes.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "), "the operator's queue differs from the policy this application runs: bound anyway; check that the Subscription resource and the application agree");
                        }
                        let redrives = live
                            .get(queue::REDRIVE_POLICY)
                            .and_then(|r| queue::parse_redrive(r))
                            .is_some();
                        return Ok((url, redrives));
                    }
                    Err(e) => {
                        self.forget_url(&want.name);
                        e.to_string()
                    }
                },
                Ok(None) => format!(
                    "queue {} does not exist yet: the operator creates it from Subscription {}/{} (kubectl describe subscription {} -n {})",
                    want.name,
                    b.namespace,
                    ctx.name(),
                    ctx.name(),
                    b.namespace
                ),
                Err(e) => e.to_string(),
            };
            if why != said {
                tracing::info!(subscription = %ctx.name(), reason = %why, "waiting for the operator's queue");
                said = why;
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(5));
        }
    }
}

impl Broker for SqsBroker {
    fn kind(&self) -> BackendKind {
        BackendKind::Sqs
    }

    fn hands_on_slow_handlers(&self) -> bool {
        true
    }

    fn open(
        &self,
        ctx: Arc<SubscriptionCtx>,
    ) -> BoxFuture<'_, Result<Box<dyn Consumer>, BusError>> {
        async move {
            let (url, redrives) = match ctx.binding().owner {
                ConsumerOwner::Runtime => {
                    let own = self.converge_own(&ctx).await?;
                    lock(&self.reports).insert(ctx.name().to_string(), report::ReportsTo::Nowhere);
                    own
                }
                ConsumerOwner::Operator => {
                    let bound = self.await_operator(&ctx).await?;
                    // The object the operator made this queue for (its `settle-object` tag):
                    // the counts from here on are its (semantics C15).
                    match admin::owner(&self.client, &bound.0).await {
                        Ok(tags) => ctx.bound_to(tags.object.as_deref()),
                        Err(e) => {
                            tracing::warn!(subscription = %ctx.name(), error = %e, "cannot read the queue's owner tags: the reports name no Subscription object");
                        }
                    }
                    let name = queue::desired(&self.prefix, ctx.policy()).map_err(SqsError::from)?.name;
                    lock(&self.reports).insert(
                        ctx.name().to_string(),
                        report::ReportsTo::Queue(report::report_queue(&name)),
                    );
                    bound
                }
            };
            let p = ctx.policy();
            tracing::info!(subscription = %ctx.name(), queue = %url, owner = ?ctx.binding().owner, "bound to an SQS queue");
            let shared = Arc::new(Shared {
                client: self.client.clone(),
                url,
                hold_limit: self.hold_limit,
                ack_wait: p.ack_wait,
                acks: p.at_least_once(),
                redrives,
                retired: AtomicBool::new(false),
            });
            let permits = Arc::new(Semaphore::new(p.max_in_flight));
            let (tx, rx) = mpsc::unbounded_channel();
            let poller = tokio::spawn(poll(
                Arc::clone(&shared),
                ctx.name().to_string(),
                Arc::clone(&permits),
                tx,
                self.long_poll,
                queue::visibility_secs(p.ack_wait),
            ));
            let subject = p.pattern.clone();
            Ok(Box::new(SqsConsumer {
                shared,
                ctx,
                subject,
                rx,
                poller: Some(poller),
            }) as Box<dyn Consumer>)
        }
        .boxed()
    }

    fn publish(
        &self,
        subject: String,
        headers: Vec<(String, String)>,
        payload: Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>> {
        async move {
            let name = format!("{}{subject}", self.prefix);
            let url = self.queue_url(&name).await?.ok_or_else(|| SqsError::QueueMissing {
                name: name.clone(),
                hint: format!(
                    ": on SQS a subject is a queue's name (after the Backend's queue prefix {:?}); the queue is made by the subscription whose durableName is {subject:?}",
                    self.prefix
                ),
            })?;
            let mut send = self.client.send_message().queue_url(&url);
            let (body, encoded) = body_of(&payload);
            send = send.message_body(body);
            let attrs = headers
                .into_iter()
                .chain(encoded.then(|| (BODY_ENCODING_ATTRIBUTE.to_string(), "base64".to_string())));
            for (k, v) in attrs {
                let value = MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value(v)
                    .build()
                    .map_err(|e| api("SendMessage", e))?;
                send = send.message_attributes(k, value);
            }
            if let Err(e) = send.send().await {
                if queue_missing(&e) {
                    self.forget_url(&name);
                }
                return Err(api("SendMessage", e).into());
            }
            Ok(())
        }
        .boxed()
    }

    fn stats_sink(&self) -> Option<Arc<dyn StatsSink>> {
        Some(Arc::new(self.clone()))
    }
}

/// The body SQS can carry for a payload: the text itself, or base64 when it is not text SQS
/// accepts (#x9, #xA, #xD, #x20 and up, no surrogates). Returns the body and whether it is base64.
fn body_of(payload: &[u8]) -> (String, bool) {
    match std::str::from_utf8(payload) {
        Ok(s)
            if s.chars().all(|c| {
                matches!(c, '\t' | '\n' | '\r') || (c >= ' ' && c != '\u{FFFE}' && c != '\u{FFFF}')
            }) =>
        {
            (s.to_string(), false)
        }
        _ => (aws_smithy_types::base64::encode(payload), true),
    }
}

/// What a consumer's deliveries share.
struct Shared {
    client: Client,
    url: String,
    hold_limit: Duration,
    ack_wait: Duration,
    acks: bool,
    redrives: bool,
    retired: AtomicBool,
}

impl Shared {
    async fn set_visibility(&self, receipt: &str, seconds: u32) -> Result<(), SqsError> {
        self.client
            .change_message_visibility()
            .queue_url(&self.url)
            .receipt_handle(receipt)
            .visibility_timeout(i32::try_from(seconds).unwrap_or(i32::MAX))
            .send()
            .await
            .map(|_| ())
            .map_err(|e| api("ChangeMessageVisibility", e))
    }

    async fn delete(&self, receipt: &str) -> Result<(), SqsError> {
        self.client
            .delete_message()
            .queue_url(&self.url)
            .receipt_handle(receipt)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| api("DeleteMessage", e))
    }
}

/// A received message with the slot it holds.
struct Received {
    message: Message,
    permit: OwnedSemaphorePermit,
}

/// Receives while the subscription has free slots: each message takes one, and gives it back
/// when it is settled or its delivery is dropped, so at most maxInFlight are held at once.
async fn poll(
    shared: Arc<Shared>,
    name: String,
    permits: Arc<Semaphore>,
    tx: mpsc::UnboundedSender<Received>,
    wait: Duration,
    visibility: u32,
) {
    let mut backoff = Duration::from_millis(200);
    loop {
        let Ok(first) = Arc::clone(&permits).acquire_owned().await else {
            return;
        };
        let mut slots = vec![first];
        while slots.len() < MAX_BATCH {
            match Arc::clone(&permits).try_acquire_owned() {
                Ok(p) => slots.push(p),
                Err(_) => break,
            }
        }
        let got = shared
            .client
            .receive_message()
            .queue_url(&shared.url)
            .max_number_of_messages(i32::try_from(slots.len()).unwrap_or(1))
            .wait_time_seconds(i32::try_from(wait.as_secs()).unwrap_or(20))
            .visibility_timeout(i32::try_from(visibility).unwrap_or(i32::MAX))
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await;
        match got {
            Ok(out) => {
                backoff = Duration::from_millis(200);
                for message in out.messages.unwrap_or_default() {
                    let Some(permit) = slots.pop() else { break };
                    if tx.send(Received { message, permit }).is_err() {
                        return;
                    }
                }
            }
            Err(e) => {
                let e = api("ReceiveMessage", e);
                tracing::warn!(subscription = %name, error = %e, "receiving from SQS; trying again in {backoff:?}");
                drop(slots);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

struct SqsConsumer {
    shared: Arc<Shared>,
    ctx: Arc<SubscriptionCtx>,
    subject: String,
    rx: mpsc::UnboundedReceiver<Received>,
    poller: Option<JoinHandle<()>>,
}

impl SqsConsumer {
    fn delivery(&self, r: Received) -> Option<Delivery> {
        let m = r.message;
        let receipt = m.receipt_handle?;
        let attr = |n: MessageSystemAttributeName| {
            m.attributes
                .as_ref()
                .and_then(|a| a.get(&n))
                .and_then(|v| v.parse::<u64>().ok())
        };
        let attempt = attr(MessageSystemAttributeName::ApproximateReceiveCount)
            .map_or(1, |n| u32::try_from(n).unwrap_or(u32::MAX));
        let first_receive_ms = attr(MessageSystemAttributeName::ApproximateFirstReceiveTimestamp)
            .unwrap_or_else(now_ms);
        let mut headers: Vec<(String, String)> = m
            .message_attributes
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(k, v)| v.string_value.map(|s| (k, s)))
            .collect();
        headers.sort();
        let body = m.body.unwrap_or_default();
        let base64 = headers
            .iter()
            .any(|(k, v)| k == BODY_ENCODING_ATTRIBUTE && v == "base64");
        let payload = if base64 {
            headers.retain(|(k, _)| k != BODY_ENCODING_ATTRIBUTE);
            match aws_smithy_types::base64::decode(&body) {
                Ok(b) => Bytes::from(b),
                Err(e) => {
                    tracing::warn!(subscription = %self.ctx.name(), error = %e, "a body marked base64 does not decode: handed over as it is");
                    Bytes::from(body)
                }
            }
        } else {
            Bytes::from(body)
        };
        Some(Delivery::new(
            &self.ctx,
            DeliveryOptions {
                subject: self.subject.clone(),
                headers,
                payload,
                attempt,
                on_settle: Box::new(SqsSettler {
                    shared: Arc::clone(&self.shared),
                    receipt,
                    first_receive_ms,
                    permit: Mutex::new(Some(r.permit)),
                }),
            },
        ))
    }

    /// Stops receiving and makes what was received but not handed out visible again at once.
    async fn give_back(&mut self) {
        if let Some(p) = self.poller.take() {
            p.abort();
            let _ = p.await;
        }
        self.rx.close();
        while let Ok(r) = self.rx.try_recv() {
            if let Some(receipt) = r.message.receipt_handle.as_deref()
                && let Err(e) = self.shared.set_visibility(receipt, 0).await
            {
                tracing::debug!(subscription = %self.ctx.name(), error = %e, "a received message not handed out comes back after ackWait");
            }
        }
    }
}

impl Consumer for SqsConsumer {
    fn next(&mut self) -> BoxFuture<'_, Option<Delivery>> {
        async move {
            loop {
                let r = self.rx.recv().await?;
                if !self.shared.acks
                    && let Some(receipt) = r.message.receipt_handle.as_deref()
                    && let Err(e) = self.shared.delete(receipt).await
                {
                    // AtMostOnce: SQS forgets a message when it is handed out.
                    tracing::warn!(subscription = %self.ctx.name(), error = %e, "could not delete a message handed out under AtMostOnce: SQS offers it again after ackWait");
                }
                if let Some(d) = self.delivery(r) {
                    return Some(d);
                }
            }
        }
        .boxed()
    }

    fn stop(&mut self) -> BoxFuture<'_, ()> {
        self.give_back().boxed()
    }

    fn retire(&mut self) -> BoxFuture<'_, ()> {
        self.shared.retired.store(true, Ordering::Release);
        self.give_back().boxed()
    }
}

impl Drop for SqsConsumer {
    fn drop(&mut self) {
        if let Some(p) = self.poller.take() {
            p.abort();
        }
    }
}

struct SqsSettler {
    shared: Arc<Shared>,
    receipt: String,
    first_receive_ms: u64,
    /// The slot this message holds; given back when it is settled (or the delivery dropped).
    permit: Mutex<Option<OwnedSemaphorePermit>>,
}

impl SqsSettler {
    fn check(&self) -> Result<(), Refusal> {
        if self.shared.retired.load(Ordering::Acquire) {
            return Err(Refusal {
                reason: "the consumer that offered this delivery was retired by this process; SQS offers the message again after ackWait".into(),
                stranded: false,
            });
        }
        Ok(())
    }

    fn refused(e: SqsError) -> Refusal {
        // A receipt that is no longer valid (the message went to another receiver after its
        // visibility ran out) or a server error: SQS offers the message again anyway.
        Refusal {
            reason: e.to_string(),
            stranded: false,
        }
    }

    fn free_slot(&self) {
        lock(&self.permit).take();
    }
}

impl OnSettle for SqsSettler {
    fn settle(&self, action: BrokerAction) -> BoxFuture<'_, Result<Performed, Refusal>> {
        async move {
            self.check()?;
            let s = &self.shared;
            let done = match action {
                BrokerAction::Ack => s.delete(&self.receipt).await.map(|()| Performed::AsAsked),
                BrokerAction::Decline(delay) => {
                    let h = hold(self.first_receive_ms, now_ms(), delay, s.hold_limit);
                    s.set_visibility(&self.receipt, h.seconds).await.map(|()| {
                        if h.shortened {
                            tracing::info!(asked = ?delay, held_secs = h.seconds, "SQS cannot hold the message that long from its first receive: offered again sooner (DelayShortened)");
                            Performed::DelayShortened
                        } else {
                            Performed::AsAsked
                        }
                    })
                }
                // Visible again at once: the next receive finds it past maxReceiveCount and the
                // redrive moves it to the dead-letter queue. Without a redrive, it is deleted.
                BrokerAction::Terminate if s.redrives => s.set_visibility(&self.receipt, 0).await.map(|()| Performed::AsAsked),
                BrokerAction::Terminate => s.delete(&self.receipt).await.map(|()| Performed::AsAsked),
            };
            self.free_slot();
            done.map_err(Self::refused)
        }
        .boxed()
    }

    fn progress(&self) -> BoxFuture<'_, Result<(), Refusal>> {
        async move {
            self.check()?;
            let s = &self.shared;
            let h = hold(self.first_receive_ms, now_ms(), s.ack_wait, s.hold_limit);
            if h.seconds == 0 {
                return Err(Refusal {
                    reason: format!(
                        "the message has been held {:?} since its first receive, SQS's limit: the lease cannot be extended",
                        s.hold_limit
                    ),
                    stranded: false,
                });
            }
            s.set_visibility(&self.receipt, h.seconds)
                .await
                .map_err(Self::refused)
        }
        .boxed()
    }

    fn release(&self) -> BoxFuture<'_, ()> {
        async move {
            if let Err(e) = self.shared.set_visibility(&self.receipt, 0).await {
                tracing::debug!(error = %e, "release not performed; SQS offers the message again after ackWait");
            }
            self.free_slot();
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_prints_the_secret_key() {
        let settings = SqsSettings {
            credentials: SqsCredentials::Static {
                access_key_id: "AKIAEXAMPLE".into(),
                secret_access_key: "s3cr3t".into(),
            },
            ..SqsSettings::default()
        };
        let text = format!("{settings:?}");
        assert!(!text.contains("s3cr3t"), "{text}");
        assert!(
            text.contains("<redacted>") && text.contains("AKIAEXAMPLE"),
            "{text}"
        );
    }

    #[test]
    fn bodies_sqs_cannot_carry_go_as_base64() {
        assert_eq!(body_of(b"hello\n"), ("hello\n".to_string(), false));
        assert!(!body_of("{\"a\":\"é\"}".as_bytes()).1);
        let (b, enc) = body_of(&[0, 159, 146, 150]);
        assert!(enc);
        assert_eq!(
            aws_smithy_types::base64::decode(&b).ok(),
            Some(vec![0, 159, 146, 150])
        );
        assert!(body_of(b"a\x01b").1, "a control character is not XML text");
    }
}
