//! What the account writes into a Subscription's status, and when: `status.stats` (the ledger's
//! totals and the broker's gauges), `statsUpdatedAt`, and the conditions `Exhausting` (messages
//! ran out of attempts within the loss window: data loss), `Stranding` (messages were declined
//! where the broker could not take them back) and `Accounted` (whether the account is kept
//! whole: saved on the broker, nothing missed from the capture, no source lost within the loss
//! window). `Stalled`, written beside them, is decided in [`super::stall`].
//!
//! Pure: no I/O and no clock (times come in as arguments). It must not count (that is the
//! ledger) nor send anything (that is the writer).

use std::borrow::Cow;
use std::collections::VecDeque;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde::{Deserialize, Serialize};

use super::ledger::Source;
use settle::api::SubscriptionStats;
use settle::api::condition::{self, Status, Want};

/// The field manager of every status write the account makes.
pub const FIELD_MANAGER: &str = "settle-account";

/// Condition types this writer owns.
pub mod types {
    /// Exhausted grew within the loss window: messages were dropped or dead-lettered.
    pub const EXHAUSTING: &str = "Exhausting";
    /// Stranded is above zero: declined messages the broker could not take back.
    pub const STRANDING: &str = "Stranding";
    /// The account is kept whole (False: a save failed, advisories were missed, reports were
    /// dropped); on a Backend, written only once False: no report naming no Subscription of it
    /// was dropped within the loss window.
    pub const ACCOUNTED: &str = "Accounted";
}

/// Their reasons.
pub mod reasons {
    /// Exhausting=True: messages ran out of attempts (maxDeliver) or were dead-lettered within
    /// the loss window; the message says how many, and how many in all.
    pub const MESSAGES_EXHAUSTED: &str = "MessagesExhausted";
    /// Exhausting=False: nothing ran out of attempts within the loss window.
    pub const NO_RECENT_LOSS: &str = "NoRecentLoss";
    /// Stranding=True: declined messages the broker could not take back (Stranded above zero).
    pub const MESSAGES_STRANDED: &str = "MessagesStranded";
    /// Stranding=False: no message is stranded.
    pub const NONE_STRANDED: &str = "NoneStranded";
    /// Accounted=True: every source of the account was read and its ledger saved.
    pub const KEPT: &str = "Kept";
    /// Accounted=False: the last save of the ledger failed (tried again every round); the
    /// counters shown hold, and may be counted again from the last save after a restart.
    pub const LEDGER_NOT_SAVED: &str = "LedgerNotSaved";
    /// Accounted=False: loss advisories were dropped before the operator counted them (the
    /// capture's limits, or its hold of advisories read before the status named the consumer),
    /// until the loss window passes with no new gap.
    pub const CAPTURE_GAP: &str = "CaptureGap";
    /// Accounted=False: a source of the account was lost within the loss window (semantics
    /// C17); counting goes on from what status showed.
    pub const SOURCE_LOST: &str = "SourceLost";
    /// Accounted=False: the operator's copy may not hold every dead letter (RabbitMQ: the copy
    /// queue lost or full, or the exchange cannot be copied whole), so Exhausted may undercount.
    pub const DEAD_LETTERS_MISSED: &str = "DeadLettersMissed";
    /// Accounted=False: the queue the runtime reports to does not exist on the broker (SQS:
    /// deleted there); its reports wait in the applications until it is made again.
    pub const REPORT_QUEUE_MISSING: &str = "ReportQueueMissing";
    /// Accounted=False: the store the runtime reports to is full (NATS: the `settle-stats`
    /// bucket at its size bound), so the broker refuses new reports; named with its fill.
    pub const REPORT_STORE_FULL: &str = "ReportStoreFull";
    /// Accounted=False: stats reports of this Subscription were dropped by the account's bounds
    /// (too many instances, a clock ahead, a sequence jump, misfiled, too large, a writer not
    /// listed), with the last reason and how many, until the loss window passes with no new one.
    pub const REPORTS_DROPPED: &str = "ReportsDropped";
}

/// What keeps one Subscription's account from being whole now, for `Accounted`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Trouble {
    /// The last save of its ledger failed, with why (it is tried again every round).
    pub unsaved: Option<String>,
    /// Advisories dropped before the operator counted them, in all: from the capture (its
    /// limits) while this Subscription was counted, or, read before its status named its
    /// consumer, from the keeper's hold of such advisories (full, or its grace over).
    pub missed_advisories: u64,
    /// A source of the account was lost within the loss window (semantics C17): counting goes
    /// on from what status showed.
    pub source_lost: Option<Source>,
    /// Dead letters the operator's copy may not hold (RabbitMQ), with why: the copy queue was
    /// lost or full, or the dead-letter exchange cannot be copied whole. Exhausted may then
    /// undercount the last attempts a crash spent.
    pub dead_letters: Option<String>,
    /// The queue the runtime reports to does not exist on the broker (SQS: deleted there),
    /// named: its reports wait in the applications until it is made again.
    pub queue_missing: Option<String>,
    /// The store the runtime reports to is full (NATS: the report bucket), said with its name
    /// and fill: new reports are refused by the broker until it has room.
    pub store_full: Option<String>,
    /// Reports of this Subscription the account's bounds dropped, since `Accounted` last said
    /// none (in memory: a report still past a bound is dropped again after a restart).
    pub dropped_reports: Option<DroppedReports>,
}

/// Reports of one Subscription dropped by the account's bounds: how many, the last reason (a
/// `settle_account_reports_total` outcome) and when (Unix ms).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DroppedReports {
    pub count: u64,
    pub reason: &'static str,
    pub at_ms: u64,
}

impl DroppedReports {
    /// One more report dropped in `slot`, for `reason`, at `now_ms`.
    pub fn note(slot: &mut Option<DroppedReports>, reason: &'static str, now_ms: u64) {
        let count = slot.as_ref().map_or(0, |d| d.count) + 1;
        *slot = Some(DroppedReports {
            count,
            reason,
            at_ms: now_ms,
        });
    }

    /// Drops in `slot` said longer than `window` ago are past: `Accounted` no longer says them.
    pub fn forget_before(slot: &mut Option<DroppedReports>, now_ms: u64, window: Duration) {
        let window = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        if slot
            .as_ref()
            .is_some_and(|d| now_ms.saturating_sub(d.at_ms) >= window)
        {
            *slot = None;
        }
    }

    /// What `Accounted` says of them after the sentence naming whose they are: the last
    /// reason, its metric and when the condition turns True again (`w`, the window).
    fn said(&self, w: &str) -> String {
        format!(
            "the last as {} ({}): what they carried is not counted. See \
             settle_account_reports_total{{outcome=\"{}\"}} and the operator's WARN lines. \
             This condition turns True by itself {w} after the last drop.",
            self.reason,
            drop_reason_text(self.reason),
            self.reason
        )
    }
}

impl Trouble {
    /// One more report dropped, for `reason`, at `now_ms`.
    pub fn report_dropped(&mut self, reason: &'static str, now_ms: u64) {
        DroppedReports::note(&mut self.dropped_reports, reason, now_ms);
    }

    /// Drops said longer than `window` ago are past: `Accounted` no longer says them.
    pub fn forget_dropped_before(&mut self, now_ms: u64, window: Duration) {
        DroppedReports::forget_before(&mut self.dropped_reports, now_ms, window);
    }
}

/// Exhausted totals over time: enough to say how many ran out within the loss window, kept
/// with the ledger so an operator restart does not forget a recent loss.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LossLog {
    /// `(unix ms, exhausted total from then on)`, oldest first; the first is the baseline.
    samples: VecDeque<(u64, u64)>,
}

impl LossLog {
    /// Notes the exhausted total at `now_ms` (kept only when it grew), and forgets what lies
    /// before the window except the one sample that says what the total was when it began.
    pub fn observe(&mut self, now_ms: u64, total: u64, window: Duration) {
        match self.samples.back() {
            Some(&(_, last)) if last >= total => {}
            _ => self.samples.push_back((now_ms, total)),
        }
        let start = now_ms.saturating_sub(millis(window));
        while self.samples.len() > 1 && self.samples[1].0 <= start {
            self.samples.pop_front();
        }
    }

    /// How many ran out within the window ending at `now_ms`.
    pub fn lost_within(&self, now_ms: u64, window: Duration) -> u64 {
        let start = now_ms.saturating_sub(millis(window));
        let Some(&(_, now_total)) = self.samples.back() else {
            return 0;
        };
        // The total when the window began: the latest sample at or before its start; when every
        // sample is inside it, the first (the baseline when counting began).
        let before = self
            .samples
            .iter()
            .rev()
            .find(|(t, _)| *t <= start)
            .or(self.samples.front())
            .map_or(now_total, |&(_, v)| v);
        now_total.saturating_sub(before)
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A Kubernetes-style rendering of the window (`15m`, `1h`, `90s`).
pub fn window_text(window: Duration) -> String {
    let s = window.as_secs();
    if s > 0 && s.is_multiple_of(3600) {
        format!("{}h", s / 3600)
    } else if s > 0 && s.is_multiple_of(60) {
        format!("{}m", s / 60)
    } else {
        format!("{s}s")
    }
}

/// Whether a backend can spend a last attempt no handler saw (semantics I3, K3), and whether
/// the operator sees such a loss on the broker side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unseen {
    /// It cannot: every loss is one a runtime counted.
    Never,
    /// It can, and the broker's advisories count such losses (NATS JetStream).
    FromAdvisories,
    /// It can, and the operator counts such losses where the broker dead-letters them (a copy
    /// of RabbitMQ's dead-letter exchange, SQS's dead-letter queue).
    FromDeadLetters,
    /// It can, and nothing on the broker side counts them (a RabbitMQ Backend without a
    /// dead-letter exchange).
    Uncounted,
    /// It can, and the operator would count them in the dead-letter queue, but that queue holds
    /// more messages (this many) than the account remembers ids of, so they are not counted
    /// until it holds fewer (SQS).
    TooManyDeadLetters(u64),
}

/// The account's three conditions, as wanted now.
pub fn wants(
    stats: &SubscriptionStats,
    lost_recently: u64,
    window: Duration,
    unseen: Unseen,
    trouble: &Trouble,
) -> [Want; 3] {
    let w = window_text(window);
    let note = unseen_note(unseen);
    [
        exhausting(stats, lost_recently, &w, &note),
        stranding(stats),
        accounted(trouble, &w),
    ]
}

/// What `Exhausting` adds about the last attempts a backend can spend unseen.
fn unseen_note(unseen: Unseen) -> Cow<'static, str> {
    match unseen {
        Unseen::TooManyDeadLetters(depth) => Cow::Owned(format!(
            " On this backend a crash or restart can spend a last attempt no handler saw: such \
                 messages are counted in the dead-letter queue, but it holds {depth} messages, more \
                 than the {} the account remembers, so they are not counted now and Exhausted may \
                 undercount by them. Empty the dead-letter queue (redrive or delete what you \
                 handled) and counting there resumes.",
            super::ledger::REMEMBERED_EXHAUSTED
        )),
        Unseen::Never => Cow::Borrowed(""),
        Unseen::FromAdvisories => Cow::Borrowed(
            " On this backend a restart can spend a last attempt no handler saw: such messages are \
             counted from the broker's advisories, which the operator captures from the moment it \
             manages the Backend; a message that ran out before then is not counted, so Exhausted may \
             undercount for that time.",
        ),
        Unseen::FromDeadLetters => Cow::Borrowed(
            " On this backend a crash or restart can spend a last attempt no handler saw: such \
             messages are counted where the broker dead-letters them, which the operator watches \
             from the moment it manages the Subscription; a message dead-lettered before then is \
             not counted, so Exhausted may undercount for that time.",
        ),
        Unseen::Uncounted => Cow::Borrowed(
            " On this backend a crash or restart can spend a last attempt no handler saw, and the \
             broker reports no such loss to the operator: Exhausted may undercount by the last \
             attempts in flight when an application instance died. On RabbitMQ, set the \
             Backend's spec.rabbitmq.deadLetterExchange: the operator then counts such losses \
             from a copy of what the queue dead-letters.",
        ),
    }
}

/// `Exhausting`: whether messages ran out of attempts within the window (`w`).
fn exhausting(stats: &SubscriptionStats, lost_recently: u64, w: &str, note: &str) -> Want {
    let exhausted = stats.counters.exhausted;
    if lost_recently > 0 {
        Want::new(
            types::EXHAUSTING,
            Status::True,
            reasons::MESSAGES_EXHAUSTED,
            format!(
                "{lost_recently} message(s) ran out of attempts (maxDeliver) in the last {w} \
                 ({exhausted} in all): they were dropped, or dead-lettered where the backend has a \
                 dead-letter target. Find why the handler declines them (its logs), fix it, and \
                 replay them from the stream if they matter.{note}"
            ),
        )
    } else {
        Want::new(
            types::EXHAUSTING,
            Status::False,
            reasons::NO_RECENT_LOSS,
            format!("no message ran out of attempts in the last {w} ({exhausted} in all).{note}"),
        )
    }
}

/// `Stranding`: whether messages were declined with no consumer to take them back.
fn stranding(stats: &SubscriptionStats) -> Want {
    let stranded = stats.counters.stranded;
    if stranded > 0 {
        Want::new(
            types::STRANDING,
            Status::True,
            reasons::MESSAGES_STRANDED,
            format!(
                "{stranded} message(s) were declined while the broker could not take them back \
                 (the consumer was gone): nothing will redeliver them. Check why the consumer \
                 went away (kubectl get events), and republish them if they matter."
            ),
        )
    } else {
        Want::new(
            types::STRANDING,
            Status::False,
            reasons::NONE_STRANDED,
            "no message was stranded.",
        )
    }
}

/// `Accounted`: the first trouble of the account (a save failing, the report queue missing, a
/// source lost within the window `w`, advisories missed, dead letters missed), else kept.
/// A Backend's `Accounted`: stats reports dropped that name no Subscription of it (junk under
/// its namespace, reports of Subscriptions not in the cache beyond the early bound), said while
/// the last came within the window `w`.
pub fn backend_accounted(dropped: Option<&DroppedReports>, w: &str) -> Want {
    match dropped {
        Some(d) => Want::new(
            types::ACCOUNTED,
            Status::False,
            reasons::REPORTS_DROPPED,
            format!(
                "{} stats report(s) under this Backend's namespace that name no Subscription of \
                 it were dropped, {}",
                d.count,
                d.said(w)
            ),
        ),
        None => Want::new(
            types::ACCOUNTED,
            Status::True,
            reasons::KEPT,
            "no stats report naming no Subscription of this Backend was dropped lately.",
        ),
    }
}

fn accounted(trouble: &Trouble, w: &str) -> Want {
    if let Some(why) = &trouble.unsaved {
        Want::new(
            types::ACCOUNTED,
            Status::False,
            reasons::LEDGER_NOT_SAVED,
            format!(
                "the account cannot be saved on the broker ({why}). The counts shown are right, \
                 and nothing is lost: the reports and advisories they hold stay unacknowledged \
                 until the save succeeds (it is tried every second). Check the broker's \
                 JetStream storage and the settle-account bucket."
            ),
        )
    } else if let Some(queue) = &trouble.queue_missing {
        Want::new(
            types::ACCOUNTED,
            Status::False,
            reasons::REPORT_QUEUE_MISSING,
            format!(
                "the report queue {queue} does not exist on the broker (deleted there?). The \
                 applications keep their counts and send them again every interval (reports are \
                 cumulative, so nothing is lost); the operator makes the queue again within \
                 --drift-interval. The counts shown are those received before it went."
            ),
        )
    } else if let Some(store) = &trouble.store_full {
        Want::new(
            types::ACCOUNTED,
            Status::False,
            reasons::REPORT_STORE_FULL,
            format!(
                "the report store is full ({store}): the broker refuses new stats reports, so \
                 this Subscription's counters may stop moving and an instance that stops now may \
                 lose its last report. The operator removes the reports it can never count \
                 (unreadable, too large, misfiled, or of a Subscription gone for \
                 --fold-after); raise --report-bucket-max-bytes (and the NATS account's \
                 JetStream limits), or give each tenant a NATS account of its own so no other \
                 tenant's reports take this room."
            ),
        )
    } else if let Some(source) = trouble.source_lost {
        source_lost(source, w)
    } else if trouble.missed_advisories > 0 {
        let n = trouble.missed_advisories;
        Want::new(
            types::ACCOUNTED,
            Status::False,
            reasons::CAPTURE_GAP,
            format!(
                "{n} advisory(ies) were dropped before the operator counted them (the capture \
                 stream's age or size limit, or, read before this Subscription's status named \
                 its consumer, the operator's hold of such advisories: at most 1,000, for \
                 --unverified-advisory-grace, 15 s by default): \
                 messages whose attempts ran out unseen by any handler may be missing from \
                 Exhausted (at most {n}). Keep the operator running, or raise the capture's \
                 limits (--capture-max-bytes); see settle_account_advisories_total{{kind=\"unverified_dropped\"}}. \
                 This condition turns True by itself {w} after the last gap was found."
            ),
        )
    } else if let Some(why) = &trouble.dead_letters {
        Want::new(
            types::ACCOUNTED,
            Status::False,
            reasons::DEAD_LETTERS_MISSED,
            format!(
                "the operator's copy of the dead-letter exchange may not hold every dead letter \
                 ({why}), so Exhausted may undercount the last attempts a crash spent. The \
                 runtime's own count, and your dead-letter queue, are unaffected."
            ),
        )
    } else if let Some(d) = &trouble.dropped_reports {
        Want::new(
            types::ACCOUNTED,
            Status::False,
            reasons::REPORTS_DROPPED,
            format!(
                "{} stats report(s) of this Subscription were dropped by the account's bounds, {}",
                d.count,
                d.said(w)
            ),
        )
    } else {
        Want::new(
            types::ACCOUNTED,
            Status::True,
            reasons::KEPT,
            "every report and advisory read is counted and saved on the broker.",
        )
    }
}

/// What a report dropped for `reason` means, and what fixes it.
fn drop_reason_text(reason: &str) -> &'static str {
    match reason {
        "too_many_instances" => {
            "more live instances than --max-instances-per-subscription: a crash loop, or a \
             writer inventing instance names"
        }
        "from_the_future" => {
            "an instance's clock is ahead of the operator's by more than --max-clock-skew: fix \
             the node's clock"
        }
        "sequence_jump" => "a sequence past the instance's last by more than --max-sequence-jump",
        "bad_instance" => "an instance name longer than 300 characters",
        "too_large" => "larger than --max-report-bytes",
        "misfiled" => "its body names another Subscription or instance than where it was written",
        "wrong_writer" => "written by a user the Backend's reportUsers do not list",
        "unreadable" => "not a stats report the operator can read",
        "early_dropped" => {
            "of a Subscription not in the operator's cache, beyond --max-early-report-bytes"
        }
        _ => "past a bound of the account",
    }
}

/// `Accounted` when a source of the account was lost (semantics C17), within the window `w`.
fn source_lost(source: Source, w: &str) -> Want {
    let (what, how) = match source {
        Source::Ledger => (
            "the account's saved ledger (bucket settle-account) was missing or unreadable",
            "its folded instances and the broker's tally were gone",
        ),
        Source::Reports => (
            "the runtime's stats reports (bucket settle-stats) were gone",
            "the reports left summed to less than status showed",
        ),
    };
    Want::new(
        types::ACCOUNTED,
        Status::False,
        reasons::SOURCE_LOST,
        format!(
            "{what} when the operator read it ({how}). Counting continues from what status \
             showed: each counter moves on with what is counted from now, none goes down, and \
             offered == delivered + released + lost still holds at rest. What happened while \
             the source was gone (between the last status write and the loss being found) may \
             be missing, Exhausted included. Find what removed it (a broker reset, a deleted \
             bucket); this condition turns True by itself {w} after the loss was found."
        ),
    )
}

/// What the account last wrote (or found) for one Subscription: written again only when this
/// changes.
#[derive(Clone, Debug, PartialEq)]
pub struct Shown {
    pub stats: SubscriptionStats,
    pub conditions: [Want; 3],
}

/// The status a Subscription shows now, as far as the account owns it.
pub fn shown(
    status: Option<&settle::api::SubscriptionStatus>,
) -> Option<(SubscriptionStats, Vec<Condition>)> {
    let s = status?;
    Some((s.stats.clone()?, s.conditions.clone()))
}

/// Whether `want` differs from what the conditions on the object say (ignoring times).
pub fn conditions_differ(existing: &[Condition], want: &[Want]) -> bool {
    want.iter().any(|w| {
        condition::find(existing, w.type_).is_none_or(|c| {
            c.status != w.status.as_str() || c.reason != w.reason || c.message != w.message
        })
    })
}

/// Whether showing `stats` and `want` where status shows `shown` and `existing` is a change that
/// matters, written before every other under the status budget (semantics C21): Exhausted or
/// Stranded grew (data loss, or a decline the broker could not take back), or one of the
/// account's conditions is there with another status (a condition not written yet is not a
/// flip: a new Subscription's first status waits its turn, unless it already shows a loss).
pub fn matters(
    shown: Option<&SubscriptionStats>,
    existing: &[Condition],
    stats: &SubscriptionStats,
    want: &[Want],
) -> bool {
    let was = shown.map(|s| s.counters).unwrap_or_default();
    stats.counters.exhausted > was.exhausted
        || stats.counters.stranded > was.stranded
        || want.iter().any(|w| {
            condition::find(existing, w.type_).is_some_and(|c| c.status != w.status.as_str())
        })
}

/// The status patch (server-side apply body) for `stats` and the account's conditions.
pub fn patch(
    stats: &SubscriptionStats,
    wants: &[Want],
    existing: &[Condition],
    generation: Option<i64>,
    now: &Time,
) -> serde_json::Value {
    let conditions: Vec<Condition> = wants
        .iter()
        .map(|w| condition::settle(existing, w, generation, now))
        .collect();
    serde_json::json!({
        "apiVersion": "messaging.settle.dev/v1alpha1",
        "kind": "Subscription",
        "status": {
            "stats": stats,
            "statsUpdatedAt": now,
            "conditions": conditions,
        }
    })
}

/// The status patch of a Subscription whose runtime has not reported counters: the broker's
/// gauges, and the counters status already shows (`shown`), if any. No counter is invented (none
/// reads as a false zero), and none is removed: a server-side apply drops the fields this field
/// manager owned and no longer sends.
pub fn gauges_patch(
    pending: u64,
    ack_pending: u64,
    shown: Option<&settle::api::ConsumerStats>,
    now: &Time,
) -> serde_json::Value {
    let mut stats = match shown {
        Some(counters) => serde_json::to_value(counters).unwrap_or_else(|_| serde_json::json!({})),
        None => serde_json::json!({}),
    };
    if let Some(map) = stats.as_object_mut() {
        map.insert("pending".into(), pending.into());
        map.insert("ackPending".into(), ack_pending.into());
    }
    serde_json::json!({
        "apiVersion": "messaging.settle.dev/v1alpha1",
        "kind": "Subscription",
        "status": {
            "stats": stats,
            "statsUpdatedAt": now,
        }
    })
}

#[cfg(test)]
mod tests;
