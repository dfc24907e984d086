//! `kubectl settle pause SUB [--until TIME | --for DURATION]` and `kubectl settle resume SUB`: a
//! JSON merge patch of `spec.paused` and `spec.pausedUntil`, nothing else (the controller pauses
//! the broker, and `Paused` in status says when it holds; docs/semantics.md W1–W6).
//! Resume removes both fields (their default is running), so the stored spec reads as one never
//! paused.
//!
//! The bodies and the text are pure; [`patch`] is the one call.

use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};

use super::Error;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use settle::api::Subscription;

/// `now` plus `d`, as the time a pause ends.
pub fn after(now: Timestamp, d: std::time::Duration) -> Result<Timestamp, Error> {
    SignedDuration::try_from(d)
        .ok()
        .and_then(|d| now.checked_add(d).ok())
        .map(|t| Timestamp::from_second(t.as_second()).unwrap_or(t))
        .ok_or_else(|| Error::Usage(format!("--for {d:?} reaches past the last time there is")))
}

/// The patch that pauses, until `until` when given.
pub fn pause_body(until: Option<Timestamp>) -> Value {
    json!({"spec": {"paused": true, "pausedUntil": until.map(|t| t.to_string())}})
}

/// The patch that resumes: both fields removed.
pub fn resume_body() -> Value {
    json!({"spec": {"paused": null, "pausedUntil": null}})
}

/// What `pause` prints.
pub fn paused_text(namespace: &str, name: &str, until: Option<Timestamp>) -> String {
    let until = match until {
        Some(t) => format!("until {t}"),
        None => format!("until `kubectl settle resume {name} -n {namespace}`"),
    };
    format!(
        "Subscription {namespace}/{name} paused {until}: nothing is offered meanwhile, messages wait on the broker \
         (`kubectl settle explain {name} -n {namespace}` shows Paused once the broker holds it)\n"
    )
}

/// Applies `body` to Subscription `namespace/name` as a merge patch.
pub async fn patch(
    api: &Api<Subscription>,
    namespace: &str,
    name: &str,
    body: &Value,
) -> Result<(), Error> {
    match api
        .patch(name, &PatchParams::default(), &Patch::Merge(body))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Err(Error::NotFound {
            namespace: namespace.to_string(),
            name: name.to_string(),
        }),
        Err(source) => Err(Error::Api {
            what: format!("patch Subscription {namespace}/{name}"),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pause_sets_both_fields_and_resume_removes_both() {
        let t = Timestamp::from_second(1_800_000_000).expect("time");
        assert_eq!(
            pause_body(Some(t)),
            json!({"spec": {"paused": true, "pausedUntil": "2027-01-15T08:00:00Z"}})
        );
        assert_eq!(
            pause_body(None),
            json!({"spec": {"paused": true, "pausedUntil": null}})
        );
        assert_eq!(
            resume_body(),
            json!({"spec": {"paused": null, "pausedUntil": null}})
        );
    }

    #[test]
    fn for_a_duration_ends_that_long_from_now_in_whole_seconds() {
        let now =
            Timestamp::from_second(1_800_000_000).expect("time") + SignedDuration::from_millis(400);
        let t = after(now, std::time::Duration::from_secs(1800)).expect("a time");
        assert_eq!(t.as_second(), 1_800_001_800);
        assert_eq!(t.subsec_nanosecond(), 0);
    }
}
