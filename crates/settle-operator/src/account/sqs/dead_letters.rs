//! Losses the broker saw on SQS: the messages a Subscription's redrive policy moved to its
//! dead-letter queue, counted once each by message id (SQS and ElasticMQ keep a message's id
//! when they move it), without taking them from the user: the queue is only looked at.
//!
//! A look (a "scan") receives every message of the dead-letter queue in batches of ten, each
//! hidden for [`SCAN_HIDE`] so the next receive returns the next ones (a receive that hides
//! nothing returns the same first ten every time), and makes them all visible again as soon as
//! the scan ends. A message counts when the redrive moved it from this Subscription's queue
//! (its `DeadLetterQueueSourceArn`, which SQS and ElasticMQ set on the move) and was sent after the Subscription
//! object was made (a dead-letter queue taken over from an earlier object holds that object's
//! losses). The ids are remembered in the ledger among the last `REMEMBERED_EXHAUSTED` (1024):
//! so a dead-letter queue holding more than that is not scanned (counting it again would
//! count forgotten ids twice) and the `Exhausting` message says broker-side losses are not
//! counted then.
//!
//! A scan runs when the queue's depth changed since the last one, or a minute after it, and only
//! while it holds something; the depth is read every few seconds. What the user sees meanwhile:
//! each message hidden for at most a few seconds per scan, and its `ApproximateReceiveCount` one
//! higher per scan.
//!
//! It must not delete or change a message (beyond making it visible again) nor decide counts
//! (the ledger does).

use std::time::{Duration, Instant};

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, Message, MessageSystemAttributeName,
};

use crate::account::ledger::{Account, BrokerOutcome, REMEMBERED_EXHAUSTED};
use crate::account::metrics::Metrics;
use settle::backend::sqs::{admin, mapping::DLQ_SUFFIX};

/// How long a scanned message is hidden at most (it is made visible again when the scan ends).
pub const SCAN_HIDE: Duration = Duration::from_secs(10);
/// How often the dead-letter queue's depth is read.
pub const CHECK_EVERY: Duration = Duration::from_secs(2);
/// A queue that did not change is scanned again this often anyway (a message moved in while
/// another went out leaves the depth as it was).
pub const RESCAN_EVERY: Duration = Duration::from_secs(60);

/// What one Subscription's dead-letter watch knows between ticks (not persisted: the ids
/// counted are in the ledger).
#[derive(Clone, Debug, Default)]
pub struct DeadLetters {
    url: Option<String>,
    checked: Option<Instant>,
    scanned: Option<Instant>,
    /// The depth (visible + in flight) at the last complete scan.
    depth: Option<u64>,
    /// The queue holds more messages than the ledger remembers ids: not counted.
    too_many: Option<u64>,
}

impl DeadLetters {
    /// The number of messages the queue holds past what can be counted exactly, if it does.
    pub fn too_many(&self) -> Option<u64> {
        self.too_many
    }

    /// Looks at the dead-letter queue of the Subscription whose queue is `queue`, when due, and
    /// counts in `account` each message newly seen there that came from `queue` and was sent at
    /// or after `since_ms`. Returns how many were newly counted.
    pub async fn scan(
        &mut self,
        client: &Client,
        queue: &str,
        since_ms: u64,
        account: &mut Account,
        metrics: &Metrics,
    ) -> u64 {
        if self.checked.is_some_and(|t| t.elapsed() < CHECK_EVERY) {
            return 0;
        }
        self.checked = Some(Instant::now());
        let dlq = format!("{queue}{DLQ_SUFFIX}");
        let Some(url) = self.url(client, &dlq).await else {
            return 0;
        };
        let Some(depth) = self.due_depth(client, &url, &dlq).await else {
            return 0;
        };
        let (receipts, counted, seen) =
            look(client, &url, &dlq, queue, since_ms, account, metrics).await;
        self.show_again(client, &url, &receipts).await;
        self.scanned = Some(Instant::now());
        // Complete only if every message there was seen (none hidden by someone else).
        self.depth = (seen >= depth).then_some(depth);
        counted
    }

    /// The dead-letter queue's URL, looked up once (None: not there, or not found now).
    async fn url(&mut self, client: &Client, dlq: &str) -> Option<String> {
        match &self.url {
            Some(u) => Some(u.clone()),
            None => match admin::queue_url(client, dlq).await {
                Ok(Some(u)) => {
                    self.url = Some(u.clone());
                    Some(u)
                }
                _ => None,
            },
        }
    }

    /// The queue's depth (visible + in flight) when a scan is due: it changed since the last
    /// one, or that was long ago, it holds something visible, and no more than can be counted.
    async fn due_depth(&mut self, client: &Client, url: &str, dlq: &str) -> Option<u64> {
        let attributes = match admin::attributes(client, url).await {
            Ok(Some(a)) => a,
            Ok(None) => {
                // Deleted on the server: looked up again (the reconcile makes it again).
                self.url = None;
                return None;
            }
            Err(e) => {
                tracing::debug!(queue = %dlq, error = %e, "cannot read the dead-letter queue's depth");
                return None;
            }
        };
        let (visible, in_flight) = admin::gauges_of(&attributes);
        let depth = visible + in_flight;
        if depth > REMEMBERED_EXHAUSTED as u64 {
            if self.too_many.is_none() {
                tracing::warn!(queue = %dlq, depth, "the dead-letter queue holds more messages than the account remembers ids: broker-side losses are not counted until it holds fewer");
            }
            self.too_many = Some(depth);
            return None;
        }
        self.too_many = None;
        let due =
            self.depth != Some(depth) || self.scanned.is_none_or(|t| t.elapsed() >= RESCAN_EVERY);
        if visible == 0 || !due {
            if visible == 0 && in_flight == 0 {
                self.depth = Some(0);
            }
            return None;
        }
        Some(depth)
    }

    /// Makes the scanned messages visible again at once.
    async fn show_again(&self, client: &Client, url: &str, receipts: &[String]) {
        for chunk in receipts.chunks(10) {
            let entries: Vec<_> = chunk
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    ChangeMessageVisibilityBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(r)
                        .visibility_timeout(0)
                        .build()
                        .ok()
                })
                .collect();
            if let Err(e) = client
                .change_message_visibility_batch()
                .queue_url(url)
                .set_entries(Some(entries))
                .send()
                .await
            {
                tracing::debug!(error = %e, "scanned dead letters come back after the scan's hide time");
            }
        }
    }
}

/// Receives every message of the dead-letter queue (`url`, named `dlq`) in batches, each hidden
/// for [`SCAN_HIDE`], and counts in `account` those of `queue` sent at or after `since_ms`.
/// Returns the receipts (to show them again), how many were newly counted and how many seen.
async fn look(
    client: &Client,
    url: &str,
    dlq: &str,
    queue: &str,
    since_ms: u64,
    account: &mut Account,
    metrics: &Metrics,
) -> (Vec<String>, u64, u64) {
    let arn_end = format!(":{queue}");
    let mut receipts = Vec::new();
    let mut counted = 0;
    let mut seen = 0u64;
    // Bounded by what the queue can hold and still be counted.
    let rounds = REMEMBERED_EXHAUSTED / 10 + 2;
    for _ in 0..rounds {
        let got = client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .visibility_timeout(i32::try_from(SCAN_HIDE.as_secs()).unwrap_or(10))
            .wait_time_seconds(0)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .send()
            .await;
        let messages = match got {
            Ok(out) => out.messages.unwrap_or_default(),
            Err(e) => {
                tracing::debug!(queue = %dlq, error = %e, "cannot look at the dead-letter queue");
                break;
            }
        };
        if messages.is_empty() {
            break;
        }
        for m in messages {
            seen += 1;
            if let Some(r) = m.receipt_handle.clone() {
                receipts.push(r);
            }
            if count_one(&m, &arn_end, since_ms, account, metrics) {
                counted += 1;
            }
        }
    }
    (receipts, counted, seen)
}

/// Counts one dead letter when the redrive of the queue whose ARN ends in `arn_end` moved it and
/// it was sent at or after `since_ms`. Returns whether it was newly counted.
fn count_one(
    m: &Message,
    arn_end: &str,
    since_ms: u64,
    account: &mut Account,
    metrics: &Metrics,
) -> bool {
    let attr =
        |n: MessageSystemAttributeName| m.attributes.as_ref().and_then(|a| a.get(&n)).cloned();
    // Moved here by the redrive of this Subscription's queue: a message sent straight
    // to the dead-letter queue has no source, and is no loss of this Subscription.
    let from_here = attr(MessageSystemAttributeName::DeadLetterQueueSourceArn)
        .is_some_and(|arn| arn.ends_with(arn_end));
    let sent = attr(MessageSystemAttributeName::SentTimestamp)
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(u64::MAX);
    // The object's creation time has whole seconds: a message sent within its first
    // second counts.
    if !from_here || sent.saturating_add(1000) < since_ms {
        return false;
    }
    let Some(id) = m.message_id.as_deref() else {
        return false;
    };
    match account.broker_dead_lettered(id) {
        BrokerOutcome::Counted => {
            metrics
                .advisories
                .with_label_values(&["dead_lettered"])
                .inc();
            true
        }
        BrokerOutcome::Duplicate | BrokerOutcome::Replayed => false,
    }
}
