//! What a keeper hands the writer for one Subscription, and when: the account's stats and
//! conditions (`Exhausting` from the loss log, `Stranding`, `Accounted`, and `Stalled` from the
//! stall watch of [`super::stall`]), the `settle_subscription_*`
//! metrics, and a status patch only when what the Subscription shows differs, at most once per
//! stats interval; a change that matters (`status::matters`: a loss, a condition flipping) is
//! marked urgent, and may go once more within the interval, at once. A Subscription whose
//! inputs did not change is looked at once an interval, not every round. A patch the same as
//! the last one sent is not sent again while that one may still be on its way (waiting for
//! the budget, in flight, or written and not yet back through the watch: [`on_its_way`]),
//! unless the writer says it failed. Every keeper (NATS, RabbitMQ, SQS) decides through
//! [`show`], so all show alike.
//!
//! It must not count (the ledger does) nor write status itself (the writer does).

use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::Config;
use super::metrics::Metrics;
use super::stall;
use super::status::{self, LossLog, Trouble};
use super::writer::{Write, Writer};
use settle::api::condition::{Status, Want};
use settle::api::{ConsumerStats, Subscription, SubscriptionStats};
use settle::policy::{Pause, ResolvedPolicy};

/// What every Subscription of one keeper's round shares.
pub struct Round<'a> {
    pub writer: &'a Writer,
    pub metrics: &'a Metrics,
    pub config: &'a Config,
    /// Whether the Backend's broker can spend a last attempt no handler saw (see `status::wants`).
    pub unseen_attempts: status::Unseen,
    /// Now, in Unix ms and as the time written.
    pub now_ms: u64,
    pub stamp: &'a Time,
}

/// One Subscription's showing: its loss log (persisted with its ledger), what keeps its account
/// from being whole, and its last write.
#[derive(Default)]
pub struct Showing {
    pub loss: LossLog,
    pub trouble: Trouble,
    pub last_write: Option<Instant>,
    /// The last urgent write sent before the interval was up (at most one per interval).
    pub last_early: Option<Instant>,
    /// Since when nothing was delivered while messages were owed (in memory: begun anew by
    /// each operator, carrying a stall status shows).
    pub stall: Option<stall::Watch>,
    /// What the last full look was given (a [`fingerprint`] of the stats, trouble and the
    /// object's resourceVersion), and when: the same again within the stats interval is not
    /// looked at anew. A fingerprint, not a copy: it is kept for every Subscription (a copy
    /// had been a quarter of each book, issue: scale).
    pub seen: Option<(u64, Instant)>,
    /// What the last patch sent showed (its stats and conditions without their times, hashed
    /// as [`fingerprint`] hashes a look), and when it was sent.
    pub sent: Option<(u64, Instant)>,
}

/// How many stats intervals a patch the same as the last one sent waits before it is sent
/// again, the writer having said nothing of a failure. Status that still does not show it
/// then was changed by someone else, or the write was lost with the writer's notes of
/// failures (full, or another replica's); it is not the writer's queue: a patch the budget
/// holds back is replaced by the newest, at no cost.
const RESEND_AFTER: u32 = 3;

/// Whether a patch showing `content` is on its way: the last one sent showed the same, within
/// [`RESEND_AFTER`] intervals, and its write did not fail. A status write takes a while to come
/// back through the watch (seconds at 10,000 Subscriptions); a look in between found status
/// without it and sent the same patch again: 1% of a mass apply's first writes were made
/// twice (issue: scale).
fn on_its_way(
    sent: Option<(u64, Instant)>,
    content: u64,
    interval: Duration,
    failed: impl FnOnce() -> bool,
) -> bool {
    sent.is_some_and(|(c, at)| c == content && at.elapsed() < interval * RESEND_AFTER) && !failed()
}

/// What a patch shows, without its times: `stats` and each wanted condition's type, status,
/// reason and message.
fn shown_fingerprint(stats: &SubscriptionStats, wants: &[Want]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    stats.hash(&mut h);
    for w in wants {
        (w.type_, w.status.as_str(), w.reason, &w.message).hash(&mut h);
    }
    h.finish()
}

/// The inputs of [`show`] that are not the clock, as one number. Two different inputs with the
/// same fingerprint (one chance in 2^64) would only wait until the stats interval is up to be
/// looked at: it decides when to look, never what is counted or shown.
pub fn fingerprint(stats: &SubscriptionStats, trouble: &Trouble, version: Option<&str>) -> u64 {
    settle::backend::fingerprint(&(stats, trouble, version))
}

/// Shows `stats` for `sub` (namespace, name): notes the exhausted total in the loss log, sets the
/// metrics, and sends a patch when status differs and the interval since the last write has
/// passed, or at once when the change matters and no early write was sent within the
/// interval. Returns whether the loss log changed (then it is persisted with the ledger).
pub fn show(
    round: &Round<'_>,
    key: &(String, String),
    sub: &Subscription,
    stats: SubscriptionStats,
    showing: &mut Showing,
) -> bool {
    let config = round.config;
    // Nothing changed since the last look, which left nothing waiting, within the interval:
    // only the clock moved, and what it moves (the loss window's and the stall window's end)
    // waits at most one interval. A tick no longer builds every Subscription's conditions
    // anew: at rest that had been the keepers' CPU, growing with the Subscriptions.
    // Compared by fingerprint: at rest this is every Subscription every round, so nothing is
    // copied, and a look kept is one number.
    let seen = fingerprint(
        &stats,
        &showing.trouble,
        sub.metadata.resource_version.as_deref(),
    );
    if showing
        .seen
        .is_some_and(|(f, at)| f == seen && at.elapsed() < config.stats_interval)
    {
        return false;
    }
    let (loss_changed, wants) = wanted(round, key, sub, &stats, showing);
    let current = sub.status.as_ref();
    let existing = current.map(|s| s.conditions.as_slice()).unwrap_or_default();
    let shown = current.and_then(|s| s.stats.as_ref());
    let differs = shown != Some(&stats) || status::conditions_differ(existing, &wants);
    let interval = config.stats_interval;
    let urgent = differs && status::matters(shown, existing, &stats, &wants);
    let due = showing.last_write.is_none_or(|t| t.elapsed() >= interval);
    let early = !due && urgent && showing.last_early.is_none_or(|t| t.elapsed() >= interval);
    let content = shown_fingerprint(&stats, &wants);
    let on_way = differs
        && (due || early)
        && on_its_way(showing.sent, content, interval, || round.writer.failed(key));
    // A look that leaves a write waiting for its turn is looked at again next round.
    showing.seen = (!differs || due || early).then(|| (seen, Instant::now()));
    if differs && (due || early) && !on_way {
        let now = Instant::now();
        showing.sent = Some((content, now));
        showing.last_write = Some(now);
        if early {
            showing.last_early = Some(now);
        }
        round.writer.send(Write {
            urgent,
            namespace: key.0.clone(),
            name: key.1.clone(),
            uid: sub.metadata.uid.clone(),
            body: status::patch(
                &stats,
                &wants,
                existing,
                sub.metadata.generation,
                round.stamp,
            ),
        });
    }
    loss_changed
}

/// The conditions wanted for `sub` now (the account's three and `Stalled`), the exhausted
/// total noted in the loss log first and the metrics set. Returns whether the loss log changed,
/// and the conditions.
fn wanted(
    round: &Round<'_>,
    key: &(String, String),
    sub: &Subscription,
    stats: &SubscriptionStats,
    showing: &mut Showing,
) -> (bool, Vec<Want>) {
    let config = round.config;
    showing
        .trouble
        .forget_dropped_before(round.now_ms, config.loss_window);
    let before = showing.loss.clone();
    showing
        .loss
        .observe(round.now_ms, stats.counters.exhausted, config.loss_window);
    let loss_changed = showing.loss != before;
    let lost = showing.loss.lost_within(round.now_ms, config.loss_window);
    let current = sub.status.as_ref();
    let existing = current.map(|s| s.conditions.as_slice()).unwrap_or_default();
    let shown = current.and_then(|s| s.stats.as_ref());

    let mut wants = status::wants(
        stats,
        lost,
        config.loss_window,
        round.unseen_attempts,
        &showing.trouble,
    )
    .to_vec();
    let stall = stall_condition(round, sub, stats, shown, existing, showing);
    round
        .metrics
        .show(&key.0, &key.1, sub.metadata.uid.as_deref(), stats, lost > 0);
    round
        .metrics
        .stalled(&key.0, &key.1, stall.status == Status::True);
    wants.push(stall);
    (loss_changed, wants)
}

/// The `Stalled` condition of `sub` now (semantics C22): its stall watch (begun on the first
/// call, from what status shows) notes Delivered and what is owed, and judges against the
/// Subscription's window.
fn stall_condition(
    round: &Round<'_>,
    sub: &Subscription,
    stats: &SubscriptionStats,
    shown: Option<&SubscriptionStats>,
    existing: &[Condition],
    showing: &mut Showing,
) -> Want {
    let policy = ResolvedPolicy::resolve(&sub.spec.policy);
    let window = stall::window(
        round.config.stall_window,
        policy.ack_wait,
        policy.nack_ceiling(),
    );
    // A paused Subscription (spec.paused) delivers nothing by choice: no stall while paused,
    // and the watch begins again on resume (a whole window before a stall).
    let now_ts = i64::try_from(round.now_ms)
        .ok()
        .and_then(|ms| k8s_openapi::jiff::Timestamp::from_millisecond(ms).ok())
        .unwrap_or_else(k8s_openapi::jiff::Timestamp::now);
    let pause = Pause::of(&sub.spec, now_ts);
    if pause.is_paused() {
        showing.stall = None;
        return stall::paused(pause, window);
    }
    let now = tokio::time::Instant::now();
    let delivered = stats.counters.delivered;
    let watch = showing.stall.get_or_insert_with(|| {
        stall::Watch::start(
            now,
            round.now_ms,
            delivered,
            shown.map(|s| s.counters.delivered),
            existing,
            window,
        )
    });
    let owed = stats.pending.saturating_add(stats.ack_pending);
    watch.observe(now, round.now_ms, delivered, owed);
    stall::want(
        watch.verdict(now, stats.pending, stats.ack_pending, window),
        window,
    )
}

/// Shows one report-fed Subscription (RabbitMQ, SQS): its counters (`totals`) with the broker's
/// gauges once its runtime has reported, else the gauges alone, so no counter is invented.
/// Returns whether the loss log changed (then it is persisted with the ledger).
pub fn show_counted_or_gauges(
    round: &Round<'_>,
    key: &(String, String),
    sub: &Subscription,
    totals: Option<ConsumerStats>,
    gauges: Option<(u64, u64)>,
    showing: &mut Showing,
    gauges_written: &mut Option<Instant>,
) -> bool {
    match (totals, gauges) {
        (Some(counters), gauges) => {
            let (pending, ack_pending) = gauges.unwrap_or_default();
            let stats = SubscriptionStats {
                counters,
                pending,
                ack_pending,
            };
            show(round, key, sub, stats, showing)
        }
        (None, Some(gauges)) => {
            show_gauges(
                round.writer,
                round.config.stats_interval,
                key,
                sub,
                gauges,
                (gauges_written, &mut showing.sent),
                round.stamp,
            );
            false
        }
        (None, None) => false,
    }
}

/// How many Subscriptions' gauges one round may read: each one's once per interval, spread over
/// the interval's rounds (`tick` apart), so a thousand queues are not asked in the same second.
pub fn gauge_budget(subscriptions: usize, interval: Duration, tick: Duration) -> usize {
    let rounds = usize::try_from(interval.as_millis() / tick.as_millis().max(1)).unwrap_or(1);
    subscriptions / rounds.max(1) + 1
}

/// Shows only the broker's gauges for `sub` (a Subscription whose runtime has not reported):
/// sends a gauges-only patch when status shows other gauges, at most once per stats interval,
/// and not while the same patch is [on its way](on_its_way).
pub fn show_gauges(
    writer: &Writer,
    interval: Duration,
    key: &(String, String),
    sub: &Subscription,
    (pending, ack_pending): (u64, u64),
    (last_write, sent): (&mut Option<Instant>, &mut Option<(u64, Instant)>),
    stamp: &Time,
) {
    let shown = sub.status.as_ref().and_then(|s| s.stats.as_ref());
    let due = last_write.is_none_or(|t| t.elapsed() >= interval);
    // Counters status already shows are sent again: a server-side apply without them
    // would remove them.
    let counters = shown
        .filter(|s| s.counters != Default::default())
        .map(|s| &s.counters);
    let content = settle::backend::fingerprint(&(pending, ack_pending, counters));
    if shown.map(|s| (s.pending, s.ack_pending)) != Some((pending, ack_pending))
        && due
        && !on_its_way(*sent, content, interval, || writer.failed(key))
    {
        let now = Instant::now();
        *last_write = Some(now);
        *sent = Some((content, now));
        writer.send(Write {
            urgent: false,
            namespace: key.0.clone(),
            name: key.1.clone(),
            uid: sub.metadata.uid.clone(),
            body: status::gauges_patch(pending, ack_pending, counters, stamp),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The account's settings, with an interval longer than the test.
    fn config() -> Config {
        Config {
            stats_interval: Duration::from_secs(3600),
            status_writes_per_second: 20,
            loss_window: Duration::from_secs(900),
            stall_window: Duration::from_secs(300),
            fold_after: Duration::from_secs(600),
            unverified_grace: Duration::from_secs(15),
            capture_max_bytes: 1 << 20,
            replicas: 1,
            limits: crate::account::Limits {
                max_report_bytes: 4096,
                max_instances: 16,
                early: std::sync::Arc::new(crate::account::early::EarlyBudget::new(1 << 20, 10)),
                max_sequence_jump: 1000,
                max_clock_skew_ms: 60_000,
                report_bucket: crate::account::BucketLimits::default(),
                report_prefetch: 16,
                dead_letter_prefetch: 16,
                dead_letter_copy_max_length: 1000,
            },
        }
    }

    /// The account's metrics, and a writer to an API server that is never there: every write
    /// fails.
    fn nowhere() -> (Metrics, Writer) {
        let registry = prometheus::Registry::new();
        let metrics = Metrics::new(&registry, &Default::default()).expect("metrics");
        let client = kube::Client::try_from(kube::Config::new(
            "http://127.0.0.1:1".parse().expect("a URL"),
        ))
        .expect("a client");
        // The cache holds shop/orders, so its patches go out (and fail).
        let (subs, mut cache) = kube::runtime::reflector::store();
        cache.apply_watcher_event(&kube::runtime::watcher::Event::Apply(orders()));
        let writer = Writer::start(client, metrics.clone(), 20, subs);
        (metrics, writer)
    }

    /// Subscription shop/orders at resourceVersion 1, with no status.
    fn orders() -> Subscription {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "messaging.settle.dev/v1alpha1",
            "kind": "Subscription",
            "metadata": {"name": "orders", "namespace": "shop", "resourceVersion": "1"},
            "spec": {"backendRef": {"name": "nats"}, "pattern": "orders.>"}
        }))
        .expect("a Subscription")
    }

    #[tokio::test]
    async fn an_unchanged_subscription_is_not_looked_at_again_within_the_interval_a_changed_one_is()
    {
        let (metrics, writer) = nowhere();
        let config = config();
        let stamp = Time(k8s_openapi::jiff::Timestamp::now());
        let round = Round {
            writer: &writer,
            metrics: &metrics,
            config: &config,
            unseen_attempts: status::Unseen::Never,
            now_ms: 1,
            stamp: &stamp,
        };
        let mut sub = orders();
        let key = ("shop".to_string(), "orders".to_string());
        let stats = SubscriptionStats::default();
        let mut showing = Showing::default();
        let when = |s: &Showing| s.seen.as_ref().map(|(_, at)| *at);

        show(&round, &key, &sub, stats.clone(), &mut showing);
        let first = when(&showing).expect("the first look is kept");
        show(&round, &key, &sub, stats.clone(), &mut showing);
        assert_eq!(
            when(&showing),
            Some(first),
            "the same inputs: not looked at"
        );

        // Each input, changed alone, is looked at anew (what it left kept, if anything).
        let mut more = stats.clone();
        more.counters.delivered = 1;
        std::thread::sleep(Duration::from_millis(2));
        show(&round, &key, &sub, more.clone(), &mut showing);
        assert_ne!(when(&showing), Some(first), "new stats are looked at");

        showing.seen = Some((fingerprint(&more, &showing.trouble, Some("1")), first));
        showing.trouble.unsaved = Some("the broker refused".into());
        show(&round, &key, &sub, more.clone(), &mut showing);
        assert_ne!(when(&showing), Some(first), "new trouble is looked at");

        showing.seen = Some((fingerprint(&more, &showing.trouble, Some("1")), first));
        sub.metadata.resource_version = Some("2".into());
        show(&round, &key, &sub, more, &mut showing);
        assert_ne!(when(&showing), Some(first), "a changed object is looked at");
    }

    #[test]
    fn a_patch_is_on_its_way_while_the_same_was_sent_within_three_intervals_and_did_not_fail() {
        let interval = Duration::from_secs(10);
        let now = Instant::now();
        let never = || -> bool { panic!("the writer is asked only when the patch is the same") };
        assert!(on_its_way(Some((7, now)), 7, interval, || false));
        assert!(!on_its_way(None, 7, interval, never));
        assert!(
            !on_its_way(Some((7, now)), 8, interval, never),
            "another patch is sent"
        );
        assert!(
            !on_its_way(Some((7, now)), 7, interval, || true),
            "a failed write is sent again"
        );
        let long_ago = now
            .checked_sub(interval * RESEND_AFTER)
            .expect("an instant");
        assert!(
            !on_its_way(Some((7, long_ago)), 7, interval, never),
            "sent again after three intervals"
        );
    }

    #[tokio::test]
    async fn the_same_patch_is_not_sent_twice_while_on_its_way_but_again_when_its_write_failed() {
        // Every write fails (no API server there), and the writer notes it.
        let (metrics, writer) = nowhere();
        let config = Config {
            stats_interval: Duration::from_millis(50),
            ..config()
        };
        let stamp = Time(k8s_openapi::jiff::Timestamp::now());
        let round = Round {
            writer: &writer,
            metrics: &metrics,
            config: &config,
            unseen_attempts: status::Unseen::Never,
            now_ms: 1,
            stamp: &stamp,
        };
        let sub = orders();
        let key = ("shop".to_string(), "orders".to_string());
        let stats = SubscriptionStats::default();
        let mut showing = Showing::default();
        let sent = |s: &Showing| s.sent.map(|(_, at)| at);
        let failed = async |writer: &Writer| {
            for _ in 0..1000 {
                if writer.failure_noted(&key) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("the write to no API server did not fail within 10 s");
        };

        show(&round, &key, &sub, stats.clone(), &mut showing);
        let first = sent(&showing).expect("the first patch is sent");
        failed(&writer).await;
        tokio::time::sleep(config.stats_interval).await;
        show(&round, &key, &sub, stats.clone(), &mut showing);
        let second = sent(&showing).expect("sent");
        assert!(second > first, "a patch whose write failed is sent again");
        assert!(!writer.failure_noted(&key), "asking forgets the failure");

        // Its write not known to have failed (the note taken away): status, still without it,
        // is not written again with the same.
        failed(&writer).await;
        assert!(writer.failed(&key));
        tokio::time::sleep(config.stats_interval).await;
        show(&round, &key, &sub, stats.clone(), &mut showing);
        assert_eq!(sent(&showing), Some(second), "the same patch is on its way");

        let mut more = stats;
        more.counters.delivered = 1;
        show(&round, &key, &sub, more, &mut showing);
        assert!(
            sent(&showing) > Some(second),
            "another patch is sent at once when due"
        );
    }

    #[test]
    fn the_gauge_budget_spreads_reads_over_the_interval() {
        let ten = Duration::from_secs(10);
        // 500 queues, 10 s, rounds of 500 ms: 20 rounds, 26 reads each (every queue within the interval).
        assert_eq!(gauge_budget(500, ten, Duration::from_millis(500)), 26);
        assert_eq!(gauge_budget(500, ten, Duration::from_secs(1)), 51);
        assert_eq!(gauge_budget(0, ten, Duration::from_secs(1)), 1);
        // A round longer than the interval reads everything at once.
        assert_eq!(
            gauge_budget(7, Duration::from_secs(1), Duration::from_secs(2)),
            8
        );
    }
}
