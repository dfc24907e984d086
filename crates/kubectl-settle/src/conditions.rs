//! Which of a Subscription's conditions are healthy: `Accepted`, `Ready` and `Accounted` when
//! True; `Exhausting`, `Stranding`, `Stalled` and `Paused` when False (a pause is no fault, but
//! nothing is delivered while it lasts, so it is shown). The types are the writers' own
//! constants (`reconcile::conditions`, `account::status`, `account::stall`), never retyped.
//!
//! Pure. It must not decide a condition, only read one; a type it does not know is always shown
//! (as `Type=Status`), never judged.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

use settle_operator::account::stall::STALLED;
use settle_operator::account::status::types::{ACCOUNTED, EXHAUSTING, STRANDING};
use settle_operator::reconcile::conditions::types::{ACCEPTED, PAUSED, READY};

/// The conditions whose True is the healthy state.
const GOOD_WHEN_TRUE: [&str; 3] = [ACCEPTED, READY, ACCOUNTED];
/// The conditions whose True is the trouble (or, for `Paused`, worth seeing: nothing is
/// offered).
const BAD_WHEN_TRUE: [&str; 4] = [EXHAUSTING, STRANDING, STALLED, PAUSED];

/// Whether `c` is healthy; `None` for a type this plugin does not know.
pub fn healthy(c: &Condition) -> Option<bool> {
    if GOOD_WHEN_TRUE.contains(&c.type_.as_str()) {
        Some(c.status == "True")
    } else if BAD_WHEN_TRUE.contains(&c.type_.as_str()) {
        Some(c.status == "False")
    } else {
        None
    }
}

/// The conditions worth a column: every unhealthy one, and every one of a type not known here.
pub fn shown(conditions: &[Condition]) -> Vec<&Condition> {
    conditions
        .iter()
        .filter(|c| healthy(c) != Some(true))
        .collect()
}

/// How a shown condition reads in a table: `Exhausting` for a trouble that is True,
/// `Ready=False` otherwise; with its reason after a colon when one is given.
pub fn label(type_: &str, status: &str, reason: Option<&str>) -> String {
    let mut s = if BAD_WHEN_TRUE.contains(&type_) && status == "True" {
        type_.to_string()
    } else {
        format!("{type_}={status}")
    };
    if let Some(r) = reason.filter(|r| !r.is_empty()) {
        s.push(':');
        s.push_str(r);
    }
    s
}

#[cfg(test)]
pub(crate) fn cond(type_: &str, status: &str, reason: &str, message: &str) -> Condition {
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
        observed_generation: None,
        last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthy_is_true_for_the_good_and_false_for_the_troubles() {
        assert_eq!(
            healthy(&cond("Ready", "True", "ConsumerReady", "")),
            Some(true)
        );
        assert_eq!(
            healthy(&cond("Ready", "False", "BackendNotReady", "")),
            Some(false)
        );
        assert_eq!(
            healthy(&cond("Exhausting", "False", "NoRecentLoss", "")),
            Some(true)
        );
        assert_eq!(
            healthy(&cond("Stalled", "True", "NothingDelivered", "")),
            Some(false)
        );
        assert_eq!(
            healthy(&cond("Accounted", "False", "CaptureGap", "")),
            Some(false)
        );
        assert_eq!(healthy(&cond("Throttled", "True", "Asked", "")), None);
        assert_eq!(
            healthy(&cond("Paused", "True", "PausedBySpec", "")),
            Some(false),
            "a pause is shown"
        );
        assert_eq!(
            healthy(&cond("Paused", "False", "NotPaused", "")),
            Some(true)
        );
    }

    #[test]
    fn labels_name_a_true_trouble_alone_and_the_rest_with_their_status() {
        let shown_ = [
            cond("Accepted", "True", "Valid", ""),
            cond("Ready", "Unknown", "", ""),
            cond("Exhausting", "True", "MessagesExhausted", ""),
            cond("Accounted", "False", "CaptureGap", ""),
            cond("Stranding", "False", "NoneStranded", ""),
            cond("Throttled", "True", "Asked", ""),
            cond("Paused", "True", "PausedBySpec", ""),
            cond("Paused", "False", "NotPaused", ""),
        ];
        let labels: Vec<String> = shown(&shown_)
            .iter()
            .map(|c| label(&c.type_, &c.status, None))
            .collect();
        assert_eq!(
            labels,
            [
                "Ready=Unknown",
                "Exhausting",
                "Accounted=False",
                "Throttled=True",
                "Paused"
            ]
        );
        assert_eq!(
            label("Exhausting", "True", Some("MessagesExhausted")),
            "Exhausting:MessagesExhausted",
            "wide adds the reason"
        );
    }
}
