//! The ledger: one Subscription's account, folded from what the runtime reports and what the
//! broker observed, so that every counter is counted once and never goes backwards.
//!
//! Pure: no I/O and no clock (times come in as arguments). The operator feeds it reports read
//! from the stats bucket and the broker's counts, persists [`Persisted`] beside the reports, and
//! writes [`Account::totals`] into status. It must not decide when status is written.
//!
//! The rules (also in the README's counter table):
//! - **One object.** An account belongs to one Subscription object (its UID): a report or a
//!   saved ledger that names another object (an earlier Subscription of the same name, deleted
//!   and applied again) is never counted (semantics C15).
//! - **Runtime counters** (offered … foreignConflicts): the sum over instance lives of each
//!   life's latest report. A report is counted only if its `sequence` is newer than the one
//!   already counted for that life, and each counter of a life only ever rises (per-counter
//!   maximum), so a stale or reordered report lowers nothing.
//! - **Sequences move by a sane step** (semantics C19). A report whose `sequence` is past the
//!   last one counted for its instance name (any life, live or folded) by more than a bound, or
//!   whose life starts or was made later than now (beyond a clock skew), is implausible and
//!   never counted: otherwise one report with `sequence` u64::MAX, or a life started at u64::MAX,
//!   would make every later real report of that instance look old, freezing its counters.
//! - **Lives come and go.** A restarted process is a new instance, or, where a name is reused
//!   (a StatefulSet pod), a new life of it (a newer `startedAtMs`); the old life keeps its last
//!   totals in the sum. Instances silent for longer than the idle limit are folded into a
//!   per-Subscription `retired` total, so the state stays small however often pods restart.
//!   An instance a report came from since the last fold (even one already counted) is not
//!   silent: its newer reports may still wait behind it (an SQS report queue is FIFO per
//!   instance), so it is not folded on an older report's time.
//! - **Dying is accounted.** A life that ends without a last word (SIGKILL) had attempts in
//!   flight at its last report: offered, never delivered, released or lost. When it is folded
//!   (or replaced by a new life), those attempts are counted given up: Released under
//!   AtLeastOnce (the broker offers them again), Lost under AtMostOnce, so offered == delivered +
//!   released + lost holds at rest (semantics I1, C16). A folded life that reports again was
//!   not dead: what it then settles of those attempts is absorbed by that credit first, so
//!   nothing is counted twice.
//! - **Exhausted**: the broker's count (every message whose attempts ran out, including a last
//!   attempt no handler saw) and the runtime's count describe the same messages; the account
//!   takes the larger, never the sum, so nothing is counted twice. The broker's count is itself
//!   deduplicated: one advisory applied twice (redelivered from the capture after a restart, in
//!   any order) is skipped by its capture sequence, and one message reported twice (its attempts ran out, then
//!   a late terminate arrived) is counted once by its stream sequence.
//! - **Never backwards**: every counter is at least what was last published (the floor), so a
//!   lost bucket or a restart of anything cannot lower status.
//! - **A lost source becomes an offset** (semantics C17). When the keeper finds that what was
//!   counted cannot explain what status showed (its ledger gone or unreadable, the reports gone),
//!   counting continues from the floor: `offset = floor - counted` per counter, raised where
//!   needed so the offset itself balances (I1), and totals are `counted + offset`. Every counter
//!   then moves with its growth again, nothing goes down, and I1 holds at rest. A life that
//!   started before the loss and shows up only afterwards (a report that was lost and is written
//!   again, a folded instance whose fold was lost) carried counts status already showed: its
//!   first report is charged against the offset, never counted twice.

use std::collections::{BTreeMap, BTreeSet};

use settle::api::{ConsumerStats, Mode};
use settle::bus::report::{REPORT_VERSION, StatsReport};

mod records;
mod sums;
#[cfg(test)]
mod tests;

pub use records::*;
use sums::{absorb, add, balance, growth, max};
pub use sums::{dominates, message_key};

/// One Subscription's account.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Account {
    live: BTreeMap<String, Seen>,
    persisted: Persisted,
    floor: ConsumerStats,
    /// Instances a report of this object came from since the last [`Account::fold_idle`]:
    /// heard from, so not folded by it.
    heard: BTreeSet<String>,
    /// Until when (unix ms) the keeper could not hear reports: before the account was opened,
    /// or while the broker was unreachable. Silence then is no sign of death.
    deaf_until_ms: u64,
}

impl Account {
    /// A new account of the Subscription object `uid`.
    pub fn of(uid: Option<String>) -> Account {
        Account {
            persisted: Persisted {
                uid,
                ..Persisted::default()
            },
            ..Account::default()
        }
    }

    /// An account that resumes from what was persisted and what status last said.
    pub fn resume(persisted: Persisted, floor: ConsumerStats) -> Account {
        Account {
            persisted,
            floor,
            ..Account::default()
        }
    }

    /// An account that resumes from a whole snapshot (live instances included) and what status
    /// last said.
    pub fn restore(snapshot: Snapshot, floor: ConsumerStats) -> Account {
        Account {
            live: snapshot.live,
            persisted: snapshot.persisted,
            floor,
            heard: BTreeSet::new(),
            deaf_until_ms: 0,
        }
    }

    /// The keeper could not hear reports until `ms` (it opened this account then, or the
    /// broker was unreachable): an instance is silent only for the time after it.
    pub fn deaf_until(&mut self, ms: u64) {
        self.deaf_until_ms = self.deaf_until_ms.max(ms);
    }

    /// The whole account (persisted part and live instances), for [`Account::restore`].
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            persisted: self.persisted.clone(),
            live: self.live.clone(),
        }
    }

    /// The Subscription object this account belongs to.
    pub fn uid(&self) -> Option<&str> {
        self.persisted.uid.as_deref()
    }

    /// Binds an account saved before accounts named their object to `uid`.
    pub fn claim(&mut self, uid: Option<String>) {
        if self.persisted.uid.is_none() {
            self.persisted.uid = uid;
        }
    }

    /// Counts one report of this Subscription.
    pub fn report(&mut self, r: &StatsReport) -> Outcome {
        let outcome = self.judge(r);
        if matches!(outcome, Outcome::Counted | Outcome::Stale) {
            self.heard.insert(r.instance.clone());
        }
        outcome
    }

    fn judge(&mut self, r: &StatsReport) -> Outcome {
        let Some(loss) = &self.persisted.lost else {
            return self.count(r);
        };
        let owed = r.started_at_ms < loss.at_ms
            && !loss.known.contains(&(r.instance.clone(), r.started_at_ms));
        let before = self.counted().exhausted;
        let outcome = self.count(r);
        if owed && outcome == Outcome::Counted {
            let rose = self.counted().exhausted.saturating_sub(before);
            self.charge(r, rose);
        }
        outcome
    }

    /// A life that started before the loss and is new since: what it counted up to now was in
    /// what status showed (as far as the offset holds it), so it comes out of the offset, once.
    /// Exhausted comes out by as much as the account's Exhausted rose (`rose`: the larger source
    /// may not have moved). Each counter comes out by at most what it was just counted, so no
    /// total goes down; the offset is balanced again by raising its offers, which counts the
    /// life's attempts in flight as offered since.
    fn charge(&mut self, r: &StatsReport, rose: u64) {
        let Some(loss) = &mut self.persisted.lost else {
            return;
        };
        loss.known.insert((r.instance.clone(), r.started_at_ms));
        while loss.known.len() > REMEMBERED_LIVES {
            let oldest = loss
                .known
                .iter()
                .min_by_key(|(k, started)| (*started, k.clone()))
                .cloned();
            match oldest {
                Some(life) => loss.known.remove(&life),
                None => break,
            };
        }
        let mut taken = r.stats;
        taken.exhausted = rose.min(r.stats.exhausted);
        self.persisted.offset = balance(&growth(&taken, &self.persisted.offset), r.mode);
    }

    fn count(&mut self, r: &StatsReport) -> Outcome {
        if r.version != REPORT_VERSION {
            return Outcome::UnknownVersion;
        }
        if let (Some(mine), Some(theirs)) = (&self.persisted.uid, &r.subscription_uid)
            && mine != theirs
        {
            return Outcome::OtherObject;
        }
        if let Some(folded) = self.persisted.folded.get_mut(&r.instance) {
            if r.started_at_ms < folded.started_at_ms
                || (r.started_at_ms == folded.started_at_ms && r.sequence <= folded.sequence)
            {
                return Outcome::Stale;
            }
            if r.started_at_ms == folded.started_at_ms {
                // Back after a fold (it was idle, not dead): add only what grew since, and let
                // the attempts credited as given up at the fold absorb what it now settled.
                let mut grown = growth(&folded.stats, &r.stats);
                folded.credit = absorb(&mut grown, folded.credit);
                self.persisted.retired = add(&self.persisted.retired, &grown);
                folded.stats = max(&folded.stats, &r.stats);
                folded.sequence = r.sequence;
                folded.reported_at_ms = r.reported_at_ms;
                return Outcome::Counted;
            }
            // A newer life of a folded instance name: counted live, below.
        }
        match self.live.get_mut(&r.instance) {
            Some(old)
                if r.started_at_ms < old.started_at_ms
                    || (r.started_at_ms == old.started_at_ms && r.sequence <= old.sequence) =>
            {
                Outcome::Stale
            }
            Some(old) if r.started_at_ms == old.started_at_ms => {
                old.stats = max(&old.stats, &r.stats);
                old.sequence = r.sequence;
                old.reported_at_ms = r.reported_at_ms;
                Outcome::Counted
            }
            Some(old) => {
                // The name's previous life ended (the process restarted under the same name):
                // it keeps its last totals, its unfinished attempts given up.
                self.persisted.retired = add(&self.persisted.retired, &old.ended());
                *old = Seen::of(r);
                Outcome::Counted
            }
            None => {
                self.live.insert(r.instance.clone(), Seen::of(r));
                Outcome::Counted
            }
        }
    }

    /// The broker's count of this Subscription's exhausted messages (it only rises).
    pub fn broker_exhausted(&mut self, count: u64) {
        let b = &mut self.persisted.broker;
        b.exhausted = b.exhausted.max(count);
    }

    /// One message whose attempts ran out, as a broker advisory says: `capture_seq` is the
    /// advisory's sequence in the operator's capture, `stream_seq` the message's.
    pub fn broker_exhausted_message(&mut self, capture_seq: u64, stream_seq: u64) -> BrokerOutcome {
        let b = &mut self.persisted.broker;
        if b.applied.contains(&capture_seq) {
            return BrokerOutcome::Replayed;
        }
        b.applied.push_back(capture_seq);
        while b.applied.len() > REMEMBERED_EXHAUSTED {
            b.applied.pop_front();
        }
        if b.recent.contains(&stream_seq) {
            return BrokerOutcome::Duplicate;
        }
        b.recent.push_back(stream_seq);
        while b.recent.len() > REMEMBERED_EXHAUSTED {
            b.recent.pop_front();
        }
        b.exhausted += 1;
        BrokerOutcome::Counted
    }

    /// One message the broker dead-lettered when its attempts ran out (RabbitMQ's delivery
    /// limit, SQS's redrive policy), seen where the operator watches dead letters: `id` names
    /// the message on the broker (a message id, or the id the runtime stamps), so the same
    /// message seen again (a redelivered copy, a second look at a dead-letter queue) is counted
    /// once. The ids are kept as a stable 64-bit hash among the last [`REMEMBERED_EXHAUSTED`].
    pub fn broker_dead_lettered(&mut self, id: &str) -> BrokerOutcome {
        let key = message_key(id);
        let b = &mut self.persisted.broker;
        if b.recent.contains(&key) {
            return BrokerOutcome::Duplicate;
        }
        b.recent.push_back(key);
        while b.recent.len() > REMEMBERED_EXHAUSTED {
            b.recent.pop_front();
        }
        b.exhausted += 1;
        BrokerOutcome::Counted
    }

    /// One copy of a dead letter (RabbitMQ's dead-letter exchange), named by `id`: a copy the
    /// broker delivers for the first time (`redelivered` false) was never counted, so it counts
    /// even when another dead letter had the same name (two alike messages dead-lettered in one
    /// second); a redelivered one (its acknowledgement lost with an operator that stopped after
    /// saving its count) counts only when its name is not remembered.
    pub fn broker_dead_letter_copy(&mut self, id: &str, redelivered: bool) -> BrokerOutcome {
        if redelivered {
            return self.broker_dead_lettered(id);
        }
        let b = &mut self.persisted.broker;
        b.recent.push_back(message_key(id));
        while b.recent.len() > REMEMBERED_EXHAUSTED {
            b.recent.pop_front();
        }
        b.exhausted += 1;
        BrokerOutcome::Counted
    }

    /// The consumer was made again: its messages may be delivered and run out afresh, so a
    /// stream sequence seen before is a new loss, not a duplicate.
    pub fn consumer_recreated(&mut self) {
        self.persisted.broker.recent.clear();
    }

    /// Folds instances whose newest report counted is older than `idle_ms` (as of `now_ms`),
    /// that the keeper could hear all that time ([`Account::deaf_until`]) and that no report
    /// came from since the last call, into the retired total, their
    /// unfinished attempts counted given up. Returns the instances folded (their reports may
    /// be deleted from the bucket), each with the attempts it had unfinished.
    pub fn fold_idle(&mut self, now_ms: u64, idle_ms: u64) -> Vec<(String, u64)> {
        let names: Vec<String> = self.idle(now_ms, idle_ms).cloned().collect();
        self.heard.clear();
        let mut idle = Vec::with_capacity(names.len());
        for instance in names {
            if let Some(mut seen) = self.live.remove(&instance) {
                self.persisted.retired = add(&self.persisted.retired, &seen.ended());
                seen.credit = seen.in_flight();
                idle.push((instance.clone(), seen.credit));
                self.persisted.folded.insert(instance, seen);
            }
        }
        // Remember only the most recent folds; the dropped ones stay in `retired`.
        while self.persisted.folded.len() > REMEMBERED_FOLDS {
            let oldest = self
                .persisted
                .folded
                .iter()
                .min_by_key(|(k, s)| (s.reported_at_ms, (*k).clone()))
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => self.persisted.folded.remove(&k),
                None => break,
            };
        }
        idle
    }

    /// Whether [`Account::fold_idle`] would fold an instance now: a keeper that must first make
    /// sure it could hear asks this before it looks.
    pub fn due_to_fold(&self, now_ms: u64, idle_ms: u64) -> bool {
        self.idle(now_ms, idle_ms).next().is_some()
    }

    /// The live instances silent for longer than `idle_ms` as of `now_ms`, on the time the
    /// keeper could hear, and not heard from since the last fold.
    fn idle(&self, now_ms: u64, idle_ms: u64) -> impl Iterator<Item = &String> {
        self.live
            .iter()
            .filter(move |(k, s)| {
                now_ms.saturating_sub(s.reported_at_ms.max(self.deaf_until_ms)) > idle_ms
                    && !self.heard.contains(*k)
            })
            .map(|(k, _)| k)
    }

    /// What to persist so a restarted operator resumes exactly.
    pub fn persisted(&self) -> &Persisted {
        &self.persisted
    }

    /// Live instances (not folded).
    pub fn instances(&self) -> usize {
        self.live.len()
    }

    /// The highest sequence counted for instance name `instance`, of any life (live or folded);
    /// `None` for a name this account has not counted.
    pub fn last_sequence(&self, instance: &str) -> Option<u64> {
        let live = self.live.get(instance).map(|s| s.sequence);
        let folded = self.persisted.folded.get(instance).map(|s| s.sequence);
        live.max(folded)
    }

    /// Whether report `r` is implausible (semantics C19): its `sequence` past the last one
    /// counted for its instance name by more than `max_jump` (a sequence goes on counting
    /// across an instance's lives, and a restarted one starts again at 1, so a new life is held
    /// to the same bound), or its life started, or it was made, later than `now_ms` plus
    /// `max_skew_ms`. A name not counted yet takes any first sequence (after an operator
    /// restart a long-lived instance is first seen far past 1).
    pub fn implausible(
        &self,
        r: &StatsReport,
        max_jump: u64,
        now_ms: u64,
        max_skew_ms: u64,
    ) -> Option<Implausible> {
        let latest = now_ms.saturating_add(max_skew_ms);
        if r.started_at_ms > latest || r.reported_at_ms > latest {
            return Some(Implausible::FromTheFuture);
        }
        match self.last_sequence(&r.instance) {
            Some(last) if r.sequence > last.saturating_add(max_jump) => {
                Some(Implausible::SequenceJump)
            }
            _ => None,
        }
    }

    /// Whether `instance` is one this account already counts (live or folded): a report of an
    /// instance it does not know adds a live instance.
    pub fn knows(&self, instance: &str) -> bool {
        self.live.contains_key(instance) || self.persisted.folded.contains_key(instance)
    }

    /// The account as counted, without the floor: live lives + retired, Exhausted from the
    /// larger source.
    pub fn counted(&self) -> ConsumerStats {
        let mut sum = self.persisted.retired;
        for seen in self.live.values() {
            sum = add(&sum, &seen.stats);
        }
        sum.exhausted = sum.exhausted.max(self.persisted.broker.exhausted);
        sum
    }

    /// The account now: [`Account::counted`] plus the offset of a lost source, never below the
    /// floor. Raises the floor to what it returns.
    pub fn totals(&mut self) -> ConsumerStats {
        let t = max(&self.counted_with_offset(), &self.floor);
        self.floor = t;
        t
    }

    /// Checks, once every source has been read (the report replay is complete), whether what is
    /// counted explains what status showed. `ledger_lost`: the saved ledger was missing or
    /// unreadable (its broker tally and folds are gone, so every counter is compared; otherwise
    /// Exhausted is not, as advisories held back by an unsaved ledger may still come again).
    /// When something is missing, counting continues from the floor as an offset (returned: the
    /// source lost); `now_ms` is when, `mode` the Subscription's (the side of the identity that
    /// attempts in flight when status was written are given up to).
    pub fn recover(&mut self, ledger_lost: bool, now_ms: u64, mode: Mode) -> Option<Source> {
        let counted = self.counted_with_offset();
        let mut missing = growth(&counted, &self.floor);
        if !ledger_lost {
            missing.exhausted = 0;
        }
        if missing == ConsumerStats::default() {
            return None;
        }
        let source = if ledger_lost {
            Source::Ledger
        } else {
            Source::Reports
        };
        self.persisted.offset = balance(&add(&self.persisted.offset, &missing), mode);
        let known = self
            .live
            .iter()
            .chain(&self.persisted.folded)
            .map(|(k, s)| (k.clone(), s.started_at_ms))
            .collect();
        self.persisted.lost = Some(Loss {
            source,
            at_ms: now_ms,
            known,
        });
        Some(source)
    }

    /// The offset added to what is counted (zero unless a source was lost).
    pub fn offset(&self) -> ConsumerStats {
        self.persisted.offset
    }

    /// [`Account::counted`] plus the offset, without the floor.
    pub fn counted_with_offset(&self) -> ConsumerStats {
        add(&self.counted(), &self.persisted.offset)
    }
}
