//! What the ledger keeps and answers: the last report counted from each instance life
//! ([`Seen`]), what is persisted beside the reports ([`Persisted`], with the broker's tally and
//! a lost source), the whole account where reports are consumed ([`Snapshot`]), and what became
//! of a report or a broker observation.
//!
//! Pure data, as serialized on the broker (a field renamed here is a ledger an older operator
//! cannot read): it must not count (that is [`super::Account`]).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use settle::api::{ConsumerStats, Mode};
use settle::bus::report::StatsReport;

/// How many exhausted messages (stream sequences) are remembered to count each once.
pub const REMEMBERED_EXHAUSTED: usize = 1024;

/// How many folded instances are remembered (for growth after a fold); older ones are dropped,
/// their totals stay in `retired`.
pub const REMEMBERED_FOLDS: usize = 256;

/// What became of one report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Its counters are in the account now (something may have grown).
    Counted,
    /// Not newer than what was already counted for its instance: ignored.
    Stale,
    /// A format version this operator does not know: skipped (log it).
    UnknownVersion,
    /// It names another Subscription object (an earlier one of the same name): never counted
    /// here (drop it).
    OtherObject,
}

/// Why a report is not believed, whoever wrote it (semantics C19): counting it would freeze
/// its instance's counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Implausible {
    /// Its `sequence` is past the last one counted for its instance name by more than the bound.
    SequenceJump,
    /// Its `startedAtMs` or `reportedAtMs` is later than now plus the clock skew allowed.
    FromTheFuture,
}

impl Implausible {
    /// The `outcome` label of `settle_account_reports_total` for a report dropped so.
    pub fn label(self) -> &'static str {
        match self {
            Implausible::SequenceJump => "sequence_jump",
            Implausible::FromTheFuture => "from_the_future",
        }
    }
}

/// The last report counted from one instance life.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Seen {
    pub sequence: u64,
    pub reported_at_ms: u64,
    /// When this life started counting (tells two lives of one instance name apart).
    #[serde(default)]
    pub started_at_ms: u64,
    /// The life runs AtMostOnce (its unfinished attempts are Lost, not Released).
    #[serde(default)]
    pub at_most_once: bool,
    pub stats: ConsumerStats,
    /// Attempts this life had in flight when it was folded, counted then as given up; a later
    /// report of the same life settles them against this credit first (only on folded lives).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub credit: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Seen {
    pub(super) fn of(r: &StatsReport) -> Seen {
        Seen {
            sequence: r.sequence,
            reported_at_ms: r.reported_at_ms,
            started_at_ms: r.started_at_ms,
            at_most_once: r.mode == Mode::AtMostOnce,
            stats: r.stats,
            credit: 0,
        }
    }

    /// Attempts offered to this life and not (yet) delivered, released or lost.
    pub(super) fn in_flight(&self) -> u64 {
        let s = &self.stats;
        s.offered.saturating_sub(
            s.delivered
                .saturating_add(s.released)
                .saturating_add(s.lost),
        )
    }

    /// This life's counters with its unfinished attempts counted as given up (it has ended).
    pub(super) fn ended(&self) -> ConsumerStats {
        let mut s = self.stats;
        let gap = self.in_flight();
        if self.at_most_once {
            s.lost = s.lost.saturating_add(gap);
        } else {
            s.released = s.released.saturating_add(gap);
        }
        s
    }
}

/// What the operator keeps between its own restarts, beside the reports: the folded instances.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Persisted {
    /// The Subscription object (UID) this account belongs to; absent in ledgers saved before
    /// accounts were bound to objects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// The sum of every folded instance's counters.
    pub retired: ConsumerStats,
    /// The most recently folded instances and what was counted of them.
    pub folded: BTreeMap<String, Seen>,
    /// What the broker's advisories counted.
    #[serde(default)]
    pub broker: BrokerTally,
    /// Added to what is counted, per counter, since a source was lost (semantics C17).
    #[serde(default, skip_serializing_if = "is_default")]
    pub offset: ConsumerStats,
    /// The last loss of a source, if any: what was lost, when, and the lives counted then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<Loss>,
}

fn is_default(s: &ConsumerStats) -> bool {
    *s == ConsumerStats::default()
}

/// Which source of the account was lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Source {
    /// The saved ledger (folded instances, the broker's tally, an earlier offset): missing or
    /// unreadable.
    Ledger,
    /// The runtime's reports: what they sum to with the ledger is below what status showed.
    Reports,
}

/// A source lost, and what the account knew when it found out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Loss {
    pub source: Source,
    /// When the loss was found (Unix ms).
    pub at_ms: u64,
    /// The lives (instance, `startedAtMs`) whose counts are in the account since the loss: the
    /// ones counted when it was found, and each charged against the offset since. Any other life
    /// started before the loss is charged when it first reports.
    #[serde(default)]
    pub known: BTreeSet<(String, u64)>,
}

/// Lives remembered in [`Loss::known`], at most (the oldest lives are forgotten first).
pub const REMEMBERED_LIVES: usize = 1024;

impl Persisted {
    /// Whether this saved ledger may be resumed by the object `uid`: it names no object (saved
    /// before accounts were bound to objects) or names this one.
    pub fn belongs_to(&self, uid: Option<&str>) -> bool {
        match (&self.uid, uid) {
            (Some(mine), Some(theirs)) => mine == theirs,
            _ => true,
        }
    }
}
/// The broker's count of exhausted messages, from the advisories the operator captures.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BrokerTally {
    /// Messages whose attempts ran out, each counted once.
    pub exhausted: u64,
    /// The capture sequences of the advisories applied most recently: one of them coming again
    /// (redelivered after a restart, in any order) is skipped.
    pub applied: VecDeque<u64>,
    /// The most recently counted messages (newest last): by stream sequence on NATS, by
    /// [`message_key`] of the message id where dead letters are watched (RabbitMQ, SQS).
    pub recent: VecDeque<u64>,
}

/// What became of one broker observation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokerOutcome {
    /// A message newly counted Exhausted.
    Counted,
    /// The advisory was applied before (a redelivery from the capture).
    Replayed,
    /// The message was already counted (by another advisory).
    Duplicate,
}

/// The whole account of one Subscription: what is persisted and the live instances' latest
/// reports. Kept where reports are consumed and acknowledged (RabbitMQ), so an acknowledged
/// report is never needed again.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    #[serde(default)]
    pub persisted: Persisted,
    /// Each live instance's latest report counted.
    #[serde(default)]
    pub live: BTreeMap<String, Seen>,
}
