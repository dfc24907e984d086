//! One attempt of one message as a handler sees it, and the one settle path (docs/semantics.md
//! S1–S6).
//!
//! Backends construct deliveries only through `Delivery::new(ctx, DeliveryOptions)`; the
//! settlement state sits behind an `Arc`, so every clone agrees and the first settlement wins.
//! `settle` / `settle_with` are the only way a settlement reaches a backend: the handler's
//! `ack`/`nack`/`nack_after`, the bus after the handler returns, and the conformance suite all
//! go through them. This module must not decide redelivery timing beyond the policy, nor talk
//! to a broker itself (that is the backend's `OnSettle`).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use serde::de::DeserializeOwned;

use crate::api::{ConsumerStats, DeliveryPolicy};

use super::envelope::{self, Data, EnvelopeEvent, Foreign};
use super::spec::ConsumerOwner;
use super::stats::{Counter, Counters, RuntimeStats};
use crate::policy::ResolvedPolicy;

/// One subscription as the runtime and its backend share it: name, resolved policy, where its
/// consumer lives and who owns it, and counters. A backend receives it when it opens a consumer
/// and passes it to every `Delivery::new`.
#[derive(Debug)]
pub struct SubscriptionCtx {
    name: String,
    policy: ResolvedPolicy,
    binding: Binding,
    pub(crate) counters: Arc<Counters>,
    /// Which Subscription object the counts go to now, and since when. Read-locked to count
    /// an event of a delivery of the current epoch, write-locked to begin an epoch or to count
    /// one of an earlier epoch's deliveries, so no count falls between two epochs.
    epoch: RwLock<Epoch>,
    /// Whether the backend stopped fetching for a pause (RabbitMQ, SQS).
    paused: tokio::sync::watch::Sender<bool>,
}

/// The stretch of a subscription's counts that belongs to one Subscription object: what the
/// counters held when it began is left out of reports (docs/stats-report.md), and so is what
/// deliveries offered before it did since (semantics C15: a delivery belongs to the epoch it
/// was offered in).
#[derive(Debug, Default)]
struct Epoch {
    uid: Option<String>,
    started_at_ms: u64,
    /// Which epoch of this subscription (each new object, one more).
    generation: u64,
    baseline: ConsumerStats,
    runtime_baseline: RuntimeStats,
    /// Counted since it began for deliveries of an earlier epoch: left out of its reports.
    earlier: Counters,
}

/// A subscription's counts as reported: those of the current object only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpochStats {
    /// The Subscription object (UID) the counts belong to, when the consumer names one.
    pub uid: Option<String>,
    /// When counting for it began (Unix ms).
    pub started_at_ms: u64,
    pub stats: ConsumerStats,
    pub runtime: RuntimeStats,
}

/// Where a subscription's consumer lives, and who makes it.
#[derive(Clone, Debug)]
pub struct Binding {
    /// The Subscription's namespace (names derived consumers).
    pub namespace: String,
    /// The stream, when named; otherwise the backend finds it by the pattern.
    pub stream: Option<String>,
    pub owner: ConsumerOwner,
}

impl Default for Binding {
    fn default() -> Self {
        Binding {
            namespace: "default".to_string(),
            stream: None,
            owner: ConsumerOwner::Runtime,
        }
    }
}

impl SubscriptionCtx {
    /// A subscription context from the CRD's policy (defaults filled in), owning its consumer.
    /// Does not validate it: `Bus::subscribe` and `conformance::run` call
    /// `policy::validate_policy` first.
    pub fn new(name: impl Into<String>, policy: &DeliveryPolicy) -> Arc<SubscriptionCtx> {
        SubscriptionCtx::with_counters(name, policy, Binding::default(), Arc::default(), 0)
    }
    pub(crate) fn with_counters(
        name: impl Into<String>,
        policy: &DeliveryPolicy,
        binding: Binding,
        counters: Arc<Counters>,
        started_at_ms: u64,
    ) -> Arc<SubscriptionCtx> {
        Arc::new(SubscriptionCtx {
            name: name.into(),
            policy: ResolvedPolicy::resolve(policy),
            binding,
            counters,
            epoch: RwLock::new(Epoch {
                started_at_ms,
                ..Epoch::default()
            }),
            paused: tokio::sync::watch::Sender::new(false),
        })
    }

    /// The backend stopped fetching for a pause (`true`), or fetches again (`false`).
    pub fn set_paused(&self, paused: bool) {
        self.paused
            .send_if_modified(|p| std::mem::replace(p, paused) != paused);
    }

    /// Whether the backend's fetching is paused, as a watch ([`SubscriptionCtx::set_paused`]).
    pub fn paused(&self) -> tokio::sync::watch::Receiver<bool> {
        self.paused.subscribe()
    }

    /// A backend bound the subscription to a consumer the operator marked as Subscription
    /// object `uid`'s. Bound to another object than before (the Subscription was deleted and
    /// applied again under the same name), the counts start afresh for it: a new
    /// `startedAtMs`, and what was counted so far left out of its reports (semantics C15).
    /// The cumulative `stats()` of this process are unaffected.
    pub fn bound_to(&self, uid: Option<&str>) {
        let Some(uid) = uid else { return };
        let mut e = self
            .epoch
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match e.uid.as_deref() {
            Some(old) if old == uid => {}
            None => e.uid = Some(uid.to_string()),
            Some(old) => {
                tracing::info!(subscription = %self.name, previous = %old, uid = %uid, "bound to a new Subscription object of the same name: its account starts at zero");
                *e = Epoch {
                    uid: Some(uid.to_string()),
                    started_at_ms: super::report::now_ms().max(e.started_at_ms + 1),
                    generation: e.generation + 1,
                    baseline: self.counters.snapshot(),
                    runtime_baseline: self.counters.runtime(),
                    earlier: Counters::default(),
                };
            }
        }
    }

    /// The Subscription object the counts go to now, if a mark named one.
    pub fn bound_uid(&self) -> Option<String> {
        self.read_epoch().uid.clone()
    }

    /// The counts of the current Subscription object (what reports carry).
    pub fn epoch(&self) -> EpochStats {
        let e = self.read_epoch();
        EpochStats {
            uid: e.uid.clone(),
            started_at_ms: e.started_at_ms,
            stats: self
                .counters
                .snapshot()
                .since(&e.baseline)
                .since(&e.earlier.snapshot()),
            runtime: self
                .counters
                .runtime()
                .since(&e.runtime_baseline)
                .since(&e.earlier.runtime()),
        }
    }

    fn read_epoch(&self) -> std::sync::RwLockReadGuard<'_, Epoch> {
        self.epoch
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new delivery offered (and a foreign conflict, when its headers contradict its
    /// envelope): counted in the current epoch, whose generation it returns.
    fn offer(&self, foreign_conflict: bool) -> u64 {
        let e = self.read_epoch();
        self.counters.offered.inc();
        if foreign_conflict {
            self.counters.foreign_conflicts.inc();
        }
        e.generation
    }

    /// One event (`counter`) of a delivery offered in epoch `generation`: in this process's
    /// counts always, and in the current epoch's only when it was offered in it.
    pub(crate) fn count(&self, generation: u64, counter: fn(&Counters) -> &Counter) {
        {
            let e = self.read_epoch();
            if e.generation == generation {
                counter(&self.counters).inc();
                return;
            }
        }
        let e = self
            .epoch
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        counter(&self.counters).inc();
        counter(&e.earlier).inc();
    }
    /// Where the consumer lives and who makes it.
    pub fn binding(&self) -> &Binding {
        &self.binding
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn policy(&self) -> &ResolvedPolicy {
        &self.policy
    }
    /// The cumulative account so far.
    pub fn stats(&self) -> ConsumerStats {
        self.counters.snapshot()
    }
    /// Handler errors and panics so far.
    pub fn runtime_stats(&self) -> RuntimeStats {
        self.counters.runtime()
    }
}

/// What a backend is asked to do with a settled attempt (AtLeastOnce only; under AtMostOnce
/// nothing is acted on and the backend is not called).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokerAction {
    /// Accepted: forget the message.
    Ack,
    /// Declined: offer it again, not before this delay (zero: at once).
    Decline(Duration),
    /// Declined on its last attempt (MaxDeliver): the runtime counted it Exhausted; the backend
    /// must not offer it again.
    Terminate,
}

/// The backend performed the action, possibly with a shorter delay than asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Performed {
    AsAsked,
    /// The backend could not hold the message as long as asked (counted DelayShortened).
    DelayShortened,
}

/// The backend could not perform a settlement (counted Refused).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub reason: String,
    /// True when the backend cannot be asked to try the message again at all (counted Stranded
    /// for a decline); false when it will come back anyway (for example after AckWait).
    pub stranded: bool,
}

/// A backend's callbacks for one delivery: how it performs a settlement (semantics S6).
pub trait OnSettle: Send + Sync + 'static {
    /// Performs a settlement.
    fn settle(&self, action: BrokerAction) -> BoxFuture<'_, Result<Performed, Refusal>>;
    /// Keeps the message with its running handler for another AckWait (JetStream `+WPI`).
    fn progress(&self) -> BoxFuture<'_, Result<(), Refusal>>;
    /// Gives back an attempt no handler finished (the bus is closing): offer it again at once.
    fn release(&self) -> BoxFuture<'_, ()>;
}

/// What is handed to `Delivery::new`.
pub struct DeliveryOptions {
    pub subject: String,
    pub headers: Vec<(String, String)>,
    pub payload: Bytes,
    /// 1 for the first attempt, higher for each redelivery.
    pub attempt: u32,
    pub on_settle: Box<dyn OnSettle>,
}

/// How a handler (or the bus, for silence) settles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Ack,
    /// Decline, waiting the backoff schedule (at once without one).
    Nack,
    /// The handler returned without settling (or panicked): counted Silent, declined like a Nack.
    Silent,
}

/// Why a settlement did not happen as asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SettleError {
    #[error("already settled: exactly one settlement per delivery, and the first call won")]
    AlreadySettled,
    #[error(
        "nack_after is not allowed on subscription {0:?}: it has neither maxNackDelay nor backoff (nothing recorded; call nack() instead, or set spec.maxNackDelay)"
    )]
    NoDelayAllowed(String),
    #[error(
        "nack_after({requested:?}) is above this subscription's ceiling of {ceiling:?} (nothing recorded; ask for less, or call nack())"
    )]
    DelayTooLong {
        requested: Duration,
        ceiling: Duration,
    },
    #[error(
        "nack_after of a negative delay ({0} ms) is refused (nothing recorded; call nack() or nack_after(0))"
    )]
    NegativeDelay(i64),
    #[error("the backend could not perform the settlement: {0}")]
    Refused(String),
}

/// The data could not be decoded into the requested type.
#[derive(Debug, thiserror::Error)]
#[error("cannot decode the event data of {subject:?}: {source}")]
pub struct DecodeError {
    subject: String,
    #[source]
    source: serde_json::Error,
}

const OPEN: u8 = 0;
const DELIVERED: u8 = 1;
const RELEASED: u8 = 2;

struct Inner {
    ctx: Arc<SubscriptionCtx>,
    subject: String,
    headers: Vec<(String, String)>,
    payload: Bytes,
    attempt: u32,
    event: EnvelopeEvent,
    foreign: Foreign,
    data: Data,
    settled: AtomicBool,
    fate: AtomicU8,
    /// The epoch of its subscription it was offered in: its every count belongs there.
    generation: u64,
    on_settle: Box<dyn OnSettle>,
}

/// One attempt of one message. Clones share one settlement state.
///
/// A backend makes one only with [`Delivery::new`], never as a struct literal (semantics S6).
/// The literal below is well-typed (it copies every field from a real delivery), so privacy is
/// the only thing that can stop it:
///
/// ```compile_fail
/// fn forge(real: settle::bus::Delivery) -> settle::bus::Delivery {
///     settle::bus::Delivery { ..real } // error[E0451]: field `inner` of struct `Delivery` is private
/// }
/// ```
#[derive(Clone)]
pub struct Delivery {
    inner: Arc<Inner>,
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("subscription", &self.inner.ctx.name)
            .field("subject", &self.inner.subject)
            .field("attempt", &self.inner.attempt)
            .field("settled", &self.is_settled())
            .finish_non_exhaustive()
    }
}

impl Delivery {
    /// The one way to make a delivery: counts it Offered (and a ForeignConflict when its
    /// transport headers contradict its envelope).
    pub fn new(ctx: &Arc<SubscriptionCtx>, opts: DeliveryOptions) -> Delivery {
        let parsed = envelope::parse(&opts.headers, &opts.payload);
        let generation = ctx.offer(!parsed.foreign.is_empty());
        if !parsed.foreign.is_empty() {
            tracing::debug!(subscription = %ctx.name, subject = %opts.subject, foreign = ?parsed.foreign.headers, "transport headers contradict the envelope; keeping the envelope's values");
        }
        Delivery {
            inner: Arc::new(Inner {
                ctx: Arc::clone(ctx),
                subject: opts.subject,
                headers: opts.headers,
                payload: opts.payload,
                attempt: opts.attempt.max(1),
                event: parsed.event,
                foreign: parsed.foreign,
                data: parsed.data,
                settled: AtomicBool::new(false),
                fate: AtomicU8::new(OPEN),
                generation,
                on_settle: opts.on_settle,
            }),
        }
    }

    pub fn subscription(&self) -> &str {
        &self.inner.ctx.name
    }
    pub fn subject(&self) -> &str {
        &self.inner.subject
    }
    /// The raw payload as it arrived.
    pub fn payload(&self) -> &Bytes {
        &self.inner.payload
    }
    /// The transport headers as they arrived.
    pub fn headers(&self) -> &[(String, String)] {
        &self.inner.headers
    }
    /// One transport header, by case-insensitive name.
    pub fn header(&self, name: &str) -> Option<&str> {
        envelope::header(&self.inner.headers, name)
    }
    /// 1 for the first attempt; each redelivery arrives with a higher attempt.
    pub fn attempt(&self) -> u32 {
        self.inner.attempt
    }
    /// The event's identity as its envelope states it.
    pub fn event(&self) -> &EnvelopeEvent {
        &self.inner.event
    }
    /// Transport headers that contradicted the envelope (empty for CloudEvents and raw).
    pub fn foreign(&self) -> &Foreign {
        &self.inner.foreign
    }
    /// Whether a settlement (by any clone) has happened.
    pub fn is_settled(&self) -> bool {
        self.inner.settled.load(Ordering::Acquire)
    }

    /// Decodes the event's data (the payload, CloudEvents `data`, or MassTransit `message`) from JSON.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, DecodeError> {
        let r = match &self.inner.data {
            Data::Bytes(b) => serde_json::from_slice(b),
            Data::Json(v) => T::deserialize(v),
        };
        r.map_err(|source| DecodeError {
            subject: self.inner.subject.clone(),
            source,
        })
    }

    /// Accepts the delivery.
    pub async fn ack(&self) -> Result<(), SettleError> {
        settle(self, Decision::Ack).await
    }
    /// Declines the delivery; under AtLeastOnce it comes back after the backoff schedule.
    pub async fn nack(&self) -> Result<(), SettleError> {
        settle(self, Decision::Nack).await
    }
    /// Declines the delivery and asks that it not come back before `delay` (zero: at once).
    /// Above the ceiling, or with no ceiling, returns an error and records nothing.
    pub async fn nack_after(&self, delay: Duration) -> Result<(), SettleError> {
        settle_with(self, delay).await
    }
    /// `nack_after` from a signed millisecond count (a parsed Retry-After, say): a negative
    /// delay returns an error and records nothing.
    pub async fn nack_after_millis(&self, millis: i64) -> Result<(), SettleError> {
        match u64::try_from(millis) {
            Ok(ms) => settle_with(self, Duration::from_millis(ms)).await,
            Err(_) => Err(SettleError::NegativeDelay(millis)),
        }
    }

    /// The bus, after the handler returned (or panicked): counts the attempt Delivered, and
    /// settles it as Silent unless the handler settled. Returns false when the attempt had
    /// already been released.
    pub(crate) async fn complete(&self) -> bool {
        if self
            .inner
            .fate
            .compare_exchange(OPEN, DELIVERED, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        self.count(|c| &c.delivered);
        if self.is_settled() {
            return true;
        }
        match settle(self, Decision::Silent).await {
            Ok(()) => {
                tracing::debug!(subscription = %self.inner.ctx.name, subject = %self.inner.subject, attempt = self.inner.attempt, "handler returned without settling: counted Silent")
            }
            Err(SettleError::AlreadySettled) => {}
            Err(e) => {
                tracing::warn!(subscription = %self.inner.ctx.name, error = %e, "silent settlement failed")
            }
        }
        true
    }

    /// The bus, giving up an attempt before a handler returned (closing): Released under
    /// AtLeastOnce (the backend owes it back), Lost under AtMostOnce.
    pub(crate) async fn release(&self) {
        if self
            .inner
            .fate
            .compare_exchange(OPEN, RELEASED, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        if self.inner.ctx.policy.at_least_once() {
            self.count(|c| &c.released);
            if !self.is_settled() {
                self.inner.on_settle.release().await;
            }
        } else {
            self.count(|c| &c.lost);
        }
    }

    /// The lease keeper: one `+WPI`.
    pub(crate) async fn progress(&self) -> Result<(), Refusal> {
        self.inner.on_settle.progress().await
    }

    pub(crate) fn ctx(&self) -> &Arc<SubscriptionCtx> {
        &self.inner.ctx
    }

    /// One event of this delivery, counted in the epoch it was offered in.
    pub(crate) fn count(&self, counter: fn(&Counters) -> &Counter) {
        self.inner.ctx.count(self.inner.generation, counter);
    }
}

/// Settles a delivery: the one path the handler's `ack`/`nack`, the bus (silence) and the
/// conformance suite all take. The first settlement of a delivery wins; any later one, from any
/// clone, returns `AlreadySettled`.
pub async fn settle(d: &Delivery, decision: Decision) -> Result<(), SettleError> {
    settle_inner(d, decision, None).await
}

/// Declines a delivery with a delay (`nack_after`): checked against the ceiling first; a refused
/// delay records nothing and leaves the delivery unsettled.
pub async fn settle_with(d: &Delivery, delay: Duration) -> Result<(), SettleError> {
    settle_inner(d, Decision::Nack, Some(delay)).await
}

async fn settle_inner(
    d: &Delivery,
    decision: Decision,
    delay: Option<Duration>,
) -> Result<(), SettleError> {
    let inner = &d.inner;
    let policy = &inner.ctx.policy;
    if let Some(delay) = delay {
        match policy.nack_ceiling() {
            None => return Err(SettleError::NoDelayAllowed(inner.ctx.name.clone())),
            Some(ceiling) if delay > ceiling => {
                return Err(SettleError::DelayTooLong {
                    requested: delay,
                    ceiling,
                });
            }
            Some(_) => {}
        }
    }
    if inner
        .settled
        .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        tracing::warn!(subscription = %inner.ctx.name, subject = %inner.subject, attempt = inner.attempt, ?decision, "second settlement refused: a handler that settles twice has a bug");
        return Err(SettleError::AlreadySettled);
    }
    match decision {
        Decision::Ack => d.count(|c| &c.acked),
        Decision::Nack => d.count(|c| &c.nacked),
        Decision::Silent => d.count(|c| &c.silent),
    }
    if !policy.at_least_once() {
        // AtMostOnce: recorded, never acted on.
        return Ok(());
    }
    let action = match decision {
        Decision::Ack => BrokerAction::Ack,
        Decision::Nack | Decision::Silent => {
            if policy.max_deliver.is_some_and(|m| inner.attempt >= m) {
                d.count(|c| &c.exhausted);
                tracing::warn!(subscription = %inner.ctx.name, subject = %inner.subject, attempt = inner.attempt, "declined on its last attempt: counted Exhausted (data loss)");
                BrokerAction::Terminate
            } else {
                BrokerAction::Decline(delay.unwrap_or_else(|| policy.decline_delay(inner.attempt)))
            }
        }
    };
    match inner.on_settle.settle(action).await {
        Ok(Performed::AsAsked) => Ok(()),
        Ok(Performed::DelayShortened) => {
            d.count(|c| &c.delay_shortened);
            Ok(())
        }
        Err(refusal) => {
            d.count(|c| &c.refused);
            if refusal.stranded && matches!(action, BrokerAction::Decline(_)) {
                d.count(|c| &c.stranded);
            }
            tracing::warn!(subscription = %inner.ctx.name, subject = %inner.subject, ?action, reason = %refusal.reason, "the backend refused a settlement");
            Err(SettleError::Refused(refusal.reason))
        }
    }
}
