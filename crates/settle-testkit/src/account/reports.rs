//! Runtime stats reports in tests: a report in its wire format, a forgery of a real one, and
//! waiting until the operator dropped reports for a reason.

use std::time::Duration;

use settle::api::ConsumerStats;

use crate::operator::{Operator, poll};

/// Waits until the operator has counted at least `n` reports of `outcome` in
/// `settle_account_reports_total` (a report dropped for that reason).
pub async fn wait_dropped(op: &Operator, outcome: &str, n: f64) {
    poll(
        &format!("settle_account_reports_total{{outcome=\"{outcome}\"}} to reach {n}"),
        Duration::from_secs(30),
        || async {
            match op.metric("settle_account_reports_total", &[("outcome", outcome)]) {
                v if v >= n => Ok(()),
                v => Err(format!("{v}")),
            }
        },
    )
    .await;
}

/// A victim's report `real` (its JSON) with `edits` applied: a forgery of it.
pub fn forged(real: &serde_json::Value, edits: &[(&str, serde_json::Value)]) -> Vec<u8> {
    let mut v = real.clone();
    for (path, value) in edits {
        let mut at = &mut v;
        for part in path.split('.') {
            at = &mut at[part];
        }
        *at = value.clone();
    }
    serde_json::to_vec(&v).expect("a report serialises")
}

/// A runtime's stats report (its documented wire format, docs/stats-report.md) for the
/// AtLeastOnce Subscription `sub` (durable name `durable`) in `ns`, from `instance`: the key it
/// is put at in the NATS bucket `settle-stats`, and its body. The bench and the budget test put
/// them as that many application instances would.
pub fn report_of(
    ns: &str,
    sub: &str,
    durable: &str,
    instance: &str,
    sequence: u64,
    stats: ConsumerStats,
) -> (String, Vec<u8>) {
    let report = settle::bus::report::StatsReport {
        version: settle::bus::report::REPORT_VERSION,
        namespace: ns.to_string(),
        subscription: sub.to_string(),
        subscription_uid: None,
        durable_name: Some(durable.to_string()),
        instance: instance.to_string(),
        backend: "nats".into(),
        mode: settle::api::Mode::AtLeastOnce,
        started_at_ms: 0,
        reported_at_ms: 0,
        sequence,
        stats,
        runtime: Default::default(),
    };
    let body = serde_json::to_vec(&report).expect("a report serialises");
    (report.key(), body)
}

/// The keys of the report bucket `reports` under `prefix` (`<namespace>.<subscription>.`), or
/// why they could not be listed.
pub async fn report_keys(
    reports: &async_nats::jetstream::kv::Store,
    prefix: &str,
) -> Result<Vec<String>, String> {
    use futures::StreamExt;
    Ok(reports
        .keys()
        .await
        .map_err(|e| e.to_string())?
        .filter_map(|k| async move { k.ok() })
        .filter(|k| futures::future::ready(k.starts_with(prefix)))
        .collect()
        .await)
}
