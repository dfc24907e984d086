//! The conditions a campaign watches (`Accounted`, `Exhausting`, `Stranding`, `Stalled`,
//! `Ready`) and the check that each one raised had a cause: every change is recorded with its
//! time; `Exhausting=True` needs a message the handlers never acknowledged (it ran out of
//! attempts); `Ready=False` and `Accounted=False` need the broker or the API server down (from
//! its kill until [`OUTAGE_GRACE`] after it is back: the operator finds the consumer
//! unreachable, a source unreadable, or catches up); `Ready=False` also a consumer gone (the
//! Subscription deleted until the new object's is made, or deleted on the broker until it is
//! made again), `Stranding=True` a consumer deleted on the broker (a decline sent to it, C8),
//! and `Accounted=False` a report source deleted on the broker, until the loss window after
//! it is back (C17, Q8). Nothing else of the campaign causes them, nor `Stalled=True` (handlers
//! return throughout, and a pause owes nothing: semantics C22), so each other one seen is a
//! discrepancy; at rest the Subscription is `Ready`, `Accounted`, and not stalled.
//!
//! It must not judge the counters: it records them for the campaign's checker.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::Api;
use settle::api::Subscription;

use crate::account::Seen;

/// The condition types a campaign judges.
const JUDGED: [&str; 5] = ["Accounted", "Exhausting", "Stranding", "Stalled", "Ready"];

/// One change of a judged condition: when (since the campaign started), its type, status and
/// reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub at: Duration,
    pub type_: String,
    pub status: String,
    pub reason: String,
}

/// Every change seen, in order.
pub type Changes = Arc<Mutex<Vec<Change>>>;

/// What the watcher saw: every status's counters (for the check that none stepped down), each
/// change of a judged condition, and when the counters changed (since the campaign started).
pub struct Watched {
    pub seen: Seen,
    pub changes: Changes,
    pub written: Arc<Mutex<Vec<Duration>>>,
    pub task: tokio::task::JoinHandle<()>,
}

impl Watched {
    /// When the counters last changed before `at` (the campaign's start if never).
    pub fn written_before(&self, at: Duration) -> Duration {
        self.written
            .lock()
            .ok()
            .and_then(|w| w.iter().rev().find(|t| **t < at).copied())
            .unwrap_or_default()
    }
}

/// Polls Subscription `orders` every 100 ms until aborted: one read gives both the counters
/// and each change of a judged condition.
pub fn watch(api: &Api<Subscription>, t0: Instant) -> Watched {
    let (seen, changes, written): (Seen, Changes, Arc<Mutex<Vec<Duration>>>) =
        (Arc::default(), Arc::default(), Arc::default());
    let (api, counters, out, times) = (api.clone(), seen.clone(), changes.clone(), written.clone());
    let task = tokio::spawn(async move {
        loop {
            if let Ok(s) = api.get("orders").await {
                let uid = s.metadata.uid.unwrap_or_default();
                let status = s.status.unwrap_or_default();
                if let (Some(stats), Ok(mut counters)) = (status.stats, counters.lock()) {
                    let now = (uid, stats.counters);
                    if counters.last() != Some(&now)
                        && let Ok(mut times) = times.lock()
                    {
                        times.push(t0.elapsed());
                    }
                    counters.push(now);
                }
                let conditions = status.conditions;
                if let Ok(mut out) = out.lock() {
                    for c in conditions
                        .iter()
                        .filter(|c| JUDGED.contains(&c.type_.as_str()))
                    {
                        let last = out.iter().rev().find(|x| x.type_ == c.type_);
                        if last.is_none_or(|l| (&l.status, &l.reason) != (&c.status, &c.reason)) {
                            out.push(Change {
                                at: t0.elapsed(),
                                type_: c.type_.clone(),
                                status: c.status.clone(),
                                reason: c.reason.clone(),
                            });
                        }
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    Watched {
        seen,
        changes,
        written,
        task,
    }
}

/// How long after the broker is back a condition it caused may still be raised: the
/// operator's next look at the consumer and the sources (its stats interval is 1 s, a client
/// reconnects within a few).
pub const OUTAGE_GRACE: Duration = Duration::from_secs(15);

/// What each condition says at rest.
const AT_REST: [(&str, &str); 4] = [
    ("Ready", "True"),
    ("Accounted", "True"),
    ("Stranding", "False"),
    ("Stalled", "False"),
];

/// Whether the last change seen of each condition is what it says at rest (one never
/// written counts as settled: [`uncaused`] judges it), `Stranding` True where status counts
/// a message `stranded`. After an outage the operator looks at a Backend again within its
/// retry delay (up to 30 s, then its Subscriptions at once), so a campaign waits for this, not
/// only for still counters, before it judges.
pub fn settled(changes: &[Change], stranded: bool) -> bool {
    AT_REST.iter().all(|(type_, want)| {
        changes
            .iter()
            .rev()
            .find(|c| c.type_ == *type_)
            .is_none_or(|c| c.status == at_rest(type_, want, stranded))
    })
}

/// What condition `type_` says at rest: `want`, but `Stranding` says True for as long as
/// status counts a message `stranded` (it is cumulative).
fn at_rest(type_: &str, want: &'static str, stranded: bool) -> &'static str {
    if type_ == "Stranding" && stranded {
        "True"
    } else {
        want
    }
}

/// Each condition seen without a cause, and each left wrong at rest; `exhausted` is how many
/// messages the handlers never acknowledged, `outages` when the broker was down, `made` when
/// the consumer was gone and made again (the Subscription deleted until the new object was
/// Ready, or the consumer deleted on the broker: not Ready until it is made), `stranding` when
/// a decline could be stranded (its consumer deleted on the broker, C8) and how many status
/// counts, and `sources_lost` when the account may say a report source was lost or is missing
/// (C17, Q8: from its deletion on the broker until the loss window after it was back).
pub fn uncaused(
    changes: &[Change],
    exhausted: u64,
    outages: &[(Duration, Duration)],
    made: &[(Duration, Duration)],
    stranding: (&[(Duration, Duration)], u64),
    sources_lost: &[(Duration, Duration)],
) -> Vec<String> {
    let mut out = Vec::new();
    let within = |windows: &[(Duration, Duration)], at: Duration, grace: Duration| {
        windows
            .iter()
            .any(|(from, to)| *from <= at && at <= *to + grace)
    };
    for c in changes {
        let down = within(outages, c.at, OUTAGE_GRACE);
        let why = match (c.type_.as_str(), c.status.as_str()) {
            ("Accounted" | "Ready", "False") if down => continue,
            ("Ready", "False") if within(made, c.at, Duration::ZERO) => continue,
            ("Accounted", "False") if within(sources_lost, c.at, Duration::ZERO) => continue,
            ("Stranding", "True") if within(stranding.0, c.at, Duration::ZERO) => continue,
            ("Accounted", "False") => {
                "no fault of the campaign but a report source deleted loses a source, a save or a report"
            }
            ("Stranding", "True") => "nothing was declined that the broker could not take back",
            ("Stalled", "True") => "handlers returned throughout, and a pause owes nothing (C22)",
            ("Exhausting", "True") if exhausted == 0 => "every message was acknowledged",
            ("Ready", "False") => {
                "no fault of the campaign removes the Backend or its connection, nor the consumer but with its Subscription"
            }
            _ => continue,
        };
        out.push(format!(
            "{}={} ({}) at {:.1} s without a cause: {why}",
            c.type_,
            c.status,
            c.reason,
            c.at.as_secs_f64()
        ));
    }
    for (type_, want) in AT_REST {
        let want = at_rest(type_, want, stranding.1 > 0);
        let last = changes.iter().rev().find(|c| c.type_ == type_);
        match last {
            Some(c) if c.status != want => out.push(format!(
                "{type_}={} ({}) at rest, not {want}",
                c.status, c.reason
            )),
            // Never written: Stalled and Stranding need not be (nothing owed, nothing stranded).
            None if type_ == "Ready" || type_ == "Accounted" => {
                out.push(format!("{type_} never written"))
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(at: u64, type_: &str, status: &str, reason: &str) -> Change {
        Change {
            at: Duration::from_secs(at),
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
        }
    }

    #[test]
    fn a_condition_without_a_cause_and_one_wrong_at_rest_are_named() {
        let calm = vec![
            change(1, "Ready", "True", "ConsumerReady"),
            change(1, "Accounted", "True", "Whole"),
            change(9, "Exhausting", "True", "MessagesExhausted"),
        ];
        assert!(
            uncaused(&calm, 3, &[], &[], (&[], 0), &[]).is_empty(),
            "{:?}",
            uncaused(&calm, 3, &[], &[], (&[], 0), &[])
        );
        let found = uncaused(&calm, 0, &[], &[], (&[], 0), &[]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with("Exhausting=True"), "{found:?}");

        let mut troubled = calm.clone();
        troubled.push(change(12, "Accounted", "False", "LedgerNotSaved"));
        let found = uncaused(&troubled, 3, &[], &[], (&[], 0), &[]);
        assert_eq!(found.len(), 2, "during, and still at rest: {found:?}");
        assert!(found[0].contains("at 12.0 s without a cause"), "{found:?}");
        assert!(
            found[1].starts_with("Accounted=False (LedgerNotSaved) at rest"),
            "{found:?}"
        );

        troubled.push(change(14, "Ready", "False", "BackendNotFound"));
        let found = uncaused(&troubled, 3, &[], &[], (&[], 0), &[]);
        assert!(
            found
                .iter()
                .any(|f| f.starts_with("Ready=False (BackendNotFound) at 14.0 s")),
            "{found:?}"
        );
        troubled.pop();
        troubled.push(change(15, "Accounted", "True", "Whole"));
        assert_eq!(
            uncaused(&troubled, 3, &[], &[], (&[], 0), &[]).len(),
            1,
            "cleared at rest, still seen"
        );
        assert_eq!(
            uncaused(&[], 0, &[], &[], (&[], 0), &[]).len(),
            2,
            "Ready and Accounted never written"
        );
    }

    #[test]
    fn the_broker_down_causes_not_ready_and_not_accounted_until_a_while_after_it_is_back() {
        let outage = [(Duration::from_secs(10), Duration::from_secs(14))];
        let changes = vec![
            change(1, "Ready", "True", "ConsumerReady"),
            change(1, "Accounted", "True", "Kept"),
            change(11, "Ready", "False", "Unreachable"),
            change(20, "Accounted", "False", "SourceUnreadable"),
            change(22, "Ready", "True", "ConsumerReady"),
            change(25, "Accounted", "True", "Kept"),
            change(40, "Ready", "False", "Unreachable"),
            change(41, "Ready", "True", "ConsumerReady"),
        ];
        let found = uncaused(&changes, 0, &outage, &[], (&[], 0), &[]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("at 40.0 s without a cause"), "{found:?}");
        assert_eq!(uncaused(&changes, 0, &[], &[], (&[], 0), &[]).len(), 3);
    }

    #[test]
    fn a_subscription_made_again_is_not_ready_until_its_consumer_is_made() {
        let changes = vec![
            change(1, "Ready", "True", "ConsumerReady"),
            change(1, "Accounted", "True", "Kept"),
            change(10, "Ready", "False", "Pending"),
            change(13, "Ready", "True", "ConsumerReady"),
        ];
        let made = [(Duration::from_secs(9), Duration::from_secs(13))];
        assert!(uncaused(&changes, 0, &[], &made, (&[], 0), &[]).is_empty());
        let found = uncaused(&changes, 0, &[], &[], (&[], 0), &[]);
        assert!(
            found[0].starts_with("Ready=False (Pending) at 10.0 s"),
            "{found:?}"
        );
        let late = [(Duration::from_secs(2), Duration::from_secs(5))];
        assert_eq!(
            uncaused(&changes, 0, &[], &late, (&[], 0), &[]).len(),
            1,
            "no grace after"
        );
    }

    #[test]
    fn a_report_source_deleted_causes_not_accounted_until_a_while_after_it_is_back() {
        let changes = vec![
            change(1, "Ready", "True", "ConsumerReady"),
            change(1, "Accounted", "True", "Kept"),
            change(12, "Accounted", "False", "SourceLost"),
            change(42, "Accounted", "True", "Kept"),
            change(50, "Accounted", "False", "ReportQueueMissing"),
            change(51, "Accounted", "True", "Kept"),
        ];
        let lost = [(Duration::from_secs(10), Duration::from_secs(20))];
        let found = uncaused(&changes, 0, &[], &[], (&[], 0), &lost);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("at 50.0 s without a cause"), "{found:?}");
        let found = uncaused(&changes, 0, &lost, &[], (&[], 0), &[]);
        assert_eq!(found.len(), 1, "an outage causes it too: {found:?}");
        assert_eq!(uncaused(&changes, 0, &[], &[], (&[], 0), &[]).len(), 2);
    }

    #[test]
    fn at_rest_waits_for_ready_again_after_an_outage() {
        let mut changes = vec![
            change(1, "Ready", "True", "ConsumerReady"),
            change(1, "Accounted", "True", "Kept"),
        ];
        assert!(settled(&changes, false));
        changes.push(change(31, "Ready", "False", "Unreachable"));
        assert!(!settled(&changes, false), "not Ready since the outage");
        changes.push(change(62, "Ready", "True", "ConsumerReady"));
        assert!(settled(&changes, false));
        changes.push(change(70, "Stalled", "True", "NoProgress"));
        assert!(!settled(&changes, false));
        assert!(
            settled(&[], false),
            "never written is judged by uncaused, not waited for"
        );
    }
}
