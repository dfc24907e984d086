//! A RabbitMQ keeper's round, once a second: idle instances folded, the snapshots that changed
//! saved, and only then the reports, registrations and dead-letter copies they hold
//! acknowledged (a book of an earlier object puts its own back instead); a deleted
//! Subscription's consumers stopped and queues deleted; the queues' gauges read once per
//! stats interval; the account shown through `show`.
//!
//! It must not count (that is `reports` and the ledger) nor write status itself (that is the
//! writer).

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::ObjectRef;
use lapin::options::{BasicAckOptions, BasicCancelOptions, BasicRejectOptions};
use lapin::types::ShortString;
use lapin::{Channel, Connection};

use super::count::tag_of;
use super::dead_letters::DeadLetters;
use super::store::{Saved, save};
use super::{Book, Broken, RabbitKeeper, TICK, broken};
use crate::account::queue_keeper::{self, SubKey, who};
use crate::account::show;
use crate::account::status::Unseen;
use settle::api::Subscription;
use settle::backend::QueueGauges;
use settle::backend::rabbitmq::{admin, report};
use settle::bus::report::now_ms;

impl RabbitKeeper {
    /// Deleted Subscriptions: their consumer stops, their report and ledger queues go.
    pub(super) async fn drop_gone(
        &self,
        conn: &Connection,
        ch: &Channel,
        dl: Option<&Channel>,
        members: &HashMap<SubKey, Arc<Subscription>>,
        books: &mut HashMap<SubKey, Book>,
    ) {
        let gone: Vec<SubKey> = books
            .keys()
            .filter(|k| !members.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            let Some(book) = books.remove(&key) else {
                continue;
            };
            // Its dead letters count for nothing any more.
            if let Some(dl) = dl {
                for tag in &book.dead_acks {
                    let _ = dl.basic_ack(*tag, BasicAckOptions::default()).await;
                }
            }
            let still = self
                .subs
                .get(&ObjectRef::new(&key.1).within(&key.0))
                .is_some();
            let queues = book.all_queues(&key);
            for q in &queues {
                let _ = ch
                    .basic_cancel(
                        ShortString::from(tag_of(q).as_str()),
                        BasicCancelOptions::default(),
                    )
                    .await;
            }
            if still {
                // Moved to another Backend: its queues are that Backend's keeper's now.
                continue;
            }
            for q in queues
                .iter()
                .chain([report::ledger_queue(&key.0, &key.1)].iter())
            {
                if let Err(e) = admin::delete(conn, q).await {
                    tracing::warn!(queue = %q, error = %e, "cannot delete a deleted Subscription's queue");
                }
            }
            self.metrics.forget(&key.0, &key.1);
            tracing::info!(subscription = %who(&key), "the Subscription is gone: its account and report queues are dropped");
            // Places in the vhost: a Subscription its max-queues refused may take them now.
            (self.freed)(&self.backend.0, &self.backend.1);
        }
    }

    /// Once a second: fold, save, acknowledge, gauges, status.
    pub(super) async fn settle(
        &self,
        conn: &Connection,
        ch: &Channel,
        saver: &Channel,
        dead: Option<&DeadLetters>,
        members: &HashMap<SubKey, Arc<Subscription>>,
        books: &mut HashMap<SubKey, Book>,
    ) -> Result<(), Broken> {
        let now = now_ms();
        let dl = dead.map(|d| &d.ch);
        self.fold_idle(books, now);
        // Save, then acknowledge: a report is never acknowledged before the snapshot holding it
        // is on the broker.
        for (key, book) in books.iter_mut() {
            if book.replaced {
                put_back(ch, dl, key, book).await;
                continue;
            }
            if book.dirty && !self.save_book(saver, members, key, book).await? {
                continue;
            }
            ack_saved(conn, ch, dl, book).await?;
        }
        // A consumer the broker cancelled (its queue deleted): saved above, opened again (and
        // the queue declared again) at the next tick.
        books.retain(|key, book| {
            if book.ended {
                tracing::warn!(subscription = %who(key), "the report queue's consumer was cancelled (the queue deleted?): opening it again");
            }
            !book.ended
        });
        self.gauges_and_show(dead, members, books, now).await;
        Ok(())
    }

    /// Folds idle instances: their report queues are retired once the snapshot is saved.
    fn fold_idle(&self, books: &mut HashMap<SubKey, Book>, now: u64) {
        let fold_after = u64::try_from(self.config.fold_after.as_millis()).unwrap_or(u64::MAX);
        for (key, book) in books.iter_mut() {
            let folded = book.account.fold_idle(now, fold_after);
            self.metrics.folded(&who(key), &folded);
            for (instance, _) in folded {
                book.dirty = true;
                let q = report::instance_queue(&key.0, &key.1, &instance);
                if book.instances.remove(&q) {
                    book.consuming.remove(&q);
                    book.retired_queues.push(q);
                }
            }
        }
    }

    /// Saves the book's snapshot to its ledger queue. Returns whether it was saved (when not,
    /// this Subscription's reports stay unacknowledged; an encoding error breaks the session).
    async fn save_book(
        &self,
        saver: &Channel,
        members: &HashMap<SubKey, Arc<Subscription>>,
        key: &SubKey,
        book: &mut Book,
    ) -> Result<bool, Broken> {
        let saved = Saved {
            ledger: book.account.snapshot(),
            loss: book.showing.loss.clone(),
            instances: book.instances.clone(),
        };
        let body = serde_json::to_vec(&saved).map_err(|e| broken("encoding a ledger", e))?;
        match save(saver, &report::ledger_queue(&key.0, &key.1), &body).await {
            Ok(()) => {
                queue_keeper::saved(
                    &self.writer,
                    &self.metrics,
                    &who(key),
                    members.get(key),
                    &mut book.showing.trouble,
                );
                book.dirty = false;
                Ok(true)
            }
            Err(e) => {
                // This Subscription's reports stay unacknowledged until it is saved;
                // every other Subscription goes on.
                queue_keeper::not_saved(
                    &self.writer,
                    &self.metrics,
                    &who(key),
                    members.get(key),
                    &mut book.showing.trouble,
                    e.to_string(),
                    "its reports stay unacknowledged until it can",
                );
                Ok(false)
            }
        }
    }

    /// Gauges (each queue's once per interval, spread over the interval's ticks) and status.
    async fn gauges_and_show(
        &self,
        dead: Option<&DeadLetters>,
        members: &HashMap<SubKey, Arc<Subscription>>,
        books: &mut HashMap<SubKey, Book>,
        now: u64,
    ) {
        let interval = self.config.stats_interval;
        let stamp = Time(Timestamp::now());
        let round = show::Round {
            writer: &self.writer,
            metrics: &self.metrics,
            config: &self.config,
            // A last attempt a crash spent is counted from the copy of the dead letters.
            unseen_attempts: match (self.unseen_attempts, dead) {
                (Unseen::Uncounted, Some(_)) => Unseen::FromDeadLetters,
                (u, _) => u,
            },
            now_ms: now,
            stamp: &stamp,
        };
        // Gauges: each queue's once per interval, spread over the interval's ticks.
        let mut budget = show::gauge_budget(books.len(), interval, TICK);
        let reader: Option<QueueGauges> = (self.queues)(&self.backend.0, &self.backend.1);
        for (key, book) in books.iter_mut() {
            let Some(sub) = members.get(key) else {
                continue;
            };
            let queue = sub.status.as_ref().and_then(|s| s.consumer.as_ref());
            if let (Some(reader), Some(queue)) = (&reader, queue)
                && book.gauges.due(&mut budget, interval)
            {
                let got = reader.read(&queue.name).await;
                book.gauges.note(&who(key), got);
            }
            book.showing.trouble.dead_letters =
                dead.and_then(|d| d.trouble(now, self.config.loss_window));
            let totals = book.counting.then(|| book.account.totals());
            if show::show_counted_or_gauges(
                &round,
                key,
                sub,
                totals,
                book.gauges.read,
                &mut book.showing,
                &mut book.gauges.written,
            ) {
                book.dirty = true;
            }
        }
    }
}

/// A book of an earlier object (replaced): nothing unsaved is dropped, back to the queues for
/// the new object's book, which counts its own and acknowledges the earlier object's
/// (registrations of report queues included); its consumers stop.
async fn put_back(ch: &Channel, dl: Option<&Channel>, key: &SubKey, book: &mut Book) {
    for tag in std::mem::take(&mut book.acks)
        .into_iter()
        .chain(std::mem::take(&mut book.foreign))
    {
        let _ = ch
            .basic_reject(tag, BasicRejectOptions { requeue: true })
            .await;
    }
    if let Some(dl) = dl {
        for tag in std::mem::take(&mut book.dead_acks) {
            let _ = dl
                .basic_reject(tag, BasicRejectOptions { requeue: true })
                .await;
        }
    }
    for q in book.all_queues(key) {
        let _ = ch
            .basic_cancel(
                ShortString::from(tag_of(&q).as_str()),
                BasicCancelOptions::default(),
            )
            .await;
    }
}

/// Once the book's snapshot is saved (or nothing changed): its reports, then its copies of
/// dead letters are acknowledged, then its folded instances' queues go.
async fn ack_saved(
    conn: &Connection,
    ch: &Channel,
    dl: Option<&Channel>,
    book: &mut Book,
) -> Result<(), Broken> {
    // Reports of another object, seen by the object's current book: an earlier
    // object's, never counted.
    for tag in std::mem::take(&mut book.acks)
        .into_iter()
        .chain(std::mem::take(&mut book.foreign))
    {
        ch.basic_ack(tag, BasicAckOptions::default())
            .await
            .map_err(|e| broken("acknowledging a report", e))?;
    }
    // Copies of dead letters: the saved snapshot counts them (and remembers their ids).
    if let Some(dl) = dl {
        for tag in std::mem::take(&mut book.dead_acks) {
            dl.basic_ack(tag, BasicAckOptions::default())
                .await
                .map_err(|e| broken("acknowledging a dead letter", e))?;
        }
    }
    // Folded instances' queues: the saved snapshot holds their counts now.
    for q in std::mem::take(&mut book.retired_queues) {
        let _ = ch
            .basic_cancel(
                ShortString::from(tag_of(&q).as_str()),
                BasicCancelOptions::default(),
            )
            .await;
        if let Err(e) = admin::delete(conn, &q).await {
            tracing::debug!(queue = %q, error = %e, "cannot delete a folded instance's report queue");
        }
    }
    Ok(())
}
