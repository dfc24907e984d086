//! The webhook's Prometheus metrics:
//!
//! - `settle_admission_requests_total{operation,allowed}`, `settle_admission_duration_seconds`:
//!   every review the validating webhook answered;
//! - `settle_admission_mutations_total{finalizer_added}`: every review the mutating webhook
//!   answered, and whether it put the finalizer on;
//! - `settle_webhook_connections_open`, `settle_webhook_connections_refused_total` (refused for
//!   being over `--webhook-max-connections`), `settle_webhook_connections_closed_total{reason}`;
//! - `settle_webhook_reviews_reading`: bodies being read and parsed now (at most
//!   `--webhook-max-concurrent-reviews`), `settle_webhook_reviews_waiting`: requests waiting
//!   for their turn;
//! - `settle_webhook_requests_rejected_total{reason}`: requests refused before a review was read
//!   (too large, too slow, unreadable, or no turn to be read in time).
//!
//! The connection metrics are `crate::serve`'s, named `webhook`. This file must not decide or
//! serve anything; it only counts what `server` reports.

use std::time::Duration;

use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry};

use super::review::Answer;
use crate::serve::ConnectionMetrics;

/// Why a request was refused before its review was read; the label of
/// `settle_webhook_requests_rejected_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Rejected {
    TooLarge,
    SlowBody,
    UnreadableBody,
    Busy,
}

impl Rejected {
    const ALL: [Rejected; 4] = [
        Rejected::TooLarge,
        Rejected::SlowBody,
        Rejected::UnreadableBody,
        Rejected::Busy,
    ];

    pub(super) fn label(self) -> &'static str {
        match self {
            Rejected::TooLarge => "too_large",
            Rejected::SlowBody => "slow_body",
            Rejected::UnreadableBody => "unreadable_body",
            Rejected::Busy => "busy",
        }
    }
}

/// The webhook's metrics, registered once per server.
#[derive(Clone)]
pub struct WebhookMetrics {
    requests: IntCounterVec,
    duration: Histogram,
    mutations: IntCounterVec,
    pub(super) connections: ConnectionMetrics,
    reading: IntGauge,
    waiting: IntGauge,
    rejected: IntCounterVec,
}

impl WebhookMetrics {
    /// Makes the metrics and registers them in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                "settle_admission_requests_total",
                "Admission reviews answered, by operation and whether allowed.",
            ),
            &["operation", "allowed"],
        )?;
        let duration = Histogram::with_opts(
            HistogramOpts::new(
                "settle_admission_duration_seconds",
                "Time to answer one admission review, body read to answer.",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0,
            ]),
        )?;
        let mutations = IntCounterVec::new(
            Opts::new(
                "settle_admission_mutations_total",
                "Reviews the mutating webhook answered, by whether it put the operator's finalizer \
                 on (false: it was there, the Subscription is being deleted, or the body was not \
                 a Subscription's CREATE or UPDATE).",
            ),
            &["finalizer_added"],
        )?;
        let connections =
            ConnectionMetrics::register(registry, "webhook", "--webhook-max-connections", true)?;
        let reading = IntGauge::new(
            "settle_webhook_reviews_reading",
            "Review bodies being read and parsed now (at most --webhook-max-concurrent-reviews).",
        )?;
        let waiting = IntGauge::new(
            "settle_webhook_reviews_waiting",
            "Requests waiting for their turn to have their body read.",
        )?;
        let rejected = IntCounterVec::new(
            Opts::new(
                "settle_webhook_requests_rejected_total",
                "Requests refused before their review was read, by why: too_large, slow_body, \
                 unreadable_body, busy.",
            ),
            &["reason"],
        )?;
        for why in Rejected::ALL {
            rejected.with_label_values(&[why.label()]);
        }
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(mutations.clone()))?;
        registry.register(Box::new(reading.clone()))?;
        registry.register(Box::new(waiting.clone()))?;
        registry.register(Box::new(rejected.clone()))?;
        Ok(WebhookMetrics {
            requests,
            duration,
            mutations,
            connections,
            reading,
            waiting,
            rejected,
        })
    }

    pub(super) fn observe(&self, answer: &Answer, elapsed: Duration) {
        let operation = match answer.operation.as_str() {
            op @ ("CREATE" | "UPDATE" | "DELETE" | "CONNECT") => op,
            _ => "unknown",
        };
        self.requests
            .with_label_values(&[operation, if answer.allowed { "true" } else { "false" }])
            .inc();
        self.duration.observe(elapsed.as_secs_f64());
    }

    /// Counts one review of the mutating webhook (a 400 counts as not added).
    pub(super) fn mutated(&self, answer: &Answer, patched: bool) {
        let added = patched && answer.status == http::StatusCode::OK;
        self.mutations
            .with_label_values(&[if added { "true" } else { "false" }])
            .inc();
    }

    /// Counts a body being read until the returned guard is dropped.
    pub(super) fn reading(&self) -> Counted {
        Counted::new(&self.reading)
    }

    /// Counts a request waiting for its turn until the returned guard is dropped.
    pub(super) fn waiting(&self) -> Counted {
        Counted::new(&self.waiting)
    }

    pub(super) fn request_rejected(&self, why: Rejected) {
        self.rejected.with_label_values(&[why.label()]).inc();
    }
}

/// One more in a gauge until dropped.
pub(super) struct Counted(IntGauge);

impl Counted {
    fn new(gauge: &IntGauge) -> Self {
        gauge.inc();
        Counted(gauge.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.dec();
    }
}
