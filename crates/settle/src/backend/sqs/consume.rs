//! Consuming from SQS: the queue a subscription receives from (created from the mapping, or
//! brought in line with it, for a code-defined subscription; waited for when the operator makes
//! it), the long poll that receives while the subscription has free slots, each message turned
//! into a `Delivery`, and its settlement with visibility timeouts (docs/semantics.md Q1–Q6).
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
//! - The stats reports go to the Subscription's report queue beside the operator's queue, or
//!   nowhere for a code-defined subscription ([`report`]).
//! - Paused (W4: the operator's tag `settle-paused` on the queue, read every pause poll
//!   interval by `backend::pause`): no receive is sent; one already sent finishes (it waits at
//!   most one interval) and what it got is handed out; every delivery taken settles as before.
//!   Receiving starts again once the tag is gone or its time has passed.
//!
//! It must not count anything (the settle path does), decide what a queue looks like (that is
//! [`super::mapping`]) nor make or change an operator-owned queue.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{Message, MessageSystemAttributeName, QueueAttributeName};
use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::JoinHandle;

use super::hold::hold;
use super::{
    BODY_ENCODING_ATTRIBUTE, SqsBroker, SqsError, admin, api, lock, mapping, pause, report,
};
use crate::backend::pause::PauseWatch;
use crate::bus::{
    self, BrokerAction, BusError, Consumer, ConsumerOwner, Delivery, DeliveryOptions, OnSettle,
    Performed, Refusal, SubscriptionCtx,
};
use crate::policy::BackendKind;

/// SQS's largest batch of one receive.
const MAX_BATCH: usize = 10;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl SqsBroker {
    /// A consumer on the subscription's queue: the code-defined subscription's own, or the
    /// operator's once it exists; its stats reports go beside it.
    pub(super) async fn consume(
        &self,
        ctx: Arc<SubscriptionCtx>,
    ) -> Result<Box<dyn Consumer>, BusError> {
        let (url, redrives) = self.bind_queue(&ctx).await?;
        let p = ctx.policy();
        tracing::info!(subscription = %ctx.name(), queue = %url, owner = ?ctx.binding().owner, "bound to an SQS queue");
        let bound = Arc::new(BoundQueue {
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
        let (pause, wait) = self.pause_watch(&ctx, bound.url.clone());
        let poller = tokio::spawn(poll(
            Arc::clone(&bound),
            Arc::clone(&ctx),
            Arc::clone(&permits),
            tx,
            wait,
            mapping::visibility_secs(p.ack_wait),
            pause.receiver(),
        ));
        let subject = p.pattern.clone();
        Ok(Box::new(SqsConsumer {
            bound,
            ctx,
            subject,
            rx,
            poller: Some(poller),
            _pause: pause,
        }))
    }

    /// The queue a subscription consumes from (its URL, and whether it redrives), found or
    /// made, with where its stats reports go.
    async fn bind_queue(&self, ctx: &SubscriptionCtx) -> Result<(String, bool), BusError> {
        Ok(match ctx.binding().owner {
            ConsumerOwner::Runtime => {
                let own = self.converge_own(ctx).await?;
                lock(&self.reports).insert(ctx.name().to_string(), report::ReportsTo::Nowhere);
                own
            }
            ConsumerOwner::Operator => self.bind_operator(ctx).await?,
        })
    }

    /// An operator-made queue, once it exists: the counts go to the object it was made for, and
    /// the reports beside the queue.
    async fn bind_operator(&self, ctx: &SubscriptionCtx) -> Result<(String, bool), BusError> {
        let found = self.await_operator(ctx).await?;
        // The object the operator made this queue for (its `settle-object` tag):
        // the counts from here on are its (semantics C15).
        lock(&self.bound).insert(ctx.name().to_string(), found.0.clone());
        match admin::owner(&self.client, &found.0).await {
            Ok(tags) => ctx.bound_to(tags.object.as_deref()),
            Err(e) => {
                tracing::warn!(subscription = %ctx.name(), error = %e, "cannot read the queue's owner tags: the reports name no Subscription object");
            }
        }
        let name = mapping::desired(&self.prefix, ctx.policy())
            .map_err(SqsError::from)?
            .name;
        lock(&self.reports).insert(
            ctx.name().to_string(),
            report::ReportsTo::Queue(report::report_queue(&name)),
        );
        Ok(found)
    }

    /// The pause watch of the queue at `url`, and how long a receive waits.
    fn pause_watch(&self, ctx: &SubscriptionCtx, url: String) -> (PauseWatch, Duration) {
        // Only the operator pauses a Subscription: an operator-made queue's tag is read (W4),
        // and a receive waits at most one pause interval, so a pause stops it soon.
        match ctx.binding().owner {
            ConsumerOwner::Operator => {
                let client = self.client.clone();
                let watch =
                    PauseWatch::start(BackendKind::Sqs, ctx.name(), self.pause_poll, move || {
                        let (client, url) = (client.clone(), url.clone());
                        async move {
                            pause::is_set(&client, &url)
                                .await
                                .map_err(|e| e.to_string())
                        }
                    });
                let wait = self
                    .long_poll
                    .min(self.pause_poll)
                    .max(Duration::from_secs(1));
                (watch, wait)
            }
            ConsumerOwner::Runtime => (PauseWatch::never(), self.long_poll),
        }
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
        let want = mapping::desired(&self.prefix, ctx.policy())?;
        let dlq_arn = match &want.redrive {
            None => None,
            Some(r) => {
                let url = match self.queue_url(&r.dead_letter_queue).await? {
                    Some(u) => u,
                    None => {
                        self.create_queue(&r.dead_letter_queue, mapping::dead_letter_attributes())
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
        let attributes = mapping::attributes(&want, dlq_arn.as_deref());
        let url = match self.queue_url(&want.name).await? {
            None => {
                tracing::info!(subscription = %ctx.name(), queue = %want.name, "creating the subscription's SQS queue");
                self.create_queue(&want.name, attributes).await?
            }
            Some(url) => {
                let live = self.queue_attributes(&url).await?;
                let changes = mapping::diff(&want, &live);
                if !changes.is_empty() {
                    tracing::info!(subscription = %ctx.name(), queue = %want.name, changes = %changes.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "), "updating the queue to the subscription's policy");
                    let mut set = attributes.clone();
                    if want.redrive.is_none() {
                        // An empty RedrivePolicy removes it.
                        set.insert(mapping::REDRIVE_POLICY.to_string(), String::new());
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
        let want = &mapping::desired(&self.prefix, ctx.policy())?;
        let b = ctx.binding();
        let found = bus::await_operator(ctx.name(), "queue", move || async move {
            let url = match self.queue_url(&want.name).await {
                Ok(Some(url)) => url,
                Ok(None) => return Err(format!(
                    "queue {} does not exist yet: the operator creates it from Subscription {}/{} (kubectl describe subscription {} -n {})",
                    want.name,
                    b.namespace,
                    ctx.name(),
                    ctx.name(),
                    b.namespace
                )),
                Err(e) => return Err(e.to_string()),
            };
            match self.queue_attributes(&url).await {
                Ok(live) => {
                    let changes = mapping::diff(want, &live);
                    if !changes.is_empty() {
                        tracing::warn!(subscription = %ctx.name(), queue = %want.name, differences = %changes.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "), "the operator's queue differs from the policy this application runs: bound anyway; check that the Subscription resource and the application agree");
                    }
                    let redrives = live
                        .get(mapping::REDRIVE_POLICY)
                        .and_then(|r| mapping::parse_redrive(r))
                        .is_some();
                    Ok((url, redrives))
                }
                Err(e) => {
                    self.forget_url(&want.name);
                    Err(e.to_string())
                }
            }
        })
        .await;
        Ok(found)
    }
}

/// The queue a consumer is bound to, and what its deliveries share.
struct BoundQueue {
    client: Client,
    url: String,
    hold_limit: Duration,
    ack_wait: Duration,
    acks: bool,
    redrives: bool,
    retired: AtomicBool,
}

impl BoundQueue {
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
/// While `paused` reads true, nothing is received (a receive already sent finishes, and what it
/// got is handed out: it was taken before the pause was seen).
async fn poll(
    bound: Arc<BoundQueue>,
    ctx: Arc<SubscriptionCtx>,
    permits: Arc<Semaphore>,
    tx: mpsc::UnboundedSender<Received>,
    wait: Duration,
    visibility: u32,
    mut paused: watch::Receiver<bool>,
) {
    let name = ctx.name().to_string();
    let mut backoff = Duration::from_millis(200);
    // The queue was found missing: it may come back made for a new object (the Subscription
    // deleted and applied again: same name, same URL), so its mark is read again before
    // anything more is received, or what this instance handles would count for the old one
    // (semantics C15).
    let mut missing = false;
    loop {
        if missing && ctx.binding().owner == ConsumerOwner::Operator {
            match admin::owner(&bound.client, &bound.url).await {
                Ok(tags) => {
                    ctx.bound_to(tags.object.as_deref());
                    missing = false;
                }
                Err(e) => {
                    tracing::debug!(subscription = %name, error = %e, "the queue is still missing; its mark is read again in {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            }
        }
        if *paused.borrow_and_update() {
            ctx.set_paused(true);
            crate::backend::pause::shown(BackendKind::Sqs, &name, true);
            tracing::info!(subscription = %name, "paused: receiving stopped until the Subscription is resumed (deliveries already taken finish)");
            if !crate::backend::pause::until(&mut paused, false).await {
                return;
            }
            ctx.set_paused(false);
            crate::backend::pause::shown(BackendKind::Sqs, &name, false);
            tracing::info!(subscription = %name, "resumed: receiving again");
            // The queue may have been deleted and made again for a new object while nothing
            // received from it (the Subscription deleted and applied again during the pause):
            // its mark is read before anything more is received (semantics C15).
            missing = ctx.binding().owner == ConsumerOwner::Operator;
            continue;
        }
        let Ok(first) = Arc::clone(&permits).acquire_owned().await else {
            return;
        };
        if *paused.borrow() {
            // Paused while it waited for a free slot.
            drop(first);
            continue;
        }
        let mut slots = vec![first];
        while slots.len() < MAX_BATCH {
            match Arc::clone(&permits).try_acquire_owned() {
                Ok(p) => slots.push(p),
                Err(_) => break,
            }
        }
        // Only the two system attributes a delivery reads (the attempt, and when it was first
        // received), not `All`: the rest is work for the server and the parser per message.
        let got = bound
            .client
            .receive_message()
            .queue_url(&bound.url)
            .max_number_of_messages(i32::try_from(slots.len()).unwrap_or(1))
            .wait_time_seconds(i32::try_from(wait.as_secs()).unwrap_or(20))
            .visibility_timeout(i32::try_from(visibility).unwrap_or(i32::MAX))
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_system_attribute_names(
                MessageSystemAttributeName::ApproximateFirstReceiveTimestamp,
            )
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
                missing |= super::queue_missing(&e);
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
    bound: Arc<BoundQueue>,
    ctx: Arc<SubscriptionCtx>,
    subject: String,
    rx: mpsc::UnboundedReceiver<Received>,
    poller: Option<JoinHandle<()>>,
    /// The pause tag's poll, for as long as the consumer lives.
    _pause: PauseWatch,
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
                    bound: Arc::clone(&self.bound),
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
                && let Err(e) = self.bound.set_visibility(receipt, 0).await
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
                if !self.bound.acks
                    && let Some(receipt) = r.message.receipt_handle.as_deref()
                    && let Err(e) = self.bound.delete(receipt).await
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
        self.bound.retired.store(true, Ordering::Release);
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
    bound: Arc<BoundQueue>,
    receipt: String,
    first_receive_ms: u64,
    /// The slot this message holds; given back when it is settled (or the delivery dropped).
    permit: Mutex<Option<OwnedSemaphorePermit>>,
}

impl SqsSettler {
    fn check(&self) -> Result<(), Refusal> {
        if self.bound.retired.load(Ordering::Acquire) {
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
            let s = &self.bound;
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
            let s = &self.bound;
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
            if let Err(e) = self.bound.set_visibility(&self.receipt, 0).await {
                tracing::debug!(error = %e, "release not performed; SQS offers the message again after ackWait");
            }
            self.free_slot();
        }
        .boxed()
    }
}
