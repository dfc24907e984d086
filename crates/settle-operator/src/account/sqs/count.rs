//! What an SQS keeper counts as it comes: the reports received from each Subscription's report
//! queue (hidden while held), judged where they arrived and counted with the ledger. It must not
//! delete a report (the round does, once the snapshot holding it is saved).

use super::*;

impl SqsKeeper {
    /// Receives what is waiting in one Subscription's report queue (bounded) and counts it.
    /// One `deleting` (its finalizer deletes the report queue) is never said to miss it.
    pub(super) async fn receive(
        &self,
        client: &Client,
        key: &SubKey,
        book: &mut Book,
        deleting: bool,
    ) {
        let who = who(key);
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
                    if missing && deleting {
                        tracing::debug!(subscription = %who, "the report queue went with the Subscription being deleted");
                    } else if missing {
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
    pub(super) fn on_report(&self, key: &SubKey, book: &mut Book, body: &[u8]) {
        let who = who(key);
        let report = queue_keeper::parse(&self.config, body);
        let refused = match &report {
            None => Some("too_large"),
            // A report counts only in its own Subscription's queue (semantics C18).
            Some(Ok(r)) if r.namespace != key.0 || r.subscription != key.1 => Some("misfiled"),
            Some(Ok(r)) => self.config.limits.refuse(r, &book.account),
            Some(Err(_)) => None,
        };
        if let Some(why) = refused {
            queue_keeper::refused(&self.metrics, &who, why);
            book.showing
                .trouble
                .report_dropped(why, settle::bus::report::now_ms());
            return;
        }
        let Some(report) = report else { return };
        if queue_keeper::count(&self.metrics, &who, &mut book.account, report) {
            book.dirty = true;
            book.counting = true;
        }
    }
}
