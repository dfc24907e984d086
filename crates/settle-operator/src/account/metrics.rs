//! The account's Prometheus metrics: every Subscription's counters at full resolution
//! (`settle_subscription_<counter>_total`, Prometheus counters because they never decrease), its
//! broker gauges, whether it is losing messages now, and what the account itself does (status
//! writes, their backlog and what the budget deferred, advisories, reports).
//!
//! The per-Subscription series are one compact row per Subscription ([`PerSubscription`]),
//! written as text only when scraped (`crate::exposition`): a metric vector keeps, for every
//! series, its own copy of the name, help and labels (about a kilobyte each; 17 series per
//! Subscription, so most of an idle operator's memory at thousands of Subscriptions), and a
//! registry's scrape builds as much again (issue: scale).
//!
//! It must not decide anything; it mirrors what the keeper computed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use crate::exposition::{self, Kind, Table, Tables};
use settle::api::{ConsumerStats, SubscriptionStats};

/// One counter: its metric name stem, its help, and how it is read from ConsumerStats.
type Counter = (&'static str, &'static str, fn(&ConsumerStats) -> u64);

/// The counters.
const COUNTERS: [Counter; 13] = [
    ("offered", "Attempts handed to the runtime.", |s| s.offered),
    ("delivered", "Attempts whose handler returned.", |s| {
        s.delivered
    }),
    (
        "released",
        "Attempts given up before a handler returned, owed back.",
        |s| s.released,
    ),
    (
        "lost",
        "Attempts offered and never delivered nor released.",
        |s| s.lost,
    ),
    ("acked", "Attempts settled Ack.", |s| s.settlement.acked),
    ("nacked", "Attempts settled Nack.", |s| s.settlement.nacked),
    (
        "silent",
        "Attempts whose handler returned without settling.",
        |s| s.settlement.silent,
    ),
    ("refused", "Settlements the broker refused.", |s| {
        s.settlement.refused
    }),
    (
        "exhausted",
        "Messages that ran out of attempts (data loss).",
        |s| s.exhausted,
    ),
    (
        "stranded",
        "Messages declined where the broker could not take them back.",
        |s| s.stranded,
    ),
    (
        "lease_expired",
        "Attempts handed on at maxProcessingTime.",
        |s| s.lease_expired,
    ),
    (
        "delay_shortened",
        "Declines redelivered sooner than asked (hold limit).",
        |s| s.delay_shortened,
    ),
    (
        "foreign_conflicts",
        "Attempts whose transport header contradicted the envelope.",
        |s| s.foreign_conflicts,
    ),
];

/// The outcomes of `settle_account_reports_total` that say a report was not believed (written
/// to another's key, implausible, by a user the Backend does not count): exported at 0 from
/// the start, so an alert on them has a series to read before the first forgery.
pub const DROPPED_FOR_TENANCY: [&str; 4] = [
    "misfiled",
    "sequence_jump",
    "from_the_future",
    "wrong_writer",
];

/// The gauges of a Subscription: their names and helps, in [`Row::gauges`] order.
const GAUGES: [(&str, &str); 3] = [
    (
        "settle_subscription_pending",
        "Messages on the broker not yet delivered to the Subscription's consumer.",
    ),
    (
        "settle_subscription_ack_pending",
        "Messages delivered and not yet settled.",
    ),
    (
        "settle_subscription_exhausting",
        "1 while the Subscription's Exhausting condition is True (messages ran out of attempts within the loss window).",
    ),
];

const STALLED: (&str, &str) = (
    "settle_subscription_stalled",
    "1 while the Subscription's Stalled condition is True (messages pending and no handler returned within the stall window).",
);

/// What one Subscription's series show. A part is exported once it was first set.
#[derive(Clone, Copy, Default)]
struct Row {
    /// The object the row shows (a hash of its UID): another object of the name (deleted and
    /// applied again faster than the keeper saw the deletion) starts the row anew.
    object: Option<u64>,
    /// In [`COUNTERS`] order; each the highest shown (a counter never goes back).
    counters: Option<[u64; COUNTERS.len()]>,
    /// pending, ack_pending, exhausting.
    gauges: Option<[i64; 3]>,
    stalled: Option<i64>,
}

/// The series' labels.
const LABELS: [&str; 2] = ["namespace", "subscription"];

/// Every Subscription's series: `settle_subscription_<counter>_total`, its gauges and
/// `settle_subscription_stalled`, labelled `namespace` and `subscription`.
#[derive(Clone)]
struct PerSubscription {
    rows: Arc<Mutex<HashMap<(String, String), Row>>>,
    /// `settle_subscription_<counter>_total`, in [`COUNTERS`] order.
    names: Arc<[String]>,
}

impl PerSubscription {
    fn new() -> PerSubscription {
        PerSubscription {
            rows: Arc::default(),
            names: COUNTERS
                .iter()
                .map(|(stem, _, _)| format!("settle_subscription_{stem}_total"))
                .collect(),
        }
    }

    fn rows(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Row>> {
        self.rows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Each row's value that `value` reads, with the row's labels.
fn series<'a, V>(
    rows: &'a HashMap<(String, String), Row>,
    value: impl Fn(&Row) -> Option<V> + 'a,
) -> impl Iterator<Item = ([&'a str; 2], V)> + 'a {
    rows.iter()
        .filter_map(move |((ns, name), row)| Some(([ns.as_str(), name.as_str()], value(row)?)))
}

impl Table for PerSubscription {
    fn write(&self, out: &mut String) {
        let rows = self.rows();
        for (i, ((_, help, _), name)) in COUNTERS.iter().zip(self.names.iter()).enumerate() {
            let values = series(&rows, |r| r.counters.map(|c| c[i]));
            exposition::family(out, name, help, Kind::Counter, LABELS, values);
        }
        for (i, (name, help)) in GAUGES.iter().enumerate() {
            let values = series(&rows, |r| r.gauges.map(|g| g[i]));
            exposition::family(out, name, help, Kind::Gauge, LABELS, values);
        }
        let (name, help) = STALLED;
        let values = series(&rows, |r| r.stalled);
        exposition::family(out, name, help, Kind::Gauge, LABELS, values);
    }

    fn series(&self) -> usize {
        self.rows().len() * (COUNTERS.len() + GAUGES.len() + 1)
    }
}

#[derive(Clone)]
pub struct Metrics {
    subscriptions: PerSubscription,
    /// `settle_status_writes_total{controller="account"}` is the controllers' metric; the
    /// account counts its own writes here, by result.
    pub writes: IntCounterVec,
    /// `settle_account_status_urgent_writes_total`: the writes (counted in `writes` too) of a
    /// change that matters, sent before the rest.
    pub urgent_writes: IntCounter,
    /// `settle_account_status_backlog`: Subscriptions whose status patch waits for the budget
    /// (`--status-writes-per-second`) or for their previous write to end.
    pub backlog: IntGauge,
    /// `settle_account_early_report_bytes`: reports held for Subscriptions not in the cache yet,
    /// over every keeper of the process (bounded by `--max-early-report-bytes`).
    pub early_bytes: IntGauge,
    /// `settle_account_status_writes_deferred_total{reason}`: patches that waited because the
    /// budget was spent (`budget`), and waiting patches replaced by a newer one for the same
    /// Subscription, never sent (`coalesced`: the newer carries the whole account).
    pub deferred: IntCounterVec,
    /// `settle_account_advisories_total{kind}`: delivery advisories read from the capture, by
    /// kind, and what was set aside: `earlier_consumer`, `held_unverified` (waiting for a
    /// Subscription's status to name the consumer), `unverified_dropped` (it did not in time, or
    /// the hold was full) and `unverified_not_ours` (the status named another stream's consumer).
    /// `earlier_consumer` and `unverified_dropped` exist at 0 from the start.
    pub advisories: IntCounterVec,
    /// `settle_account_reports_total{outcome}`: runtime reports read, by what became of them
    /// (counted, stale, and each reason one was dropped; [`DROPPED_FOR_TENANCY`] from the start).
    pub reports: IntCounterVec,
    /// `settle_account_ledger_saves_total{result}`: ledgers saved on the broker (ok, error, conflict).
    pub saves: IntCounterVec,
    /// `settle_account_capture_gap_total`: advisories dropped from the capture before the
    /// operator read them (the stream's limits).
    pub capture_gap: IntCounterVec,
    /// `settle_account_source_lost_total{source}`: sources of an account found lost (ledger,
    /// reports), each continued from status as an offset (semantics C17).
    pub source_lost: IntCounterVec,
    /// `settle_account_dead_letters_total{outcome}`: copies of RabbitMQ dead letters read
    /// (counted, duplicate, not_exhausted, not_ours, earlier_object), and the copies the broker dropped or never
    /// made as far as the keeper can tell (`copy_queue_full`: it was found full, so the oldest
    /// beyond `--dead-letter-copy-max-length` were dropped; `copy_queue_lost`: it was deleted on
    /// the broker and made again).
    pub dead_letters: IntCounterVec,
    /// `settle_account_gauge_calls_total{call}`: broker calls made to read the consumers'
    /// gauges (NATS: `list`, one stream's consumers listed, 256 to a call; `info`, one consumer asked alone).
    pub gauge_calls: IntCounterVec,
    /// `settle_account_report_store_full{backend}`: 1 while a NATS Backend's report bucket
    /// (`settle-stats`) cannot take one more report of the largest size (the broker then
    /// refuses new reports), else 0.
    pub store_full: IntGaugeVec,
    /// `settle_account_report_watch_stalls_total`: times a NATS keeper's report watch
    /// delivered nothing while its bucket held a newer report, and was made again.
    pub watch_stalls: IntCounter,
    /// `settle_account_instances_folded_total`: runtime instances folded after `--fold-after`
    /// without a report, their unfinished attempts counted Released (Lost under AtMostOnce).
    pub folds: IntCounter,
}

impl Metrics {
    // Long on purpose: one constructor and registration per metric, the whole set in one place
    // (docs/reference/metrics.md is generated from it).
    /// Registers the account's metrics in `registry`, and its per-Subscription series in
    /// `tables`.
    pub fn new(registry: &Registry, tables: &Tables) -> Result<Metrics, prometheus::Error> {
        let subscriptions = PerSubscription::new();
        tables.add(Arc::new(subscriptions.clone()));
        let counter =
            |name: &str, help: &str, l: &[&str]| -> Result<IntCounterVec, prometheus::Error> {
                let c = IntCounterVec::new(Opts::new(name, help), l)?;
                registry.register(Box::new(c.clone()))?;
                Ok(c)
            };
        Ok(Metrics {
            subscriptions,
            writes: counter(
                "settle_account_status_writes_total",
                "Status writes of the account, by result (ok; error; conflict: the object changed since the cache saw it, read again and written once more; other_object: the patch was made for an object since deleted and made again under its name, not written).",
                &["result"],
            )?,
            urgent_writes: {
                let c = IntCounter::new(
                    "settle_account_status_urgent_writes_total",
                    "Status writes of a change that matters (Exhausted or Stranded grew, a condition flipped), sent before the rest; also in settle_account_status_writes_total.",
                )?;
                registry.register(Box::new(c.clone()))?;
                c
            },
            backlog: {
                let g = IntGauge::new(
                    "settle_account_status_backlog",
                    "Subscriptions whose status write waits (for the --status-writes-per-second budget, or for their previous write to end).",
                )?;
                registry.register(Box::new(g.clone()))?;
                g
            },
            early_bytes: {
                let g = IntGauge::new(
                    "settle_account_early_report_bytes",
                    "Bytes of stats reports held for Subscriptions not in the operator's cache yet, over every Backend's keeper (at most --max-early-report-bytes; beyond, reports are dropped: settle_account_reports_total{outcome=\"early_dropped\"}).",
                )?;
                registry.register(Box::new(g.clone()))?;
                g
            },
            deferred: counter(
                "settle_account_status_writes_deferred_total",
                "Status patches deferred by the budget, by reason (budget: waited for --status-writes-per-second; coalesced: replaced while waiting by a newer one for the same Subscription, never sent).",
                &["reason"],
            )?,
            advisories: counter(
                "settle_account_advisories_total",
                "Delivery advisories read from the operator's capture, by kind.",
                &["kind"],
            )?,
            reports: counter(
                "settle_account_reports_total",
                "Runtime stats reports read, by outcome (counted, stale, unknown_version, unreadable, other_object, gone, misfiled, too_large, bad_instance, too_many_instances, early_dropped, sequence_jump, from_the_future, wrong_writer).",
                &["outcome"],
            )?,
            saves: counter(
                "settle_account_ledger_saves_total",
                "Ledgers saved on the broker, by result (ok, error, conflict: another operator wrote it first).",
                &["result"],
            )?,
            capture_gap: counter(
                "settle_account_capture_gap_total",
                "Advisories dropped from the capture stream (its limits) before the operator read them.",
                &["backend"],
            )?,
            source_lost: counter(
                "settle_account_source_lost_total",
                "Sources of a Subscription's account found lost (ledger, reports): counting continued from status as an offset.",
                &["source"],
            )?,
            dead_letters: counter(
                "settle_account_dead_letters_total",
                "Copies of RabbitMQ dead letters read by the account, by outcome (counted, duplicate, not_exhausted, not_ours, earlier_object), and the times the copy queue was found full (copy_queue_full) or deleted (copy_queue_lost).",
                &["outcome"],
            )?,
            gauge_calls: counter(
                "settle_account_gauge_calls_total",
                "Broker calls made to read the consumers' gauges (pending, ackPending), by call (NATS: list, one stream's consumers listed, 256 to a call; info, one consumer asked alone).",
                &["call"],
            )?,
            store_full: {
                let g = IntGaugeVec::new(
                    Opts::new(
                        "settle_account_report_store_full",
                        "1 while a NATS Backend's report bucket (settle-stats, on its server and account) cannot take one more report of the largest size, so the broker refuses new reports (its Subscriptions say Accounted=False ReportStoreFull), else 0.",
                    ),
                    &["backend"],
                )?;
                registry.register(Box::new(g.clone()))?;
                g
            },
            watch_stalls: {
                let c = IntCounter::new(
                    "settle_account_report_watch_stalls_total",
                    "Times a NATS Backend's report watch delivered nothing for 20 s while its report bucket held a newer report (a watch the broker left heartbeating but not delivering); each time the keeper's session started again with a new watch, reading the reports again (they are cumulative: nothing counts twice).",
                )?;
                registry.register(Box::new(c.clone()))?;
                c
            },
            folds: {
                let c = IntCounter::new(
                    "settle_account_instances_folded_total",
                    "Runtime instances folded after --fold-after without a report (dead, or idle: one that reports again is counted on from its fold), their unfinished attempts counted Released (Lost under AtMostOnce).",
                )?;
                registry.register(Box::new(c.clone()))?;
                c
            },
        }
        .exported_at_zero())
    }

    /// The writes' series exist at 0 from the start, on every replica, so "no write" reads as a
    /// 0 that is there rather than as a metric that is missing.
    fn exported_at_zero(self) -> Metrics {
        for result in ["ok", "error"] {
            self.writes.with_label_values(&[result]);
        }
        for call in ["list", "info"] {
            self.gauge_calls.with_label_values(&[call]);
        }
        for reason in ["budget", "coalesced"] {
            self.deferred.with_label_values(&[reason]);
        }
        for outcome in DROPPED_FOR_TENANCY {
            self.reports.with_label_values(&[outcome]);
        }
        for outcome in ["copy_queue_full", "copy_queue_lost", "not_ours"] {
            self.dead_letters.with_label_values(&[outcome]);
        }
        // Losses counted for nobody: alerted on.
        for kind in ["unverified_dropped", "earlier_consumer"] {
            self.advisories.with_label_values(&[kind]);
        }
        self
    }

    /// Mirrors one Subscription's account (a counter shows the highest value the same object
    /// gave it; another object of the name, by `uid`, starts the row anew).
    pub fn show(
        &self,
        namespace: &str,
        name: &str,
        uid: Option<&str>,
        stats: &SubscriptionStats,
        exhausting: bool,
    ) {
        let mut rows = self.subscriptions.rows();
        let row = rows
            .entry((namespace.to_string(), name.to_string()))
            .or_default();
        let object = uid.map(|u| settle::backend::fingerprint(&u));
        if object.is_some() && row.object.is_some() && row.object != object {
            *row = Row::default();
        }
        row.object = object.or(row.object);
        let mut counters = row.counters.unwrap_or_default();
        for ((_, _, read), shown) in COUNTERS.iter().zip(counters.iter_mut()) {
            *shown = (*shown).max(read(&stats.counters));
        }
        row.counters = Some(counters);
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        row.gauges = Some([
            gauge(stats.pending),
            gauge(stats.ack_pending),
            i64::from(exhausting),
        ]);
    }

    /// Mirrors one Subscription's `Stalled` condition.
    pub fn stalled(&self, namespace: &str, name: &str, stalled: bool) {
        self.subscriptions
            .rows()
            .entry((namespace.to_string(), name.to_string()))
            .or_default()
            .stalled = Some(i64::from(stalled));
    }

    /// Counts and says the instances a keeper just folded (`instance`, unfinished attempts).
    pub fn folded(&self, who: &str, folded: &[(String, u64)]) {
        for (instance, unfinished) in folded {
            self.folds.inc();
            tracing::info!(subscription = %who, %instance, unfinished, "an instance silent for --fold-after is folded: its unfinished attempts count as Released (Lost under AtMostOnce)");
        }
    }

    /// Forgets a deleted Subscription.
    pub fn forget(&self, namespace: &str, name: &str) {
        self.subscriptions
            .rows()
            .remove(&(namespace.to_string(), name.to_string()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exposition::Exposition;

    fn text(e: &Exposition) -> String {
        e.text().expect("encodes")
    }

    #[test]
    fn counters_rise_by_growth_and_names_are_the_documented_ones() {
        let r = Exposition::default();
        let m = Metrics::new(&r.registry, &r.tables).expect("registers");
        let mut s = SubscriptionStats::default();
        s.counters.settlement.nacked = 30;
        s.counters.exhausted = 10;
        s.pending = 4;
        m.show("shop", "orders", Some("uid-1"), &s, true);
        m.show("shop", "orders", Some("uid-1"), &s, true);
        s.counters.exhausted = 12;
        m.show("shop", "orders", Some("uid-1"), &s, true);
        m.stalled("shop", "orders", true);
        let t = text(&r);
        for line in [
            r#"settle_subscription_nacked_total{namespace="shop",subscription="orders"} 30"#,
            r#"settle_subscription_exhausted_total{namespace="shop",subscription="orders"} 12"#,
            r#"settle_subscription_acked_total{namespace="shop",subscription="orders"} 0"#,
            r#"settle_subscription_pending{namespace="shop",subscription="orders"} 4"#,
            r#"settle_subscription_exhausting{namespace="shop",subscription="orders"} 1"#,
            r#"settle_subscription_stalled{namespace="shop",subscription="orders"} 1"#,
        ] {
            assert!(t.contains(line), "missing {line} in\n{t}");
        }
        // A lower value (a source lost and continued) never takes a counter back.
        s.counters.exhausted = 3;
        m.show("shop", "orders", Some("uid-1"), &s, true);
        assert!(text(&r).contains(
            r#"settle_subscription_exhausted_total{namespace="shop",subscription="orders"} 12"#
        ));
        // Stalled alone makes no counter series.
        m.stalled("shop", "idle", false);
        let t = text(&r);
        assert!(
            t.contains(r#"settle_subscription_stalled{namespace="shop",subscription="idle"} 0"#)
        );
        assert!(
            !t.contains(r#"settle_subscription_acked_total{namespace="shop",subscription="idle"}"#)
        );
        m.forget("shop", "orders");
        assert!(!text(&r).contains(r#"subscription="orders""#));
    }

    #[test]
    fn the_status_writes_are_exported_at_zero_before_any_write() {
        let r = Exposition::default();
        let _m = Metrics::new(&r.registry, &r.tables).expect("registers");
        let t = text(&r);
        for line in [
            r#"settle_account_status_writes_total{result="ok"} 0"#,
            r#"settle_account_status_writes_total{result="error"} 0"#,
            r#"settle_account_status_urgent_writes_total 0"#,
            r#"settle_account_status_backlog 0"#,
            r#"settle_account_early_report_bytes 0"#,
            r#"settle_account_status_writes_deferred_total{reason="budget"} 0"#,
            r#"settle_account_status_writes_deferred_total{reason="coalesced"} 0"#,
            r#"settle_account_reports_total{outcome="misfiled"} 0"#,
            r#"settle_account_reports_total{outcome="sequence_jump"} 0"#,
            r#"settle_account_reports_total{outcome="from_the_future"} 0"#,
            r#"settle_account_reports_total{outcome="wrong_writer"} 0"#,
        ] {
            assert!(t.contains(line), "missing {line} in\n{t}");
        }
    }
    #[test]
    fn another_object_of_the_name_starts_its_series_anew() {
        let r = Exposition::default();
        let m = Metrics::new(&r.registry, &r.tables).expect("registers");
        let mut s = SubscriptionStats::default();
        s.counters.exhausted = 12;
        m.show("shop", "orders", Some("uid-1"), &s, true);
        // Deleted and applied again before the keeper saw the deletion: its own counts, from 0.
        s.counters.exhausted = 2;
        m.show("shop", "orders", Some("uid-2"), &s, false);
        let t = text(&r);
        assert!(
            t.contains(
                r#"settle_subscription_exhausted_total{namespace="shop",subscription="orders"} 2"#
            ),
            "{t}"
        );
        assert!(
            t.contains(
                r#"settle_subscription_exhausting{namespace="shop",subscription="orders"} 0"#
            ),
            "{t}"
        );
        // The same object again: never back.
        s.counters.exhausted = 1;
        m.show("shop", "orders", Some("uid-2"), &s, false);
        assert!(text(&r).contains(
            r#"settle_subscription_exhausted_total{namespace="shop",subscription="orders"} 2"#
        ));
    }
}
