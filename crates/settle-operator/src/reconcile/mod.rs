//! The controllers: every Backend gets one live connection and an honest `Ready`; every
//! Subscription becomes a consumer on its broker (a JetStream consumer, a RabbitMQ quorum queue,
//! an SQS queue) and stays one through faults (deleted or edited on the broker, a broker
//! restart, an operator restart or a change of leader).
//!
//! - [`backend`]: the Backend controller (Secrets → connection → status), every kind.
//! - [`subscription`]: the Subscription controller (validate → broker → status), one pipeline;
//!   its broker step by kind in [`nats`], [`rabbitmq`] and [`sqs`].
//! - [`connections`]: one shared connection per Backend, and the broker events that trigger reconciles.
//! - [`gate`]: after a broker refused a create for one of its limits, further creates held by
//!   that limit wait (one probe after a growing delay), so a full stream costs the broker nothing.
//! - [`status`], [`conditions`], [`index`]: the pure parts (each outcome, one per meaning for
//!   every kind, and the status it means; reasons; which object a change concerns).
//!
//! [`run`] runs both controllers while this replica leads, and stops them when it does not. A
//! Ready Subscription is re-checked by one resync walk over the cache (`resync_walk`), not by a
//! requeue of its own (which kube-runtime's scheduler would hold for every one at rest).
//! This module imports `backend`, `bus`, `policy` and `api` only, never `admission` or
//! `operator`: the operator hands it the leader's gate as a plain channel.

pub mod backend;
pub mod backend_finalizer;
pub mod backend_limit;
pub mod conditions;
pub mod connections;
pub mod gate;
pub mod index;
pub mod metrics;
pub mod nats;
pub mod rabbitmq;
pub mod redial;
pub mod shared_vhost;
pub mod sqs;
pub mod status;
pub mod step;
pub mod subscription;
mod term;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::events::{Recorder, Reporter};
use futures::channel::{mpsc, oneshot};
use futures::{FutureExt, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::watch;

use connections::Connections;
pub use metrics::Metrics;
use settle::api::{Backend, Subscription};
use settle::backend::QueueGauges;
pub use step::AdoptNamespaces;

/// The field manager of every status write the controllers make.
pub const FIELD_MANAGER: &str = "settle-reconcile";

/// How the controllers run (the operator's flags).
#[derive(Clone, Debug)]
pub struct Config {
    /// Namespaces whose Backends and Subscriptions are reconciled; empty: all.
    pub watch_namespaces: Vec<String>,
    /// Every consumer and connection is re-checked this often (the safety net under the advisories).
    pub resync: Duration,
    /// Subscriptions on kinds without broker events (RabbitMQ, SQS) are re-checked this often,
    /// so a queue deleted or changed on the broker is repaired.
    pub drift: Duration,
    /// How long a deleted Backend waits for its Subscriptions' deletions (`--backend-deletion-grace`).
    pub backend_deletion_grace: Duration,
    /// Backends connected in one namespace at most (`--max-backends-per-namespace`).
    pub max_backends_per_namespace: u16,
    /// Subscriptions reconciled at once.
    pub concurrency: u16,
    /// This replica's name (Events' reporting instance, and the NATS connection name).
    pub identity: String,
    /// What Backends may name (Secret opt-in, broker hosts, SQS pod identity), re-checked
    /// before any Secret is read into a connection (docs/semantics.md A18–A20).
    pub backend_rules: settle::policy::BackendRules,
    /// A RabbitMQ Backend's dead-letter copy queue holds at most this many copies (set when
    /// the queue is made).
    pub dead_letter_copy_max_length: i64,
    /// The namespaces whose Subscriptions may take over what Settle did not make
    /// (`--adopt-namespaces`).
    pub adopt_namespaces: step::AdoptNamespaces,
}

/// Why one reconcile failed (it is tried again with a growing delay).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("the broker refused: {0}")]
    Broker(String),
    #[error("waiting for the broker: {0}")]
    Waiting(String),
}

impl Error {
    /// What kind of failure it is: the `result` label of `settle_reconcile_total`.
    pub fn category(&self) -> &'static str {
        match self {
            Error::Kube(_) => metrics::RESULT_KUBE,
            Error::Broker(_) => metrics::RESULT_BROKER,
            Error::Waiting(_) => metrics::RESULT_WAITING,
        }
    }
}

/// Resolves once `store` holds its first list (or its writer is gone). kube's readiness wakes
/// only the task that polled it last, so with several waiters (the term's readiness, every
/// Subscription reconciled at a term's start) the others would wait for ever: each waiter
/// polls again every 200 ms instead.
pub(crate) async fn cache_ready<K>(store: &Store<K>)
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    while tokio::time::timeout(Duration::from_millis(200), store.wait_until_ready())
        .await
        .is_err()
    {}
}

/// What every reconcile shares.
pub struct Ctx {
    pub client: Client,
    pub conns: Arc<Connections>,
    pub backends: Store<Backend>,
    /// The Subscriptions, from the controller's cache (a deleted Backend waits for those that
    /// name it).
    pub subs: Store<Subscription>,
    pub metrics: Metrics,
    pub recorder: Recorder,
    pub resync: Duration,
    pub drift: Duration,
    pub backend_deletion_grace: Duration,
    pub max_backends_per_namespace: u16,
    /// What Backends may name; the Backend controller re-checks it before it connects.
    pub backend_rules: settle::policy::BackendRules,
    /// The dead-letter copy queue's bound (`--dead-letter-copy-max-length`).
    pub dead_letter_copy_max_length: i64,
    /// The namespaces whose Subscriptions may take over what Settle did not make.
    pub adopt_namespaces: step::AdoptNamespaces,
    failures: Mutex<HashMap<String, u32>>,
}

impl Ctx {
    /// One more failure for `key`: the delay before the next try (0.5 s, doubling, up to `max`).
    pub fn failed(&self, key: &str, max: Duration) -> Duration {
        let mut f = self
            .failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = f.entry(key.to_string()).or_insert(0);
        *n = n.saturating_add(1);
        retry_delay(*n, max)
    }

    /// `key` is healthy again: its next failure starts over.
    pub fn succeeded(&self, key: &str) {
        self.failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(key);
    }
}

/// The delay before try `failures + 1`: 0.5 s after the first failure, doubling, at most `max`.
pub fn retry_delay(failures: u32, max: Duration) -> Duration {
    Duration::from_millis(250)
        .saturating_mul(1u32 << failures.clamp(1, 16))
        .min(max)
}

/// Whether the controllers' caches have synced: true while this replica does not lead (it has
/// nothing to sync), false from the moment it leads until its caches have their first list.
#[derive(Clone, Debug)]
pub struct Readiness(Arc<AtomicBool>);

impl Default for Readiness {
    fn default() -> Self {
        Readiness(Arc::new(AtomicBool::new(true)))
    }
}

impl Readiness {
    pub fn ready(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
    fn set(&self, v: bool) {
        self.0.store(v, Ordering::SeqCst)
    }
}

/// What a leadership term shares with the rest of the operator (the account): the controllers'
/// caches, and each Backend's live broker handles by namespace and name.
pub use settle::backend::Term;
pub use settle::backend::{AmqpLookup, NatsLookup, QueueLookup};

/// Work that runs beside the controllers for each leadership term, and stops with it.
pub type TermHook = Arc<dyn Fn(Term) -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// Runs the controllers whenever `leader` says this replica leads, until `shutdown` resolves (then
/// in-flight reconciles finish first). `beside` runs with them, term by term.
pub async fn run(
    client: Client,
    config: Config,
    mut leader: watch::Receiver<bool>,
    metrics: Metrics,
    readiness: Readiness,
    beside: Option<TermHook>,
    shutdown: impl Future<Output = ()>,
) {
    let shutdown = shutdown.shared();
    loop {
        tokio::select! {
            () = shutdown.clone() => return,
            r = leader.wait_for(|l| *l) => if r.is_err() { return },
        }
        tracing::info!(namespaces = ?config.watch_namespaces, "leading: starting the controllers");
        readiness.set(false);
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let term = term::run_term(
            client.clone(),
            &config,
            metrics.clone(),
            readiness.clone(),
            beside.clone(),
            stop_rx,
        );
        tokio::pin!(term);
        let mut stopping = false;
        tokio::select! {
            () = &mut term => {},
            () = shutdown.clone() => stopping = true,
            _ = leader.wait_for(|l| !*l) => {
                tracing::warn!("no longer leading: stopping the controllers");
            },
        }
        let _ = stop_tx.send(());
        // In-flight reconciles finish; a stuck one does not hold the process.
        let _ = tokio::time::timeout(Duration::from_secs(10), term).await;
        readiness.set(true);
        if stopping {
            return;
        }
    }
}

/// Every Subscription whose status says Ready, once per `every`, spread over it: each tick
/// (a second, or `every` when shorter) the ones whose [`slot`] it is. The resync had been a
/// requeue per Subscription: kube-runtime's scheduler then held an entry for every Subscription
/// at rest (about 0.8 KiB each, issue: scale); now it holds none.
fn resync_walk(
    subs: Store<Subscription>,
    every: Duration,
) -> impl futures::Stream<Item = ObjectRef<Subscription>> {
    let tick = every.clamp(Duration::from_millis(1), Duration::from_secs(1));
    let slots = (every.as_millis() / tick.as_millis()).max(1) as u64;
    let mut timer = tokio::time::interval(tick);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    futures::stream::unfold((timer, 0u64), move |(mut timer, n)| {
        let subs = subs.clone();
        async move {
            timer.tick().await;
            let turn: Vec<ObjectRef<Subscription>> = subs
                .state()
                .iter()
                .filter(|sub| slot(sub, slots) == n % slots && ready_for(sub, every))
                .map(|sub| ObjectRef::from_obj(sub.as_ref()))
                .collect();
            Some((futures::stream::iter(turn), (timer, n.wrapping_add(1))))
        }
    })
    .flatten()
}

/// Which of `slots` ticks of the resync walk looks at `sub`: by its namespace and name, so the
/// same each walk.
fn slot(sub: &Subscription, slots: u64) -> u64 {
    settle::backend::fingerprint(&(
        sub.metadata.namespace.as_deref(),
        sub.metadata.name.as_deref(),
    )) % slots.max(1)
}

/// Whether `sub`'s status has said Ready=True for at least `every` (the controller stamps the
/// transition with its own clock): one just made Ready was looked at just now, and a look
/// again within the interval would only cost the broker a call (issue: scale, calls per
/// Subscription no more than NACK's).
fn ready_for(sub: &Subscription, every: Duration) -> bool {
    use settle::api::condition::{self, Status};
    let Some(status) = sub.status.as_ref() else {
        return false;
    };
    condition::find(&status.conditions, conditions::types::READY).is_some_and(|c| {
        c.status == Status::True.as_str()
            && Duration::try_from(
                k8s_openapi::jiff::Timestamp::now().duration_since(c.last_transition_time.0),
            )
            .is_ok_and(|d| d >= every)
    })
}

/// What a cached object keeps of its metadata: no `managedFields`, and of its annotations only
/// Settle's own (`settle.dev/...`). A tenant's object can carry up to the API server's 256 KiB
/// of annotations and a long field history; every replica caches every watched object, so
/// neither is kept (issue: a cache is bounded by what Settle reads, not by what tenants write).
pub fn lean<K: Resource>(o: &mut K) {
    let meta = o.meta_mut();
    meta.managed_fields = None;
    if let Some(a) = meta.annotations.as_mut() {
        a.retain(|k, _| k.starts_with(SETTLE_ANNOTATION_PREFIX));
        if a.is_empty() {
            meta.annotations = None;
        }
    }
}

/// The annotations a cached object keeps ([`lean`]).
pub const SETTLE_ANNOTATION_PREFIX: &str = "settle.dev/";

/// A watch of `K` in the watched namespaces: one namespaced watch for one namespace, else one
/// cluster-wide watch filtered to them; objects are cached [`lean`].
pub fn watch<K>(
    client: &Client,
    namespaces: &[String],
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let api: Api<K> = match namespaces {
        [one] => Api::namespaced(client.clone(), one),
        _ => Api::all(client.clone()),
    };
    let namespaces = namespaces.to_vec();
    // Lists are consistent (the most recent state, not whatever the API server's watch cache
    // holds): a term starts from them, and a replica that takes over from a dead leader must not
    // act on a state seconds old (seen: a takeover that listed Subscriptions without the status
    // their consumers were made under, and without one applied after the leader died).
    watcher(api, watcher::Config::default())
        .default_backoff()
        .try_filter(move |ev| {
            let keep = match ev {
                watcher::Event::Apply(o)
                | watcher::Event::Delete(o)
                | watcher::Event::InitApply(o) => {
                    index::watched(&namespaces, o.meta().namespace.as_deref())
                }
                watcher::Event::Init | watcher::Event::InitDone => true,
            };
            futures::future::ready(keep)
        })
        .modify(lean)
}

/// What makes a Subscription worth reconciling again: its spec (generation), its deletion and its
/// adopt annotation (docs/semantics.md J8, R8, Q7). Not its status (this controller's own
/// writes) nor its finalizers (its own too).
/// Replaces an object's finalizer list, guarded by the resourceVersion it was read at, so a
/// concurrent writer's finalizer is never lost (a conflict is retried with the fresh object); an
/// object gone already has nothing left to guard. `controller` labels the request's count.
pub async fn set_finalizers<K>(
    api: &Api<K>,
    obj: &K,
    ctx: &Ctx,
    controller: &str,
    finalizers: Vec<String>,
) -> Result<(), Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": obj.resource_version(),
            "finalizers": finalizers,
        }
    });
    ctx.metrics.kube(controller, "patch_finalizer");
    match api
        .patch(
            &obj.name_any(),
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// What wakes the Backend controller: a new generation, or the start of its deletion (its own
/// finalizer and status writes do not).
fn backend_predicate(b: &Backend) -> Option<u64> {
    Some(settle::backend::fingerprint(&(
        b.metadata.generation,
        b.metadata.deletion_timestamp.is_some(),
    )))
}

fn subscription_predicate(s: &Subscription) -> Option<u64> {
    Some(settle::backend::fingerprint(&(
        s.metadata.generation,
        s.metadata.deletion_timestamp.is_some(),
        s.annotations().get(status::ADOPT_ANNOTATION),
    )))
}

/// Counts one reconcile's result (`settle_reconcile_total`): `ok`, or the failure's category.
fn count<K: Resource, Q: std::error::Error + 'static>(
    metrics: &Metrics,
    controller: &str,
    r: Result<(ObjectRef<K>, Action), kube::runtime::controller::Error<Error, Q>>,
) -> futures::future::Ready<()> {
    use kube::runtime::controller::Error as Run;
    let result = match &r {
        Ok(_) => metrics::RESULT_OK,
        Err(e) => {
            tracing::debug!(%controller, error = %e, "reconcile error");
            match e {
                Run::ReconcilerFailed(e, _) => e.category(),
                // The watch or the queue behind the controller, not one object's reconcile.
                _ => metrics::RESULT_WATCH,
            }
        }
    };
    metrics
        .reconciles
        .with_label_values(&[controller, result])
        .inc();
    futures::future::ready(())
}

fn backend_error_policy(b: Arc<Backend>, error: &Error, ctx: Arc<Ctx>) -> Action {
    let key = format!(
        "backend/{}/{}",
        b.namespace().unwrap_or_default(),
        b.name_any()
    );
    let delay = ctx.failed(&key, Duration::from_secs(30));
    tracing::warn!(backend = %key, error = %error, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn walked(name: &str, ready: &str) -> Subscription {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "messaging.settle.dev/v1alpha1",
            "kind": "Subscription",
            "metadata": {"name": name, "namespace": "shop"},
            "spec": {"backendRef": {"name": "nats"}, "pattern": "orders.>"},
            "status": {"conditions": [{"type": "Ready", "status": ready, "reason": "R",
                "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
        }))
        .expect("a Subscription")
    }

    #[tokio::test(start_paused = true)]
    async fn the_resync_walk_looks_at_every_ready_subscription_once_per_interval() {
        let (store, mut writer) = reflector::store::<Subscription>();
        let names: Vec<String> = (0..40).map(|i| format!("s{i}")).collect();
        for name in &names {
            writer.apply_watcher_event(&watcher::Event::Apply(walked(name, "True")));
        }
        writer.apply_watcher_event(&watcher::Event::Apply(walked("down", "False")));
        let mut new = walked("new", "True");
        if let Some(c) = new.status.as_mut().and_then(|s| s.conditions.first_mut()) {
            c.last_transition_time = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            );
        }
        writer.apply_watcher_event(&watcher::Event::Apply(new));
        let every = Duration::from_secs(4);
        let walk = resync_walk(store, every);
        futures::pin_mut!(walk);
        let start = tokio::time::Instant::now();
        for round in 0..2u32 {
            let mut seen: HashMap<String, usize> = HashMap::new();
            let mut ticks = std::collections::HashSet::new();
            // Just before the next interval's first tick.
            let end = start + every * (round + 1) - Duration::from_millis(1);
            while let Ok(Some(r)) = tokio::time::timeout_at(end, walk.next()).await {
                ticks.insert(tokio::time::Instant::now());
                *seen.entry(r.name).or_default() += 1;
            }
            assert_eq!(seen.len(), names.len(), "round {round}: every Ready one");
            assert!(
                seen.values().all(|n| *n == 1),
                "round {round}: each once: {seen:?}"
            );
            assert!(!seen.contains_key("down"), "not one that is not Ready");
            assert!(
                !seen.contains_key("new"),
                "not one Ready for less than the interval"
            );
            assert!(
                ticks.len() > 1,
                "round {round}: spread over the interval, not at once"
            );
        }
    }

    #[test]
    fn retries_start_at_half_a_second_and_double_up_to_the_cap() {
        let max = Duration::from_secs(60);
        let got: Vec<u64> = (1..=10)
            .map(|n| retry_delay(n, max).as_millis() as u64)
            .collect();
        assert_eq!(
            got,
            vec![
                500, 1000, 2000, 4000, 8000, 16000, 32000, 60000, 60000, 60000
            ]
        );
        assert_eq!(retry_delay(0, max), Duration::from_millis(500));
        assert_eq!(retry_delay(u32::MAX, max), max, "no overflow");
        assert_eq!(
            retry_delay(3, Duration::from_secs(1)),
            Duration::from_secs(1)
        );
    }

    fn sub(generation: i64, deleting: bool, finalizers: &[&str], ready: bool) -> Subscription {
        let mut s: Subscription = serde_json::from_value(serde_json::json!({
            "apiVersion": "messaging.settle.dev/v1alpha1",
            "kind": "Subscription",
            "metadata": {"name": "a", "namespace": "shop", "generation": generation,
                         "finalizers": finalizers},
            "spec": {"backendRef": {"name": "nats"}, "pattern": "a.>"},
        }))
        .expect("a Subscription");
        if deleting {
            s.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::from_second(1).expect("time"),
                ));
        }
        if ready {
            s.status = Some(Default::default());
        }
        s
    }

    #[test]
    fn only_spec_changes_deletion_and_adoption_trigger_a_subscription_reconcile() {
        let base = subscription_predicate(&sub(1, false, &[], false));
        assert_eq!(
            subscription_predicate(&sub(1, false, &["messaging.settle.dev/consumer"], true)),
            base,
            "the controller's own finalizer and status writes do not trigger it again"
        );
        assert_ne!(subscription_predicate(&sub(2, false, &[], false)), base);
        assert_ne!(subscription_predicate(&sub(1, true, &[], false)), base);
        let mut adopting = sub(1, false, &[], false);
        adopting
            .annotations_mut()
            .insert("unrelated".into(), "x".into());
        assert_eq!(
            subscription_predicate(&adopting),
            base,
            "other annotations do not"
        );
        adopting
            .annotations_mut()
            .insert(status::ADOPT_ANNOTATION.into(), "u-0".into());
        assert_ne!(
            subscription_predicate(&adopting),
            base,
            "the adopt annotation does (R8)"
        );
    }

    #[test]
    fn a_cached_object_keeps_no_field_history_and_only_settles_annotations() {
        let mut s: Subscription = serde_json::from_value(serde_json::json!({
            "apiVersion": "messaging.settle.dev/v1alpha1",
            "kind": "Subscription",
            "metadata": {"name": "a", "namespace": "shop",
                         "annotations": {
                             "kubectl.kubernetes.io/last-applied-configuration": "x".repeat(100_000),
                             "settle.dev/adopt": "yes"},
                         "managedFields": [{"manager": "kubectl", "operation": "Apply"}]},
            "spec": {"backendRef": {"name": "nats"}, "pattern": "a.>"},
        }))
        .expect("a Subscription");
        lean(&mut s);
        assert!(s.metadata.managed_fields.is_none());
        let kept: Vec<_> = s.annotations().keys().cloned().collect();
        assert_eq!(kept, vec!["settle.dev/adopt".to_string()]);
        let mut bare = sub(1, false, &[], false);
        bare.metadata.annotations = Some([("team".to_string(), "a".to_string())].into());
        lean(&mut bare);
        assert!(
            bare.metadata.annotations.is_none(),
            "an emptied map is dropped"
        );
    }
}
