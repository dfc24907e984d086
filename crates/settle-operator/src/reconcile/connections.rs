//! One shared connection per Backend, whatever its kind, made by the Backend controller and
//! used by the Subscription controller (and, through [`Connections::get`], by the account):
//!
//! - NATS: a client that reconnects by itself and listens to the consumer advisories, so a
//!   consumer deleted or edited on the broker is repaired within about a second;
//! - RabbitMQ: an AMQP connection, made again on the next use after it drops (its drop
//!   reconciles the Backend and its Subscriptions), and a management API client;
//! - SQS: a client (HTTP; nothing to keep open).
//!
//! When a connection drops or comes back, its Backend and that Backend's Subscriptions are
//! reconciled (a restarted broker is re-converged without an operator restart). Kinds without
//! broker events (RabbitMQ without plugins, SQS) are re-checked on the drift interval instead.
//!
//! It must not decide what a consumer or queue looks like or what status to write; it only holds
//! connections and turns broker events into reconcile triggers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures::StreamExt;
use futures::channel::mpsc::UnboundedSender;
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::task::JoinHandle;

use super::gate::Gates;
use super::index;
use super::metrics::Metrics;
use super::redial::Redial;
use settle::api::{Backend, Subscription};
use settle::backend::nats::advisory::{self, ChangeKind};
use settle::backend::nats::connect::{self, ConnectFailure, ConnectSpec};
use settle::backend::rabbitmq::connect::{self as amqp, RabbitConnectSpec};
use settle::backend::rabbitmq::management::Management;
use settle::backend::rabbitmq::mapping::Exchanges;
use settle::backend::sqs::{SqsBroker, SqsSettings};

/// A Backend, by namespace and name.
pub type Key = (String, String);

/// The operator's own consumer changes, each waiting for the one advisory it causes.
type OwnMarks = Arc<Mutex<HashMap<(ChangeKind, String, String), Instant>>>;

/// How long a mark of the operator's own consumer change waits for its advisory.
const OWN_MARK_TTL: Duration = Duration::from_secs(10);

/// How long a consumer this connection made is remembered as made, for a Subscription whose
/// status does not show it yet: a check of it that runs before the status write reaches the
/// controller's cache reads the consumer instead of making it again (and saying so twice).
const MADE_TTL: Duration = Duration::from_secs(30);

/// A live connection to one Backend's broker, by kind.
// One per Backend, behind an Arc: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum Conn {
    Nats(NatsConn),
    Rabbitmq(RabbitConn),
    Sqs(SqsConn),
}

/// A NATS client and its advisory listener.
pub struct NatsConn {
    pub client: async_nats::Client,
    /// This connection among all the process made (a new one, from a changed spec, has another):
    /// the account starts its session again when a Backend's number changes.
    pub serial: u64,
    pub js: jetstream::Context,
    /// Consumer changes the operator made itself, each waiting for the one advisory it causes.
    own: OwnMarks,
    /// Consumers made through this connection in the last [`MADE_TTL`].
    made: Mutex<MadeNotes>,
    listener: JoinHandle<()>,
}

impl Drop for NatsConn {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

/// A RabbitMQ Backend's AMQP connection (made again on the next use after it drops) and its
/// management API client.
pub struct RabbitConn {
    spec: RabbitConnectSpec,
    current: tokio::sync::Mutex<Option<(Arc<lapin::Connection>, JoinHandle<()>)>>,
    /// The management API, when the Backend names one (spec.rabbitmq.managementUrl).
    pub management: Option<Management>,
    /// The vhost queues live in.
    pub vhost: String,
    /// Where queues are bound and exhausted messages go.
    pub exchanges: Exchanges,
    conns: Weak<Connections>,
    key: Key,
    /// Queues whose running marker (`settle.running.<queue>`, semantics W3) this connection
    /// made: each is made once per connection, not on every check.
    pub running_marked: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Queues the management API showed without a state: since when, and when last (each is
    /// removed once shown with one, or not shown for 10 minutes).
    pub stateless: std::sync::Mutex<
        std::collections::HashMap<String, (std::time::Instant, std::time::Instant)>,
    >,
    /// Whether the broker keeps no statistics (read once): then no queue shows a state, and
    /// none is judged by its lack of one.
    pub stats_disabled: std::sync::Mutex<Option<bool>>,
    /// When a dropped connection may be made again.
    redial: Arc<Mutex<Redial>>,
}

impl Drop for RabbitConn {
    fn drop(&mut self) {
        if let Some((c, listener)) = self.current.get_mut().take() {
            listener.abort();
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = c.close(200, "the Backend changed or is gone".into()).await;
                });
            }
        }
    }
}

impl RabbitConn {
    /// The AMQP connection, made again first when it dropped.
    pub async fn connection(&self) -> Result<Arc<lapin::Connection>, amqp::ConnectFailure> {
        let mut slot = self.current.lock().await;
        if let Some((c, _)) = slot.as_ref()
            && c.status().connected()
        {
            return Ok(c.clone());
        }
        let backend = format!("{}/{}", self.key.0, self.key.1);
        if let Some((_, listener)) = slot.take() {
            listener.abort();
            lock(&self.redial).dropped(Instant::now());
            tracing::info!(%backend, "the AMQP connection dropped: connecting again");
        }
        if let Some(soon) = lock(&self.redial).too_soon(Instant::now()) {
            tracing::debug!(%backend, drops = soon.drops, retry_in = ?soon.retry_in, "the AMQP connection keeps dropping: not connecting yet");
            return Err(amqp::ConnectFailure::Unsteady {
                drops: soon.drops,
                pause: soon.pause,
                last_error: soon.last_error,
            });
        }
        let c = Arc::new(amqp::connect(&self.spec).await?);
        lock(&self.redial).made(Instant::now());
        let mut events = c.events_listener();
        let (conns, key, weak) = (self.conns.clone(), self.key.clone(), Arc::downgrade(&c));
        let redial = self.redial.clone();
        let listener = tokio::spawn(async move {
            while let Some(ev) = events.next().await {
                if let lapin::Event::Error(e) = ev {
                    // A channel the broker closed (a refused declare, a missing queue) reports
                    // here too; only a connection that is no longer up is a drop.
                    if weak.upgrade().is_some_and(|c| c.status().connected()) {
                        tracing::debug!(backend = %format!("{}/{}", key.0, key.1), error = %e, "an AMQP channel closed; the connection is up");
                        continue;
                    }
                    lock(&redial).closed_because(e.to_string());
                    tracing::warn!(backend = %format!("{}/{}", key.0, key.1), error = %e, "the AMQP connection failed: re-checking the Backend and its Subscriptions");
                    if let Some(conns) = conns.upgrade() {
                        conns.dropped(&key, "disconnect");
                    }
                    return;
                }
            }
        });
        *slot = Some((c.clone(), listener));
        Ok(c)
    }
}

/// An SQS Backend's client (its queue prefix included).
pub struct SqsConn {
    pub broker: SqsBroker,
}

impl NatsConn {
    /// Whether the connection is up now (not reconnecting).
    pub fn connected(&self) -> bool {
        connect::is_connected(&self.client)
    }

    /// Notes that this consumer was just made through this connection.
    pub fn note_made(&self, stream: &str, consumer: &str) {
        lock(&self.made).note(stream, consumer, Instant::now());
    }

    /// Forgets that this consumer was made here: status shows it now, and the note served only
    /// until then.
    pub fn made_shown(&self, stream: &str, consumer: &str) {
        lock(&self.made).shown(stream, consumer);
    }

    /// Whether this consumer was made through this connection in the last [`MADE_TTL`].
    pub fn made_recently(&self, stream: &str, consumer: &str) -> bool {
        lock(&self.made).recently(stream, consumer, Instant::now())
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

/// Consumers made through one connection, by (stream, name), each until status shows it or for
/// [`MADE_TTL`], whichever comes first.
#[derive(Default)]
struct MadeNotes(HashMap<(String, String), Instant>);

impl MadeNotes {
    fn note(&mut self, stream: &str, consumer: &str, now: Instant) {
        self.0
            .retain(|_, at| now.saturating_duration_since(*at) < MADE_TTL);
        self.0
            .insert((stream.to_string(), consumer.to_string()), now);
    }

    /// Forgets a note; the map gives back the room a mass apply grew (it would otherwise keep a
    /// note, or room for one, per Subscription made, issue: scale).
    fn shown(&mut self, stream: &str, consumer: &str) {
        if self.0.capacity() == 0 {
            return;
        }
        self.0.remove(&(stream.to_string(), consumer.to_string()));
        if self.0.len() <= self.0.capacity() / 4 {
            self.0.shrink_to_fit();
        }
    }

    fn recently(&self, stream: &str, consumer: &str, now: Instant) -> bool {
        self.0
            .get(&(stream.to_string(), consumer.to_string()))
            .is_some_and(|at| now.saturating_duration_since(*at) < MADE_TTL)
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
    Up {
        conn: Arc<Conn>,
        fingerprint: u64,
    },
    Failed {
        fingerprint: u64,
        message: String,
        /// The connection held when its Secret went missing, and since when: kept only for the
        /// Subscriptions' deletions (a namespace deletion may take the Secret first), never for
        /// anything else, and closed by [`Connections::close_retired`].
        retired: Option<(Arc<Conn>, Instant)>,
    },
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
    /// Each Backend's gates on creates its broker refused for a limit; a consumer deleted on the
    /// broker opens them, a reconnect drops them.
    pub gates: Gates,
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
            gates: Gates::new(sub_trigger.clone(), metrics.clone()),
            sub_trigger,
            backend_trigger,
            metrics,
        })
    }

    /// Backend `key`'s connection (the account reads queue gauges through it).
    pub fn get(&self, key: &Key) -> Lookup {
        match lock(&self.entries).get(key) {
            Some(Entry::Up { conn, .. }) => Lookup::Up(conn.clone()),
            Some(Entry::Failed { message, .. }) => Lookup::Failed(message.clone()),
            None => Lookup::Unknown,
        }
    }

    /// Backend `key`'s connection to delete consumers with: the one in use, or the one held when
    /// its Secret went missing.
    pub fn get_for_deletion(&self, key: &Key) -> Lookup {
        match lock(&self.entries).get(key) {
            Some(Entry::Failed {
                retired: Some((conn, _)),
                ..
            }) => Lookup::Up(conn.clone()),
            Some(Entry::Up { conn, .. }) => Lookup::Up(conn.clone()),
            Some(Entry::Failed { message, .. }) => Lookup::Failed(message.clone()),
            None => Lookup::Unknown,
        }
    }

    /// Closes the connection kept for deletions once it has been kept `longer_than`.
    pub fn close_retired(&self, key: &Key, longer_than: Duration) {
        if let Some(Entry::Failed { retired, .. }) = lock(&self.entries).get_mut(key)
            && retired
                .as_ref()
                .is_some_and(|(_, since)| since.elapsed() > longer_than)
        {
            *retired = None;
            tracing::info!(backend = %format!("{}/{}", key.0, key.1), "closed the connection kept for deletions after its Secret went missing");
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
    /// Backend's Subscriptions say why. The connection it held is kept for their deletions only
    /// ([`Connections::get_for_deletion`]); [`Connections::remove`] first drops it as well.
    pub fn fail(&self, key: &Key, message: String) {
        let mut entries = lock(&self.entries);
        let retired = match entries.remove(key) {
            Some(Entry::Up { conn, .. }) => Some((conn, Instant::now())),
            Some(Entry::Failed { retired, .. }) => retired,
            None => None,
        };
        entries.insert(
            key.clone(),
            Entry::Failed {
                fingerprint: 0,
                message,
                retired,
            },
        );
    }

    /// The connection made from `fingerprint`, if that is the one held; else notes (once) that
    /// the spec or Secret changed.
    fn current(&self, key: &Key, fingerprint: u64) -> Option<Arc<Conn>> {
        let had = match lock(&self.entries).get(key) {
            Some(Entry::Up {
                conn,
                fingerprint: f,
            }) if *f == fingerprint => {
                return Some(conn.clone());
            }
            Some(Entry::Up { .. }) => true,
            Some(Entry::Failed { .. }) | None => false,
        };
        if had {
            tracing::info!(backend = %format!("{}/{}", key.0, key.1), "the Backend's spec or Secret changed: reconnecting");
        }
        None
    }

    fn up(&self, key: &Key, fingerprint: u64, conn: Conn) -> Arc<Conn> {
        let conn = Arc::new(conn);
        lock(&self.entries).insert(
            key.clone(),
            Entry::Up {
                conn: conn.clone(),
                fingerprint,
            },
        );
        conn
    }

    fn failed(&self, key: &Key, fingerprint: u64, message: String) {
        lock(&self.entries).insert(
            key.clone(),
            Entry::Failed {
                fingerprint,
                message,
                retired: None,
            },
        );
    }

    /// The RabbitMQ connection for `spec`: the existing one when it was made from the same spec,
    /// else a new one (connected once now, so a failure is reported at once).
    pub async fn ensure_rabbitmq(
        self: &Arc<Self>,
        key: &Key,
        spec: &RabbitConnectSpec,
    ) -> Result<Arc<Conn>, amqp::ConnectFailure> {
        let fingerprint = spec.fingerprint();
        if let Some(c) = self.current(key, fingerprint) {
            return Ok(c);
        }
        let management = match &spec.management_url {
            None => None,
            Some(url) => {
                let c = spec.effective_credentials();
                match Management::new(url, &c.username, &c.password, spec.ca_pem.as_deref()) {
                    Ok(m) => Some(m),
                    Err(e) => {
                        let f = amqp::ConnectFailure::BadConfig(e.to_string());
                        self.failed(key, fingerprint, f.to_string());
                        return Err(f);
                    }
                }
            }
        };
        let conn = RabbitConn {
            vhost: spec.effective_vhost(),
            exchanges: spec.exchanges.clone(),
            spec: spec.clone(),
            current: tokio::sync::Mutex::default(),
            management,
            conns: Arc::downgrade(self),
            key: key.clone(),
            running_marked: std::sync::Mutex::default(),
            stateless: std::sync::Mutex::default(),
            stats_disabled: std::sync::Mutex::default(),
            redial: Arc::default(),
        };
        if let Err(e) = conn.connection().await {
            self.failed(key, fingerprint, e.to_string());
            return Err(e);
        }
        Ok(self.up(key, fingerprint, Conn::Rabbitmq(conn)))
    }

    /// The SQS client for `settings`: the existing one when made from the same settings.
    pub async fn ensure_sqs(
        self: &Arc<Self>,
        key: &Key,
        settings: &SqsSettings,
    ) -> Result<Arc<Conn>, String> {
        let fingerprint = settings.fingerprint();
        if let Some(c) = self.current(key, fingerprint) {
            return Ok(c);
        }
        match SqsBroker::connect(settings.clone()).await {
            Ok(broker) => Ok(self.up(key, fingerprint, Conn::Sqs(SqsConn { broker }))),
            Err(e) => {
                self.failed(key, fingerprint, e.to_string());
                Err(e.to_string())
            }
        }
    }

    /// The NATS connection for `spec`: the existing one when it was made from the same spec,
    /// else a new one (the old one, made from an old Secret, is dropped).
    pub async fn ensure(
        self: &Arc<Self>,
        key: &Key,
        spec: &ConnectSpec,
    ) -> Result<Arc<Conn>, ConnectFailure> {
        let fingerprint = spec.fingerprint();
        if let Some(c) = self.current(key, fingerprint) {
            return Ok(c);
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
                self.failed(key, fingerprint, e.to_string());
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
        static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let conn = Conn::Nats(NatsConn {
            js: jetstream::new(client.clone()),
            client,
            serial: SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            own,
            made: Mutex::default(),
            listener,
        });
        Ok(self.up(key, fingerprint, conn))
    }

    /// Whether the last failure for `key` was for this very spec (nothing changed since).
    pub fn failed_with(&self, key: &Key, spec: &ConnectSpec) -> bool {
        matches!(lock(&self.entries).get(key), Some(Entry::Failed { fingerprint, .. }) if *fingerprint == spec.fingerprint())
    }

    /// A connection dropped or came back (`source`: disconnect, reconnect): the Backend and its
    /// Subscriptions are checked again, and its gates go (a restarted broker may allow more).
    fn dropped(&self, key: &Key, source: &str) {
        self.metrics.triggers.with_label_values(&[source]).inc();
        self.gates.drop_backend(key);
        let _ = self
            .backend_trigger
            .unbounded_send(ObjectRef::new(&key.1).within(&key.0));
        self.trigger_all(key);
    }

    fn on_event(&self, key: &Key, event: &async_nats::Event) {
        match event {
            async_nats::Event::Connected | async_nats::Event::Disconnected => {
                tracing::info!(backend = %format!("{}/{}", key.0, key.1), %event, "NATS connection event: re-checking the Backend and its Subscriptions");
                self.dropped(
                    key,
                    if matches!(event, async_nats::Event::Connected) {
                        "reconnect"
                    } else {
                        "disconnect"
                    },
                );
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
        advisory::STREAM_UPDATED,
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
        // A stream updated (its max_consumers raised, perhaps): a refused create may go now.
        if let Some(stream) = advisory::updated_stream(msg.subject.as_str()) {
            if let Some(conns) = conns.upgrade() {
                conns.gates.freed(&key, Some(stream));
            }
            continue;
        }
        let Some(change) = advisory::parse(msg.subject.as_str(), &msg.payload) else {
            continue;
        };
        let Some(conns) = conns.upgrade() else {
            return;
        };
        // A consumer gone from the stream, whoever deleted it: a place for a refused create.
        if change.kind == ChangeKind::Deleted {
            conns.gates.freed(&key, Some(&change.stream));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_made_consumer_is_remembered_until_status_shows_it_or_the_note_is_old() {
        let t0 = Instant::now();
        let mut made = MadeNotes::default();
        made.note("S", "a", t0);
        made.note("S", "b", t0);
        assert!(made.recently("S", "a", t0 + Duration::from_secs(1)));
        assert!(!made.recently("T", "a", t0), "another stream's consumer");
        made.shown("S", "a");
        assert!(
            !made.recently("S", "a", t0),
            "forgotten once status shows it"
        );
        assert!(made.recently("S", "b", t0));
        assert!(
            !made.recently("S", "b", t0 + MADE_TTL),
            "an old note is no note"
        );
        // The next note drops the old ones.
        made.note("S", "c", t0 + MADE_TTL);
        assert_eq!(made.0.len(), 1);
    }

    #[test]
    fn a_mass_apply_shown_gives_the_room_back() {
        let t0 = Instant::now();
        let mut made = MadeNotes::default();
        for i in 0..5_000 {
            made.note("S", &format!("c{i}"), t0);
        }
        let grown = made.0.capacity();
        for i in 0..5_000 {
            made.shown("S", &format!("c{i}"));
        }
        assert!(
            grown >= 5_000 && made.0.capacity() < 64,
            "room for {grown}, then {}",
            made.0.capacity()
        );
    }
}
