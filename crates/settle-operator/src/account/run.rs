//! The account's term: a keeper per NATS, RabbitMQ or SQS Backend (the whole account), started
//! and stopped with the leadership term. When a NATS Backend is deleted, its keeper's durable
//! reader of the server's capture is deleted too, and the ledgers and reports of its namespace's
//! Subscriptions that are gone (a namespace deleted at once takes the keeper before its round
//! drops them), through the connection the keeper ran on (the Backend's own is closed by
//! then): the capture is not read for a Backend that is gone.

use std::collections::HashMap;
use std::time::Duration;

use kube::ResourceExt;

use super::ledger::Account;
use super::{Metrics, nats, rabbitmq, sqs, writer};
use settle::bus::report::StatsReport;
use settle::policy::effective_capabilities;

/// How the account runs (the operator's flags).
#[derive(Clone, Debug)]
pub struct Config {
    /// At most one status write per Subscription this often (and only on change).
    pub stats_interval: Duration,
    /// The account's status writes across all Subscriptions at most, per second (urgent ones
    /// first, the rest coalesced and in turn).
    pub status_writes_per_second: u32,
    /// `Exhausting` is True while Exhausted grew within this window.
    pub loss_window: Duration,
    /// The floor of every Subscription's stall window (semantics C22): `Stalled` is True while
    /// messages are owed and no handler returned for the larger of this and three ackWaits past
    /// the longest decline delay.
    pub stall_window: Duration,
    /// An instance that has not reported for this long is folded into the retired total.
    pub fold_after: Duration,
    /// How long a NATS keeper holds a loss advisory whose consumer no status names yet.
    pub unverified_grace: Duration,
    /// The advisory capture's size limit on each NATS server, in bytes.
    pub capture_max_bytes: i64,
    /// The replicas of the capture stream and the account's buckets on each NATS server.
    pub replicas: usize,
    /// What the account takes in at most (reports are written by anyone who can write to the
    /// broker: each bound keeps a flood from taking the operator, and its webhook, down).
    pub limits: Limits,
}

/// The account's input bounds (the operator's `--max-report-bytes`, …); what each drops is
/// counted in `settle_account_reports_total{outcome}`.
#[derive(Clone, Debug)]
pub struct Limits {
    /// A report larger than this is dropped (`too_large`).
    pub max_report_bytes: usize,
    /// A report of a new instance when a Subscription already counts this many live instances
    /// is dropped (`too_many_instances`).
    pub max_instances: usize,
    /// Reports held back for Subscriptions not in the cache yet, over every keeper of the
    /// process, within `--max-early-report-bytes`; beyond, they are dropped (`early_dropped`:
    /// the runtime's next report carries the same counts).
    pub early: std::sync::Arc<super::early::EarlyBudget>,
    /// A report whose `sequence` is past the last one counted for its instance name by more
    /// than this is dropped (`sequence_jump`, semantics C19).
    pub max_sequence_jump: u64,
    /// A report whose life started, or that was made, later than now plus this (ms) is dropped
    /// (`from_the_future`, semantics C19).
    pub max_clock_skew_ms: u64,
    /// The NATS report bucket's own bounds, set on it by the keeper: the broker refuses a
    /// report past them, so nothing past them reaches the operator.
    pub report_bucket: BucketLimits,
    /// Reports one RabbitMQ report queue hands the keeper unacknowledged at most.
    pub report_prefetch: u16,
    /// Copies of dead letters a RabbitMQ Backend's copy queue hands the keeper unacknowledged
    /// at most (acknowledged once the snapshot counting them is saved).
    pub dead_letter_prefetch: u16,
    /// Copies a RabbitMQ Backend's copy queue holds at most; beyond, the oldest are dropped by
    /// the broker (`settle_account_dead_letters_total{outcome="copy_queue_full"}`).
    pub dead_letter_copy_max_length: i64,
}

/// The longest instance name a report may carry (a pod name is at most 253 characters, plus
/// the start time the runtime appends).
pub const MAX_INSTANCE_NAME: usize = 300;

impl Limits {
    /// Whether a report of `bytes` bytes is dropped unread.
    pub fn too_large(&self, bytes: usize) -> bool {
        bytes > self.max_report_bytes
    }

    /// Why a read report for `account` is dropped, if it is: an instance name past
    /// [`MAX_INSTANCE_NAME`] (`bad_instance`), a new instance past `max_instances`, or an
    /// implausible sequence or time ([`Account::implausible`]: `sequence_jump`,
    /// `from_the_future`).
    pub fn refuse(&self, report: &StatsReport, account: &Account) -> Option<&'static str> {
        if report.instance.len() > MAX_INSTANCE_NAME {
            return Some("bad_instance");
        }
        if !account.knows(&report.instance) && account.instances() >= self.max_instances {
            return Some("too_many_instances");
        }
        account
            .implausible(
                report,
                self.max_sequence_jump,
                settle::bus::report::now_ms(),
                self.max_clock_skew_ms,
            )
            .map(super::ledger::Implausible::label)
    }
}

/// What one leadership term hands the account: the controllers' caches and connections.
pub use settle::backend::Term;
pub use settle::backend::nats::capture::BucketLimits;
pub use settle::backend::{AmqpLookup, NatsLookup, PlacesFreed, QueueLookup};

/// Keeps one keeper per Backend until dropped (the end of the leadership term).
pub async fn run(term: Term, config: Config, metrics: Metrics) {
    // A store wakes only its latest waiter (the controllers wait too): ask again until it is.
    wait_ready(|| term.subscriptions.wait_until_ready()).await;
    wait_ready(|| term.backends.wait_until_ready()).await;
    let writer = writer::Writer::start(
        term.client.clone(),
        metrics.clone(),
        config.status_writes_per_second,
        term.subscriptions.clone(),
    );
    tracing::info!(
        "account started: the books of every NATS, RabbitMQ and SQS Backend's Subscriptions"
    );
    let mut keepers = Tasks::default();
    // The NATS connection each NATS keeper started on, by its serial number, and a client on it.
    let mut sessions: HashMap<BackendKey, NatsSession> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (wanted, kinds) = wanted_backends(&term);
        keepers.0.retain(|key, task| {
            let moved = sessions.get(key).is_some_and(|(started, _)| {
                (term.nats)(&key.0, &key.1).map(|(_, serial)| serial) != Some(*started)
            });
            if moved {
                tracing::info!(backend = %format!("{}/{}", key.0, key.1), "the Backend's NATS connection was made again or closed (its credentials, servers, TLS or consent changed): the account's session ends on the old one");
            }
            let deleted = !wanted.contains(key);
            let keep = !deleted && !task.is_finished() && !moved;
            if !keep {
                task.abort();
                if let Some((_, client)) = sessions.remove(key)
                    && deleted
                {
                    let (subs, key) = (term.subscriptions.clone(), key.clone());
                    tokio::spawn(async move {
                        // The Backend went once its Subscriptions had; the cache may see their
                        // deletions a moment after its own.
                        tokio::time::sleep(CACHE_LAG).await;
                        nats::drop_backend(client, subs, &key.0, &key.1).await;
                    });
                }
            }
            keep
        });
        for key in wanted {
            if keepers.0.contains_key(&key) {
                continue;
            }
            let Some(kind) = kinds.get(&key) else {
                continue;
            };
            if let Some((task, serial)) =
                start_keeper(&term, &writer, &config, &metrics, &key, kind)
            {
                if let Some(session) = serial {
                    sessions.insert(key.clone(), session);
                }
                keepers.0.insert(key, task);
            }
        }
    }
}

/// A Backend, by namespace and name.
type BackendKey = (String, String);

/// How long after a Backend's deletion what it kept is swept: the cache sees the deletions of
/// its Subscriptions (which the Backend waited for) within this.
const CACHE_LAG: Duration = Duration::from_secs(5);

/// The NATS connection a keeper runs on: its serial number, and a client on it.
type NatsSession = (u64, async_nats::Client);

/// The Backends that get a keeper now, and which keeper each gets.
fn wanted_backends(term: &Term) -> (Vec<BackendKey>, HashMap<BackendKey, Kind>) {
    let mut wanted = Vec::new();
    let mut kinds = HashMap::new();
    for b in term.backends.state() {
        let key = (b.namespace().unwrap_or_default(), b.name_any());
        let unseen = effective_capabilities(&b).is_none_or(|c| c.restart_can_spend_unseen_attempt);
        let kind = if b.spec.nats.is_some() {
            Kind::Nats { unseen }
        } else if b.spec.rabbitmq.is_some() {
            Kind::Rabbitmq { unseen }
        } else if b.spec.sqs.is_some() {
            Kind::Sqs { unseen }
        } else {
            continue;
        };
        kinds.insert(key.clone(), kind);
        wanted.push(key);
    }
    (wanted, kinds)
}

/// Starts Backend `key`'s keeper of `kind`, with the serial number of the NATS connection it
/// runs on and a client on it (None: a NATS Backend with no connection yet, tried again next
/// tick).
fn start_keeper(
    term: &Term,
    writer: &writer::Writer,
    config: &Config,
    metrics: &Metrics,
    key: &BackendKey,
    kind: &Kind,
) -> Option<(tokio::task::JoinHandle<()>, Option<NatsSession>)> {
    let unseen = match kind {
        Kind::Nats { unseen } => *unseen,
        Kind::Rabbitmq { unseen } => {
            let r = rabbitmq::RabbitKeeper::new(
                key.clone(),
                term.backends.clone(),
                term.rabbitmq.clone(),
                term.queues.clone(),
                term.freed.clone(),
                term.subscriptions.clone(),
                writer.clone(),
                config.clone(),
                metrics.clone(),
                // Uncounted until the keeper's session copies the Backend's dead
                // letters: then FromDeadLetters (the keeper decides, per session).
                if *unseen {
                    super::status::Unseen::Uncounted
                } else {
                    super::status::Unseen::Never
                },
            );
            return Some((tokio::spawn(r.run()), None));
        }
        Kind::Sqs { unseen } => {
            let s = sqs::SqsKeeper::new(
                key.clone(),
                term.backends.clone(),
                term.queues.clone(),
                term.subscriptions.clone(),
                writer.clone(),
                config.clone(),
                metrics.clone(),
                *unseen,
            );
            return Some((tokio::spawn(s.run()), None));
        }
    };
    let Some((client, serial)) = (term.nats)(&key.0, &key.1) else {
        tracing::debug!(backend = %format!("{}/{}", key.0, key.1), "account: the Backend has no connection yet");
        return None;
    };
    let k = nats::NatsKeeper::new(
        key.clone(),
        client.clone(),
        term.subscriptions.clone(),
        writer.clone(),
        config.clone(),
        metrics.clone(),
        if unseen {
            super::status::Unseen::FromAdvisories
        } else {
            super::status::Unseen::Never
        },
    );
    // Readers of this namespace's Backends deleted while no operator ran go too.
    let alive = term
        .backends
        .state()
        .iter()
        .filter(|b| b.namespace().as_deref() == Some(key.0.as_str()))
        .map(|b| nats::reader_name(&key.0, &b.name_any()))
        .collect();
    tokio::spawn(nats::drop_gone_readers(
        client.clone(),
        key.0.clone(),
        alive,
    ));
    Some((tokio::spawn(k.run()), Some((serial, client))))
}

/// Which keeper a Backend gets.
enum Kind {
    Nats { unseen: bool },
    Rabbitmq { unseen: bool },
    Sqs { unseen: bool },
}

async fn wait_ready<F, Fut, E>(ready: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(), E>>,
{
    while tokio::time::timeout(Duration::from_millis(200), ready())
        .await
        .is_err()
    {}
}

/// Tasks that end with the term: aborted when dropped.
#[derive(Default)]
pub struct Tasks(HashMap<(String, String), tokio::task::JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in self.0.values() {
            task.abort();
        }
    }
}
