//! The table tests of `status` (its pure rules, case by case).

use super::*;
use k8s_openapi::jiff::Timestamp;
use settle::api::ConsumerStats;

const MIN: u64 = 60_000;
const WINDOW: Duration = Duration::from_secs(15 * 60);

fn stats(exhausted: u64, stranded: u64) -> SubscriptionStats {
    SubscriptionStats {
        counters: ConsumerStats {
            exhausted,
            stranded,
            ..ConsumerStats::default()
        },
        ..SubscriptionStats::default()
    }
}

#[test]
fn a_loss_a_stranding_or_a_flipped_condition_matters_other_counters_do_not() {
    let now = Time(Timestamp::from_second(1_700_000_000).expect("time"));
    let quiet = |s: &SubscriptionStats| wants(s, 0, WINDOW, Unseen::Never, &Trouble::default());
    let shown = stats(2, 1);
    let existing: Vec<Condition> = quiet(&shown)
        .iter()
        .map(|w| condition::settle(&[], w, Some(1), &now))
        .collect();
    // Acked, delivered, the gauges move: not urgent.
    let mut moved = shown.clone();
    moved.counters.offered = 100;
    moved.counters.settlement.acked = 90;
    moved.pending = 7;
    assert!(!matters(Some(&shown), &existing, &moved, &quiet(&moved)));
    // Exhausted grew: urgent, and so does Stranded.
    let lost = stats(3, 1);
    assert!(matters(Some(&shown), &existing, &lost, &quiet(&lost)));
    let stranded = stats(2, 2);
    assert!(matters(
        Some(&shown),
        &existing,
        &stranded,
        &quiet(&stranded)
    ));
    // Exhausting turns True with the same counts shown (the loss was shown, its condition
    // not yet): a flip.
    let losing = wants(&shown, 1, WINDOW, Unseen::Never, &Trouble::default());
    assert!(matters(Some(&shown), &existing, &shown, &losing));
    // A first status: urgent only if it shows a loss.
    let mut first = stats(0, 0);
    first.counters.settlement.acked = 5;
    assert!(!matters(None, &[], &first, &quiet(&first)));
    assert!(matters(None, &[], &lost, &quiet(&lost)));
}

#[test]
fn loss_counts_only_growth_inside_the_window() {
    let mut log = LossLog::default();
    log.observe(0, 5, WINDOW); // baseline: 5 lost before counting began
    assert_eq!(log.lost_within(0, WINDOW), 0);
    log.observe(MIN, 8, WINDOW);
    assert_eq!(log.lost_within(MIN, WINDOW), 3);
    log.observe(10 * MIN, 10, WINDOW);
    assert_eq!(log.lost_within(10 * MIN, WINDOW), 5);
    // 16 minutes in, the growth at minute 1 has left the window; minute 10's is inside.
    log.observe(16 * MIN, 10, WINDOW);
    assert_eq!(log.lost_within(16 * MIN, WINDOW), 2);
    // 26 minutes in, nothing grew within the window.
    log.observe(26 * MIN, 10, WINDOW);
    assert_eq!(log.lost_within(26 * MIN, WINDOW), 0);
    assert!(log.samples.len() <= 2, "old samples are dropped: {log:?}");
}

#[test]
fn a_total_that_does_not_grow_adds_no_sample() {
    let mut log = LossLog::default();
    for t in 0..100 {
        log.observe(t * 1000, 7, WINDOW);
    }
    assert_eq!(log.samples.len(), 1);
    assert_eq!(log.lost_within(100_000, WINDOW), 0);
}

#[test]
fn the_log_survives_a_restart() {
    let mut log = LossLog::default();
    log.observe(0, 0, WINDOW);
    log.observe(MIN, 4, WINDOW);
    let back: LossLog =
        serde_json::from_str(&serde_json::to_string(&log).expect("json")).expect("parses");
    assert_eq!(back.lost_within(2 * MIN, WINDOW), 4);
}

#[test]
fn exhausting_says_how_many_within_the_window_and_stranding_says_how_many_in_all() {
    let [e, s, a] = wants(&stats(12, 0), 3, WINDOW, Unseen::Never, &Trouble::default());
    assert_eq!((a.status, a.reason), (Status::True, reasons::KEPT));
    assert_eq!(
        (e.status, e.reason),
        (Status::True, reasons::MESSAGES_EXHAUSTED)
    );
    assert!(
        e.message.starts_with(
            "3 message(s) ran out of attempts (maxDeliver) in the last 15m (12 in all)"
        ),
        "{}",
        e.message
    );
    assert_eq!(
        (s.status, s.reason),
        (Status::False, reasons::NONE_STRANDED)
    );

    let [e, s, _] = wants(
        &stats(12, 2),
        0,
        WINDOW,
        Unseen::FromAdvisories,
        &Trouble::default(),
    );
    assert_eq!(
        (e.status, e.reason),
        (Status::False, reasons::NO_RECENT_LOSS)
    );
    assert!(
        e.message.contains("may undercount"),
        "the unseen-attempt note: {}",
        e.message
    );
    assert_eq!(
        (s.status, s.reason),
        (Status::True, reasons::MESSAGES_STRANDED)
    );
    assert!(s.message.starts_with("2 message(s)"));
}

#[test]
fn windows_read_like_kubernetes_durations() {
    assert_eq!(window_text(Duration::from_secs(900)), "15m");
    assert_eq!(window_text(Duration::from_secs(7200)), "2h");
    assert_eq!(window_text(Duration::from_secs(90)), "90s");
}

#[test]
fn the_patch_keeps_transition_times_of_unchanged_conditions() {
    let t0 = Time(Timestamp::from_second(1_000).expect("time"));
    let t1 = Time(Timestamp::from_second(2_000).expect("time"));
    let w = wants(&stats(1, 0), 1, WINDOW, Unseen::Never, &Trouble::default());
    let first = patch(&stats(1, 0), &w, &[], Some(1), &t0);
    let existing: Vec<Condition> =
        serde_json::from_value(first["status"]["conditions"].clone()).expect("conditions");
    assert!(!conditions_differ(&existing, &w));
    let again = patch(
        &stats(2, 0),
        &wants(&stats(2, 0), 2, WINDOW, Unseen::Never, &Trouble::default()),
        &existing,
        Some(1),
        &t1,
    );
    let conds: Vec<Condition> =
        serde_json::from_value(again["status"]["conditions"].clone()).expect("conditions");
    assert_eq!(
        conds[0].last_transition_time, t0,
        "still True: its time stays"
    );
    assert_eq!(again["status"]["stats"]["exhausted"], 2);
    assert_eq!(again["status"]["statsUpdatedAt"], serde_json::json!(t1));
    assert!(conditions_differ(
        &existing,
        &wants(&stats(1, 0), 0, WINDOW, Unseen::Never, &Trouble::default())
    ));
}

#[test]
fn a_full_report_store_is_said_with_its_fill_and_what_to_do() {
    let full = Trouble {
        store_full: Some("bucket settle-stats holds 1048000 of its 1048576 bytes".into()),
        ..Trouble::default()
    };
    let [_, _, a] = wants(&stats(0, 0), 0, WINDOW, Unseen::Never, &full);
    assert_eq!(
        (a.status, a.reason),
        (Status::False, reasons::REPORT_STORE_FULL)
    );
    assert!(
        a.message.contains("1048000 of its 1048576")
            && a.message.contains("--report-bucket-max-bytes"),
        "{}",
        a.message
    );
}

#[test]
fn a_missing_report_queue_and_too_many_dead_letters_are_said() {
    let missing = Trouble {
        queue_missing: Some("shop-orders-settle-stats.fifo".into()),
        ..Trouble::default()
    };
    let [_, _, a] = wants(&stats(0, 0), 0, WINDOW, Unseen::Never, &missing);
    assert_eq!(
        (a.status, a.reason),
        (Status::False, reasons::REPORT_QUEUE_MISSING)
    );
    assert!(
        a.message.contains("shop-orders-settle-stats.fifo"),
        "{}",
        a.message
    );
    let [e, _, _] = wants(
        &stats(1, 0),
        1,
        WINDOW,
        Unseen::TooManyDeadLetters(2000),
        &Trouble::default(),
    );
    assert!(
        e.message.contains("holds 2000 messages") && e.message.contains("undercount"),
        "{}",
        e.message
    );
}

#[test]
fn accounted_says_why_the_account_is_not_whole() {
    let unsaved = Trouble {
        unsaved: Some("no space".into()),
        missed_advisories: 3,
        source_lost: Some(Source::Ledger),
        dead_letters: None,
        queue_missing: None,
        store_full: None,
        dropped_reports: None,
    };
    let [_, _, a] = wants(&stats(0, 0), 0, WINDOW, Unseen::Never, &unsaved);
    assert_eq!(
        (a.status, a.reason),
        (Status::False, reasons::LEDGER_NOT_SAVED)
    );
    assert!(a.message.contains("(no space)"), "{}", a.message);
    let gap = Trouble {
        unsaved: None,
        missed_advisories: 3,
        source_lost: None,
        dead_letters: None,
        queue_missing: None,
        store_full: None,
        dropped_reports: None,
    };
    let [_, _, a] = wants(&stats(0, 0), 0, WINDOW, Unseen::Never, &gap);
    assert_eq!((a.status, a.reason), (Status::False, reasons::CAPTURE_GAP));
    assert!(a.message.starts_with("3 advisory(ies)"), "{}", a.message);
    let [e, _, _] = wants(&stats(1, 0), 1, WINDOW, Unseen::Uncounted, &gap);
    assert!(
        e.message.contains("reports no such loss")
            && e.message.contains("spec.rabbitmq.deadLetterExchange"),
        "the RabbitMQ note says how to count them: {}",
        e.message
    );
    let [e, _, _] = wants(&stats(1, 0), 1, WINDOW, Unseen::FromDeadLetters, &gap);
    assert!(!e.message.contains("reports no such loss"), "{}", e.message);
    let missed = Trouble {
        dead_letters: Some("the copy queue was deleted on the broker".into()),
        ..Trouble::default()
    };
    let [_, _, a] = wants(&stats(0, 0), 0, WINDOW, Unseen::FromDeadLetters, &missed);
    assert_eq!(
        (a.status, a.reason),
        (Status::False, reasons::DEAD_LETTERS_MISSED)
    );
    assert!(a.message.contains("deleted on the broker"), "{}", a.message);
}

#[test]
fn accounted_says_which_source_was_lost_and_that_counting_goes_on_from_status() {
    for (source, names) in [
        (Source::Ledger, "settle-account"),
        (Source::Reports, "settle-stats"),
    ] {
        let lost = Trouble {
            source_lost: Some(source),
            missed_advisories: 2,
            ..Trouble::default()
        };
        let [_, _, a] = wants(&stats(0, 0), 0, WINDOW, Unseen::Never, &lost);
        assert_eq!((a.status, a.reason), (Status::False, reasons::SOURCE_LOST));
        assert!(a.message.contains(names), "{}", a.message);
        assert!(
            a.message
                .contains("Counting continues from what status showed"),
            "{}",
            a.message
        );
        assert!(a.message.contains("may be missing"), "{}", a.message);
        assert!(a.message.contains("15m after"), "{}", a.message);
    }
    // A save failing now says more than a loss that is over.
    let both = Trouble {
        unsaved: Some("no space".into()),
        source_lost: Some(Source::Reports),
        ..Trouble::default()
    };
    let [_, _, a] = wants(&stats(0, 0), 0, WINDOW, Unseen::Never, &both);
    assert_eq!(a.reason, reasons::LEDGER_NOT_SAVED);
}

#[test]
fn a_gauges_only_patch_keeps_the_counters_status_shows() {
    let t = Time(Timestamp::from_second(1_000).expect("time"));
    let counters = ConsumerStats {
        offered: 7,
        delivered: 7,
        ..ConsumerStats::default()
    };
    let p = gauges_patch(3, 1, Some(&counters), &t);
    assert_eq!(p["status"]["stats"]["offered"], 7);
    assert_eq!(p["status"]["stats"]["pending"], 3);
    let p = gauges_patch(3, 1, None, &t);
    assert!(p["status"]["stats"].get("offered").is_none(), "{p}");
    assert_eq!(p["status"]["stats"]["ackPending"], 1);
}

#[test]
fn dropped_reports_are_said_with_the_last_reason_until_the_window_passes() {
    let mut t = Trouble::default();
    t.report_dropped("too_many_instances", 1_000);
    t.report_dropped("from_the_future", 2_000);
    let [_, _, a] = wants(&stats(0, 0), 0, WINDOW, Unseen::Never, &t);
    assert_eq!(
        (a.status, a.reason),
        (Status::False, reasons::REPORTS_DROPPED)
    );
    assert!(
        a.message.starts_with("2 stats report(s)")
            && a.message.contains("the last as from_the_future")
            && a.message.contains("--max-clock-skew"),
        "{}",
        a.message
    );
    let window = u64::try_from(WINDOW.as_millis()).expect("ms");
    t.forget_dropped_before(2_000 + window - 1, WINDOW);
    assert!(t.dropped_reports.is_some(), "within the window");
    t.forget_dropped_before(2_000 + window, WINDOW);
    let [_, _, a] = wants(&stats(0, 0), 0, WINDOW, Unseen::Never, &t);
    assert_eq!((a.status, a.reason), (Status::True, reasons::KEPT));
}
