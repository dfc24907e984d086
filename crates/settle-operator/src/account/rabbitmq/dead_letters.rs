//! A RabbitMQ Backend's dead letters, for its account keeper ([`super`]): consumes the
//! Backend's copy queue (`backend::rabbitmq::dead_letters`, made by the controller before the
//! first queue that dead-letters, and again here when it is gone), attributes each copy to the
//! Subscription whose verified queue (`status.consumer`) its newest `x-death` names, and says
//! what the copy may be missing (the queue lost or full, an exchange no binding copies whole).
//! A copy is acknowledged by the keeper once the snapshot that counts it is saved; one that
//! counts for nobody here is acknowledged at once (docs/semantics.md R9–R12).
//!
//! It must not count (the ledger does: [`crate::account::ledger::Account::broker_dead_letter_copy`]) nor
//! save or write anything.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection};

use crate::account::metrics::Metrics;
use settle::backend::rabbitmq::admin;
use settle::backend::rabbitmq::dead_letters::{self, Copy, Kind};

/// How long a Backend has no AtLeastOnce Subscription before its copy queue is deleted (a
/// Subscription being made meanwhile is in the cache by then).
const IDLE_BEFORE_DELETE: Duration = Duration::from_secs(10);

/// How long a copy naming a queue a Subscription wants but has not verified is held (the
/// controller writes `status.consumer` right after it makes the queue); then it counts for
/// nobody.
pub const HOLD_UNVERIFIED: Duration = Duration::from_secs(60);

/// A Subscription, by namespace and name.
pub type SubKey = (String, String);

/// The Subscription a verified queue is, and since when (its object's `creationTimestamp`,
/// Unix seconds; 0 when unknown): a dead letter from before was an earlier object's.
#[derive(Clone, Debug)]
pub struct Owner {
    pub key: SubKey,
    pub since_s: u64,
}

/// What one copy counts for.
pub enum Attribution {
    /// The Subscription whose verified queue dead-lettered it because its attempts ran out;
    /// with the id that names this dead-lettering.
    Exhausted(SubKey, String),
    /// The queue an AtLeastOnce Subscription of the Backend wants, not verified as its own yet
    /// (its status names no queue): held a while, as the controller may be about to.
    Unverified,
    /// Nothing here (the label of `settle_account_dead_letters_total` it is counted under).
    Nothing(&'static str),
}

/// Attributes one copy (pure): `owners` maps each verified AtLeastOnce queue of the Backend to
/// its Subscription; `wanted` holds the queues its AtLeastOnce Subscriptions want that no status
/// names yet. A copy dead-lettered in a second before the owner's object was made is an
/// earlier object's (one of the same name whose queue this one took over, C15): it counts for
/// nobody. `x-death` times are whole seconds of the broker's clock, the object's of the API
/// server's: one from the object's first second counts.
pub fn attribute(
    owners: &HashMap<String, Owner>,
    wanted: &BTreeSet<String>,
    props: &lapin::BasicProperties,
    body: &[u8],
) -> Attribution {
    let Some(death) = dead_letters::last_death(props) else {
        return Attribution::Nothing("not_exhausted");
    };
    if !dead_letters::counts_as_exhausted(&death.reason) {
        return Attribution::Nothing("not_exhausted");
    }
    match owners.get(&death.queue) {
        Some(o) if death.time != 0 && death.time < o.since_s => {
            Attribution::Nothing("earlier_object")
        }
        Some(o) => {
            Attribution::Exhausted(o.key.clone(), dead_letters::message_id(&death, props, body))
        }
        None if wanted.contains(&death.queue) => Attribution::Unverified,
        None => Attribution::Nothing("not_ours"),
    }
}

/// One Backend's copy queue, consumed on a channel of its own.
pub struct DeadLetters {
    pub ch: Channel,
    namespace: String,
    backend: String,
    /// The dead-letter exchange this session copies.
    pub dlx: String,
    queue: String,
    max_length: i64,
    consumer: Option<lapin::Consumer>,
    /// What the last [`dead_letters::ensure_copy`] found (`None`: not asked yet).
    copy: Option<Copy>,
    keys: BTreeSet<String>,
    /// The copy missed dead letters at this time (Unix ms), with why.
    gap: Option<(u64, String)>,
    idle_since: Option<Instant>,
    /// Deleted for want of Subscriptions (once, until one comes).
    idle_deleted: bool,
    checked: Option<Instant>,
    /// The exchange's type and when it was learned: kept, so each check only asks whether the
    /// exchange is there (learning a type costs a refused declare, logged by the AMQP client
    /// as an error), and learned again after [`KIND_KEPT`].
    kind: Option<(Kind, Instant)>,
}

/// How long a learned dead-letter exchange type is trusted: one deleted and declared again
/// with another type is bound for its new type within this.
const KIND_KEPT: Duration = Duration::from_secs(600);

fn broken(what: &str, e: impl std::fmt::Display) -> super::Broken {
    super::Broken(format!("{what}: {e}"))
}

impl DeadLetters {
    /// A channel with `prefetch` for the copy queue of Backend `namespace/backend`.
    pub async fn open(
        conn: &Connection,
        (namespace, backend): (&str, &str),
        dlx: &str,
        prefetch: u16,
        max_length: i64,
    ) -> Result<DeadLetters, super::Broken> {
        let ch = conn
            .create_channel()
            .await
            .map_err(|e| broken("opening the dead-letter channel", e))?;
        ch.basic_qos(prefetch, BasicQosOptions { global: false })
            .await
            .map_err(|e| broken("basic.qos", e))?;
        Ok(DeadLetters {
            ch,
            namespace: namespace.to_string(),
            backend: backend.to_string(),
            dlx: dlx.to_string(),
            queue: dead_letters::copy_queue(namespace, backend),
            max_length,
            consumer: None,
            copy: None,
            keys: BTreeSet::new(),
            gap: None,
            idle_since: None,
            idle_deleted: false,
            checked: None,
            kind: None,
        })
    }

    /// The next copy; pending while nothing is consumed. `None`: the broker ended the consumer
    /// (the queue was deleted).
    pub async fn next(&mut self) -> Option<Result<lapin::message::Delivery, lapin::Error>> {
        match self.consumer.as_mut() {
            Some(c) => c.next().await,
            None => futures::future::pending().await,
        }
    }

    /// The consumer ended: the copy queue is gone (copies missed until it is made again).
    pub fn ended(&mut self, now_ms: u64, metrics: &Metrics) {
        self.consumer = None;
        self.copy = None;
        metrics
            .dead_letters
            .with_label_values(&["copy_queue_lost"])
            .inc();
        tracing::warn!(queue = %self.queue, "the dead-letter copy queue was deleted on the broker: making it again; dead letters meanwhile are not counted");
        self.gap = Some((
            now_ms,
            format!(
                "the copy queue {} was deleted on the broker; it is made again, and what was \
                 dead-lettered while it was gone is not counted",
                self.queue
            ),
        ));
    }

    /// Once a tick: the copy queue made and bound for `keys` (the routing keys of the
    /// Backend's AtLeastOnce Subscriptions; empty: none, and after a while the queue is
    /// deleted), consumed, and once per `interval` checked for being full. `verified`: one of
    /// them has a verified queue, so the controller made the copy queue before it; finding it
    /// missing then means it was deleted (while no operator ran, or the cancel was missed).
    pub async fn keep(
        &mut self,
        conn: &Connection,
        keys: BTreeSet<String>,
        verified: bool,
        now_ms: u64,
        interval: Duration,
        metrics: &Metrics,
    ) -> Result<(), super::Broken> {
        if keys.is_empty() {
            self.idle(conn).await;
            return Ok(());
        }
        self.idle_since = None;
        self.idle_deleted = false;
        // Once per interval the binding is declared again too (one removed by hand comes back,
        // an exchange declared since is copied).
        let due = self.checked.is_none_or(|t| t.elapsed() >= interval);
        if due {
            self.checked = Some(Instant::now());
        }
        if (self.copy.is_none() || self.keys != keys || due)
            && !self.make(conn, keys, verified, now_ms, metrics).await
        {
            return Ok(());
        }
        if self.consumer.is_none() && !matches!(self.copy, Some(Copy::None(_)) | None) {
            let c = self
                .ch
                .basic_consume(
                    ShortString::from(self.queue.as_str()),
                    ShortString::from(self.tag().as_str()),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| broken(&format!("consuming {:?}", self.queue), e))?;
            self.consumer = Some(c);
        }
        if self.consumer.is_some() && due {
            self.check_full(conn, now_ms, metrics).await;
        }
        Ok(())
    }

    /// No AtLeastOnce Subscription: after [`IDLE_BEFORE_DELETE`], the copy queue is no longer
    /// consumed and is deleted (once).
    async fn idle(&mut self, conn: &Connection) {
        let since = *self.idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() >= IDLE_BEFORE_DELETE && !self.idle_deleted {
            self.idle_deleted = true;
            self.consumer = None;
            self.copy = None;
            let _ = self
                .ch
                .basic_cancel(
                    ShortString::from(self.tag().as_str()),
                    lapin::options::BasicCancelOptions::default(),
                )
                .await;
            match settle::backend::rabbitmq::admin::delete(conn, &self.queue).await {
                Ok(()) => {
                    tracing::info!(queue = %self.queue, "the Backend has no AtLeastOnce Subscription: its dead-letter copy queue is deleted")
                }
                Err(e) => {
                    tracing::debug!(queue = %self.queue, error = %e, "cannot delete the dead-letter copy queue")
                }
            }
        }
    }

    /// The copy queue made and bound for `keys`. Returns false when that failed (tried again
    /// next tick).
    async fn make(
        &mut self,
        conn: &Connection,
        keys: BTreeSet<String>,
        verified: bool,
        now_ms: u64,
        metrics: &Metrics,
    ) -> bool {
        let known = self
            .kind
            .as_ref()
            .filter(|(_, at)| at.elapsed() < KIND_KEPT)
            .map(|(k, _)| k);
        match dead_letters::ensure_copy(
            conn,
            &self.namespace,
            &self.backend,
            &self.dlx,
            &keys.iter().cloned().collect::<Vec<_>>(),
            self.max_length,
            known,
        )
        .await
        {
            Ok((copy, kind)) => {
                // A type learned now is kept from now; one that was known stays as it was.
                match kind {
                    None => self.kind = None,
                    Some(k) if known.is_none() => self.kind = Some((k, Instant::now())),
                    Some(_) => {}
                }
                // A queue deleted on the broker ends its consumer (`ended`); made again
                // while a consumer is still held (the cancel was missed), or missing under
                // a queue that was made after it: the same gap.
                if let Copy::Whole { made: true } | Copy::Partial { made: true, .. } = copy
                    && (self.consumer.is_some() || verified && self.gap.is_none())
                {
                    self.ended(now_ms, metrics);
                }
                self.copy = Some(copy);
                self.keys = keys;
                true
            }
            Err(e) => {
                tracing::warn!(queue = %self.queue, error = %e, "cannot make or bind the dead-letter copy queue; trying again");
                false
            }
        }
    }

    /// The copy queue found full: the broker drops the oldest copies (a gap).
    async fn check_full(&mut self, conn: &Connection, now_ms: u64, metrics: &Metrics) {
        if let Ok(Some(n)) = admin::depth(conn, &self.queue).await
            && i64::from(n) >= self.max_length
        {
            metrics
                .dead_letters
                .with_label_values(&["copy_queue_full"])
                .inc();
            tracing::warn!(queue = %self.queue, copies = n, "the dead-letter copy queue is full: the broker drops the oldest copies (raise --dead-letter-copy-max-length)");
            self.gap = Some((
                now_ms,
                format!(
                    "the copy queue {} was found full ({n} copies, \
                         --dead-letter-copy-max-length): the broker dropped the oldest beyond",
                    self.queue
                ),
            ));
        }
    }

    /// Why the copy may be missing dead letters now: a gap within `window` of `now_ms`, or an
    /// exchange the copy cannot follow whole.
    pub fn trouble(&self, now_ms: u64, window: Duration) -> Option<String> {
        let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        let gap = self
            .gap
            .as_ref()
            .filter(|(at, _)| now_ms.saturating_sub(*at) < window_ms)
            .map(|(_, why)| why.clone());
        let standing = match &self.copy {
            Some(Copy::Partial { why, .. } | Copy::None(why)) => Some(why.clone()),
            _ => None,
        };
        match (gap, standing) {
            (Some(a), Some(b)) => Some(format!("{a}; {b}")),
            (a, b) => a.or(b),
        }
    }

    fn tag(&self) -> String {
        format!("settle-account-{}-{}", self.queue, std::process::id())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{AMQPValue, FieldArray};

    fn copy_of(queue: &str, reason: &str) -> lapin::BasicProperties {
        copy_at(queue, reason, 1_800_000_000)
    }

    fn copy_at(queue: &str, reason: &str, time: u64) -> lapin::BasicProperties {
        let mut e = FieldTable::default();
        e.insert("queue".into(), AMQPValue::LongString(queue.into()));
        e.insert("reason".into(), AMQPValue::LongString(reason.into()));
        e.insert("count".into(), AMQPValue::LongLongInt(1));
        e.insert("time".into(), AMQPValue::Timestamp(time));
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(e)])),
        );
        lapin::BasicProperties::default().with_headers(h)
    }

    #[test]
    fn a_copy_counts_for_the_subscription_whose_verified_queue_ran_it_out() {
        let owner = Owner {
            key: ("shop".into(), "orders".into()),
            since_s: 1_700_000_000,
        };
        let owners = HashMap::from([("orders".to_string(), owner)]);
        let none = BTreeSet::new();
        for reason in ["rejected", "delivery_limit"] {
            assert!(matches!(
                attribute(&owners, &none, &copy_of("orders", reason), b"x"),
                Attribution::Exhausted(k, _) if k == ("shop".to_string(), "orders".to_string())
            ));
        }
        // Expired or pushed out by a length limit: never ran out of attempts.
        for reason in ["expired", "maxlen"] {
            assert!(matches!(
                attribute(&owners, &none, &copy_of("orders", reason), b"x"),
                Attribution::Nothing("not_exhausted")
            ));
        }
        // Another team's queue, or one no Subscription here has verified: counts for nobody.
        assert!(matches!(
            attribute(&owners, &none, &copy_of("payments", "rejected"), b"x"),
            Attribution::Nothing("not_ours")
        ));
        // A queue a Subscription here wants, before its status names it: held, not dropped.
        let wanted = BTreeSet::from(["payments".to_string()]);
        assert!(matches!(
            attribute(&owners, &wanted, &copy_of("payments", "rejected"), b"x"),
            Attribution::Unverified
        ));
        assert!(matches!(
            attribute(&owners, &none, &lapin::BasicProperties::default(), b"x"),
            Attribution::Nothing("not_exhausted")
        ));
    }

    #[test]
    fn a_copy_from_before_its_queues_object_was_made_counts_for_nobody() {
        let since = 1_700_000_000;
        let owners = HashMap::from([(
            "orders".to_string(),
            Owner {
                key: ("shop".into(), "orders".into()),
                since_s: since,
            },
        )]);
        let none = BTreeSet::new();
        // Dead-lettered by the queue while it was an earlier object's, read after the takeover.
        assert!(matches!(
            attribute(
                &owners,
                &none,
                &copy_at("orders", "rejected", since - 1),
                b"x"
            ),
            Attribution::Nothing("earlier_object")
        ));
        // From the object's first second on, or with no time to tell by: this object's.
        for time in [since, since + 30, 0] {
            assert!(matches!(
                attribute(
                    &owners,
                    &none,
                    &copy_at("orders", "delivery_limit", time),
                    b"x"
                ),
                Attribution::Exhausted(..)
            ));
        }
    }
}
