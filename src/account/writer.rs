//! The one status writer of the account: every keeper hands it patches; it applies them with
//! server-side apply (field manager `settle-account`, owning `status.stats`,
//! `statsUpdatedAt` and the `Exhausting`/`Stranding` conditions, never the controllers' fields),
//! a few at once but one at a time per Subscription, and when several patches for one
//! Subscription wait, only the newest is sent.
//!
//! It also records the account's Kubernetes Events (a ledger that cannot be saved, and saved
//! again), so the account reaches the API server through this one place.
//!
//! How often a Subscription is written is the keeper's decision (at most once per stats
//! interval, only on change); this module must not compute status.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client, Resource};
use tokio::sync::mpsc;

use super::metrics::Metrics;
use super::status::FIELD_MANAGER;
use crate::api::Subscription;

/// One status patch for one Subscription.
pub struct Write {
    pub namespace: String,
    pub name: String,
    pub body: serde_json::Value,
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The handle keepers send patches to; the task ends when the last handle is dropped.
#[derive(Clone)]
pub struct Writer {
    tx: mpsc::UnboundedSender<Write>,
    recorder: Recorder,
    _task: Arc<AbortOnDrop>,
}

impl Writer {
    pub fn start(client: Client, metrics: Metrics) -> Writer {
        let (tx, rx) = mpsc::unbounded_channel();
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "settle-account".into(),
                instance: None,
            },
        );
        let task = tokio::spawn(serve(client, metrics, rx));
        Writer {
            tx,
            recorder,
            _task: Arc::new(AbortOnDrop(task)),
        }
    }

    pub fn send(&self, w: Write) {
        let _ = self.tx.send(w);
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

async fn serve(client: Client, metrics: Metrics, mut rx: mpsc::UnboundedReceiver<Write>) {
    let mut order: VecDeque<(String, String)> = VecDeque::new();
    let mut waiting: HashMap<(String, String), serde_json::Value> = HashMap::new();
    let mut busy: HashSet<(String, String)> = HashSet::new();
    let mut inflight = FuturesUnordered::new();
    let mut open = true;
    loop {
        // Start what may start: one patch per Subscription at a time, the newest one.
        while inflight.len() < CONCURRENCY {
            let Some(i) = order.iter().position(|k| !busy.contains(k)) else {
                break;
            };
            let Some(key) = order.remove(i) else { break };
            let Some(body) = waiting.remove(&key) else {
                continue;
            };
            busy.insert(key.clone());
            inflight.push(write(client.clone(), metrics.clone(), key, body));
        }
        if !open && inflight.is_empty() {
            return;
        }
        tokio::select! {
            w = rx.recv(), if open => match w {
                Some(w) => take(&mut order, &mut waiting, w),
                None => open = false,
            },
            Some(key) = inflight.next(), if !inflight.is_empty() => {
                busy.remove(&key);
            }
        }
    }
}

async fn write(
    client: Client,
    metrics: Metrics,
    key: (String, String),
    body: serde_json::Value,
) -> (String, String) {
    let api: Api<Subscription> = Api::namespaced(client, &key.0);
    let result = api
        .patch_status(
            &key.1,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await;
    match result {
        Ok(_) => metrics.writes.with_label_values(&["ok"]).inc(),
        // Deleted meanwhile: nothing to account for any more.
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => {
            metrics.writes.with_label_values(&["error"]).inc();
            tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), error = %e, "could not write the account to status; it is written again at the next interval");
        }
    }
    key
}

fn take(
    order: &mut VecDeque<(String, String)>,
    waiting: &mut HashMap<(String, String), serde_json::Value>,
    w: Write,
) {
    let key = (w.namespace, w.name);
    if waiting.insert(key.clone(), w.body).is_none() {
        order.push_back(key);
    }
}
