//! One NATS Backend's account keeper. It reads two sources and keeps one ledger per
//! Subscription of that Backend:
//!
//! - the runtime's stats reports (the `settle-stats` bucket, latest value per instance, then
//!   every update), and
//! - the broker's delivery advisories, from the operator's capture stream through this
//!   Backend's durable reader (its checkpoint: nothing is missed while the operator is down).
//!
//! Twice a second it folds idle instances, persists the ledgers that changed (bucket
//! `settle-account`), and only then acknowledges the advisories it applied, so a restart
//! re-applies nothing twice (the ledger skips a capture sequence it already counted). It reads
//! the broker's gauges once per stats interval and hands the writer a status patch when what the
//! Subscription shows differs from the account, at most once per stats interval.
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
use super::ledger::{Account, BrokerOutcome, Outcome, Persisted};
use super::metrics::Metrics;
use super::show::{self, Showing};
use super::status::LossLog;
use super::writer::Writer;
use crate::api::{Subscription, SubscriptionStats};
use crate::backend::nats::advisory::{self, ChangeKind, DeliveryKind};
use crate::backend::nats::capture;
use crate::backend::nats::consumer::consumer_name;
use crate::backend::nats::jsapi::{self, NatsError};
use crate::bus::report::{StatsReport, now_ms, report_key};
use crate::policy::ResolvedPolicy;

/// How often the keeper folds, persists, acknowledges and decides what to write: a change
/// reaches status within the stats interval plus this (and the write).
const TICK: Duration = Duration::from_millis(500);

/// Reports held back for a Subscription not in the cache yet, at most.
const EARLY_REPORTS: usize = 10_000;

/// A Subscription, by namespace and name.
type SubKey = (String, String);

/// What is persisted per Subscription.
#[derive(Default, Serialize, Deserialize)]
struct Saved {
    ledger: Persisted,
    loss: LossLog,
}

/// One Subscription's account as the keeper holds it.
struct Book {
    account: Account,
    showing: Showing,
    /// Something persisted changed since the last save.
    dirty: bool,
    /// The bucket revision of each live instance's latest report (to drop folded ones).
    revisions: HashMap<String, u64>,
    gauges: (u64, u64),
    gauges_at: Option<Instant>,
}

/// A Subscription of this Backend, as the advisories name its consumer.
struct Member {
    sub: Arc<Subscription>,
    stream: Option<String>,
    consumer: String,
    max_deliver: Option<u32>,
}

pub struct Keeper {
    backend: SubKey,
    client: async_nats::Client,
    subs: Store<Subscription>,
    writer: Writer,
    config: Config,
    metrics: Metrics,
    unseen_attempts: bool,
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
        unseen_attempts: bool,
    ) -> Keeper {
        Keeper {
            backend,
            client,
            subs,
            writer,
            config,
            metrics,
            unseen_attempts,
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
        let clean = |s: &str| s.replace(['.', '*', '>', ' '], "_");
        format!(
            "settle-account-{}-{}",
            clean(&self.backend.0),
            clean(&self.backend.1)
        )
    }

    /// The Subscriptions of this Backend now, by consumer.
    fn members(&self) -> HashMap<SubKey, Member> {
        let mut out = HashMap::new();
        for sub in self.subs.state() {
            let ns = sub.namespace().unwrap_or_default();
            if ns != self.backend.0 || sub.spec.backend_ref.name != self.backend.1 {
                continue;
            }
            let name = sub.name_any();
            let policy = ResolvedPolicy::resolve(&sub.spec.policy);
            let known = sub.status.as_ref().and_then(|s| s.consumer.clone());
            let member = Member {
                stream: known.as_ref().map(|c| c.stream.clone()),
                consumer: known.map_or_else(|| consumer_name(&ns, &name, &policy), |c| c.name),
                max_deliver: policy.max_deliver,
                sub,
            };
            out.insert((ns, name), member);
        }
        out
    }

    async fn session(&self) -> Result<(), NatsError> {
        let js = jetstream::new(self.client.clone());
        let reports = capture::reports(&js).await?;
        let ledgers = capture::ledgers(&js).await?;
        let reader = capture::open(&js, &self.reader()).await?;
        let mut watch = reports
            .watch_with_history(">")
            .await
            .map_err(|e| broken("watching the report bucket", e))?;
        let mut advisories = reader
            .messages()
            .await
            .map_err(|e| broken("reading the advisory capture", e))?;
        tracing::info!(backend = %format!("{}/{}", self.backend.0, self.backend.1), reader = %self.reader(), "account keeper started");

        let mut books: HashMap<SubKey, Book> = HashMap::new();
        let mut members = self.members();
        // Reports of Subscriptions not in the cache yet (applied and the app reported first).
        let mut early: HashMap<String, kv::Entry> = HashMap::new();
        let mut acks: Vec<jetstream::Message> = Vec::new();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                entry = watch.next() => {
                    let entry = entry
                        .ok_or_else(|| broken("the report watch", "ended"))?
                        .map_err(|e| broken("the report watch", e))?;
                    if let Some(entry) = self.on_report(&ledgers, &members, &mut books, entry).await?
                        && early.len() < EARLY_REPORTS
                    {
                        early.insert(entry.key.clone(), entry);
                    }
                }
                msg = advisories.next() => {
                    let msg = msg
                        .ok_or_else(|| broken("the advisory capture", "ended"))?
                        .map_err(|e| broken("the advisory capture", e))?;
                    self.on_advisory(&ledgers, &members, &mut books, &msg).await?;
                    acks.push(msg);
                }
                _ = tick.tick() => {
                    members = self.members();
                    for (_, entry) in std::mem::take(&mut early) {
                        if let Some(entry) = self.on_report(&ledgers, &members, &mut books, entry).await? {
                            early.insert(entry.key.clone(), entry);
                        }
                    }
                    self.settle(&js, &ledgers, &members, &mut books, &mut acks).await?;
                }
            }
        }
    }

    /// The book of `key`, loaded from the ledger bucket the first time.
    async fn book<'a>(
        &self,
        ledgers: &kv::Store,
        books: &'a mut HashMap<SubKey, Book>,
        key: &SubKey,
        sub: &Subscription,
    ) -> Result<&'a mut Book, NatsError> {
        if !books.contains_key(key) {
            let saved: Saved = match ledgers
                .get(ledger_key(key))
                .await
                .map_err(|e| broken("reading a ledger", e))?
            {
                Some(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                    tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), error = %e, "a persisted ledger is unreadable: starting from what status shows");
                    Saved::default()
                }),
                None => Saved::default(),
            };
            let floor = sub
                .status
                .as_ref()
                .and_then(|s| s.stats.as_ref())
                .map(|s| s.counters)
                .unwrap_or_default();
            let mut loss = saved.loss;
            loss.observe(now_ms(), floor.exhausted, self.config.loss_window);
            books.insert(
                key.clone(),
                Book {
                    account: Account::resume(saved.ledger, floor),
                    showing: Showing {
                        loss,
                        last_write: None,
                    },
                    dirty: false,
                    revisions: HashMap::new(),
                    gauges: (0, 0),
                    gauges_at: None,
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
        let key = (report.namespace.clone(), report.subscription.clone());
        // Another Backend's Subscription, a subscription defined in code only, or one the cache
        // has not seen yet: kept to be tried again while it is in this Backend's namespace.
        let Some(member) = members.get(&key) else {
            return Ok((report.namespace == self.backend.0).then_some(entry));
        };
        let book = self.book(ledgers, books, &key, &member.sub).await?;
        let label = match book.account.report(&report) {
            Outcome::Counted => {
                book.revisions
                    .insert(report.instance.clone(), entry.revision);
                "counted"
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

    async fn on_advisory(
        &self,
        ledgers: &kv::Store,
        members: &HashMap<SubKey, Member>,
        books: &mut HashMap<SubKey, Book>,
        msg: &jetstream::Message,
    ) -> Result<(), NatsError> {
        let capture_seq = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
        let subject = msg.subject.as_str();
        let owner = |stream: &str, consumer: &str| {
            members.iter().find(|(_, m)| {
                m.consumer == consumer && m.stream.as_deref().is_none_or(|s| s == stream)
            })
        };
        if let Some(change) = advisory::parse(subject, &msg.payload) {
            if change.kind == ChangeKind::Created
                && let Some((key, m)) = owner(&change.stream, &change.consumer)
            {
                let book = self.book(ledgers, books, key, &m.sub).await?;
                book.account.consumer_recreated();
                book.dirty = true;
            }
            self.metrics
                .advisories
                .with_label_values(&["consumer_change"])
                .inc();
            return Ok(());
        }
        let Some(event) = advisory::parse_delivery(subject, &msg.payload) else {
            return Ok(());
        };
        let kind = match event.kind {
            DeliveryKind::MaxDeliveries => "max_deliveries",
            DeliveryKind::Terminated => "terminated",
            DeliveryKind::Naked => "naked",
        };
        self.metrics.advisories.with_label_values(&[kind]).inc();
        let Some((key, m)) = owner(&event.stream, &event.consumer) else {
            return Ok(());
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
            let book = self.book(ledgers, books, key, &m.sub).await?;
            if book
                .account
                .broker_exhausted_message(capture_seq, event.stream_seq)
                == BrokerOutcome::Counted
            {
                tracing::debug!(subscription = %format!("{}/{}", key.0, key.1), stream_seq = event.stream_seq, %kind, "a message ran out of attempts");
            }
            book.dirty = true;
        }
        Ok(())
    }

    /// Every tick: fold, persist, acknowledge, gauges, status.
    async fn settle(
        &self,
        js: &jetstream::Context,
        ledgers: &kv::Store,
        members: &HashMap<SubKey, Member>,
        books: &mut HashMap<SubKey, Book>,
        acks: &mut Vec<jetstream::Message>,
    ) -> Result<(), NatsError> {
        // Every Subscription of this Backend has a book, so each shows its counters.
        for (key, m) in members {
            self.book(ledgers, books, key, &m.sub).await?;
        }
        // Deleted Subscriptions: their ledger and reports go with them.
        let gone: Vec<SubKey> = books
            .keys()
            .filter(|k| !members.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            if let Some(book) = books.remove(&key) {
                for revision in book.revisions.values() {
                    let _ = capture::drop_report(js, *revision).await;
                }
                let _ = ledgers.purge(ledger_key(&key)).await;
                self.metrics.forget(&key.0, &key.1);
                tracing::info!(subscription = %format!("{}/{}", key.0, key.1), "the Subscription is gone: its account is dropped");
            }
        }

        let now = now_ms();
        let fold_after = u64::try_from(self.config.fold_after.as_millis()).unwrap_or(u64::MAX);
        let mut dropped = Vec::new();
        for book in books.values_mut() {
            for instance in book.account.fold_idle(now, fold_after) {
                book.dirty = true;
                if let Some(r) = book.revisions.remove(&instance) {
                    dropped.push(r);
                }
            }
        }
        // Persist, then acknowledge: an advisory is never acknowledged before what it counted
        // is saved.
        for (key, book) in books.iter_mut().filter(|(_, b)| b.dirty) {
            let saved = Saved {
                ledger: book.account.persisted().clone(),
                loss: book.showing.loss.clone(),
            };
            let body = serde_json::to_vec(&saved).map_err(|e| broken("encoding a ledger", e))?;
            ledgers
                .put(ledger_key(key), body.into())
                .await
                .map_err(|e| broken("saving a ledger", e))?;
            book.dirty = false;
        }
        for msg in acks.drain(..) {
            if let Err(e) = msg.ack().await {
                tracing::debug!(error = %e, "acknowledging an advisory failed: it comes again and is skipped then");
            }
        }
        for revision in dropped {
            if let Err(e) = capture::drop_report(js, revision).await {
                tracing::debug!(error = %e, "dropping a folded report failed (it is counted once all the same)");
            }
        }

        let interval = self.config.stats_interval;
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
                if let (Some(stream), Some(_)) = (&m.stream, m.sub.status.as_ref()) {
                    match jsapi::consumer_info(js, stream, &m.consumer).await {
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
                }
            }
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

/// A Subscription's key in the ledger bucket.
fn ledger_key(key: &SubKey) -> String {
    report_key(&key.0, &key.1, "ledger")
}
