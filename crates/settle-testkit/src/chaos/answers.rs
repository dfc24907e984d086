//! What the handlers did, read from their own files (the example's `model` handler writes one
//! line per answer, and one when its settlement returned), and the rules an answer itself must
//! keep whatever else happened: a second settlement is refused (S2), a delay under the ceiling
//! is taken and one without a ceiling refused (B3), and a delayed message does not come back
//! before its delay (B5).
//!
//! It must not read Settle's counters (that is [`super::model`]'s check against status), nor
//! inject faults.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::PathBuf;

use super::model::{Outages, in_any};

/// One answer a handler gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// Which file (which application instance) said it.
    pub file: usize,
    /// When the handler decided (written before it settles, so a kill cannot hide it).
    pub at_ms: u64,
    /// When its settlement returned (`done`, or `failed`): the runtime counts the attempt
    /// Delivered only then. None: still settling when the instance died or the run ended.
    pub done_ms: Option<u64>,
    pub id: u64,
    pub attempt: u32,
    /// How the attempt was settled: `ack`, `nack` or `silent`.
    pub answer: String,
    /// The handler's own word for it (`ack-twice`, `nack-after-800ms`, `silent-error`, …).
    pub how: String,
    /// Its settlement returned an error.
    pub failed: bool,
    /// `nack_after` was refused for want of a ceiling, and the handler nacked instead.
    pub no_delay: bool,
}

impl Answer {
    /// The delay a `nack-after` answer asked for, in ms.
    pub fn delay_ms(&self) -> Option<u64> {
        self.how
            .strip_prefix("nack-after-")
            .and_then(|d| d.strip_suffix("ms"))
            .and_then(|d| d.parse().ok())
    }
}

/// What the handlers did, from their files.
#[derive(Debug, Default)]
pub struct Model {
    pub attempts: u64,
    pub acked: u64,
    pub nacked: u64,
    pub silent: u64,
    /// When each settlement the handler sent was refused by the runtime (`failed` lines).
    pub failed_at: Vec<u64>,
    /// Ids whose every ack failed: the broker may or may not have taken one.
    pub unsure_acks: BTreeSet<u64>,
    /// The ids acknowledged, and those acknowledged more than once.
    pub acked_ids: BTreeSet<u64>,
    pub acked_again: BTreeSet<u64>,
    /// Attempts `(id, attempt, when)` whose second settlement was not refused (S2).
    pub settled_twice: Vec<(u64, u32, u64)>,
    /// Every answer, in the files' order.
    pub answers: Vec<Answer>,
}

/// The settlement a handler's word for its answer comes to.
fn settlement(how: &str) -> Option<&'static str> {
    match how {
        "ack" | "ack-error" | "ack-twice" | "slow-ack" => Some("ack"),
        "nack" => Some("nack"),
        h if h.starts_with("nack-after-") => Some("nack"),
        "silent" | "silent-error" => Some("silent"),
        _ => None,
    }
}

impl Model {
    /// Reads the model handler's files: `<id> <attempt> <answer> <unix ms>` lines, each
    /// followed by `<id> <attempt> done <unix ms>` once its settlement returned (`failed`
    /// instead when it returned an error), and by `no-delay` or `settled-twice` where the
    /// handler saw one.
    pub fn read(files: &[PathBuf]) -> Model {
        let mut answers: Vec<Answer> = Vec::new();
        let mut twice = Vec::new();
        for (file, path) in files.iter().enumerate() {
            // An (id, attempt) may be open twice: a consumer made again numbers its attempts
            // afresh while the earlier one's settlement is still under way. Each settlement
            // that returns is the oldest open one's (a slow ack's, 3 s after its answer).
            let mut open: HashMap<(u64, u32), VecDeque<usize>> = HashMap::new();
            let Ok(text) = std::fs::read_to_string(path) else {
                continue;
            };
            for line in text.lines() {
                let words: Vec<&str> = line.split_whitespace().collect();
                let (Some(id), Some(attempt), Some(word)) = (
                    words.first().and_then(|w| w.parse::<u64>().ok()),
                    words.get(1).and_then(|w| w.parse::<u32>().ok()),
                    words.get(2),
                ) else {
                    continue;
                };
                let at_ms = words.get(3).and_then(|w| w.parse().ok()).unwrap_or(0);
                match *word {
                    "done" | "failed" => {
                        if let Some(i) = open.get_mut(&(id, attempt)).and_then(VecDeque::pop_front)
                        {
                            answers[i].done_ms = Some(at_ms);
                            answers[i].failed = *word == "failed";
                        }
                        continue;
                    }
                    "no-delay" => {
                        if let Some(i) = open.get(&(id, attempt)).and_then(|o| o.back()) {
                            answers[*i].no_delay = true;
                        }
                        continue;
                    }
                    "settled-twice" => {
                        twice.push((id, attempt, at_ms));
                        continue;
                    }
                    _ => {}
                }
                let Some(kind) = settlement(word) else {
                    continue;
                };
                open.entry((id, attempt))
                    .or_default()
                    .push_back(answers.len());
                answers.push(Answer {
                    file,
                    at_ms,
                    done_ms: None,
                    id,
                    attempt,
                    answer: kind.to_string(),
                    how: (*word).to_string(),
                    failed: false,
                    no_delay: false,
                });
            }
        }
        Model::of(answers, twice)
    }

    /// What the answers given from `from_ms` until before `to_ms` (unix ms) come to: one
    /// object's, when the Subscription was deleted and applied again (C15: a delivery belongs
    /// to the count it was offered in, and a handler answers as it is offered).
    pub fn between(&self, from_ms: u64, to_ms: u64) -> Model {
        let within = |at: u64| from_ms <= at && at < to_ms;
        Model::of(
            self.answers
                .iter()
                .filter(|a| within(a.at_ms))
                .cloned()
                .collect(),
            self.settled_twice
                .iter()
                .filter(|(_, _, at)| within(*at))
                .copied()
                .collect(),
        )
    }

    /// The tallies of `answers`; `twice`, the attempts settled a second time unrefused.
    fn of(answers: Vec<Answer>, twice: Vec<(u64, u32, u64)>) -> Model {
        let mut m = Model {
            settled_twice: twice,
            ..Model::default()
        };
        for a in &answers {
            match a.answer.as_str() {
                "ack" => {
                    m.acked += 1;
                    if !m.acked_ids.insert(a.id) {
                        m.acked_again.insert(a.id);
                    }
                }
                "nack" => m.nacked += 1,
                _ => m.silent += 1,
            }
            m.attempts += 1;
            if a.failed {
                m.failed_at.extend(a.done_ms);
            }
        }
        m.failed_at.sort_unstable();
        // An id is unsure when every ack it was answered failed.
        for id in answers
            .iter()
            .filter(|a| a.answer == "ack" && a.failed)
            .map(|a| a.id)
            .collect::<BTreeSet<_>>()
        {
            if !answers
                .iter()
                .any(|a| a.id == id && a.answer == "ack" && !a.failed)
            {
                m.unsure_acks.insert(id);
            }
        }
        m.answers = answers;
        m
    }
}

/// Every answer that broke a rule of its own, each with the rule: S2 (a second settlement
/// refused), B3 (on a broker that holds a message back, `delays`, a delay under the
/// ceiling is taken; on one that cannot, refused) and B5 (the message is not offered again
/// before its delay passed, but where a fault of the broker may have lost the decline:
/// J3, within `outages`, `grace` ms after each).
pub fn kept(model: &Model, delays: bool, outages: &Outages, grace: u64) -> Vec<String> {
    let mut out = Vec::new();
    for (id, attempt, _) in &model.settled_twice {
        out.push(format!(
            "S2: message {id}'s attempt {attempt} was settled a second time and it was not refused"
        ));
    }
    let next: HashMap<(u64, u32), u64> = model
        .answers
        .iter()
        .map(|a| ((a.id, a.attempt), a.at_ms))
        .collect();
    for a in &model.answers {
        let Some(delay) = a.delay_ms() else {
            continue;
        };
        // Still settling when its instance died or the run ended: the decline may not have
        // been sent, and the message comes back after ackWait instead.
        let Some(done) = a.done_ms.filter(|_| !a.failed) else {
            continue;
        };
        if delays && a.no_delay {
            out.push(format!(
                "B3: message {}'s attempt {}: nack_after({delay} ms) was refused for want of a ceiling, on a broker with one",
                a.id, a.attempt
            ));
        } else if !delays && !a.no_delay {
            out.push(format!(
                "B3: message {}'s attempt {}: nack_after({delay} ms) was taken where there is no ceiling",
                a.id, a.attempt
            ));
        }
        let lost = |at: u64| in_any(&outages.broker, at, grace) || in_any(&outages.acks, at, 0);
        if let Some(again) = next.get(&(a.id, a.attempt + 1)).filter(|_| delays)
            && *again < a.at_ms + delay
            && !lost(a.at_ms)
            && !lost(done)
        {
            out.push(format!(
                "B5: message {} came back {} ms after its attempt {} was declined with a delay of {delay} ms",
                a.id,
                again.saturating_sub(a.at_ms),
                a.attempt
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_files_are_read_with_their_times_and_failed_settlements_apart() {
        let dir = tempfile::tempdir().expect("a directory");
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(
            &a,
            "1 1 ack-error 1000\n2 1 nack 1001\n1 1 done 1005\n2 1 failed 1002\n",
        )
        .expect("a");
        std::fs::write(&b, "2 2 silent-error\nnot a line\n3 1 mystery 5\n").expect("b");
        let m = Model::read(&[a, b]);
        assert_eq!(
            (m.attempts, m.acked, m.nacked, m.silent, m.failed_at.len()),
            (3, 1, 1, 1, 1)
        );
        assert_eq!(
            (m.answers[0].answer.as_str(), m.answers[0].how.as_str()),
            ("ack", "ack-error")
        );
        assert_eq!(m.answers[0].done_ms, Some(1005));
        assert_eq!(m.answers[1].done_ms, Some(1002));
        assert!(m.answers[1].failed);
        assert_eq!(m.answers[2].done_ms, None);
        assert_eq!((m.answers[2].at_ms, m.answers[2].id), (0, 2));
        // An id is unsure only while every ack of it failed.
        let c = dir.path().join("c");
        std::fs::write(
            &c,
            "3 1 ack 10\n3 1 failed 11\n4 1 ack-twice 12\n4 1 failed 13\n4 2 slow-ack 14\n4 2 done 15\n",
        )
        .expect("c");
        let m = Model::read(&[c]);
        assert_eq!(m.unsure_acks, [3].into());
        assert_eq!(m.failed_at, vec![11, 13]);
    }

    #[test]
    fn a_settlement_that_returns_is_the_oldest_open_answers_of_its_attempt() {
        // A slow ack of an earlier consumer's delivery, refused after the consumer made again
        // offered the message afresh at the same attempt, whose own slow ack then returns.
        let m = read("17 1 slow-ack 100\n17 1 slow-ack 3000\n17 1 failed 3100\n17 1 done 6000\n");
        assert_eq!(m.answers[0].done_ms, Some(3100));
        assert!(m.answers[0].failed);
        assert_eq!(m.answers[1].done_ms, Some(6000));
        assert!(!m.answers[1].failed);
    }

    #[test]
    fn the_answers_of_one_object_are_tallied_apart() {
        let m = read(
            "1 1 ack 10\n1 1 done 11\n2 1 ack-twice 12\n2 1 failed 13\n2 1 settled-twice 14\n1 1 nack 30\n1 1 done 31\n1 2 ack 32\n",
        );
        let (before, after) = (m.between(0, 20), m.between(20, u64::MAX));
        assert_eq!((before.attempts, before.acked, after.attempts), (2, 2, 2));
        assert_eq!(before.unsure_acks, [2].into());
        assert_eq!(before.failed_at, vec![13]);
        assert_eq!(before.settled_twice, vec![(2, 1, 14)]);
        assert!(after.settled_twice.is_empty() && after.failed_at.is_empty());
        assert_eq!((after.nacked, after.acked_ids.len()), (1, 1));
        assert!(
            after.acked_again.is_empty(),
            "acked again only across objects"
        );
        assert_eq!(m.acked_again, [1].into());
    }

    fn read(text: &str) -> Model {
        let dir = tempfile::tempdir().expect("a directory");
        let f = dir.path().join("f");
        std::fs::write(&f, text).expect("f");
        Model::read(&[f])
    }

    #[test]
    fn a_second_settlement_not_refused_and_a_refused_delay_where_there_is_a_ceiling_are_found() {
        let m = read(
            "1 1 ack-twice 10\n1 1 done 11\n1 1 settled-twice 12\n2 1 nack-after-500ms 20\n2 1 no-delay 21\n2 1 done 22\n",
        );
        assert_eq!((m.nacked, m.acked), (1, 1));
        let found = kept(&m, true, &Outages::default(), 0);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].starts_with("S2: message 1"), "{found:?}");
        assert!(found[1].starts_with("B3: message 2"), "{found:?}");
        // Without a ceiling the refusal is what B3 asks, and taking the delay is not.
        assert_eq!(kept(&m, false, &Outages::default(), 0).len(), 1);
        let taken = read("2 1 nack-after-500ms 20\n2 1 done 22\n");
        let found = kept(&taken, false, &Outages::default(), 0);
        assert!(
            found[0].contains("taken where there is no ceiling"),
            "{found:?}"
        );
    }

    #[test]
    fn a_delayed_message_back_too_soon_is_found_unless_a_fault_of_the_broker_may_have_lost_the_decline()
     {
        let soon = "5 1 nack-after-1000ms 1000\n5 1 done 1003\n5 2 ack 1600\n5 2 done 1601\n";
        let m = read(soon);
        assert_eq!(m.answers[0].delay_ms(), Some(1000));
        let found = kept(&m, true, &Outages::default(), 0);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("B5: message 5 came back 600 ms"),
            "{found:?}"
        );
        let down = Outages {
            broker: vec![(900, 950)],
            acks: Vec::new(),
        };
        assert!(kept(&m, true, &down, 100).is_empty());
        let late = read("5 1 nack-after-1000ms 1000\n5 1 done 1003\n5 2 ack 2100\n");
        assert!(kept(&late, true, &Outages::default(), 0).is_empty());
        // A decline that failed, or never returned, may not have reached the broker.
        for text in [
            "5 1 nack-after-1000ms 1000\n5 1 failed 1003\n5 2 ack 1600\n",
            "5 1 nack-after-1000ms 1000\n5 2 ack 1600\n",
        ] {
            assert!(
                kept(&read(text), true, &Outages::default(), 0).is_empty(),
                "{text}"
            );
        }
    }
}
