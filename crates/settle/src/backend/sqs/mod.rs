//! The SQS backend (Amazon SQS or an SQS-compatible server such as ElasticMQ): [`SqsBroker`],
//! the `bus::Broker` that gives each subscription one queue, long-polled, each received message
//! a `Delivery`, settlements performed with visibility timeouts (docs/semantics.md Q1–Q6), and
//! publishes.
//!
//! - Publish: SendMessage to the queue `<prefix><subject>`: a subject is a queue's name. A
//!   payload SQS cannot carry as text goes base64, with the `settle-body-encoding` attribute.
//! - Stats reports: SendMessage to the Subscription's report queue, which the operator makes
//!   beside its queue ([`report`]); the object's UID is read from the queue's `settle-object` tag.
//!
//! Its files, the same as every broker's: [`connect`] (settings and credentials to a client),
//! `consume` (the queue received from, each delivery and its settlement), [`mapping`] (the one
//! spec → queue mapping) and [`admin`] (the operator's calls: find, create, tag, change, delete a
//! managed queue, read its gauges). Beside them: [`hold`] (how long SQS may hold a message),
//! [`report`] (the stats reports' queues) and [`pause`] (the tag that says a Subscription is
//! paused, W4).
//!
//! It must not count anything (the settle path does) nor make an operator-owned queue: it creates
//! (or brings in line) only the queue of a code-defined subscription, through `mapping::desired`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::ProvideErrorMetadata;
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;

pub mod admin;
pub mod connect;
mod consume;
pub mod hold;
pub mod mapping;
pub mod pause;
pub mod report;

pub use connect::{SqsCredentials, SqsSettings};

use crate::bus::{Broker, BusError, Consumer, StatsSink, SubscriptionCtx};
use crate::policy::BackendKind;

use hold::HOLD_LIMIT;

/// The message attribute that says a body is base64 (the payload was not text SQS can carry).
pub const BODY_ENCODING_ATTRIBUTE: &str = "settle-body-encoding";

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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
    Mapping(#[from] mapping::QueueError),
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
    /// How often a consumer of an operator-made queue reads its pause tag.
    pause_poll: Duration,
    /// The operator-made queue each subscription is bound to (by subscription name), whose
    /// owner tags are read again for its mark.
    bound: Arc<Mutex<HashMap<String, String>>>,
}

impl SqsBroker {
    /// Uses an existing client; every queue name gets `prefix` in front.
    pub fn from_client(client: Client, prefix: impl Into<String>) -> SqsBroker {
        SqsBroker {
            client,
            prefix: prefix.into(),
            hold_limit: HOLD_LIMIT,
            long_poll: Duration::from_secs(20),
            urls: Arc::default(),
            reports: Arc::default(),
            pause_poll: crate::backend::pause::poll_interval_from_env(),
            bound: Arc::default(),
        }
    }

    /// How often each consumer of an operator-made queue reads whether its Subscription is
    /// paused (the tag `settle-paused`, [`pause`]); default `SETTLE_PAUSE_POLL_INTERVAL`, else
    /// 5s, at least 100ms. A receive waits at most this long too, so a pause stops receiving
    /// within about two intervals.
    pub fn with_pause_poll(mut self, every: Duration) -> SqsBroker {
        self.pause_poll = every.max(crate::backend::pause::MIN_POLL);
        self
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
        self.consume(ctx).boxed()
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

    fn read_mark<'a>(&'a self, ctx: &'a SubscriptionCtx) -> BoxFuture<'a, Option<String>> {
        async move {
            let url = lock(&self.bound).get(ctx.name()).cloned()?;
            match admin::owner(&self.client, &url).await {
                Ok(tags) => tags.object,
                Err(e) => {
                    tracing::debug!(subscription = %ctx.name(), error = %e, "cannot read the queue's owner tags again");
                    None
                }
            }
        }
        .boxed()
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

#[cfg(test)]
mod tests {
    use super::*;

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
