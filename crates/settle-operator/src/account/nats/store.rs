//! Where a NATS keeper keeps each Subscription's ledger: the ledger bucket, read when a book is
//! opened (an earlier object's ledger, or an unreadable one, starts over from what status shows)
//! and written by the round with the revision it read, so two writers never both win. It must
//! not count (`count`) nor decide when to save (`round`).

use super::*;

/// Why a ledger was not saved.
pub(super) enum Save {
    /// Another operator wrote it since it was read.
    Conflict,
    Failed(String),
}

impl NatsKeeper {
    /// The book of `key` for the Subscription object `m` is, loaded from the ledger bucket the
    /// first time; a book or saved ledger of an earlier object of that name is dropped.
    pub(super) async fn book<'a>(
        &self,
        ledgers: &kv::Store,
        books: &'a mut Books,
        key: &SubKey,
        m: &Member,
    ) -> Result<&'a mut Book, NatsError> {
        if let Some(book) = books.get(key)
            && !book.account.persisted().belongs_to(m.uid())
        {
            self.drop_earlier(books, key).await;
        }
        if !books.contains_key(key) {
            let book = self.load(ledgers, key, m).await?;
            books.insert(key.clone(), book);
        }
        books
            .get_mut(key)
            .map(Box::as_mut)
            .ok_or_else(|| broken("a ledger", "missing after loading"))
    }

    /// The book of an earlier object of `key`'s name (deleted and made again) is dropped, and
    /// the reports it counted with it.
    async fn drop_earlier(&self, books: &mut Books, key: &SubKey) {
        tracing::info!(subscription = %format!("{}/{}", key.0, key.1), "the Subscription was deleted and made again: the new object's account starts at zero");
        let old = books.remove(key);
        for (instance, revision) in old.iter().flat_map(|b| b.revisions.iter()) {
            let report = report_key(&key.0, &key.1, instance);
            let _ = self.drop_report(&report, *revision).await;
        }
    }

    /// The book of `key` for the Subscription object `m` is, loaded from the ledger bucket.
    async fn load(
        &self,
        ledgers: &kv::Store,
        key: &SubKey,
        m: &Member,
    ) -> Result<Box<Book>, NatsError> {
        let sub = &m.sub;
        let (saved, revision, ledger_lost) = self.read_ledger(ledgers, key, m).await?;
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
        account.claim(m.uid().map(str::to_string));
        // Nothing was heard before now: silence counts from here (C16).
        account.deaf_until(now_ms());
        Ok(Box::new(Book {
            account,
            showing: Showing {
                loss,
                trouble: crate::account::status::Trouble {
                    unsaved: None,
                    missed_advisories: saved.missed_advisories,
                    source_lost: None,
                    dead_letters: None,
                    queue_missing: None,
                    store_full: None,
                    dropped_reports: None,
                },
                last_write: None,
                last_early: None,
                stall: None,
                seen: None,
                sent: None,
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
            missed_at_ms: match saved.missed_at_ms {
                0 if saved.missed_advisories > 0 => now_ms(),
                at => at,
            },
        }))
    }

    /// `key`'s saved ledger in the bucket (empty when it is an earlier object's), its revision
    /// there, and whether it was lost (missing or unreadable).
    async fn read_ledger(
        &self,
        ledgers: &kv::Store,
        key: &SubKey,
        m: &Member,
    ) -> Result<(Saved, Option<u64>, bool), NatsError> {
        let name = || format!("{}/{}", key.0, key.1);
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
        let saved = if saved.ledger.belongs_to(m.uid()) {
            saved
        } else {
            tracing::info!(subscription = %name(), "the saved ledger is an earlier object's of the same name (deleted while no operator ran): the new object's account starts at zero");
            Saved::default()
        };
        Ok((saved, revision, ledger_lost))
    }
}

impl NatsKeeper {
    /// Saves one book's ledger, checked against the revision it was read or last written at.
    pub(super) async fn save(
        &self,
        ledgers: &kv::Store,
        key: &SubKey,
        book: &mut Book,
    ) -> Result<(), Save> {
        let saved = Saved {
            ledger: book.account.persisted().clone(),
            loss: book.showing.loss.clone(),
            missed_advisories: book.showing.trouble.missed_advisories,
            missed_at_ms: book.missed_at_ms,
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
