//! When a Backend's RabbitMQ connection that dropped is made again: at once after one that lived
//! and after the first the broker closed within seconds of its making, then after a pause that
//! doubles (half a second up to 30 s) for each further such quick drop in a row.
//!
//! RabbitMQ closes the whole connection for some refusals (a quorum queue it cannot form yet
//! answers 541 `cluster_not_formed`), and every drop re-checks the Backend's Subscriptions, whose
//! check connects and declares again: without a pause the operator and the broker would trade a
//! connection and a refusal many times a second until the broker recovers, which it then does
//! later. It must not connect or decide anything itself; it only says whether now is too soon,
//! and why.

use std::time::{Duration, Instant};

/// A connection that lived this long before it dropped was steady: the next is made at once.
pub const STEADY: Duration = Duration::from_secs(10);
/// The pause after the second quick drop in a row.
pub const FIRST_PAUSE: Duration = Duration::from_millis(500);
/// The longest pause.
pub const LONGEST_PAUSE: Duration = Duration::from_secs(30);

/// One connection slot's recent history.
#[derive(Debug, Default)]
pub struct Redial {
    made_at: Option<Instant>,
    quick_drops: u32,
    not_before: Option<Instant>,
    last_error: Option<String>,
}

/// Too soon to connect again: how many quick drops in a row, the pause after the last of them
/// (what is left of it is `retry_in`), and the broker's last word.
#[derive(Debug, Clone, PartialEq)]
pub struct TooSoon {
    pub drops: u32,
    pub pause: Duration,
    pub retry_in: Duration,
    pub last_error: Option<String>,
}

impl Redial {
    /// A connection was made at `now`.
    pub fn made(&mut self, now: Instant) {
        self.made_at = Some(now);
    }

    /// The broker's reason for closing the current connection, as the connection reported it.
    pub fn closed_because(&mut self, error: String) {
        self.last_error = Some(error);
    }

    /// The current connection was found dropped at `now`.
    pub fn dropped(&mut self, now: Instant) {
        let quick = self
            .made_at
            .is_some_and(|m| now.saturating_duration_since(m) < STEADY);
        self.quick_drops = if quick {
            self.quick_drops.saturating_add(1)
        } else {
            0
        };
        self.not_before = (self.quick_drops > 1).then(|| now + pause(self.quick_drops));
    }

    /// `Some` while it is too soon at `now` to make the next connection.
    pub fn too_soon(&self, now: Instant) -> Option<TooSoon> {
        let retry_in = self
            .not_before?
            .checked_duration_since(now)
            .filter(|d| !d.is_zero())?;
        Some(TooSoon {
            drops: self.quick_drops,
            pause: pause(self.quick_drops),
            retry_in,
            last_error: self.last_error.clone(),
        })
    }
}

/// The pause after `quick` quick drops in a row (at least two).
fn pause(quick: u32) -> Duration {
    FIRST_PAUSE
        .saturating_mul(1u32 << quick.saturating_sub(2).min(8))
        .min(LONGEST_PAUSE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_steady_connection_is_made_again_at_once_and_quick_drops_wait_longer_each_time() {
        let t0 = Instant::now();
        let mut r = Redial::default();
        r.made(t0);
        r.dropped(t0 + STEADY + Duration::from_secs(1));
        assert_eq!(r.too_soon(t0 + STEADY + Duration::from_secs(1)), None);

        let mut at = t0 + Duration::from_secs(60);
        let mut waits = Vec::new();
        for _ in 0..9 {
            r.made(at);
            r.closed_because("cluster_not_formed".into());
            at += Duration::from_millis(50);
            r.dropped(at);
            if waits.is_empty() && r.too_soon(at).is_none() {
                // The first quick drop is made again at once (an administrator closed it, say).
                waits.push(Duration::ZERO);
                continue;
            }
            let soon = r.too_soon(at).expect("a further quick drop waits");
            assert_eq!(soon.last_error.as_deref(), Some("cluster_not_formed"));
            assert_eq!(soon.pause, soon.retry_in, "asked at the drop");
            waits.push(soon.retry_in);
            at += soon.retry_in;
            assert_eq!(r.too_soon(at), None, "the pause ends");
        }
        let secs: Vec<f64> = waits.iter().map(Duration::as_secs_f64).collect();
        assert_eq!(secs, [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]);

        // One that lives again starts over.
        r.made(at);
        r.dropped(at + STEADY);
        assert_eq!(r.too_soon(at + STEADY), None);
        for n in 1..=2 {
            r.made(at + STEADY * n);
            r.dropped(at + STEADY * n + Duration::from_secs(1));
        }
        assert_eq!(
            r.too_soon(at + STEADY * 2 + Duration::from_secs(1))
                .map(|s| s.retry_in),
            Some(FIRST_PAUSE)
        );
    }
}
