//! What the two report-queue keepers ([`super::rabbitmq`], [`super::sqs`]) share, written once:
//! the Backend's Subscriptions now, a Subscription's account opened from its snapshot (an
//! earlier object's snapshot told apart), one
//! report judged and counted, a save's outcome counted and said once (log and Event), and the
//! queue's gauges read once per stats interval within the round's budget.
//!
//! It must not talk to a broker (each keeper reads and writes its own queues), decide counts
//! (that is the ledger) nor write status (that is the writer, through [`super::show`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::runtime::reflector::Store;

use super::Config;
use super::ledger::{Account, Outcome, Snapshot};
use super::metrics::Metrics;
use super::status::{self, LossLog, Trouble};
use super::writer::Writer;
use settle::api::Subscription;
use settle::bus::report::{StatsReport, now_ms};

/// A Subscription (or a Backend), by namespace and name.
pub type SubKey = (String, String);

/// `namespace/name`, as logs name a Subscription.
pub fn who(key: &SubKey) -> String {
    format!("{}/{}", key.0, key.1)
}

/// Whether the reconcile made the Subscription's queue (its consumer is in status): only then
/// is anything delivered to count, and only then are the account's own queues made for it.
pub fn has_queue(sub: &Subscription) -> bool {
    sub.status
        .as_ref()
        .and_then(|s| s.consumer.as_ref())
        .is_some()
}

/// The Subscriptions of Backend `backend` now.
pub fn members(subs: &Store<Subscription>, backend: &SubKey) -> HashMap<SubKey, Arc<Subscription>> {
    subs.state()
        .into_iter()
        .filter(|s| {
            s.namespace().as_deref() == Some(backend.0.as_str())
                && s.spec.backend_ref.name == backend.1
        })
        .map(|s| ((backend.0.clone(), s.name_any()), s))
        .collect()
}

/// The account of `sub` restored from its snapshot (`ledger`, empty when none was saved): never
/// below what status shows (the floor, whose exhausted total `loss` notes now), claimed for this
/// object, hearing from now on.
pub fn open(sub: &Subscription, ledger: Snapshot, loss: &mut LossLog, config: &Config) -> Account {
    let floor = sub
        .status
        .as_ref()
        .and_then(|s| s.stats.as_ref())
        .map(|s| s.counters)
        .unwrap_or_default();
    loss.observe(now_ms(), floor.exhausted, config.loss_window);
    let mut account = Account::restore(ledger, floor);
    account.claim(sub.metadata.uid.clone());
    // Nothing was heard before now: an instance of the snapshot is silent from now on (its
    // reports waited while no keeper read them, C16).
    account.deaf_until(now_ms());
    account
}

/// Whether a saved snapshot (its `ledger`) is of an earlier object of `sub`'s name, not this
/// one's (semantics C15); said (logged) when it is: the new object's account starts at zero.
pub fn earlier_object(ledger: &Snapshot, sub: &Subscription, who: &str) -> bool {
    let earlier = !ledger.persisted.belongs_to(sub.metadata.uid.as_deref());
    if earlier {
        tracing::info!(subscription = %who, "the saved ledger is an earlier object's of the same name: the new object's account starts at zero");
    }
    earlier
}

/// A report's body parsed, or `None` when it is larger than `--max-report-bytes` (then it is
/// not read at all).
pub fn parse(config: &Config, body: &[u8]) -> Option<Result<StatsReport, serde_json::Error>> {
    if config.limits.too_large(body.len()) {
        None
    } else {
        Some(serde_json::from_slice::<StatsReport>(body))
    }
}

/// A report refused (`why`: past the account's bounds, misfiled, a wrong writer): counted in
/// `settle_account_reports_total` and logged, never counted in the account.
pub fn refused(metrics: &Metrics, who: &str, why: &str) {
    metrics.reports.with_label_values(&[why]).inc();
    tracing::warn!(subscription = %who, reason = why, "a stats report past the account's bounds: dropped");
}

/// Counts one report the keeper did not refuse (or could not read) into `account`, with its
/// outcome in `settle_account_reports_total`. Returns whether the account counted it (then the
/// snapshot changed and the counters are shown).
pub fn count(
    metrics: &Metrics,
    who: &str,
    account: &mut Account,
    report: Result<StatsReport, serde_json::Error>,
) -> bool {
    let mut counted = false;
    let label = match report {
        Err(e) => {
            tracing::warn!(subscription = %who, error = %e, "a stats report is unreadable: skipped");
            "unreadable"
        }
        Ok(r) => match account.report(&r) {
            Outcome::Counted => {
                counted = true;
                "counted"
            }
            Outcome::Stale => "stale",
            Outcome::OtherObject => "other_object",
            Outcome::UnknownVersion => {
                tracing::warn!(subscription = %who, version = r.version, "a stats report of a version this operator does not know: skipped (upgrade the operator)");
                "unknown_version"
            }
        },
    };
    metrics.reports.with_label_values(&[label]).inc();
    counted
}

/// A snapshot was saved: counted, and said (log and a Normal Event) when the save before it
/// had failed.
pub fn saved(
    writer: &Writer,
    metrics: &Metrics,
    who: &str,
    sub: Option<&Arc<Subscription>>,
    trouble: &mut Trouble,
) {
    metrics.saves.with_label_values(&["ok"]).inc();
    if trouble.unsaved.take().is_some() {
        tracing::info!(subscription = %who, "the Subscription's ledger is saved again");
        if let Some(sub) = sub {
            writer.event(
                sub,
                false,
                "LedgerSaved",
                "the account's ledger is saved on the broker again".into(),
            );
        }
    }
}

/// A snapshot could not be saved (`error`, kept in `Accounted` until a save goes through):
/// counted, and said once (log and a Warning Event) when the save before it went through;
/// `held` says what waits meanwhile. Returns whether it was said now (the first failure).
pub fn not_saved(
    writer: &Writer,
    metrics: &Metrics,
    who: &str,
    sub: Option<&Arc<Subscription>>,
    trouble: &mut Trouble,
    error: String,
    held: &str,
) -> bool {
    metrics.saves.with_label_values(&["error"]).inc();
    let first = trouble.unsaved.is_none();
    if first {
        tracing::warn!(subscription = %who, error = %error, "cannot save the Subscription's ledger; {held}");
        if let Some(sub) = sub {
            writer.event(sub, true, status::reasons::LEDGER_NOT_SAVED, format!("the account's ledger cannot be saved on the broker ({error}); counts are still shown and nothing is lost meanwhile"));
        }
    }
    trouble.unsaved = Some(error);
    first
}

/// A Subscription queue's gauges (pending, unacknowledged) as last read, and when they were
/// read and written alone.
#[derive(Default)]
pub struct Gauges {
    pub read: Option<(u64, u64)>,
    at: Option<Instant>,
    /// The last gauges-only write (a Subscription whose runtime has not reported).
    pub written: Option<Instant>,
}

impl Gauges {
    /// Whether this round reads them: once per `interval`, while the round's `budget` (see
    /// `show::gauge_budget`) lasts, which this counts down.
    pub fn due(&mut self, budget: &mut usize, interval: Duration) -> bool {
        if *budget > 0 && self.at.is_none_or(|t| t.elapsed() >= interval) {
            *budget -= 1;
            self.at = Some(Instant::now());
            true
        } else {
            false
        }
    }

    /// Notes what a read returned (no queue: zero); a failed read keeps the last gauges.
    pub fn note(&mut self, who: &str, got: Result<Option<(u64, u64)>, impl std::fmt::Display>) {
        match got {
            Ok(g) => self.read = Some(g.unwrap_or((0, 0))),
            Err(e) => {
                tracing::debug!(subscription = %who, error = %e, "cannot read the queue's gauges")
            }
        }
    }
}
