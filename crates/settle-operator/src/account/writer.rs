//! The one status writer of the account: every keeper hands it patches; it applies them with
//! server-side apply (field manager `settle-account`, owning `status.stats`,
//! `statsUpdatedAt` and the `Exhausting`/`Stranding` conditions, never the controllers' fields),
//! a few at once but one at a time per Subscription, and when several patches for one
//! Subscription wait, only the newest is sent. Writes go out within the cluster-wide budget
//! (`--status-writes-per-second`, [`super::budget`]): urgent patches first, the rest in the
//! order they started waiting; `settle_account_status_backlog` counts the Subscriptions whose
//! patch waits. A waiting patch is kept as its JSON text, not as a tree of values: after a mass
//! apply every Subscription's first patch waits its turn, and a tree had been several times the
//! size of its text.
//!
//! It also records the account's Kubernetes Events (a ledger that cannot be saved, and saved
//! again) and writes the one condition the account owns on a Backend (`Accounted`: reports
//! dropped that name no Subscription of it), so the account reaches the API server through
//! this one place.
//!
//! How often a Subscription is written, and whether its patch is urgent, is the keeper's
//! decision (`show`: at most once per stats interval, only on change); this module must not
//! compute status nor look inside a patch. It tells the keepers which Subscriptions' last
//! write failed ([`Writer::failed`]), so that one is sent again at once, not after the wait
//! for a patch on its way.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use crate::events::{Event, EventType, Recorder, Reporter};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, Resource};
use serde_json::value::RawValue;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::budget::{Bucket, Pushed, Queue};
use super::metrics::Metrics;
use super::status::FIELD_MANAGER;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use settle::api::condition::{self, Want};
use settle::api::{Backend, Subscription};

/// One status patch for one Subscription.
pub struct Write {
    pub namespace: String,
    pub name: String,
    /// The UID of the object the patch was made for: written to that object only, never to a
    /// newer one of the same name (a delete and apply while the patch waited).
    pub uid: Option<String>,
    pub body: serde_json::Value,
    /// A change that matters (Exhausted or Stranded grew, a condition flipped: the keeper
    /// decides): written before every patch that is not.
    pub urgent: bool,
}

/// Ends the writer with its last handle; what waited is no longer this replica's to write.
struct AbortOnDrop(tokio::task::JoinHandle<()>, Metrics);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
        self.1.backlog.set(0);
    }
}

/// The Subscriptions whose last write failed, until a keeper asks ([`Writer::failed`]). A
/// Subscription deleted before its keeper asked stays; past this many, a failure is not noted
/// and its patch is sent again after the wait for one on its way (`show`).
const MAX_FAILED: usize = 10_000;

type Failed = Arc<Mutex<HashSet<(String, String)>>>;

/// A patch waiting its turn: its text, and the object it was made for.
struct Pending {
    body: Box<RawValue>,
    uid: Option<String>,
}

/// The handle keepers send patches to; the task ends when the last handle is dropped.
#[derive(Clone)]
pub struct Writer {
    tx: mpsc::UnboundedSender<Write>,
    client: Client,
    recorder: Recorder,
    failed: Failed,
    _task: Arc<AbortOnDrop>,
}

impl Writer {
    /// Starts the writer, sending at most `per_second` status writes a second; `subs` (the
    /// controllers' cache) gives each patch the version of its object to apply to.
    pub fn start(
        client: Client,
        metrics: Metrics,
        per_second: u32,
        subs: Store<Subscription>,
    ) -> Writer {
        let (tx, rx) = mpsc::unbounded_channel();
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "settle-account".into(),
                instance: None,
            },
        );
        let failed = Failed::default();
        let client_for_backends = client.clone();
        let task = tokio::spawn(serve(
            client,
            subs,
            metrics.clone(),
            per_second,
            rx,
            failed.clone(),
        ));
        Writer {
            tx,
            client: client_for_backends,
            recorder,
            failed,
            _task: Arc::new(AbortOnDrop(task, metrics)),
        }
    }

    pub fn send(&self, w: Write) {
        let _ = self.tx.send(w);
    }

    /// Whether the last write for `key` (namespace, name) failed since a keeper last asked;
    /// asking forgets it.
    pub fn failed(&self, key: &(String, String)) -> bool {
        self.failed
            .lock()
            .map(|mut f| f.remove(key))
            .unwrap_or(false)
    }

    /// Whether a failure of `key`'s last write is noted, without forgetting it.
    #[cfg(test)]
    pub(crate) fn failure_noted(&self, key: &(String, String)) -> bool {
        self.failed.lock().map(|f| f.contains(key)).unwrap_or(false)
    }

    /// Writes `want` as Backend `namespace/name`'s condition (server-side apply, field manager
    /// `settle-account`, in the background), unless the Backend shows it already; its
    /// `lastTransitionTime` moves only when its status changes. Outside the status budget: a
    /// keeper writes it only when what it says changed, at most once per round.
    pub fn backend_condition(&self, namespace: &str, name: &str, want: Want) {
        let api: Api<Backend> = Api::namespaced(self.client.clone(), namespace);
        let name = name.to_string();
        tokio::spawn(async move {
            let Ok(backend) = api.get(&name).await else {
                return;
            };
            let existing = backend
                .status
                .as_ref()
                .map(|s| s.conditions.clone())
                .unwrap_or_default();
            let now = Time(k8s_openapi::jiff::Timestamp::now());
            let ours = condition::settle(&existing, &want, backend.metadata.generation, &now);
            if condition::conditions_current(&existing, std::slice::from_ref(&ours)) {
                return;
            }
            let body = serde_json::json!({
                "apiVersion": "messaging.settle.dev/v1alpha1",
                "kind": "Backend",
                "status": {"conditions": [ours]},
            });
            if let Err(e) = api
                .patch_status(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&body),
                )
                .await
            {
                tracing::debug!(backend = %name, error = %e, "could not write the Backend's Accounted condition");
            }
        });
    }

    /// Records an Event on `sub` (in the background: a keeper never waits for it).
    pub fn event(&self, sub: &Subscription, warning: bool, reason: &str, note: String) {
        let ev = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.to_string(),
            note: Some(note),
            action: "Account".to_string(),
            secondary: None,
        };
        let (recorder, object) = (self.recorder.clone(), sub.object_ref(&()));
        tokio::spawn(async move {
            if let Err(e) = recorder.publish(&ev, &object).await {
                tracing::debug!(error = %e, "could not record an account Event");
            }
        });
    }
}

/// Status patches in flight at once: enough that a burst of Subscriptions due together is
/// written within a second or two, few enough to be gentle on the API server.
const CONCURRENCY: usize = 8;

async fn serve(
    client: Client,
    subs: Store<Subscription>,
    metrics: Metrics,
    per_second: u32,
    mut rx: mpsc::UnboundedReceiver<Write>,
    failed: Failed,
) {
    let mut queue: Queue<(String, String), Pending> = Queue::default();
    let mut bucket = Bucket::new(per_second, Instant::now());
    // When the budget last had no token for the next patch: a patch that waited since before
    // then was deferred by the budget.
    let mut refused_at: Option<Instant> = None;
    let mut inflight = FuturesUnordered::new();
    let mut open = true;
    loop {
        // Start what may start: one patch per Subscription at a time (the newest one), urgent
        // ones first, each with a token of the budget.
        let mut refill = None;
        while inflight.len() < CONCURRENCY && queue.ready() {
            let now = Instant::now();
            if let Err(wait) = bucket.take(now) {
                refused_at = Some(now);
                refill = Some(now + wait);
                break;
            }
            let Some((key, body, urgent, since)) = queue.pop() else {
                break;
            };
            if refused_at.is_some_and(|t| t >= since) {
                metrics.deferred.with_label_values(&["budget"]).inc();
            }
            inflight.push(write(
                client.clone(),
                subs.clone(),
                metrics.clone(),
                failed.clone(),
                key,
                body,
                urgent,
            ));
        }
        metrics
            .backlog
            .set(i64::try_from(queue.backlog()).unwrap_or(i64::MAX));
        if !open && inflight.is_empty() && queue.backlog() == 0 {
            return;
        }
        tokio::select! {
            w = rx.recv(), if open => match w {
                Some(w) => {
                    let key = (w.namespace, w.name);
                    // A JSON value always serializes; were it ever to fail, the patch is
                    // counted as a failed write, and the keeper sends it again next interval.
                    let body = match serde_json::value::to_raw_value(&w.body) {
                        Ok(body) => body,
                        Err(e) => {
                            metrics.writes.with_label_values(&["error"]).inc();
                            tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), error = %e, "could not serialize the account's status patch; it is written again at the next interval");
                            note_failed(&failed, key);
                            continue;
                        }
                    };
                    let pending = Pending { body, uid: w.uid };
                    if queue.push(key, pending, w.urgent, Instant::now()) == Pushed::Coalesced {
                        metrics.deferred.with_label_values(&["coalesced"]).inc();
                    }
                }
                None => open = false,
            },
            Some(key) = inflight.next(), if !inflight.is_empty() => {
                queue.done(&key);
            }
            () = sleep_until(refill), if refill.is_some() => {}
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    if let Some(at) = at {
        tokio::time::sleep_until(at).await;
    }
}

/// Notes that `key`'s write failed, for its keeper to send it again (at most [`MAX_FAILED`]).
fn note_failed(failed: &Failed, key: (String, String)) {
    if let Ok(mut f) = failed.lock()
        && f.len() < MAX_FAILED
    {
        f.insert(key);
    }
}

/// Writes `pending` to the object it was made for, at the version the cache holds (its
/// `resourceVersion` a precondition, which the status subresource honours where it ignores a
/// UID): a newer object of the same name is never written with an older one's account. The
/// object changed since the cache saw it: read again, and written once more if it is still that
/// object.
async fn write(
    client: Client,
    subs: Store<Subscription>,
    metrics: Metrics,
    failed: Failed,
    key: (String, String),
    pending: Pending,
    urgent: bool,
) -> (String, String) {
    let api: Api<Subscription> = Api::namespaced(client, &key.0);
    let mut version = subs
        .get(&ObjectRef::new(&key.1).within(&key.0))
        .map(|s| (s.metadata.uid.clone(), s.metadata.resource_version.clone()));
    let mut read_again = false;
    let result = loop {
        // Gone, or not yet in the cache: nothing to account for on it now.
        let Some((uid, resource_version)) = version.take() else {
            return key;
        };
        if pending.uid.is_some() && uid != pending.uid {
            metrics.writes.with_label_values(&["other_object"]).inc();
            return key;
        }
        let body = match at_version(&pending.body, resource_version.as_deref()) {
            Ok(body) => body,
            Err(e) => break Err(kube::Error::SerdeError(e)),
        };
        let result = api
            .patch_status(
                &key.1,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await;
        match result {
            Err(kube::Error::Api(s)) if s.code == 409 && !read_again => {
                read_again = true;
                metrics.writes.with_label_values(&["conflict"]).inc();
                version = match api.get_opt(&key.1).await {
                    Ok(found) => found.map(|s| (s.metadata.uid, s.metadata.resource_version)),
                    Err(e) => break Err(e),
                };
            }
            other => break other,
        }
    };
    match result {
        Ok(_) => {
            metrics.writes.with_label_values(&["ok"]).inc();
            if urgent {
                metrics.urgent_writes.inc();
            }
        }
        // Deleted meanwhile: nothing to account for any more.
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => {
            metrics.writes.with_label_values(&["error"]).inc();
            tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), error = %e, "could not write the account to status; it is written again at the next interval");
            note_failed(&failed, key.clone());
        }
    }
    key
}

/// `body` with `metadata.resourceVersion` set to `version` (none: as it is).
fn at_version(
    body: &RawValue,
    version: Option<&str>,
) -> Result<serde_json::Value, serde_json::Error> {
    let mut body: serde_json::Value = serde_json::from_str(body.get())?;
    if let (Some(v), Some(object)) = (version, body.as_object_mut()) {
        let metadata = object
            .entry("metadata")
            .or_insert_with(|| serde_json::json!({}));
        if let Some(m) = metadata.as_object_mut() {
            m.insert("resourceVersion".into(), v.into());
        }
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_noted_up_to_the_bound() {
        let failed = Failed::default();
        for i in 0..MAX_FAILED {
            note_failed(&failed, ("ns".into(), format!("s{i}")));
        }
        note_failed(&failed, ("ns".into(), "one-too-many".into()));
        let noted = |k: &str| {
            failed
                .lock()
                .map(|f| f.contains(&("ns".to_string(), k.to_string())))
                .unwrap_or(false)
        };
        assert!(noted("s0"));
        assert!(
            !noted("one-too-many"),
            "past the bound a failure is not noted"
        );
        assert_eq!(failed.lock().map(|f| f.len()).unwrap_or(0), MAX_FAILED);
    }
}
