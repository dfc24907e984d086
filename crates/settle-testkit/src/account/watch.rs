//! The watcher of a Subscription's `status.stats`, the checks that no counter it saw ever
//! stepped down (per Subscription object), and reading the counters in status.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::Api;
use settle::api::{ConsumerStats, Subscription};
use settle_operator::account::ledger::dominates;

/// What the watcher saw: `(uid, counters)` of every status polled, in order.
pub type Seen = Arc<Mutex<Vec<(String, ConsumerStats)>>>;

/// Polls Subscription `name`'s `status.stats` every 100 ms until aborted.
pub fn watch(api: &Api<Subscription>, name: &str) -> (Seen, tokio::task::JoinHandle<()>) {
    let seen: Seen = Arc::default();
    let (api, out, name) = (api.clone(), seen.clone(), name.to_string());
    let task = tokio::spawn(async move {
        loop {
            if let Ok(s) = api.get(&name).await
                && let Some(stats) = s.status.and_then(|st| st.stats)
            {
                let uid = s.metadata.uid.unwrap_or_default();
                out.lock().expect("seen").push((uid, stats.counters));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    (seen, task)
}

/// No counter went down between two statuses of the same object.
pub fn assert_never_decreased(seen: &Seen) {
    let seen = seen.lock().expect("seen");
    assert!(!seen.is_empty(), "the watcher saw no status at all");
    for pair in seen.windows(2) {
        if pair[0].0 == pair[1].0 {
            assert!(
                dominates(&pair[1].1, &pair[0].1),
                "a counter went down in status: {:?} then {:?}",
                pair[0].1,
                pair[1].1
            );
        }
    }
}

/// As [`assert_never_decreased`], where the watcher may have seen no status stats at all.
pub fn assert_never_decreased_or_empty(seen: &Seen) {
    if !seen.lock().expect("seen").is_empty() {
        assert_never_decreased(seen);
    }
}

/// Subscription `name`'s counters in status, `None` while status has none (or it cannot be
/// read).
pub async fn reported_in(api: &Api<Subscription>, name: &str) -> Option<ConsumerStats> {
    api.get(name)
        .await
        .ok()
        .and_then(|s| s.status)
        .and_then(|s| s.stats)
        .map(|s| s.counters)
}

/// Subscription `name`'s counters in status (zero while status has none).
pub async fn stats_in(api: &Api<Subscription>, name: &str) -> ConsumerStats {
    reported_in(api, name).await.unwrap_or_default()
}
