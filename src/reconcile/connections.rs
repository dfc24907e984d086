//! One shared NATS connection per Backend, made by the Backend controller and used by the
//! Subscription controller. Each connection reconnects by itself; when it drops or comes back,
//! its Backend and that Backend's Subscriptions are reconciled (a restarted broker is
//! re-converged without an operator restart). Each connection also listens to the consumer
//! advisories, so a consumer deleted or edited on the broker is repaired within about a second.
//!
//! It must not decide what a consumer looks like or what status to write; it only holds
//! connections and turns broker events into reconcile triggers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures::StreamExt;
use futures::channel::mpsc::UnboundedSender;
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::task::JoinHandle;

use super::index;
use super::metrics::Metrics;
use crate::api::{Backend, Subscription};
use crate::backend::nats::advisory::{self, ChangeKind};
use crate::backend::nats::connect::{self, ConnectFailure, ConnectSpec};

/// A Backend, by namespace and name.
pub type Key = (String, String);

/// The operator's own consumer changes, each waiting for the one advisory it causes.
type OwnMarks = Arc<Mutex<HashMap<(ChangeKind, String, String), Instant>>>;

/// How long a mark of the operator's own consumer change waits for its advisory.
const OWN_MARK_TTL: Duration = Duration::from_secs(10);

/// A live connection to one Backend's broker.
pub struct Conn {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    fingerprint: u64,
    /// Consumer changes the operator made itself, each waiting for the one advisory it causes.
    own: OwnMarks,
    listener: JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

impl Conn {
    /// Whether the connection is up now (not reconnecting).
    pub fn connected(&self) -> bool {
        connect::is_connected(&self.client)
    }

    /// Notes that the operator itself is about to create or delete this consumer, so that the
    /// advisory it causes does not trigger a reconcile.
    pub fn mark_own(&self, kind: ChangeKind, stream: &str, consumer: &str) {
        let mut own = lock(&self.own);
        own.retain(|_, at| at.elapsed() < OWN_MARK_TTL);
        own.insert(
            (kind, stream.to_string(), consumer.to_string()),
            Instant::now(),
        );
    }
}

/// What the registry knows about one Backend's connection.
#[derive(Clone)]
pub enum Lookup {
    Up(Arc<Conn>),
    /// The last attempt failed; why.
    Failed(String),
    /// Not tried yet (the Backend controller has not reached it).
    Unknown,
}

enum Entry {
    Up(Arc<Conn>),
    Failed { fingerprint: u64, message: String },
}

/// Every Backend's connection, and where their events go.
pub struct Connections {
    entries: Mutex<HashMap<Key, Entry>>,
    /// The connection name the operator's clients announce (its own API calls are recognised by it
    /// in the audit advisory).
    pub client_name: String,
    subs: Store<Subscription>,
    sub_trigger: UnboundedSender<ObjectRef<Subscription>>,
    backend_trigger: UnboundedSender<ObjectRef<Backend>>,
    metrics: Metrics,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Connections {
    pub fn new(
        client_name: String,
        subs: Store<Subscription>,
        sub_trigger: UnboundedSender<ObjectRef<Subscription>>,
        backend_trigger: UnboundedSender<ObjectRef<Backend>>,
        metrics: Metrics,
    ) -> Arc<Connections> {
        Arc::new(Connections {
            entries: Mutex::default(),
            client_name,
            subs,
            sub_trigger,
            backend_trigger,
            metrics,
        })
    }

    pub fn get(&self, key: &Key) -> Lookup {
        match lock(&self.entries).get(key) {
            Some(Entry::Up(c)) => Lookup::Up(c.clone()),
            Some(Entry::Failed { message, .. }) => Lookup::Failed(message.clone()),
            None => Lookup::Unknown,
        }
    }

    /// Drops a Backend's connection (the Backend is gone).
    pub fn remove(&self, key: &Key) {
        let gone = lock(&self.entries).remove(key);
        if gone.is_some() {
            tracing::info!(backend = %format!("{}/{}", key.0, key.1), "closed the connection of a deleted Backend");
        }
    }

    /// Records that connecting failed without a spec to connect with (a missing Secret): the
    /// Backend's Subscriptions say why.
    pub fn fail(&self, key: &Key, message: String) {
        lock(&self.entries).insert(
            key.clone(),
            Entry::Failed {
                fingerprint: 0,
                message,
            },
        );
    }

    /// The connection for `spec`: the existing one when it was made from the same spec, else a
    /// new one (the old one, made from an old Secret, is dropped).
    pub async fn ensure(
        self: &Arc<Self>,
        key: &Key,
        spec: &ConnectSpec,
    ) -> Result<Arc<Conn>, ConnectFailure> {
        let fingerprint = spec.fingerprint();
        let had = match lock(&self.entries).get(key) {
            Some(Entry::Up(c)) if c.fingerprint == fingerprint => return Ok(c.clone()),
            Some(Entry::Up(_)) => true,
            Some(Entry::Failed { .. }) | None => false,
        };
        if had {
            tracing::info!(backend = %format!("{}/{}", key.0, key.1), "the Backend's spec or Secret changed: reconnecting");
        }
        let events = Arc::downgrade(self);
        let event_key = key.clone();
        let client = match connect::connect(spec, move |event| {
            if let Some(conns) = events.upgrade() {
                conns.on_event(&event_key, &event);
            }
        })
        .await
        {
            Ok(c) => c,
            Err(e) => {
                let message = e.to_string();
                lock(&self.entries).insert(
                    key.clone(),
                    Entry::Failed {
                        fingerprint,
                        message,
                    },
                );
                return Err(e);
            }
        };
        let own: OwnMarks = Arc::default();
        let listener = tokio::spawn(listen(
            Arc::downgrade(self),
            key.clone(),
            client.clone(),
            own.clone(),
        ));
        let conn = Arc::new(Conn {
            js: jetstream::new(client.clone()),
            client,
            fingerprint,
            own,
            listener,
        });
        lock(&self.entries).insert(key.clone(), Entry::Up(conn.clone()));
        Ok(conn)
    }

    /// Whether the last failure for `key` was for this very spec (nothing changed since).
    pub fn failed_with(&self, key: &Key, spec: &ConnectSpec) -> bool {
        matches!(lock(&self.entries).get(key), Some(Entry::Failed { fingerprint, .. }) if *fingerprint == spec.fingerprint())
    }

    fn on_event(&self, key: &Key, event: &async_nats::Event) {
        match event {
            async_nats::Event::Connected | async_nats::Event::Disconnected => {
                tracing::info!(backend = %format!("{}/{}", key.0, key.1), %event, "NATS connection event: re-checking the Backend and its Subscriptions");
                self.metrics
                    .triggers
                    .with_label_values(&[if matches!(event, async_nats::Event::Connected) {
                        "reconnect"
                    } else {
                        "disconnect"
                    }])
                    .inc();
                let _ = self
                    .backend_trigger
                    .unbounded_send(ObjectRef::new(&key.1).within(&key.0));
                self.trigger_all(key);
            }
            other => {
                tracing::debug!(backend = %format!("{}/{}", key.0, key.1), event = %other, "NATS connection event")
            }
        }
    }

    /// Reconciles every Subscription of Backend `key`.
    pub fn trigger_all(&self, key: &Key) {
        let state = self.subs.state();
        for s in index::subscriptions_of(state.iter().map(AsRef::as_ref), &key.0, &key.1) {
            let _ = self.sub_trigger.unbounded_send(ObjectRef::from_obj(s));
        }
    }

    fn on_change(&self, key: &Key, change: &advisory::ConsumerChange) {
        let state = self.subs.state();
        for s in index::owners_of_consumer(
            state.iter().map(AsRef::as_ref),
            &key.0,
            &key.1,
            &change.stream,
            &change.consumer,
        ) {
            tracing::info!(subscription = %format!("{}/{}", key.0, s.metadata.name.as_deref().unwrap_or("")), stream = %change.stream, consumer = %change.consumer, change = ?change.kind, "the consumer changed on the broker: re-checking it");
            self.metrics.triggers.with_label_values(&["advisory"]).inc();
            let _ = self.sub_trigger.unbounded_send(ObjectRef::from_obj(s));
        }
    }
}

/// Listens to the consumer advisories on one connection until the connection is dropped.
async fn listen(
    conns: std::sync::Weak<Connections>,
    key: Key,
    client: async_nats::Client,
    own: OwnMarks,
) {
    let mut subs = Vec::new();
    for subject in [
        advisory::CONSUMER_DELETED,
        advisory::CONSUMER_CREATED,
        advisory::API_AUDIT,
    ] {
        match client.subscribe(subject).await {
            Ok(s) => subs.push(s),
            Err(e) => {
                tracing::warn!(backend = %format!("{}/{}", key.0, key.1), %subject, error = %e, "cannot listen to consumer advisories: drift is repaired only by the periodic resync");
            }
        }
    }
    let mut all = futures::stream::select_all(subs);
    while let Some(msg) = all.next().await {
        let Some(change) = advisory::parse(msg.subject.as_str(), &msg.payload) else {
            continue;
        };
        let Some(conns) = conns.upgrade() else {
            return;
        };
        let own_write = match change.kind {
            ChangeKind::Written => change.client.as_deref() == Some(conns.client_name.as_str()),
            kind => {
                let mut own = lock(&own);
                own.remove(&(kind, change.stream.clone(), change.consumer.clone()))
                    .is_some_and(|at| at.elapsed() < OWN_MARK_TTL)
            }
        };
        if !own_write {
            conns.on_change(&key, &change);
        }
    }
}
