//! Kubernetes Events (events.k8s.io/v1) on Settle's objects, what `kubectl describe` shows: a
//! repeat of one (same object, type, reason, action, reporter) within [`FOLD_WINDOW`] of the
//! last is folded into its series (a patch of the count), as kube-runtime's `Recorder` does.
//! Unlike that recorder, what is kept to fold is the Event's name and count only (about 100
//! bytes, not the whole Event), it is swept once a minute rather than over the whole cache on
//! every publish, and it holds at most [`MAX_FOLDED`] (a mass apply publishes one "created"
//! Event per Subscription: 10,000 Subscriptions had kept 37 MiB of Events for good, and every
//! publish went over all of them). An Event past the cap is still published, only not folded.
//!
//! It must not decide what an Event says, nor import anything else of the crate: it sits below
//! every layer so that `reconcile` and `account` share it.

use std::collections::HashMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};

pub use kube::runtime::events::{Event, EventType, Reporter};

/// How long after an Event's last occurrence a repeat is folded into it (kube-runtime's too).
pub const FOLD_WINDOW: Duration = Duration::from_secs(6 * 60);

/// Events remembered for folding, at most.
pub const MAX_FOLDED: usize = 16_384;

/// How often what is past [`FOLD_WINDOW`] is forgotten.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// An Event published, as far as folding a repeat needs.
struct Published {
    namespace: String,
    name: String,
    count: i32,
    last: Instant,
}

struct Folds {
    by_key: HashMap<u64, Published>,
    swept: Instant,
}

impl Folds {
    fn new(now: Instant) -> Folds {
        Folds {
            by_key: HashMap::new(),
            swept: now,
        }
    }

    /// The Event `key` folds into, counted once more, if one is remembered.
    fn repeat_of(&mut self, key: u64, now: Instant) -> Option<(String, String, i32)> {
        if now.duration_since(self.swept) >= SWEEP_EVERY {
            self.by_key
                .retain(|_, p| now.duration_since(p.last) < FOLD_WINDOW);
            self.by_key.shrink_to_fit();
            self.swept = now;
        }
        let p = self.by_key.get_mut(&key)?;
        if now.duration_since(p.last) >= FOLD_WINDOW {
            return None;
        }
        // A first Event is a series of one: its first repeat makes it two.
        p.count = p.count.saturating_add(1).max(2);
        p.last = now;
        Some((p.namespace.clone(), p.name.clone(), p.count))
    }

    /// Remembers a new Event published, while there is room.
    fn remember(&mut self, key: u64, namespace: String, name: String, now: Instant) {
        if self.by_key.len() < MAX_FOLDED || self.by_key.contains_key(&key) {
            self.by_key.insert(
                key,
                Published {
                    namespace,
                    name,
                    count: 1,
                    last: now,
                },
            );
        }
    }
}

/// Publishes Events as one reporter (controller and instance).
#[derive(Clone)]
pub struct Recorder {
    client: Client,
    reporter: Reporter,
    folds: Arc<Mutex<Folds>>,
}

impl Recorder {
    pub fn new(client: Client, reporter: Reporter) -> Recorder {
        Recorder {
            client,
            reporter,
            folds: Arc::new(Mutex::new(Folds::new(Instant::now()))),
        }
    }

    /// Publishes `ev` on `regarding`: a new Event, or the series of the same one published
    /// within the fold window.
    pub async fn publish(
        &self,
        ev: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let key = fold_key(&self.reporter, ev, regarding);
        let repeat = self.repeat_of(key);
        let now = Timestamp::now();
        if let Some((namespace, name, count)) = repeat {
            let series = EventSeries {
                count,
                last_observed_time: MicroTime(now),
            };
            let patch = serde_json::json!({ "series": series });
            let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), &namespace);
            match api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => return Ok(()),
                // Gone (expired on the API server): published anew below.
                Err(kube::Error::Api(e)) if e.code == 404 => self.forget(key),
                Err(e) => return Err(e),
            }
        }
        let event = self.generate(ev, regarding, now);
        let namespace = event.metadata.namespace.clone().unwrap_or_default();
        let name = event.metadata.name.clone().unwrap_or_default();
        let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), &namespace);
        api.create(&PostParams::default(), &event).await?;
        self.remember(key, namespace, name);
        Ok(())
    }

    fn repeat_of(&self, key: u64) -> Option<(String, String, i32)> {
        self.folds.lock().ok()?.repeat_of(key, Instant::now())
    }

    fn remember(&self, key: u64, namespace: String, name: String) {
        if let Ok(mut folds) = self.folds.lock() {
            folds.remember(key, namespace, name, Instant::now());
        }
    }

    fn forget(&self, key: u64) {
        if let Ok(mut folds) = self.folds.lock() {
            folds.by_key.remove(&key);
        }
    }

    fn generate(&self, ev: &Event, regarding: &ObjectReference, now: Timestamp) -> K8sEvent {
        let controller = &self.reporter.controller;
        K8sEvent {
            action: Some(ev.action.clone()),
            reason: Some(ev.reason.clone()),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            note: ev.note.clone(),
            metadata: ObjectMeta {
                // Cluster-scoped objects' Events go to "default", as kube-runtime's.
                namespace: Some(
                    regarding
                        .namespace
                        .clone()
                        .unwrap_or_else(|| "default".to_string()),
                ),
                name: Some(format!(
                    "{}.{:x}",
                    regarding.name.as_deref().unwrap_or(controller),
                    now.as_nanosecond()
                )),
                ..Default::default()
            },
            reporting_controller: Some(controller.clone()),
            reporting_instance: Some(
                self.reporter
                    .instance
                    .clone()
                    .unwrap_or_else(|| controller.clone()),
            ),
            type_: Some(
                match ev.type_ {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .to_string(),
            ),
            related: ev.secondary.clone(),
            ..Default::default()
        }
    }
}

/// What makes two Events one series: the reporter, the object, type, reason, action and the
/// related object (the note is not: a repeat keeps the first one's).
fn fold_key(reporter: &Reporter, ev: &Event, regarding: &ObjectReference) -> u64 {
    let mut h = DefaultHasher::new();
    reporter.controller.hash(&mut h);
    reporter.instance.hash(&mut h);
    matches!(ev.type_, EventType::Warning).hash(&mut h);
    ev.reason.hash(&mut h);
    ev.action.hash(&mut h);
    for r in std::iter::once(Some(regarding)).chain(std::iter::once(ev.secondary.as_ref())) {
        let r = r.map(|r| (&r.api_version, &r.kind, &r.namespace, &r.name, &r.uid));
        r.hash(&mut h);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(reason: &str) -> Event {
        Event {
            type_: EventType::Normal,
            reason: reason.into(),
            note: Some("a note".into()),
            action: "Reconcile".into(),
            secondary: None,
        }
    }

    fn object(name: &str, uid: &str) -> ObjectReference {
        ObjectReference {
            kind: Some("Subscription".into()),
            namespace: Some("team".into()),
            name: Some(name.into()),
            uid: Some(uid.into()),
            ..Default::default()
        }
    }

    #[test]
    fn a_repeat_folds_into_the_last_event_until_the_window_passes_and_the_cap_holds() {
        let t0 = Instant::now();
        let mut f = Folds::new(t0);
        assert_eq!(f.repeat_of(1, t0), None, "nothing published yet");
        f.remember(1, "team".into(), "a.1".into(), t0);
        let later = t0 + Duration::from_secs(30);
        assert_eq!(
            f.repeat_of(1, later),
            Some(("team".into(), "a.1".into(), 2))
        );
        assert_eq!(
            f.repeat_of(1, later),
            Some(("team".into(), "a.1".into(), 3))
        );
        // The window runs from the last repeat.
        let still = later + FOLD_WINDOW - Duration::from_secs(1);
        assert_eq!(f.repeat_of(1, still).map(|r| r.2), Some(4));
        assert_eq!(f.repeat_of(1, still + FOLD_WINDOW), None, "past the window");
        assert!(f.by_key.is_empty(), "swept: {}", f.by_key.len());
        for key in 0..(MAX_FOLDED as u64 + 10) {
            f.remember(key, "team".into(), format!("e.{key}"), still);
        }
        assert_eq!(f.by_key.len(), MAX_FOLDED, "at most MAX_FOLDED remembered");
    }

    #[test]
    fn one_series_per_object_reason_and_reporter_whatever_the_note() {
        let r = Reporter {
            controller: "settle-operator".into(),
            instance: None,
        };
        let a = fold_key(&r, &ev("Created"), &object("a", "1"));
        let mut other_note = ev("Created");
        other_note.note = Some("another".into());
        assert_eq!(a, fold_key(&r, &other_note, &object("a", "1")));
        assert_ne!(a, fold_key(&r, &ev("Updated"), &object("a", "1")));
        assert_ne!(a, fold_key(&r, &ev("Created"), &object("b", "1")));
        assert_ne!(
            a,
            fold_key(&r, &ev("Created"), &object("a", "2")),
            "a new object of the same name"
        );
        let other = Reporter {
            controller: "settle-account".into(),
            instance: None,
        };
        assert_ne!(a, fold_key(&other, &ev("Created"), &object("a", "1")));
    }
}
