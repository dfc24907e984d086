//! The gates on creates a broker refused for one of its limits ([`BrokerLimit`]): after such a
//! refusal on a Backend, further creates held back by the same limit (on one stream for a
//! stream's `max_consumers`, on the whole Backend for an account's or vhost's limit) do not call
//! the broker until the gate opens. Its delay grows with each refusal in a row (1 s doubling to
//! 5 min, with jitter); when it opens, one waiting Subscription probes (it is triggered); the
//! probe's success closes the gate and triggers every waiting Subscription at once. A consumer
//! deleted on that stream or Backend (a place freed) opens it at once, and a change of the
//! Backend drops it. So 2,000 Subscriptions refused by one limit cost the broker one call now
//! and then, not 2,000 retries each.
//!
//! The pure parts ([`Gate`], [`backoff`], [`jittered`]) take the time as an argument; [`Gates`]
//! holds one per Backend and limit, and arms the timer that triggers the probe. It must not call
//! a broker or write status; updates of existing consumers never ask it.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use futures::channel::mpsc::UnboundedSender;
use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;

use super::metrics::Metrics;
use settle::api::Subscription;
use settle::backend::limit::{BrokerLimit, LimitScope};

/// The delay after the first refusal in a row.
pub const FIRST: Duration = Duration::from_secs(1);
/// The longest delay between two probes.
pub const MOST: Duration = Duration::from_secs(300);
/// How long a probe may take before another waiting Subscription probes instead (it may have
/// been deleted, or found its consumer there).
pub const PROBE_LEASE: Duration = Duration::from_secs(30);

/// A Subscription, by namespace and name.
pub type Who = (String, String);
/// A Backend, by namespace and name.
pub type BackendKey = (String, String);

/// The delay after `refusals` refusals in a row, before jitter: 1 s, doubling, at most 5 min.
pub fn backoff(refusals: u32) -> Duration {
    FIRST
        .saturating_mul(1u32 << refusals.saturating_sub(1).min(16))
        .min(MOST)
}

/// `d` with jitter: between half of it and all of it, by `unit` in [0, 1].
pub fn jittered(d: Duration, unit: f64) -> Duration {
    d.mul_f64(0.5 + 0.5 * unit.clamp(0.0, 1.0))
}

/// A number in [0, 1) from the process's random hasher keys (no dependency for one number).
fn random_unit() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// Whether a create may call the broker.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Yes (the gate is open, or this Subscription is its probe).
    Pass,
    /// No: the limit still holds, as far as Settle knows.
    Wait(BrokerLimit),
}

/// One limit's gate on one Backend.
#[derive(Debug)]
pub struct Gate {
    limit: BrokerLimit,
    refusals: u32,
    opens_at: Instant,
    /// The Subscription asking the broker now, and until when it may.
    probe: Option<(Who, Instant)>,
    waiting: BTreeSet<Who>,
    /// The probe that was asking the broker when a freed place opened the gate: its refusal may
    /// answer a call made before the place was freed, so it does not close the gate again.
    stale: Option<Who>,
    /// Changes with each new delay, so an older timer does nothing.
    epoch: u64,
}

impl Gate {
    /// Closed by a first refusal of `who`; opens after `delay`.
    pub fn new(limit: BrokerLimit, who: Who, now: Instant, delay: Duration, epoch: u64) -> Gate {
        Gate {
            limit,
            refusals: 1,
            opens_at: now + delay,
            probe: None,
            waiting: BTreeSet::from([who]),
            stale: None,
            epoch,
        }
    }

    /// Whether `who` may create now; if not it waits for the gate (and is triggered when it
    /// opens). The first to come once the gate is open is its probe.
    pub fn check(&mut self, who: &Who, now: Instant) -> Verdict {
        match &self.probe {
            Some((p, _)) if p == who => return Verdict::Pass,
            Some((_, until)) if now < *until => {}
            _ if now >= self.opens_at => {
                self.probe = Some((who.clone(), now + PROBE_LEASE));
                self.waiting.remove(who);
                return Verdict::Pass;
            }
            _ => {}
        }
        self.waiting.insert(who.clone());
        Verdict::Wait(self.limit.clone())
    }

    /// Refused again: by the probe (or a create once the gate was open), the next delay, longer,
    /// from `unit`'s jitter; by a create that passed before the gate closed (many reconcile at
    /// once), or by the probe that was asking when a freed place opened the gate (its call may
    /// have come before the place was freed), `None`: it only waits too, and the delay does not
    /// grow for it.
    pub fn refused(
        &mut self,
        limit: BrokerLimit,
        who: Who,
        now: Instant,
        unit: f64,
        epoch: u64,
    ) -> Option<Duration> {
        let stale = self.stale.as_ref() == Some(&who);
        if stale {
            self.stale = None;
        }
        let another_probes = self
            .probe
            .as_ref()
            .is_some_and(|(p, until)| *p != who && now < *until);
        let probed = !stale
            && !another_probes
            && (now >= self.opens_at || self.probe.as_ref().is_some_and(|(p, _)| *p == who));
        if !probed {
            if self.probe.as_ref().is_some_and(|(p, _)| *p == who) {
                // Probing again since the gate opened: it passes when it comes.
                return None;
            }
            self.waiting.insert(who);
            return None;
        }
        self.refusals = self.refusals.saturating_add(1);
        let delay = jittered(backoff(self.refusals), unit);
        self.limit = limit;
        self.opens_at = now + delay;
        self.probe = None;
        self.waiting.insert(who);
        self.epoch = epoch;
        Some(delay)
    }

    /// The gate's time has come: the waiting Subscription that probes now (to be triggered), if
    /// the gate is open and no probe runs. A probe whose lease ran out is not waited for again
    /// (it comes back when it reconciles and is still refused).
    pub fn due(&mut self, now: Instant) -> Option<Who> {
        if now < self.opens_at {
            return None;
        }
        if let Some((p, until)) = self.probe.take() {
            if now < until {
                self.probe = Some((p, until));
                return None;
            }
            self.waiting.remove(&p);
        }
        let next = self.waiting.pop_first()?;
        self.probe = Some((next.clone(), now + PROBE_LEASE));
        Some(next)
    }

    /// A place was freed (a consumer deleted): open now, the delay kept for the next refusal.
    pub fn open(&mut self, now: Instant, epoch: u64) {
        self.opens_at = now;
        if let Some((p, _)) = self.probe.take() {
            self.waiting.insert(p.clone());
            self.stale = Some(p);
        }
        self.epoch = epoch;
    }

    /// `who` no longer waits (it was deleted).
    pub fn forget(&mut self, who: &Who) {
        self.waiting.remove(who);
        if self.stale.as_ref() == Some(who) {
            self.stale = None;
        }
        if self.probe.as_ref().is_some_and(|(p, _)| p == who) {
            self.probe = None;
        }
    }

    pub fn opens_at(&self) -> Instant {
        self.opens_at
    }

    pub fn waiting(&self) -> &BTreeSet<Who> {
        &self.waiting
    }

    pub fn limit(&self) -> &BrokerLimit {
        &self.limit
    }
}

type Map = HashMap<(BackendKey, LimitScope), Gate>;

/// Every Backend's gates, and where their triggers go.
pub struct Gates {
    inner: Arc<Mutex<Map>>,
    trigger: UnboundedSender<ObjectRef<Subscription>>,
    metrics: Metrics,
    epochs: Arc<AtomicU64>,
}

fn lock(m: &Mutex<Map>) -> MutexGuard<'_, Map> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn send(trigger: &UnboundedSender<ObjectRef<Subscription>>, who: &Who) {
    let _ = trigger.unbounded_send(ObjectRef::new(&who.1).within(&who.0));
}

impl Gates {
    pub fn new(trigger: UnboundedSender<ObjectRef<Subscription>>, metrics: Metrics) -> Gates {
        Gates {
            inner: Arc::default(),
            trigger,
            metrics,
            epochs: Arc::default(),
        }
    }

    fn epoch(&self) -> u64 {
        self.epochs.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Whether `who` waits on a closed gate of `backend` (asked before any broker call: a
    /// waiting Subscription costs the broker nothing); `None`: go on.
    pub fn held(&self, backend: &BackendKey, who: &Who) -> Option<BrokerLimit> {
        let now = Instant::now();
        let mut map = lock(&self.inner);
        let verdict = map
            .iter_mut()
            .filter(|((b, _), g)| b == backend && g.waiting.contains(who))
            .find_map(|(_, g)| match g.check(who, now) {
                Verdict::Wait(l) => Some(l),
                Verdict::Pass => None,
            });
        if let Some(l) = &verdict {
            self.metrics.gated(l.label());
        }
        verdict
    }

    /// Whether `who` may create on `stream` of `backend` now (its stream's gate and the
    /// Backend's); if not, it waits and is triggered when the gate opens.
    pub fn check(&self, backend: &BackendKey, stream: &str, who: &Who) -> Option<BrokerLimit> {
        let now = Instant::now();
        let mut map = lock(&self.inner);
        let mut held = None;
        for scope in [LimitScope::Backend, LimitScope::Stream(stream.to_string())] {
            if let Some(g) = map.get_mut(&(backend.clone(), scope))
                && let Verdict::Wait(l) = g.check(who, now)
            {
                held = Some(l);
                break;
            }
        }
        if let Some(l) = &held {
            self.metrics.gated(l.label());
            self.publish(&map, backend);
        }
        held
    }

    /// The limit a gate of `backend` holds for `scope`, as it was named at its first refusal.
    pub fn known(&self, backend: &BackendKey, scope: &LimitScope) -> Option<BrokerLimit> {
        lock(&self.inner)
            .get(&(backend.clone(), scope.clone()))
            .map(|g| g.limit.clone())
    }

    /// A create of `who` on `backend` was refused for `limit`: its gate closes (or stays closed
    /// longer); the delay before it opens.
    pub fn refused(&self, backend: &BackendKey, limit: BrokerLimit, who: &Who) -> Duration {
        let now = Instant::now();
        let epoch = self.epoch();
        let key = (backend.clone(), limit.scope());
        let mut map = lock(&self.inner);
        let (delay, armed) = match map.get_mut(&key) {
            Some(g) => match g.refused(limit, who.clone(), now, random_unit(), epoch) {
                Some(delay) => (delay, true),
                None => (g.opens_at.saturating_duration_since(now), false),
            },
            None => {
                let delay = jittered(backoff(1), random_unit());
                map.insert(
                    key.clone(),
                    Gate::new(limit, who.clone(), now, delay, epoch),
                );
                (delay, true)
            }
        };
        self.publish(&map, backend);
        drop(map);
        if armed {
            self.arm(key, epoch, now + delay);
        }
        delay
    }

    /// A create on `stream` of `backend` succeeded: the limit no longer holds, its gates go and
    /// every Subscription waiting on them is triggered.
    pub fn created(&self, backend: &BackendKey, stream: &str) {
        let mut map = lock(&self.inner);
        let mut woken = BTreeSet::new();
        for scope in [LimitScope::Backend, LimitScope::Stream(stream.to_string())] {
            if let Some(g) = map.remove(&(backend.clone(), scope)) {
                tracing::info!(backend = %format!("{}/{}", backend.0, backend.1), limit = g.limit.label(), waiting = g.waiting.len(), "the broker took a create again: its limit's gate is open");
                woken.extend(g.waiting);
            }
        }
        if !woken.is_empty() {
            self.publish(&map, backend);
        }
        drop(map);
        for who in &woken {
            send(&self.trigger, who);
        }
    }

    /// A consumer on `stream` of `backend` was deleted (`None`: a queue, or anything on the
    /// Backend): the gates it may have freed a place for open now, and one waiting Subscription
    /// probes.
    pub fn freed(&self, backend: &BackendKey, stream: Option<&str>) {
        let now = Instant::now();
        let mut map = lock(&self.inner);
        let mut probes = Vec::new();
        for ((b, scope), g) in map.iter_mut() {
            let hit = match (scope, stream) {
                (LimitScope::Backend, _) | (_, None) => true,
                (LimitScope::Stream(s), Some(freed)) => s == freed,
            };
            if b == backend && hit {
                g.open(now, self.epochs.fetch_add(1, Ordering::Relaxed) + 1);
                if let Some(who) = g.due(now) {
                    probes.push(who);
                }
            }
        }
        drop(map);
        for who in &probes {
            send(&self.trigger, who);
        }
    }

    /// Backend `backend` changed or is gone: its gates go (what its broker allows may have
    /// changed), and their waiting Subscriptions are triggered.
    pub fn drop_backend(&self, backend: &BackendKey) {
        let mut map = lock(&self.inner);
        let mut woken = BTreeSet::new();
        map.retain(|(b, _), g| {
            if b == backend {
                woken.append(&mut g.waiting);
                false
            } else {
                true
            }
        });
        self.publish(&map, backend);
        drop(map);
        for who in &woken {
            send(&self.trigger, who);
        }
    }

    /// Subscription `who` on `backend` is gone: it no longer waits.
    pub fn forget(&self, backend: &BackendKey, who: &Who) {
        let mut map = lock(&self.inner);
        for ((b, _), g) in map.iter_mut() {
            if b == backend {
                g.forget(who);
            }
        }
        self.publish(&map, backend);
    }

    /// `settle_backend_gated{namespace,backend,limit}`: the Subscriptions waiting on a gate.
    fn publish(&self, map: &Map, backend: &BackendKey) {
        let mut by: HashMap<&'static str, i64> = HashMap::new();
        for ((b, _), g) in map.iter() {
            if b == backend {
                let n = i64::try_from(g.waiting.len() + usize::from(g.probe.is_some()))
                    .unwrap_or(i64::MAX);
                *by.entry(g.limit.label()).or_default() += n;
            }
        }
        self.metrics.backend_gated(&backend.0, &backend.1, &by);
    }

    /// When the gate of `key` at `epoch` opens (at `at`), its probe is triggered; a probe that
    /// does not come back within its lease hands over to the next waiting Subscription.
    fn arm(&self, key: (BackendKey, LimitScope), epoch: u64, at: Instant) {
        let inner: Weak<Mutex<Map>> = Arc::downgrade(&self.inner);
        let trigger = self.trigger.clone();
        tokio::spawn(async move {
            let mut at = at;
            loop {
                tokio::time::sleep_until(at).await;
                let Some(inner) = inner.upgrade() else { return };
                let mut map = lock(&inner);
                let Some(g) = map.get_mut(&key).filter(|g| g.epoch == epoch) else {
                    return;
                };
                let now = Instant::now();
                let Some(who) = g.due(now) else { return };
                drop(map);
                tracing::debug!(backend = %format!("{}/{}", key.0.0, key.0.1), subscription = %format!("{}/{}", who.0, who.1), "a limit's gate opens: one Subscription asks the broker");
                send(&trigger, &who);
                at = now + PROBE_LEASE;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use settle::backend::limit::SetBy;

    fn limit() -> BrokerLimit {
        BrokerLimit::StreamConsumers {
            stream: "ORDERS".into(),
            max: Some(3),
            set_by: SetBy::Stream,
        }
    }

    fn who(n: &str) -> Who {
        ("shop".into(), n.into())
    }

    #[test]
    fn the_delay_doubles_from_a_second_to_five_minutes() {
        let secs: Vec<u64> = (1..=11).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(backoff(u32::MAX), MOST);
    }

    #[test]
    fn jitter_stays_between_half_and_all_of_the_delay() {
        let d = Duration::from_secs(40);
        assert_eq!(jittered(d, 0.0), Duration::from_secs(20));
        assert_eq!(jittered(d, 1.0), d);
        assert_eq!(jittered(d, 7.0), d, "clamped");
        for _ in 0..1000 {
            let u = random_unit();
            assert!((0.0..1.0).contains(&u), "{u}");
            let j = jittered(d, u);
            assert!(j >= d / 2 && j <= d, "{j:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_closed_gate_holds_everyone_until_it_opens_then_one_probes() {
        let t0 = Instant::now();
        let mut g = Gate::new(limit(), who("a"), t0, Duration::from_secs(1), 1);
        assert_eq!(g.check(&who("b"), t0), Verdict::Wait(limit()));
        assert_eq!(g.due(t0), None, "not yet");
        tokio::time::advance(Duration::from_millis(1000)).await;
        let t1 = Instant::now();
        assert_eq!(g.due(t1), Some(who("a")), "the first waiting one probes");
        assert_eq!(g.check(&who("a"), t1), Verdict::Pass);
        assert_eq!(
            g.check(&who("b"), t1),
            Verdict::Wait(limit()),
            "one probe at a time"
        );
        assert_eq!(g.due(t1), None, "the probe runs");
        // The probe refused again: closed for longer (2 s with jitter: 1 to 2 s).
        let d = g
            .refused(limit(), who("a"), t1, 0.5, 2)
            .expect("a new delay");
        assert_eq!(d, Duration::from_millis(1500));
        assert_eq!(g.opens_at(), t1 + d);
        assert_eq!(g.waiting().len(), 2);
        // A create that passed before the gate closed, refused too: it waits, the delay is
        // the same (a thousand at once do not push it to five minutes).
        assert_eq!(g.refused(limit(), who("c"), t1, 1.0, 3), None);
        assert_eq!(g.opens_at(), t1 + d);
        assert_eq!(g.waiting().len(), 3);
        tokio::time::advance(d).await;
        let t2 = Instant::now();
        assert_eq!(g.check(&who("b"), t2), Verdict::Pass, "open: b probes");
        let d = g
            .refused(limit(), who("b"), t2, 1.0, 4)
            .expect("a new delay");
        assert_eq!(d, Duration::from_secs(4), "doubling");
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_that_does_not_come_back_hands_over_and_a_freed_place_opens_at_once() {
        let t0 = Instant::now();
        let mut g = Gate::new(limit(), who("a"), t0, Duration::from_secs(8), 1);
        g.check(&who("b"), t0);
        // A consumer deleted: open now, one probes.
        g.open(t0, 2);
        assert_eq!(g.due(t0), Some(who("a")));
        tokio::time::advance(PROBE_LEASE).await;
        let t1 = Instant::now();
        assert_eq!(g.due(t1), Some(who("b")), "a's lease ran out: b probes");
        assert!(!g.waiting().contains(&who("a")));
        // A newcomer once the gate is open and no probe runs: it probes itself.
        tokio::time::advance(PROBE_LEASE).await;
        assert_eq!(g.check(&who("c"), Instant::now()), Verdict::Pass);
        g.forget(&who("c"));
        assert_eq!(g.check(&who("d"), Instant::now()), Verdict::Pass);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_of_the_call_made_before_a_place_was_freed_does_not_close_the_gate_again() {
        let t0 = Instant::now();
        let mut g = Gate::new(limit(), who("a"), t0, Duration::from_secs(1), 1);
        g.check(&who("b"), t0);
        tokio::time::advance(Duration::from_secs(1)).await;
        let t1 = Instant::now();
        assert_eq!(g.check(&who("a"), t1), Verdict::Pass, "a probes");
        // While a's call is out, a consumer is deleted: open, and b probes.
        g.open(t1, 2);
        assert_eq!(g.due(t1), Some(who("a")), "the first waiting one probes");
        // a's refusal answers the call made before the place was freed.
        assert_eq!(g.refused(limit(), who("a"), t1, 1.0, 3), None);
        assert_eq!(g.opens_at(), t1, "still open");
        assert_eq!(g.check(&who("a"), t1), Verdict::Pass, "a probes again");
        assert_eq!(
            g.check(&who("b"), t1),
            Verdict::Wait(limit()),
            "one probe at a time"
        );
        // Refused again, now for a call after the free: the gate closes, the delay grown.
        let d = g
            .refused(limit(), who("a"), t1, 1.0, 4)
            .expect("closed again");
        assert_eq!(d, Duration::from_secs(2));

        // With another one chosen to probe meanwhile, the stale refusal only waits too.
        let t2 = t1 + d;
        tokio::time::advance(d).await;
        assert_eq!(g.check(&who("a"), t2), Verdict::Pass);
        g.open(t2, 5);
        g.forget(&who("a"));
        assert_eq!(g.due(t2), Some(who("b")));
        assert_eq!(
            g.refused(limit(), who("a"), t2, 1.0, 6),
            None,
            "a was forgotten, b probes"
        );
        assert_eq!(g.check(&who("b"), t2), Verdict::Pass, "b's probe stands");
    }

    #[tokio::test(start_paused = true)]
    async fn the_registry_triggers_the_probe_when_the_gate_opens_and_everyone_on_success() {
        let (tx, mut rx) = futures::channel::mpsc::unbounded();
        let metrics =
            Metrics::new(&prometheus::Registry::new(), &Default::default()).expect("metrics");
        let gates = Gates::new(tx, metrics);
        let b: BackendKey = ("shop".into(), "nats".into());
        let d = gates.refused(&b, limit(), &who("a"));
        assert!(d >= Duration::from_millis(500) && d <= FIRST, "{d:?}");
        assert_eq!(gates.check(&b, "ORDERS", &who("b")), Some(limit()));
        assert_eq!(
            gates.check(&b, "OTHER", &who("c")),
            None,
            "another stream is not held"
        );
        assert_eq!(gates.held(&b, &who("b")), Some(limit()));
        assert_eq!(gates.held(&b, &who("c")), None);
        assert!(rx.try_recv().is_err(), "nothing triggered while closed");
        tokio::time::sleep(d + Duration::from_millis(1)).await;
        let probe = rx.try_recv().expect("a trigger");
        assert_eq!(probe.name, "a");
        assert!(rx.try_recv().is_err(), "only one probe");
        assert_eq!(
            gates.held(&b, &who("b")),
            Some(limit()),
            "b still waits while a probes"
        );
        gates.created(&b, "ORDERS");
        let woken = rx.try_recv().expect("a trigger");
        assert_eq!(woken.name, "b");
        assert_eq!(gates.held(&b, &who("b")), None);
        assert_eq!(
            gates.check(&b, "ORDERS", &who("b")),
            None,
            "the gate is gone"
        );

        // Closed again, then a consumer deleted on the stream: one probes at once.
        gates.refused(&b, limit(), &who("a"));
        gates.check(&b, "ORDERS", &who("b"));
        gates.freed(&b, Some("OTHER"));
        assert!(
            rx.try_recv().is_err(),
            "another stream's consumer frees nothing here"
        );
        gates.freed(&b, Some("ORDERS"));
        assert_eq!(rx.try_recv().expect("a trigger").name, "a");
        assert!(rx.try_recv().is_err());
        gates.drop_backend(&b);
        let mut rest: Vec<String> = std::iter::from_fn(|| rx.try_recv().ok())
            .map(|r| r.name)
            .collect();
        rest.sort();
        assert_eq!(rest, ["b"], "a probes already; b is woken");
    }
}
