//! The ledger's table and property tests: every rule of the header, case by case.

/// Folds as a keeper does once a round without a report from the instances to fold: the
/// reports before were heard in a round of their own, which folds none of their instances.
fn fold_silent(a: &mut Account, now_ms: u64, idle_ms: u64) -> Vec<(String, u64)> {
    let mut folded = a.fold_idle(now_ms, idle_ms);
    folded.extend(a.fold_idle(now_ms, idle_ms));
    folded
}

#[test]
fn an_instance_heard_from_in_a_round_is_not_folded_in_it_even_by_a_stale_report() {
    // A FIFO report queue gives an instance's backlog oldest first: its old report is not a
    // reason to fold it while newer ones come.
    let mut a = Account::default();
    let mut one_in_flight = stats(3, 2, 0);
    one_in_flight.offered += 1;
    a.report(&report("pod-a", 1, 1, one_in_flight));
    assert!(!a.due_to_fold(1_000_000, 60), "heard since the last fold");
    assert!(a.fold_idle(1_000_000, 60).is_empty(), "heard this round");
    assert_eq!(
        a.report(&report("pod-a", 1, 1, one_in_flight)),
        Outcome::Stale
    );
    assert!(
        a.fold_idle(1_000_000, 60).is_empty(),
        "a stale report is heard too"
    );
    assert!(a.due_to_fold(1_000_000, 60), "asking does not fold");
    assert!(a.due_to_fold(1_000_000, 60));
    assert_eq!(a.fold_idle(1_000_000, 60), vec![("pod-a".to_string(), 1)]);
    assert!(!a.due_to_fold(1_000_000, 60));
}

#[test]
fn an_instance_is_silent_only_for_the_time_the_keeper_could_hear_it() {
    // pod-a's last report at 1,000 ms; the broker unreachable, or the account only opened,
    // until 50,000 ms: at 50,040 ms it has been silent 40 ms that counted, not 49 s.
    let mut a = Account::default();
    let mut one_in_flight = stats(3, 2, 0);
    one_in_flight.offered += 1;
    a.report(&report("pod-a", 1, 1_000, one_in_flight));
    a.deaf_until(50_000);
    a.deaf_until(20_000);
    assert!(
        fold_silent(&mut a, 50_040, 60).is_empty(),
        "deaf until 50 s"
    );
    assert_eq!(
        fold_silent(&mut a, 50_061, 60),
        vec![("pod-a".to_string(), 1)],
        "silent 61 ms since the keeper could hear"
    );
}

#[test]
fn a_dead_lettered_message_is_counted_once_and_only_the_larger_source_shows() {
    let mut a = Account::of(Some("uid-1".into()));
    assert_eq!(a.broker_dead_lettered("m-1"), BrokerOutcome::Counted);
    assert_eq!(a.broker_dead_lettered("m-2"), BrokerOutcome::Counted);
    // The same message seen again (a second look at the dead-letter queue) counts nothing.
    assert_eq!(a.broker_dead_lettered("m-1"), BrokerOutcome::Duplicate);
    assert_eq!(a.counted().exhausted, 2);
    assert_eq!(a.persisted().broker.exhausted, 2);
    // The key is stable (persisted ledgers are read by later operators) and tells ids apart.
    assert_eq!(message_key("m-1"), message_key("m-1"));
    assert_ne!(message_key("m-1"), message_key("m-2"));
    assert_eq!(message_key(""), 0xcbf2_9ce4_8422_2325);
}

#[test]
fn a_first_delivered_dead_letter_copy_counts_and_a_redelivered_one_only_if_unknown() {
    let mut a = Account::of(Some("uid-1".into()));
    // Two alike messages dead-lettered in one second: two first deliveries, two losses.
    assert_eq!(
        a.broker_dead_letter_copy("k", false),
        BrokerOutcome::Counted
    );
    assert_eq!(
        a.broker_dead_letter_copy("k", false),
        BrokerOutcome::Counted
    );
    // Handed again after the save (the acknowledgement was lost): counted before.
    assert_eq!(
        a.broker_dead_letter_copy("k", true),
        BrokerOutcome::Duplicate
    );
    // Handed again but never saved (the operator stopped before): counted now.
    assert_eq!(a.broker_dead_letter_copy("j", true), BrokerOutcome::Counted);
    assert_eq!(a.counted().exhausted, 3);
}
use super::*;
use proptest::prelude::*;
use settle::api::Settlement;
use settle::bus::RuntimeStats;

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

/// A report of `instance`'s first life (started at 0).
fn report(instance: &str, sequence: u64, at: u64, s: ConsumerStats) -> StatsReport {
    life(instance, 0, sequence, at, s)
}

/// A report of `instance`'s life started at `started`.
fn life(instance: &str, started: u64, sequence: u64, at: u64, s: ConsumerStats) -> StatsReport {
    StatsReport {
        version: REPORT_VERSION,
        namespace: "shop".into(),
        subscription: "orders".into(),
        subscription_uid: None,
        durable_name: Some("orders".into()),
        instance: instance.into(),
        backend: "nats".into(),
        mode: Mode::AtLeastOnce,
        started_at_ms: started,
        reported_at_ms: at,
        sequence,
        stats: s,
        runtime: RuntimeStats::default(),
    }
}

fn of_object(mut r: StatsReport, uid: &str) -> StatsReport {
    r.subscription_uid = Some(uid.into());
    r
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
    assert_eq!(a.counted().settlement.acked, 10);
}

#[test]
fn a_sequence_past_the_bound_is_implausible_for_every_life_of_the_name() {
    const JUMP: u64 = 100;
    const NOW: u64 = 1_000_000;
    let mut a = Account::default();
    a.report(&life("orders-0", 100, 7, 150, stats(3, 0, 0)));
    let jumped = |seq: u64| life("orders-0", 100, seq, 160, stats(4, 0, 900_002));
    // One step, and exactly the bound, are plausible; one more is not.
    assert_eq!(a.implausible(&jumped(8), JUMP, NOW, 0), None);
    assert_eq!(a.implausible(&jumped(7 + JUMP), JUMP, NOW, 0), None);
    assert_eq!(
        a.implausible(&jumped(7 + JUMP + 1), JUMP, NOW, 0),
        Some(Implausible::SequenceJump)
    );
    assert_eq!(
        a.implausible(&jumped(u64::MAX), JUMP, NOW, 0),
        Some(Implausible::SequenceJump)
    );
    // A new life of the name goes on counting (or starts again at 1): the same bound.
    let new_life = |seq: u64| life("orders-0", 200, seq, 210, stats(1, 0, 0));
    assert_eq!(a.implausible(&new_life(1), JUMP, NOW, 0), None);
    assert_eq!(a.implausible(&new_life(8), JUMP, NOW, 0), None);
    assert_eq!(
        a.implausible(&new_life(u64::MAX), JUMP, NOW, 0),
        Some(Implausible::SequenceJump)
    );
    // A name not counted yet takes any first sequence (first seen after a restart).
    assert_eq!(
        a.implausible(
            &report("long-lived", 5_000_000, 10, stats(1, 0, 0)),
            JUMP,
            NOW,
            0
        ),
        None
    );
    // A folded life is held to its last sequence too.
    fold_silent(&mut a, 10_000_000, 60);
    assert_eq!(a.last_sequence("orders-0"), Some(7));
    assert_eq!(
        a.implausible(&jumped(u64::MAX), JUMP, NOW, 0),
        Some(Implausible::SequenceJump)
    );
    assert_eq!(a.implausible(&jumped(9), JUMP, NOW, 0), None);
}

#[test]
fn a_life_started_or_reported_in_the_future_is_implausible() {
    const NOW: u64 = 1_000_000;
    let a = Account::default();
    let at = |started: u64, reported: u64| life("p", started, 1, reported, stats(1, 0, 0));
    assert_eq!(a.implausible(&at(NOW, NOW), 10, NOW, 0), None);
    assert_eq!(a.implausible(&at(NOW + 500, NOW + 500), 10, NOW, 500), None);
    assert_eq!(
        a.implausible(&at(u64::MAX, NOW), 10, NOW, 500),
        Some(Implausible::FromTheFuture)
    );
    assert_eq!(
        a.implausible(&at(NOW, NOW + 501), 10, NOW, 500),
        Some(Implausible::FromTheFuture)
    );
    assert_eq!(Implausible::SequenceJump.label(), "sequence_jump");
    assert_eq!(Implausible::FromTheFuture.label(), "from_the_future");
}

#[test]
fn what_a_jumped_report_would_have_done_is_why_it_is_dropped() {
    // Counted, a report with sequence u64::MAX makes every later real report stale: the
    // freeze that `implausible` keeps out.
    let mut a = Account::default();
    a.report(&report("a", 1, 10, stats(1, 0, 0)));
    let forged = report("a", u64::MAX, 20, stats(1, 0, 900_002));
    assert_eq!(
        a.implausible(&forged, 100, 1_000, 0),
        Some(Implausible::SequenceJump)
    );
    let mut counted = a.clone();
    counted.report(&forged);
    assert_eq!(
        counted.report(&report("a", 2, 30, stats(5, 0, 0))),
        Outcome::Stale
    );
    assert_eq!(
        a.report(&report("a", 2, 30, stats(5, 0, 0))),
        Outcome::Counted
    );
    assert_eq!(a.counted().settlement.acked, 5);
    assert_eq!(a.counted().exhausted, 0);
}

#[test]
fn a_newer_report_with_a_lower_counter_keeps_the_higher_value() {
    // A runtime never lowers a counter; if a report did, the account must not follow it.
    let mut a = Account::default();
    a.report(&report("a", 1, 10, stats(10, 2, 0)));
    a.report(&report("a", 2, 20, stats(8, 3, 0)));
    let t = a.counted();
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
    let t = a.counted();
    assert_eq!(t.settlement.acked, 32);
    assert_eq!(t.exhausted, 1);
}

#[test]
fn a_reused_instance_name_adds_its_lives_instead_of_keeping_the_larger() {
    // A StatefulSet pod restarted under the same name: a new startedAtMs, counting from zero.
    let mut a = Account::default();
    a.report(&life("orders-0", 100, 9, 150, stats(30, 5, 1)));
    assert_eq!(
        a.report(&life("orders-0", 200, 1, 210, stats(2, 0, 0))),
        Outcome::Counted
    );
    assert_eq!(a.counted().settlement.acked, 32);
    assert_eq!(a.instances(), 1);
    // A late report of the old life changes nothing.
    assert_eq!(
        a.report(&life("orders-0", 100, 10, 160, stats(31, 5, 1))),
        Outcome::Stale
    );
    assert_eq!(a.counted().settlement.acked, 32);
}

#[test]
fn a_report_of_another_object_is_never_counted() {
    // The Subscription was deleted and applied again under the same name: a new UID.
    let mut a = Account::of(Some("new".into()));
    assert_eq!(
        a.report(&of_object(report("a", 9, 10, stats(5, 10, 5)), "old")),
        Outcome::OtherObject
    );
    assert_eq!(a.counted(), ConsumerStats::default());
    assert_eq!(
        a.report(&of_object(report("a", 1, 20, stats(1, 2, 1)), "new")),
        Outcome::Counted
    );
    assert_eq!(a.counted().exhausted, 1);
    // A report from before runtimes knew the UID is this object's (compatibility).
    assert_eq!(
        a.report(&report("b", 1, 20, stats(1, 0, 0))),
        Outcome::Counted
    );
    // A saved ledger of the old object is not the new one's.
    let old = Account::of(Some("old".into()));
    assert!(!old.persisted().belongs_to(Some("new")));
    assert!(old.persisted().belongs_to(Some("old")));
    assert!(Persisted::default().belongs_to(Some("new")));
    let mut legacy = Account::default();
    legacy.claim(Some("new".into()));
    assert_eq!(legacy.uid(), Some("new"));
}

/// An instance killed with `in_flight` attempts offered and not finished.
fn killed(acked: u64, in_flight: u64) -> ConsumerStats {
    let mut s = stats(acked, 0, 0);
    s.offered += in_flight;
    s
}

#[test]
fn a_dead_instances_unfinished_attempts_are_released_when_it_is_folded() {
    let mut a = Account::default();
    a.report(&report("killed", 3, 100, killed(10, 4)));
    assert!(!a.counted().balanced(), "4 attempts in flight");
    fold_silent(&mut a, 10_000, 1_000);
    let t = a.counted();
    assert_eq!((t.offered, t.delivered, t.released), (14, 10, 4));
    assert!(t.balanced(), "the identity holds at rest: {t:?}");
    // Under AtMostOnce nothing brings them back: Lost.
    let mut b = Account::default();
    let mut r = report("killed", 3, 100, killed(10, 4));
    r.mode = Mode::AtMostOnce;
    b.report(&r);
    fold_silent(&mut b, 10_000, 1_000);
    let t = b.counted();
    assert_eq!((t.lost, t.released), (4, 0));
    assert!(t.balanced());
}

#[test]
fn a_reused_names_previous_life_gives_up_its_unfinished_attempts() {
    let mut a = Account::default();
    a.report(&life("orders-0", 100, 3, 150, killed(10, 2)));
    a.report(&life("orders-0", 200, 1, 210, stats(1, 0, 0)));
    let t = a.counted();
    assert_eq!((t.offered, t.delivered, t.released), (13, 11, 2));
    assert!(t.balanced());
}

#[test]
fn a_folded_instance_that_reports_again_is_never_counted_twice() {
    // Silent past the fold limit, then back: its 4 attempts were credited as released at
    // the fold; when they finish they are not counted again.
    let mut a = Account::default();
    a.report(&report("slow", 3, 100, killed(10, 4)));
    fold_silent(&mut a, 1_000_000, 60_000);
    // The 4 finish (acked), and 2 more arrive and finish.
    a.report(&report("slow", 4, 2_000_000, stats(16, 0, 0)));
    let t = a.counted();
    assert_eq!(t.offered, 16);
    assert_eq!(t.delivered + t.released + t.lost, 16, "{t:?}");
    assert!(t.balanced());
    assert_eq!(t.settlement.acked, 16);
    // A repeat of its old report is stale.
    assert_eq!(
        a.report(&report("slow", 3, 100, killed(10, 4))),
        Outcome::Stale
    );
    assert_eq!(a.counted(), t);
}

#[test]
fn folding_keeps_totals_and_bounds_the_state() {
    let mut a = Account::default();
    for i in 0..1000u64 {
        a.report(&report(&format!("pod-{i}"), 1, i, stats(1, 1, 0)));
    }
    let before = a.counted();
    let folded = fold_silent(&mut a, 10_000, 60);
    assert_eq!(folded.len(), 1000);
    assert_eq!(a.instances(), 0);
    assert!(a.persisted().folded.len() <= REMEMBERED_FOLDS);
    assert_eq!(
        a.counted(),
        before,
        "folding moves counters, it never loses them"
    );
}

#[test]
fn a_folded_instance_that_reports_again_adds_only_its_growth() {
    let mut a = Account::default();
    a.report(&report("idle", 3, 100, stats(5, 0, 0)));
    fold_silent(&mut a, 1_000_000, 60_000);
    a.report(&report("idle", 4, 2_000_000, stats(7, 0, 0)));
    assert_eq!(a.counted().settlement.acked, 7);
    // And a repeat of its old report is stale.
    assert_eq!(
        a.report(&report("idle", 3, 100, stats(5, 0, 0))),
        Outcome::Stale
    );
    assert_eq!(a.counted().settlement.acked, 7);
}

#[test]
fn exhausted_takes_the_larger_source_never_the_sum() {
    let mut a = Account::default();
    a.report(&report("a", 1, 10, stats(0, 30, 10)));
    a.broker_exhausted(10);
    assert_eq!(
        a.counted().exhausted,
        10,
        "the same ten messages, counted once"
    );
    // A last attempt no handler saw: only the broker knows.
    a.broker_exhausted(11);
    assert_eq!(a.counted().exhausted, 11);
    // A broker count that went back (a lost capture) lowers nothing.
    a.broker_exhausted(3);
    assert_eq!(a.counted().exhausted, 11);
}

#[test]
fn the_account_resumes_exactly_after_an_operator_restart() {
    let mut a = Account::default();
    a.report(&report("old", 2, 10, stats(4, 1, 0)));
    a.report(&report("live", 2, 10_000, stats(6, 0, 0)));
    fold_silent(&mut a, 10_000, 1_000);
    let published = a.totals();
    // The operator restarts: it reads the persisted folds and the bucket again. With no
    // floor at all, what is persisted and the reports alone give the same account.
    let mut b = Account::resume(a.persisted().clone(), ConsumerStats::default());
    b.report(&report("live", 2, 10_000, stats(6, 0, 0)));
    assert_eq!(b.counted(), published);
    b.report(&report("live", 3, 11_000, stats(8, 0, 0)));
    assert_eq!(b.counted().settlement.acked, 12);
}

#[test]
fn a_snapshot_restores_the_same_totals_and_later_reports_count_as_before() {
    let mut a = Account::default();
    a.report(&report("old", 2, 10, stats(4, 1, 0)));
    a.report(&report("live", 2, 10_000, stats(6, 0, 1)));
    a.report(&report("other", 5, 10_000, stats(1, 9, 3)));
    fold_silent(&mut a, 10_000, 1_000);
    let published = a.totals();
    let text = serde_json::to_string(&a.snapshot()).expect("serialises");
    let back: Snapshot = serde_json::from_str(&text).expect("parses");
    // Restored with no floor at all: the snapshot alone holds every counter.
    let mut b = Account::restore(back, ConsumerStats::default());
    assert_eq!(b.counted(), published);
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
    assert_eq!(b.counted(), published);
    // Reports after the restore count exactly as they would have in the first account.
    for acc in [&mut a, &mut b] {
        assert_eq!(
            acc.report(&report("live", 3, 11_000, stats(8, 0, 1))),
            Outcome::Counted
        );
        acc.report(&report("new", 1, 11_000, stats(1, 1, 1)));
        acc.report(&report("old", 3, 11_000, stats(5, 1, 0)));
    }
    assert_eq!(a.counted(), b.counted());
    assert_eq!(b.counted().settlement.acked, 4 + 1 + 8 + 1 + 1);
    assert_eq!(b.snapshot(), a.snapshot());
}

#[test]
fn what_an_older_operator_saved_still_reads() {
    let old: Snapshot = serde_json::from_str(
        r#"{"persisted":{"retired":{"offered":3},"folded":{"p":{"sequence":2,"reportedAtMs":5,"stats":{"offered":3}}}},"live":{}}"#,
    )
    .expect("an older snapshot");
    assert_eq!(old.persisted.uid, None);
    assert_eq!(old.persisted.folded["p"].started_at_ms, 0);
    assert_eq!(old.persisted.folded["p"].credit, 0);
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

/// Always-nack numbers: `n` messages at maxDeliver 3 (offered, delivered and nacked 3n,
/// exhausted n).
fn nacked(n: u64) -> ConsumerStats {
    stats(0, 3 * n, n)
}

const LOST_AT: u64 = 1_000_000;

#[test]
fn a_lost_ledger_continues_from_status_as_an_offset_and_growth_shows_one_for_one() {
    // Status showed 5 messages run out; the instance that counted them was folded and its
    // report removed, then the ledger holding that fold was lost. A new instance runs.
    let floor = nacked(5);
    let mut a = Account::resume(Persisted::default(), floor);
    a.report(&life("new", LOST_AT + 1, 1, LOST_AT + 1, nacked(1)));
    assert_eq!(
        a.recover(true, LOST_AT, Mode::AtLeastOnce),
        Some(Source::Ledger)
    );
    assert_eq!(a.offset(), nacked(4), "floor - counted, per counter");
    assert_eq!(a.totals(), floor, "nothing moved yet, nothing went down");
    // Two more messages on the new instance: every counter moves by exactly their growth.
    a.report(&life("new", LOST_AT + 1, 2, LOST_AT + 2, nacked(3)));
    let t = a.totals();
    assert_eq!(t, nacked(7), "{t:?}");
    assert!(t.balanced());
    // The broker's count after the loss (its tally restarted) keeps its rule on the counted
    // part: the larger source, never the sum.
    a.broker_exhausted(3);
    assert_eq!(a.totals().exhausted, 7);
    a.broker_exhausted(4);
    assert_eq!(a.totals().exhausted, 8);
}

#[test]
fn without_an_offset_the_floor_freezes_counters_and_breaks_the_identity() {
    // What the offset fixes: the floor alone holds each counter until its new sum passes it.
    let floor = stats(10, 0, 0);
    let mut a = Account::resume(Persisted::default(), floor);
    let mut s = stats(3, 0, 0);
    s.offered += 2; // two in flight
    a.report(&life("new", LOST_AT + 1, 1, LOST_AT + 1, s));
    s.released += 2;
    a.report(&life("new", LOST_AT + 1, 2, LOST_AT + 2, s));
    let frozen = a.totals();
    assert_eq!(
        (frozen.offered, frozen.delivered, frozen.released),
        (10, 10, 2)
    );
    assert!(!frozen.balanced(), "offered 10 != 10 + 2");
    // With the loss recovered the same history balances, and the growth shows.
    let mut b = Account::resume(Persisted::default(), floor);
    b.recover(true, LOST_AT, Mode::AtLeastOnce);
    b.report(&life("new", LOST_AT + 1, 2, LOST_AT + 2, s));
    let t = b.totals();
    assert_eq!((t.offered, t.delivered, t.released), (15, 13, 2));
    assert!(t.balanced());
}

#[test]
fn nothing_is_offset_when_what_is_counted_explains_status() {
    // The ledger was missing, but the reports alone account for everything status showed.
    let floor = nacked(5);
    let mut a = Account::resume(Persisted::default(), floor);
    a.report(&report("a", 9, 10, nacked(5)));
    assert_eq!(a.recover(true, LOST_AT, Mode::AtLeastOnce), None);
    assert_eq!(a.offset(), ConsumerStats::default());
    assert_eq!(a.persisted().lost, None);
    // Nor when status shows nothing at all (a new Subscription).
    let mut b = Account::resume(Persisted::default(), ConsumerStats::default());
    assert_eq!(b.recover(true, LOST_AT, Mode::AtLeastOnce), None);
}

#[test]
fn with_the_ledger_read_exhausted_alone_below_status_is_no_loss() {
    // Advisories held back by an unsaved ledger come again after the replay: not a loss.
    let mut floor = nacked(5);
    floor.exhausted = 7;
    let mut a = Account::resume(Persisted::default(), floor);
    a.report(&report("a", 9, 10, nacked(5)));
    assert_eq!(a.recover(false, LOST_AT, Mode::AtLeastOnce), None);
    // With the ledger gone, its broker tally went with it: that is a loss.
    let mut b = Account::resume(Persisted::default(), floor);
    b.report(&report("a", 9, 10, nacked(5)));
    assert_eq!(
        b.recover(true, LOST_AT, Mode::AtLeastOnce),
        Some(Source::Ledger)
    );
    assert_eq!(b.offset().exhausted, 2);
    assert_eq!(b.totals(), floor);
}

#[test]
fn a_lost_report_written_again_is_charged_against_the_offset_never_counted_twice() {
    // The report bucket was reset; the ledger (the broker's tally of 5) survived. The
    // instance runs on: its next report carries everything since it started.
    let mut before = Account::default();
    before.report(&report("a", 9, 10, nacked(5)));
    for seq in 1..=5 {
        before.broker_exhausted_message(seq, seq);
    }
    let floor = before.totals();
    let mut a = Account::resume(before.persisted().clone(), floor);
    assert_eq!(
        a.recover(false, LOST_AT, Mode::AtLeastOnce),
        Some(Source::Reports)
    );
    assert_eq!(a.totals(), floor);
    // Two more messages: the instance's report is back with 7.
    a.report(&report("a", 12, LOST_AT + 10, nacked(7)));
    a.broker_exhausted_message(6, 6);
    a.broker_exhausted_message(7, 7);
    let t = a.totals();
    assert_eq!(t, nacked(7), "{t:?}");
    assert_eq!(a.offset(), ConsumerStats::default(), "all of it charged");
    // A later report of it counts its growth only.
    a.report(&report("a", 13, LOST_AT + 20, nacked(8)));
    assert_eq!(a.totals(), nacked(8));
}

#[test]
fn a_life_back_with_attempts_in_flight_keeps_the_identity_once_they_finish() {
    let floor = stats(15, 0, 0);
    let mut a = Account::resume(Persisted::default(), floor);
    assert_eq!(
        a.recover(false, LOST_AT, Mode::AtLeastOnce),
        Some(Source::Reports)
    );
    let mut busy = stats(15, 0, 0);
    busy.offered += 1;
    a.report(&report("a", 20, LOST_AT + 1, busy));
    let t = a.totals();
    assert!(dominates(&t, &floor));
    assert_eq!(
        t.offered, 16,
        "the attempt in flight is offered since: {t:?}"
    );
    a.report(&report("a", 21, LOST_AT + 2, stats(16, 0, 0)));
    let t = a.totals();
    assert_eq!(t, stats(16, 0, 0));
    assert!(t.balanced());
}

#[test]
fn two_lost_lives_hide_growth_until_both_are_back_then_count_exactly() {
    let floor = add(&stats(10, 0, 0), &stats(5, 0, 0));
    let mut a = Account::resume(Persisted::default(), floor);
    a.recover(false, LOST_AT, Mode::AtLeastOnce);
    // `a` (10 before) is back with 12: its 2 are hidden by `b`'s share of the offset.
    a.report(&report("a", 5, LOST_AT + 1, stats(12, 0, 0)));
    assert_eq!(a.totals(), floor);
    // `b` (5 before) is back with 6: every attempt is counted once.
    a.report(&report("b", 5, LOST_AT + 1, stats(6, 0, 0)));
    assert_eq!(a.totals(), stats(18, 0, 0));
    // A life started after the loss is never charged.
    a.report(&life("c", LOST_AT + 5, 1, LOST_AT + 6, stats(1, 0, 0)));
    assert_eq!(a.totals(), stats(19, 0, 0));
}

#[test]
fn attempts_in_flight_when_status_was_written_are_given_up_by_the_offset() {
    let mut floor = stats(8, 0, 0);
    floor.offered = 10;
    for (mode, released, lost) in [(Mode::AtLeastOnce, 2, 0), (Mode::AtMostOnce, 0, 2)] {
        let mut a = Account::resume(Persisted::default(), floor);
        a.recover(true, LOST_AT, mode);
        let t = a.totals();
        assert_eq!(
            (t.offered, t.delivered, t.released, t.lost),
            (10, 8, released, lost)
        );
        assert!(t.balanced(), "{mode:?}: {t:?}");
    }
}

#[test]
fn after_a_loss_a_restarted_operator_resumes_the_offset_and_charges_no_life_twice() {
    let floor = add(&nacked(5), &nacked(2));
    let mut a = Account::resume(Persisted::default(), floor);
    a.report(&report("kept", 3, LOST_AT - 5, nacked(2)));
    a.recover(false, LOST_AT, Mode::AtLeastOnce);
    a.report(&report("back", 8, LOST_AT + 1, nacked(6)));
    a.report(&report("kept", 4, LOST_AT + 1, nacked(3)));
    let shown = a.totals();
    assert_eq!(shown, add(&nacked(6), &nacked(3)));
    // The operator restarts: the saved ledger, the same reports again, status as floor.
    let text = serde_json::to_string(a.persisted()).expect("serialises");
    let mut b = Account::resume(serde_json::from_str(&text).expect("parses"), shown);
    b.report(&report("back", 8, LOST_AT + 1, nacked(6)));
    b.report(&report("kept", 4, LOST_AT + 1, nacked(3)));
    assert_eq!(b.recover(false, LOST_AT + 50, Mode::AtLeastOnce), None);
    assert_eq!(b.counted_with_offset(), shown, "nothing charged again");
    b.report(&report("back", 9, LOST_AT + 60, nacked(7)));
    assert_eq!(b.totals(), add(&nacked(7), &nacked(3)));
}

#[test]
fn a_ledger_saved_before_offsets_reads_with_none() {
    let old: Persisted =
        serde_json::from_str(r#"{"retired":{"offered":3},"folded":{}}"#).expect("an older ledger");
    assert_eq!(old.offset, ConsumerStats::default());
    assert_eq!(old.lost, None);
    // And a ledger without a loss saves as before (no new fields).
    let saved = serde_json::to_value(Persisted::default()).expect("serialises");
    assert!(
        saved.get("offset").is_none() && saved.get("lost").is_none(),
        "{saved}"
    );
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
    assert_eq!(b.counted().exhausted, 2);
    // The same message, reported again by a late terminate after its attempts ran out.
    assert_eq!(a.broker_exhausted_message(3, 40), BrokerOutcome::Duplicate);
    assert_eq!(a.counted().exhausted, 2);
    // A consumer made again may lose the same stream sequence again: a new loss.
    a.consumer_recreated();
    assert_eq!(a.broker_exhausted_message(4, 40), BrokerOutcome::Counted);
    assert_eq!(a.counted().exhausted, 3);
}

#[test]
fn the_broker_tally_survives_a_restart_through_what_is_persisted() {
    let mut a = Account::default();
    for (capture, seq) in [(10, 1), (11, 2), (12, 3)] {
        a.broker_exhausted_message(capture, seq);
    }
    let saved = serde_json::to_string(a.persisted()).expect("serialises");
    let back: Persisted = serde_json::from_str(&saved).expect("parses");
    let mut b = Account::resume(back, ConsumerStats::default());
    assert_eq!(b.broker_exhausted_message(12, 3), BrokerOutcome::Replayed);
    assert_eq!(b.broker_exhausted_message(13, 4), BrokerOutcome::Counted);
    assert_eq!(b.counted().exhausted, 4);
    // What an older operator persisted (no broker tally) still reads.
    let old: Persisted = serde_json::from_str(r#"{"retired":{},"folded":{}}"#).expect("old form");
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
    assert_eq!(a.counted().exhausted, REMEMBERED_EXHAUSTED as u64 + 500);
}

/// Any ConsumerStats, every one of the 13 counters free.
fn arb_counters() -> impl Strategy<Value = ConsumerStats> {
    (prop::array::uniform13(0u64..40)).prop_map(|c| ConsumerStats {
        offered: c[0],
        delivered: c[1],
        released: c[2],
        lost: c[3],
        settlement: Settlement {
            acked: c[4],
            nacked: c[5],
            silent: c[6],
            refused: c[7],
        },
        exhausted: c[8],
        stranded: c[9],
        lease_expired: c[10],
        delay_shortened: c[11],
        foreign_conflicts: c[12],
    })
}

/// A life's cumulative reports: each counter only grows (by arbitrary steps).
fn arb_life() -> impl Strategy<Value = Vec<ConsumerStats>> {
    prop::collection::vec(arb_counters(), 1..6).prop_map(|steps| {
        let mut acc = ConsumerStats::default();
        steps
            .into_iter()
            .map(|s| {
                acc = add(&acc, &s);
                acc
            })
            .collect()
    })
}

proptest! {
    /// The account as counted (no floor to hide behind) is exactly the model: per life, the
    /// per-counter maximum of the reports counted, summed over lives; whatever the order,
    /// repeats and stale reports. Every one of the 13 counters is varied, so a mix-up of
    /// any two fails.
    #[test]
    fn the_counted_account_is_the_sum_of_each_lifes_latest_report(
        lives in prop::collection::vec((0usize..3, arb_life()), 1..5),
        shuffle in any::<u64>(),
    ) {
        // Lives of up to three instance names; a name's lives start in order.
        let mut all = Vec::new();
        let mut model = ConsumerStats::default();
        for (n, (name, reports)) in lives.iter().enumerate() {
            let started = n as u64 * 1_000;
            for (i, s) in reports.iter().enumerate() {
                all.push(life(&format!("i{name}"), started, i as u64 + 1, started + i as u64, *s));
            }
            model = add(&model, reports.last().expect("a report"));
        }
        // Reports of one name arrive life by life (a new life ends the one before); within
        // a life, in any order and twice.
        let mut x = shuffle | 1;
        let mut a = Account::default();
        let mut by_name: BTreeMap<String, Vec<&StatsReport>> = BTreeMap::new();
        for r in &all {
            by_name.entry(r.instance.clone()).or_default().push(r);
        }
        for reports in by_name.values() {
            let mut lives: BTreeMap<u64, Vec<&StatsReport>> = BTreeMap::new();
            for r in reports {
                lives.entry(r.started_at_ms).or_default().push(r);
            }
            for mut rs in lives.into_values() {
                for i in (1..rs.len()).rev() {
                    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                    rs.swap(i, (x % (i as u64 + 1)) as usize);
                }
                for r in rs.iter().chain(rs.iter()) {
                    a.report(r);
                }
            }
        }
        // Lives replaced by a newer one gave their unfinished attempts up; the live ones
        // have not ended yet. The model adds exactly that.
        let mut expect = model;
        for reports in by_name.values() {
            let newest = reports.iter().map(|r| r.started_at_ms).max().unwrap_or(0);
            let mut ended: BTreeMap<u64, ConsumerStats> = BTreeMap::new();
            for r in reports.iter().filter(|r| r.started_at_ms < newest) {
                let e = ended.entry(r.started_at_ms).or_default();
                *e = max(e, &r.stats);
            }
            for s in ended.values() {
                let gap = Seen { stats: *s, ..Seen::of(reports[0]) }.in_flight();
                expect.released += gap;
            }
        }
        prop_assert_eq!(a.counted(), expect);
    }

    /// A source lost against a model of the lives that made status. Before the loss, lives
    /// at rest (balanced) made status; then some lives' counts are lost (their reports gone,
    /// or, when the ledger goes, their folds), the account recovers, and lives grow, come
    /// back and start, in any order, with an operator restart anywhere. At every step no
    /// counter goes down and the identity holds (every life is at rest); growth of a life
    /// the account still knew shows one for one; nothing is ever counted beyond the truth;
    /// once every lost life is back, the account is exactly the truth.
    #[test]
    fn after_a_source_is_lost_the_account_follows_the_truth_and_never_steps_down(
        lives in prop::collection::vec((arb_counters(), any::<bool>()), 1..5),
        growth_steps in prop::collection::vec((0usize..6, arb_counters()), 0..12),
        ledger in any::<bool>(),
        restart_at in 0usize..14,
    ) {
        let balanced = |mut s: ConsumerStats| {
            s.offered = s.delivered + s.released + s.lost;
            s.exhausted = 0; // the broker's tally is not in this model
            s
        };
        // Before: every life reported at rest; the lost ones are folded when the ledger is
        // what goes (their reports are removed then).
        let mut before = Account::default();
        let mut now: Vec<ConsumerStats> = Vec::new();
        let mut seqs: Vec<u64> = Vec::new();
        for (i, (s, _)) in lives.iter().enumerate() {
            let s = balanced(*s);
            let at = if ledger && lives[i].1 { 10 } else { 500_000 };
            before.report(&report(&format!("p{i}"), 1, at, s));
            now.push(s);
            seqs.push(1);
        }
        if ledger {
            fold_silent(&mut before, 400_000, 1_000);
        }
        let floor = before.totals();
        let mut truth = floor;
        // The loss: the ledger (and the folds in it), or the lost lives' reports.
        let kept = if ledger { Persisted::default() } else { before.persisted().clone() };
        let mut a = Account::resume(kept, floor);
        let mut back: Vec<bool> = lives.iter().map(|(_, lost)| !lost).collect();
        // The reports in the bucket now, as a restarted operator replays them.
        let mut bucket: BTreeMap<String, StatsReport> = BTreeMap::new();
        for (i, (_, lost)) in lives.iter().enumerate() {
            if !lost {
                let r = report(&format!("p{i}"), 1, 500_000, now[i]);
                a.report(&r);
                bucket.insert(r.instance.clone(), r);
            }
        }
        a.recover(ledger, LOST_AT, Mode::AtLeastOnce);
        let mut last = a.totals();
        prop_assert!(dominates(&last, &floor), "{last:?} below {floor:?}");
        prop_assert!(last.balanced(), "{last:?}");
        let mut known_growth = ConsumerStats::default();
        for (step, (who, g)) in growth_steps.iter().enumerate() {
            if step == restart_at {
                let text = serde_json::to_string(a.persisted()).expect("serialises");
                let mut b = Account::resume(serde_json::from_str(&text).expect("parses"), last);
                for r in bucket.values() {
                    b.report(r);
                }
                prop_assert_eq!(b.recover(false, LOST_AT + 1, Mode::AtLeastOnce), None);
                prop_assert_eq!(b.totals(), last);
                a = b;
            }
            let g = balanced(*g);
            let i = *who;
            truth = add(&truth, &g);
            if i < now.len() {
                // A life of before grows (and, if it was lost, comes back with it).
                if back[i] {
                    known_growth = add(&known_growth, &g);
                }
                back[i] = true;
                now[i] = add(&now[i], &g);
                seqs[i] += 1;
                let r = report(&format!("p{i}"), seqs[i], LOST_AT + step as u64, now[i]);
                a.report(&r);
                bucket.insert(r.instance.clone(), r);
            } else {
                // A life started after the loss.
                known_growth = add(&known_growth, &g);
                let started = LOST_AT + 1 + step as u64;
                let r = life(&format!("n{step}"), started, 1, started, g);
                a.report(&r);
                bucket.insert(r.instance.clone(), r);
            }
            let t = a.totals();
            prop_assert!(dominates(&t, &last), "went down: {last:?} -> {t:?}");
            prop_assert!(t.balanced(), "{t:?}");
            prop_assert!(dominates(&truth, &t), "beyond the truth: {t:?} > {truth:?}");
            prop_assert!(
                dominates(&t, &add(&floor, &known_growth)),
                "growth hidden: {t:?} < {floor:?} + {known_growth:?}"
            );
            last = t;
        }
        if back.iter().all(|b| *b) {
            prop_assert_eq!(a.totals(), truth);
        }
    }

    /// Whatever arrives, in whatever order, with folds and returns in between: the account
    /// as counted (no floor) never goes down, and at rest after a fold the identity holds.
    #[test]
    fn the_counted_account_never_decreases_and_balances_after_folds(
        steps in prop::collection::vec(
            (0usize..4, 1u64..20, arb_counters(), any::<bool>(), 0u64..30),
            1..80,
        )
    ) {
        let mut a = Account::default();
        let mut last = a.counted();
        let mut clock = 0u64;
        let mut seqs = [0u64; 4];
        let mut acc = [ConsumerStats::default(); 4];
        for (inst, jump, grow, fold, broker) in steps {
            clock += 10;
            seqs[inst] += jump;
            acc[inst] = add(&acc[inst], &grow);
            a.report(&report(&format!("i{inst}"), seqs[inst], clock, acc[inst]));
            a.broker_exhausted(broker);
            if fold {
                fold_silent(&mut a, clock, 15);
            }
            let now = a.counted();
            prop_assert!(dominates(&now, &last), "went down: {last:?} -> {now:?}");
            last = now;
        }
    }

    /// Lives whose reports balance at rest, some killed with attempts in flight: once every
    /// instance is folded, offered == delivered + released + lost.
    #[test]
    fn the_identity_holds_at_rest_once_the_dead_are_folded(
        lives in prop::collection::vec((0u64..30, 0u64..5, 0u64..5, any::<bool>()), 1..8),
    ) {
        let mut a = Account::default();
        for (i, (done, in_flight, released, amo)) in lives.iter().enumerate() {
            let mut s = stats(*done, 0, 0);
            s.released = *released;
            s.offered += released + in_flight;
            let mut r = report(&format!("p{i}"), 1, 10, s);
            if *amo { r.mode = Mode::AtMostOnce; }
            a.report(&r);
        }
        fold_silent(&mut a, 1_000_000, 60);
        let t = a.counted();
        prop_assert!(t.balanced(), "{:?}", t);
    }
}
