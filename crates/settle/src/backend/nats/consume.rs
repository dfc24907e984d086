//! Consuming from JetStream: the pull consumer a subscription binds to (created from the
//! mapping, or brought in line with it, for a code-defined subscription; waited for when the
//! operator makes it), each JetStream message turned into a `Delivery`, and its settlement with
//! JetStream's ack protocol.
//!
//! What it sends, and why (docs/semantics.md J1–J7, J11):
//! - Ack: `+ACK`, fire-and-forget (as any JetStream client does). A late ack after the consumer
//!   was retired by this process is Refused locally.
//! - Decline: a bare `-NAK` for a zero delay (a `{"delay":0}` is not immediate on a consumer with
//!   a `backoff` list), else `-NAK {"delay":<ns>}`. Sent as a request, so the server confirms it:
//!   when nobody answers (the consumer was deleted) the decline is Refused and, since the broker
//!   cannot be asked to try again, Stranded. Nobody answers a clustered consumer for the few
//!   seconds it has no leader either (its leader's server lost): unless the JetStream API says
//!   the consumer is gone for [`GONE_CONFIRMED`] running, the decline is sent again for up to
//!   [`LEADERLESS_GRACE`].
//! - Last attempt declined (attempt == maxDeliver): `+TERM`. The runtime has already counted it
//!   Exhausted at message grain; terminating frees its max-ack-pending slot at once instead of
//!   holding it until the server notices max_deliver (its ack wait, or the next pull), and the server's
//!   `MSG_TERMINATED` advisory tells the operator the same story. The consumer's `max_deliver` is
//!   still set, so attempts spent without a handler (a crash, AckWait) also stop there.
//! - ExtendLease: `+WPI` (the bus decides when); Redeliver: nothing. Release at close: bare `-NAK`.
//! - Pull: at most maxInFlight messages (at least 2) and [`NatsBroker::pull_bytes`] bytes at a
//!   time, so the subscriptions sharing a connection do not overrun the server's `max_pending`
//!   for it (J11).
//! - The consumer's `backoff` list is never set: the server would lengthen every nak delay by it;
//!   the schedule is paced client-side with delayed naks.
//!
//! It must not count anything (the settle path does), create streams (the platform or the
//! operator owns them), decide what a consumer looks like (that is [`super::mapping`]) nor
//! change a consumer the operator owns.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull};
use async_nats::{Client, RequestErrorKind, Subject};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};

use super::{NatsBroker, admin, err, mapping};
use crate::bus::{
    self, BrokerAction, BusError, Consumer, ConsumerOwner, Delivery, DeliveryOptions, OnSettle,
    Performed, Refusal, SubscriptionCtx,
};

const ACK: &[u8] = b"+ACK";
const NAK: &[u8] = b"-NAK";
const TERM: &[u8] = b"+TERM";
const WPI: &[u8] = b"+WPI";

/// How long a decline nobody answered is sent again while the consumer may still exist: a
/// clustered consumer whose leader was lost has none until its replicas elect one (nats-server
/// waits 4–9 s of silence, then votes; 6–18 s on the test cluster).
pub const LEADERLESS_GRACE: Duration = Duration::from_secs(15);
/// How long the JetStream API must say the consumer is gone, running, before such a decline is
/// Stranded: a server that has just become meta leader can answer "not found" for a consumer
/// it has not applied yet (seen on the test cluster after a restart).
pub const GONE_CONFIRMED: Duration = Duration::from_secs(5);
/// The most bytes one pull asks for, by default (semantics J11): 2 MiB, so a subscription has
/// at most about 3 MiB under way on the connection (the client pulls again at half), and about
/// twenty subscriptions of large messages stay under the server's default `max_pending` of
/// 64 MiB together. A pull of 250 messages of 64 KiB would be 16 MiB.
pub const DEFAULT_PULL_BYTES: usize = 2 << 20;
/// What a pull holds beyond the largest payload: the server counts a message's subject and ack
/// reply against a pull's bytes as well as its headers and payload.
pub const PULL_BYTES_MARGIN: usize = 16 << 10;
/// The fewest messages one pull asks for (semantics J11). The server never has more than
/// maxInFlight unacknowledged anyway (`max_ack_pending`), so a larger pull only waits longer at
/// the server. With one in flight, pulls of 2 cost a pull request every two messages and, with
/// ten such subscriptions on one connection, left some waiting for messages the stream held until
/// their pull expired (async-nats' missed-heartbeat error said so, seen in the runtime matrix);
/// pulls of 10 did neither.
pub const MIN_PULL_BATCH: usize = 10;

impl NatsBroker {
    /// The UID mark of the operator's consumer subscription `name` is bound to, read now.
    pub(super) async fn mark_of(&self, name: &str) -> Option<String> {
        let (stream, consumer) = self.bound.lock().ok()?.get(name).cloned()?;
        match admin::consumer_info(&self.js, &stream, &consumer).await {
            Ok(Some(info)) => info.config.metadata.get(mapping::UID_KEY).cloned(),
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(subscription = %name, error = %e, "cannot read the consumer's mark again");
                None
            }
        }
    }

    /// A consumer pulling from the subscription's JetStream consumer (see [`NatsBroker::bind`]).
    pub(super) async fn consume(
        &self,
        ctx: Arc<SubscriptionCtx>,
    ) -> Result<Box<dyn Consumer>, BusError> {
        let (messages, made) = self.bind(&ctx).await?;
        Ok(Box::new(NatsConsumer {
            broker: self.clone(),
            client: Arc::new(self.client.clone()),
            js: Arc::new(self.js.clone()),
            acks: ctx.policy().at_least_once(),
            ctx,
            messages: Some(messages),
            retired: Arc::default(),
            bound: Arc::default(),
            made,
        }))
    }

    /// Finds or makes the subscription's consumer (through the one mapping in `consumer`) and
    /// starts pulling from it. A code-defined subscription creates its consumer, or brings an
    /// existing one in line (refusing when only a new consumer could); one the operator owns is
    /// only bound to, waiting while it does not exist. Also says when the consumer was made
    /// (by the server's clock), which tells one made again from the same one bound again.
    async fn bind(&self, ctx: &SubscriptionCtx) -> Result<(pull::Stream, i128), BusError> {
        let (stream, name) = match ctx.binding().owner {
            ConsumerOwner::Runtime => self.converge_own(ctx).await?,
            ConsumerOwner::Operator => self.await_operator(ctx).await,
        };
        let p = ctx.policy();
        let mut consumer: jetstream::consumer::PullConsumer = self
            .js
            .get_consumer_from_stream(&name, &stream)
            .await
            .map_err(|e| err(format!("consumer {name} on stream {stream}: {e}")))?;
        let mut made = consumer.cached_info().created.unix_timestamp_nanos();
        if ctx.binding().owner == ConsumerOwner::Operator {
            // The object the operator made this consumer for: the counts from here on are its.
            let info = consumer
                .info()
                .await
                .map_err(|e| err(format!("consumer {name} on stream {stream}: {e}")))?;
            made = info.created.unix_timestamp_nanos();
            ctx.bound_to(
                info.config
                    .metadata
                    .get(mapping::UID_KEY)
                    .map(String::as_str),
            );
            if let Ok(mut bound) = self.bound.lock() {
                bound.insert(ctx.name().to_string(), (stream.clone(), name.clone()));
            }
        }
        // The server caps deliveries at max_ack_pending anyway; small pulls stall (see
        // MIN_PULL_BATCH).
        let batch = p.max_in_flight.clamp(MIN_PULL_BATCH, 1000);
        let messages = consumer
            .stream()
            .max_messages_per_batch(batch)
            // Bytes bounded too: every subscription shares the connection, and the server closes
            // one with more than its max_pending waiting to be read (a slow consumer), dropping
            // what was under way (semantics J11).
            .max_bytes_per_batch(self.pull_bytes())
            // Short pulls: after a broker restart the client re-pulls when a pull expires, so
            // this bounds how long a subscription can sit idle (semantics J7).
            .expires(Duration::from_secs(10))
            .heartbeat(Duration::from_secs(3))
            .messages()
            .await
            .map_err(|e| err(format!("cannot pull from stream {stream}: {e}")))?;
        tracing::info!(subscription = %ctx.name(), %stream, consumer = %name, owner = ?ctx.binding().owner, "bound to a JetStream pull consumer");
        Ok((messages, made))
    }

    /// A code-defined subscription's consumer: created from the mapping, or updated to it.
    async fn converge_own(&self, ctx: &SubscriptionCtx) -> Result<(String, String), BusError> {
        let b = ctx.binding();
        let p = ctx.policy();
        let stream = admin::resolve_stream(&self.js, b.stream.as_deref(), &p.pattern).await?;
        let want = mapping::desired_by_runtime(&b.namespace, ctx.name(), &stream, p);
        match admin::consumer_info(&self.js, &stream, &want.name).await? {
            None => {
                admin::create_consumer(&self.js, &want).await?;
            }
            Some(info) => {
                let live = mapping::normalise(&stream, &want.name, &info.config);
                let d = mapping::diff(&want, &live);
                if !d.immutable.is_empty() {
                    return Err(err(format!(
                        "consumer {} on stream {stream} exists with a config that cannot change in place ({}): \
                         delete it, or choose another durableName",
                        want.name,
                        d.immutable
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join("; ")
                    )));
                }
                if !d.editable.is_empty() {
                    tracing::info!(subscription = %ctx.name(), consumer = %want.name, changes = %d.editable.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "), "updating the consumer to the subscription's policy");
                    admin::update_consumer(&self.js, &want).await?;
                }
            }
        }
        Ok((stream, want.name))
    }

    /// An operator-owned consumer: waits, logging why, until the stream and the consumer exist;
    /// warns (never silently) when the consumer differs from the policy this runtime runs.
    async fn await_operator(&self, ctx: &SubscriptionCtx) -> (String, String) {
        let b = ctx.binding();
        let p = ctx.policy();
        let js = &self.js;
        bus::await_operator(ctx.name(), "consumer", move || async move {
            let stream = admin::resolve_stream(js, b.stream.as_deref(), &p.pattern)
                .await
                .map_err(|e| e.to_string())?;
            let want = mapping::desired(&b.namespace, ctx.name(), &stream, p);
            match admin::consumer_info(js, &stream, &want.name).await {
                Ok(Some(info)) => {
                    let live = mapping::normalise(&stream, &want.name, &info.config);
                    // The object mark is the operator's own, not the application's policy.
                    let want = want.marked_as(&live);
                    let d = mapping::diff(&want, &live);
                    if !d.is_empty() {
                        let all: Vec<String> = d
                            .immutable
                            .iter()
                            .chain(&d.editable)
                            .map(ToString::to_string)
                            .collect();
                        tracing::warn!(subscription = %ctx.name(), consumer = %want.name, differences = %all.join("; "), "the operator's consumer differs from the policy this application runs: bound anyway; check that the Subscription resource and the application agree");
                    }
                    Ok((stream, want.name))
                }
                Ok(None) => Err(format!(
                    "consumer {} on stream {stream} does not exist yet: the operator creates it from Subscription {}/{} (kubectl describe subscription {} -n {})",
                    want.name,
                    b.namespace,
                    ctx.name(),
                    ctx.name(),
                    b.namespace
                )),
                Err(e) => Err(e.to_string()),
            }
        })
        .await
    }
}

struct NatsConsumer {
    broker: NatsBroker,
    client: Arc<Client>,
    js: Arc<jetstream::Context>,
    ctx: Arc<SubscriptionCtx>,
    messages: Option<pull::Stream>,
    retired: Arc<AtomicBool>,
    acks: bool,
    /// How many times it bound again to a consumer made again (deleted on the broker, or with
    /// its Subscription): a delivery remembers the binding it came from.
    bound: Arc<AtomicU64>,
    /// When the consumer it is bound to was made (unix ns, by the server's clock).
    made: i128,
}

impl NatsConsumer {
    fn delivery(&self, m: jetstream::Message) -> Delivery {
        let msg: async_nats::Message = m.into();
        // Only the delivery count is read from the ack subject (not the whole `info()`).
        let attempt = msg
            .reply
            .as_deref()
            .and_then(ack_subject)
            .and_then(|a| a.delivered)
            .map_or(1, |n| u32::try_from(n).unwrap_or(u32::MAX));
        let headers = msg
            .headers
            .as_ref()
            .map(|h| {
                h.iter()
                    .flat_map(|(k, vs)| vs.iter().map(move |v| (k.to_string(), v.to_string())))
                    .collect()
            })
            .unwrap_or_default();
        let on_settle = NatsSettler {
            client: Arc::clone(&self.client),
            js: Arc::clone(&self.js),
            reply: msg.reply,
            retired: Arc::clone(&self.retired),
            acks: self.acks,
            offered_in: self.bound.load(Ordering::Acquire),
            bound: Arc::clone(&self.bound),
        };
        Delivery::new(
            &self.ctx,
            DeliveryOptions {
                subject: msg.subject.as_str().to_owned(),
                headers,
                payload: msg.payload,
                attempt,
                on_settle: Box::new(on_settle),
            },
        )
    }
}

impl Consumer for NatsConsumer {
    fn next(&mut self) -> BoxFuture<'_, Option<Delivery>> {
        async move {
            loop {
                let messages = self.messages.as_mut()?;
                match messages.next().await {
                    Some(Ok(m)) => return Some(self.delivery(m)),
                    Some(Err(e)) => {
                        use pull::MessagesErrorKind as K;
                        match e.kind() {
                            K::ConsumerDeleted | K::NoResponders | K::PushBasedConsumer => {
                                self.messages = None;
                                if self.ctx.binding().owner == ConsumerOwner::Operator && !self.retired.load(Ordering::Acquire) {
                                    // The operator repairs a deleted consumer while its Subscription exists:
                                    // bind again when it is back (or wait until the bus closes).
                                    tracing::warn!(subscription = %self.ctx.name(), error = %e, "the operator's consumer is gone; waiting for it to come back");
                                    match self.broker.bind(&self.ctx).await {
                                        Ok((m, made)) => {
                                            if made != self.made {
                                                self.made = made;
                                                self.bound.fetch_add(1, Ordering::AcqRel);
                                            }
                                            self.messages = Some(m);
                                            continue;
                                        }
                                        Err(e) => tracing::error!(subscription = %self.ctx.name(), error = %e, "cannot bind again"),
                                    }
                                    return None;
                                }
                                tracing::error!(subscription = %self.ctx.name(), error = %e, "the JetStream consumer is gone");
                                return None;
                            }
                            _ => tracing::warn!(subscription = %self.ctx.name(), error = %e, "pulling from JetStream"),
                        }
                    }
                    None => {
                        self.messages = None;
                        return None;
                    }
                }
            }
        }
        .boxed()
    }

    fn stop(&mut self) -> BoxFuture<'_, ()> {
        self.messages = None;
        futures::future::ready(()).boxed()
    }

    fn retire(&mut self) -> BoxFuture<'_, ()> {
        self.retired.store(true, Ordering::Release);
        self.messages = None;
        futures::future::ready(()).boxed()
    }
}

struct NatsSettler {
    client: Arc<Client>,
    js: Arc<jetstream::Context>,
    reply: Option<Subject>,
    retired: Arc<AtomicBool>,
    acks: bool,
    /// The binding the delivery came from, and the consumer's current one.
    offered_in: u64,
    bound: Arc<AtomicU64>,
}

impl NatsSettler {
    fn reply(&self) -> Result<Subject, Refusal> {
        if self.retired.load(Ordering::Acquire) {
            return Err(Refusal {
                reason: "the consumer that offered this delivery was retired by this process; the server offers the message again after ackWait".into(),
                stranded: false,
            });
        }
        if self.bound.load(Ordering::Acquire) != self.offered_in {
            // An ack subject names the consumer only by stream and name: sent now, it would
            // reach the consumer made again under that name and settle the message it has
            // offered afresh (semantics J3).
            return Err(Refusal {
                reason: "the consumer that offered this delivery was deleted and made again; the new one offers the message afresh".into(),
                stranded: false,
            });
        }
        if !self.acks {
            return Err(Refusal {
                reason: "the consumer does not take acknowledgements (ack policy none)".into(),
                stranded: false,
            });
        }
        self.reply.clone().ok_or_else(|| Refusal {
            reason: "the message has no reply subject: not a JetStream delivery".into(),
            stranded: true,
        })
    }

    async fn publish(&self, body: &'static [u8]) -> Result<(), Refusal> {
        let reply = self.reply()?;
        self.client
            .publish(reply, Bytes::from_static(body))
            .await
            .map_err(|e| Refusal {
                reason: format!("cannot send to the server: {e}"),
                stranded: false,
            })
    }

    /// Sends and waits for the server's confirmation; sent again while nobody answers and the
    /// consumer may still exist (a clustered one between leaders), for [`LEADERLESS_GRACE`], or
    /// until the API has said it is gone for [`GONE_CONFIRMED`].
    async fn confirmed(&self, body: Bytes) -> Result<(), Refusal> {
        let reply = self.reply()?;
        let started = std::time::Instant::now();
        let mut retried = false;
        let mut gone_since = None;
        let stranded = || {
            Refusal {
            reason: "no such consumer on the server any more (deleted?): the message cannot be offered again on it".into(),
            stranded: true,
        }
        };
        loop {
            match self.client.request(reply.clone(), body.clone()).await {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == RequestErrorKind::NoResponders => {
                    if started.elapsed() < LEADERLESS_GRACE {
                        if self.consumer_may_exist(&reply).await {
                            gone_since = None;
                        } else if gone_since
                            .get_or_insert_with(std::time::Instant::now)
                            .elapsed()
                            >= GONE_CONFIRMED
                        {
                            return Err(stranded());
                        }
                        if !retried {
                            tracing::info!(%reply, "nobody answered a decline (a consumer between leaders, or deleted): sending it again");
                            retried = true;
                        }
                        tokio::time::sleep(Duration::from_millis(250)).await;
                        continue;
                    }
                    return Err(stranded());
                }
                Err(e) => {
                    return Err(Refusal {
                        reason: format!("the server did not confirm: {e}"),
                        stranded: false,
                    });
                }
            }
        }
    }

    /// False when the JetStream API says the consumer `reply` acknowledges for is gone; true
    /// while it exists or cannot say (no leader, no answer).
    async fn consumer_may_exist(&self, reply: &str) -> bool {
        let Some(a) = ack_subject(reply) else {
            return false;
        };
        !matches!(
            admin::consumer_info(&self.js, a.stream, a.consumer).await,
            Ok(None)
        )
    }
}

/// What an ack subject names.
#[derive(Debug, PartialEq, Eq)]
struct AckSubject<'a> {
    stream: &'a str,
    consumer: &'a str,
    /// The delivery count: 1 for the first attempt.
    delivered: Option<u64>,
}

/// Reads an ack subject, `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>`,
/// or with a domain and account hash before the stream (11 or more tokens); without allocating,
/// since it runs for every delivery.
fn ack_subject(reply: &str) -> Option<AckSubject<'_>> {
    let rest = reply.strip_prefix("$JS.ACK.")?;
    let skip = match rest.bytes().filter(|&b| b == b'.').count() + 1 {
        7 => 0,
        n if n >= 9 => 2,
        _ => return None,
    };
    let mut tokens = rest.split('.').skip(skip);
    Some(AckSubject {
        stream: tokens.next()?,
        consumer: tokens.next()?,
        delivered: tokens.next().and_then(|d| d.parse().ok()),
    })
}

/// The body of a decline: a bare `-NAK` for zero (immediate), else `-NAK {"delay":<ns>}`.
pub fn nak_body(delay: Duration) -> Bytes {
    if delay.is_zero() {
        Bytes::from_static(NAK)
    } else {
        Bytes::from(format!("-NAK {{\"delay\":{}}}", delay.as_nanos()))
    }
}

impl OnSettle for NatsSettler {
    fn settle(&self, action: BrokerAction) -> BoxFuture<'_, Result<Performed, Refusal>> {
        async move {
            match action {
                BrokerAction::Ack => self.publish(ACK).await?,
                BrokerAction::Decline(delay) => self.confirmed(nak_body(delay)).await?,
                BrokerAction::Terminate => self.confirmed(Bytes::from_static(TERM)).await?,
            }
            Ok(Performed::AsAsked)
        }
        .boxed()
    }

    fn progress(&self) -> BoxFuture<'_, Result<(), Refusal>> {
        self.publish(WPI).boxed()
    }

    fn release(&self) -> BoxFuture<'_, ()> {
        async move {
            if let Err(r) = self.publish(NAK).await {
                tracing::debug!(reason = %r.reason, "release not sent; the server offers the message again after ackWait");
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::{AckSubject, ack_subject};

    #[test]
    fn an_ack_subject_names_its_stream_consumer_and_delivery_count_in_either_form() {
        assert_eq!(
            ack_subject("$JS.ACK.ORDERS.orders.1.22.22.1700000000000000000.0"),
            Some(AckSubject {
                stream: "ORDERS",
                consumer: "orders",
                delivered: Some(1)
            })
        );
        assert_eq!(
            ack_subject("$JS.ACK.hub.ACCHASH.ORDERS.orders.3.22.22.1700000000000000000.0.r"),
            Some(AckSubject {
                stream: "ORDERS",
                consumer: "orders",
                delivered: Some(3)
            })
        );
        assert_eq!(
            ack_subject("$JS.ACK.hub.ACCHASH.ORDERS.orders.7.22.22.1700000000000000000.0"),
            Some(AckSubject {
                stream: "ORDERS",
                consumer: "orders",
                delivered: Some(7)
            })
        );
        assert_eq!(ack_subject("_INBOX.abc"), None);
        assert_eq!(ack_subject("$JS.ACK.ORDERS.orders.1"), None);
    }
}
