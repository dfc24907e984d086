//! Condition arithmetic every status writer shares: a condition as a writer wants it ([`Want`]),
//! settled against the object's current conditions so `lastTransitionTime` moves only when the
//! status changes ([`settle`]), and compared ignoring times ([`conditions_current`]).
//!
//! Pure: no I/O and no clock (callers pass `now`). Which conditions exist, and their reasons,
//! belong to their writers.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// The statuses a condition takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    True,
    False,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::True => "True",
            Status::False => "False",
        }
    }
}

/// One condition as a writer wants it, before times are settled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Want {
    pub type_: &'static str,
    pub status: Status,
    pub reason: &'static str,
    pub message: String,
}

impl Want {
    pub fn new(
        type_: &'static str,
        status: Status,
        reason: &'static str,
        message: impl Into<String>,
    ) -> Want {
        Want {
            type_,
            status,
            reason,
            message: message.into(),
        }
    }
}

/// The condition to write for `want`, given the conditions the object has now: its
/// `lastTransitionTime` moves only when its status changes (not its reason or message).
pub fn settle(
    existing: &[Condition],
    want: &Want,
    observed_generation: Option<i64>,
    now: &Time,
) -> Condition {
    let old = existing.iter().find(|c| c.type_ == want.type_);
    let last_transition_time = match old {
        Some(c) if c.status == want.status.as_str() => c.last_transition_time.clone(),
        _ => now.clone(),
    };
    Condition {
        type_: want.type_.to_string(),
        status: want.status.as_str().to_string(),
        reason: want.reason.to_string(),
        message: want.message.clone(),
        observed_generation,
        last_transition_time,
    }
}

/// Whether the conditions in `ours` are already on the object, as they are, ignoring
/// `lastTransitionTime` (only a status change moves it, and `settle` keeps it then).
pub fn conditions_current(existing: &[Condition], ours: &[Condition]) -> bool {
    ours.iter().all(|c| {
        existing.iter().any(|e| {
            e.type_ == c.type_
                && e.status == c.status
                && e.reason == c.reason
                && e.message == c.message
                && e.observed_generation == c.observed_generation
        })
    })
}

/// The condition of `type_` in `conditions`, if any.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}
