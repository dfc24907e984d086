//! One SQS Backend's account keeper. Every instance of a Subscription's runtime sends its
//! cumulative report to the Subscription's report queue (`backend::sqs::report`, made by the
//! operator beside the queue); this keeper receives them (hidden for [`REPORT_HIDE`] while it
//! holds them), counts them with the ledger, and keeps the newest snapshot of the whole account
//! in the Subscription's ledger queue. Once a second it folds idle instances, saves the snapshots
//! that changed, and only then deletes the reports they contain, so a restart finds every
//! deleted report in the snapshot and every other one back in the queue (counted once: the
//! ledger skips a report it already holds). A SIGKILLed operator loses nothing and counts
//! nothing twice.
//!
//! Exhausted also comes from the broker side: messages the redrive policy moved to the
//! Subscription's dead-letter queue ([`dead_letters`]), each counted once by its message
//! id, and the account takes the larger of the runtime's and the broker's count.
//!
//! It reads the queue's gauges once per stats interval and shows the account through [`show`]
//! exactly as the other keepers do. Until a Subscription's runtime has reported (or a snapshot
//! exists), only the broker's gauges are written: no counter is invented. A report queue missing
//! on the server (deleted there; the reconcile makes it again) is said in `Accounted`.
//!
//! A report counts only where it belongs: its body names the Subscription whose report queue it
//! came from, else it is dropped (`misfiled`); who may send to that queue is the cloud
//! provider's permissions' to decide (docs/stats-report.md).
//!
//! It must not write status itself (that is the writer), decide counts (that is the ledger), nor
//! make or delete a queue (that is the reconcile).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{DeleteMessageBatchRequestEntry, QueueAttributeName};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use serde::{Deserialize, Serialize};

mod dead_letters;
use super::ledger::{Account, Outcome, Snapshot};
use super::metrics::Metrics;
use super::show::{self, Showing};
use super::status::{LossLog, Unseen};
use super::writer::Writer;
use super::{Config, QueueLookup};
use crate::api::{Backend, Subscription};
use crate::backend::QueueGauges;
use crate::backend::sqs::{admin, queue, report};
use crate::bus::report::{StatsReport, now_ms};
use crate::policy::ResolvedPolicy;
use dead_letters::DeadLetters;

/// A Subscription, by namespace and name.
type SubKey = (String, String);

/// How long a received report stays hidden from another receive while the keeper holds it
/// (counted, waiting for the snapshot that holds it to be saved, then deleted).
pub const REPORT_HIDE: Duration = Duration::from_secs(30);
/// How long a snapshot read (at load, or to delete older ones) stays hidden at most.
const LEDGER_HIDE_SECS: i32 = 5;
/// Receives of (at most 10) reports per Subscription per second, at most: 300 reports a
/// second; more wait in the queue for the next second.
pub const REPORT_RECEIVES_PER_TICK: usize = 30;
/// SQS's largest batch.
const BATCH: i32 = 10;
/// How often the keeper receives, folds, saves, deletes and decides what to write.
const TICK: Duration = Duration::from_secs(1);

/// What is kept in a Subscription's ledger queue.
#[derive(Default, Serialize, Deserialize)]
struct Saved {
    /// Each save's number, one more than the last: the highest is the newest.
    generation: u64,
    ledger: Snapshot,
    loss: LossLog,
}

/// One Subscription's account as the keeper holds it.
struct Book {
    account: Account,
    showing: Showing,
    generation: u64,
    dead_letters: DeadLetters,
    /// Something in the snapshot changed since the last save.
    dirty: bool,
    /// Receipts of the reports counted (or dropped) since the last save, with when they were
    /// received: deleted once it is saved (a receipt older than [`REPORT_HIDE`] is let go: that
    /// report is back in the queue, and counted as stale when it comes again).
    acks: Vec<(String, Instant)>,
    /// The runtime has reported (or a snapshot existed): counters are shown.
    counting: bool,
    /// The Subscription's queue (its full name) and its account queues' URLs.
    queue: String,
    report_url: String,
    ledger_url: String,
    /// The Subscription has a dead-letter queue the redrive moves exhausted messages to.
    redrives: bool,
    gauges: Option<(u64, u64)>,
    gauges_at: Option<Instant>,
    gauges_written: Option<Instant>,
}

pub struct SqsKeeper {
    backend: SubKey,
    backends: Store<Backend>,
    queues: QueueLookup,
    subs: Store<Subscription>,
    writer: Writer,
    config: Config,
    metrics: Metrics,
    /// Whether the backend can spend a last attempt no handler saw (SQS: yes, semantics Q6).
    unseen: bool,
}

impl SqsKeeper {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        backend: SubKey,
        backends: Store<Backend>,
        queues: QueueLookup,
        subs: Store<Subscription>,
        writer: Writer,
        config: Config,
        metrics: Metrics,
        unseen: bool,
    ) -> SqsKeeper {
        SqsKeeper {
            backend,
            backends,
            queues,
            subs,
            writer,
            config,
            metrics,
            unseen,
        }
    }

    fn name(&self) -> String {
        format!("{}/{}", self.backend.0, self.backend.1)
    }

    /// The Backend's SQS client and queue prefix, while it has a connection.
    fn client(&self) -> Option<(Client, String)> {
        let prefix = self
            .backends
            .get(&ObjectRef::new(&self.backend.1).within(&self.backend.0))
            .and_then(|b| b.spec.sqs.as_ref().map(|s| s.queue_prefix.clone()))?
            .unwrap_or_default();
        match (self.queues)(&self.backend.0, &self.backend.1)? {
            QueueGauges::Sqs(client) => Some((client, prefix)),
            QueueGauges::Rabbitmq { .. } => None,
        }
    }

    /// The Subscriptions of this Backend now.
    fn members(&self) -> HashMap<SubKey, Arc<Subscription>> {
        self.subs
            .state()
            .into_iter()
            .filter(|s| {
                s.namespace().as_deref() == Some(self.backend.0.as_str())
                    && s.spec.backend_ref.name == self.backend.1
            })
            .map(|s| ((self.backend.0.clone(), s.name_any()), s))
            .collect()
    }

    /// Runs until aborted.
    pub async fn run(self) {
        let mut books: HashMap<SubKey, Book> = HashMap::new();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut connected: Option<bool> = None;
        loop {
            tick.tick().await;
            let Some((client, prefix)) = self.client() else {
                if connected != Some(false) {
                    tracing::debug!(backend = %self.name(), "account: the SQS Backend has no connection yet");
                    connected = Some(false);
                }
                continue;
            };
            if connected != Some(true) {
                tracing::info!(backend = %self.name(), "account keeper started (SQS report queues)");
                connected = Some(true);
            }
            let members = self.members();
            // Gone, moved to another Backend, or deleted and applied again (another object):
            // the book is dropped (reports it counted but did not save were not deleted: they
            // come back to whichever book counts them next).
            books.retain(|key, book| {
                let keep = members
                    .get(key)
                    .is_some_and(|s| book.account.persisted().belongs_to(s.metadata.uid.as_deref()));
                if !keep && !members.contains_key(key) {
                    self.metrics.forget(&key.0, &key.1);
                    tracing::info!(subscription = %format!("{}/{}", key.0, key.1), "the Subscription is gone from this Backend: its account is dropped here");
                }
                keep
            });
            self.open_new(&client, &prefix, &members, &mut books).await;
            self.settle(&client, &members, &mut books).await;
        }
    }

    /// Loads the book of every new Subscription whose account queues exist (its snapshot).
    async fn open_new(
        &self,
        client: &Client,
        prefix: &str,
        members: &HashMap<SubKey, Arc<Subscription>>,
        books: &mut HashMap<SubKey, Book>,
    ) {
        for (key, sub) in members {
            if books.contains_key(key) {
                continue;
            }
            // Only once the reconcile has made the queues (its consumer in status).
            if sub
                .status
                .as_ref()
                .and_then(|s| s.consumer.as_ref())
                .is_none()
            {
                continue;
            }
            let policy = ResolvedPolicy::resolve(&sub.spec.policy);
            let Ok(want) = queue::desired(prefix, &policy) else {
                continue;
            };
            let who = format!("{}/{}", key.0, key.1);
            let (report_q, ledger_q) = (
                report::report_queue(&want.name),
                report::ledger_queue(&want.name),
            );
            let urls = (
                admin::queue_url(client, &report_q).await,
                admin::queue_url(client, &ledger_q).await,
            );
            let (report_url, ledger_url) = match urls {
                (Ok(Some(r)), Ok(Some(l))) => (r, l),
                (Err(e), _) | (_, Err(e)) => {
                    tracing::debug!(subscription = %who, error = %e, "cannot look up the account queues; trying again");
                    continue;
                }
                _ => {
                    tracing::debug!(subscription = %who, "the account queues are not made yet; waiting for the reconcile");
                    continue;
                }
            };
            let saved = match load(client, &ledger_url).await {
                Ok(Loaded::Saved(s)) => s,
                Ok(Loaded::Busy) => {
                    tracing::debug!(subscription = %who, "a snapshot is in flight in the ledger queue (an operator before this one read it): waiting until it is back");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(subscription = %who, error = %e, "cannot read the saved ledger; trying again");
                    continue;
                }
            };
            let floor = sub
                .status
                .as_ref()
                .and_then(|s| s.stats.as_ref())
                .map(|s| s.counters)
                .unwrap_or_default();
            // A snapshot of an earlier object of this name is not this one's (semantics C15).
            let saved = match saved.map(|s| *s) {
                Some(s) if !s.ledger.persisted.belongs_to(sub.metadata.uid.as_deref()) => {
                    tracing::info!(subscription = %who, "the saved ledger is an earlier object's of the same name: the new object's account starts at zero");
                    None
                }
                other => other,
            };
            let counting = saved.is_some();
            let Saved {
                generation,
                ledger,
                mut loss,
            } = saved.unwrap_or_default();
            loss.observe(now_ms(), floor.exhausted, self.config.loss_window);
            let mut account = Account::restore(ledger, floor);
            account.claim(sub.metadata.uid.clone());
            tracing::info!(subscription = %who, generation, "counting the Subscription's SQS reports");
            books.insert(
                key.clone(),
                Book {
                    account,
                    showing: Showing {
                        loss,
                        trouble: Default::default(),
                        last_write: None,
                        last_early: None,
                        stall: None,
                    },
                    generation,
                    dead_letters: DeadLetters::default(),
                    dirty: false,
                    acks: Vec::new(),
                    counting,
                    queue: want.name.clone(),
                    report_url,
                    ledger_url,
                    redrives: want.redrive.is_some(),
                    gauges: None,
                    gauges_at: None,
                    gauges_written: None,
                },
            );
        }
    }

    /// Receives what is waiting in one Subscription's report queue (bounded) and counts it.
    async fn receive(&self, client: &Client, key: &SubKey, book: &mut Book) {
        let who = format!("{}/{}", key.0, key.1);
        for _ in 0..REPORT_RECEIVES_PER_TICK {
            let got = client
                .receive_message()
                .queue_url(&book.report_url)
                .max_number_of_messages(BATCH)
                .visibility_timeout(secs(REPORT_HIDE))
                .wait_time_seconds(0)
                .send()
                .await;
            let messages = match got {
                Ok(out) => {
                    if book.showing.trouble.queue_missing.take().is_some() {
                        tracing::info!(subscription = %who, "the report queue is back");
                    }
                    out.messages.unwrap_or_default()
                }
                Err(e) => {
                    let missing = e.as_service_error().is_some_and(|s| {
                        aws_sdk_sqs::error::ProvideErrorMetadata::code(s).is_some_and(|c| {
                            c.contains("QueueDoesNotExist") || c.contains("NonExistentQueue")
                        })
                    });
                    if missing {
                        if book.showing.trouble.queue_missing.is_none() {
                            tracing::warn!(subscription = %who, queue = %report::report_queue(&book.queue), "the report queue does not exist on the server (deleted there?): the reconcile makes it again");
                        }
                        book.showing.trouble.queue_missing =
                            Some(report::report_queue(&book.queue));
                        // Looked up again once it is back (a new queue has a new URL on SQS).
                        if let Ok(Some(url)) =
                            admin::queue_url(client, &report::report_queue(&book.queue)).await
                        {
                            book.report_url = url;
                        }
                    } else {
                        tracing::debug!(subscription = %who, error = %e, "cannot receive reports; trying again");
                    }
                    return;
                }
            };
            let full = messages.len() >= usize::try_from(BATCH).unwrap_or(10);
            for m in messages {
                let Some(receipt) = m.receipt_handle else {
                    continue;
                };
                book.acks.push((receipt, Instant::now()));
                let body = m.body.unwrap_or_default();
                self.on_report(key, book, body.as_bytes());
            }
            if !full {
                return;
            }
        }
    }

    /// Counts one report; it is deleted once the snapshot holding it is saved.
    fn on_report(&self, key: &SubKey, book: &mut Book, body: &[u8]) {
        let who = format!("{}/{}", key.0, key.1);
        let report = if self.config.limits.too_large(body.len()) {
            None
        } else {
            Some(serde_json::from_slice::<StatsReport>(body))
        };
        let refused = match &report {
            None => Some("too_large"),
            // A report counts only in its own Subscription's queue (semantics C18).
            Some(Ok(r)) if r.namespace != key.0 || r.subscription != key.1 => Some("misfiled"),
            Some(Ok(r)) => self.config.limits.refuse(r, &book.account),
            Some(Err(_)) => None,
        };
        if let Some(why) = refused {
            self.metrics.reports.with_label_values(&[why]).inc();
            tracing::warn!(subscription = %who, reason = why, "a stats report past the account's bounds: dropped");
            return;
        }
        let Some(report) = report else { return };
        let label = match report {
            Err(e) => {
                tracing::warn!(subscription = %who, error = %e, "a stats report is unreadable: skipped");
                "unreadable"
            }
            Ok(r) => match book.account.report(&r) {
                Outcome::Counted => {
                    book.dirty = true;
                    book.counting = true;
                    "counted"
                }
                Outcome::Stale => "stale",
                Outcome::OtherObject => "other_object",
                Outcome::UnknownVersion => {
                    tracing::warn!(subscription = %who, version = r.version, "a stats report of a version this operator does not know: skipped (upgrade the operator)");
                    "unknown_version"
                }
            },
        };
        self.metrics.reports.with_label_values(&[label]).inc();
    }

    /// Once a second: receive, look at the dead letters, fold, save, delete, gauges, status.
    async fn settle(
        &self,
        client: &Client,
        members: &HashMap<SubKey, Arc<Subscription>>,
        books: &mut HashMap<SubKey, Book>,
    ) {
        let now = now_ms();
        let fold_after = u64::try_from(self.config.fold_after.as_millis()).unwrap_or(u64::MAX);
        for (key, book) in books.iter_mut() {
            self.receive(client, key, book).await;
            if book.redrives
                && let Some(sub) = members.get(key)
            {
                let since_ms = sub
                    .metadata
                    .creation_timestamp
                    .as_ref()
                    .map_or(0, |t| u64::try_from(t.0.as_millisecond()).unwrap_or(0));
                let counted = book
                    .dead_letters
                    .scan(
                        client,
                        &book.queue,
                        since_ms,
                        &mut book.account,
                        &self.metrics,
                    )
                    .await;
                if counted > 0 {
                    book.dirty = true;
                    book.counting = true;
                }
            }
            if !book.account.fold_idle(now, fold_after).is_empty() {
                book.dirty = true;
            }
            self.save(client, key, members.get(key), book).await;
        }

        let interval = self.config.stats_interval;
        let stamp = Time(Timestamp::now());
        let mut budget = show::gauge_budget(books.len(), interval, TICK);
        for (key, book) in books.iter_mut() {
            let Some(sub) = members.get(key) else {
                continue;
            };
            if budget > 0 && book.gauges_at.is_none_or(|t| t.elapsed() >= interval) {
                budget -= 1;
                book.gauges_at = Some(Instant::now());
                match admin::queue_gauges(client, &book.queue).await {
                    Ok(g) => book.gauges = Some(g.unwrap_or((0, 0))),
                    Err(e) => {
                        tracing::debug!(subscription = %format!("{}/{}", key.0, key.1), error = %e, "cannot read the queue's gauges")
                    }
                }
            }
            let unseen = match (self.unseen, book.redrives, book.dead_letters.too_many()) {
                (false, _, _) => Unseen::Never,
                (true, true, None) => Unseen::FromDeadLetters,
                (true, true, Some(depth)) => Unseen::TooManyDeadLetters(depth),
                // No redrive: no message ever runs out of attempts (no maxDeliver), or AtMostOnce.
                (true, false, _) => Unseen::Never,
            };
            let round = show::Round {
                writer: &self.writer,
                metrics: &self.metrics,
                config: &self.config,
                unseen_attempts: unseen,
                now_ms: now,
                stamp: &stamp,
            };
            let totals = book.counting.then(|| book.account.totals());
            if show::show_counted_or_gauges(
                &round,
                key,
                sub,
                totals,
                book.gauges,
                &mut book.showing,
                &mut book.gauges_written,
            ) {
                book.dirty = true;
            }
        }
    }

    /// Saves the book's snapshot if it changed, then deletes the reports it holds.
    async fn save(
        &self,
        client: &Client,
        key: &SubKey,
        sub: Option<&Arc<Subscription>>,
        book: &mut Book,
    ) {
        let who = format!("{}/{}", key.0, key.1);
        if book.dirty {
            let saved = Saved {
                generation: book.generation + 1,
                ledger: book.account.snapshot(),
                loss: book.showing.loss.clone(),
            };
            match store(client, &book.ledger_url, &saved).await {
                Ok(()) => {
                    self.metrics.saves.with_label_values(&["ok"]).inc();
                    book.generation = saved.generation;
                    book.dirty = false;
                    if book.showing.trouble.unsaved.take().is_some() {
                        tracing::info!(subscription = %who, "the Subscription's ledger is saved again");
                        if let Some(sub) = sub {
                            self.writer.event(
                                sub,
                                false,
                                "LedgerSaved",
                                "the account's ledger is saved on the broker again".into(),
                            );
                        }
                    }
                }
                Err(e) => {
                    self.metrics.saves.with_label_values(&["error"]).inc();
                    if book.showing.trouble.unsaved.is_none() {
                        tracing::warn!(subscription = %who, error = %e, "cannot save the Subscription's ledger; its reports stay in the report queue until it can");
                        if let Some(sub) = sub {
                            self.writer.event(sub, true, super::status::reasons::LEDGER_NOT_SAVED, format!("the account's ledger cannot be saved on the broker ({e}); counts are still shown and nothing is lost meanwhile"));
                        }
                        // The ledger queue may have been deleted on the server: look it up again.
                        if let Ok(Some(url)) =
                            admin::queue_url(client, &report::ledger_queue(&book.queue)).await
                        {
                            book.ledger_url = url;
                        }
                    }
                    book.showing.trouble.unsaved = Some(e);
                    // Receipts past the hide time are let go: those reports are back in the queue.
                    book.acks.retain(|(_, at)| at.elapsed() < REPORT_HIDE);
                    return;
                }
            }
            // Older snapshots go (the newest, just saved, stays).
            if let Err(e) = prune(client, &book.ledger_url, book.generation).await {
                tracing::debug!(subscription = %who, error = %e, "cannot delete older snapshots yet (the next save tries again)");
            }
        }
        let acks: Vec<String> = book.acks.drain(..).map(|(r, _)| r).collect();
        if let Err(e) = delete_all(client, &book.report_url, &acks).await {
            // Those reports come back after the hide time and are counted stale.
            tracing::debug!(subscription = %who, error = %e, "cannot delete counted reports; they come back and are skipped");
        }
    }
}

fn secs(d: Duration) -> i32 {
    i32::try_from(d.as_secs()).unwrap_or(i32::MAX)
}

/// What a ledger queue held.
enum Loaded {
    /// The newest snapshot (none: never saved, or lost).
    Saved(Option<Box<Saved>>),
    /// A snapshot is in flight (another reader holds it for a few seconds): read again later,
    /// as a receive now could miss it.
    Busy,
}

/// Reads the newest snapshot of a ledger queue, deleting older ones, and leaves the newest
/// there (visible again at once). The queue is FIFO with one message group, oldest first.
async fn load(client: &Client, url: &str) -> Result<Loaded, String> {
    let attrs = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .map_err(|e| format!("GetQueueAttributes: {}", e.into_service_error()))?;
    let in_flight = attrs
        .attributes
        .as_ref()
        .and_then(|a| a.get(&QueueAttributeName::ApproximateNumberOfMessagesNotVisible))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    if in_flight > 0 {
        return Ok(Loaded::Busy);
    }
    let mut best: Option<(Saved, String)> = None;
    // Bounded: each round deletes all but one of up to ten.
    for _ in 0..100 {
        let got = client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(BATCH)
            .visibility_timeout(LEDGER_HIDE_SECS)
            .wait_time_seconds(0)
            .send()
            .await
            .map_err(|e| format!("ReceiveMessage: {}", e.into_service_error()))?;
        let messages = got.messages.unwrap_or_default();
        let full = messages.len() >= usize::try_from(BATCH).unwrap_or(10);
        let mut older = Vec::new();
        for m in messages {
            let Some(receipt) = m.receipt_handle else {
                continue;
            };
            match serde_json::from_str::<Saved>(m.body.as_deref().unwrap_or_default()) {
                Ok(s)
                    if best
                        .as_ref()
                        .is_none_or(|(b, _)| s.generation >= b.generation) =>
                {
                    if let Some((_, r)) = best.replace((s, receipt.clone()))
                        && r != receipt
                    {
                        older.push(r);
                    }
                }
                Ok(_) => older.push(receipt),
                Err(e) => {
                    tracing::warn!(error = %e, "an unreadable snapshot in a ledger queue: skipped and deleted");
                    older.push(receipt);
                }
            }
        }
        delete_all(client, url, &older).await?;
        if let Some((_, receipt)) = &best {
            let _ = client
                .change_message_visibility()
                .queue_url(url)
                .receipt_handle(receipt)
                .visibility_timeout(0)
                .send()
                .await;
        }
        if !full {
            break;
        }
    }
    Ok(Loaded::Saved(best.map(|(s, _)| Box::new(s))))
}

/// Sends a snapshot to its ledger queue.
async fn store(client: &Client, url: &str, saved: &Saved) -> Result<(), String> {
    let body = serde_json::to_string(saved).map_err(|e| format!("encoding a ledger: {e}"))?;
    if body.len() > report::LEDGER_MAX_BYTES as usize {
        return Err(format!(
            "the snapshot is {} bytes, past SQS's largest message ({} bytes): fewer live instances (--max-instances-per-subscription, --fold-after) keep it smaller",
            body.len(),
            report::LEDGER_MAX_BYTES
        ));
    }
    client
        .send_message()
        .queue_url(url)
        .message_body(body)
        .message_group_id(report::LEDGER_GROUP)
        .send()
        .await
        .map_err(|e| {
            format!(
                "SendMessage to the ledger queue: {}",
                e.into_service_error()
            )
        })?;
    Ok(())
}

/// Deletes the snapshots older than `generation` from a ledger queue (the oldest come first);
/// the newest is made visible again at once.
async fn prune(client: &Client, url: &str, generation: u64) -> Result<(), String> {
    let got = client
        .receive_message()
        .queue_url(url)
        .max_number_of_messages(BATCH)
        .visibility_timeout(LEDGER_HIDE_SECS)
        .wait_time_seconds(0)
        .send()
        .await
        .map_err(|e| format!("ReceiveMessage: {}", e.into_service_error()))?;
    let mut older = Vec::new();
    for m in got.messages.unwrap_or_default() {
        let Some(receipt) = m.receipt_handle else {
            continue;
        };
        let g = serde_json::from_str::<Saved>(m.body.as_deref().unwrap_or_default())
            .map_or(0, |s| s.generation);
        if g < generation {
            older.push(receipt);
        } else {
            let _ = client
                .change_message_visibility()
                .queue_url(url)
                .receipt_handle(&receipt)
                .visibility_timeout(0)
                .send()
                .await;
        }
    }
    delete_all(client, url, &older).await
}

/// Deletes the messages of these receipts, ten at a time.
pub(super) async fn delete_all(
    client: &Client,
    url: &str,
    receipts: &[String],
) -> Result<(), String> {
    for chunk in receipts.chunks(10) {
        let entries: Vec<DeleteMessageBatchRequestEntry> = chunk
            .iter()
            .enumerate()
            .filter_map(|(i, r)| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(r)
                    .build()
                    .ok()
            })
            .collect();
        client
            .delete_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| format!("DeleteMessageBatch: {}", e.into_service_error()))?;
    }
    Ok(())
}
