//! The handler runtime (docs/semantics.md): a `Bus` runs subscriptions on a backend, hands each
//! delivery to its handler, and keeps the account (`ConsumerStats`).
//!
//! - [`Subscriber`]: name + the CRD's `DeliveryPolicy` + a handler.
//! - [`Delivery`]: one attempt; `ack`/`nack`/`nack_after`; exactly one settlement across clones.
//! - [`settle`] / [`settle_with`]: the one settle path (handlers, the bus, the conformance suite).
//! - [`Broker`] / [`Consumer`]: the seam a broker implements (`backend::memory`, `backend::nats`,
//!   `backend::rabbitmq`, `backend::sqs`).
//! - [`conformance::run`]: the conformance rows (semantics T1–T6) for any AtLeastOnce backend.
//! - [`report`]: the versioned stats report for the operator.
//! - [`await_operator`]: the one loop a broker waits in for the consumer or queue the operator
//!   makes.
//!
//! This module must not know a particular broker, and must not re-state the admission rules:
//! it calls `policy::validate_runtime` when a subscription is added.

pub mod conformance;
mod delivery;
mod envelope;
pub mod report;
mod seam;
mod spec;
mod stats;
mod waiting;

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use tokio::sync::{Semaphore, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

pub use delivery::{
    Binding, BrokerAction, Decision, DecodeError, Delivery, DeliveryOptions, EpochStats, OnSettle,
    Performed, Refusal, SettleError, SubscriptionCtx, settle, settle_with,
};
pub use envelope::{EnvelopeEvent, Foreign, Format};
pub use seam::{Broker, BusError, Consumer, StatsSink};
pub use spec::{ConsumerOwner, Handler, HandlerError, Subscriber, handler};
pub use stats::RuntimeStats;
pub use waiting::await_operator;

use crate::api::{Capabilities, ConsumerStats, SlowHandler};
use report::{ReportTarget, StatsReporter};
use stats::Counters;

/// How long `close` waits for running handlers before it gives their attempts up (Released
/// under AtLeastOnce, Lost under AtMostOnce).
pub const DEFAULT_CLOSE_GRACE: Duration = Duration::from_secs(30);

/// How often the last report at `close` is tried before it is given up.
const LAST_REPORT_TRIES: u32 = 5;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means another thread panicked while holding it; the maps stay usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Builds a [`Bus`].
pub struct BusBuilder {
    backend: Arc<dyn Broker>,
    close_grace: Duration,
    namespace: String,
    instance: String,
    report_interval: Duration,
    sink: Option<Arc<dyn StatsSink>>,
}

impl BusBuilder {
    /// How long `close` waits for running handlers (default 30s).
    pub fn close_grace(mut self, d: Duration) -> Self {
        self.close_grace = d;
        self
    }
    /// The Subscriptions' namespace, for stats reports (default `POD_NAMESPACE`, else `default`).
    pub fn namespace(mut self, ns: impl Into<String>) -> Self {
        self.namespace = ns.into();
        self
    }
    /// This instance's name in stats reports (default: see `report::default_instance`).
    pub fn instance(mut self, id: impl Into<String>) -> Self {
        self.instance = id.into();
        self
    }
    /// The least time between two reports of one subscription (default 5s).
    pub fn report_interval(mut self, d: Duration) -> Self {
        self.report_interval = d.max(Duration::from_millis(10));
        self
    }
    /// Where stats reports go (default: the backend's own sink, if it has one).
    pub fn stats_sink(mut self, sink: Arc<dyn StatsSink>) -> Self {
        self.sink = Some(sink);
        self
    }
    /// Publish no stats reports.
    pub fn without_reports(mut self) -> Self {
        self.sink = None;
        self
    }
    pub fn build(self) -> Bus {
        let (report_stop, _) = watch::channel(false);
        Bus {
            inner: Arc::new(BusInner {
                backend: self.backend,
                close_grace: self.close_grace,
                report: self.sink.map(|sink| (self.report_interval, sink)),
                namespace: self.namespace,
                instance: self.instance,
                started_at_ms: report::now_ms(),
                running: Mutex::new(HashMap::new()),
                ctxs: Mutex::new(HashMap::new()),
                counters: Mutex::new(HashMap::new()),
                closed: AtomicBool::new(false),
                report_stop,
                report_task: Mutex::new(None),
            }),
        }
    }
}

struct Running {
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
}

struct BusInner {
    backend: Arc<dyn Broker>,
    close_grace: Duration,
    report: Option<(Duration, Arc<dyn StatsSink>)>,
    namespace: String,
    instance: String,
    started_at_ms: u64,
    running: Mutex<HashMap<String, Running>>,
    /// The latest context of every subscription this bus ran (kept after unsubscribe, so stats stay readable).
    ctxs: Mutex<HashMap<String, Arc<SubscriptionCtx>>>,
    /// Counters by subscription name, reused if a name is subscribed again: counters never go backwards.
    counters: Mutex<HashMap<String, Arc<Counters>>>,
    closed: AtomicBool,
    report_stop: watch::Sender<bool>,
    report_task: Mutex<Option<JoinHandle<()>>>,
}

/// The handler runtime: runs subscriptions on one backend. Cheap to clone.
#[derive(Clone)]
pub struct Bus {
    inner: Arc<BusInner>,
}

impl Bus {
    /// A bus on `backend` with the defaults (reports to the backend's sink, if it has one).
    pub fn new(backend: impl Broker) -> Bus {
        Bus::builder(backend).build()
    }

    pub fn builder(backend: impl Broker) -> BusBuilder {
        let backend: Arc<dyn Broker> = Arc::new(backend);
        let sink = backend.stats_sink();
        BusBuilder {
            backend,
            close_grace: DEFAULT_CLOSE_GRACE,
            namespace: std::env::var("POD_NAMESPACE").unwrap_or_else(|_| "default".to_string()),
            instance: report::default_instance(),
            report_interval: report::DEFAULT_REPORT_INTERVAL,
            sink,
        }
    }

    pub fn capabilities(&self) -> Capabilities {
        self.inner.backend.capabilities()
    }

    pub fn instance(&self) -> &str {
        &self.inner.instance
    }

    /// Starts a subscription. Refused, with the admission rules' own words, when the backend
    /// cannot honour its policy or its stream (semantics B7, A1–A5, A15).
    pub async fn subscribe(&self, spec: Subscriber) -> Result<(), BusError> {
        let inner = &self.inner;
        if inner.closed.load(Ordering::Acquire) {
            return Err(BusError::Closed);
        }
        let backend = &inner.backend;
        let verdict = crate::policy::validate_runtime(
            &spec.policy,
            spec.stream.as_deref(),
            &backend.capabilities(),
        );
        if !verdict.allowed() {
            return Err(BusError::Refused {
                name: spec.name,
                backend: backend.kind(),
                reason: verdict.error_text(),
            });
        }
        for w in &verdict.warnings {
            tracing::warn!(subscription = %spec.name, "{w}");
        }
        if lock(&inner.running).contains_key(&spec.name) {
            return Err(BusError::Duplicate(spec.name));
        }
        let counters = Arc::clone(lock(&inner.counters).entry(spec.name.clone()).or_default());
        let binding = Binding {
            namespace: inner.namespace.clone(),
            stream: spec.stream.clone(),
            owner: spec.owner,
        };
        let ctx = SubscriptionCtx::with_counters(
            spec.name.clone(),
            &spec.policy,
            binding,
            counters,
            inner.started_at_ms,
        );
        let consumer = backend.open(Arc::clone(&ctx)).await?;

        let (shutdown, shutdown_rx) = watch::channel(false);
        let lease = (backend.hands_on_slow_handlers()
            && ctx.policy().at_least_once()
            && ctx.policy().slow_handler == SlowHandler::ExtendLease)
            .then(|| Lease {
                ack_wait: ctx.policy().ack_wait,
                max_processing_time: ctx.policy().max_processing_time,
            });
        let task = tokio::spawn(dispatch(
            Arc::clone(&ctx),
            spec.handler,
            consumer,
            shutdown_rx,
            inner.close_grace,
            lease,
        ));
        {
            let mut running = lock(&inner.running);
            if running.contains_key(&spec.name) {
                // Lost a race with another subscribe of the same name.
                let _ = shutdown.send(true);
                return Err(BusError::Duplicate(spec.name));
            }
            running.insert(spec.name.clone(), Running { shutdown, task });
        }
        lock(&inner.ctxs).insert(spec.name.clone(), ctx);
        self.start_reports();
        tracing::info!(subscription = %spec.name, backend = %backend.kind(), "subscribed");
        Ok(())
    }

    /// Publishes a message.
    pub async fn publish(
        &self,
        subject: impl Into<String>,
        payload: impl Into<Bytes>,
    ) -> Result<(), BusError> {
        self.publish_with_headers(subject, Vec::new(), payload)
            .await
    }

    /// Publishes a message with transport headers.
    pub async fn publish_with_headers(
        &self,
        subject: impl Into<String>,
        headers: Vec<(String, String)>,
        payload: impl Into<Bytes>,
    ) -> Result<(), BusError> {
        self.inner
            .backend
            .publish(subject.into(), headers, payload.into())
            .await
    }

    /// The cumulative account of a subscription (also after it stopped).
    pub fn stats(&self, name: &str) -> Option<ConsumerStats> {
        lock(&self.inner.ctxs).get(name).map(|c| c.stats())
    }

    /// Whether a subscription's fetching is paused now (`true` once its backend stopped taking
    /// deliveries for a pause, `false` again once it takes them): a watch, so an application
    /// can say so in its readiness or logs. Only backends without a pause of their own set it
    /// (RabbitMQ, SQS: the runtime stops fetching); on JetStream the server pauses the consumer
    /// and this stays `false` (docs/semantics.md W1–W6).
    pub fn paused(&self, name: &str) -> Option<watch::Receiver<bool>> {
        lock(&self.inner.ctxs).get(name).map(|c| c.paused())
    }

    /// Handler errors and panics of a subscription.
    pub fn runtime_stats(&self, name: &str) -> Option<RuntimeStats> {
        lock(&self.inner.ctxs).get(name).map(|c| c.runtime_stats())
    }

    /// Stops one subscription: no new deliveries; running handlers get the close grace; then
    /// its consumer is retired.
    pub async fn unsubscribe(&self, name: &str) -> Result<(), BusError> {
        let running = lock(&self.inner.running)
            .remove(name)
            .ok_or_else(|| BusError::Unknown(name.to_string()))?;
        stop(running).await;
        Ok(())
    }

    /// Stops every subscription (see `unsubscribe`) and publishes a last stats report, waiting
    /// for the broker to confirm it (a few tries). The graceful stop: call it when the process
    /// is asked to stop ([`stop_signal`]), so handlers in flight finish (or their attempts are
    /// released after the close grace) and the final counts reach the operator.
    pub async fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        let all: Vec<Running> = lock(&self.inner.running).drain().map(|(_, r)| r).collect();
        futures::future::join_all(all.into_iter().map(stop)).await;
        let _ = self.inner.report_stop.send(true);
        let task = lock(&self.inner.report_task).take();
        if let Some(task) = task
            && let Err(e) = task.await
        {
            tracing::warn!(error = %e, "stats reporter ended abnormally");
        }
    }

    fn start_reports(&self) {
        let Some((interval, sink)) = self.inner.report.clone() else {
            return;
        };
        let mut slot = lock(&self.inner.report_task);
        if slot.is_some() {
            return;
        }
        let target = ReportTarget {
            namespace: self.inner.namespace.clone(),
            instance: self.inner.instance.clone(),
            backend: self.inner.backend.kind().to_string(),
            sink,
        };
        let weak = Arc::downgrade(&self.inner);
        let mut stop_rx = self.inner.report_stop.subscribe();
        *slot = Some(tokio::spawn(async move {
            let mut reporter = StatsReporter::default();
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut marks_read = Instant::now();
            loop {
                let stopping = tokio::select! {
                    _ = tick.tick() => false,
                    _ = stop_rx.changed() => true,
                };
                let Some(inner) = weak.upgrade() else { return };
                let subs: Vec<Arc<SubscriptionCtx>> = lock(&inner.ctxs).values().cloned().collect();
                let backend = Arc::clone(&inner.backend);
                drop(inner);
                if !stopping && marks_read.elapsed() >= MARK_RECHECK {
                    marks_read = Instant::now();
                    read_marks_again(backend.as_ref(), &subs).await;
                }
                if stopping {
                    // The last report: tried until the broker confirms it, a few times.
                    for attempt in 1..=LAST_REPORT_TRIES {
                        if reporter.tick(&target, &subs, attempt == 1).await {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    tracing::error!(
                        "the last stats report was not confirmed: the operator keeps the counts of the report before it (at most one report interval behind)"
                    );
                    return;
                }
                reporter.tick(&target, &subs, false).await;
            }
        }));
    }
}

/// How often a running subscription bound to an operator's consumer or queue reads its
/// object mark again: a takeover under running applications starts the new object's epoch
/// within this (and a report interval) without a restart.
pub const MARK_RECHECK: Duration = Duration::from_secs(5);

/// Each subscription bound to a marked consumer or queue: its mark read again, and a new
/// object's epoch begun when it names one (semantics C15).
async fn read_marks_again(backend: &dyn Broker, subs: &[Arc<SubscriptionCtx>]) {
    for ctx in subs {
        if ctx.bound_uid().is_none() {
            continue;
        }
        if let Some(uid) = backend.read_mark(ctx).await {
            ctx.bound_to(Some(&uid));
        }
    }
}

/// Resolves when the process is asked to stop: SIGTERM (what Kubernetes sends a pod's
/// containers, then SIGKILL after `terminationGracePeriodSeconds`) or SIGINT (Ctrl-C). Use it
/// with [`Bus::close`]:
///
/// ```no_run
/// # async fn run(bus: settle::bus::Bus) {
/// settle::bus::stop_signal().await;
/// bus.close().await; // handlers finish, the last report is confirmed
/// # }
/// ```
///
/// Keep the pod's grace period longer than the bus's close grace (30 s by default) plus a few
/// seconds for the last report.
pub async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; stopping on Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
    tracing::info!("asked to stop: closing the bus");
}

async fn stop(r: Running) {
    let _ = r.shutdown.send(true);
    if let Err(e) = r.task.await {
        tracing::error!(error = %e, "subscription dispatcher ended abnormally");
    }
}

#[derive(Clone, Copy)]
struct Lease {
    ack_wait: Duration,
    max_processing_time: Duration,
}

/// One subscription's loop: takes a slot (maxInFlight), takes a delivery, runs its handler.
async fn dispatch(
    ctx: Arc<SubscriptionCtx>,
    handler: Handler,
    mut consumer: Box<dyn Consumer>,
    mut shutdown: watch::Receiver<bool>,
    grace: Duration,
    lease: Option<Lease>,
) {
    let slots = Arc::new(Semaphore::new(ctx.policy().max_in_flight));
    let in_flight: Arc<Mutex<HashMap<u64, Delivery>>> = Arc::default();
    let ids = AtomicU64::new(0);
    let mut tasks = JoinSet::new();
    // The slot of a delivery whose handler finished inline, kept for the next one: no release
    // and acquire (each a lock in the semaphore) per message.
    let mut kept = None;
    loop {
        // A stop is seen between deliveries without a wait; the waits below also end on it.
        if shutdown.has_changed().unwrap_or(true) {
            break;
        }
        let permit = match kept.take() {
            Some(p) => p,
            None => match Arc::clone(&slots).try_acquire_owned() {
                Ok(p) => p,
                Err(_) => tokio::select! {
                    biased;
                    _ = shutdown.changed() => break,
                    p = Arc::clone(&slots).acquire_owned() => match p { Ok(p) => p, Err(_) => break },
                },
            },
        };
        // A delivery the consumer has ready is taken without arming the stop's wake-up; the
        // same future is awaited with the stop when it is not ready.
        let mut next_delivery = consumer.next();
        let next = match futures::poll!(next_delivery.as_mut()) {
            Poll::Ready(d) => d,
            Poll::Pending => tokio::select! {
                biased;
                _ = shutdown.changed() => break,
                d = next_delivery => d,
            },
        };
        let Some(d) = next else {
            tracing::warn!(subscription = %ctx.name(), "consumer ended");
            break;
        };
        if !tasks.is_empty() {
            while tasks.try_join_next().is_some() {}
        }
        // A handler that finishes without waiting (the common ack-and-return) completes inline
        // on its first poll: no task, no cross-thread wake-up. One that waits continues on its
        // own task, so slow handlers run concurrently up to maxInFlight.
        let mut run: Pin<Box<dyn Future<Output = ()> + Send>> =
            Box::pin(run_one(d.clone(), Arc::clone(&handler), lease));
        if futures::poll!(run.as_mut()).is_ready() {
            kept = Some(permit);
            continue;
        }
        let id = ids.fetch_add(1, Ordering::Relaxed);
        lock(&in_flight).insert(id, d);
        let registry = Arc::clone(&in_flight);
        tasks.spawn(async move {
            run.await;
            lock(&registry).remove(&id);
            drop(permit);
        });
    }
    close(&ctx, consumer, tasks, &in_flight, grace).await;
}

/// Closing a subscription's loop: running handlers get the grace; what is left is given up
/// (released), after the consumer stopped pulling; then the consumer is retired.
async fn close(
    ctx: &SubscriptionCtx,
    mut consumer: Box<dyn Consumer>,
    tasks: JoinSet<()>,
    in_flight: &Mutex<HashMap<u64, Delivery>>,
    grace: Duration,
) {
    wait_for_handlers(tasks, grace).await;
    // Stop pulling before giving attempts back, so they are not offered to this consumer again.
    consumer.stop().await;
    let left: Vec<Delivery> = lock(in_flight).drain().map(|(_, d)| d).collect();
    for d in left {
        tracing::warn!(subscription = %ctx.name(), subject = %d.subject(), "handler still running at close: attempt given up");
        d.release().await;
    }
    consumer.retire().await;
}

/// Waits up to `grace` for the running handlers' tasks; then aborts those left and waits for
/// them to end.
async fn wait_for_handlers(mut tasks: JoinSet<()>, grace: Duration) {
    let deadline = tokio::time::sleep(grace);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            r = tasks.join_next() => if r.is_none() { break },
            _ = &mut deadline => {
                tasks.abort_all();
                while tasks.join_next().await.is_some() {}
                break;
            }
        }
    }
}

/// Runs one handler on one delivery: contains a panic, counts a returned error, keeps the
/// lease, and settles silence.
async fn run_one(d: Delivery, handler: Handler, lease: Option<Lease>) {
    let ctx = Arc::clone(d.ctx());
    let run = AssertUnwindSafe(handler(d.clone())).catch_unwind();
    let outcome = match lease {
        None => run.await,
        Some(lease) => {
            tokio::pin!(run);
            // Biased: a handler that finishes on its first poll never arms a lease timer.
            tokio::select! {
                biased;
                r = &mut run => r,
                never = keep_lease(&d, lease) => match never {},
            }
        }
    };
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            d.count(|c| &c.handler_errors);
            tracing::warn!(subscription = %ctx.name(), subject = %d.subject(), attempt = d.attempt(), settled = d.is_settled(), error = %e, "handler returned an error (it does not decide settlement)");
        }
        Err(panic) => {
            d.count(|c| &c.panics);
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(subscription = %ctx.name(), subject = %d.subject(), attempt = d.attempt(), panic = %what, "handler panicked: contained, treated as silence");
        }
    }
    d.complete().await;
}

enum Never {}

/// ExtendLease: `+WPI` half an AckWait before each lease runs out, up to MaxProcessingTime; then
/// counts LeaseExpired when the last lease runs out with the handler still running. Never returns.
async fn keep_lease(d: &Delivery, lease: Lease) -> Never {
    let start = Instant::now();
    let bound = start + lease.max_processing_time;
    let mut held_until = start + lease.ack_wait;
    let half = lease.ack_wait / 2;
    loop {
        // Extend half an AckWait before the lease runs out; the last extension is timed so the
        // lease ends exactly at MaxProcessingTime (a +WPI always grants a full AckWait).
        let regular = held_until - half;
        let at = if regular + lease.ack_wait <= bound {
            regular
        } else if held_until < bound {
            bound - lease.ack_wait
        } else {
            break;
        };
        tokio::time::sleep_until(at).await;
        if d.is_settled() {
            return std::future::pending().await;
        }
        match d.progress().await {
            Ok(()) => held_until = Instant::now() + lease.ack_wait,
            Err(r) => {
                tracing::warn!(subscription = %d.subscription(), reason = %r.reason, "could not extend the lease");
                break;
            }
        }
    }
    tokio::time::sleep_until(held_until).await;
    if !d.is_settled() {
        d.count(|c| &c.lease_expired);
        tracing::warn!(subscription = %d.subscription(), subject = %d.subject(), attempt = d.attempt(), "handler ran past maxProcessingTime: the message is handed on while it may still run (LeaseExpired)");
    }
    std::future::pending().await
}
