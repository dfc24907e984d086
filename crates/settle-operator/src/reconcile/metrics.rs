//! The controllers' Prometheus metrics: how many reconciles and how long, what they did to
//! consumers and queues, which Subscriptions are Ready, how often they wrote status, and the API and broker calls they made (so a steady
//! state can be shown to cost nothing).
//!
//! It must not decide anything; it counts.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};

use crate::exposition::{self, Kind, Table, Tables};

/// The controllers, as the `controller` label names them.
pub const BACKEND: &str = "backend";
pub const SUBSCRIPTION: &str = "subscription";
/// The `result` of a reconcile: `ok`, or the failure's category (`reconcile::Error::category`):
/// the Kubernetes API failed, the broker refused, the broker cannot be asked yet, or the watch
/// behind the controller failed.
pub const RESULT_OK: &str = "ok";
pub const RESULT_KUBE: &str = "kube";
pub const RESULT_BROKER: &str = "broker";
pub const RESULT_WAITING: &str = "waiting";
pub const RESULT_WATCH: &str = "watch";
pub const RESULTS: [&str; 5] = [
    RESULT_OK,
    RESULT_KUBE,
    RESULT_BROKER,
    RESULT_WAITING,
    RESULT_WATCH,
];
/// The `op` of a consumer operation.
pub const OPS: [&str; 5] = ["create", "update", "delete", "recreate", "adopt"];

#[derive(Clone)]
pub struct Metrics {
    /// `settle_reconcile_total{controller,result}`: result is `ok` or the failure's category.
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
    /// `settle_backends_over_limit{namespace}`: Backends of the namespace beyond
    /// `--max-backends-per-namespace`, not connected; gone at 0.
    pub backends_over_limit: IntGaugeVec,
    /// `settle_consumers_left_total`: consumers or queues a deleted Subscription with
    /// `deletionPolicy: Delete` left on the broker, because its Backend was gone.
    pub consumers_left: IntCounter,
    /// `settle_subscription_ready{namespace,subscription}`: 1 while Ready=True, else 0; gone
    /// with the Subscription.
    ready: Ready,
    /// `settle_reconcile_refusals_gated_total{limit}`: creates not sent to the broker because a
    /// limit's gate was closed (`reconcile::gate`).
    pub refusals_gated: IntCounterVec,
    /// `settle_backend_gated{namespace,backend,limit}`: Subscriptions waiting on a Backend's
    /// gate for that limit; gone when none waits.
    pub backend_gated: IntGaugeVec,
}

impl Metrics {
    // Long on purpose: one constructor and registration per metric, the whole set in one place
    // (docs/reference/metrics.md is generated from it).
    /// Registers the controllers' metrics in `registry`, and `settle_subscription_ready` in
    /// `tables`.
    pub fn new(registry: &Registry, tables: &Tables) -> Result<Metrics, prometheus::Error> {
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
            backends_over_limit: IntGaugeVec::new(
                Opts::new(
                    "settle_backends_over_limit",
                    "Backends of a namespace beyond --max-backends-per-namespace: Ready=False BackendLimit, not connected.",
                ),
                &["namespace"],
            )?,
            consumers_left: IntCounter::new(
                "settle_consumers_left_total",
                "Consumers or queues a deleted Subscription (deletionPolicy Delete) left on the broker because its Backend was gone.",
            )?,
            ready: Ready::default(),
            refusals_gated: IntCounterVec::new(
                Opts::new(
                    "settle_reconcile_refusals_gated_total",
                    "Creates not sent to the broker because the broker refused one for this limit and its gate is closed.",
                ),
                &["limit"],
            )?,
            backend_gated: IntGaugeVec::new(
                Opts::new(
                    "settle_backend_gated",
                    "Subscriptions waiting for a Backend's broker limit to free a place.",
                ),
                &["namespace", "backend", "limit"],
            )?,
        };
        registry.register(Box::new(m.refusals_gated.clone()))?;
        registry.register(Box::new(m.backend_gated.clone()))?;
        tables.add(Arc::new(m.ready.clone()));
        registry.register(Box::new(m.reconciles.clone()))?;
        registry.register(Box::new(m.duration.clone()))?;
        registry.register(Box::new(m.consumer_ops.clone()))?;
        registry.register(Box::new(m.status_writes.clone()))?;
        registry.register(Box::new(m.kube_requests.clone()))?;
        registry.register(Box::new(m.js_calls.clone()))?;
        registry.register(Box::new(m.triggers.clone()))?;
        registry.register(Box::new(m.consumers_left.clone()))?;
        registry.register(Box::new(m.backends_over_limit.clone()))?;
        // Every series that counts work exists at 0 from the start, on every replica: a family
        // with no series is not exported at all, and a standby's "reconciled nothing" must read
        // as a 0 that is there, not as a metric that is missing.
        for controller in [BACKEND, SUBSCRIPTION] {
            for result in RESULTS {
                m.reconciles.with_label_values(&[controller, result]);
            }
            m.status_writes.with_label_values(&[controller]);
        }
        for op in OPS {
            m.consumer_ops.with_label_values(&[op]);
        }
        for limit in settle::backend::limit::LABELS {
            m.refusals_gated.with_label_values(&[limit]);
        }
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
        let key = (namespace.to_string(), subscription.to_string());
        self.ready.map().insert(key, ready);
    }

    /// The Subscription is gone: its series go too.
    pub fn forget_subscription(&self, namespace: &str, subscription: &str) {
        let key = (namespace.to_string(), subscription.to_string());
        let mut flags = self.ready.map();
        flags.remove(&key);
        // The room a mass delete leaves is given back.
        if flags.len() <= flags.capacity() / 4 {
            flags.shrink_to_fit();
        }
    }

    /// One create held back by a closed gate.
    pub fn gated(&self, limit: &str) {
        self.refusals_gated.with_label_values(&[limit]).inc();
    }

    /// How many Subscriptions wait on Backend `namespace/backend`'s gates, by limit.
    pub fn backend_gated(
        &self,
        namespace: &str,
        backend: &str,
        by: &std::collections::HashMap<&'static str, i64>,
    ) {
        for limit in settle::backend::limit::LABELS {
            match by.get(limit) {
                Some(n) if *n > 0 => self
                    .backend_gated
                    .with_label_values(&[namespace, backend, limit])
                    .set(*n),
                _ => {
                    let _ = self
                        .backend_gated
                        .remove_label_values(&[namespace, backend, limit]);
                }
            }
        }
    }

    pub fn op(&self, op: &str) {
        self.consumer_ops.with_label_values(&[op]).inc();
    }
}

/// `settle_subscription_ready`: one flag per Subscription, written as text only when scraped
/// (`crate::exposition`). A gauge vector keeps, for every series, its own copy of the name,
/// help and label pairs (about half a kilobyte a Subscription, issue: scale).
#[derive(Clone, Default)]
struct Ready {
    flags: Arc<Mutex<HashMap<(String, String), bool>>>,
}

impl Ready {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), bool>> {
        self.flags
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Table for Ready {
    fn write(&self, out: &mut String) {
        let flags = self.map();
        exposition::family(
            out,
            "settle_subscription_ready",
            "1 while the Subscription's Ready condition is True, else 0.",
            Kind::Gauge,
            ["namespace", "subscription"],
            flags
                .iter()
                .map(|((ns, name), ready)| ([ns.as_str(), name.as_str()], u8::from(*ready))),
        );
    }

    fn series(&self) -> usize {
        self.map().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_failure_category_is_a_result_exported_from_the_start() {
        use super::super::Error;
        for e in [
            Error::Broker("refused".into()),
            Error::Waiting("connecting".into()),
            Error::Kube(kube::Error::LinesCodecMaxLineLengthExceeded),
        ] {
            assert!(RESULTS.contains(&e.category()), "{e}: {}", e.category());
        }
    }

    #[test]
    fn the_work_counters_are_exported_at_zero_before_any_work() {
        let r = Registry::new();
        let _m = Metrics::new(&r, &Tables::default()).expect("registers");
        let mut buf = Vec::new();
        prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &r.gather(), &mut buf)
            .expect("encodes");
        let text = String::from_utf8(buf).expect("utf-8");
        for line in [
            r#"settle_reconcile_total{controller="subscription",result="ok"} 0"#,
            r#"settle_reconcile_total{controller="subscription",result="kube"} 0"#,
            r#"settle_reconcile_total{controller="subscription",result="broker"} 0"#,
            r#"settle_reconcile_total{controller="subscription",result="waiting"} 0"#,
            r#"settle_reconcile_total{controller="subscription",result="watch"} 0"#,
            r#"settle_reconcile_total{controller="backend",result="ok"} 0"#,
            r#"settle_reconcile_total{controller="backend",result="broker"} 0"#,
            r#"settle_status_writes_total{controller="subscription"} 0"#,
            r#"settle_status_writes_total{controller="backend"} 0"#,
            r#"settle_consumer_operations_total{op="create"} 0"#,
            r#"settle_consumer_operations_total{op="update"} 0"#,
            r#"settle_consumer_operations_total{op="delete"} 0"#,
            r#"settle_consumer_operations_total{op="recreate"} 0"#,
            r#"settle_reconcile_refusals_gated_total{limit="max_consumers"} 0"#,
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn a_subscription_is_ready_or_not_until_it_is_forgotten() {
        let e = crate::exposition::Exposition::default();
        let m = Metrics::new(&e.registry, &e.tables).expect("registers");
        let text = || e.text().expect("encodes");
        assert!(!text().contains("settle_subscription_ready"));
        m.subscription_ready("team-a", "orders", true);
        m.subscription_ready("team-b", "orders", false);
        let t = text();
        assert!(t.contains("# TYPE settle_subscription_ready gauge"), "{t}");
        assert!(
            t.contains(r#"settle_subscription_ready{namespace="team-a",subscription="orders"} 1"#),
            "{t}"
        );
        assert!(
            t.contains(r#"settle_subscription_ready{namespace="team-b",subscription="orders"} 0"#),
            "{t}"
        );
        m.subscription_ready("team-a", "orders", false);
        m.forget_subscription("team-b", "orders");
        let t = text();
        assert!(
            t.contains(r#"settle_subscription_ready{namespace="team-a",subscription="orders"} 0"#),
            "{t}"
        );
        assert!(!t.contains("team-b"), "{t}");

        // A mass apply and delete: the room goes with the flags.
        for i in 0..5_000 {
            m.subscription_ready("team-c", &format!("s{i}"), true);
        }
        let grown = m.ready.map().capacity();
        for i in 0..5_000 {
            m.forget_subscription("team-c", &format!("s{i}"));
        }
        let left = m.ready.map().capacity();
        assert!(grown >= 5_000 && left < 64, "room for {grown}, then {left}");
    }
}
