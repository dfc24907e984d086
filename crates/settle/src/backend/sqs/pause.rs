//! A Subscription's pause on SQS (docs/semantics.md W4). SQS has no pause of a queue, so the
//! runtime stops receiving, and the operator leaves the signal on the queue itself: while the
//! Subscription is paused its queue carries the tag [`TAG`] = `settle-paused`, whose value is
//! the time the pause ends (RFC 3339) or [`INDEFINITE`]. Every application bound to the queue
//! reads its tags (`ListQueueTags`, which it is granted already to read the queue's owner) once
//! per `SETTLE_PAUSE_POLL_INTERVAL` (`backend::pause`), and receives nothing while the tag says
//! paused; a time passed means resumed, so a pause with a time ends on time even while no
//! operator runs.
//!
//! Why a tag: the runtime already reads the queue's tags, SQS and ElasticMQ both keep them,
//! reading them costs one call and never touches a message, and a queue attribute has no room
//! for a value of Settle's own. Tenants: `sqs:TagQueue` and `sqs:UntagQueue` on the queue are
//! the operator's (README, IAM); an application is granted `ListQueueTags` only, and no tenant
//! reaches another's `<queuePrefix>*` queues, so nobody can pause a queue it cannot already
//! change.
//!
//! The operator's calls ([`set`], [`clear`]) and the runtime's ([`paused_at`]) are here, so the
//! tag is written once. It must not decide when to pause (the controller does, from the spec).

use aws_sdk_sqs::Client;
use k8s_openapi::jiff::Timestamp;

use super::admin::{AdminError, classify};
use crate::policy::Pause;

/// The tag that pauses a queue's applications (kept beside the owner tags it is read with).
pub use super::admin::PAUSE_TAG as TAG;
/// Its value for a pause without an end (`paused: true` without `pausedUntil`).
pub const INDEFINITE: &str = "indefinite";

/// The tag value `pause` asks for: `None` to have no tag (running).
pub fn value(pause: Pause) -> Option<String> {
    match pause {
        Pause::Running => None,
        Pause::Paused { until: None } => Some(INDEFINITE.to_string()),
        Pause::Paused { until: Some(t) } => Some(
            Timestamp::from_second(t.as_second())
                .unwrap_or(t)
                .to_string(),
        ),
    }
}

/// Whether a queue whose tag reads `value` is paused at `now`: any value but a time passed
/// pauses (an unreadable one too: the operator wrote it, and a pause that is not honoured is
/// worse than one that lasts until the operator clears it).
pub fn paused_at(value: Option<&str>, now: Timestamp) -> bool {
    match value {
        None => false,
        Some(v) => match v.parse::<Timestamp>() {
            Ok(until) => until > now,
            Err(_) => true,
        },
    }
}

/// Tags the queue at `url` with `value`.
pub async fn set(client: &Client, url: &str, value: &str) -> Result<(), AdminError> {
    client
        .tag_queue()
        .queue_url(url)
        .tags(TAG, value)
        .send()
        .await
        .map_err(|e| classify("TagQueue", e))?;
    Ok(())
}

/// Removes the tag from the queue at `url`.
pub async fn clear(client: &Client, url: &str) -> Result<(), AdminError> {
    client
        .untag_queue()
        .queue_url(url)
        .tag_keys(TAG)
        .send()
        .await
        .map_err(|e| classify("UntagQueue", e))?;
    Ok(())
}

/// The runtime's check: whether the queue at `url` is paused now.
pub async fn is_set(client: &Client, url: &str) -> Result<bool, AdminError> {
    let out = client
        .list_queue_tags()
        .queue_url(url)
        .send()
        .await
        .map_err(|e| classify("ListQueueTags", e))?;
    let tags = out.tags.unwrap_or_default();
    Ok(paused_at(
        tags.get(TAG).map(String::as_str),
        Timestamp::now(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).expect("time")
    }

    #[test]
    fn the_tag_says_until_when_and_a_time_passed_is_running() {
        assert_eq!(value(Pause::Running), None);
        assert_eq!(
            value(Pause::Paused { until: None }).as_deref(),
            Some(INDEFINITE)
        );
        let v = value(Pause::Paused {
            until: Some(at(2_000_000_000)),
        })
        .expect("a value");
        assert_eq!(v, "2033-05-18T03:33:20Z");
        assert!(paused_at(Some(&v), at(1_999_999_999)));
        assert!(!paused_at(Some(&v), at(2_000_000_000)));
        assert!(paused_at(Some(INDEFINITE), at(2_000_000_000)));
        assert!(paused_at(Some("garbled"), at(0)), "a pause is honoured");
        assert!(!paused_at(None, at(0)));
    }
}
