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
//! Its files, the same as every keeper's: this one holds the keeper, its session and its loop,
//! and opens each Subscription's book;
//! [`count`] judges and counts what comes in, [`round`] is the round (save, then
//! acknowledge, gauges, status), [`store`] reads and writes the account queues on the broker.
//! The parts the SQS keeper also has are in `account::queue_keeper`.
//!
//! It must not write status itself (that is the writer) nor decide counts (that is the ledger).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::SelectAll;
use kube::runtime::reflector::{ObjectRef, Store};
use lapin::options::{BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{Channel, Connection};

mod count;
mod dead_letters;
mod round;
mod store;
use super::ledger::Account;
use super::metrics::Metrics;
use super::queue_keeper::{self, Gauges, SubKey, who};
use super::show::Showing;
use super::writer::Writer;
use super::{AmqpLookup, Config, PlacesFreed, QueueLookup};
use count::{Reports, consume, next_copy, queues_of};
use dead_letters::{DeadLetters, Owner};
use settle::api::{Backend, Subscription};
use settle::backend::rabbitmq::{admin, report};
use settle::bus::report::now_ms;
use store::{Saved, load};

const NO_CONNECTION: &str = "the Backend has no AMQP connection yet";

/// Why a session ended.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Broken(pub(super) String);

fn broken(what: &str, e: impl std::fmt::Display) -> Broken {
    Broken(format!("{what}: {e}"))
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
    gauges: Gauges,
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
    /// Tells the controllers that this keeper deleted queues (places under `max-queues`).
    freed: PlacesFreed,
    subs: Store<Subscription>,
    writer: Writer,
    config: Config,
    metrics: Metrics,
    unseen_attempts: super::status::Unseen,
}

impl RabbitKeeper {
    /// `queues` reads the queues' counts (the management API), when the Backend names one.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        backend: SubKey,
        backends: Store<Backend>,
        connect: AmqpLookup,
        queues: QueueLookup,
        freed: PlacesFreed,
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
            freed,
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
        let mut owners: HashMap<String, Owner> = HashMap::new();
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
                    self.on_delivery(ch, &mut reports, &mut books, key, source, delivery).await?;
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
                    self.check_session(ch, saver, dead)?;
                    let members = queue_keeper::members(&self.subs, &self.backend);
                    mark_replaced(&members, &mut books);
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

    /// A report delivery (or its consumer's end): counted into its book, or put back when its
    /// book is gone.
    async fn on_delivery(
        &self,
        ch: &Channel,
        reports: &mut Reports,
        books: &mut HashMap<SubKey, Book>,
        key: SubKey,
        source: Source,
        delivery: Option<Result<lapin::message::Delivery, lapin::Error>>,
    ) -> Result<(), Broken> {
        match delivery {
            Some(d) => {
                let d = d.map_err(|e| broken("consuming reports", e))?;
                if !books.contains_key(&key) {
                    // Delivered to a consumer whose book is gone (replaced, or being
                    // opened again): back to its queue for the next book.
                    ch.basic_reject(d.delivery_tag, BasicRejectOptions { requeue: true })
                        .await
                        .map_err(|e| broken("putting a report back", e))?;
                    return Ok(());
                }
                if source == Source::Index {
                    self.on_registration(ch, reports, books, &key, d).await?;
                } else {
                    self.on_report(books, &key, &source, d);
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
        Ok(())
    }

    /// The session breaks when a channel closed or the Backend's dead-letter exchange changed.
    fn check_session(
        &self,
        ch: &Channel,
        saver: &Channel,
        dead: &Option<DeadLetters>,
    ) -> Result<(), Broken> {
        if !ch.status().connected()
            || !saver.status().connected()
            || dead.as_ref().is_some_and(|d| !d.ch.status().connected())
        {
            return Err(Broken("a channel closed".into()));
        }
        if dead.as_ref().map(|d| d.dlx.clone()) != self.dead_letter_exchange() {
            return Err(Broken("the Backend's dead-letter exchange changed".into()));
        }
        Ok(())
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
            // No queue of its own yet (refused, say by the vhost's max-queues): nothing is
            // delivered to count, and its account queues, which the controller makes with its
            // queue, would take places in the vhost before it (and retry each tick). Being
            // deleted: nothing more is counted, and its account queues go once it is gone.
            if !queue_keeper::has_queue(sub) || sub.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let saved = match load(conn, key).await {
                Ok(saved) => saved,
                Err(e) => {
                    tracing::warn!(subscription = %who(key), error = %e, "cannot open the Subscription's report queues; trying again");
                    continue;
                }
            };
            let (saved, instances) = own_snapshot(sub, key, saved);
            let counting = saved.is_some();
            let Saved {
                ledger, mut loss, ..
            } = saved.unwrap_or_default();
            let account = queue_keeper::open(sub, ledger, &mut loss, &self.config);
            let consuming = consume_all(conn, ch, reports, key, &instances).await?;
            books.insert(
                key.clone(),
                Book {
                    account,
                    showing: Showing {
                        loss,
                        ..Default::default()
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
                    gauges: Gauges::default(),
                },
            );
        }
        Ok(())
    }
}

/// A snapshot of an earlier object of this name (deleted while no operator ran) is not this
/// one's (semantics C15); the instances' report queues it lists still are (a queue belongs to an
/// instance, whichever object it counts for). Returns this object's snapshot (if any) and the
/// instances' queues.
fn own_snapshot(
    sub: &Subscription,
    key: &SubKey,
    saved: Option<Saved>,
) -> (Option<Saved>, BTreeSet<String>) {
    match saved {
        Some(s) if queue_keeper::earlier_object(&s.ledger, sub, &who(key)) => (None, s.instances),
        Some(mut s) => {
            let instances = std::mem::take(&mut s.instances);
            (Some(s), instances)
        }
        None => (None, BTreeSet::new()),
    }
}

/// Consumes a new book's report queues: the shared one, the index, and each instance's queue
/// still there (a queue registered before and gone since is dropped from the list). Returns the
/// instances' queues consumed.
async fn consume_all(
    conn: &Connection,
    ch: &Channel,
    reports: &mut Reports,
    key: &SubKey,
    instances: &BTreeSet<String>,
) -> Result<HashSet<String>, Broken> {
    let reports_q = report::report_queue(&key.0, &key.1);
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
    for q in instances {
        // A queue registered before and gone since: dropped from the list.
        if admin::exists(conn, q).await.unwrap_or(true) {
            consume(ch, reports, key, q, Source::Instance(q.clone())).await?;
            consuming.insert(q.clone());
        }
    }
    Ok(consuming)
}

/// A Subscription deleted and applied again between two ticks: the old object's book is saved
/// and dropped, the new one's opened afresh.
fn mark_replaced(members: &HashMap<SubKey, Arc<Subscription>>, books: &mut HashMap<SubKey, Book>) {
    for (key, book) in books.iter_mut() {
        if let Some(sub) = members.get(key)
            && !book
                .account
                .persisted()
                .belongs_to(sub.metadata.uid.as_deref())
        {
            book.ended = true;
            book.replaced = true;
        }
    }
}
