//! The controllers' Prometheus metrics: how many reconciles and how long, what they did to
//! consumers and queues, which Subscriptions are Ready, how often they wrote status, and the API and broker calls they made (so a steady
//! state can be shown to cost nothing).
//!
//! It must not decide anything; it counts.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

/// The controllers, as the `controller` label names them.
pub const BACKEND: &str = "backend";
pub const SUBSCRIPTION: &str = "subscription";

#[derive(Clone)]
pub struct Metrics {
    /// `settle_reconcile_total{controller,result}`: result is `ok` or the error's kind.
    pub reconciles: IntCounterVec,
    /// `settle_reconcile_duration_seconds{controller}`.
    pub duration: HistogramVec,
    /// `settle_consumer_operations_total{op}`: create, update, delete, recreate.
    pub consumer_ops: IntCounterVec,
    /// `settle_status_writes_total{controller}`.
    pub status_writes: IntCounterVec,
    /// `settle_kube_requests_total{controller,verb}`: requests to the API server (watches aside).
    pub kube_requests: IntCounterVec,
    /// `settle_consumer_api_calls_total{call}`: broker calls: JetStream's (info, create, update,
    /// delete, stream), RabbitMQ's (`queue.*`, `amqp.connect`, `management.overview`) and SQS's
    /// (`sqs.*`).
    pub js_calls: IntCounterVec,
    /// `settle_drift_triggers_total{source}`: reconciles asked for by advisories or reconnects.
    pub triggers: IntCounterVec,
    /// `settle_subscription_ready{namespace,subscription}`: 1 while Ready=True, else 0; gone
    /// with the Subscription.
    pub ready: IntGaugeVec,
}

impl Metrics {
    pub fn new(registry: &Registry) -> Result<Metrics, prometheus::Error> {
        let m = Metrics {
            reconciles: IntCounterVec::new(
                Opts::new(
                    "settle_reconcile_total",
                    "Reconciles, by controller and result.",
                ),
                &["controller", "result"],
            )?,
            duration: HistogramVec::new(
                HistogramOpts::new(
                    "settle_reconcile_duration_seconds",
                    "How long one reconcile took, by controller.",
                )
                .buckets(vec![
                    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                ]),
                &["controller"],
            )?,
            consumer_ops: IntCounterVec::new(
                Opts::new(
                    "settle_consumer_operations_total",
                    "Changes made to broker consumers: create, update, delete, recreate.",
                ),
                &["op"],
            )?,
            status_writes: IntCounterVec::new(
                Opts::new(
                    "settle_status_writes_total",
                    "Status writes, by controller.",
                ),
                &["controller"],
            )?,
            kube_requests: IntCounterVec::new(
                Opts::new(
                    "settle_kube_requests_total",
                    "Requests the controllers sent to the Kubernetes API (watches not counted).",
                ),
                &["controller", "verb"],
            )?,
            js_calls: IntCounterVec::new(
                Opts::new(
                    "settle_consumer_api_calls_total",
                    "Broker API calls the controllers made (JetStream, RabbitMQ, SQS), by call.",
                ),
                &["call"],
            )?,
            triggers: IntCounterVec::new(
                Opts::new(
                    "settle_drift_triggers_total",
                    "Reconciles asked for by the broker: advisories and reconnects.",
                ),
                &["source"],
            )?,
            ready: IntGaugeVec::new(
                Opts::new(
                    "settle_subscription_ready",
                    "1 while the Subscription's Ready condition is True, else 0.",
                ),
                &["namespace", "subscription"],
            )?,
        };
        registry.register(Box::new(m.ready.clone()))?;
        registry.register(Box::new(m.reconciles.clone()))?;
        registry.register(Box::new(m.duration.clone()))?;
        registry.register(Box::new(m.consumer_ops.clone()))?;
        registry.register(Box::new(m.status_writes.clone()))?;
        registry.register(Box::new(m.kube_requests.clone()))?;
        registry.register(Box::new(m.js_calls.clone()))?;
        registry.register(Box::new(m.triggers.clone()))?;
        Ok(m)
    }

    pub fn kube(&self, controller: &str, verb: &str) {
        self.kube_requests
            .with_label_values(&[controller, verb])
            .inc();
    }

    pub fn js(&self, call: &str) {
        self.js_calls.with_label_values(&[call]).inc();
    }

    pub fn subscription_ready(&self, namespace: &str, subscription: &str, ready: bool) {
        self.ready
            .with_label_values(&[namespace, subscription])
            .set(i64::from(ready));
    }

    /// The Subscription is gone: its series go too.
    pub fn forget_subscription(&self, namespace: &str, subscription: &str) {
        let _ = self.ready.remove_label_values(&[namespace, subscription]);
    }

    pub fn op(&self, op: &str) {
        self.consumer_ops.with_label_values(&[op]).inc();
    }
}
