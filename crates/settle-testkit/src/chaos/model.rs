//! The checker of status against what the handlers did ([`super::answers`]). At rest every
//! counter equals the model, except where an application was SIGKILLed: what it
//! answered after its last report never reached the account, and the semantics (C16) move it
//! into Released when the instance is folded. The applications report every 200 ms, so the
//! checker allows, per kill, what that instance finished settling in the [`KILL_WINDOW`] before
//! it (or was still settling at it), and says which rule allowed each difference it accepted.
//! A consumer deleted on the broker and made again ([`Earlier`]) owes its messages afresh: the
//! messages that ran out under each earlier one count too, and a settlement around the
//! deletion may fail (C6) or a decline be Stranded (C8). A report source deleted on the broker
//! ([`Unreported`]) may take what the account had not counted yet: what a SIGKILLed instance
//! reported and the account had not read, and on NATS, where the loss is found and counting
//! goes on from status, what any instance did between the last status written and the loss
//! being found (C17).
//!
//! It must not build the model from Settle's counters, nor inject faults.

use std::collections::BTreeSet;
use std::time::Duration;

use settle::api::ConsumerStats;
use settle_operator::account::ledger::dominates;

use super::answers::{Answer, Model};
use super::conditions::OUTAGE_GRACE;
use crate::account::Seen;

/// The campaign's `maxDeliver`: an answer other than ack to this attempt exhausts a message.
pub const MAX_DELIVER: u32 = 3;

/// How far before its SIGKILL an instance's settlements may be missing from its reports, from
/// when each returned: its report interval (200 ms) and the report's way to the broker, with
/// room to spare.
pub const KILL_WINDOW: Duration = Duration::from_millis(1500);

/// An application SIGKILLed: its file, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kill {
    pub file: usize,
    pub at_ms: u64,
}

impl Kill {
    /// What its instance answered and never reported: settled within [`KILL_WINDOW`] before
    /// the kill, or never.
    pub fn unreported(&self) -> Unreported {
        let window = u64::try_from(KILL_WINDOW.as_millis()).unwrap_or(u64::MAX);
        Unreported {
            file: Some(self.file),
            from_ms: self.at_ms.saturating_sub(window),
            to_ms: self.at_ms,
        }
    }
}

/// Answers that may be missing from status: those of instance `file` (of every instance:
/// None) given by `to_ms` whose settlement returned from `from_ms` on, or never. A SIGKILL
/// leaves them ([`Kill::unreported`], C16), and a report source lost with reports the account
/// had not counted yet (C17).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unreported {
    pub file: Option<usize>,
    pub from_ms: u64,
    pub to_ms: u64,
}

/// The answers one of `windows` allows to be missing.
fn unreported<'a>(
    model: &'a Model,
    windows: &'a [Unreported],
) -> impl Iterator<Item = &'a Answer> + 'a {
    model.answers.iter().filter(move |a| {
        windows.iter().any(|w| {
            w.file.is_none_or(|f| f == a.file)
                && a.at_ms <= w.to_ms
                && a.done_ms.is_none_or(|d| d >= w.from_ms)
        })
    })
}

/// When the broker was down, in unix ms: from each fault until it was whole again (a
/// settlement may fail then, and for [`OUTAGE_GRACE`] after), and, narrower, when an ack sent
/// may have been lost (from a second before a server was hit: the server leading the consumer
/// until the broker was whole again, on the cluster another one while it was down or paused,
/// and a second more: semantics J3).
#[derive(Debug, Default)]
pub struct Outages {
    pub broker: Vec<(u64, u64)>,
    pub acks: Vec<(u64, u64)>,
}

/// Whether `at` falls in one of `windows` (unix ms, each end `grace` later).
pub(super) fn in_any(windows: &[(u64, u64)], at: u64, grace: u64) -> bool {
    windows
        .iter()
        .any(|(from, to)| *from <= at && at <= to.saturating_add(grace))
}

/// What the object's earlier consumers left, when its consumer or queue was deleted on the
/// broker and made again (same object, so every settlement counter goes on; but the consumer
/// made again owes its messages afresh, and a settlement to the one deleted fails).
#[derive(Debug, Default)]
pub struct Earlier {
    /// The answers since the consumer was last made (None: it never was deleted).
    pub last: Option<Model>,
    /// Messages that ran out under an earlier consumer: at least, and at most (those declined
    /// on their last attempt around its deletion may have been refused instead).
    pub exhausted: (u64, u64),
    /// When a consumer was gone (unix ms, from a second before its deletion until it was made
    /// again): a settlement may fail then (C6), and a decline be Stranded (C8).
    pub gone: Vec<(u64, u64)>,
}

impl Earlier {
    /// What `object`'s answers left under the consumers `gone` (unix ms: deleted, made again)
    /// before the last one; `acks_lost`, when an ack sent may have been lost (J3).
    pub fn of(object: &Model, gone: &[(u64, u64)], acks_lost: &[(u64, u64)]) -> Earlier {
        let Some(&(_, from)) = gone.last() else {
            return Earlier::default();
        };
        let windows: Vec<(u64, u64)> = gone
            .iter()
            .map(|(d, b)| (d.saturating_sub(1000), *b))
            .collect();
        let ran_out: Vec<&Answer> = object
            .answers
            .iter()
            .filter(|a| a.at_ms < from && a.attempt >= MAX_DELIVER && a.answer != "ack")
            .collect();
        let sure = ran_out
            .iter()
            .filter(|a| {
                !in_any(&windows, a.at_ms, 0) && a.done_ms.is_some_and(|d| !in_any(&windows, d, 0))
            })
            .count() as u64;
        // An ack of a last attempt that failed, or may have been lost, leaves the message to
        // run out on the broker (its dead-letter count, C7) with no decline answered.
        let unsure = object
            .answers
            .iter()
            .filter(|a| {
                a.at_ms < from
                    && a.attempt >= MAX_DELIVER
                    && a.answer == "ack"
                    && (a.failed || in_any(acks_lost, a.at_ms, 0))
            })
            .count() as u64;
        Earlier {
            last: Some(object.between(from, u64::MAX)),
            exhausted: (sure, ran_out.len() as u64 + unsure),
            gone: windows,
        }
    }
}

/// Every difference between status `s` (at rest) and the model of `published` messages (those
/// the last consumer owes), each with the rule it breaks; with the answers that may be
/// `unreported` (the applications SIGKILLed, a report source lost), the broker's `outages` and
/// what `earlier` consumers left, the differences C16, C17, J3 and C6/C8 allow are accepted,
/// and each is said in `allowed`.
pub fn check(
    model: &Model,
    published: u64,
    s: &ConsumerStats,
    missing: &[Unreported],
    outages: &Outages,
    earlier: &Earlier,
    allowed: &mut Vec<String>,
) -> Vec<String> {
    let lost: Vec<&Answer> = unreported(model, missing).collect();
    let grace = u64::try_from(OUTAGE_GRACE.as_millis()).unwrap_or(u64::MAX);
    let down = |at: u64| in_any(&outages.broker, at, grace) || in_any(&earlier.gone, at, grace);
    let ack_lost = |at: u64| in_any(&outages.acks, at, 0);
    // The messages the last consumer owes are judged by its answers.
    let last_made = earlier.last.as_ref().unwrap_or(model);
    // Ids whose every ack may not have reached the broker: it failed, or was sent while the
    // broker was down, the consumer had no leader or the server it went through was down or
    // paused (J3: such an ack is lost, and the message offered again, so it may run out).
    let unsure: BTreeSet<u64> = last_made
        .acked_ids
        .iter()
        .copied()
        .filter(|id| {
            last_made.unsure_acks.contains(id)
                || last_made
                    .answers
                    .iter()
                    .filter(|a| a.id == *id && a.answer == "ack")
                    .all(|a| ack_lost(a.at_ms))
        })
        .collect();
    let of = |kind: &str| lost.iter().filter(|a| a.answer == kind).count() as u64;
    let last = |ack: bool| {
        lost.iter()
            .filter(|a| a.attempt >= MAX_DELIVER && (a.answer == "ack") == ack)
            .count() as u64
    };
    let mut out = Vec::new();
    let mut within = |what: &str, status: u64, model: u64, below: u64, above: u64, rule: &str| {
        if status + below < model || status > model + above {
            out.push(format!(
                "{what}: status {status}, the handlers {model} ({rule}; a SIGKILL or a lost report source allows {below} fewer, {above} more)"
            ));
        } else if status != model {
            allowed.push(format!(
                "{what}: status {status}, the handlers {model}: allowed (C16: answered by a SIGKILLed instance after its last report; or C17: answered before a report source was lost and not counted yet; or J3: an ack that failed, or was sent while the broker was down, the consumer had no leader, or the server it went through was down or paused; or C6, C8: settled around a deletion of the consumer on the broker)"
            ));
        }
    };
    within(
        "delivered",
        s.delivered,
        model.attempts,
        lost.len() as u64,
        0,
        "every attempt a handler answered is delivered",
    );
    within(
        "acked",
        s.settlement.acked,
        model.acked,
        of("ack"),
        0,
        "every ack answered",
    );
    within(
        "nacked",
        s.settlement.nacked,
        model.nacked,
        of("nack"),
        0,
        "every nack answered",
    );
    within(
        "silent",
        s.settlement.silent,
        model.silent,
        of("silent"),
        0,
        "every attempt returned without settling",
    );
    // A last attempt declined after the instance's last report was counted by nobody but the
    // broker; one acked in the file may have died before its ack was sent, and run out. An
    // earlier consumer's messages that ran out count too (the consumer made again offers its
    // messages afresh, and they may run out again).
    let (ran_out, around) = (
        earlier.exhausted.0,
        earlier.exhausted.1 - earlier.exhausted.0,
    );
    within(
        "exhausted",
        s.exhausted,
        published.saturating_sub((last_made.acked_ids.len() - unsure.len()) as u64) + ran_out,
        last(false) + unsure.len() as u64,
        last(true) + around,
        "at rest every message not acknowledged ran out of attempts, and so did those that ran out under an earlier consumer",
    );
    within("lost", s.lost, 0, 0, 0, "nothing is lost under AtLeastOnce");
    let strandable = model
        .answers
        .iter()
        .filter(|a| a.answer != "ack" && in_any(&earlier.gone, a.at_ms, grace))
        .count() as u64;
    within(
        "stranded",
        s.stranded,
        0,
        0,
        strandable,
        "a decline is Stranded only when its consumer was deleted on the broker (C8)",
    );
    // A settlement the broker could not take fails in the handler and is refused (C6); only
    // a broker outage causes one here. Beyond the handlers' own, a silent attempt's decline,
    // which the runtime sends after the handler returned, may be refused while it is down.
    let outside = model.failed_at.iter().filter(|at| !down(**at)).count();
    if outside > 0 {
        out.push(format!(
            "{outside} settlements failed in the handlers outside a broker outage: no other fault of the campaign refuses one"
        ));
    }
    let silent_down = model
        .answers
        .iter()
        .filter(|a| a.answer == "silent" && down(a.at_ms))
        .count() as u64;
    let (refused, failed) = (s.settlement.refused, model.failed_at.len() as u64);
    if refused < failed || refused > failed + silent_down {
        out.push(format!(
            "refused: status {refused}, the handlers' failed settlements {} (C6: every settlement the broker did not take is refused; beyond the handlers' own only a silent attempt's decline while the broker was down, {silent_down} here)",
            failed
        ));
    } else if refused != failed {
        allowed.push(format!(
            "refused: status {refused}, the handlers' failed settlements {failed}: allowed (C6: silent attempts declined while the broker was down)",
        ));
    }
    if !s.balanced() {
        out.push(format!(
            "I1: offered {} != delivered {} + released {} + lost {}",
            s.offered, s.delivered, s.released, s.lost
        ));
    }
    out
}

/// Each object's last status seen, in the order the objects were made (a Subscription deleted
/// and applied again is a new object, with a new UID).
pub fn last_of_each(seen: &Seen) -> Vec<(String, ConsumerStats)> {
    let seen = seen.lock().map(|s| s.clone()).unwrap_or_default();
    let mut objects: Vec<(String, ConsumerStats)> = Vec::new();
    for (uid, stats) in seen {
        match objects.last_mut() {
            Some((last, s)) if *last == uid => *s = stats,
            _ => objects.push((uid, stats)),
        }
    }
    objects
}

/// Each counter of `s`, an earlier object's last status, above what its handlers answered
/// while it was the Subscription (`model`): a status is a floor of what happened (C14), and
/// an object counts nothing offered by another's consumer (C15).
pub fn above(s: &ConsumerStats, model: &Model) -> Vec<String> {
    [
        ("delivered", s.delivered, model.attempts),
        ("acked", s.settlement.acked, model.acked),
        ("nacked", s.settlement.nacked, model.nacked),
        ("silent", s.settlement.silent, model.silent),
    ]
    .into_iter()
    .filter(|(_, status, handlers)| status > handlers)
    .map(|(what, status, handlers)| {
        format!("{what}: status {status}, above the {handlers} its handlers answered (C14, C15)")
    })
    .collect()
}

/// Every pair of statuses of one object where a counter went down.
pub fn stepped_down(seen: &Seen) -> Vec<String> {
    let seen = seen.lock().map(|s| s.clone()).unwrap_or_default();
    seen.windows(2)
        .filter(|p| p[0].0 == p[1].0 && !dominates(&p[1].1, &p[0].1))
        .map(|p| {
            format!(
                "a counter went down in status: {:?} then {:?}",
                p[0].1, p[1].1
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(file: usize, at_ms: u64, id: u64, attempt: u32, answer: &str) -> Answer {
        Answer {
            file,
            at_ms,
            done_ms: Some(at_ms + 5),
            id,
            attempt,
            answer: answer.into(),
            how: answer.into(),
            failed: false,
            no_delay: false,
        }
    }

    /// Three messages: 1 acked at its first attempt, 2 nacked twice then acked, 3 nacked to
    /// its last attempt (exhausted).
    fn model() -> Model {
        let answers = vec![
            answer(0, 1000, 1, 1, "ack"),
            answer(0, 1100, 2, 1, "nack"),
            answer(0, 1200, 3, 1, "nack"),
            answer(1, 2000, 2, 2, "nack"),
            answer(1, 2100, 3, 2, "nack"),
            answer(1, 9000, 2, 3, "ack"),
            answer(1, 9100, 3, 3, "nack"),
        ];
        Model {
            attempts: 7,
            acked: 2,
            nacked: 5,
            acked_ids: [1, 2].into(),
            answers,
            ..Model::default()
        }
    }

    fn stats(delivered: u64, acked: u64, nacked: u64, exhausted: u64) -> ConsumerStats {
        let mut s = ConsumerStats {
            offered: delivered,
            delivered,
            exhausted,
            ..Default::default()
        };
        s.settlement.acked = acked;
        s.settlement.nacked = nacked;
        s
    }

    #[test]
    fn without_a_kill_every_counter_is_exact_and_each_difference_names_its_rule() {
        let mut allowed = Vec::new();
        assert!(
            check(
                &model(),
                3,
                &stats(7, 2, 5, 1),
                &[],
                &Outages::default(),
                &Earlier::default(),
                &mut allowed
            )
            .is_empty()
        );
        let mut s = stats(7, 2, 5, 0);
        s.offered = 8;
        let found = check(
            &model(),
            3,
            &s,
            &[],
            &Outages::default(),
            &Earlier::default(),
            &mut allowed,
        );
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found[0].starts_with("exhausted: status 0, the handlers 1"),
            "{found:?}"
        );
        assert!(found[1].starts_with("I1:"), "{found:?}");
        assert!(allowed.is_empty(), "{allowed:?}");
    }

    #[test]
    fn a_kill_allows_what_its_instance_answered_just_before_it_and_nothing_else() {
        // Instance 1 killed at 9150 ms: its last two answers (2's ack, 3's last nack) never
        // reached a report; the broker counted 3's exhaustion, or did not yet.
        let kills = [Kill {
            file: 1,
            at_ms: 9150,
        }];
        let mut allowed = Vec::new();
        let found = check(
            &model(),
            3,
            &stats(5, 1, 4, 0),
            &kills.map(|k| k.unreported()),
            &Outages::default(),
            &Earlier::default(),
            &mut allowed,
        );
        assert!(found.is_empty(), "{found:?}");
        assert_eq!(
            allowed.len(),
            4,
            "delivered, acked, nacked, exhausted: {allowed:?}"
        );
        assert!(allowed.iter().all(|a| a.contains("C16")), "{allowed:?}");
        // Beyond the window: the nacks at 2000 and 2100 ms were reported long before.
        let found = check(
            &model(),
            3,
            &stats(4, 1, 3, 0),
            &kills.map(|k| k.unreported()),
            &Outages::default(),
            &Earlier::default(),
            &mut Vec::new(),
        );
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].starts_with("delivered: status 4"), "{found:?}");
        assert!(found[1].starts_with("nacked: status 3"), "{found:?}");
        // A kill of the other instance allows nothing of this one's.
        let other = [Kill {
            file: 0,
            at_ms: 9150,
        }];
        assert_eq!(
            check(
                &model(),
                3,
                &stats(5, 1, 4, 0),
                &other.map(|k| k.unreported()),
                &Outages::default(),
                &Earlier::default(),
                &mut Vec::new()
            )
            .len(),
            4
        );
    }

    #[test]
    fn a_lost_report_source_allows_what_any_instance_settled_until_the_loss_was_found() {
        // Status last written at 1050 ms, the loss found at 2050: message 2's first nack (1100,
        // instance 0) and its second (2000, instance 1) may be missing, nothing later.
        let lost = [Unreported {
            file: None,
            from_ms: 1050,
            to_ms: 2050,
        }];
        let mut allowed = Vec::new();
        let found = check(
            &model(),
            3,
            &stats(4, 2, 2, 1),
            &lost,
            &Outages::default(),
            &Earlier::default(),
            &mut allowed,
        );
        assert!(found.is_empty(), "{found:?}");
        assert!(allowed.iter().all(|a| a.contains("C17")), "{allowed:?}");
        // The answers after the loss was found are counted again: none may be missing.
        let found = check(
            &model(),
            3,
            &stats(3, 1, 2, 1),
            &lost,
            &Outages::default(),
            &Earlier::default(),
            &mut Vec::new(),
        );
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].starts_with("delivered: status 3"), "{found:?}");
        assert!(found[1].starts_with("acked: status 1"), "{found:?}");
    }

    #[test]
    fn a_kill_allows_a_settlement_by_when_it_returned_not_when_it_was_decided() {
        // Message 1's last nack, decided at 2000 ms, long before the kill at 9150 ms: its
        // attempt is missing from the reports only if its settlement returned inside the
        // window, or never returned; the broker counted the message exhausted.
        let kills = [Kill {
            file: 1,
            at_ms: 9150,
        }];
        let mut m = Model {
            attempts: 1,
            nacked: 1,
            answers: vec![answer(1, 2000, 1, MAX_DELIVER, "nack")],
            ..Model::default()
        };
        let mut status = stats(0, 0, 0, 1);
        (status.offered, status.released) = (1, 1);
        let found = check(
            &m,
            1,
            &status,
            &kills.map(|k| k.unreported()),
            &Outages::default(),
            &Earlier::default(),
            &mut Vec::new(),
        );
        assert_eq!(found.len(), 2, "delivered, nacked: {found:?}");
        for done in [Some(8000), None] {
            m.answers[0].done_ms = done;
            let mut allowed = Vec::new();
            let found = check(
                &m,
                1,
                &status,
                &kills.map(|k| k.unreported()),
                &Outages::default(),
                &Earlier::default(),
                &mut allowed,
            );
            assert!(found.is_empty(), "{done:?}: {found:?}");
            assert_eq!(allowed.len(), 2, "delivered, nacked: {allowed:?}");
        }
    }

    #[test]
    fn a_settlement_fails_only_while_the_broker_is_down_and_each_is_refused() {
        // Message 1 acked at 2000 ms, the ack failing at 2010 ms (the broker may or may not
        // have taken it); message 2 silent at 2100 ms, its decline perhaps refused too.
        let m = Model {
            attempts: 2,
            acked: 1,
            silent: 1,
            failed_at: vec![2010],
            acked_ids: [1].into(),
            unsure_acks: [1].into(),
            answers: vec![
                answer(0, 2000, 1, 1, "ack"),
                answer(0, 2100, 2, 1, "silent"),
            ],
            ..Model::default()
        };
        let mut s = stats(2, 1, 0, 1);
        s.settlement.silent = 1;
        s.settlement.refused = 1;
        let outage = Outages {
            broker: vec![(1500, 2500)],
            acks: Vec::new(),
        };
        let found = check(
            &m,
            2,
            &s,
            &[],
            &Outages::default(),
            &Earlier::default(),
            &mut Vec::new(),
        );
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("outside a broker outage"), "{found:?}");
        assert!(
            check(
                &m,
                2,
                &s,
                &[],
                &outage,
                &Earlier::default(),
                &mut Vec::new()
            )
            .is_empty()
        );
        // The broker took the failed ack after all (one exhausted, message 2) or did not (two).
        s.exhausted = 2;
        let mut allowed = Vec::new();
        assert!(check(&m, 2, &s, &[], &outage, &Earlier::default(), &mut allowed).is_empty());
        assert_eq!(allowed.len(), 0, "{allowed:?}");
        s.exhausted = 1;
        // The silent attempt's decline refused as well: allowed, said.
        s.settlement.refused = 2;
        let mut allowed = Vec::new();
        assert!(check(&m, 2, &s, &[], &outage, &Earlier::default(), &mut allowed).is_empty());
        assert!(
            allowed.iter().any(|a| a.starts_with("refused")),
            "{allowed:?}"
        );
        // A failed settlement not counted refused, or one refused too many.
        for refused in [0, 3] {
            s.settlement.refused = refused;
            let found = check(
                &m,
                2,
                &s,
                &[],
                &outage,
                &Earlier::default(),
                &mut Vec::new(),
            );
            assert_eq!(found.len(), 1, "{refused}: {found:?}");
            assert!(found[0].starts_with("refused: status"), "{found:?}");
        }
    }

    #[test]
    fn an_ack_sent_while_the_broker_was_down_may_be_lost_and_its_message_run_out() {
        // Message 1 acked at 2000 ms, while the broker was down: the ack returned (NATS sends
        // it without an answer) but may never have been taken, and the message offered again
        // and declined to its last attempt.
        let m = Model {
            attempts: 1,
            acked: 1,
            acked_ids: [1].into(),
            answers: vec![answer(0, 2000, 1, 1, "ack")],
            ..Model::default()
        };
        let mut s = stats(1, 1, 0, 1);
        // The broker down from 1500 to 2500 ms, the server leading the consumer among it.
        let outage = Outages {
            broker: vec![(1500, 2500)],
            acks: vec![(500, 2500)],
        };
        let found = check(
            &m,
            1,
            &s,
            &[],
            &Outages::default(),
            &Earlier::default(),
            &mut Vec::new(),
        );
        assert_eq!(
            found.len(),
            1,
            "outside an outage the ack was taken: {found:?}"
        );
        assert!(found[0].starts_with("exhausted"), "{found:?}");
        assert!(
            check(
                &m,
                1,
                &s,
                &[],
                &outage,
                &Earlier::default(),
                &mut Vec::new()
            )
            .is_empty()
        );
        // A follower hit instead: the consumer kept its leader, the ack was taken.
        let follower = Outages {
            broker: vec![(1500, 2500)],
            acks: Vec::new(),
        };
        assert_eq!(
            check(
                &m,
                1,
                &s,
                &[],
                &follower,
                &Earlier::default(),
                &mut Vec::new()
            )
            .len(),
            1,
            "a follower's outage loses no ack"
        );
        // Taken after all: nothing ran out, as the handlers say; allowed, and said.
        s.exhausted = 0;
        let mut allowed = Vec::new();
        assert!(check(&m, 1, &s, &[], &outage, &Earlier::default(), &mut allowed).is_empty());
        assert!(
            allowed.iter().any(|a| a.starts_with("exhausted")),
            "{allowed:?}"
        );
    }

    #[test]
    fn an_earlier_object_counts_no_more_than_its_handlers_answered() {
        let seen: Seen = Seen::default();
        if let Ok(mut s) = seen.lock() {
            s.extend([
                ("a".to_string(), stats(1, 1, 0, 0)),
                ("a".to_string(), stats(3, 2, 1, 0)),
                ("b".to_string(), stats(1, 0, 1, 0)),
            ]);
        }
        let objects = last_of_each(&seen);
        assert_eq!(objects.len(), 2);
        assert_eq!((objects[0].0.as_str(), objects[0].1.delivered), ("a", 3));
        let m = Model {
            attempts: 3,
            acked: 2,
            nacked: 1,
            ..Model::default()
        };
        assert!(above(&objects[0].1, &m).is_empty());
        let found = above(&stats(4, 2, 2, 0), &m);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].starts_with("delivered: status 4"), "{found:?}");
    }

    #[test]
    fn what_ran_out_under_an_earlier_consumer_counts_and_a_decline_around_its_deletion_may_not() {
        // The consumer deleted at 5000 ms and made again at 5500 ms: message 1 ran out long
        // before, message 2's last decline was answered just before the deletion.
        let mut a = answer(0, 1000, 1, MAX_DELIVER, "nack");
        a.done_ms = Some(1001);
        let mut b = answer(0, 4500, 2, MAX_DELIVER, "silent");
        b.done_ms = Some(4501);
        let c = answer(0, 6000, 1, 1, "ack");
        let m = Model {
            attempts: 3,
            answers: vec![a, b, c],
            ..Model::default()
        };
        let e = Earlier::of(&m, &[(5000, 5500)], &[]);
        assert_eq!(e.exhausted, (1, 2));
        assert_eq!(e.gone, vec![(4000, 5500)]);
        assert_eq!(e.last.map(|l| l.attempts), Some(1));
        assert_eq!(Earlier::of(&m, &[], &[]).exhausted, (0, 0));
        // A last attempt's ack that failed may have left its message to run out.
        let mut m = m;
        m.answers[2].attempt = MAX_DELIVER;
        m.answers[2].at_ms = 3000;
        m.answers[2].failed = true;
        assert_eq!(Earlier::of(&m, &[(5000, 5500)], &[]).exhausted, (1, 3));
    }
}
