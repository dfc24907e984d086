//! The stats report: what a running bus publishes for the operator, per subscription and
//! instance, in a versioned JSON format any runtime can write (docs/stats-report.md).
//!
//! Format, key and the rate-bounded publishing loop only. It must not interpret counters (the
//! operator sums instances and keeps per-counter maxima) and must not block handlers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::api::{ConsumerStats, Mode};

use super::stats::RuntimeStats;
use super::{StatsSink, SubscriptionCtx};

/// The format version this runtime writes. Readers must ignore unknown fields and refuse
/// versions they do not know.
pub const REPORT_VERSION: u32 = 1;
/// The JetStream KV bucket reports go to.
pub const REPORT_BUCKET: &str = "settle-stats";
/// The largest value the report bucket takes, unless the operator's `--report-bucket-max-value-bytes`
/// says otherwise (a real report is under 1 KiB): the broker refuses a larger one before any
/// reader holds it. Whoever makes the bucket first (the runtime or the operator) makes it so.
pub const REPORT_BUCKET_MAX_VALUE_BYTES: i32 = 65_536;
/// The most bytes the report bucket holds, unless the operator's `--report-bucket-max-bytes`
/// says otherwise (a million live instances of 1 KiB).
pub const REPORT_BUCKET_MAX_BYTES: i64 = 1 << 30;
/// The default interval between two reports of one subscription.
pub const DEFAULT_REPORT_INTERVAL: Duration = Duration::from_secs(5);
/// An unchanged subscription is reported again this often, so the operator can tell an idle
/// instance from one that is gone (it folds instances silent for an hour).
pub const KEEPALIVE: Duration = Duration::from_secs(300);

/// One report: the cumulative account of one subscription in one running instance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatsReport {
    pub version: u32,
    /// The Subscription's namespace.
    pub namespace: String,
    /// The Subscription's name.
    pub subscription: String,
    /// The Subscription object (its UID) the counters belong to, as the operator marked the
    /// consumer the runtime is bound to; absent before the runtime knows it (a code-defined
    /// subscription, or a consumer not marked yet). The operator never counts a report that
    /// names another object (semantics C15).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscription_uid: Option<String>,
    /// The broker consumer (AtLeastOnce), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub durable_name: Option<String>,
    /// The reporting instance (stable for the life of the process).
    pub instance: String,
    /// The backend kind (`nats`, `rabbitmq`, `memory`).
    pub backend: String,
    pub mode: Mode,
    /// When this instance started counting (Unix ms): a new value means the counters restarted
    /// from zero (a new process, or a new Subscription object bound to).
    pub started_at_ms: u64,
    /// When this report was made (Unix ms).
    pub reported_at_ms: u64,
    /// Reports of this instance and subscription so far, this one included.
    pub sequence: u64,
    /// The cumulative counters (docs/semantics.md C1–C11) since `startedAtMs`.
    pub stats: ConsumerStats,
    /// Handler errors and panics (outside ConsumerStats).
    pub runtime: RuntimeStats,
}

impl StatsReport {
    /// The KV key: `<namespace>.<subscription>.<instance>`, each part reduced to the key alphabet.
    pub fn key(&self) -> String {
        report_key(&self.namespace, &self.subscription, &self.instance)
    }
}

/// The KV key of one instance's report of one subscription.
pub fn report_key(namespace: &str, subscription: &str, instance: &str) -> String {
    let clean = |s: &str| -> String {
        let c: String = s
            .chars()
            .map(|ch| {
                if ch.is_ascii_alphanumeric() || ch == '-' || ch == '_' {
                    ch
                } else {
                    '_'
                }
            })
            .collect();
        if c.is_empty() { "_".to_string() } else { c }
    };
    format!(
        "{}.{}.{}",
        clean(namespace),
        clean(subscription),
        clean(instance)
    )
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Who this process is, for reports: `SETTLE_INSTANCE`, else `HOSTNAME` (a pod's name), else
/// `pid-<pid>`; always followed by the start time so a restarted process is a new instance.
pub fn default_instance() -> String {
    let base = std::env::var("SETTLE_INSTANCE")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| format!("pid-{}", std::process::id()));
    format!("{base}-{}", now_ms())
}

pub(crate) struct ReportTarget {
    pub namespace: String,
    pub instance: String,
    pub backend: String,
    pub sink: Arc<dyn StatsSink>,
}

/// Per-subscription state of the publishing loop.
#[derive(Default)]
pub(crate) struct StatsReporter {
    last: HashMap<String, (ConsumerStats, RuntimeStats, u64, std::time::Instant)>,
}

impl StatsReporter {
    /// Publishes the reports of subscriptions whose counters changed since their last report
    /// (all of them when `force`). Failures are logged and retried at the next tick. Returns
    /// whether every report due was confirmed.
    pub(crate) async fn tick(
        &mut self,
        target: &ReportTarget,
        subs: &[Arc<SubscriptionCtx>],
        force: bool,
    ) -> bool {
        let mut all = true;
        for ctx in subs {
            let epoch = ctx.epoch();
            let (stats, runtime) = (epoch.stats, epoch.runtime);
            let entry = self.last.entry(ctx.name().to_string()).or_insert((
                ConsumerStats::default(),
                RuntimeStats::default(),
                0,
                std::time::Instant::now(),
            ));
            let fresh = entry.3.elapsed() < KEEPALIVE;
            if !force && entry.2 > 0 && entry.0 == stats && entry.1 == runtime && fresh {
                continue;
            }
            let report = StatsReport {
                version: REPORT_VERSION,
                namespace: target.namespace.clone(),
                subscription: ctx.name().to_string(),
                subscription_uid: epoch.uid,
                durable_name: ctx.policy().durable_name.clone(),
                instance: target.instance.clone(),
                backend: target.backend.clone(),
                mode: ctx.policy().mode,
                started_at_ms: epoch.started_at_ms,
                reported_at_ms: now_ms(),
                sequence: entry.2 + 1,
                stats,
                runtime,
            };
            let body = match serde_json::to_vec(&report) {
                Ok(b) => Bytes::from(b),
                Err(e) => {
                    tracing::error!(error = %e, "cannot encode a stats report");
                    all = false;
                    continue;
                }
            };
            match target.sink.put(report.key(), body).await {
                Ok(()) => *entry = (stats, runtime, report.sequence, std::time::Instant::now()),
                Err(e) => {
                    all = false;
                    tracing::warn!(subscription = %ctx.name(), error = %e, "stats report not published; retrying at the next interval")
                }
            }
        }
        all
    }
}
