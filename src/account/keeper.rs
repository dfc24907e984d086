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
//! (`status.consumer`), never by a name alone.
//!
//! It must not write status itself (that is the writer) nor decide counts (that is the ledger).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::Store;
use serde::{Deserialize, Serialize};

use super::Config;
use super::ledger::{Account, BrokerOutcome, Outcome, Persisted, Source};
use super::metrics::Metrics;
use super::show::{self, Showing};
use super::status::LossLog;
use super::writer::Writer;
use crate::api::{Subscription, SubscriptionStats};
use crate::backend::nats::advisory::{self, ChangeKind, DeliveryKind};
use crate::backend::nats::capture;
use crate::backend::nats::jsapi::{self, NatsError};
use crate::bus::report::{StatsReport, now_ms, report_key};
use crate::policy::ResolvedPolicy;

/// How often the keeper folds, persists, acknowledges and decides what to write: a change
/// reaches status within the stats interval plus this (and the write).
const TICK: Duration = Duration::from_millis(500);

/// Reports held back for a Subscription not in the cache yet, at most.
const EARLY_REPORTS: usize = 10_000;

/// An empty report bucket delivers no initial value at all: when none has come this long after
/// the watch started, its replay is complete.
const EMPTY_REPLAY: Duration = Duration::from_secs(5);

/// How long after its session starts a keeper deletes the reader of its legacy name: two
/// Backends whose legacy names were alike shared that reader, and the other's keeper takes it
/// over when its Backend connects.
const LEGACY_READER_GRACE: Duration = Duration::from_secs(600);

/// A Subscription, by namespace and name.
type SubKey = (String, String);

/// What is persisted per Subscription.
#[derive(Default, Serialize, Deserialize)]
struct Saved {
    ledger: Persisted,
    loss: LossLog,
    /// Advisories dropped from the capture before they were read, while this was counted.
    #[serde(default)]
    missed_advisories: u64,
}

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
}

/// A Subscription of this Backend, and the consumer the controller verified as its own.
struct Member {
    sub: Arc<Subscription>,
    uid: Option<String>,
    /// `(stream, consumer)` from `status.consumer`: only through it does the broker count.
    consumer: Option<(String, String)>,
    max_deliver: Option<u32>,
    mode: crate::api::Mode,
}

pub struct Keeper {
    backend: SubKey,
    client: async_nats::Client,
    subs: Store<Subscription>,
    writer: Writer,
    config: Config,
    metrics: Metrics,
    unseen_attempts: super::status::Unseen,
    /// The Subscriptions whose book was loaded in this session.
    loaded: std::sync::Mutex<std::collections::HashSet<SubKey>>,
}

fn broken(what: &str, e: impl std::fmt::Display) -> NatsError {
    NatsError::Unreachable(format!("{what}: {e}"))
}

impl Keeper {
    pub fn new(
        backend: SubKey,
        client: async_nats::Client,
        subs: Store<Subscription>,
        writer: Writer,
        config: Config,
        metrics: Metrics,
        unseen_attempts: super::status::Unseen,
    ) -> Keeper {
        Keeper {
            backend,
            client,
            subs,
            writer,
            config,
            metrics,
            unseen_attempts,
            loaded: Default::default(),
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

    /// The Subscriptions of this Backend now.
    fn members(&self) -> HashMap<SubKey, Member> {
        let mut out = HashMap::new();
        for sub in self.subs.state() {
            let ns = sub.namespace().unwrap_or_default();
            if ns != self.backend.0 || sub.spec.backend_ref.name != self.backend.1 {
                continue;
            }
            let name = sub.name_any();
            let policy = ResolvedPolicy::resolve(&sub.spec.policy);
            let member = Member {
                uid: sub.metadata.uid.clone(),
                consumer: sub
                    .status
                    .as_ref()
                    .and_then(|s| s.consumer.as_ref())
                    .map(|c| (c.stream.clone(), c.name.clone())),
                max_deliver: policy.max_deliver,
                mode: policy.mode,
                sub,
            };
            out.insert((ns, name), member);
        }
        out
    }

    /// Subscription `ns/name` in the cache now (of any Backend).
    fn cached(&self, ns: &str, name: &str) -> Option<Arc<Subscription>> {
        self.subs
            .get(&kube::runtime::reflector::ObjectRef::new(name).within(ns))
    }

    /// Removes the ledgers of this namespace's Subscriptions that no longer exist (deleted while
    /// no operator ran): the next object of the same name starts at zero.
    async fn sweep(&self, ledgers: &kv::Store) {
        let Ok(keys) = ledgers.keys().await else {
            return;
        };
        let keys: Vec<String> = keys.filter_map(|k| async move { k.ok() }).collect().await;
        // Keys are `<namespace>.<subscription>.ledger`, each part reduced to the key alphabet.
        let prefix = match report_key(&self.backend.0, "_", "_").split_once('.') {
            Some((ns, _)) => format!("{ns}."),
            None => return,
        };
        let alive: Vec<String> = self
            .subs
            .state()
            .iter()
            .filter(|s| s.namespace().as_deref() == Some(self.backend.0.as_str()))
            .map(|s| ledger_key(&(self.backend.0.clone(), s.name_any())))
            .collect();
        for key in keys {
            if key.starts_with(&prefix) && key.ends_with(".ledger") && !alive.contains(&key) {
                match ledgers.purge(&key).await {
                    Ok(()) => {
                        tracing::info!(key = %key, "removed the ledger of a Subscription deleted while no operator ran")
                    }
                    Err(e) => {
                        tracing::debug!(key = %key, error = %e, "cannot remove a leftover ledger")
                    }
                }
            }
        }
    }

    async fn session(&self) -> Result<(), NatsError> {
        let js = jetstream::new(self.client.clone());
        let reports = capture::reports(&js, self.config.limits.report_bucket).await?;
        let ledgers = capture::ledgers(&js).await?;
        // An operator before unambiguous reader names read through the legacy name: that
        // reader is the checkpoint, so the new one starts right after what it acknowledged.
        let legacy = legacy_reader_name(&self.backend.0, &self.backend.1);
        capture::take_over_reader(&js, &legacy, &self.reader()).await?;
        // Deleted once every Backend that shared the legacy name had the time to take it over.
        let mut legacy_dropped = false;
        let session_started = Instant::now();
        let reader = capture::open(&js, &self.reader(), self.config.capture_max_bytes).await?;
        if let Ok(mut loaded) = self.loaded.lock() {
            loaded.clear();
        }
        // The replay of the report bucket's history is complete when the watch says it has seen
        // the current values, or at once when the bucket is empty.
        let mut replayed = reports.status().await.is_ok_and(|s| s.values() == 0);
        let mut initial_values = 0u64;
        let watch_started = Instant::now();
        let mut watch = reports
            .watch_with_history(">")
            .await
            .map_err(|e| broken("watching the report bucket", e))?;
        let mut advisories = reader
            .messages()
            .await
            .map_err(|e| broken("reading the advisory capture", e))?;
        tracing::info!(backend = %format!("{}/{}", self.backend.0, self.backend.1), reader = %self.reader(), "account keeper started");
        // Where new advisories start: a first delivery past it by more than one was dropped by
        // the capture's limits before this reader got to it.
        let mut read_to = match reader.clone().info().await {
            Ok(info) => info.delivered.stream_sequence,
            Err(e) => return Err(broken("reading the capture reader", e)),
        };
        self.sweep(&ledgers).await;

        let mut books: HashMap<SubKey, Book> = HashMap::new();
        let mut members = self.members();
        // Reports of Subscriptions not in the cache yet (applied and the app reported first).
        let mut early: HashMap<String, kv::Entry> = HashMap::new();
        // Advisories that counted for no book: acknowledged at the next round.
        let mut loose: Vec<jetstream::Message> = Vec::new();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                entry = watch.next() => {
                    let entry = entry
                        .ok_or_else(|| broken("the report watch", "ended"))?
                        .map_err(|e| broken("the report watch", e))?;
                    initial_values += 1;
                    replayed |= entry.seen_current;
                    if let Some(entry) = self.on_report(&ledgers, &members, &mut books, entry).await? {
                        let held: usize = early.values().map(|e| e.value.len()).sum();
                        if early.len() < EARLY_REPORTS
                            && held + entry.value.len() <= self.config.limits.max_early_bytes
                        {
                            early.insert(entry.key.clone(), entry);
                        } else {
                            self.metrics.reports.with_label_values(&["early_dropped"]).inc();
                        }
                    }
                }
                msg = advisories.next() => {
                    let msg = msg
                        .ok_or_else(|| broken("the advisory capture", "ended"))?
                        .map_err(|e| broken("the advisory capture", e))?;
                    if let Ok(info) = msg.info()
                        && info.delivered == 1
                        && info.stream_sequence > read_to
                    {
                        let missed = info.stream_sequence.saturating_sub(read_to + 1);
                        if missed > 0 && read_to > 0 {
                            self.missed(&mut books, &members, &ledgers, missed).await?;
                        }
                        read_to = info.stream_sequence;
                    }
                    match self.on_advisory(&ledgers, &members, &mut books, &msg).await? {
                        Some(key) => match books.get_mut(&key) {
                            Some(book) => book.acks.push(msg),
                            None => loose.push(msg),
                        },
                        None => loose.push(msg),
                    }
                }
                _ = tick.tick() => {
                    if !legacy_dropped && session_started.elapsed() >= LEGACY_READER_GRACE {
                        match capture::drop_reader(&js, &legacy).await {
                            Ok(()) => legacy_dropped = true,
                            Err(e) => tracing::debug!(reader = %legacy, error = %e, "cannot delete the account's former reader yet"),
                        }
                    }
                    if !replayed && initial_values == 0 && watch_started.elapsed() >= EMPTY_REPLAY {
                        replayed = true;
                    }
                    members = self.members();
                    for (_, entry) in std::mem::take(&mut early) {
                        if let Some(entry) = self.on_report(&ledgers, &members, &mut books, entry).await? {
                            early.insert(entry.key.clone(), entry);
                        }
                    }
                    for msg in loose.drain(..) {
                        if let Err(e) = msg.ack().await {
                            tracing::debug!(error = %e, "acknowledging an advisory failed: it comes again and is skipped then");
                        }
                    }
                    self.settle(&js, &ledgers, &reports, &members, &mut books, replayed).await?;
                }
            }
        }
    }

    /// Counts advisories the capture dropped before they were read, on every book of this
    /// Backend (any of them may have lost a message no handler saw).
    async fn missed(
        &self,
        books: &mut HashMap<SubKey, Book>,
        members: &HashMap<SubKey, Member>,
        ledgers: &kv::Store,
        missed: u64,
    ) -> Result<(), NatsError> {
        tracing::warn!(backend = %format!("{}/{}", self.backend.0, self.backend.1), missed, "advisories were dropped from the capture stream before the account read them");
        self.metrics
            .capture_gap
            .with_label_values(&[&format!("{}/{}", self.backend.0, self.backend.1)])
            .inc_by(missed);
        for (key, m) in members {
            let book = self.book(ledgers, books, key, m).await?;
            book.showing.trouble.missed_advisories += missed;
            book.dirty = true;
        }
        Ok(())
    }

    /// The book of `key` for the Subscription object `m` is, loaded from the ledger bucket the
    /// first time; a book or saved ledger of an earlier object of that name is dropped.
    async fn book<'a>(
        &self,
        ledgers: &kv::Store,
        books: &'a mut HashMap<SubKey, Book>,
        key: &SubKey,
        m: &Member,
    ) -> Result<&'a mut Book, NatsError> {
        let name = || format!("{}/{}", key.0, key.1);
        if let Some(book) = books.get(key)
            && !book.account.persisted().belongs_to(m.uid.as_deref())
        {
            tracing::info!(subscription = %name(), "the Subscription was deleted and made again: the new object's account starts at zero");
            let old = books.remove(key);
            for (instance, revision) in old.iter().flat_map(|b| b.revisions.iter()) {
                let report = report_key(&key.0, &key.1, instance);
                let _ =
                    capture::drop_report(&jetstream::new(self.client.clone()), &report, *revision)
                        .await;
            }
        }
        if !books.contains_key(key) {
            let sub = &m.sub;
            let entry = ledgers
                .entry(ledger_key(key))
                .await
                .map_err(|e| broken("reading a ledger", e))?;
            let revision = entry.as_ref().map(|e| e.revision);
            let mut ledger_lost = false;
            let saved: Saved = match entry.filter(|e| e.operation == kv::Operation::Put) {
                Some(e) => serde_json::from_slice(&e.value).unwrap_or_else(|err| {
                    tracing::warn!(subscription = %name(), error = %err, "a persisted ledger is unreadable: starting from what status shows");
                    ledger_lost = true;
                    Saved::default()
                }),
                None => {
                    ledger_lost = true;
                    Saved::default()
                }
            };
            let saved = if saved.ledger.belongs_to(m.uid.as_deref()) {
                saved
            } else {
                tracing::info!(subscription = %name(), "the saved ledger is an earlier object's of the same name (deleted while no operator ran): the new object's account starts at zero");
                Saved::default()
            };
            let floor = sub
                .status
                .as_ref()
                .and_then(|s| s.stats.as_ref())
                .map(|s| s.counters)
                .unwrap_or_default();
            let mut loss = saved.loss;
            loss.observe(now_ms(), floor.exhausted, self.config.loss_window);
            let first_load = self
                .loaded
                .lock()
                .map(|mut loaded| loaded.insert(key.clone()))
                .unwrap_or(false);
            let mut account = Account::resume(saved.ledger, floor);
            account.claim(m.uid.clone());
            books.insert(
                key.clone(),
                Book {
                    account,
                    showing: Showing {
                        loss,
                        trouble: super::status::Trouble {
                            unsaved: None,
                            missed_advisories: saved.missed_advisories,
                            source_lost: None,
                            dead_letters: None,
                            queue_missing: None,
                        },
                        last_write: None,
                        last_early: None,
                        stall: None,
                    },
                    // A ledger missing or unreadable is written at once, before status shows
                    // anything from this book: so status showing counters with no ledger there
                    // means the ledger was lost.
                    dirty: ledger_lost,
                    revision,
                    acks: Vec::new(),
                    revisions: HashMap::new(),
                    consumer_since: None,
                    gauges: (0, 0),
                    gauges_at: None,
                    check: first_load.then_some(ledger_lost),
                },
            );
        }
        books
            .get_mut(key)
            .ok_or_else(|| broken("a ledger", "missing after loading"))
    }

    /// Counts one report. Returns it when its Subscription is not (yet) one of this Backend's,
    /// to be tried again.
    async fn on_report(
        &self,
        ledgers: &kv::Store,
        members: &HashMap<SubKey, Member>,
        books: &mut HashMap<SubKey, Book>,
        entry: kv::Entry,
    ) -> Result<Option<kv::Entry>, NatsError> {
        if entry.operation != kv::Operation::Put {
            return Ok(None);
        }
        if self.config.limits.too_large(entry.value.len()) {
            self.metrics.reports.with_label_values(&["too_large"]).inc();
            tracing::warn!(key = %entry.key, bytes = entry.value.len(), "a stats report larger than --max-report-bytes: dropped");
            return Ok(None);
        }
        let report: StatsReport = match serde_json::from_slice(&entry.value) {
            Ok(r) => r,
            Err(e) => {
                self.metrics
                    .reports
                    .with_label_values(&["unreadable"])
                    .inc();
                tracing::warn!(key = %entry.key, error = %e, "a stats report is unreadable: skipped");
                return Ok(None);
            }
        };
        // A report counts only under its own key: a body naming another Subscription or
        // instance than the key it was written to is dropped.
        if report.key() != entry.key {
            self.metrics.reports.with_label_values(&["misfiled"]).inc();
            tracing::warn!(key = %entry.key, named = %report.key(), "a stats report whose body names another key than the one it was written to: dropped");
            return Ok(None);
        }
        let key = (report.namespace.clone(), report.subscription.clone());
        // Another Backend's Subscription, a subscription defined in code only, or one the cache
        // has not seen yet: kept to be tried again while it is in this Backend's namespace.
        let Some(member) = members.get(&key) else {
            if report.subscription_uid.is_some()
                && report.namespace == self.backend.0
                && self.cached(&key.0, &key.1).is_none()
            {
                // Bound to an operator's consumer once, and that Subscription is gone.
                self.metrics.reports.with_label_values(&["gone"]).inc();
                let _ = capture::drop_report(
                    &jetstream::new(self.client.clone()),
                    &entry.key,
                    entry.revision,
                )
                .await;
                return Ok(None);
            }
            return Ok((report.namespace == self.backend.0).then_some(entry));
        };
        // A report of the object that now holds the name, while this round's members still
        // name the one before (it was deleted and applied again meanwhile): tried again next
        // round, never dropped.
        if report.subscription_uid.is_some()
            && report.subscription_uid != member.uid
            && self
                .cached(&key.0, &key.1)
                .and_then(|s| s.metadata.uid.clone())
                == report.subscription_uid
        {
            return Ok(Some(entry));
        }
        let book = self.book(ledgers, books, &key, member).await?;
        if let Some(why) = self.config.limits.refuse(&report, &book.account) {
            self.metrics.reports.with_label_values(&[why]).inc();
            tracing::warn!(key = %entry.key, reason = why, "a stats report past the account's bounds (--max-instances-per-subscription, the instance name's length): dropped");
            return Ok(None);
        }
        let before = kept(&book.account);
        let label = match book.account.report(&report) {
            Outcome::Counted => {
                book.revisions
                    .insert(report.instance.clone(), entry.revision);
                // A life replaced by a newer one, a folded one back, or a charge against the
                // offset changes what is persisted: saved, or a restart would lose it.
                if kept(&book.account) != before {
                    book.dirty = true;
                }
                "counted"
            }
            Outcome::OtherObject => {
                // An earlier object's report of the same name: never this one's.
                let _ = capture::drop_report(
                    &jetstream::new(self.client.clone()),
                    &entry.key,
                    entry.revision,
                )
                .await;
                "other_object"
            }
            Outcome::Stale => "stale",
            Outcome::UnknownVersion => {
                tracing::warn!(key = %entry.key, version = report.version, "a stats report of a version this operator does not know: skipped (upgrade the operator)");
                "unknown_version"
            }
        };
        self.metrics.reports.with_label_values(&[label]).inc();
        Ok(None)
    }

    /// A book read anew: its ledger from the bucket, and every live report of its Subscription
    /// from the report bucket (the watch has passed them; they are cumulative, so reading them
    /// again counts each once).
    async fn rebuild(
        &self,
        ledgers: &kv::Store,
        reports: &kv::Store,
        members: &HashMap<SubKey, Member>,
        books: &mut HashMap<SubKey, Book>,
        key: &SubKey,
    ) -> Result<(), NatsError> {
        let Some(member) = members.get(key) else {
            return Ok(());
        };
        self.book(ledgers, books, key, member).await?;
        let prefix = format!(
            "{}.",
            report_key(&key.0, &key.1, "_")
                .rsplit_once('.')
                .map_or("", |(p, _)| p)
        );
        let keys: Vec<String> = reports
            .keys()
            .await
            .map_err(|e| broken("listing the report bucket", e))?
            .filter_map(|k| async move { k.ok() })
            .filter(|k| futures::future::ready(k.starts_with(&prefix)))
            .collect()
            .await;
        for k in keys {
            if let Ok(Some(entry)) = reports.entry(k).await {
                self.on_report(ledgers, members, books, entry).await?;
            }
        }
        Ok(())
    }

    /// Applies one advisory; returns the Subscription whose book it changed (its
    /// acknowledgement waits for that book's save).
    async fn on_advisory(
        &self,
        ledgers: &kv::Store,
        members: &HashMap<SubKey, Member>,
        books: &mut HashMap<SubKey, Book>,
        msg: &jetstream::Message,
    ) -> Result<Option<SubKey>, NatsError> {
        let capture_seq = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
        let subject = msg.subject.as_str();
        // Only the consumer the controller verified as a Subscription's counts for it.
        let owner = |stream: &str, consumer: &str| {
            members.iter().find(|(_, m)| {
                m.consumer
                    .as_ref()
                    .is_some_and(|(s, c)| s == stream && c == consumer)
            })
        };
        if let Some(change) = advisory::parse(subject, &msg.payload) {
            self.metrics
                .advisories
                .with_label_values(&["consumer_change"])
                .inc();
            if change.kind == ChangeKind::Created
                && let Some((key, m)) = owner(&change.stream, &change.consumer)
            {
                let book = self.book(ledgers, books, key, m).await?;
                book.account.consumer_recreated();
                book.consumer_since = None;
                book.dirty = true;
                return Ok(Some(key.clone()));
            }
            return Ok(None);
        }
        let Some(event) = advisory::parse_delivery(subject, &msg.payload) else {
            return Ok(None);
        };
        let kind = match event.kind {
            DeliveryKind::MaxDeliveries => "max_deliveries",
            DeliveryKind::Terminated => "terminated",
            DeliveryKind::Naked => "naked",
        };
        self.metrics.advisories.with_label_values(&[kind]).inc();
        let Some((key, m)) = owner(&event.stream, &event.consumer) else {
            return Ok(None);
        };
        // A terminate is a loss only on the last attempt (the runtime's decline of it).
        let exhausted = match event.kind {
            DeliveryKind::MaxDeliveries => true,
            DeliveryKind::Terminated => m
                .max_deliver
                .is_some_and(|max| event.deliveries >= u64::from(max)),
            DeliveryKind::Naked => false,
        };
        if exhausted {
            let book = self.book(ledgers, books, key, m).await?;
            if let (Some(at), Some(since)) =
                (event.at_ns, consumer_since(&self.client, book, m).await)
                && at < since
            {
                self.metrics
                    .advisories
                    .with_label_values(&["earlier_consumer"])
                    .inc();
                tracing::debug!(subscription = %format!("{}/{}", key.0, key.1), stream_seq = event.stream_seq, "an advisory of an earlier consumer of the same name: not this object's");
                return Ok(None);
            }
            if book
                .account
                .broker_exhausted_message(capture_seq, event.stream_seq)
                == BrokerOutcome::Counted
            {
                tracing::debug!(subscription = %format!("{}/{}", key.0, key.1), stream_seq = event.stream_seq, %kind, "a message ran out of attempts");
            }
            book.dirty = true;
            return Ok(Some(key.clone()));
        }
        Ok(None)
    }

    /// Every tick: fold, persist, acknowledge, gauges, status.
    async fn settle(
        &self,
        js: &jetstream::Context,
        ledgers: &kv::Store,
        reports: &kv::Store,
        members: &HashMap<SubKey, Member>,
        books: &mut HashMap<SubKey, Book>,
        replayed: bool,
    ) -> Result<(), NatsError> {
        // Every Subscription of this Backend has a book, so each shows its counters.
        for (key, m) in members {
            self.book(ledgers, books, key, m).await?;
        }
        // Every report there was is counted now: what status shows and they do not explain was
        // lost with a source (C17).
        if replayed {
            let now = now_ms();
            for (key, book) in books.iter_mut() {
                let (Some(ledger_lost), Some(m)) = (book.check, members.get(key)) else {
                    continue;
                };
                book.check = None;
                if let Some(source) = book.account.recover(ledger_lost, now, m.mode) {
                    book.dirty = true;
                    let offset = book.account.offset();
                    tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), ?source, offered = offset.offered, exhausted = offset.exhausted, "a source of the account was lost: counting continues from what status showed (an offset)");
                    self.metrics
                        .source_lost
                        .with_label_values(&[match source {
                            Source::Ledger => "ledger",
                            Source::Reports => "reports",
                        }])
                        .inc();
                }
            }
        }
        // Deleted Subscriptions: their ledger and reports go with them.
        let gone: Vec<SubKey> = books
            .keys()
            .filter(|k| !members.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            if let Some(book) = books.remove(&key) {
                for (instance, revision) in &book.revisions {
                    let report = report_key(&key.0, &key.1, instance);
                    let _ = capture::drop_report(js, &report, *revision).await;
                }
                let _ = ledgers.purge(ledger_key(&key)).await;
                self.metrics.forget(&key.0, &key.1);
                tracing::info!(subscription = %format!("{}/{}", key.0, key.1), "the Subscription is gone: its account is dropped");
            }
        }

        let now = now_ms();
        let fold_after = u64::try_from(self.config.fold_after.as_millis()).unwrap_or(u64::MAX);
        let mut dropped = Vec::new();
        for (key, book) in books.iter_mut() {
            for instance in book.account.fold_idle(now, fold_after) {
                book.dirty = true;
                if let Some(r) = book.revisions.remove(&instance) {
                    dropped.push((report_key(&key.0, &key.1, &instance), r));
                }
            }
        }
        // Persist, then acknowledge: an advisory is never acknowledged before what it counted
        // is saved. A save that fails holds back that book's advisories only.
        let mut lost_race = Vec::new();
        for (key, book) in books.iter_mut() {
            if book.dirty {
                let was_unsaved = book.showing.trouble.unsaved.is_some();
                match self.save(ledgers, key, book).await {
                    Ok(()) => {
                        if was_unsaved && let Some(m) = members.get(key) {
                            self.writer.event(
                                &m.sub,
                                false,
                                "LedgerSaved",
                                "the account's ledger is saved on the broker again".into(),
                            );
                        }
                    }
                    Err(Save::Conflict) => {
                        lost_race.push(key.clone());
                        continue;
                    }
                    Err(Save::Failed(why)) => {
                        if book.showing.trouble.unsaved.is_none() {
                            tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), error = %why, "cannot save the Subscription's ledger; its advisories stay unacknowledged until it can");
                            if let Some(m) = members.get(key) {
                                self.writer.event(&m.sub, true, super::status::reasons::LEDGER_NOT_SAVED, format!("the account's ledger cannot be saved on the broker ({why}); counts are still shown and nothing is lost meanwhile"));
                            }
                        }
                        book.showing.trouble.unsaved = Some(why);
                        continue;
                    }
                }
            }
            for msg in book.acks.drain(..) {
                if let Err(e) = msg.ack().await {
                    tracing::debug!(error = %e, "acknowledging an advisory failed: it comes again and is skipped then");
                }
            }
        }
        // Another operator wrote a ledger since this one read it (a leader handover): this
        // book is read again from the bucket, its unacknowledged advisories come back.
        for key in lost_race {
            tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), "the ledger was written by another writer meanwhile: reading it and the Subscription's reports again");
            books.remove(&key);
            self.rebuild(ledgers, reports, members, books, &key).await?;
        }
        for (report, revision) in dropped {
            if let Err(e) = capture::drop_report(js, &report, revision).await {
                tracing::debug!(error = %e, "dropping a folded report failed (it is counted once all the same)");
            }
        }

        let interval = self.config.stats_interval;
        let loss_window = u64::try_from(self.config.loss_window.as_millis()).unwrap_or(u64::MAX);
        let stamp = Time(Timestamp::now());
        let round = show::Round {
            writer: &self.writer,
            metrics: &self.metrics,
            config: &self.config,
            unseen_attempts: self.unseen_attempts,
            now_ms: now,
            stamp: &stamp,
        };
        // Gauges: each Subscription's once per interval, spread over the interval's ticks so a
        // thousand consumers are not asked in the same second.
        let mut budget = show::gauge_budget(books.len(), interval, TICK);
        for (key, book) in books.iter_mut() {
            let Some(m) = members.get(key) else { continue };
            if budget > 0 && book.gauges_at.is_none_or(|t| t.elapsed() >= interval) {
                budget -= 1;
                book.gauges_at = Some(Instant::now());
                if let Some((stream, consumer)) = &m.consumer {
                    match jsapi::consumer_info(js, stream, consumer).await {
                        Ok(Some(info)) => {
                            book.gauges = (
                                info.num_pending,
                                u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX),
                            );
                        }
                        Ok(None) => book.gauges = (0, 0),
                        Err(e) => {
                            tracing::debug!(subscription = %format!("{}/{}", key.0, key.1), error = %e, "cannot read the consumer's gauges")
                        }
                    }
                } else {
                    // Not (or no longer) its own consumer: the broker's gauges are not its.
                    book.gauges = (0, 0);
                }
            }
            book.showing.trouble.source_lost = book
                .account
                .persisted()
                .lost
                .as_ref()
                .filter(|l| now.saturating_sub(l.at_ms) < loss_window)
                .map(|l| l.source);
            let stats = SubscriptionStats {
                counters: book.account.totals(),
                pending: book.gauges.0,
                ack_pending: book.gauges.1,
            };
            if show::show(&round, key, &m.sub, stats, &mut book.showing) {
                book.dirty = true;
            }
        }
        Ok(())
    }
}

/// Why a ledger was not saved.
enum Save {
    /// Another operator wrote it since it was read.
    Conflict,
    Failed(String),
}

impl Keeper {
    /// Saves one book's ledger, checked against the revision it was read or last written at.
    async fn save(&self, ledgers: &kv::Store, key: &SubKey, book: &mut Book) -> Result<(), Save> {
        let saved = Saved {
            ledger: book.account.persisted().clone(),
            loss: book.showing.loss.clone(),
            missed_advisories: book.showing.trouble.missed_advisories,
        };
        let body = serde_json::to_vec(&saved).map_err(|e| Save::Failed(e.to_string()))?;
        let written = match book.revision {
            Some(rev) => ledgers
                .update(ledger_key(key), body.into(), rev)
                .await
                .map_err(|e| match e.kind() {
                    kv::UpdateErrorKind::WrongLastRevision => Save::Conflict,
                    _ => Save::Failed(e.to_string()),
                }),
            None => ledgers
                .create(ledger_key(key), body.into())
                .await
                .map_err(|e| match e.kind() {
                    kv::CreateErrorKind::AlreadyExists => Save::Conflict,
                    _ => Save::Failed(e.to_string()),
                }),
        };
        let label = match &written {
            Ok(_) => "ok",
            Err(Save::Conflict) => "conflict",
            Err(Save::Failed(_)) => "error",
        };
        self.metrics.saves.with_label_values(&[label]).inc();
        let revision = written?;
        if book.showing.trouble.unsaved.take().is_some() {
            tracing::info!(subscription = %format!("{}/{}", key.0, key.1), "the Subscription's ledger is saved again");
        }
        book.revision = Some(revision);
        book.dirty = false;
        Ok(())
    }
}

/// What of an account is persisted and a report can change (to tell when to save).
fn kept(account: &Account) -> (crate::api::ConsumerStats, crate::api::ConsumerStats, usize) {
    let p = account.persisted();
    (
        p.retired,
        p.offset,
        p.lost.as_ref().map_or(0, |l| l.known.len()),
    )
}

/// A Subscription's key in the ledger bucket.
fn ledger_key(key: &SubKey) -> String {
    report_key(&key.0, &key.1, "ledger")
}

/// The longest name the keeper gives a durable reader (NATS allows 255 characters; the name is
/// also a directory on the server's disk).
const MAX_READER_NAME: usize = 255;

/// The durable reader of Backend `namespace/backend` in the capture: one name per Backend,
/// never two Backends' alike. A namespace is a DNS label (`a-z 0-9 -`), so the first `_` ends
/// it; a Backend's name is a DNS subdomain whose dots (which a NATS name may not hold) become
/// `_`, never two in a row (a subdomain has no empty label). A name too long for NATS keeps
/// the namespace and replaces the Backend's name by `__` and a hash of it, which no Backend
/// name can spell (`__`).
pub fn reader_name(namespace: &str, backend: &str) -> String {
    // Anything a NATS name may not hold (never in a Kubernetes name) is mapped as dots are.
    let clean = |s: &str| s.replace(['.', '*', '>', ' ', '/', '\\'], "_");
    let name = format!("settle-account_{}_{}", clean(namespace), clean(backend));
    if name.len() <= MAX_READER_NAME {
        return name;
    }
    format!(
        "settle-account_{}__{:016x}",
        clean(namespace),
        fnv1a(format!("{namespace}/{backend}").as_bytes())
    )
}

/// The reader's name before names were unambiguous (`team`/`a-nats` and `team-a`/`nats` gave
/// the same one): read once on upgrade, to start the new reader where it stopped.
pub fn legacy_reader_name(namespace: &str, backend: &str) -> String {
    let clean = |s: &str| s.replace(['.', '*', '>', ' '], "_");
    format!("settle-account-{}-{}", clean(namespace), clean(backend))
}

/// FNV-1a, 64 bits: a stable hash (the name must be the same in every operator version).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// When `m`'s consumer was made, in nanoseconds (the server's clock), read once per consumer and
/// kept in `book`; None when it cannot be read (then every advisory of the name counts, as before).
async fn consumer_since(client: &async_nats::Client, book: &mut Book, m: &Member) -> Option<i128> {
    let consumer = m.consumer.clone()?;
    if let Some((seen, since)) = &book.consumer_since
        && *seen == consumer
    {
        return Some(*since);
    }
    let js = jetstream::new(client.clone());
    let stream = js.get_stream(&consumer.0).await.ok()?;
    let info = stream.consumer_info(&consumer.1).await.ok()?;
    let created = serde_json::to_value(info.created).ok()?;
    let since = advisory::rfc3339_ns(created.as_str()?)?;
    book.consumer_since = Some((consumer, since));
    Some(since)
}

#[cfg(test)]
mod reader_tests {
    use super::*;

    #[test]
    fn two_backends_whose_legacy_reader_names_met_get_distinct_readers() {
        // The two pairs the legacy name could not tell apart, and one with dots.
        assert_eq!(
            legacy_reader_name("team", "a-nats"),
            legacy_reader_name("team-a", "nats")
        );
        assert_ne!(reader_name("team", "a-nats"), reader_name("team-a", "nats"));
        assert_eq!(reader_name("team-a", "nats"), "settle-account_team-a_nats");
        assert_ne!(reader_name("team", "a.nats"), reader_name("team", "a-nats"));
        assert_ne!(
            reader_name("team-a", "b.nats"),
            reader_name("team", "a-b.nats")
        );
    }

    #[test]
    fn a_reader_name_fits_nats_whatever_the_backend_name() {
        let long = format!("{}.{}", "b".repeat(200), "c".repeat(52));
        let other = format!("{}.{}", "b".repeat(200), "d".repeat(52));
        let ns = "n".repeat(63);
        for backend in [long.as_str(), other.as_str(), "nats", "a.b.c"] {
            let name = reader_name(&ns, backend);
            assert!(name.len() <= MAX_READER_NAME, "{name}");
            assert!(
                !name.contains(['.', '*', '>', ' ', '/', '\\']),
                "{name} is not a NATS name"
            );
        }
        assert_ne!(reader_name(&ns, &long), reader_name(&ns, &other));
        // The hashed form cannot be any short name's: no Backend name maps to `__`.
        assert!(reader_name(&ns, &long).contains("__"));
        assert!(!reader_name(&ns, "a.b.c").contains("__"));
    }
}
