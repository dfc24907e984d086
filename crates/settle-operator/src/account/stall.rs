//! Whether a Subscription is stalled (semantics C22): messages are owed on the broker (pending,
//! plus delivered and not settled) and no handler returned (Delivered did not grow) for the
//! stall window; and the `Stalled` condition that says so, with what is owed and since when.
//!
//! The window is the larger of `--stall-window` and three ackWaits of the Subscription past its
//! longest decline delay (maxNackDelay, else the backoff's max): a healthy handler returns
//! within an ackWait (or has its lease extended and returns within maxProcessingTime), and a
//! declined message comes back within that delay, so that long without one return, while
//! messages wait, is not a slow handler nor a backoff. The watch starts again whenever nothing
//! is owed: a message published after an idle hour is not an hour late. A paused Subscription
//! (`spec.paused`) is never stalled: [`paused`] says so, and its watch begins anew on resume.
//!
//! Pure: no I/O and no clock of its own (times come in as arguments, on Tokio's clock so the
//! tests run on a paused one). It must not count (that is the ledger) nor write (that is the
//! writer); it is kept in memory only: an operator that starts watches anew, carrying a
//! `Stalled=True` it finds in status, so a leader handover neither hides a stall nor raises one
//! early.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use tokio::time::Instant;

use super::status::window_text;
use settle::api::condition::{Status, Want};

/// Messages are owed on the broker and no handler returned within the stall window (semantics
/// C22): the condition says what is owed and since when.
pub const STALLED: &str = "Stalled";

/// Its reasons.
pub mod reasons {
    /// Messages are owed and no handler returned within the window.
    pub const NOTHING_DELIVERED: &str = "NothingDelivered";
    /// Messages are owed and handlers return (or the window has not passed yet).
    pub const DELIVERING: &str = "Delivering";
    /// Nothing is owed.
    pub const NOTHING_PENDING: &str = "NothingPending";
    /// The Subscription is paused (`spec.paused`): nothing is offered by choice, which is no
    /// stall.
    pub const PAUSED: &str = "Paused";
}

/// How many ackWaits without a handler returning make a stall (above the floor).
pub const ACK_WAITS: u32 = 3;

/// The stall window of a Subscription whose resolved ackWait is `ack_wait` and whose longest
/// decline delay is `longest_delay` (`ResolvedPolicy::nack_ceiling`).
pub fn window(floor: Duration, ack_wait: Duration, longest_delay: Option<Duration>) -> Duration {
    floor.max(
        longest_delay
            .unwrap_or_default()
            .saturating_add(ack_wait.saturating_mul(ACK_WAITS)),
    )
}

/// One Subscription's watch: when a handler was last seen returning, or nothing was last owed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Watch {
    /// Delivered when last seen.
    delivered: u64,
    /// Since when nothing was delivered while something was owed.
    since: Instant,
    /// The same moment, in Unix ms (for the message).
    since_ms: u64,
}

/// What the watch says now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing is owed.
    NothingPending,
    /// Messages are owed, and a handler returned within the window (or it has not passed since
    /// the watch began).
    Delivering,
    /// `pending` messages wait and `ack_pending` were delivered and not settled, and no handler
    /// returned since `since_ms` (Unix ms), at least the window ago.
    Stalled {
        pending: u64,
        ack_pending: u64,
        since_ms: u64,
    },
}

impl Watch {
    /// A watch beginning at `now` (`now_ms` in Unix ms), counting from `shown_delivered` (what
    /// status shows, so a delivery since the last write counts as one) or else `delivered`.
    /// When status shows `Stalled=True` (`existing`), the stall goes on: the watch counts from
    /// a window before that condition turned True (nothing was delivered since then, as the
    /// operator that wrote it saw), so it stays True until a handler returns.
    pub fn start(
        now: Instant,
        now_ms: u64,
        delivered: u64,
        shown_delivered: Option<u64>,
        existing: &[Condition],
        window: Duration,
    ) -> Watch {
        let stalled = settle::api::condition::find(existing, STALLED)
            .filter(|c| c.status == Status::True.as_str());
        let (since, since_ms) = match stalled {
            Some(c) => {
                let turned = u64::try_from(c.last_transition_time.0.as_millisecond()).unwrap_or(0);
                let before = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
                (
                    now.checked_sub(window).unwrap_or(now),
                    turned.saturating_sub(before).min(now_ms),
                )
            }
            None => (now, now_ms),
        };
        Watch {
            delivered: shown_delivered.unwrap_or(delivered).min(delivered),
            since,
            since_ms,
        }
    }

    /// Notes `delivered` and how many messages are `owed` at `now`: the watch starts again when
    /// a handler returned (Delivered grew) or nothing is owed.
    pub fn observe(&mut self, now: Instant, now_ms: u64, delivered: u64, owed: u64) {
        if delivered > self.delivered || owed == 0 {
            self.since = now;
            self.since_ms = now_ms;
        }
        self.delivered = self.delivered.max(delivered);
    }

    /// The verdict at `now` with `pending` messages waiting and `ack_pending` delivered and not
    /// settled (after [`Watch::observe`]).
    pub fn verdict(
        &self,
        now: Instant,
        pending: u64,
        ack_pending: u64,
        window: Duration,
    ) -> Verdict {
        if pending.saturating_add(ack_pending) == 0 {
            Verdict::NothingPending
        } else if now.saturating_duration_since(self.since) >= window {
            Verdict::Stalled {
                pending,
                ack_pending,
                since_ms: self.since_ms,
            }
        } else {
            Verdict::Delivering
        }
    }
}

/// The `Stalled` condition for `verdict` under `window`.
pub fn want(verdict: Verdict, window: Duration) -> Want {
    let w = window_text(window);
    match verdict {
        Verdict::Stalled {
            pending,
            ack_pending,
            since_ms,
        } => {
            let since = i64::try_from(since_ms / 1000)
                .ok()
                .and_then(|s| k8s_openapi::jiff::Timestamp::from_second(s).ok())
                .map_or_else(
                    || format!("{since_ms} ms after the epoch"),
                    |t| t.to_string(),
                );
            Want::new(
                STALLED,
                Status::True,
                reasons::NOTHING_DELIVERED,
                format!(
                    "{} message(s) pending, nothing delivered since {since} (window {w}): {pending} \
                     waiting on the broker and {ack_pending} handed to the application and not \
                     settled, and no handler returned. Check the application: are its pods \
                     running and subscribed (the runtime logs `subscribed`), is a handler blocked \
                     (a call without a timeout, a deadlock: its logs, a thread dump)? It turns \
                     False by itself once a handler returns.",
                    pending.saturating_add(ack_pending)
                ),
            )
        }
        Verdict::Delivering => Want::new(
            STALLED,
            Status::False,
            reasons::DELIVERING,
            format!(
                "messages are pending and handlers return: none went {w} (the stall window) \
                 without a handler returning."
            ),
        ),
        Verdict::NothingPending => Want::new(
            STALLED,
            Status::False,
            reasons::NOTHING_PENDING,
            "no message is pending.",
        ),
    }
}

/// The `Stalled` condition of a paused Subscription: False, whatever is pending (a pause
/// delivers nothing by choice); the watch starts anew on resume.
pub fn paused(pause: settle::policy::Pause, window: Duration) -> Want {
    Want::new(
        STALLED,
        Status::False,
        reasons::PAUSED,
        format!(
            "delivery is paused {} (see Paused): messages pending while paused are no stall; the \
             watch starts again on resume (window {})",
            pause.until_text(),
            window_text(window)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;
    use settle::api::condition;
    use tokio::time::advance;

    const W: Duration = Duration::from_secs(90);
    /// 2023-11-14T22:13:20Z.
    const T0_MS: u64 = 1_700_000_000_000;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn ms(start_ms: u64, since: Instant) -> u64 {
        start_ms + u64::try_from(since.elapsed().as_millis()).expect("ms")
    }

    #[test]
    fn the_window_is_the_floor_or_three_ack_waits_past_the_longest_delay_whichever_is_longer() {
        assert_eq!(window(secs(300), secs(30), None), secs(300));
        assert_eq!(window(secs(300), secs(120), None), secs(360));
        assert_eq!(window(secs(3), secs(1), None), secs(3));
        assert_eq!(window(secs(1), secs(2), None), secs(6));
        // A message waiting out a 10-minute backoff is no stall.
        assert_eq!(window(secs(300), secs(30), Some(secs(600))), secs(690));
        assert_eq!(window(secs(300), secs(30), Some(secs(60))), secs(300));
    }

    #[tokio::test(start_paused = true)]
    async fn messages_owed_and_no_handler_returning_for_the_window_is_a_stall() {
        let t0 = Instant::now();
        let mut watch = Watch::start(t0, T0_MS, 10, Some(10), &[], W);
        watch.observe(Instant::now(), T0_MS, 10, 5);
        assert_eq!(watch.verdict(Instant::now(), 4, 1, W), Verdict::Delivering);
        advance(secs(89)).await;
        watch.observe(Instant::now(), ms(T0_MS, t0), 10, 5);
        assert_eq!(
            watch.verdict(Instant::now(), 4, 1, W),
            Verdict::Delivering,
            "one second short of the window"
        );
        advance(secs(1)).await;
        watch.observe(Instant::now(), ms(T0_MS, t0), 10, 5);
        let v = watch.verdict(Instant::now(), 4, 1, W);
        assert_eq!(
            v,
            Verdict::Stalled {
                pending: 4,
                ack_pending: 1,
                since_ms: T0_MS
            }
        );
        let c = want(v, W);
        assert_eq!(
            (c.status, c.reason),
            (Status::True, reasons::NOTHING_DELIVERED)
        );
        assert!(
            c.message.starts_with(
                "5 message(s) pending, nothing delivered since 2023-11-14T22:13:20Z (window 90s): \
                 4 waiting on the broker and 1 handed to the application"
            ),
            "{}",
            c.message
        );
        // The message stays the same while the stall goes on: no write for nothing.
        advance(secs(60)).await;
        watch.observe(Instant::now(), ms(T0_MS, t0), 10, 5);
        assert_eq!(want(watch.verdict(Instant::now(), 4, 1, W), W), c);
    }

    #[tokio::test(start_paused = true)]
    async fn a_handler_returning_clears_the_stall_and_starts_the_watch_again() {
        let t0 = Instant::now();
        let mut watch = Watch::start(t0, T0_MS, 3, None, &[], W);
        advance(secs(120)).await;
        watch.observe(Instant::now(), ms(T0_MS, t0), 3, 2);
        assert!(matches!(
            watch.verdict(Instant::now(), 0, 2, W),
            Verdict::Stalled { .. }
        ));
        // Delivered grew: Delivering, and a whole new window before the next stall.
        watch.observe(Instant::now(), ms(T0_MS, t0), 4, 1);
        let v = watch.verdict(Instant::now(), 0, 1, W);
        assert_eq!(v, Verdict::Delivering);
        assert_eq!(
            (want(v, W).status, want(v, W).reason),
            (Status::False, reasons::DELIVERING)
        );
        advance(secs(89)).await;
        watch.observe(Instant::now(), ms(T0_MS, t0), 4, 1);
        assert_eq!(watch.verdict(Instant::now(), 0, 1, W), Verdict::Delivering);
        advance(secs(1)).await;
        watch.observe(Instant::now(), ms(T0_MS, t0), 4, 1);
        assert_eq!(
            watch.verdict(Instant::now(), 0, 1, W),
            Verdict::Stalled {
                pending: 0,
                ack_pending: 1,
                since_ms: T0_MS + 120_000
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_owed_is_no_stall_and_a_message_after_an_idle_hour_is_not_late() {
        let t0 = Instant::now();
        let mut watch = Watch::start(t0, T0_MS, 7, Some(7), &[], W);
        for _ in 0..60 {
            advance(secs(60)).await;
            watch.observe(Instant::now(), ms(T0_MS, t0), 7, 0);
            assert_eq!(
                watch.verdict(Instant::now(), 0, 0, W),
                Verdict::NothingPending
            );
        }
        let v = watch.verdict(Instant::now(), 0, 0, W);
        assert_eq!(want(v, W).reason, reasons::NOTHING_PENDING);
        // A message arrives, and no application takes it: a stall one window later, not at once.
        advance(secs(1)).await;
        watch.observe(Instant::now(), ms(T0_MS, t0), 7, 1);
        assert_eq!(watch.verdict(Instant::now(), 1, 0, W), Verdict::Delivering);
        advance(W).await;
        watch.observe(Instant::now(), ms(T0_MS, t0), 7, 1);
        assert_eq!(
            watch.verdict(Instant::now(), 1, 0, W),
            Verdict::Stalled {
                pending: 1,
                ack_pending: 0,
                since_ms: T0_MS + 3_600_000
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_watch_carries_a_stall_status_shows_until_a_handler_returns() {
        let turned = Time(Timestamp::from_second(1_700_000_600).expect("time"));
        let stalled = want(
            Verdict::Stalled {
                pending: 2,
                ack_pending: 0,
                since_ms: 1_700_000_510_000,
            },
            W,
        );
        let existing = vec![condition::settle(&[], &stalled, Some(1), &turned)];
        let now_ms = 1_700_000_900_000;
        // Nothing delivered since status was written: still stalled, at once, since a window
        // before the condition turned True.
        let mut watch = Watch::start(Instant::now(), now_ms, 9, Some(9), &existing, W);
        watch.observe(Instant::now(), now_ms, 9, 2);
        assert_eq!(
            watch.verdict(Instant::now(), 2, 0, W),
            Verdict::Stalled {
                pending: 2,
                ack_pending: 0,
                since_ms: 1_700_000_510_000
            }
        );
        // Delivered since status was written (the ledger is past what status shows): over.
        let mut watch = Watch::start(Instant::now(), now_ms, 10, Some(9), &existing, W);
        watch.observe(Instant::now(), now_ms, 10, 2);
        assert_eq!(watch.verdict(Instant::now(), 2, 0, W), Verdict::Delivering);
        // Without a stall in status, a new watch waits a whole window.
        let mut watch = Watch::start(Instant::now(), now_ms, 9, Some(9), &[], W);
        watch.observe(Instant::now(), now_ms, 9, 2);
        assert_eq!(watch.verdict(Instant::now(), 2, 0, W), Verdict::Delivering);
    }

    #[test]
    fn a_stall_beginning_or_ending_is_a_change_that_matters_its_count_moving_is_not() {
        let now = Time(Timestamp::from_second(1_700_000_000).expect("time"));
        let stats = settle::api::SubscriptionStats::default();
        let stalled = |pending| {
            want(
                Verdict::Stalled {
                    pending,
                    ack_pending: 0,
                    since_ms: T0_MS,
                },
                W,
            )
        };
        let delivering = want(Verdict::Delivering, W);
        let shown = |w: &Want| vec![condition::settle(&[], w, Some(1), &now)];
        // A flip either way goes first under the status budget (semantics C21).
        assert!(super::super::status::matters(
            Some(&stats),
            &shown(&delivering),
            &stats,
            std::slice::from_ref(&stalled(3))
        ));
        assert!(super::super::status::matters(
            Some(&stats),
            &shown(&stalled(3)),
            &stats,
            std::slice::from_ref(&delivering)
        ));
        // More pending while stalled: a change to write in turn, not an urgent one.
        assert!(!super::super::status::matters(
            Some(&stats),
            &shown(&stalled(3)),
            &stats,
            std::slice::from_ref(&stalled(4))
        ));
        assert!(super::super::status::conditions_differ(
            &shown(&stalled(3)),
            std::slice::from_ref(&stalled(4))
        ));
        // Delivering and nothing pending are both False: no flip.
        assert!(!super::super::status::matters(
            Some(&stats),
            &shown(&delivering),
            &stats,
            &[want(Verdict::NothingPending, W)]
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn delivered_never_read_backwards_restarts_nothing() {
        // A lower Delivered (a source that lags) is no return of a handler.
        let t0 = Instant::now();
        let mut watch = Watch::start(t0, T0_MS, 5, Some(5), &[], W);
        advance(W).await;
        watch.observe(Instant::now(), ms(T0_MS, t0), 4, 3);
        assert!(matches!(
            watch.verdict(Instant::now(), 3, 0, W),
            Verdict::Stalled { .. }
        ));
        watch.observe(Instant::now(), ms(T0_MS, t0), 5, 3);
        assert!(matches!(
            watch.verdict(Instant::now(), 3, 0, W),
            Verdict::Stalled { .. }
        ));
    }
}
