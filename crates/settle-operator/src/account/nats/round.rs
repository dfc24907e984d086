//! A NATS keeper's round, every tick: a book for every Subscription of the Backend, a lost
//! source found once the report replay is complete (semantics C17), a deleted Subscription's
//! ledger and reports removed, idle instances folded (only when the keeper could hear them:
//! `watch`), the ledgers that changed saved (checked
//! against the revision read, so two operators cannot overwrite each other) and only then their
//! advisories acknowledged, a folded instance's report removed once the loss window has passed
//! and the ledger holding the fold is saved (until then it shows a lost ledger which lives it
//! held), the consumers' gauges read once per stats interval, and the account shown through
//! `show`.
//!
//! It must not count (that is `count` and the ledger) nor write status itself (that is the
//! writer).

use std::collections::HashMap;
use std::time::Instant;

use async_nats::jetstream::{self, kv};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use super::names::ledger_key;
use super::store::Save;
use super::watch::{Heard, Hearing};
use super::{Book, Books, FoldedReport, Members, NatsKeeper, SubKey};
use crate::account::ledger::Source;
use crate::account::show;
use settle::api::SubscriptionStats;
use settle::backend::nats::admin::{self, NatsError};
use settle::backend::nats::capture;
use settle::bus::report::{now_ms, report_key};

/// A stream's gauge listing: None when it failed, Some(None) when the stream is gone.
type Listing = Option<Option<HashMap<String, (u64, u64)>>>;

impl NatsKeeper {
    /// Every tick: fold, persist, acknowledge, gauges, status.
    pub(super) async fn settle(
        &self,
        js: &jetstream::Context,
        ledgers: &kv::Store,
        reports: &kv::Store,
        members: &Members,
        books: &mut Books,
        hearing: &mut Hearing,
    ) -> Result<(), NatsError> {
        // Every Subscription of this Backend has a book, so each shows its counters.
        for (key, m) in members.iter() {
            self.book(ledgers, books, key, m).await?;
        }
        // Every report there was is counted now: what status shows and they do not explain was
        // lost with a source (C17).
        if hearing.replayed {
            self.recover_lost(members, books);
        }
        self.drop_gone(js, ledgers, members, books).await;

        let now = now_ms();
        let dropped = match self.listen(js, reports, books, hearing).await {
            Heard::All => self.fold_idle(books, now),
            Heard::NotYet | Heard::Deaf => Vec::new(),
        };
        let lost_race = self.save_then_ack(ledgers, members, books).await;
        // Another operator wrote a ledger since this one read it (a leader handover): this
        // book is read again from the bucket, its unacknowledged advisories come back.
        for key in lost_race {
            tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), "the ledger was written by another writer meanwhile: reading it and the Subscription's reports again");
            books.remove(&key);
            self.rebuild(ledgers, reports, members, books, &key).await?;
        }
        self.purge_folded_later(dropped, now);
        self.purge_folded_due(js, books, now).await;

        let stamp = Time(Timestamp::now());
        let listed = self.list_due_streams(js, members, books).await;
        self.gauges_and_show(js, members, books, &listed, now, &stamp)
            .await;
        Ok(())
    }

    /// The reports of instances folded now, kept in the bucket for the loss window: a ledger
    /// lost meanwhile is found with those lives known (semantics C17), so a folded life that
    /// comes back is not charged against the offset for what it counts after the loss.
    pub(super) fn purge_folded_later(&self, folded: Vec<(SubKey, String, u64)>, now: u64) {
        if folded.is_empty() {
            return;
        }
        if let Ok(mut later) = self.folded_reports.lock() {
            later.extend(
                folded
                    .into_iter()
                    .map(|(book, report, revision)| FoldedReport {
                        at: now,
                        book,
                        report,
                        revision,
                    }),
            );
        }
    }

    /// Removes the folded reports whose loss window has passed (each only if not written since:
    /// a life back after its fold keeps its report), and only once their book's ledger, which
    /// holds the fold, is saved: while its saves fail the report is the fold's only record.
    async fn purge_folded_due(&self, js: &jetstream::Context, books: &Books, now: u64) {
        let window = u64::try_from(self.config.loss_window.as_millis()).unwrap_or(u64::MAX);
        let due: Vec<FoldedReport> = match self.folded_reports.lock() {
            Ok(mut later) => {
                let (due, keep) = std::mem::take(&mut *later).into_iter().partition(|f| {
                    now.saturating_sub(f.at) >= window
                        && !books.get(&f.book).is_some_and(|b| b.dirty)
                });
                *later = keep;
                due
            }
            Err(_) => return,
        };
        for f in due {
            if let Err(e) = capture::drop_report(js, &f.report, f.revision).await {
                tracing::debug!(error = %e, "dropping a folded report failed (it is counted once all the same)");
            }
        }
    }

    /// Each book's first check after the replay: a source lost is counted on from what status
    /// showed (an offset).
    fn recover_lost(&self, members: &Members, books: &mut Books) {
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

    /// Deleted Subscriptions: their ledger and reports go with them. Every member has a book
    /// now, so there is one to find only when there are more books than members.
    async fn drop_gone(
        &self,
        js: &jetstream::Context,
        ledgers: &kv::Store,
        members: &Members,
        books: &mut Books,
    ) {
        let gone: Vec<SubKey> = if books.len() > members.len() {
            books
                .keys()
                .filter(|k| !members.contains_key(k))
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
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
    }

    /// Whether instances may be folded this round: the keeper looks whether it could hear
    /// every quarter of `--fold-after` ([`Hearing`]), and at once when its client is not
    /// connected. While the last look says it could not, every book's silence starts again
    /// each round (silence the keeper could not hear is no sign that an instance died, C16),
    /// and nothing is folded.
    async fn listen(
        &self,
        js: &jetstream::Context,
        reports: &kv::Store,
        books: &mut Books,
        hearing: &mut Hearing,
    ) -> Heard {
        let now = Instant::now();
        if js.client().connection_state() != async_nats::connection::State::Connected {
            hearing.disconnected(now);
        } else if hearing.due(now, Hearing::every(self.config.fold_after)) {
            self.look(reports, hearing).await;
        }
        let heard = hearing.verdict();
        if heard == Heard::Deaf {
            let now = now_ms();
            for book in books.values_mut() {
                book.account.deaf_until(now);
            }
        }
        heard
    }

    /// Folds idle instances; returns the reports (key, revision) to drop once saved.
    fn fold_idle(&self, books: &mut Books, now: u64) -> Vec<(SubKey, String, u64)> {
        let fold_after = u64::try_from(self.config.fold_after.as_millis()).unwrap_or(u64::MAX);
        let mut dropped = Vec::new();
        for (key, book) in books.iter_mut() {
            let folded = book.account.fold_idle(now, fold_after);
            self.metrics
                .folded(&format!("{}/{}", key.0, key.1), &folded);
            for (instance, _) in folded {
                book.dirty = true;
                if let Some(r) = book.revisions.remove(&instance) {
                    dropped.push((key.clone(), report_key(&key.0, &key.1, &instance), r));
                }
            }
        }
        dropped
    }

    /// Persist, then acknowledge: an advisory is never acknowledged before what it counted
    /// is saved. A save that fails holds back that book's advisories only. Returns the books
    /// whose save lost a race to another writer.
    async fn save_then_ack(
        &self,
        ledgers: &kv::Store,
        members: &Members,
        books: &mut Books,
    ) -> Vec<SubKey> {
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
                                self.writer.event(&m.sub, true, crate::account::status::reasons::LEDGER_NOT_SAVED, format!("the account's ledger cannot be saved on the broker ({why}); counts are still shown and nothing is lost meanwhile"));
                            }
                        }
                        book.showing.trouble.unsaved = Some(why);
                        continue;
                    }
                }
            }
            // Taken, not drained: a drained Vec keeps its buffer, and a book's advisories
            // (each message holds its JetStream context) had kept 6.7 KiB a Subscription at rest.
            for msg in std::mem::take(&mut book.acks) {
                if let Err(e) = msg.ack().await {
                    tracing::debug!(error = %e, "acknowledging an advisory failed: it comes again and is skipped then");
                }
            }
        }
        lost_race
    }

    /// Gauges: each Subscription's once per interval. A stream with a book due is listed
    /// whole (256 consumers a call) and every book on it takes its gauges from that listing:
    /// asking each consumer had cost the broker a call per Subscription per interval, 1,000
    /// calls a second at rest for 10,000 Subscriptions.
    async fn list_due_streams<'m>(
        &self,
        js: &jetstream::Context,
        members: &'m Members,
        books: &Books,
    ) -> HashMap<&'m str, Listing> {
        let interval = self.config.stats_interval;
        let due = |book: &Book| book.gauges_at.is_none_or(|t| t.elapsed() >= interval);
        let mut listed: HashMap<&str, Listing> = HashMap::new();
        for (key, book) in books.iter() {
            if let Some((stream, _)) = members.get(key).and_then(|m| m.consumer())
                && due(book)
                && !listed.contains_key(stream)
            {
                self.metrics.gauge_calls.with_label_values(&["list"]).inc();
                match admin::consumer_gauges(js, stream).await {
                    Ok(consumers) => {
                        listed.insert(stream, Some(consumers));
                    }
                    Err(e) => {
                        tracing::debug!(%stream, error = %e, "cannot list the stream's consumers for their gauges");
                        listed.insert(stream, None);
                    }
                }
            }
        }
        listed
    }

    /// Each book takes its gauges (from its stream's listing, if listed this round) and is
    /// shown.
    async fn gauges_and_show(
        &self,
        js: &jetstream::Context,
        members: &Members,
        books: &mut Books,
        listed: &HashMap<&str, Listing>,
        now: u64,
        stamp: &Time,
    ) {
        let loss_window = u64::try_from(self.config.loss_window.as_millis()).unwrap_or(u64::MAX);
        let store_full = self.store_full();
        let round = show::Round {
            writer: &self.writer,
            metrics: &self.metrics,
            config: &self.config,
            unseen_attempts: self.unseen_attempts,
            now_ms: now,
            stamp,
        };
        for (key, book) in books.iter_mut() {
            let Some(m) = members.get(key) else { continue };
            match m.consumer() {
                Some((stream, consumer)) => {
                    if let Some(listing) = listed.get(stream) {
                        book.gauges_at = Some(Instant::now());
                        self.take_gauges(js, key, book, listing, stream, consumer)
                            .await;
                    }
                }
                // Not (or no longer) its own consumer: the broker's gauges are not its.
                None => book.gauges = (0, 0),
            }
            // A gap past the loss window is past: `Accounted` describes the present (the
            // metric keeps the total).
            if book.showing.trouble.missed_advisories > 0
                && now.saturating_sub(book.missed_at_ms) >= loss_window
            {
                book.showing.trouble.missed_advisories = 0;
                book.dirty = true;
            }
            if let Some(fill) = &store_full
                && book.showing.trouble.store_full.is_none()
            {
                self.writer.event(
                    &m.sub,
                    true,
                    crate::account::status::reasons::REPORT_STORE_FULL,
                    format!(
                        "the report store is full ({fill}): the broker refuses new stats reports"
                    ),
                );
            }
            book.showing.trouble.store_full = store_full.clone();
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
    }

    /// A book's gauges from its stream's `listing`.
    async fn take_gauges(
        &self,
        js: &jetstream::Context,
        key: &SubKey,
        book: &mut Book,
        listing: &Listing,
        stream: &str,
        consumer: &str,
    ) {
        match listing {
            Some(Some(consumers)) if consumers.contains_key(consumer) => {
                book.gauges = consumers[consumer];
            }
            // The stream is gone, and its consumers with it.
            Some(None) => book.gauges = (0, 0),
            // The listing failed: the gauges shown stay, read again next interval.
            None => {}
            // Not in the listing (made or deleted meanwhile): asked on its own.
            Some(Some(_)) => {
                self.metrics.gauge_calls.with_label_values(&["info"]).inc();
                match admin::consumer_info(js, stream, consumer).await {
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
    }
}
