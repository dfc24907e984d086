//! One SQS Backend's account keeper. Every instance of a Subscription's runtime sends its
//! cumulative report to the Subscription's report queue (`backend::sqs::report`, made by the
//! operator beside the queue); this keeper receives them (hidden for [`REPORT_HIDE`] while it
//! holds them), counts them with the ledger, and keeps the newest snapshot of the whole account
//! in the Subscription's ledger queue. Once a second it folds idle instances, saves the snapshots
//! that changed, and only then deletes the reports they contain, so a restart finds every
//! deleted report in the snapshot and every other one back in the queue (counted once: the
//! ledger skips a report it already holds). A SIGKILLed operator loses nothing and counts
//! nothing twice.
//!
//! Exhausted also comes from the broker side: messages the redrive policy moved to the
//! Subscription's dead-letter queue ([`dead_letters`]), each counted once by its message
//! id, and the account takes the larger of the runtime's and the broker's count.
//!
//! It reads the queue's gauges once per stats interval and shows the account through [`show`]
//! exactly as the other keepers do. Until a Subscription's runtime has reported (or a snapshot
//! exists), only the broker's gauges are written: no counter is invented. A report queue missing
//! on the server (deleted there; the reconcile makes it again) is said in `Accounted`.
//!
//! A report counts only where it belongs: its body names the Subscription whose report queue it
//! came from, else it is dropped (`misfiled`); who may send to that queue is the cloud
//! provider's permissions' to decide (docs/stats-report.md).
//!
//! Its files, the same as every keeper's: this one is the loop (a session, a Subscription's
//! book opened); [`count`] counts what comes in, [`round`] is the round (save, then delete),
//! [`store`] reads and writes the ledger queue, [`dead_letters`] counts the broker's.
//!
//! It must not write status itself (that is the writer), decide counts (that is the ledger), nor
//! make or delete a queue (that is the reconcile).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_sqs::Client;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::{ObjectRef, Store};

mod count;
mod dead_letters;
mod round;
mod store;

use super::ledger::Account;
use super::metrics::Metrics;
use super::queue_keeper::{self, Gauges, SubKey, who};
use super::show::{self, Showing};
use super::status::Unseen;
use super::writer::Writer;
use super::{Config, QueueLookup};
use dead_letters::DeadLetters;
use settle::api::{Backend, Subscription};
use settle::backend::QueueGauges;
use settle::backend::sqs::{admin, mapping, report};
use settle::bus::report::now_ms;
use settle::policy::ResolvedPolicy;
use store::{Loaded, Saved, delete_all, load, prune, secs, store};

/// How long a received report stays hidden from another receive while the keeper holds it
/// (counted, waiting for the snapshot that holds it to be saved, then deleted: one
/// Subscription's receive, save and delete, well under a second). A report queue is FIFO by
/// instance, so a held report also holds back that instance's later ones: after a leader is
/// SIGKILLed, its successor reads them once these holds run out. Kept at most the Lease's
/// duration less one renewal, so they have run out by the time a standby can take the Lease.
pub const REPORT_HIDE: Duration = Duration::from_secs(8);
/// Receives of (at most 10) reports per Subscription per second, at most: 300 reports a
/// second; more wait in the queue for the next second.
pub const REPORT_RECEIVES_PER_TICK: usize = 30;
/// SQS's largest batch.
pub(super) const BATCH: i32 = 10;
/// How often the keeper receives, folds, saves, deletes and decides what to write.
const TICK: Duration = Duration::from_secs(1);

/// One Subscription's account as the keeper holds it.
struct Book {
    account: Account,
    showing: Showing,
    generation: u64,
    dead_letters: DeadLetters,
    /// Something in the snapshot changed since the last save.
    dirty: bool,
    /// Receipts of the reports counted (or dropped) since the last save, with when they were
    /// received: deleted once it is saved (a receipt older than [`REPORT_HIDE`] is let go: that
    /// report is back in the queue, and counted as stale when it comes again).
    acks: Vec<(String, Instant)>,
    /// The runtime has reported (or a snapshot existed): counters are shown.
    counting: bool,
    /// The Subscription's queue (its full name) and its account queues' URLs.
    queue: String,
    report_url: String,
    ledger_url: String,
    /// The Subscription has a dead-letter queue the redrive moves exhausted messages to.
    redrives: bool,
    gauges: Gauges,
}

pub struct SqsKeeper {
    backend: SubKey,
    backends: Store<Backend>,
    queues: QueueLookup,
    subs: Store<Subscription>,
    writer: Writer,
    config: Config,
    metrics: Metrics,
    /// Whether the backend can spend a last attempt no handler saw (SQS: yes, semantics Q6).
    unseen: bool,
}

impl SqsKeeper {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        backend: SubKey,
        backends: Store<Backend>,
        queues: QueueLookup,
        subs: Store<Subscription>,
        writer: Writer,
        config: Config,
        metrics: Metrics,
        unseen: bool,
    ) -> SqsKeeper {
        SqsKeeper {
            backend,
            backends,
            queues,
            subs,
            writer,
            config,
            metrics,
            unseen,
        }
    }

    fn name(&self) -> String {
        format!("{}/{}", self.backend.0, self.backend.1)
    }

    /// The Backend's SQS client and queue prefix, while it has a connection.
    fn client(&self) -> Option<(Client, String)> {
        let prefix = self
            .backends
            .get(&ObjectRef::new(&self.backend.1).within(&self.backend.0))
            .and_then(|b| b.spec.sqs.as_ref().map(|s| s.queue_prefix.clone()))?
            .unwrap_or_default();
        match (self.queues)(&self.backend.0, &self.backend.1)? {
            QueueGauges::Sqs(client) => Some((client, prefix)),
            QueueGauges::Rabbitmq { .. } => None,
        }
    }

    /// Runs until aborted.
    pub async fn run(self) {
        let mut books: HashMap<SubKey, Book> = HashMap::new();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut connected: Option<bool> = None;
        loop {
            tick.tick().await;
            let Some((client, prefix)) = self.client() else {
                if connected != Some(false) {
                    tracing::debug!(backend = %self.name(), "account: the SQS Backend has no connection yet");
                    connected = Some(false);
                }
                continue;
            };
            if connected != Some(true) {
                tracing::info!(backend = %self.name(), "account keeper started (SQS report queues)");
                connected = Some(true);
            }
            let members = queue_keeper::members(&self.subs, &self.backend);
            // Gone, moved to another Backend, or deleted and applied again (another object):
            // the book is dropped (reports it counted but did not save were not deleted: they
            // come back to whichever book counts them next).
            books.retain(|key, book| {
                let keep = members
                    .get(key)
                    .is_some_and(|s| book.account.persisted().belongs_to(s.metadata.uid.as_deref()));
                if !keep && !members.contains_key(key) {
                    self.metrics.forget(&key.0, &key.1);
                    tracing::info!(subscription = %who(key), "the Subscription is gone from this Backend: its account is dropped here");
                }
                keep
            });
            self.open_new(&client, &prefix, &members, &mut books).await;
            self.settle(&client, &members, &mut books).await;
        }
    }

    /// Loads the book of every new Subscription whose account queues exist (its snapshot).
    async fn open_new(
        &self,
        client: &Client,
        prefix: &str,
        members: &HashMap<SubKey, Arc<Subscription>>,
        books: &mut HashMap<SubKey, Book>,
    ) {
        for (key, sub) in members {
            if books.contains_key(key) {
                continue;
            }
            // Only once the reconcile has made the queues (its consumer in status).
            if !queue_keeper::has_queue(sub) {
                continue;
            }
            let policy = ResolvedPolicy::resolve(&sub.spec.policy);
            let Ok(want) = mapping::desired(prefix, &policy) else {
                continue;
            };
            let who = who(key);
            let Some((report_url, ledger_url)) = account_urls(client, &who, &want.name).await
            else {
                continue;
            };
            let Some(saved) = load_own(client, &ledger_url, sub, &who).await else {
                continue;
            };
            let counting = saved.is_some();
            let Saved {
                generation,
                ledger,
                mut loss,
            } = saved.unwrap_or_default();
            let account = queue_keeper::open(sub, ledger, &mut loss, &self.config);
            tracing::info!(subscription = %who, generation, "counting the Subscription's SQS reports");
            books.insert(
                key.clone(),
                Book {
                    account,
                    showing: Showing {
                        loss,
                        ..Default::default()
                    },
                    generation,
                    dead_letters: DeadLetters::default(),
                    dirty: false,
                    acks: Vec::new(),
                    counting,
                    queue: want.name.clone(),
                    report_url,
                    ledger_url,
                    redrives: want.redrive.is_some(),
                    gauges: Gauges::default(),
                },
            );
        }
    }
}

/// The URLs of the account queues (reports, ledger) of Subscription queue `queue`, once the
/// reconcile has made them (None: not yet, or not looked up; tried again next tick).
async fn account_urls(client: &Client, who: &str, queue: &str) -> Option<(String, String)> {
    let (report_q, ledger_q) = (report::report_queue(queue), report::ledger_queue(queue));
    let urls = (
        admin::queue_url(client, &report_q).await,
        admin::queue_url(client, &ledger_q).await,
    );
    match urls {
        (Ok(Some(r)), Ok(Some(l))) => Some((r, l)),
        (Err(e), _) | (_, Err(e)) => {
            tracing::debug!(subscription = %who, error = %e, "cannot look up the account queues; trying again");
            None
        }
        _ => {
            tracing::debug!(subscription = %who, "the account queues are not made yet; waiting for the reconcile");
            None
        }
    }
}

/// The snapshot in the ledger queue, if this object's (an earlier object's of the same name is
/// not, semantics C15); None when it cannot be read now (tried again next tick).
async fn load_own(
    client: &Client,
    ledger_url: &str,
    sub: &Subscription,
    who: &str,
) -> Option<Option<Saved>> {
    let saved = match load(client, ledger_url).await {
        Ok(Loaded::Saved(s)) => s,
        Ok(Loaded::Busy) => {
            tracing::debug!(subscription = %who, "a snapshot is in flight in the ledger queue (an operator before this one read it): waiting until it is back");
            return None;
        }
        Err(e) => {
            tracing::warn!(subscription = %who, error = %e, "cannot read the saved ledger; trying again");
            return None;
        }
    };
    Some(match saved.map(|s| *s) {
        Some(s) if queue_keeper::earlier_object(&s.ledger, sub, who) => None,
        other => other,
    })
}
