//! What a keeper hands the writer for one Subscription, and when: the account's stats and
//! conditions (`Exhausting` from the loss log, `Stranding`), the `settle_subscription_*`
//! metrics, and a status patch only when what the Subscription shows differs, at most once per
//! stats interval. Every keeper (NATS, RabbitMQ) decides through [`show`], so all show alike.
//!
//! It must not count (the ledger does) nor write status itself (the writer does).

use std::time::Instant;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::Config;
use super::metrics::Metrics;
use super::status::{self, LossLog};
use super::writer::{Write, Writer};
use crate::api::{Subscription, SubscriptionStats};

/// What every Subscription of one keeper's round shares.
pub struct Round<'a> {
    pub writer: &'a Writer,
    pub metrics: &'a Metrics,
    pub config: &'a Config,
    /// Whether the Backend's broker can spend a last attempt no handler saw (see `status::wants`).
    pub unseen_attempts: bool,
    /// Now, in Unix ms and as the time written.
    pub now_ms: u64,
    pub stamp: &'a Time,
}

/// One Subscription's showing: its loss log (persisted with its ledger) and its last write.
#[derive(Default)]
pub struct Showing {
    pub loss: LossLog,
    pub last_write: Option<Instant>,
}

/// Shows `stats` for `sub` (namespace, name): notes the exhausted total in the loss log, sets the
/// metrics, and sends a patch when status differs and the interval since the last write has
/// passed. Returns whether the loss log changed (then it is persisted with the ledger).
pub fn show(
    round: &Round<'_>,
    key: &(String, String),
    sub: &Subscription,
    stats: SubscriptionStats,
    showing: &mut Showing,
) -> bool {
    let config = round.config;
    let before = showing.loss.clone();
    showing
        .loss
        .observe(round.now_ms, stats.counters.exhausted, config.loss_window);
    let loss_changed = showing.loss != before;
    let lost = showing.loss.lost_within(round.now_ms, config.loss_window);
    let wants = status::wants(&stats, lost, config.loss_window, round.unseen_attempts);
    round.metrics.show(&key.0, &key.1, &stats, lost > 0);

    let current = sub.status.as_ref();
    let existing = current.map(|s| s.conditions.as_slice()).unwrap_or_default();
    let differs = current.and_then(|s| s.stats.as_ref()) != Some(&stats)
        || status::conditions_differ(existing, &wants);
    let due = showing
        .last_write
        .is_none_or(|t| t.elapsed() >= config.stats_interval);
    if differs && due {
        showing.last_write = Some(Instant::now());
        round.writer.send(Write {
            namespace: key.0.clone(),
            name: key.1.clone(),
            body: status::patch(
                &stats,
                &wants,
                existing,
                sub.metadata.generation,
                round.stamp,
            ),
        });
    }
    loss_changed
}
