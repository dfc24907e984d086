//! What a NATS keeper says about its Backend as a whole: whether the report bucket is full
//! (read every `STORE_CHECK`, said on every Subscription of the Backend through `Accounted`,
//! and in `settle_account_report_store_full`), and the reports it dropped that name no
//! Subscription of the Backend (said in the Backend's own `Accounted`, the one condition the
//! account writes on a Backend). The bucket's stream it reads is handed back to the session,
//! which judges from it whether its report watch keeps up ([`super::watch`]).
//!
//! It must not count reports nor write a Subscription's status (`count`, `round` and the
//! writer do).

use std::time::Instant;

use async_nats::jetstream::stream::Stream;
use async_nats::jetstream::{self, kv};

use super::NatsKeeper;
use crate::account::status::{self, DroppedReports};
use settle::api::condition::{Status, Want};
use settle::bus::report::now_ms;

/// Reports dropped that name no Subscription of the Backend, and the Backend's `Accounted`
/// as last written (and when).
#[derive(Default)]
pub(super) struct Unnamed {
    dropped: Option<DroppedReports>,
    shown: Option<(Want, Instant)>,
}

impl NatsKeeper {
    /// A report dropped for `reason` that names no Subscription of this Backend.
    pub(super) fn dropped_unnamed(&self, reason: &'static str) {
        if let Ok(mut u) = self.unnamed.lock() {
            DroppedReports::note(&mut u.dropped, reason, now_ms());
        }
    }

    /// The Backend's `Accounted`: False while reports that name no Subscription of it were
    /// dropped within the loss window, True once none was. Written when its status or reason
    /// changes, and its message (the count) at most once per stats interval; True only after
    /// it was False, so a Backend with no drop costs no write.
    pub(super) fn show_backend(&self) {
        let Ok(mut u) = self.unnamed.lock() else {
            return;
        };
        DroppedReports::forget_before(&mut u.dropped, now_ms(), self.config.loss_window);
        let want = status::backend_accounted(
            u.dropped.as_ref(),
            &status::window_text(self.config.loss_window),
        );
        let due = match &u.shown {
            None => want.status == Status::False,
            Some((shown, at)) => {
                (shown.status, shown.reason) != (want.status, want.reason)
                    || (shown.message != want.message && at.elapsed() >= self.config.stats_interval)
            }
        };
        if due {
            self.writer
                .backend_condition(&self.backend.0, &self.backend.1, want.clone());
            u.shown = Some((want, Instant::now()));
        }
    }

    /// Whether the report bucket was full at its last check, and how.
    pub(super) fn store_full(&self) -> Option<String> {
        self.store_full.lock().ok().and_then(|s| s.clone())
    }

    /// Reads how full the report bucket is: full when it cannot take one more report of the
    /// largest size it allows (the broker refuses a put that does not fit: discard new).
    /// Turning full, or room again, is logged, counted in `settle_account_report_store_full`
    /// and, through `Accounted`, said on every Subscription of the Backend. Returns the bucket's
    /// stream as read (for the watch's progress), None when it could not be read.
    pub(super) async fn check_store(&self, reports: &kv::Store) -> Option<Stream> {
        // The store's own status is what it read when opened: the stream is asked afresh.
        let bucket = reports.status().await.ok()?.bucket().to_string();
        let js = jetstream::new(self.client.clone());
        let stream = match js.get_stream(format!("KV_{bucket}")).await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read how full the report bucket is");
                return None;
            }
        };
        let info = stream.cached_info();
        let (config, state) = (&info.config, &info.state);
        let full = config.max_bytes > 0
            && state.bytes.saturating_add(
                u64::try_from(config.max_message_size.max(1024)).unwrap_or(u64::MAX),
            ) > u64::try_from(config.max_bytes).unwrap_or(u64::MAX);
        let said = full.then(|| {
            format!(
                "bucket {} holds {} of its {} bytes in {} report(s)",
                bucket, state.bytes, config.max_bytes, state.messages
            )
        });
        let backend = format!("{}/{}", self.backend.0, self.backend.1);
        self.metrics
            .store_full
            .with_label_values(&[&backend])
            .set(i64::from(full));
        if let Ok(mut shown) = self.store_full.lock() {
            if shown.is_some() != full {
                match &said {
                    Some(s) => {
                        tracing::warn!(backend = %backend, fill = %s, "the report bucket is full: the broker refuses new reports")
                    }
                    None => tracing::info!(backend = %backend, "the report bucket has room again"),
                }
            }
            *shown = said;
        }
        Some(stream)
    }
}
