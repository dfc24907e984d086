//! One NATS Backend's account keeper. It reads two sources and keeps one ledger per
//! Subscription of that Backend:
//!
//! - the runtime's stats reports (the `settle-stats` bucket, latest value per instance, then
//!   every update), and
//! - the broker's delivery advisories, from the operator's capture stream through this
//!   Backend's durable reader (its checkpoint: nothing is missed while the operator is down),
//!   named for this Backend alone ([`reader_name`]); the reader of an operator before that
//!   naming is taken over at start, the new one continuing after what it acknowledged.
//!
//! Twice a second it folds idle instances, persists the ledgers that changed (bucket
//! `settle-account`, each write checked against the revision it read, so two operators at a
//! leader handover cannot overwrite each other), and only then acknowledges the advisories each
//! ledger applied, so a restart re-applies nothing twice (the ledger skips a capture sequence it
//! already counted). A save that fails holds back that Subscription's advisories only and is
//! said in its `Accounted` condition; every other Subscription goes on. It reads the broker's
//! gauges once per stats interval and hands the writer a status patch when what the
//! Subscription shows differs from the account, at most once per stats interval.
//!
//! A source lost (semantics C17): once the report bucket's history is replayed (the watch's
//! initial values are in), each Subscription loaded in this session is checked once: when what
//! its saved ledger and the reports sum to is below what status shows (the ledger missing or
//! unreadable, the reports gone), the ledger continues from status as an offset, saved with the
//! ledger, and `Accounted` says so (reason `SourceLost`) for the loss window.
//!
//! A report counts only under its own key (a body naming another is dropped, `misfiled`) and
//! within the account's bounds ([`super::Limits`]: an implausible sequence or time included).
//!
//! An account belongs to one Subscription object (its UID): a report or saved ledger of an
//! earlier object of the same name is dropped, never counted. The broker's advisories and
//! gauges count for a Subscription only through the consumer the controller verified as its own
//! (`status.consumer`), never by a name alone: a loss advisory read while a Subscription that
//! would make a consumer of its name has no `status.consumer` yet is held (at most
//! [`UNVERIFIED_ADVISORIES`], for `--unverified-advisory-grace`: the controller's status write
//! reaching the cache takes well under a second at rest and seconds under load) until the
//! status names one. One dropped
//! instead (the hold full, or the grace over) is remembered by its consumer, and when a
//! Subscription's status names that consumer, its `Accounted` says how many may be missing.
//!
//! Its files, the same as every keeper's: this one holds the keeper, its session and its loop;
//! [`count`] counts what comes in (reports, advisories), [`round`] is the round (save, then
//! acknowledge, gauges, status), [`store`] loads each Subscription's book from the ledger bucket
//! and saves it there. Beside them: [`members`] holds the Backend's Subscriptions as a round
//! sees them, [`names`] names the ledger keys and the durable reader, [`backend`] says what
//! concerns the Backend as a whole (its report bucket full, reports dropped that name no
//! Subscription of it), [`junk`] reads and judges each report and removes what can never count,
//! [`leftovers`] removes what the account kept for Subscriptions and Backends that are gone,
//! [`watch`] judges whether the report watch keeps up with the bucket (a stalled one ends the
//! session, which starts again with a new watch).
//!
//! It must not write status itself (that is the writer) nor decide counts (that is the ledger).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use kube::runtime::reflector::Store;
use serde::{Deserialize, Serialize};

mod backend;
mod count;
mod junk;
mod leftovers;
mod members;
mod names;
mod round;
mod store;
mod watch;
use super::Config;
use super::early::EarlyHold;
use super::ledger::{Account, Persisted};
use super::metrics::Metrics;
use super::show::Showing;
use super::status::LossLog;
use super::writer::Writer;
use leftovers::sweep_keys;
pub use leftovers::{drop_backend, drop_gone_readers};
use members::{Member, Members};
use names::ledger_key;
pub use names::{legacy_reader_name, reader_name};
use settle::api::Subscription;
use settle::backend::nats::admin::NatsError;
use settle::backend::nats::advisory::DeliveryEvent;
use settle::backend::nats::capture;
use settle::bus::report::{now_ms, report_key};
use watch::{Hearing, WatchProgress};

/// How often the keeper folds, persists, acknowledges and decides what to write: a change
/// reaches status within the stats interval plus this (and the write).
const TICK: Duration = Duration::from_millis(500);

/// Loss advisories held (for the configured grace), at most (one is about half a KiB).
const UNVERIFIED_ADVISORIES: usize = 1_000;

/// Loss advisories dropped unverified, by stream and consumer, until a Subscription's status
/// names the consumer (then that Subscription is told) or no Subscription awaits it any more
/// (then forgotten); at most [`UNVERIFIED_ADVISORIES`] consumers.
#[derive(Default)]
struct Uncounted(HashMap<(String, String), u64>);

impl Uncounted {
    fn note(&mut self, event: &DeliveryEvent) {
        let key = (event.stream.clone(), event.consumer.clone());
        if let Some(n) = self.0.get_mut(&key) {
            *n += 1;
        } else if self.0.len() < UNVERIFIED_ADVISORIES {
            self.0.insert(key, 1);
        }
    }

    /// The Subscriptions whose status now names a consumer of a dropped advisory, with how many
    /// were dropped; those no Subscription awaits or names any more are forgotten.
    fn claimed(&mut self, members: &Members) -> Vec<(SubKey, u64)> {
        let mut claimed = Vec::new();
        self.0.retain(|(stream, consumer), n| {
            if let Some((key, _)) = members.owner(stream, consumer) {
                claimed.push((key.clone(), *n));
                false
            } else {
                members.awaits(consumer)
            }
        });
        claimed
    }
}

/// Advisories a session holds outside its books.
#[derive(Default)]
struct Held {
    /// Advisories that counted for no book: acknowledged at the next round.
    loose: Vec<jetstream::Message>,
    /// Loss advisories of a consumer a Subscription would make, read before its status named
    /// it: tried again each round, for the configured grace.
    unverified: Vec<(Instant, jetstream::Message, DeliveryEvent)>,
    /// Those dropped (the hold full, or the grace over), by stream and consumer: the
    /// Subscription whose status comes to name the consumer is told they may be missing.
    uncounted: Uncounted,
}

/// How often a keeper reads how full its report bucket is.
const STORE_CHECK: Duration = Duration::from_secs(10);

/// An empty report bucket delivers no initial value at all: when none has come this long after
/// the watch started, its replay is complete.
const EMPTY_REPLAY: Duration = Duration::from_secs(5);

/// How long after its session starts a keeper deletes the reader of its legacy name: two
/// Backends whose legacy names were alike shared that reader, and the other's keeper takes it
/// over when its Backend connects.
const LEGACY_READER_GRACE: Duration = Duration::from_secs(600);

/// An advisory that changed `key`'s book is acknowledged once that book is saved; one whose book
/// is gone, at the next round.
fn ack_with_book(
    books: &mut Books,
    loose: &mut Vec<jetstream::Message>,
    key: &SubKey,
    msg: jetstream::Message,
) {
    match books.get_mut(key) {
        Some(book) => book.acks.push(msg),
        None => loose.push(msg),
    }
}

/// The advisories that counted for no book, acknowledged.
async fn ack_loose(loose: &mut Vec<jetstream::Message>) {
    // Taken, not drained: a burst of them would keep its buffer for good.
    for msg in std::mem::take(loose) {
        if let Err(e) = msg.ack().await {
            tracing::debug!(error = %e, "acknowledging an advisory failed: it comes again and is skipped then");
        }
    }
}

/// A Subscription, by namespace and name.
type SubKey = (String, String);

/// A session's rounds, until one breaks (the type an async block with `?` in it needs).
async fn rounds(f: impl Future<Output = Result<(), NatsError>>) -> Result<(), NatsError> {
    f.await
}

/// What is persisted per Subscription.
#[derive(Default, Serialize, Deserialize)]
struct Saved {
    ledger: Persisted,
    loss: LossLog,
    /// Advisories dropped from the capture before they were read, while this was counted,
    /// since `Accounted` last said none.
    #[serde(default)]
    missed_advisories: u64,
    /// When the last of them was found (ms since the epoch; 0 in a ledger saved before this
    /// was kept: the window starts when it is read).
    #[serde(default)]
    missed_at_ms: u64,
}

/// Every book of a session, each boxed: a map sizes its table in powers of two, so unboxed
/// books (about 1.1 KiB each) had held up to twice their size in empty slots.
type Books = HashMap<SubKey, Box<Book>>;

/// One Subscription's account as the keeper holds it.
struct Book {
    account: Account,
    showing: Showing,
    /// Something persisted changed since the last save.
    dirty: bool,
    /// The ledger's revision in the bucket as last read or written (None: no ledger there).
    revision: Option<u64>,
    /// Advisories this book applied since its last save: acknowledged once it is saved.
    acks: Vec<jetstream::Message>,
    /// The bucket revision of each live instance's latest report (to drop folded ones).
    revisions: HashMap<String, u64>,
    gauges: (u64, u64),
    gauges_at: Option<Instant>,
    /// Whether a source may have been lost, to check once the report replay is complete:
    /// `Some(ledger_lost)` on a book's first load in a session (a book read again after a lost
    /// race has no replay of its reports coming, so it is not checked).
    check: Option<bool>,
    /// When the consumer this book counts through was made (the server's clock), once read: a
    /// delivery advisory written before it is an earlier consumer's of the same name (an earlier
    /// object's, its advisories still unread when no operator ran), never this object's.
    consumer_since: Option<((String, String), i128)>,
    /// When advisories this book may have lost were last found (ms since the epoch): `Accounted`
    /// says `CaptureGap` until the loss window has passed since.
    missed_at_ms: u64,
}

pub struct NatsKeeper {
    backend: SubKey,
    client: async_nats::Client,
    subs: Store<Subscription>,
    writer: Writer,
    config: Config,
    metrics: Metrics,
    unseen_attempts: super::status::Unseen,
    /// The Subscriptions whose book was loaded in this session.
    loaded: std::sync::Mutex<std::collections::HashSet<SubKey>>,
    /// The report bucket is full, said with its fill (read every [`STORE_CHECK`]).
    store_full: std::sync::Mutex<Option<String>>,
    /// Reports dropped that name no Subscription of this Backend, said in its `Accounted`
    /// while the last is within the loss window; and what that condition last said.
    unnamed: std::sync::Mutex<backend::Unnamed>,
    /// Reports of folded instances, removed once the loss window has passed and their book is
    /// saved.
    folded_reports: std::sync::Mutex<Vec<FoldedReport>>,
}

/// A folded instance's report, waiting to be removed from the bucket.
struct FoldedReport {
    /// When it was folded (or, read again after a restart, written), ms.
    at: u64,
    /// The Subscription whose ledger holds the fold.
    book: SubKey,
    report: String,
    /// The revision it was read at: removed only if not written since.
    revision: u64,
}

fn broken(what: &str, e: impl std::fmt::Display) -> NatsError {
    NatsError::Unreachable(format!("{what}: {e}"))
}

impl NatsKeeper {
    pub fn new(
        backend: SubKey,
        client: async_nats::Client,
        subs: Store<Subscription>,
        writer: Writer,
        config: Config,
        metrics: Metrics,
        unseen_attempts: super::status::Unseen,
    ) -> NatsKeeper {
        NatsKeeper {
            backend,
            client,
            subs,
            writer,
            config,
            metrics,
            unseen_attempts,
            loaded: Default::default(),
            store_full: Default::default(),
            unnamed: Default::default(),
            folded_reports: Default::default(),
        }
    }

    /// Runs until aborted; a broken session (the broker went away) starts again.
    pub async fn run(self) {
        loop {
            if let Err(e) = self.session().await {
                tracing::warn!(backend = %format!("{}/{}", self.backend.0, self.backend.1), error = %e, "the account lost its broker session; starting it again in 2s");
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }

    /// This Backend's durable reader of the capture (one per Backend: two Backends on one
    /// server each read every advisory).
    fn reader(&self) -> String {
        reader_name(&self.backend.0, &self.backend.1)
    }

    /// Removes report `key` from the report bucket if it still holds `revision` (a report
    /// written since is kept).
    async fn drop_report(&self, key: &str, revision: u64) -> Result<(), NatsError> {
        capture::drop_report(&jetstream::new(self.client.clone()), key, revision).await
    }

    /// Subscription `ns/name` in the cache now (of any Backend).
    fn cached(&self, ns: &str, name: &str) -> Option<Arc<Subscription>> {
        self.subs
            .get(&kube::runtime::reflector::ObjectRef::new(name).within(ns))
    }

    /// Removes the ledgers of this namespace's Subscriptions that no longer exist (deleted while
    /// no operator ran): the next object of the same name starts at zero.
    async fn sweep(&self, ledgers: &kv::Store) {
        sweep_keys(ledgers, &self.subs, &self.backend.0, |key| {
            key.ends_with(".ledger")
        })
        .await;
    }

    // Long on purpose: the select! loop's three arms share the session's report watch, reader position, replay state, books, members and held advisories; each self-contained step is a method.
    /// One broker session: the capture's reader and the report watch opened, then reports,
    /// advisories and rounds until the broker goes away; what is unsaved is declined at the end.
    async fn session(&self) -> Result<(), NatsError> {
        let js = jetstream::new(self.client.clone());
        let reports =
            capture::reports(&js, self.config.limits.report_bucket, self.config.replicas).await?;
        let ledgers = capture::ledgers(&js, self.config.replicas).await?;
        // An operator before unambiguous reader names read through the legacy name: that
        // reader is the checkpoint, so the new one starts right after what it acknowledged.
        let legacy = legacy_reader_name(&self.backend.0, &self.backend.1);
        capture::take_over_reader(&js, &legacy, &self.reader()).await?;
        // Deleted once every Backend that shared the legacy name had the time to take it over.
        let mut legacy_dropped = false;
        let session_started = Instant::now();
        let reader = self.open_reader(&js).await?;
        // The replay of the report bucket's history is complete when the watch says it has seen
        // the current values, or at once when the bucket is empty.
        let mut hearing = Hearing::default();
        hearing.replayed = reports.status().await.is_ok_and(|s| s.values() == 0);
        let mut initial_values = 0u64;
        let watch_started = Instant::now();
        // The bucket the watch reads: one made again later starts its revisions over.
        let bucket_made = reports.stream.cached_info().created;
        let mut watch = reports
            .watch_with_history(">")
            .await
            .map_err(|e| broken("watching the report bucket", e))?;
        let mut advisories = reader
            .messages()
            .await
            .map_err(|e| broken("reading the advisory capture", e))?;
        // Where new advisories start: a first delivery past it by more than one was dropped by
        // the capture's limits before this reader got to it.
        let mut read_to = self.reader_started(&reader).await?;
        self.sweep(&ledgers).await;

        let mut books: Books = HashMap::new();
        let mut members = Members::default();
        members.refresh(&self.subs, &self.backend);
        // Reports of Subscriptions not in the cache yet (applied and the app reported first).
        let mut early: EarlyHold<kv::Entry> = EarlyHold::new(self.config.limits.early.clone());
        let mut held = Held::default();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.check_store(&reports).await;
        let mut store_checked = Instant::now();
        // The newest revision the watch delivered, and whether it keeps up with the bucket.
        let mut progress = WatchProgress::default();
        let ended = rounds(async {
        loop {
            tokio::select! {
                entry = watch.next() => {
                    let entry = entry
                        .ok_or_else(|| broken("the report watch", "ended"))?
                        .map_err(|e| broken("the report watch", e))?;
                    initial_values += 1;
                    hearing.replayed |= entry.seen_current;
                    hearing.watched = hearing.watched.max(entry.revision);
                    if let Some(entry) = self.on_report(&ledgers, &members, &mut books, entry).await? {
                        self.hold_early(&mut early, entry);
                    }
                }
                msg = advisories.next() => {
                    let msg = msg
                        .ok_or_else(|| broken("the advisory capture", "ended"))?
                        .map_err(|e| broken("the advisory capture", e))?;
                    self.read_advisory(&ledgers, &members, &mut books, &mut held, &mut read_to, msg).await?;
                }
                _ = tick.tick() => {
                    if !legacy_dropped && session_started.elapsed() >= LEGACY_READER_GRACE {
                        match capture::drop_reader(&js, &legacy).await {
                            Ok(()) => legacy_dropped = true,
                            Err(e) => tracing::debug!(reader = %legacy, error = %e, "cannot delete the account's former reader yet"),
                        }
                    }
                    if !hearing.replayed && initial_values == 0 && watch_started.elapsed() >= EMPTY_REPLAY {
                        hearing.replayed = true;
                    }
                    if store_checked.elapsed() >= STORE_CHECK {
                        let stream = self.check_store(&reports).await;
                        store_checked = Instant::now();
                        self.watch_keeps_up(stream, (hearing.watched, bucket_made), &mut progress).await?;
                    }
                    members.refresh(&self.subs, &self.backend);
                    self.retry_unverified(&ledgers, &members, &mut books, &mut held).await?;
                    self.tell_uncounted(&ledgers, &members, &mut books, &mut held.uncounted).await?;
                    self.retry_early(&ledgers, &members, &mut books, &mut early).await?;
                    ack_loose(&mut held.loose).await;
                    self.settle(&js, &ledgers, &reports, &members, &mut books, &mut hearing).await?;
                    self.show_backend();
                }
            }
        }
        })
        .await;
        self.decline_unsaved(books, held).await;
        ended
    }

    /// This Backend's reader of the capture opened, the capture replicated as configured, and
    /// the books loaded in a session before forgotten.
    async fn open_reader(&self, js: &jetstream::Context) -> Result<PullConsumer, NatsError> {
        let reader = capture::open(
            js,
            &self.reader(),
            self.config.capture_max_bytes,
            self.config.replicas,
        )
        .await?;
        capture::replicate(js, self.config.replicas).await?;
        if let Ok(mut loaded) = self.loaded.lock() {
            loaded.clear();
        }
        Ok(reader)
    }

    /// Where the capture reader's new advisories start (what it delivered), logged once.
    async fn reader_started(&self, reader: &PullConsumer) -> Result<u64, NatsError> {
        match reader.clone().info().await {
            Ok(info) => {
                tracing::info!(
                    backend = %format!("{}/{}", self.backend.0, self.backend.1),
                    reader = %self.reader(),
                    delivered = info.delivered.stream_sequence,
                    acknowledged = info.ack_floor.stream_sequence,
                    pending = info.num_pending,
                    unacknowledged = info.num_ack_pending,
                    leader = ?info.cluster.as_ref().and_then(|c| c.leader.as_deref()),
                    "account keeper started"
                );
                Ok(info.delivered.stream_sequence)
            }
            Err(e) => Err(broken("reading the capture reader", e)),
        }
    }

    /// A report of a Subscription not in the cache yet: held, within the process's bounds.
    fn hold_early(&self, early: &mut EarlyHold<kv::Entry>, entry: kv::Entry) {
        let (key, bytes) = (entry.key.clone(), entry.value.len());
        if !early.hold(key, entry, bytes) {
            self.metrics
                .reports
                .with_label_values(&["early_dropped"])
                .inc();
            self.dropped_unnamed("early_dropped");
        }
        self.metrics
            .early_bytes
            .set(i64::try_from(self.config.limits.early.held_bytes()).unwrap_or(i64::MAX));
    }

    /// The session is over and its books with it: the advisories they counted and did not
    /// save yet are declined, so they come to the next session at once, not after the
    /// reader's ack wait (one saved after all is skipped there by its capture sequence).
    async fn decline_unsaved(&self, books: Books, held: Held) {
        let Held {
            loose, unverified, ..
        } = held;
        let unsaved: Vec<jetstream::Message> = books
            .into_values()
            .flat_map(|book| book.acks)
            .chain(unverified.into_iter().map(|(_, msg, _)| msg))
            .collect();
        if !unsaved.is_empty() {
            tracing::info!(backend = %format!("{}/{}", self.backend.0, self.backend.1), advisories = unsaved.len(), "the session ended with advisories counted and not saved, or held for a consumer not verified yet: declined, for the next session to count");
        }
        for msg in unsaved {
            if let Err(e) = msg.ack_with(jetstream::AckKind::Nak(None)).await {
                tracing::debug!(error = %e, "declining an advisory failed: it comes again after the reader's ack wait");
            }
        }
        for msg in loose {
            let _ = msg.ack().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use settle::backend::nats::advisory::DeliveryKind;

    fn lost(stream: &str, consumer: &str) -> DeliveryEvent {
        DeliveryEvent {
            kind: DeliveryKind::MaxDeliveries,
            stream: stream.into(),
            consumer: consumer.into(),
            stream_seq: 1,
            deliveries: 1,
            at_ns: None,
        }
    }

    #[test]
    fn dropped_advisories_are_remembered_by_stream_and_consumer_up_to_the_bound() {
        let mut u = Uncounted::default();
        for i in 0..UNVERIFIED_ADVISORIES {
            u.note(&lost("S", &format!("c{i}")));
        }
        // A consumer of another stream is another key; past the bound a new one is not kept,
        // and one already kept still counts every drop.
        u.note(&lost("T", "c0"));
        u.note(&lost("S", "c0"));
        assert_eq!(u.0.len(), UNVERIFIED_ADVISORIES);
        assert_eq!(u.0.get(&("S".into(), "c0".into())), Some(&2));
        assert_eq!(u.0.get(&("T".into(), "c0".into())), None);
    }
}
