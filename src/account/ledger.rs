//! The ledger: one Subscription's account, folded from what the runtime reports and what the
//! broker observed, so that every counter is counted once and never goes backwards.
//!
//! Pure: no I/O and no clock (times come in as arguments). The operator feeds it reports read
//! from the stats bucket and the broker's counts, persists [`Persisted`] beside the reports, and
//! writes [`Account::totals`] into status. It must not decide when status is written.
//!
//! The rules (also in the README's counter table):
//! - **Runtime counters** (offered … foreignConflicts): the sum over instances of each instance's
//!   latest report. A report is counted only if its `sequence` is newer than the one already
//!   counted for that instance, and each counter of an instance only ever rises (per-counter
//!   maximum), so a stale or reordered report lowers nothing.
//! - **Instances come and go.** A restarted process is a new instance; the old one keeps its last
//!   totals in the sum. Instances silent for longer than the idle limit are folded into a
//!   per-Subscription `retired` total, so the state stays small however often pods restart. A
//!   folded instance that reports again has only its growth since the fold added.
//! - **Exhausted**: the broker's count (every message whose attempts ran out, including a last
//!   attempt no handler saw) and the runtime's count describe the same messages; the account
//!   takes the larger, never the sum, so nothing is counted twice. The broker's count is itself
//!   deduplicated: one advisory applied twice (redelivered from the capture after a restart, in
//!   any order) is skipped by its capture sequence, and one message reported twice (its attempts ran out, then
//!   a late terminate arrived) is counted once by its stream sequence.
//! - **Never backwards**: every counter is at least what was last published (the floor), so a
//!   lost bucket or a restart of anything cannot lower status.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::api::{ConsumerStats, Settlement};
use crate::bus::report::{REPORT_VERSION, StatsReport};

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
}

/// The last report counted from one instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Seen {
    pub sequence: u64,
    pub reported_at_ms: u64,
    pub stats: ConsumerStats,
}

/// What the operator keeps between its own restarts, beside the reports: the folded instances.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Persisted {
    /// The sum of every folded instance's counters.
    pub retired: ConsumerStats,
    /// The most recently folded instances and what was counted of them.
    pub folded: BTreeMap<String, Seen>,
    /// What the broker's advisories counted.
    #[serde(default)]
    pub broker: BrokerTally,
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
    /// The most recently counted messages by stream sequence (newest last).
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

/// One Subscription's account.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Account {
    live: BTreeMap<String, Seen>,
    persisted: Persisted,
    floor: ConsumerStats,
}

impl Account {
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
        }
    }

    /// The whole account (persisted part and live instances), for [`Account::restore`].
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            persisted: self.persisted.clone(),
            live: self.live.clone(),
        }
    }

    /// Counts one report of this Subscription.
    pub fn report(&mut self, r: &StatsReport) -> Outcome {
        if r.version != REPORT_VERSION {
            return Outcome::UnknownVersion;
        }
        let seen = Seen {
            sequence: r.sequence,
            reported_at_ms: r.reported_at_ms,
            stats: r.stats,
        };
        if let Some(folded) = self.persisted.folded.get_mut(&r.instance) {
            // Back after a fold: add only what grew since.
            if r.sequence <= folded.sequence {
                return Outcome::Stale;
            }
            let grown = growth(&folded.stats, &r.stats);
            self.persisted.retired = add(&self.persisted.retired, &grown);
            folded.stats = max(&folded.stats, &r.stats);
            folded.sequence = r.sequence;
            folded.reported_at_ms = r.reported_at_ms;
            return Outcome::Counted;
        }
        match self.live.get_mut(&r.instance) {
            Some(old) if r.sequence <= old.sequence => Outcome::Stale,
            Some(old) => {
                old.stats = max(&old.stats, &r.stats);
                old.sequence = r.sequence;
                old.reported_at_ms = r.reported_at_ms;
                Outcome::Counted
            }
            None => {
                self.live.insert(r.instance.clone(), seen);
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

    /// The consumer was made again: its messages may be delivered and run out afresh, so a
    /// stream sequence seen before is a new loss, not a duplicate.
    pub fn consumer_recreated(&mut self) {
        self.persisted.broker.recent.clear();
    }

    /// Folds instances that have not reported for `idle_ms` (as of `now_ms`) into the retired
    /// total. Returns the instances folded (their reports may be deleted from the bucket).
    pub fn fold_idle(&mut self, now_ms: u64, idle_ms: u64) -> Vec<String> {
        let idle: Vec<String> = self
            .live
            .iter()
            .filter(|(_, s)| now_ms.saturating_sub(s.reported_at_ms) > idle_ms)
            .map(|(k, _)| k.clone())
            .collect();
        for instance in &idle {
            if let Some(seen) = self.live.remove(instance) {
                self.persisted.retired = add(&self.persisted.retired, &seen.stats);
                self.persisted.folded.insert(instance.clone(), seen);
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

    /// What to persist so a restarted operator resumes exactly.
    pub fn persisted(&self) -> &Persisted {
        &self.persisted
    }

    /// Live instances (not folded).
    pub fn instances(&self) -> usize {
        self.live.len()
    }

    /// The account now: live instances + retired, Exhausted from the larger source, never below
    /// the floor. Raises the floor to what it returns.
    pub fn totals(&mut self) -> ConsumerStats {
        let mut sum = self.persisted.retired;
        for seen in self.live.values() {
            sum = add(&sum, &seen.stats);
        }
        sum.exhausted = sum.exhausted.max(self.persisted.broker.exhausted);
        let t = max(&sum, &self.floor);
        self.floor = t;
        t
    }
}

/// Applies `f` to every counter pair.
fn zip(a: &ConsumerStats, b: &ConsumerStats, f: impl Fn(u64, u64) -> u64) -> ConsumerStats {
    ConsumerStats {
        offered: f(a.offered, b.offered),
        delivered: f(a.delivered, b.delivered),
        released: f(a.released, b.released),
        lost: f(a.lost, b.lost),
        settlement: Settlement {
            acked: f(a.settlement.acked, b.settlement.acked),
            nacked: f(a.settlement.nacked, b.settlement.nacked),
            silent: f(a.settlement.silent, b.settlement.silent),
            refused: f(a.settlement.refused, b.settlement.refused),
        },
        exhausted: f(a.exhausted, b.exhausted),
        stranded: f(a.stranded, b.stranded),
        lease_expired: f(a.lease_expired, b.lease_expired),
        delay_shortened: f(a.delay_shortened, b.delay_shortened),
        foreign_conflicts: f(a.foreign_conflicts, b.foreign_conflicts),
    }
}

fn add(a: &ConsumerStats, b: &ConsumerStats) -> ConsumerStats {
    zip(a, b, u64::saturating_add)
}

fn max(a: &ConsumerStats, b: &ConsumerStats) -> ConsumerStats {
    zip(a, b, u64::max)
}

/// How much `to` grew past `from`, per counter (zero where it did not).
fn growth(from: &ConsumerStats, to: &ConsumerStats) -> ConsumerStats {
    zip(to, from, u64::saturating_sub)
}

/// Every counter of `a` is at least that of `b`.
pub fn dominates(a: &ConsumerStats, b: &ConsumerStats) -> bool {
    max(a, b) == *a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Mode;
    use crate::bus::RuntimeStats;
    use proptest::prelude::*;

    fn stats(acked: u64, nacked: u64, exhausted: u64) -> ConsumerStats {
        ConsumerStats {
            offered: acked + nacked,
            delivered: acked + nacked,
            settlement: Settlement {
                acked,
                nacked,
                ..Settlement::default()
            },
            exhausted,
            ..ConsumerStats::default()
        }
    }

    fn report(instance: &str, sequence: u64, at: u64, s: ConsumerStats) -> StatsReport {
        StatsReport {
            version: REPORT_VERSION,
            namespace: "shop".into(),
            subscription: "orders".into(),
            durable_name: Some("orders".into()),
            instance: instance.into(),
            backend: "nats".into(),
            mode: Mode::AtLeastOnce,
            started_at_ms: 0,
            reported_at_ms: at,
            sequence,
            stats: s,
            runtime: RuntimeStats::default(),
        }
    }

    #[test]
    fn instances_are_summed_from_their_latest_reports() {
        let mut a = Account::default();
        assert_eq!(
            a.report(&report("a", 1, 10, stats(1, 0, 0))),
            Outcome::Counted
        );
        assert_eq!(
            a.report(&report("a", 2, 20, stats(3, 1, 0))),
            Outcome::Counted
        );
        assert_eq!(
            a.report(&report("b", 1, 20, stats(2, 0, 0))),
            Outcome::Counted
        );
        let t = a.totals();
        assert_eq!(t.settlement.acked, 5);
        assert_eq!(t.settlement.nacked, 1);
        assert_eq!(t.delivered, 6);
    }

    #[test]
    fn a_stale_or_repeated_report_lowers_nothing() {
        let mut a = Account::default();
        a.report(&report("a", 5, 50, stats(10, 0, 0)));
        assert_eq!(
            a.report(&report("a", 4, 40, stats(7, 0, 0))),
            Outcome::Stale
        );
        assert_eq!(
            a.report(&report("a", 5, 50, stats(10, 0, 0))),
            Outcome::Stale
        );
        assert_eq!(a.totals().settlement.acked, 10);
    }

    #[test]
    fn a_newer_report_with_a_lower_counter_keeps_the_higher_value() {
        // A runtime never lowers a counter; if a report did, the account must not follow it.
        let mut a = Account::default();
        a.report(&report("a", 1, 10, stats(10, 2, 0)));
        a.report(&report("a", 2, 20, stats(8, 3, 0)));
        let t = a.totals();
        assert_eq!((t.settlement.acked, t.settlement.nacked), (10, 3));
    }

    #[test]
    fn an_unknown_version_is_skipped_not_counted() {
        let mut a = Account::default();
        let mut r = report("a", 1, 10, stats(4, 0, 0));
        r.version = REPORT_VERSION + 1;
        assert_eq!(a.report(&r), Outcome::UnknownVersion);
        assert_eq!(a.totals(), ConsumerStats::default());
    }

    #[test]
    fn a_restarted_instance_adds_to_what_its_previous_life_counted() {
        let mut a = Account::default();
        a.report(&report("pod-1-100", 9, 100, stats(30, 5, 1)));
        // The process restarts: a new instance id, counting from zero.
        a.report(&report("pod-1-200", 1, 200, stats(2, 0, 0)));
        let t = a.totals();
        assert_eq!(t.settlement.acked, 32);
        assert_eq!(t.exhausted, 1);
    }

    #[test]
    fn folding_keeps_totals_and_bounds_the_state() {
        let mut a = Account::default();
        for i in 0..1000u64 {
            a.report(&report(&format!("pod-{i}"), 1, i, stats(1, 1, 0)));
        }
        let before = a.totals();
        let folded = a.fold_idle(10_000, 60);
        assert_eq!(folded.len(), 1000);
        assert_eq!(a.instances(), 0);
        assert!(a.persisted().folded.len() <= REMEMBERED_FOLDS);
        assert_eq!(
            a.totals(),
            before,
            "folding moves counters, it never loses them"
        );
    }

    #[test]
    fn a_folded_instance_that_reports_again_adds_only_its_growth() {
        let mut a = Account::default();
        a.report(&report("idle", 3, 100, stats(5, 0, 0)));
        a.fold_idle(1_000_000, 60_000);
        a.report(&report("idle", 4, 2_000_000, stats(7, 0, 0)));
        assert_eq!(a.totals().settlement.acked, 7);
        // And a repeat of its old report is stale.
        assert_eq!(
            a.report(&report("idle", 3, 100, stats(5, 0, 0))),
            Outcome::Stale
        );
        assert_eq!(a.totals().settlement.acked, 7);
    }

    #[test]
    fn exhausted_takes_the_larger_source_never_the_sum() {
        let mut a = Account::default();
        a.report(&report("a", 1, 10, stats(0, 30, 10)));
        a.broker_exhausted(10);
        assert_eq!(
            a.totals().exhausted,
            10,
            "the same ten messages, counted once"
        );
        // A last attempt no handler saw: only the broker knows.
        a.broker_exhausted(11);
        assert_eq!(a.totals().exhausted, 11);
        // A broker count that went back (a lost capture) lowers nothing.
        a.broker_exhausted(3);
        assert_eq!(a.totals().exhausted, 11);
    }

    #[test]
    fn the_account_resumes_exactly_after_an_operator_restart() {
        let mut a = Account::default();
        a.report(&report("old", 2, 10, stats(4, 1, 0)));
        a.report(&report("live", 2, 10_000, stats(6, 0, 0)));
        a.fold_idle(10_000, 1_000);
        let published = a.totals();
        // The operator restarts: it reads the persisted folds, status, and the bucket again.
        let mut b = Account::resume(a.persisted().clone(), published);
        b.report(&report("live", 2, 10_000, stats(6, 0, 0)));
        assert_eq!(b.totals(), published);
        b.report(&report("live", 3, 11_000, stats(8, 0, 0)));
        assert_eq!(b.totals().settlement.acked, 12);
    }

    #[test]
    fn a_snapshot_restores_the_same_totals_and_later_reports_count_as_before() {
        let mut a = Account::default();
        a.report(&report("old", 2, 10, stats(4, 1, 0)));
        a.report(&report("live", 2, 10_000, stats(6, 0, 1)));
        a.report(&report("other", 5, 10_000, stats(1, 9, 3)));
        a.fold_idle(10_000, 1_000);
        let published = a.totals();
        let text = serde_json::to_string(&a.snapshot()).expect("serialises");
        let back: Snapshot = serde_json::from_str(&text).expect("parses");
        // Restored with no floor at all: the snapshot alone holds every counter.
        let mut b = Account::restore(back, ConsumerStats::default());
        assert_eq!(b.totals(), published);
        assert_eq!(b.instances(), 2);
        // The same reports again (requeued, not acknowledged before the restart): stale.
        assert_eq!(
            b.report(&report("live", 2, 10_000, stats(6, 0, 1))),
            Outcome::Stale
        );
        assert_eq!(
            b.report(&report("old", 2, 10, stats(4, 1, 0))),
            Outcome::Stale
        );
        assert_eq!(b.totals(), published);
        // Reports after the restore count exactly as they would have in the first account.
        for acc in [&mut a, &mut b] {
            assert_eq!(
                acc.report(&report("live", 3, 11_000, stats(8, 0, 1))),
                Outcome::Counted
            );
            acc.report(&report("new", 1, 11_000, stats(1, 1, 1)));
            acc.report(&report("old", 3, 11_000, stats(5, 1, 0)));
        }
        assert_eq!(a.totals(), b.totals());
        assert_eq!(b.totals().settlement.acked, 4 + 1 + 8 + 1 + 1);
        assert_eq!(b.snapshot(), a.snapshot());
    }

    #[test]
    fn an_empty_snapshot_reads_and_the_floor_still_holds() {
        let back: Snapshot = serde_json::from_str("{}").expect("an empty snapshot");
        let floor = stats(7, 2, 1);
        let mut a = Account::restore(back, floor);
        assert_eq!(a.totals(), floor);
        a.report(&report("x", 1, 1, stats(1, 0, 0)));
        assert!(dominates(&a.totals(), &floor));
    }

    #[test]
    fn a_lost_bucket_cannot_lower_what_status_said() {
        let floor = stats(100, 20, 3);
        let mut a = Account::resume(Persisted::default(), floor);
        a.report(&report("new", 1, 10, stats(1, 0, 0)));
        assert!(dominates(&a.totals(), &floor));
    }

    #[test]
    fn each_exhausted_message_is_counted_once_from_the_broker() {
        let mut a = Account::default();
        assert_eq!(a.broker_exhausted_message(1, 40), BrokerOutcome::Counted);
        assert_eq!(a.broker_exhausted_message(2, 41), BrokerOutcome::Counted);
        // The capture redelivers what was applied before the operator's restart.
        assert_eq!(a.broker_exhausted_message(2, 41), BrokerOutcome::Replayed);
        assert_eq!(a.broker_exhausted_message(1, 40), BrokerOutcome::Replayed);
        // An advisory applied out of order (one redelivered after later ones) still counts.
        let mut b = Account::default();
        assert_eq!(b.broker_exhausted_message(9, 90), BrokerOutcome::Counted);
        assert_eq!(b.broker_exhausted_message(7, 70), BrokerOutcome::Counted);
        assert_eq!(b.totals().exhausted, 2);
        // The same message, reported again by a late terminate after its attempts ran out.
        assert_eq!(a.broker_exhausted_message(3, 40), BrokerOutcome::Duplicate);
        assert_eq!(a.totals().exhausted, 2);
        // A consumer made again may lose the same stream sequence again: a new loss.
        a.consumer_recreated();
        assert_eq!(a.broker_exhausted_message(4, 40), BrokerOutcome::Counted);
        assert_eq!(a.totals().exhausted, 3);
    }

    #[test]
    fn the_broker_tally_survives_a_restart_through_what_is_persisted() {
        let mut a = Account::default();
        for (capture, seq) in [(10, 1), (11, 2), (12, 3)] {
            a.broker_exhausted_message(capture, seq);
        }
        let saved = serde_json::to_string(a.persisted()).expect("serialises");
        let back: Persisted = serde_json::from_str(&saved).expect("parses");
        let mut b = Account::resume(back, a.totals());
        assert_eq!(b.broker_exhausted_message(12, 3), BrokerOutcome::Replayed);
        assert_eq!(b.broker_exhausted_message(13, 4), BrokerOutcome::Counted);
        assert_eq!(b.totals().exhausted, 4);
        // What an older operator persisted (no broker tally) still reads.
        let old: Persisted =
            serde_json::from_str(r#"{"retired":{},"folded":{}}"#).expect("old form");
        assert_eq!(old.broker, BrokerTally::default());
    }

    #[test]
    fn remembered_messages_stay_bounded() {
        let mut a = Account::default();
        for i in 1..=(REMEMBERED_EXHAUSTED as u64 + 500) {
            a.broker_exhausted_message(i, i);
        }
        assert_eq!(a.persisted().broker.recent.len(), REMEMBERED_EXHAUSTED);
        assert_eq!(a.persisted().broker.applied.len(), REMEMBERED_EXHAUSTED);
        assert_eq!(a.totals().exhausted, REMEMBERED_EXHAUSTED as u64 + 500);
    }

    fn arb_stats() -> impl Strategy<Value = ConsumerStats> {
        (0u64..50, 0u64..50, 0u64..5).prop_map(|(a, n, e)| stats(a, n, e))
    }

    proptest! {
        /// Whatever arrives, in whatever order, with folds in between: the totals never go down.
        #[test]
        fn totals_never_decrease(
            steps in prop::collection::vec(
                (0usize..4, 1u64..20, arb_stats(), any::<bool>(), 0u64..30),
                1..80,
            )
        ) {
            let mut a = Account::default();
            let mut last = a.totals();
            let mut clock = 0u64;
            for (inst, seq, s, fold, broker) in steps {
                clock += 10;
                a.report(&report(&format!("i{inst}"), seq, clock, s));
                a.broker_exhausted(broker);
                if fold {
                    a.fold_idle(clock, 15);
                }
                let now = a.totals();
                prop_assert!(dominates(&now, &last), "went down: {last:?} -> {now:?}");
                last = now;
            }
        }

        /// Monotonic reports of fixed instances, delivered in any order and repeated, end at
        /// exactly the sum of each instance's last report.
        #[test]
        fn reordered_reports_end_at_the_exact_sum(
            counts in prop::collection::vec(1usize..6, 1..4),
            shuffle in any::<u64>(),
        ) {
            let mut all = Vec::new();
            let mut expect = 0u64;
            for (i, n) in counts.iter().enumerate() {
                for seq in 1..=*n as u64 {
                    all.push(report(&format!("i{i}"), seq, seq, stats(seq * 2, 0, 0)));
                }
                expect += *n as u64 * 2;
            }
            // A deterministic shuffle, then every report twice.
            let mut order: Vec<usize> = (0..all.len()).collect();
            let mut x = shuffle | 1;
            for i in (1..order.len()).rev() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            let mut a = Account::default();
            for &i in order.iter().chain(order.iter()) {
                a.report(&all[i]);
            }
            prop_assert_eq!(a.totals().settlement.acked, expect);
        }
    }
}
