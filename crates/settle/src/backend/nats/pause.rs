//! A Subscription's pause on JetStream (docs/semantics.md W2): the server's consumer pause
//! (nats-server 2.11+), which delivers nothing to any pull request until its time, then resumes
//! by itself. The mapping from the spec's [`Pause`] to the time the server is asked for, and the
//! live pause read back from `CONSUMER.INFO` (`paused`, `config.pause_until`) in the same
//! shape, so the controller compares the two and sends `CONSUMER.PAUSE` only when they differ.
//!
//! The pause is not part of the consumer's config diff (`consumer::diff`): the server ignores
//! `pause_until` in an update and keeps it in the config it reports, so comparing it there would
//! fight the pause (an update every reconcile that changes nothing). It is set through the pause
//! API only ([`super::admin::pause_consumer`]).
//!
//! Pure: no I/O. It must not decide when to pause (the spec and the controller do).

use async_nats::jetstream::consumer;
use k8s_openapi::jiff::Timestamp;

use crate::policy::Pause;

/// The time an indefinite pause (`paused: true` without `pausedUntil`) is sent as:
/// 9999-01-01T00:00:00Z. JetStream pauses only until a time; this one no Subscription reaches,
/// and the controller reads it back as "until spec.paused is set false".
pub const FOREVER_SECOND: i64 = 253_370_764_800;

/// A consumer's pause as the server reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LivePause {
    /// Whether the server holds deliveries back now.
    pub paused: bool,
    /// Until when (whole seconds; `None` when not paused).
    pub until: Option<Timestamp>,
}

impl LivePause {
    /// The pause of a consumer's info (`paused` and `config.pause_until`; the config keeps a
    /// passed time after the server resumed, so only `paused` says whether it holds).
    pub fn of(info: &consumer::Info) -> LivePause {
        let until = info
            .config
            .pause_until
            .and_then(|t| Timestamp::from_second(t.unix_timestamp()).ok());
        LivePause {
            paused: info.paused,
            until: until.filter(|_| info.paused),
        }
    }

    /// Whether the server holds what `want` asks for.
    pub fn matches(self, want: Pause) -> bool {
        match (want, self.paused) {
            (Pause::Running, paused) => !paused,
            (Pause::Paused { .. }, false) => false,
            (want, true) => {
                self.until.map(Timestamp::as_second) == request(want).map(Timestamp::as_second)
            }
        }
    }

    /// Whether it is Settle's indefinite pause.
    pub fn forever(self) -> bool {
        self.until.map(Timestamp::as_second) == Some(FOREVER_SECOND)
    }
}

/// The `pause_until` to send for `want`: its time, [`FOREVER_SECOND`] for an indefinite pause,
/// and `None` to resume.
pub fn request(want: Pause) -> Option<Timestamp> {
    match want {
        Pause::Running => None,
        Pause::Paused { until: Some(t) } => {
            Some(Timestamp::from_second(t.as_second()).unwrap_or(t))
        }
        Pause::Paused { until: None } => Timestamp::from_second(FOREVER_SECOND).ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).expect("time")
    }

    fn live(paused: bool, until: Option<i64>) -> LivePause {
        LivePause {
            paused,
            until: until.map(at),
        }
    }

    #[test]
    fn the_live_pause_matches_the_spec_only_when_it_holds_until_the_same_second() {
        let until = Pause::Paused {
            until: Some(at(2_000_000_000)),
        };
        let forever = Pause::Paused { until: None };
        assert!(live(false, None).matches(Pause::Running));
        assert!(
            !live(true, Some(2_000_000_000)).matches(Pause::Running),
            "paused by hand: resumed"
        );
        assert!(live(true, Some(2_000_000_000)).matches(until));
        assert!(
            !live(true, Some(2_000_000_001)).matches(until),
            "another time"
        );
        assert!(
            !live(false, None).matches(until),
            "resumed by hand: paused again"
        );
        assert!(live(true, Some(FOREVER_SECOND)).matches(forever));
        assert!(live(true, Some(FOREVER_SECOND)).forever());
        assert!(!live(true, Some(2_000_000_000)).matches(forever));
    }

    #[test]
    fn an_indefinite_pause_is_sent_as_the_year_9999_and_running_as_nothing() {
        assert_eq!(
            request(Pause::Paused { until: None }).map(|t| t.to_string()),
            Some("9999-01-01T00:00:00Z".to_string())
        );
        assert_eq!(request(Pause::Running), None);
        let t = at(2_000_000_000) + k8s_openapi::jiff::SignedDuration::from_millis(500);
        assert_eq!(
            request(Pause::Paused { until: Some(t) }),
            Some(at(2_000_000_000)),
            "whole seconds"
        );
    }
}
