//! What a NATS keeper counts as it comes: a runtime's report from the `settle-stats` bucket
//! (judged under its own key and within the account's bounds, held back while its Subscription
//! is not in the cache yet), a delivery advisory from the capture (a loss counted only through
//! the consumer the controller verified, never an earlier consumer's of the same name), and
//! the advisories the capture dropped before they were read; the reports held back and the loss
//! advisories held unverified are tried again each round (a Subscription told when advisories of
//! its consumer were dropped unverified).
//!
//! It must not save or acknowledge anything (that is `settle`), nor decide counts (that is the
//! ledger).

use std::time::Instant;

use async_nats::jetstream::{self, kv};
use futures::StreamExt;

use super::{
    Book, Books, Held, Member, Members, NatsKeeper, SubKey, UNVERIFIED_ADVISORIES, Uncounted,
    ack_with_book, broken,
};
use crate::account::early::EarlyHold;
use crate::account::ledger::{Account, BrokerOutcome, Outcome};
use settle::backend::nats::admin::NatsError;
use settle::backend::nats::advisory::{self, ChangeKind, DeliveryEvent, DeliveryKind};
use settle::bus::report::now_ms;
use settle::bus::report::{StatsReport, report_key};

impl NatsKeeper {
    /// Counts advisories the capture dropped before they were read, on every book of this
    /// Backend (any of them may have lost a message no handler saw).
    pub(super) async fn missed(
        &self,
        books: &mut Books,
        members: &Members,
        ledgers: &kv::Store,
        missed: u64,
    ) -> Result<(), NatsError> {
        tracing::warn!(backend = %format!("{}/{}", self.backend.0, self.backend.1), missed, "advisories were dropped from the capture stream before the account read them");
        self.metrics
            .capture_gap
            .with_label_values(&[&format!("{}/{}", self.backend.0, self.backend.1)])
            .inc_by(missed);
        for (key, m) in members.iter() {
            let book = self.book(ledgers, books, key, m).await?;
            book.showing.trouble.missed_advisories += missed;
            book.missed_at_ms = now_ms();
            book.dirty = true;
        }
        Ok(())
    }

    /// Counts one report. Returns it when its Subscription is not (yet) one of this Backend's,
    /// to be tried again.
    pub(super) async fn on_report(
        &self,
        ledgers: &kv::Store,
        members: &Members,
        books: &mut Books,
        entry: kv::Entry,
    ) -> Result<Option<kv::Entry>, NatsError> {
        let report = match self.read_report(&entry).await {
            Ok(report) => report,
            Err(Some(reason)) => {
                self.said_dropped(ledgers, members, books, &entry.key, reason)
                    .await?;
                return Ok(None);
            }
            Err(None) => return Ok(None),
        };
        let key = (report.namespace.clone(), report.subscription.clone());
        // Another Backend's Subscription, a subscription defined in code only, or one the cache
        // has not seen yet: kept to be tried again while it is in this Backend's namespace.
        let Some(member) = members.get(&key) else {
            return Ok(self.not_member(&report, &key, entry).await);
        };
        // A report of the object that now holds the name, while this round's members still
        // name the one before (it was deleted and applied again meanwhile): tried again next
        // round, never dropped.
        if report.subscription_uid.is_some()
            && report.subscription_uid.as_deref() != member.uid()
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
            book.showing.trouble.report_dropped(why, now_ms());
            tracing::warn!(key = %entry.key, reason = why, "a stats report past the account's bounds (--max-instances-per-subscription, the instance name's length): dropped");
            return Ok(None);
        }
        self.count_report(book, &report, &entry).await;
        Ok(None)
    }

    /// A report put in the bucket, read: None when it is a deletion, too large, unreadable or
    /// misfiled (a body naming another Subscription or instance than its key), then counted in
    /// `settle_account_reports_total` and dropped.
    /// A report of no member of this Backend: dropped when its Subscription is gone (it was
    /// bound to an operator's consumer once, or its instance has been silent for
    /// `--fold-after`), else returned to be tried again while it is in this Backend's namespace.
    async fn not_member(
        &self,
        report: &StatsReport,
        key: &SubKey,
        entry: kv::Entry,
    ) -> Option<kv::Entry> {
        if report.namespace != self.backend.0 {
            return None;
        }
        let fold_after = u64::try_from(self.config.fold_after.as_millis()).unwrap_or(u64::MAX);
        // Bound to an operator's consumer once, and that Subscription is gone; or of no
        // Subscription, its instance silent for longer than an idle one is kept (a stopped
        // code-defined subscription's, or junk: it would fill the bucket).
        let gone = self.cached(&key.0, &key.1).is_none()
            && (report.subscription_uid.is_some()
                || now_ms().saturating_sub(report.reported_at_ms) >= fold_after);
        if gone {
            self.metrics.reports.with_label_values(&["gone"]).inc();
            let _ = self.drop_report(&entry.key, entry.revision).await;
            return None;
        }
        Some(entry)
    }

    /// Counts a report within the bounds into its book, with its outcome in
    /// `settle_account_reports_total`; an earlier object's report is dropped from the bucket.
    async fn count_report(&self, book: &mut Book, report: &StatsReport, entry: &kv::Entry) {
        let before = kept(&book.account);
        let label = match book.account.report(report) {
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
                let _ = self.drop_report(&entry.key, entry.revision).await;
                "other_object"
            }
            Outcome::Stale => {
                // A folded life's report, read again (a new session's replay): removed once the
                // loss window since it was written has passed.
                if book
                    .account
                    .persisted()
                    .folded
                    .contains_key(&report.instance)
                {
                    let book_key = (report.namespace.clone(), report.subscription.clone());
                    self.purge_folded_later(
                        vec![(book_key, entry.key.clone(), entry.revision)],
                        report.reported_at_ms,
                    );
                }
                "stale"
            }
            Outcome::UnknownVersion => {
                tracing::warn!(key = %entry.key, version = report.version, "a stats report of a version this operator does not know: skipped (upgrade the operator)");
                "unknown_version"
            }
        };
        self.metrics.reports.with_label_values(&[label]).inc();
    }

    /// An advisory read from the capture: advisories the capture dropped before it are
    /// noted, then it is counted, held (its consumer not verified yet) or acknowledged loose.
    pub(super) async fn read_advisory(
        &self,
        ledgers: &kv::Store,
        members: &Members,
        books: &mut Books,
        held: &mut Held,
        read_to: &mut u64,
        msg: jetstream::Message,
    ) -> Result<(), NatsError> {
        let info = msg.info().ok();
        if let Some(info) = &info {
            tracing::debug!(subject = %msg.subject, capture_seq = info.stream_sequence, delivered = info.delivered, "an advisory read");
        }
        if let Some(info) = info
            && info.delivered == 1
            && info.stream_sequence > *read_to
        {
            let missed = info.stream_sequence.saturating_sub(*read_to + 1);
            if missed > 0 && *read_to > 0 {
                self.missed(books, members, ledgers, missed).await?;
            }
            *read_to = info.stream_sequence;
        }
        match self.on_advisory(ledgers, members, books, &msg).await? {
            Applied::Book(key) => ack_with_book(books, &mut held.loose, &key, msg),
            Applied::Unverified(event) if held.unverified.len() < UNVERIFIED_ADVISORIES => {
                self.metrics
                    .advisories
                    .with_label_values(&["held_unverified"])
                    .inc();
                held.unverified.push((Instant::now(), msg, event));
            }
            Applied::Unverified(event) => {
                self.metrics
                    .advisories
                    .with_label_values(&["unverified_dropped"])
                    .inc();
                tracing::warn!(stream = %event.stream, consumer = %event.consumer, stream_seq = event.stream_seq, held = UNVERIFIED_ADVISORIES, "a loss advisory of a consumer whose Subscription is not verified yet, with the most held already: dropped");
                held.uncounted.note(&event);
                held.loose.push(msg);
            }
            Applied::Nothing => held.loose.push(msg),
        }
        Ok(())
    }

    /// The held loss advisories tried again: counted, held on within the grace, or dropped.
    pub(super) async fn retry_unverified(
        &self,
        ledgers: &kv::Store,
        members: &Members,
        books: &mut Books,
        held: &mut Held,
    ) -> Result<(), NatsError> {
        for (since, msg, event) in std::mem::take(&mut held.unverified) {
            let capture_seq = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
            match self
                .on_delivery(ledgers, members, books, capture_seq, event)
                .await?
            {
                Applied::Book(key) => ack_with_book(books, &mut held.loose, &key, msg),
                Applied::Unverified(event) if since.elapsed() < self.config.unverified_grace => {
                    held.unverified.push((since, msg, event));
                }
                Applied::Unverified(event) => {
                    self.metrics
                        .advisories
                        .with_label_values(&["unverified_dropped"])
                        .inc();
                    tracing::warn!(stream = %event.stream, consumer = %event.consumer, stream_seq = event.stream_seq, grace = ?self.config.unverified_grace, "a loss advisory whose Subscription's status named no consumer within the grace: counted for none");
                    held.uncounted.note(&event);
                    held.loose.push(msg);
                }
                // The status now names another consumer (another stream's of this name): not
                // this Backend's loss, so not a drop either.
                Applied::Nothing => {
                    self.metrics
                        .advisories
                        .with_label_values(&["unverified_not_ours"])
                        .inc();
                    held.loose.push(msg);
                }
            }
        }
        Ok(())
    }

    /// A Subscription whose status now names a consumer of dropped advisories is told.
    pub(super) async fn tell_uncounted(
        &self,
        ledgers: &kv::Store,
        members: &Members,
        books: &mut Books,
        uncounted: &mut Uncounted,
    ) -> Result<(), NatsError> {
        for (key, n) in uncounted.claimed(members) {
            let Some(m) = members.get(&key) else { continue };
            let book = self.book(ledgers, books, &key, m).await?;
            book.showing.trouble.missed_advisories += n;
            book.missed_at_ms = now_ms();
            book.dirty = true;
            tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), missed = n, "loss advisories of this Subscription's consumer were dropped before its status named it: Accounted says they may be missing");
        }
        Ok(())
    }

    /// The early reports tried again: those whose Subscription is still not cached stay.
    pub(super) async fn retry_early(
        &self,
        ledgers: &kv::Store,
        members: &Members,
        books: &mut Books,
        early: &mut EarlyHold<kv::Entry>,
    ) -> Result<(), NatsError> {
        for entry in early.take_all() {
            if let Some(entry) = self.on_report(ledgers, members, books, entry).await? {
                self.hold_early(early, entry);
            }
        }
        self.metrics
            .early_bytes
            .set(i64::try_from(self.config.limits.early.held_bytes()).unwrap_or(i64::MAX));
        Ok(())
    }

    /// A book read anew: its ledger from the bucket, and every live report of its Subscription
    /// from the report bucket (the watch has passed them; they are cumulative, so reading them
    /// again counts each once).
    pub(super) async fn rebuild(
        &self,
        ledgers: &kv::Store,
        reports: &kv::Store,
        members: &Members,
        books: &mut Books,
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

    /// Applies one advisory: the Subscription whose book it changed (its acknowledgement waits
    /// for that book's save), a loss waiting for its Subscription's consumer to be verified, or
    /// nothing of this Backend's.
    pub(super) async fn on_advisory(
        &self,
        ledgers: &kv::Store,
        members: &Members,
        books: &mut Books,
        msg: &jetstream::Message,
    ) -> Result<Applied, NatsError> {
        let capture_seq = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
        let subject = msg.subject.as_str();
        // Only the consumer the controller verified as a Subscription's counts for it
        // (`members.owner`: an index, where a search of every Subscription per advisory had made
        // a mass apply of N Subscriptions, each announcing its consumer, cost N² comparisons).
        if let Some(change) = advisory::parse(subject, &msg.payload) {
            self.metrics
                .advisories
                .with_label_values(&["consumer_change"])
                .inc();
            if change.kind == ChangeKind::Created
                && let Some((key, m)) = members.owner(&change.stream, &change.consumer)
            {
                let book = self.book(ledgers, books, key, m).await?;
                book.account.consumer_recreated();
                book.consumer_since = None;
                book.dirty = true;
                return Ok(Applied::Book(key.clone()));
            }
            return Ok(Applied::Nothing);
        }
        let Some(event) = advisory::parse_delivery(subject, &msg.payload) else {
            return Ok(Applied::Nothing);
        };
        self.metrics
            .advisories
            .with_label_values(&[label(event.kind)])
            .inc();
        self.on_delivery(ledgers, members, books, capture_seq, event)
            .await
    }

    /// Applies one delivery advisory (read now, or held since for its Subscription's consumer
    /// to be verified).
    pub(super) async fn on_delivery(
        &self,
        ledgers: &kv::Store,
        members: &Members,
        books: &mut Books,
        capture_seq: u64,
        event: DeliveryEvent,
    ) -> Result<Applied, NatsError> {
        let Some((key, m)) = members.owner(&event.stream, &event.consumer) else {
            // A Subscription the controller has not checked yet would make a consumer of this
            // name: it may have made it, its status saying so not in the cache yet. Held, not
            // dropped (a last attempt that ran out within seconds of the consumer's making had
            // been lost so).
            if members.awaits(&event.consumer) && event.kind != DeliveryKind::Naked {
                return Ok(Applied::Unverified(event));
            }
            return Ok(Applied::Nothing);
        };
        let kind = label(event.kind);
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
                return Ok(Applied::Nothing);
            }
            if book
                .account
                .broker_exhausted_message(capture_seq, event.stream_seq)
                == BrokerOutcome::Counted
            {
                tracing::debug!(subscription = %format!("{}/{}", key.0, key.1), stream_seq = event.stream_seq, %kind, "a message ran out of attempts");
            }
            book.dirty = true;
            return Ok(Applied::Book(key.clone()));
        }
        Ok(Applied::Nothing)
    }
}

/// A delivery advisory's kind, as the metric and the log name it.
fn label(kind: DeliveryKind) -> &'static str {
    match kind {
        DeliveryKind::MaxDeliveries => "max_deliveries",
        DeliveryKind::Terminated => "terminated",
        DeliveryKind::Naked => "naked",
    }
}

/// What an advisory did.
pub(super) enum Applied {
    /// It changed this Subscription's book: acknowledged once the book is saved.
    Book(SubKey),
    /// A loss of a consumer a Subscription would make and whose status names none yet: held and
    /// tried again each round (`Unverified`, in the keeper).
    Unverified(DeliveryEvent),
    /// Nothing of this Backend's: acknowledged at the next round.
    Nothing,
}

/// What of an account is persisted and a report can change (to tell when to save).
pub(super) fn kept(
    account: &Account,
) -> (
    settle::api::ConsumerStats,
    settle::api::ConsumerStats,
    usize,
) {
    let p = account.persisted();
    (
        p.retired,
        p.offset,
        p.lost.as_ref().map_or(0, |l| l.known.len()),
    )
}

/// Since when `m`'s consumer counts for its object, in nanoseconds: the later of when it was
/// made (the server's clock, read once per consumer and kept in `book`) and when the object was
/// (a consumer taken over is older than its object); None when it cannot be read (then every
/// advisory of the name counts).
pub(super) async fn consumer_since(
    client: &async_nats::Client,
    book: &mut Book,
    m: &Member,
) -> Option<i128> {
    let (stream_name, consumer) = m.consumer()?;
    if let Some(((s, c), since)) = &book.consumer_since
        && (s.as_str(), c.as_str()) == (stream_name, consumer)
    {
        return Some(*since);
    }
    let js = jetstream::new(client.clone());
    let stream = js.get_stream(stream_name).await.ok()?;
    let info = stream.consumer_info(consumer).await.ok()?;
    // Read off the time itself: serialized alone (no human-readable serde for `time`), it is a
    // tuple, not RFC 3339 text, and read as text it gave nothing, so every advisory of the name
    // counted (the earlier object's too: account_life's recreate-while-down failed so).
    // A consumer older than the object (taken over with `spec.adopt` or `settle.dev/adopt`,
    // a NACK consumer migrated through a new Backend) lost what it lost before the object
    // existed for its earlier owner: the object's creation bounds it too. Its whole seconds
    // are rounded down, so a loss of the object's first second is never left out.
    let object = m
        .sub
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or(0, |t| t.0.as_nanosecond());
    let since = info.created.unix_timestamp_nanos().max(object);
    book.consumer_since = Some(((stream_name.to_string(), consumer.to_string()), since));
    Some(since)
}
