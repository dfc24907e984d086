//! An SQS keeper's round, once a second: idle instances folded, the snapshots that changed saved
//! to the ledger queue, and only then the reports they hold deleted; a deleted Subscription's
//! queues let go. It must not receive reports (`count`) nor decide counts (the ledger).

use super::*;

impl SqsKeeper {
    /// Once a second: receive, look at the dead letters, fold, save, delete, gauges, status.
    pub(super) async fn settle(
        &self,
        client: &Client,
        members: &HashMap<SubKey, Arc<Subscription>>,
        books: &mut HashMap<SubKey, Book>,
    ) {
        let now = now_ms();
        let fold_after = u64::try_from(self.config.fold_after.as_millis()).unwrap_or(u64::MAX);
        for (key, book) in books.iter_mut() {
            // Being deleted, its finalizer takes the report queue with the Subscription's
            // queue: that is no report queue missing.
            let deleting = members
                .get(key)
                .is_some_and(|s| s.metadata.deletion_timestamp.is_some());
            self.receive(client, key, book, deleting).await;
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
            let folded = book.account.fold_idle(now, fold_after);
            if !folded.is_empty() {
                self.metrics.folded(&who(key), &folded);
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
            if book.gauges.due(&mut budget, interval) {
                let got = admin::queue_gauges(client, &book.queue).await;
                book.gauges.note(&who(key), got);
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
                book.gauges.read,
                &mut book.showing,
                &mut book.gauges.written,
            ) {
                book.dirty = true;
            }
        }
    }

    /// Saves the book's snapshot if it changed, then deletes the reports it holds.
    pub(super) async fn save(
        &self,
        client: &Client,
        key: &SubKey,
        sub: Option<&Arc<Subscription>>,
        book: &mut Book,
    ) {
        let who = who(key);
        if book.dirty {
            let saved = Saved {
                generation: book.generation + 1,
                ledger: book.account.snapshot(),
                loss: book.showing.loss.clone(),
            };
            match store(client, &book.ledger_url, &saved).await {
                Ok(()) => {
                    book.generation = saved.generation;
                    book.dirty = false;
                    queue_keeper::saved(
                        &self.writer,
                        &self.metrics,
                        &who,
                        sub,
                        &mut book.showing.trouble,
                    );
                }
                Err(e) => {
                    let first = queue_keeper::not_saved(
                        &self.writer,
                        &self.metrics,
                        &who,
                        sub,
                        &mut book.showing.trouble,
                        e,
                        "its reports stay in the report queue until it can",
                    );
                    // The ledger queue may have been deleted on the server: look it up again.
                    if first
                        && let Ok(Some(url)) =
                            admin::queue_url(client, &report::ledger_queue(&book.queue)).await
                    {
                        book.ledger_url = url;
                    }
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
        let acks: Vec<String> = std::mem::take(&mut book.acks)
            .into_iter()
            .map(|(r, _)| r)
            .collect();
        if let Err(e) = delete_all(client, &book.report_url, &acks).await {
            // Those reports come back after the hide time and are counted stale.
            tracing::debug!(subscription = %who, error = %e, "cannot delete counted reports; they come back and are skipped");
        }
    }
}
