//! What a Subscription's pause asks (`spec.paused`, `spec.pausedUntil`) at a given moment, for
//! every reader of it alike: the controller (which pauses the consumer or leaves the marker on
//! the broker, and writes `Paused`), the account (no `Stalled` while paused) and the plugin.
//!
//! Pure: the moment is an argument (no clock of its own). It must not decide how a broker is
//! paused (that is each backend's) nor admit anything (the rule A23 is in `rules`).

use k8s_openapi::jiff::Timestamp;

use crate::api::SubscriptionSpec;

/// The pause a spec asks for at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pause {
    /// Delivery runs: `paused` is false, or `pausedUntil` has been reached.
    Running,
    /// Nothing is offered; `until` is when it ends by itself (`None`: until `paused` is false).
    Paused { until: Option<Timestamp> },
}

impl Pause {
    /// The pause `spec` asks for at `now`: a `pausedUntil` at or before `now` is over.
    pub fn of(spec: &SubscriptionSpec, now: Timestamp) -> Pause {
        if !spec.paused {
            return Pause::Running;
        }
        match spec.paused_until.as_ref().map(|t| t.0) {
            Some(until) if until <= now => Pause::Running,
            until => Pause::Paused { until },
        }
    }

    pub fn is_paused(self) -> bool {
        matches!(self, Pause::Paused { .. })
    }

    /// When the pause ends by itself, if it does.
    pub fn until(self) -> Option<Timestamp> {
        match self {
            Pause::Paused { until } => until,
            Pause::Running => None,
        }
    }

    /// "until 2026-12-01T10:00:00Z (spec.pausedUntil)" or "until spec.paused is set false", for
    /// messages.
    pub fn until_text(self) -> String {
        match self.until() {
            Some(t) => format!("until {t} (spec.pausedUntil)"),
            None => "until spec.paused is set false".to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn spec(paused: bool, until: Option<i64>) -> SubscriptionSpec {
        let mut s: SubscriptionSpec = serde_json::from_value(serde_json::json!({
            "backendRef": {"name": "nats"}, "pattern": "a.>",
        }))
        .expect("a spec");
        s.paused = paused;
        s.paused_until = until.map(|u| Time(Timestamp::from_second(u).expect("time")));
        s
    }

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).expect("time")
    }

    #[test]
    fn paused_lasts_until_its_time_and_a_time_reached_or_passed_is_running() {
        assert_eq!(Pause::of(&spec(false, None), at(100)), Pause::Running);
        assert_eq!(
            Pause::of(&spec(true, None), at(100)),
            Pause::Paused { until: None }
        );
        assert_eq!(
            Pause::of(&spec(true, Some(200)), at(100)),
            Pause::Paused {
                until: Some(at(200))
            }
        );
        assert_eq!(Pause::of(&spec(true, Some(200)), at(200)), Pause::Running);
        assert_eq!(Pause::of(&spec(true, Some(200)), at(300)), Pause::Running);
        // pausedUntil alone pauses nothing (and is refused at admission, A23).
        assert_eq!(Pause::of(&spec(false, Some(200)), at(100)), Pause::Running);
    }

    #[test]
    fn the_text_says_until_when() {
        assert_eq!(
            Pause::of(&spec(true, Some(1_764_583_200)), at(100)).until_text(),
            "until 2025-12-01T10:00:00Z (spec.pausedUntil)"
        );
        assert_eq!(
            Pause::of(&spec(true, None), at(100)).until_text(),
            "until spec.paused is set false"
        );
    }

    #[test]
    fn the_fields_round_trip_and_are_left_out_when_unset() {
        let s = spec(false, None);
        let v = serde_json::to_value(&s).expect("json");
        assert!(
            v.get("paused").is_none() && v.get("pausedUntil").is_none(),
            "{v}"
        );
        let s = spec(true, Some(1_764_583_200));
        let v = serde_json::to_value(&s).expect("json");
        assert_eq!(v["paused"], true);
        assert_eq!(v["pausedUntil"], "2025-12-01T10:00:00Z");
        let back: SubscriptionSpec = serde_json::from_value(v).expect("back");
        assert_eq!(back, s);
    }
}
