//! One RabbitMQ Backend's account keeper. Each instance of each Subscription of the Backend
//! reports to a queue of its own that holds its newest report, registered in the
//! Subscription's index queue (see `backend::rabbitmq::report`); this keeper consumes the index
//! and every registered queue (and the Subscription's older shared report queue) with manual
//! acknowledgement, and keeps a ledger queue holding the newest snapshot of its whole account
//! (live instances and registered queues included, since a consumed report is gone). A folded
//! instance's queue is deleted.
//!
//! Once a second it folds idle instances, saves the snapshots that changed (published with
//! publisher confirms) and only then acknowledges the reports they contain, so a restart finds
//! every acknowledged report in the snapshot and every other one back in its queue (counted
//! once: the ledger skips a report it already holds). It reads the queue's gauges once per stats
//! interval and shows the account through [`show`] exactly as the NATS keeper does. RabbitMQ has
//! no advisories: on a Backend with a dead-letter exchange, the broker's count of Exhausted comes
//! from a copy of its dead letters ([`dead_letters`], semantics R9–R12), each counted into
//! the Subscription's snapshot and acknowledged after its save like a report; without one,
//! Exhausted is the runtime's count alone. A deleted Subscription's report and ledger queues are
//! deleted.
//!
//! Until a Subscription's runtime has reported (or a snapshot exists), only the broker's gauges
//! are written: no counter is invented.
//!
//! A report counts only where it belongs: its body names the Subscription whose queue it came
//! from (and, from an instance's queue, that instance), else it is dropped (`misfiled`); and,
//! when the Backend lists `reportUsers`, only if RabbitMQ's validated `user_id` is one of them
//! (else `wrong_writer`), since on a shared vhost anyone may publish to any queue through the
//! default exchange.
//!
//! It must not write status itself (that is the writer) nor decide counts (that is the ledger).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::{BoxStream, SelectAll};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions,
    BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection};
use serde::{Deserialize, Serialize};

mod dead_letters;
use super::ledger::{Account, BrokerOutcome, Outcome, Snapshot};
use super::metrics::Metrics;
use super::show::{self, Showing};
use super::status::LossLog;
use super::writer::Writer;
use super::{AmqpLookup, Config, QueueLookup};
use crate::api::{Backend, Subscription};
use crate::backend::QueueGauges;
use crate::backend::rabbitmq::{admin, deadletter, report};
use crate::bus::report::{StatsReport, now_ms};
use dead_letters::{Attribution, DeadLetters};

/// A Subscription, by namespace and name.
type SubKey = (String, String);

const NO_CONNECTION: &str = "the Backend has no AMQP connection yet";

/// Why a session ended.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Broken(pub(super) String);

fn broken(what: &str, e: impl std::fmt::Display) -> Broken {
    Broken(format!("{what}: {e}"))
}

/// What is kept in a Subscription's ledger queue.
#[derive(Default, Serialize, Deserialize)]
struct Saved {
    ledger: Snapshot,
    loss: LossLog,
    /// The instances' report queues registered in the index.
    #[serde(default)]
    instances: BTreeSet<String>,
}

/// Which of a Subscription's queues a delivery came from.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Source {
    /// The shared report queue runtimes before instance queues report to.
    Shared,
    /// The index: an instance registering its report queue.
    Index,
    /// One instance's report queue.
    Instance(String),
}

/// One Subscription's account as the keeper holds it.
struct Book {
    account: Account,
    showing: Showing,
    /// Something in the snapshot changed since the last save.
    dirty: bool,
    /// Reports counted (or skipped) since the last save: acknowledged once it is saved.
    acks: Vec<u64>,
    /// Copies of dead letters counted (or found counted before) since the last save, on the
    /// dead-letter channel: acknowledged once it is saved.
    dead_acks: Vec<u64>,
    /// Reports naming another object than this book's: an earlier one's (acknowledged with the
    /// save), or, when this book turns out to be the earlier one, the new object's (put back
    /// for its book).
    foreign: Vec<u64>,
    /// The runtime has reported (or a snapshot existed): counters are shown.
    counting: bool,
    /// The instances' report queues registered (persisted with the snapshot).
    instances: BTreeSet<String>,
    /// The registered queues consumed now.
    consuming: HashSet<String>,
    /// Folded instances' queues, deleted once the snapshot without them is saved.
    retired_queues: Vec<String>,
    /// Its report consumer ended: the book is saved and dropped, then opened again.
    ended: bool,
    /// It belongs to an earlier object of the Subscription's name: dropped unsaved.
    replaced: bool,
    gauges: Option<(u64, u64)>,
    gauges_at: Option<Instant>,
    gauges_written: Option<Instant>,
}

impl Book {
    /// Every queue this book consumes: the shared report queue, the index, the instances'.
    fn all_queues(&self, key: &SubKey) -> Vec<String> {
        let mut all = vec![
            report::report_queue(&key.0, &key.1),
            report::index_queue(&key.0, &key.1),
        ];
        all.extend(self.instances.iter().cloned());
        all
    }
}

/// How often leftover account queues of deleted Subscriptions are looked for.
const SWEEP_INTERVAL: Duration = Duration::from_secs(300);

/// How often the keeper folds, saves, acknowledges and decides what to write.
const TICK: Duration = Duration::from_secs(1);

pub struct RabbitKeeper {
    backend: SubKey,
    /// The Backends: this one's `reportUsers` say whose reports count.
    backends: Store<Backend>,
    connect: AmqpLookup,
    queues: QueueLookup,
    subs: Store<Subscription>,
    writer: Writer,
    config: Config,
    metrics: Metrics,
    unseen_attempts: super::status::Unseen,
}

/// The report deliveries of every Subscription, by Subscription; `None` when its consumer
/// ended (the broker cancelled it: its queue was deleted).
type Reports = SelectAll<
    BoxStream<
        'static,
        (
            SubKey,
            Source,
            Option<Result<lapin::message::Delivery, lapin::Error>>,
        ),
    >,
>;

/// The consumer tag of `queue` on this keeper's channel.
fn tag_of(queue: &str) -> String {
    format!("settle-account-{queue}-{}", std::process::id())
}

/// Consumes `queue` for Subscription `key` into `reports`.
async fn consume(
    ch: &Channel,
    reports: &mut Reports,
    key: &SubKey,
    queue: &str,
    source: Source,
) -> Result<(), Broken> {
    let consumer = ch
        .basic_consume(
            ShortString::from(queue),
            ShortString::from(tag_of(queue).as_str()),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| broken(&format!("consuming {queue:?}"), e))?;
    let (k, end, s, s_end) = (key.clone(), key.clone(), source.clone(), source);
    reports.push(
        consumer
            .map(move |d| (k.clone(), s.clone(), Some(d)))
            .chain(futures::stream::once(async move { (end, s_end, None) }))
            .boxed(),
    );
    Ok(())
}

impl RabbitKeeper {
    /// `queues` reads the queues' counts (the management API), when the Backend names one.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        backend: SubKey,
        backends: Store<Backend>,
        connect: AmqpLookup,
        queues: QueueLookup,
        subs: Store<Subscription>,
        writer: Writer,
        config: Config,
        metrics: Metrics,
        unseen_attempts: super::status::Unseen,
    ) -> RabbitKeeper {
        RabbitKeeper {
            backend,
            backends,
            connect,
            queues,
            subs,
            writer,
            config,
            metrics,
            unseen_attempts,
        }
    }

    fn name(&self) -> String {
        format!("{}/{}", self.backend.0, self.backend.1)
    }

    /// Runs until aborted; a broken session (the broker went away) starts again.
    pub async fn run(self) {
        loop {
            if let Err(e) = self.session().await {
                if e.0 == NO_CONNECTION {
                    tracing::debug!(backend = %self.name(), "account: the Backend has no AMQP connection yet");
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    continue;
                }
                tracing::warn!(backend = %self.name(), error = %e, "the account lost its RabbitMQ session; starting it again in 2s");
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }

    /// The Subscriptions of this Backend now.
    fn members(&self) -> HashMap<SubKey, Arc<Subscription>> {
        self.subs
            .state()
            .into_iter()
            .filter(|s| {
                s.namespace().as_deref() == Some(self.backend.0.as_str())
                    && s.spec.backend_ref.name == self.backend.1
            })
            .map(|s| ((self.backend.0.clone(), s.name_any()), s))
            .collect()
    }

    async fn session(&self) -> Result<(), Broken> {
        let conn = (self.connect)(&self.backend.0, &self.backend.1)
            .await
            .ok_or_else(|| Broken(NO_CONNECTION.into()))?;
        let ch = conn
            .create_channel()
            .await
            .map_err(|e| broken("opening the report channel", e))?;
        // Per consumer (one per report queue): an instance's queue holds its newest report only,
        // so a few in flight suffice; the instance cap bounds the consumers.
        ch.basic_qos(
            self.config.limits.report_prefetch,
            BasicQosOptions { global: false },
        )
        .await
        .map_err(|e| broken("basic.qos", e))?;
        let saver = conn
            .create_channel()
            .await
            .map_err(|e| broken("opening the ledger channel", e))?;
        saver
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| broken("turning on publisher confirms", e))?;
        // The Backend's dead letters, when it has a dead-letter exchange (semantics R9).
        let mut dead = match self.dead_letter_exchange() {
            Some(dlx) => Some(
                DeadLetters::open(
                    &conn,
                    (&self.backend.0, &self.backend.1),
                    &dlx,
                    self.config.limits.dead_letter_prefetch,
                    self.config.limits.dead_letter_copy_max_length,
                )
                .await?,
            ),
            None => None,
        };
        tracing::info!(backend = %self.name(), dead_letters = ?dead.as_ref().map(|d| d.dlx.clone()), "account keeper started (RabbitMQ report queues)");
        let result = self.serve(&conn, &ch, &saver, &mut dead).await;
        // Reports and copies not acknowledged go back to their queues for the next session.
        let dl = dead.map(|d| d.ch);
        for c in [Some(ch), Some(saver), dl].into_iter().flatten() {
            if c.status().connected() {
                let _ = c.close(200, ShortString::from("session ended")).await;
            }
        }
        result
    }

    /// Deletes the account queues of this namespace's Subscriptions that no longer exist
    /// (deleted while no operator ran): reports, index, instances, ledger and object mark; and
    /// the dead-letter copy queues of Backends gone or without a dead-letter exchange. Needs
    /// the management API to list queues; without it they stay (bounded) until the
    /// Subscription's name is used again.
    async fn sweep(&self, conn: &Connection) {
        let Some(reader) = (self.queues)(&self.backend.0, &self.backend.1) else {
            return;
        };
        let Ok(names) = reader.names().await else {
            return;
        };
        let ns = &self.backend.0;
        let alive: Vec<String> = self
            .subs
            .state()
            .iter()
            .filter(|s| s.namespace().as_deref() == Some(ns.as_str()))
            .map(|s| s.name_any())
            .collect();
        // Copy queues of dead letters: a Backend's while it has a dead-letter exchange.
        let copying: Vec<String> = self
            .backends
            .state()
            .iter()
            .filter(|b| {
                b.namespace().as_deref() == Some(ns.as_str())
                    && b.spec
                        .rabbitmq
                        .as_ref()
                        .is_some_and(|r| r.dead_letter_exchange.is_some())
            })
            .map(|b| deadletter::copy_queue(ns, &b.name_any()))
            .collect();
        for q in names {
            if q.starts_with(&deadletter::copy_queue(ns, "")) {
                if !copying.contains(&q) {
                    match admin::delete(conn, &q).await {
                        Ok(()) => {
                            tracing::info!(queue = %q, "deleted the dead-letter copy queue of a Backend gone, or without a dead-letter exchange")
                        }
                        Err(e) => {
                            tracing::debug!(queue = %q, error = %e, "cannot delete a leftover copy queue")
                        }
                    }
                }
                continue;
            }
            let Some(sub) = ["stats", "ledger", "instances", "object", "report"]
                .iter()
                .find_map(|kind| {
                    q.strip_prefix(&format!("settle.{kind}.{ns}."))
                        .map(|rest| (*kind, rest))
                })
            else {
                continue;
            };
            let owned = match sub {
                // `settle.report.<ns>.<subscription>.<instance>`: a name may hold dots.
                ("report", rest) => alive.iter().any(|a| rest.starts_with(&format!("{a}."))),
                (_, rest) => alive.iter().any(|a| a == rest),
            };
            if !owned {
                match admin::delete(conn, &q).await {
                    Ok(()) => {
                        tracing::info!(queue = %q, "deleted the account queue of a Subscription deleted while no operator ran")
                    }
                    Err(e) => {
                        tracing::debug!(queue = %q, error = %e, "cannot delete a leftover account queue")
                    }
                }
            }
        }
    }

    /// The Backend's dead-letter exchange now, if it names one.
    fn dead_letter_exchange(&self) -> Option<String> {
        self.backends
            .get(&ObjectRef::new(&self.backend.1).within(&self.backend.0))
            .and_then(|b| b.spec.rabbitmq.as_ref()?.dead_letter_exchange.clone())
    }

    async fn serve(
        &self,
        conn: &Connection,
        ch: &Channel,
        saver: &Channel,
        dead: &mut Option<DeadLetters>,
    ) -> Result<(), Broken> {
        let mut books: HashMap<SubKey, Book> = HashMap::new();
        let mut reports: Reports = SelectAll::new();
        // Each verified AtLeastOnce queue of the Backend, by name: whose its dead letters are.
        let mut owners: HashMap<String, SubKey> = HashMap::new();
        // The queues the Backend's AtLeastOnce Subscriptions want that no status names yet.
        let mut wanted: BTreeSet<String> = BTreeSet::new();
        // Copies for a Subscription whose book is not open, or whose queue is not verified,
        // yet: handled again after the next tick (unverified for at most HOLD_UNVERIFIED).
        let mut held: Vec<(Instant, lapin::message::Delivery)> = Vec::new();
        self.sweep(conn).await;
        let mut swept = Instant::now();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                Some((key, source, delivery)) = reports.next(), if !reports.is_empty() => {
                    match delivery {
                        Some(d) => {
                            let d = d.map_err(|e| broken("consuming reports", e))?;
                            if !books.contains_key(&key) {
                                // Delivered to a consumer whose book is gone (replaced, or being
                                // opened again): back to its queue for the next book.
                                ch.basic_reject(d.delivery_tag, BasicRejectOptions { requeue: true })
                                    .await
                                    .map_err(|e| broken("putting a report back", e))?;
                                continue;
                            }
                            if source == Source::Index {
                                self.on_registration(ch, &mut reports, &mut books, &key, d).await?;
                            } else {
                                self.on_report(&mut books, &key, &source, d);
                            }
                        }
                        None => {
                            if let Some(book) = books.get_mut(&key) {
                                match source {
                                    // An instance's queue went (deleted on the broker): a live
                                    // instance registers it again when its report comes back.
                                    Source::Instance(q) => {
                                        book.consuming.remove(&q);
                                        if book.instances.remove(&q) {
                                            book.dirty = true;
                                        }
                                    }
                                    Source::Shared | Source::Index => book.ended = true,
                                }
                            }
                        }
                    }
                }
                copy = next_copy(dead) => {
                    let Some(dl) = dead.as_mut() else { continue };
                    match copy {
                        Some(d) => {
                            let d = d.map_err(|e| broken("consuming dead letters", e))?;
                            let mine = (&owners, &wanted);
                            self.on_dead_letter(&dl.ch, mine, &mut books, &mut held, (Instant::now(), d)).await?;
                        }
                        None => dl.ended(now_ms(), &self.metrics),
                    }
                }
                _ = tick.tick() => {
                    if !ch.status().connected() || !saver.status().connected()
                        || dead.as_ref().is_some_and(|d| !d.ch.status().connected())
                    {
                        return Err(Broken("a channel closed".into()));
                    }
                    if dead.as_ref().map(|d| d.dlx.clone()) != self.dead_letter_exchange() {
                        return Err(Broken("the Backend's dead-letter exchange changed".into()));
                    }
                    let members = self.members();
                    // A Subscription deleted and applied again between two ticks: the old
                    // object's book is saved and dropped, the new one's opened afresh.
                    for (key, book) in books.iter_mut() {
                        if let Some(sub) = members.get(key)
                            && !book.account.persisted().belongs_to(sub.metadata.uid.as_deref())
                        {
                            book.ended = true;
                            book.replaced = true;
                        }
                    }
                    self.open_new(conn, ch, &members, &mut books, &mut reports).await?;
                    self.drop_gone(conn, ch, dead.as_ref().map(|d| &d.ch), &members, &mut books)
                        .await;
                    if let Some(dl) = dead.as_mut() {
                        let (o, w, keys) = queues_of(&members);
                        (owners, wanted) = (o, w);
                        let verified = !owners.is_empty();
                        dl.keep(conn, keys, verified, now_ms(), self.config.stats_interval, &self.metrics)
                            .await?;
                        for d in std::mem::take(&mut held) {
                            self.on_dead_letter(&dl.ch, (&owners, &wanted), &mut books, &mut held, d).await?;
                        }
                    }
                    if swept.elapsed() >= SWEEP_INTERVAL {
                        swept = Instant::now();
                        self.sweep(conn).await;
                    }
                    self.settle(conn, ch, saver, dead.as_ref(), &members, &mut books).await?;
                }
            }
        }
    }

    /// Loads the book of every new Subscription (its snapshot) and consumes its reports.
    async fn open_new(
        &self,
        conn: &Connection,
        ch: &Channel,
        members: &HashMap<SubKey, Arc<Subscription>>,
        books: &mut HashMap<SubKey, Book>,
        reports: &mut Reports,
    ) -> Result<(), Broken> {
        for (key, sub) in members {
            if books.contains_key(key) {
                continue;
            }
            let (reports_q, ledger_q) = (
                report::report_queue(&key.0, &key.1),
                report::ledger_queue(&key.0, &key.1),
            );
            let saved = match load(conn, &reports_q, &ledger_q).await {
                Ok(saved) => saved,
                Err(e) => {
                    tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), error = %e, "cannot open the Subscription's report queues; trying again");
                    continue;
                }
            };
            let floor = sub
                .status
                .as_ref()
                .and_then(|s| s.stats.as_ref())
                .map(|s| s.counters)
                .unwrap_or_default();
            // A snapshot of an earlier object of this name (deleted while no operator ran) is
            // not this one's (semantics C15); the instances' report queues it lists still are
            // (a queue belongs to an instance, whichever object it counts for).
            let (saved, instances) = match saved {
                Some(s) if !s.ledger.persisted.belongs_to(sub.metadata.uid.as_deref()) => {
                    tracing::info!(subscription = %format!("{}/{}", key.0, key.1), "the saved ledger is an earlier object's of the same name: the new object's account starts at zero");
                    (None, s.instances)
                }
                Some(mut s) => {
                    let instances = std::mem::take(&mut s.instances);
                    (Some(s), instances)
                }
                None => (None, BTreeSet::new()),
            };
            let counting = saved.is_some();
            let Saved {
                ledger, mut loss, ..
            } = saved.unwrap_or_default();
            loss.observe(now_ms(), floor.exhausted, self.config.loss_window);
            consume(ch, reports, key, &reports_q, Source::Shared).await?;
            consume(
                ch,
                reports,
                key,
                &report::index_queue(&key.0, &key.1),
                Source::Index,
            )
            .await?;
            let mut consuming = HashSet::new();
            for q in &instances {
                // A queue registered before and gone since: dropped from the list.
                if admin::exists(conn, q).await.unwrap_or(true) {
                    consume(ch, reports, key, q, Source::Instance(q.clone())).await?;
                    consuming.insert(q.clone());
                }
            }
            let mut account = Account::restore(ledger, floor);
            account.claim(sub.metadata.uid.clone());
            books.insert(
                key.clone(),
                Book {
                    account,
                    showing: Showing {
                        loss,
                        trouble: Default::default(),
                        last_write: None,
                        last_early: None,
                        stall: None,
                    },
                    dirty: false,
                    acks: Vec::new(),
                    dead_acks: Vec::new(),
                    foreign: Vec::new(),
                    counting,
                    instances: consuming.iter().cloned().collect(),
                    consuming,
                    retired_queues: Vec::new(),
                    ended: false,
                    replaced: false,
                    gauges: None,
                    gauges_at: None,
                    gauges_written: None,
                },
            );
        }
        Ok(())
    }

    /// An instance registered its report queue: consumed from now on, kept in the snapshot; the
    /// registration is acknowledged once the snapshot holding it is saved.
    async fn on_registration(
        &self,
        ch: &Channel,
        reports: &mut Reports,
        books: &mut HashMap<SubKey, Book>,
        key: &SubKey,
        d: lapin::message::Delivery,
    ) -> Result<(), Broken> {
        let written_by_a_reporter = self.written_by_a_reporter(&d);
        let Some(book) = books.get_mut(key) else {
            return Ok(());
        };
        book.acks.push(d.delivery_tag);
        if !written_by_a_reporter {
            self.metrics
                .reports
                .with_label_values(&["wrong_writer"])
                .inc();
            tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), user = ?d.properties.user_id(), "a registration by a user the Backend's reportUsers do not list: dropped");
            return Ok(());
        }
        // Only a queue of this Subscription's own names is taken.
        let prefix = report::instance_queue(&key.0, &key.1, "");
        let queue = serde_json::from_slice::<report::Registration>(&d.data)
            .ok()
            .map(|r| r.queue)
            .filter(|q| q.starts_with(&prefix) && q.len() > prefix.len() && q.len() <= 255);
        let Some(queue) = queue else {
            self.metrics.reports.with_label_values(&["misfiled"]).inc();
            tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), "a registration naming no report queue of this Subscription's: dropped");
            return Ok(());
        };
        if book.consuming.contains(&queue) {
            return Ok(());
        }
        consume(ch, reports, key, &queue, Source::Instance(queue.clone())).await?;
        book.consuming.insert(queue.clone());
        book.instances.insert(queue);
        book.dirty = true;
        Ok(())
    }

    /// One copy of a dead letter: counted for the Subscription whose verified queue ran it out
    /// of attempts (acknowledged once the snapshot counting it is saved), held when that
    /// Subscription's book is not open yet or a Subscription wants the queue it names but has
    /// not verified it yet, else acknowledged at once, counting for nobody.
    async fn on_dead_letter(
        &self,
        dl: &Channel,
        (owners, wanted): (&HashMap<String, SubKey>, &BTreeSet<String>),
        books: &mut HashMap<SubKey, Book>,
        held: &mut Vec<(Instant, lapin::message::Delivery)>,
        (since, d): (Instant, lapin::message::Delivery),
    ) -> Result<(), Broken> {
        let attribution = match dead_letters::attribute(owners, wanted, &d.properties, &d.data) {
            Attribution::Unverified if since.elapsed() < dead_letters::HOLD_UNVERIFIED => {
                held.push((since, d));
                return Ok(());
            }
            // Held long enough: the queue is not that Subscription's (a conflict).
            Attribution::Unverified => Attribution::Nothing("not_ours"),
            other => other,
        };
        let label = match attribution {
            Attribution::Unverified => "not_ours",
            Attribution::Exhausted(key, id) => {
                let Some(book) = books.get_mut(&key) else {
                    held.push((since, d));
                    return Ok(());
                };
                book.dead_acks.push(d.delivery_tag);
                match book.account.broker_dead_letter_copy(&id, d.redelivered) {
                    BrokerOutcome::Counted => {
                        book.dirty = true;
                        book.counting = true;
                        "counted"
                    }
                    BrokerOutcome::Duplicate | BrokerOutcome::Replayed => "duplicate",
                }
            }
            Attribution::Nothing(label) => {
                dl.basic_ack(d.delivery_tag, BasicAckOptions::default())
                    .await
                    .map_err(|e| broken("acknowledging a dead letter", e))?;
                label
            }
        };
        self.metrics.dead_letters.with_label_values(&[label]).inc();
        Ok(())
    }

    /// Counts one report; it is acknowledged once the snapshot holding it is saved.
    fn on_report(
        &self,
        books: &mut HashMap<SubKey, Book>,
        key: &SubKey,
        source: &Source,
        d: lapin::message::Delivery,
    ) {
        let written_by_a_reporter = self.written_by_a_reporter(&d);
        let Some(book) = books.get_mut(key) else {
            return;
        };
        // Parsed once (unless too large to read at all), then judged against the bounds.
        let report = if self.config.limits.too_large(d.data.len()) {
            None
        } else {
            Some(serde_json::from_slice::<StatsReport>(&d.data))
        };
        let refused = match &report {
            None => Some("too_large"),
            // Whoever may publish to the default exchange reaches any queue: only a user the
            // Backend lists counts (RabbitMQ validated the user_id).
            Some(_) if !written_by_a_reporter => Some("wrong_writer"),
            // A report counts only in its own queue: the Subscription's, and an instance
            // queue's own instance.
            Some(Ok(r)) if !arrived_where_it_belongs(r, key, source) => Some("misfiled"),
            Some(Ok(r)) => self.config.limits.refuse(r, &book.account),
            Some(Err(_)) => None,
        };
        if let Some(why) = refused {
            // Dropped: acknowledged with the next save, never counted.
            book.acks.push(d.delivery_tag);
            self.metrics.reports.with_label_values(&[why]).inc();
            tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), reason = why, "a stats report past the account's bounds: dropped");
            return;
        }
        let Some(report) = report else { return };
        if let Ok(r) = &report
            && r.subscription_uid.is_some()
            && !book
                .account
                .persisted()
                .belongs_to(r.subscription_uid.as_deref())
        {
            book.foreign.push(d.delivery_tag);
            self.metrics
                .reports
                .with_label_values(&["other_object"])
                .inc();
            return;
        }
        book.acks.push(d.delivery_tag);
        let label = match report {
            Err(e) => {
                tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), error = %e, "a stats report is unreadable: skipped");
                "unreadable"
            }
            Ok(r) => match book.account.report(&r) {
                Outcome::Counted => {
                    book.dirty = true;
                    book.counting = true;
                    "counted"
                }
                Outcome::Stale => "stale",
                Outcome::OtherObject => "other_object",
                Outcome::UnknownVersion => {
                    tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), version = r.version, "a stats report of a version this operator does not know: skipped (upgrade the operator)");
                    "unknown_version"
                }
            },
        };
        self.metrics.reports.with_label_values(&[label]).inc();
    }

    /// Whether `d` was written by a user whose reports count for this Backend: one its
    /// `reportUsers` list (by the `user_id` RabbitMQ validated), or anyone when it lists none.
    fn written_by_a_reporter(&self, d: &lapin::message::Delivery) -> bool {
        let users = self
            .backends
            .get(&ObjectRef::new(&self.backend.1).within(&self.backend.0))
            .and_then(|b| b.spec.rabbitmq.as_ref().map(|r| r.report_users.clone()))
            .unwrap_or_default();
        users.is_empty()
            || d.properties
                .user_id()
                .as_ref()
                .is_some_and(|u| users.iter().any(|x| x == u.as_str()))
    }

    /// Deleted Subscriptions: their consumer stops, their report and ledger queues go.
    async fn drop_gone(
        &self,
        conn: &Connection,
        ch: &Channel,
        dl: Option<&Channel>,
        members: &HashMap<SubKey, Arc<Subscription>>,
        books: &mut HashMap<SubKey, Book>,
    ) {
        let gone: Vec<SubKey> = books
            .keys()
            .filter(|k| !members.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            let Some(book) = books.remove(&key) else {
                continue;
            };
            // Its dead letters count for nothing any more.
            if let Some(dl) = dl {
                for tag in &book.dead_acks {
                    let _ = dl.basic_ack(*tag, BasicAckOptions::default()).await;
                }
            }
            let still = self
                .subs
                .get(&ObjectRef::new(&key.1).within(&key.0))
                .is_some();
            let queues = book.all_queues(&key);
            for q in &queues {
                let _ = ch
                    .basic_cancel(
                        ShortString::from(tag_of(q).as_str()),
                        BasicCancelOptions::default(),
                    )
                    .await;
            }
            if still {
                // Moved to another Backend: its queues are that Backend's keeper's now.
                continue;
            }
            for q in queues
                .iter()
                .chain([report::ledger_queue(&key.0, &key.1)].iter())
            {
                if let Err(e) = admin::delete(conn, q).await {
                    tracing::warn!(queue = %q, error = %e, "cannot delete a deleted Subscription's queue");
                }
            }
            self.metrics.forget(&key.0, &key.1);
            tracing::info!(subscription = %format!("{}/{}", key.0, key.1), "the Subscription is gone: its account and report queues are dropped");
        }
    }

    /// Once a second: fold, save, acknowledge, gauges, status.
    #[allow(clippy::too_many_lines)]
    async fn settle(
        &self,
        conn: &Connection,
        ch: &Channel,
        saver: &Channel,
        dead: Option<&DeadLetters>,
        members: &HashMap<SubKey, Arc<Subscription>>,
        books: &mut HashMap<SubKey, Book>,
    ) -> Result<(), Broken> {
        let now = now_ms();
        let dl = dead.map(|d| &d.ch);
        let fold_after = u64::try_from(self.config.fold_after.as_millis()).unwrap_or(u64::MAX);
        for (key, book) in books.iter_mut() {
            for instance in book.account.fold_idle(now, fold_after) {
                book.dirty = true;
                let q = report::instance_queue(&key.0, &key.1, &instance);
                if book.instances.remove(&q) {
                    book.consuming.remove(&q);
                    book.retired_queues.push(q);
                }
            }
        }
        // Save, then acknowledge: a report is never acknowledged before the snapshot holding it
        // is on the broker.
        for (key, book) in books.iter_mut() {
            if book.replaced {
                // Nothing unsaved is dropped: back to the queues for the new object's book,
                // which counts its own and acknowledges the earlier object's (registrations of
                // report queues included).
                for tag in book.acks.drain(..).chain(book.foreign.drain(..)) {
                    let _ = ch
                        .basic_reject(tag, BasicRejectOptions { requeue: true })
                        .await;
                }
                if let Some(dl) = dl {
                    for tag in book.dead_acks.drain(..) {
                        let _ = dl
                            .basic_reject(tag, BasicRejectOptions { requeue: true })
                            .await;
                    }
                }
                for q in book.all_queues(key) {
                    let _ = ch
                        .basic_cancel(
                            ShortString::from(tag_of(&q).as_str()),
                            BasicCancelOptions::default(),
                        )
                        .await;
                }
                continue;
            }
            if book.dirty {
                let saved = Saved {
                    ledger: book.account.snapshot(),
                    loss: book.showing.loss.clone(),
                    instances: book.instances.clone(),
                };
                let body =
                    serde_json::to_vec(&saved).map_err(|e| broken("encoding a ledger", e))?;
                match save(saver, &report::ledger_queue(&key.0, &key.1), &body).await {
                    Ok(()) => {
                        self.metrics.saves.with_label_values(&["ok"]).inc();
                        if book.showing.trouble.unsaved.take().is_some() {
                            tracing::info!(subscription = %format!("{}/{}", key.0, key.1), "the Subscription's ledger is saved again");
                            if let Some(sub) = members.get(key) {
                                self.writer.event(
                                    sub,
                                    false,
                                    "LedgerSaved",
                                    "the account's ledger is saved on the broker again".into(),
                                );
                            }
                        }
                        book.dirty = false;
                    }
                    Err(e) => {
                        // This Subscription's reports stay unacknowledged until it is saved;
                        // every other Subscription goes on.
                        self.metrics.saves.with_label_values(&["error"]).inc();
                        if book.showing.trouble.unsaved.is_none() {
                            tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), error = %e, "cannot save the Subscription's ledger; its reports stay unacknowledged until it can");
                            if let Some(sub) = members.get(key) {
                                self.writer.event(sub, true, super::status::reasons::LEDGER_NOT_SAVED, format!("the account's ledger cannot be saved on the broker ({e}); counts are still shown and nothing is lost meanwhile"));
                            }
                        }
                        book.showing.trouble.unsaved = Some(e.to_string());
                        continue;
                    }
                }
            }
            // Reports of another object, seen by the object's current book: an earlier
            // object's, never counted.
            for tag in book.acks.drain(..).chain(book.foreign.drain(..)) {
                ch.basic_ack(tag, BasicAckOptions::default())
                    .await
                    .map_err(|e| broken("acknowledging a report", e))?;
            }
            // Copies of dead letters: the saved snapshot counts them (and remembers their ids).
            if let Some(dl) = dl {
                for tag in book.dead_acks.drain(..) {
                    dl.basic_ack(tag, BasicAckOptions::default())
                        .await
                        .map_err(|e| broken("acknowledging a dead letter", e))?;
                }
            }
            // Folded instances' queues: the saved snapshot holds their counts now.
            for q in book.retired_queues.drain(..) {
                let _ = ch
                    .basic_cancel(
                        ShortString::from(tag_of(&q).as_str()),
                        BasicCancelOptions::default(),
                    )
                    .await;
                if let Err(e) = admin::delete(conn, &q).await {
                    tracing::debug!(queue = %q, error = %e, "cannot delete a folded instance's report queue");
                }
            }
        }
        // A consumer the broker cancelled (its queue deleted): saved above, opened again (and
        // the queue declared again) at the next tick.
        books.retain(|key, book| {
            if book.ended {
                tracing::warn!(subscription = %format!("{}/{}", key.0, key.1), "the report queue's consumer was cancelled (the queue deleted?): opening it again");
            }
            !book.ended
        });

        let interval = self.config.stats_interval;
        let stamp = Time(Timestamp::now());
        let round = show::Round {
            writer: &self.writer,
            metrics: &self.metrics,
            config: &self.config,
            // A last attempt a crash spent is counted from the copy of the dead letters.
            unseen_attempts: match (self.unseen_attempts, dead) {
                (super::status::Unseen::Uncounted, Some(_)) => {
                    super::status::Unseen::FromDeadLetters
                }
                (u, _) => u,
            },
            now_ms: now,
            stamp: &stamp,
        };
        // Gauges: each queue's once per interval, spread over the interval's ticks.
        let mut budget = show::gauge_budget(books.len(), interval, TICK);
        let reader: Option<QueueGauges> = (self.queues)(&self.backend.0, &self.backend.1);
        for (key, book) in books.iter_mut() {
            let Some(sub) = members.get(key) else {
                continue;
            };
            let queue = sub.status.as_ref().and_then(|s| s.consumer.as_ref());
            if let (Some(reader), Some(queue)) = (&reader, queue)
                && budget > 0
                && book.gauges_at.is_none_or(|t| t.elapsed() >= interval)
            {
                budget -= 1;
                book.gauges_at = Some(Instant::now());
                match reader.read(&queue.name).await {
                    Ok(g) => book.gauges = Some(g.unwrap_or((0, 0))),
                    Err(e) => {
                        tracing::debug!(subscription = %format!("{}/{}", key.0, key.1), error = %e, "cannot read the queue's gauges")
                    }
                }
            }
            book.showing.trouble.dead_letters =
                dead.and_then(|d| d.trouble(now, self.config.loss_window));
            let totals = book.counting.then(|| book.account.totals());
            if show::show_counted_or_gauges(
                &round,
                key,
                sub,
                totals,
                book.gauges,
                &mut book.showing,
                &mut book.gauges_written,
            ) {
                book.dirty = true;
            }
        }
        Ok(())
    }
}

/// The next copy of a dead letter, when the Backend's are copied; pending otherwise.
async fn next_copy(
    dead: &mut Option<DeadLetters>,
) -> Option<Result<lapin::message::Delivery, lapin::Error>> {
    match dead.as_mut() {
        Some(d) => d.next().await,
        None => futures::future::pending().await,
    }
}

/// The verified queues of the Backend's AtLeastOnce Subscriptions (their dead letters are
/// theirs: `status.consumer`, which the controller writes only for a queue it claimed as the
/// object's, semantics R8), the queues they want that no status names yet, and the routing keys
/// they are bound with.
fn queues_of(
    members: &HashMap<SubKey, Arc<Subscription>>,
) -> (HashMap<String, SubKey>, BTreeSet<String>, BTreeSet<String>) {
    let mut owners = HashMap::new();
    let mut wanted = BTreeSet::new();
    let mut keys = BTreeSet::new();
    for (key, sub) in members {
        let policy = crate::policy::ResolvedPolicy::resolve(&sub.spec.policy);
        if policy.mode != crate::api::Mode::AtLeastOnce {
            continue;
        }
        keys.insert(crate::backend::rabbitmq::queue::routing_key(
            &policy.pattern,
        ));
        match sub.status.as_ref().and_then(|s| s.consumer.as_ref()) {
            Some(c) => {
                owners.insert(c.name.clone(), key.clone());
            }
            None => {
                wanted.insert(crate::backend::rabbitmq::queue::queue_name(
                    &key.0, &key.1, &policy,
                ));
            }
        }
    }
    (owners, wanted, keys)
}

/// Declares a Subscription's report and ledger queues (as the runtime does) and reads its
/// snapshot, leaving it in the queue (`basic.get`, then `basic.reject` with requeue). A channel
/// of its own: a refused declare closes it.
async fn load(conn: &Connection, reports_q: &str, ledger_q: &str) -> Result<Option<Saved>, Broken> {
    let ch = conn
        .create_channel()
        .await
        .map_err(|e| broken("opening a channel", e))?;
    report::declare(&ch, reports_q, report::REPORTS_MAX_LENGTH)
        .await
        .map_err(|e| broken(&format!("declaring {reports_q:?}"), e))?;
    report::declare(&ch, ledger_q, report::LEDGER_MAX_LENGTH)
        .await
        .map_err(|e| broken(&format!("declaring {ledger_q:?}"), e))?;
    let index_q = reports_q.replacen("settle.stats.", "settle.instances.", 1);
    report::declare_index(&ch, &index_q)
        .await
        .map_err(|e| broken(&format!("declaring {index_q:?}"), e))?;
    let got = ch
        .basic_get(
            ShortString::from(ledger_q),
            BasicGetOptions { no_ack: false },
        )
        .await
        .map_err(|e| broken(&format!("reading {ledger_q:?}"), e))?;
    let saved = match got {
        None => None,
        Some(msg) => {
            let saved = match serde_json::from_slice::<Saved>(&msg.delivery.data) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(queue = %ledger_q, error = %e, "a saved ledger is unreadable: starting from what status shows");
                    None
                }
            };
            ch.basic_reject(
                msg.delivery.delivery_tag,
                BasicRejectOptions { requeue: true },
            )
            .await
            .map_err(|e| broken(&format!("putting back {ledger_q:?}"), e))?;
            saved
        }
    };
    let _ = ch.close(200, ShortString::from("loaded")).await;
    Ok(saved)
}

/// Publishes a snapshot to its ledger queue (persistent, through the default exchange) and
/// waits for the broker's confirm; the older snapshot is dropped by the queue's bound.
async fn save(saver: &Channel, ledger_q: &str, body: &[u8]) -> Result<(), Broken> {
    let confirm = saver
        .basic_publish(
            ShortString::from(""),
            ShortString::from(ledger_q),
            BasicPublishOptions::default(),
            body,
            report::persistent_json(),
        )
        .await
        .map_err(|e| broken(&format!("saving a ledger to {ledger_q:?}"), e))?;
    let confirmation = tokio::time::timeout(report::CONFIRM_TIMEOUT, confirm)
        .await
        .map_err(|_| {
            Broken(format!(
                "no confirm for the ledger to {ledger_q:?} within {:?}",
                report::CONFIRM_TIMEOUT
            ))
        })?
        .map_err(|e| broken(&format!("saving a ledger to {ledger_q:?}"), e))?;
    if confirmation.is_nack() {
        return Err(Broken(format!(
            "the broker refused a ledger to {ledger_q:?} (basic.nack)"
        )));
    }
    Ok(())
}

/// Whether report `r`, delivered from `source` of Subscription `key`, names that Subscription
/// and (from an instance's own queue) that queue's instance.
fn arrived_where_it_belongs(r: &StatsReport, key: &SubKey, source: &Source) -> bool {
    if r.namespace != key.0 || r.subscription != key.1 {
        return false;
    }
    match source {
        Source::Instance(q) => *q == report::instance_queue(&key.0, &key.1, &r.instance),
        Source::Shared | Source::Index => true,
    }
}
