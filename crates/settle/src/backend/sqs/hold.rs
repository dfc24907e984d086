//! The hold limit of SQS (docs/semantics.md C10, Q4): a message cannot be kept invisible past
//! twelve hours from its first receive (`ApproximateFirstReceiveTimestamp`). This module is the
//! arithmetic only: how long a decline or a lease extension may hide a message, and whether that
//! is shorter than asked.
//!
//! Pure: no clock and no client. The caller reads the first receive from the server and passes
//! the time now.

use std::time::Duration;

/// How long SQS can hold a message back, counted from its first receive.
pub const HOLD_LIMIT: Duration = Duration::from_secs(12 * 3600);

/// How long to hide a message (SQS takes whole seconds), and whether that is less than asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hold {
    /// The visibility timeout to set, in seconds.
    pub seconds: u32,
    /// True when the limit cut the wait short (a decline counts DelayShortened).
    pub shortened: bool,
}

/// The visibility timeout for a wait of `asked`, starting `now_ms`, for a message first received
/// at `first_receive_ms` (both in milliseconds since the epoch), with the hold `limit`.
///
/// The wait is rounded up to whole seconds (a delay is a floor, semantics B5). What is left of
/// the limit is rounded down, so the message never stays hidden past it; when the wait does not
/// fit, it is cut to what is left and `shortened` is set. A first receive in the future (clock
/// skew between this host and the server) counts as now.
pub fn hold(first_receive_ms: u64, now_ms: u64, asked: Duration, limit: Duration) -> Hold {
    let asked_s = ceil_secs(asked);
    let held_ms = now_ms.saturating_sub(first_receive_ms);
    let left_ms = u64::try_from(limit.as_millis())
        .unwrap_or(u64::MAX)
        .saturating_sub(held_ms);
    let left_s = left_ms / 1000;
    if asked_s <= left_s {
        Hold {
            seconds: u32::try_from(asked_s).unwrap_or(u32::MAX),
            shortened: false,
        }
    } else {
        Hold {
            seconds: u32::try_from(left_s).unwrap_or(u32::MAX),
            shortened: true,
        }
    }
}

/// Whole seconds, rounded up.
pub fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: u64 = 3_600_000;
    const T0: u64 = 1_700_000_000_000;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn table() {
        // (held so far in ms, asked, expected seconds, shortened)
        let rows: &[(u64, Duration, u32, bool)] = &[
            // A fresh message: any wait up to twelve hours fits.
            (0, secs(0), 0, false),
            (0, secs(30), 30, false),
            (0, secs(12 * 3600), 12 * 3600, false),
            (0, secs(12 * 3600 + 1), 12 * 3600, true),
            // Sub-second waits round up: never offered before the delay.
            (0, Duration::from_millis(600), 1, false),
            (0, Duration::from_millis(1001), 2, false),
            // Eleven hours in: one hour is left.
            (11 * H, secs(3600), 3600, false),
            (11 * H, secs(3601), 3600, true),
            (11 * H, secs(4 * 3600), 3600, true),
            // Just under the limit: what is left rounds down.
            (12 * H - 1500, secs(1), 1, false),
            (12 * H - 1500, secs(2), 1, true),
            (12 * H - 999, secs(1), 0, true),
            // At the limit: nothing is left; an immediate retry is still as asked.
            (12 * H, secs(1), 0, true),
            (12 * H, secs(0), 0, false),
            // Past it: the same.
            (13 * H, secs(60), 0, true),
            (13 * H, secs(0), 0, false),
        ];
        for &(held, asked, seconds, shortened) in rows {
            let got = hold(T0, T0 + held, asked, HOLD_LIMIT);
            assert_eq!(
                got,
                Hold { seconds, shortened },
                "held {held} ms, asked {asked:?}"
            );
        }
    }

    #[test]
    fn a_first_receive_in_the_future_counts_as_now() {
        assert_eq!(
            hold(T0 + 5000, T0, secs(12 * 3600), HOLD_LIMIT),
            Hold {
                seconds: 12 * 3600,
                shortened: false
            }
        );
    }

    #[test]
    fn the_twelve_hour_example() {
        // A schedule of 4h, 8h, 8h: the first decline fits, the second would end at 12h + a
        // few seconds of handling, the third finds nothing left.
        let first = T0;
        let d1 = hold(first, first + 10_000, secs(4 * 3600), HOLD_LIMIT);
        assert_eq!(
            d1,
            Hold {
                seconds: 4 * 3600,
                shortened: false
            }
        );
        let d2 = hold(first, first + 4 * H + 20_000, secs(8 * 3600), HOLD_LIMIT);
        assert_eq!(
            d2,
            Hold {
                seconds: 8 * 3600 - 20,
                shortened: true
            }
        );
        let d3 = hold(first, first + 12 * H + 1_000, secs(8 * 3600), HOLD_LIMIT);
        assert_eq!(
            d3,
            Hold {
                seconds: 0,
                shortened: true
            }
        );
    }
}
