//! The in-memory backend: the embedded default for tests and local development. Holds every
//! published message in process, delivers it to each matching subscription (fanout), redelivers
//! declined messages after their delay, and keeps durable consumers for as long as the backend
//! value lives (so a bus restarted on the same `MemoryBroker` resumes where it left off).
//!
//! It never hands a message on while a handler runs (no AckWait), so SlowHandler does nothing
//! here (docs/semantics.md H4). It must not count anything itself: counting is the settle
//! path's job.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::bus::{
    Broker, BrokerAction, BusError, Consumer, Delivery, DeliveryOptions, OnSettle, Performed,
    Refusal, StatsSink, SubscriptionCtx,
};
use crate::policy::BackendKind;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The in-memory backend. Clones share one store.
#[derive(Clone, Default)]
pub struct MemoryBroker {
    store: Arc<Store>,
}

/// The one store every clone of a [`MemoryBroker`] reads and writes: the message log, the
/// consumers, the stats reports.
#[derive(Default)]
struct Store {
    state: Mutex<State>,
    reports: Mutex<BTreeMap<String, Bytes>>,
    ids: AtomicU64,
}

#[derive(Default)]
struct State {
    log: Vec<Stored>,
    consumers: HashMap<String, Arc<ConsumerState>>,
}

struct Stored {
    subject: String,
    headers: Vec<(String, String)>,
    payload: Bytes,
}

struct ConsumerState {
    pattern: String,
    acks: bool,
    queue: Mutex<Queue>,
    notify: Notify,
}

#[derive(Default)]
struct Queue {
    /// Ready now, in publish order: seq → attempts spent.
    ready: BTreeMap<usize, u32>,
    /// Waiting out a delay: (ready_at, seq, attempts spent).
    delayed: BinaryHeap<Reverse<(Instant, usize, u32)>>,
    /// Handed out and not settled: token → (attachment, message).
    in_flight: HashMap<u64, (u64, Pending)>,
    live: Vec<u64>,
}

#[derive(Clone, Copy)]
struct Pending {
    seq: usize,
    /// Attempts spent so far.
    attempts: u32,
}

impl Queue {
    fn put_back(&mut self, p: Pending, ready_at: Option<Instant>) {
        match ready_at {
            Some(t) => self.delayed.push(Reverse((t, p.seq, p.attempts))),
            None => {
                self.ready.insert(p.seq, p.attempts);
            }
        }
    }
}

/// Whether `subject` matches the NATS-style `pattern` (`*` one token, `>` one or more at the end).
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

impl MemoryBroker {
    pub fn new() -> MemoryBroker {
        MemoryBroker::default()
    }

    /// The stats reports published to this backend, by key.
    pub fn reports(&self) -> BTreeMap<String, Bytes> {
        lock(&self.store.reports).clone()
    }

    /// Messages of a durable consumer waiting to be offered (ready or delayed).
    pub fn pending(&self, durable_name: &str) -> usize {
        let state = lock(&self.store.state);
        state.consumers.get(durable_name).map_or(0, |c| {
            let q = lock(&c.queue);
            q.ready.len() + q.delayed.len()
        })
    }

    fn id(&self) -> u64 {
        self.store.ids.fetch_add(1, Ordering::Relaxed) + 1
    }
}

impl Broker for MemoryBroker {
    fn kind(&self) -> BackendKind {
        BackendKind::Memory
    }

    fn hands_on_slow_handlers(&self) -> bool {
        false
    }

    fn open(
        &self,
        ctx: Arc<SubscriptionCtx>,
    ) -> BoxFuture<'_, Result<Box<dyn Consumer>, BusError>> {
        async move {
            let policy = ctx.policy();
            let attachment = self.id();
            let cs = {
                let mut state = lock(&self.store.state);
                let key = match &policy.durable_name {
                    Some(d) => d.clone(),
                    None => format!("_ephemeral-{attachment}"),
                };
                if let Some(existing) = state.consumers.get(&key) {
                    if existing.pattern != policy.pattern {
                        return Err(BusError::backend(
                            BackendKind::Memory,
                            format!("durable consumer {key:?} exists with pattern {:?}, not {:?}: use another durableName", existing.pattern, policy.pattern),
                        ));
                    }
                    Arc::clone(existing)
                } else {
                    // A durable consumer starts from the first stored message; an ephemeral one from now.
                    let ready = if policy.durable_name.is_some() {
                        state.log.iter().enumerate().filter(|(_, m)| subject_matches(&policy.pattern, &m.subject)).map(|(seq, _)| (seq, 0)).collect()
                    } else {
                        BTreeMap::new()
                    };
                    let cs = Arc::new(ConsumerState {
                        pattern: policy.pattern.clone(),
                        acks: policy.at_least_once(),
                        queue: Mutex::new(Queue { ready, ..Queue::default() }),
                        notify: Notify::new(),
                    });
                    state.consumers.insert(key, Arc::clone(&cs));
                    cs
                }
            };
            lock(&cs.queue).live.push(attachment);
            Ok(Box::new(MemoryConsumer { backend: self.clone(), ctx, cs, attachment, retired: false }) as Box<dyn Consumer>)
        }
        .boxed()
    }

    fn publish(
        &self,
        subject: String,
        headers: Vec<(String, String)>,
        payload: Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>> {
        let mut state = lock(&self.store.state);
        let seq = state.log.len();
        for cs in state.consumers.values() {
            if subject_matches(&cs.pattern, &subject) {
                lock(&cs.queue).ready.insert(seq, 0);
                cs.notify.notify_waiters();
            }
        }
        state.log.push(Stored {
            subject,
            headers,
            payload,
        });
        futures::future::ready(Ok(())).boxed()
    }

    fn stats_sink(&self) -> Option<Arc<dyn StatsSink>> {
        Some(Arc::new(self.clone()))
    }
}

impl StatsSink for MemoryBroker {
    fn put(&self, key: String, value: Bytes) -> BoxFuture<'_, Result<(), BusError>> {
        lock(&self.store.reports).insert(key, value);
        futures::future::ready(Ok(())).boxed()
    }
}

struct MemoryConsumer {
    backend: MemoryBroker,
    ctx: Arc<SubscriptionCtx>,
    cs: Arc<ConsumerState>,
    attachment: u64,
    retired: bool,
}

enum Next {
    Ready(Pending, u64),
    WaitUntil(Instant),
    Wait,
    Retired,
}

impl MemoryConsumer {
    fn take(&self) -> Next {
        let mut q = lock(&self.cs.queue);
        if self.retired || !q.live.contains(&self.attachment) {
            return Next::Retired;
        }
        let now = Instant::now();
        while let Some(Reverse((t, seq, attempts))) = q.delayed.peek().copied() {
            if t > now {
                break;
            }
            q.delayed.pop();
            q.ready.insert(seq, attempts);
        }
        match q.ready.pop_first() {
            Some((seq, attempts)) => {
                let p = Pending {
                    seq,
                    attempts: attempts + 1,
                };
                let token = self.backend.id();
                if self.cs.acks {
                    q.in_flight.insert(token, (self.attachment, p));
                }
                Next::Ready(p, token)
            }
            None => match q.delayed.peek() {
                Some(Reverse((t, _, _))) => Next::WaitUntil(*t),
                None => Next::Wait,
            },
        }
    }

    fn delivery(&self, p: Pending, token: u64) -> Delivery {
        let (subject, headers, payload) = {
            let state = lock(&self.backend.store.state);
            match state.log.get(p.seq) {
                Some(m) => (m.subject.clone(), m.headers.clone(), m.payload.clone()),
                None => (String::new(), Vec::new(), Bytes::new()),
            }
        };
        Delivery::new(
            &self.ctx,
            DeliveryOptions {
                subject,
                headers,
                payload,
                attempt: p.attempts,
                on_settle: Box::new(MemorySettler {
                    cs: Arc::clone(&self.cs),
                    token,
                }),
            },
        )
    }
}

impl Consumer for MemoryConsumer {
    fn next(&mut self) -> BoxFuture<'_, Option<Delivery>> {
        async move {
            loop {
                let notified = self.cs.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                match self.take() {
                    Next::Ready(p, token) => return Some(self.delivery(p, token)),
                    Next::Retired => return None,
                    Next::WaitUntil(t) => {
                        tokio::select! {
                            _ = &mut notified => {}
                            _ = tokio::time::sleep_until(t) => {}
                        }
                    }
                    Next::Wait => notified.await,
                }
            }
        }
        .boxed()
    }

    fn retire(&mut self) -> BoxFuture<'_, ()> {
        self.retired = true;
        let mut q = lock(&self.cs.queue);
        q.live.retain(|a| *a != self.attachment);
        // Unsettled messages of this attachment go back, ready at once, attempts kept.
        let mine: Vec<u64> = q
            .in_flight
            .iter()
            .filter(|(_, (a, _))| *a == self.attachment)
            .map(|(t, _)| *t)
            .collect();
        for t in mine {
            if let Some((_, p)) = q.in_flight.remove(&t) {
                q.put_back(p, None);
            }
        }
        drop(q);
        self.cs.notify.notify_waiters();
        futures::future::ready(()).boxed()
    }
}

struct MemorySettler {
    cs: Arc<ConsumerState>,
    token: u64,
}

impl MemorySettler {
    fn requeue(&self, delay: Duration) -> bool {
        let mut q = lock(&self.cs.queue);
        let Some((_, p)) = q.in_flight.remove(&self.token) else {
            return false;
        };
        q.put_back(p, (!delay.is_zero()).then(|| Instant::now() + delay));
        drop(q);
        self.cs.notify.notify_waiters();
        true
    }
}

impl OnSettle for MemorySettler {
    fn settle(&self, action: BrokerAction) -> BoxFuture<'_, Result<Performed, Refusal>> {
        let done = match action {
            BrokerAction::Ack | BrokerAction::Terminate => {
                lock(&self.cs.queue).in_flight.remove(&self.token).is_some()
            }
            BrokerAction::Decline(delay) => self.requeue(delay),
        };
        let r = if done {
            Ok(Performed::AsAsked)
        } else {
            Err(Refusal {
                reason: "the consumer that offered this delivery was retired; the message is offered again to the next consumer".to_string(),
                stranded: false,
            })
        };
        futures::future::ready(r).boxed()
    }

    fn progress(&self) -> BoxFuture<'_, Result<(), Refusal>> {
        futures::future::ready(Ok(())).boxed()
    }

    fn release(&self) -> BoxFuture<'_, ()> {
        self.requeue(Duration::ZERO);
        futures::future::ready(()).boxed()
    }
}
