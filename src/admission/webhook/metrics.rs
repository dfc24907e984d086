//! The webhook's Prometheus metrics: `settle_admission_requests_total{operation,allowed}` and
//! `settle_admission_duration_seconds`.
//!
//! This file must not decide or serve anything; it only counts what `server` reports.

use std::time::Duration;

use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts, Registry};

use super::review::Answer;

/// `settle_admission_requests_total{operation,allowed}` and `settle_admission_duration_seconds`.
#[derive(Clone)]
pub struct WebhookMetrics {
    requests: IntCounterVec,
    duration: Histogram,
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
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        Ok(WebhookMetrics { requests, duration })
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
}
