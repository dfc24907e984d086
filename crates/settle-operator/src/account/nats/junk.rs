//! Reports a NATS keeper can never count: read and judged (too large, unreadable, misfiled),
//! removed from the report bucket by the keeper of the key's namespace (unless it says it is a
//! newer runtime's), and said where they belong: on the Subscription of this Backend the key
//! names, else on the Backend (`backend`), unless another Backend's Subscription is named.
//!
//! It must not count a report (`count` does) nor write status (the writer does).

use async_nats::jetstream::kv;

use super::{Books, Members, NatsKeeper};
use settle::backend::nats::admin::NatsError;
use settle::bus::report::{StatsReport, now_ms, report_key};

impl NatsKeeper {
    /// The report in `entry`, or why it is dropped (`None`: not a value, a deletion).
    pub(super) async fn read_report(
        &self,
        entry: &kv::Entry,
    ) -> Result<StatsReport, Option<&'static str>> {
        if entry.operation != kv::Operation::Put {
            return Err(None);
        }
        if self.config.limits.too_large(entry.value.len()) {
            self.metrics.reports.with_label_values(&["too_large"]).inc();
            tracing::warn!(key = %entry.key, bytes = entry.value.len(), "a stats report larger than --max-report-bytes: dropped");
            self.purge_junk(entry).await;
            return Err(Some("too_large"));
        }
        let report: StatsReport = match serde_json::from_slice(&entry.value) {
            Ok(r) => r,
            Err(e) => {
                self.metrics
                    .reports
                    .with_label_values(&["unreadable"])
                    .inc();
                tracing::warn!(key = %entry.key, error = %e, "a stats report is unreadable: skipped");
                if !of_a_newer_runtime(&entry.value) {
                    self.purge_junk(entry).await;
                }
                return Err(Some("unreadable"));
            }
        };
        // A report counts only under its own key: a body naming another Subscription or
        // instance than the key it was written to is dropped.
        if report.key() != entry.key {
            self.metrics.reports.with_label_values(&["misfiled"]).inc();
            tracing::warn!(key = %entry.key, named = %report.key(), "a stats report whose body names another key than the one it was written to: dropped");
            self.purge_junk(entry).await;
            return Err(Some("misfiled"));
        }
        Ok(report)
    }

    /// A report dropped unread under `key`, said where it belongs: on the Subscription of this
    /// Backend its key names (`Accounted=False ReportsDropped`), else on the Backend, when the
    /// key is under this Backend's namespace (another namespace's keeper says its own).
    pub(super) async fn said_dropped(
        &self,
        ledgers: &kv::Store,
        members: &Members,
        books: &mut Books,
        key: &str,
        reason: &'static str,
    ) -> Result<(), NatsError> {
        if key.split('.').next() != Some(self.namespace_token().as_str()) {
            return Ok(());
        }
        let prefix = key.rsplit_once('.').map_or(key, |(p, _)| p);
        let named = members.iter().find(|(k, _)| {
            report_key(&k.0, &k.1, "_")
                .rsplit_once('.')
                .is_some_and(|(p, _)| p == prefix)
        });
        match named {
            Some((k, m)) => {
                let k = k.clone();
                let book = self.book(ledgers, books, &k, m).await?;
                book.showing.trouble.report_dropped(reason, now_ms());
            }
            // Of another Backend's Subscription of the namespace: its keeper says it.
            None if self.names_a_subscription(prefix) => {}
            None => self.dropped_unnamed(reason),
        }
        Ok(())
    }

    /// A value under this Backend's namespace that no operator can ever count (too large,
    /// unreadable, misfiled) removed from the report bucket, so junk never fills it (the
    /// keeper of the key's namespace removes it; another namespace's is left to its own).
    async fn purge_junk(&self, entry: &kv::Entry) {
        if entry.key.split('.').next() != Some(self.namespace_token().as_str()) {
            return;
        }
        match self.drop_report(&entry.key, entry.revision).await {
            Ok(()) => {
                tracing::info!(key = %entry.key, "removed a value of the report bucket that no operator can count")
            }
            Err(e) => {
                tracing::debug!(key = %entry.key, error = %e, "cannot remove a value of the report bucket that no operator can count")
            }
        }
    }

    /// Whether report-key prefix `prefix` (`<namespace>.<subscription>`, reduced) names a
    /// Subscription of this Backend's namespace in the cache (of any Backend).
    fn names_a_subscription(&self, prefix: &str) -> bool {
        self.subs.state().iter().any(|s| {
            s.metadata.namespace.as_deref() == Some(self.backend.0.as_str())
                && report_key(
                    &self.backend.0,
                    &s.metadata.name.clone().unwrap_or_default(),
                    "_",
                )
                .rsplit_once('.')
                .is_some_and(|(p, _)| p == prefix)
        })
    }

    /// This Backend's namespace as the first part of a report key.
    pub(super) fn namespace_token(&self) -> String {
        report_key(&self.backend.0, "_", "_")
            .split('.')
            .next()
            .unwrap_or_default()
            .to_string()
    }
}

/// Whether an unreadable report says it is of a runtime newer than this operator (a JSON
/// object whose `version` is above the one it reads): kept for an upgraded operator to count.
fn of_a_newer_runtime(value: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(value)
        .ok()
        .and_then(|v| v.get("version").and_then(serde_json::Value::as_u64))
        .is_some_and(|v| v > u64::from(settle::bus::report::REPORT_VERSION))
}
