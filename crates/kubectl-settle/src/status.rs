//! `kubectl settle status`: one row per Subscription, from `status.stats` (the account's
//! counters and the broker's gauges) and `status.conditions`, as a table or as JSON.
//!
//! Pure: the Subscriptions and Backends come in already read. It must not count or derive a
//! counter the account did not write: a Subscription without stats shows `-` (JSON `null`).

use serde::Serialize;

use super::conditions;
use settle::api::{Backend, Subscription};
use settle::policy::BackendKind;
use settle_operator::reconcile::conditions::types::READY;

/// One Subscription's account, as `-o json` prints it (field names are stable: camelCase, the
/// counters named as in `status.stats`; `null` where status has no stats yet).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Row {
    pub namespace: String,
    pub name: String,
    /// `spec.backendRef.name`.
    pub backend: String,
    /// The Backend's kind (nats, rabbitmq, sqs, memory); `null` when the Backend is missing.
    pub backend_kind: Option<String>,
    /// The `Ready` condition's status (True, False, Unknown); `null` before it is written.
    pub ready: Option<String>,
    pub offered: Option<u64>,
    pub delivered: Option<u64>,
    pub acked: Option<u64>,
    pub nacked: Option<u64>,
    pub silent: Option<u64>,
    pub refused: Option<u64>,
    pub released: Option<u64>,
    pub lost: Option<u64>,
    pub exhausted: Option<u64>,
    pub stranded: Option<u64>,
    /// The broker's gauges: not yet delivered, and delivered and not yet settled.
    pub pending: Option<u64>,
    pub ack_pending: Option<u64>,
    /// `status.statsUpdatedAt`, RFC 3339.
    pub stats_updated_at: Option<String>,
    /// The conditions that are not healthy (and any of a type this plugin does not know).
    pub conditions: Vec<ShownCondition>,
}

/// A condition as `-o json` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ShownCondition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    pub reason: String,
    pub message: String,
}

/// The rows, sorted by namespace and name. `backends` are those the Subscriptions may name
/// (their kind fills `backendKind`).
pub fn rows(subs: &[Subscription], backends: &[Backend]) -> Vec<Row> {
    let mut rows: Vec<Row> = subs
        .iter()
        .map(|sub| {
            let namespace = sub.metadata.namespace.clone().unwrap_or_default();
            let backend = sub.spec.backend_ref.name.clone();
            let backend_kind = backends
                .iter()
                .find(|b| {
                    b.metadata.namespace.as_deref() == Some(namespace.as_str())
                        && b.metadata.name.as_deref() == Some(backend.as_str())
                })
                .and_then(|b| BackendKind::of(&b.spec))
                .map(|k| k.name().to_string());
            let status = sub.status.as_ref();
            let conds = status.map(|s| s.conditions.as_slice()).unwrap_or_default();
            let stats = status.and_then(|s| s.stats.as_ref());
            let counter = |f: fn(&settle::api::SubscriptionStats) -> u64| stats.map(f);
            Row {
                name: sub.metadata.name.clone().unwrap_or_default(),
                namespace,
                backend,
                backend_kind,
                ready: settle::api::condition::find(conds, READY).map(|c| c.status.clone()),
                offered: counter(|s| s.counters.offered),
                delivered: counter(|s| s.counters.delivered),
                acked: counter(|s| s.counters.settlement.acked),
                nacked: counter(|s| s.counters.settlement.nacked),
                silent: counter(|s| s.counters.settlement.silent),
                refused: counter(|s| s.counters.settlement.refused),
                released: counter(|s| s.counters.released),
                lost: counter(|s| s.counters.lost),
                exhausted: counter(|s| s.counters.exhausted),
                stranded: counter(|s| s.counters.stranded),
                pending: counter(|s| s.pending),
                ack_pending: counter(|s| s.ack_pending),
                stats_updated_at: status
                    .and_then(|s| s.stats_updated_at.as_ref())
                    .map(|t| t.0.to_string()),
                conditions: conditions::shown(conds)
                    .into_iter()
                    .map(|c| ShownCondition {
                        type_: c.type_.clone(),
                        status: c.status.clone(),
                        reason: c.reason.clone(),
                        message: c.message.clone(),
                    })
                    .collect(),
            }
        })
        .collect();
    rows.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    rows
}

/// The table: kubectl's look (upper-case headers, columns three spaces apart). `all` adds
/// NAMESPACE first; `wide` adds KIND, OFFERED, RELEASED, LOST, REFUSED and the reasons.
pub fn table(rows: &[Row], all: bool, wide: bool) -> String {
    let mut lines: Vec<Vec<String>> = vec![header(all, wide)];
    lines.extend(rows.iter().map(|r| cells(r, all, wide)));
    aligned(&lines)
}

/// The header's cells, in the columns [`cells`] fills.
fn header(all: bool, wide: bool) -> Vec<String> {
    let mut header: Vec<&str> = Vec::new();
    if all {
        header.push("NAMESPACE");
    }
    header.extend(["NAME", "BACKEND"]);
    if wide {
        header.push("KIND");
    }
    header.push("READY");
    if wide {
        header.push("OFFERED");
    }
    header.extend(["DELIVERED", "ACKED", "NACKED", "SILENT"]);
    if wide {
        header.extend(["REFUSED", "RELEASED", "LOST"]);
    }
    header.extend([
        "EXHAUSTED",
        "STRANDED",
        "PENDING",
        "ACKPENDING",
        "CONDITIONS",
    ]);
    header.iter().map(|h| h.to_string()).collect()
}

/// One row's cells, in the columns of [`header`]: `-` where there is no value.
fn cells(r: &Row, all: bool, wide: bool) -> Vec<String> {
    let n = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
    let mut line = Vec::new();
    if all {
        line.push(r.namespace.clone());
    }
    line.extend([r.name.clone(), r.backend.clone()]);
    if wide {
        line.push(r.backend_kind.clone().unwrap_or_else(|| "-".into()));
    }
    line.push(r.ready.clone().unwrap_or_else(|| "-".into()));
    if wide {
        line.push(n(r.offered));
    }
    line.extend([n(r.delivered), n(r.acked), n(r.nacked), n(r.silent)]);
    if wide {
        line.extend([n(r.refused), n(r.released), n(r.lost)]);
    }
    line.extend([
        n(r.exhausted),
        n(r.stranded),
        n(r.pending),
        n(r.ack_pending),
    ]);
    let shown: Vec<String> = r
        .conditions
        .iter()
        .map(|c| conditions::label(&c.type_, &c.status, wide.then_some(c.reason.as_str())))
        .collect();
    line.push(if shown.is_empty() {
        "-".into()
    } else {
        shown.join(",")
    });
    line
}

/// The lines as text: each column as wide as its widest cell, three spaces apart, the last
/// left as it is.
fn aligned(lines: &[Vec<String>]) -> String {
    let columns = lines[0].len();
    let widths: Vec<usize> = (0..columns)
        .map(|i| {
            lines
                .iter()
                .map(|l| l[i].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for line in lines {
        let mut text = String::new();
        for (i, cell) in line.iter().enumerate() {
            if i + 1 == columns {
                text.push_str(cell);
            } else {
                text.push_str(&format!("{cell:<w$}   ", w = widths[i]));
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::conditions::cond;
    use super::*;
    use settle::api::{ConsumerStats, Settlement, SubscriptionStats, SubscriptionStatus};

    fn sub(ns: &str, name: &str, stats: Option<SubscriptionStats>) -> Subscription {
        let mut s: Subscription = serde_json::from_value(serde_json::json!({
            "apiVersion": "messaging.settle.dev/v1alpha1",
            "kind": "Subscription",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"backendRef": {"name": "nats"}, "pattern": "orders.>"},
        }))
        .expect("a Subscription");
        s.status = Some(SubscriptionStatus {
            stats,
            conditions: vec![
                cond("Accepted", "True", "Valid", ""),
                cond("Ready", "True", "ConsumerReady", ""),
                cond("Exhausting", "True", "MessagesExhausted", "10 ran out"),
            ],
            ..Default::default()
        });
        s
    }

    fn stats() -> SubscriptionStats {
        SubscriptionStats {
            counters: ConsumerStats {
                offered: 31,
                delivered: 30,
                released: 1,
                settlement: Settlement {
                    acked: 17,
                    nacked: 12,
                    silent: 1,
                    refused: 0,
                },
                exhausted: 10,
                stranded: 2,
                ..Default::default()
            },
            pending: 5,
            ack_pending: 3,
        }
    }

    #[test]
    fn the_table_shows_each_counter_in_its_column_and_only_the_troubles() {
        let rows = rows(&[sub("shop", "orders", Some(stats()))], &[]);
        let text = table(&rows, false, false);
        let lines: Vec<&str> = text.lines().collect();
        let header: Vec<&str> = lines[0].split_whitespace().collect();
        assert_eq!(
            header,
            [
                "NAME",
                "BACKEND",
                "READY",
                "DELIVERED",
                "ACKED",
                "NACKED",
                "SILENT",
                "EXHAUSTED",
                "STRANDED",
                "PENDING",
                "ACKPENDING",
                "CONDITIONS"
            ]
        );
        let row: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            row,
            [
                "orders",
                "nats",
                "True",
                "30",
                "17",
                "12",
                "1",
                "10",
                "2",
                "5",
                "3",
                "Exhausting"
            ]
        );
    }

    #[test]
    fn a_subscription_without_stats_shows_dashes_not_zeros() {
        let rows = rows(&[sub("shop", "fresh", None)], &[]);
        assert_eq!(rows[0].delivered, None);
        let text = table(&rows, true, true);
        let row: Vec<&str> = text
            .lines()
            .nth(1)
            .expect("a row")
            .split_whitespace()
            .collect();
        assert_eq!(
            row[..4],
            ["shop", "fresh", "nats", "-"],
            "no Backend: kind -"
        );
        // NAMESPACE NAME BACKEND KIND READY, then the twelve counters and gauges (OFFERED to
        // ACKPENDING), then CONDITIONS.
        assert_eq!(row.len(), 18, "{row:?}");
        assert!(row[5..17].iter().all(|c| *c == "-"), "{row:?}");
        assert_eq!(row[17], "Exhausting:MessagesExhausted");
    }

    #[test]
    fn rows_are_sorted_by_namespace_then_name() {
        let rows = rows(
            &[
                sub("b", "a", None),
                sub("a", "z", None),
                sub("a", "b", None),
            ],
            &[],
        );
        let names: Vec<(&str, &str)> = rows
            .iter()
            .map(|r| (r.namespace.as_str(), r.name.as_str()))
            .collect();
        assert_eq!(names, [("a", "b"), ("a", "z"), ("b", "a")]);
    }
}
