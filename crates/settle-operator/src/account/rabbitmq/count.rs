//! What comes in on a RabbitMQ Backend's account queues, one delivery at a time: a
//! Subscription's reports (its shared queue and each instance's, judged where they arrived and
//! who wrote them, then counted), an instance registering its queue in the index (consumed from
//! then on), and a copy of a dead letter (counted for the Subscription whose verified queue ran
//! it out of attempts, semantics R9–R12). Each is acknowledged only once the snapshot holding it
//! is saved (see `settle`).
//!
//! It must not save or acknowledge anything itself (that is `settle`), nor decide counts (that
//! is the ledger).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use futures::stream::{BoxStream, SelectAll};
use kube::runtime::reflector::ObjectRef;
use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicConsumeOptions};
use lapin::types::{FieldTable, ShortString};

use super::dead_letters::{self, Attribution, DeadLetters, Owner};
use super::{Book, Broken, RabbitKeeper, Source, broken};
use crate::account::ledger::BrokerOutcome;
use crate::account::queue_keeper::{self, SubKey, who};
use settle::api::Subscription;
use settle::backend::rabbitmq::report;
use settle::bus::report::StatsReport;

/// The report deliveries of every Subscription, by Subscription; `None` when its consumer
/// ended (the broker cancelled it: its queue was deleted).
pub(super) type Reports = SelectAll<
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
pub(super) fn tag_of(queue: &str) -> String {
    format!("settle-account-{queue}-{}", std::process::id())
}

/// Consumes `queue` for Subscription `key` into `reports`.
pub(super) async fn consume(
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
    /// An instance registered its report queue: consumed from now on, kept in the snapshot; the
    /// registration is acknowledged once the snapshot holding it is saved.
    pub(super) async fn on_registration(
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
            tracing::warn!(subscription = %who(key), user = ?d.properties.user_id(), "a registration by a user the Backend's reportUsers do not list: dropped");
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
            tracing::warn!(subscription = %who(key), "a registration naming no report queue of this Subscription's: dropped");
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
    pub(super) async fn on_dead_letter(
        &self,
        dl: &Channel,
        (owners, wanted): (&HashMap<String, Owner>, &BTreeSet<String>),
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
    pub(super) fn on_report(
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
        let report = queue_keeper::parse(&self.config, &d.data);
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
            queue_keeper::refused(&self.metrics, &who(key), why);
            book.showing
                .trouble
                .report_dropped(why, settle::bus::report::now_ms());
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
        if queue_keeper::count(&self.metrics, &who(key), &mut book.account, report) {
            book.dirty = true;
            book.counting = true;
        }
    }

    /// Whether `d` was written by a user whose reports count for this Backend: one its
    /// `reportUsers` list (by the `user_id` RabbitMQ validated), or anyone when it lists none.
    pub(super) fn written_by_a_reporter(&self, d: &lapin::message::Delivery) -> bool {
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
}

/// The next copy of a dead letter, when the Backend's are copied; pending otherwise.
pub(super) async fn next_copy(
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
pub(super) fn queues_of(
    members: &HashMap<SubKey, Arc<Subscription>>,
) -> (HashMap<String, Owner>, BTreeSet<String>, BTreeSet<String>) {
    let mut owners = HashMap::new();
    let mut wanted = BTreeSet::new();
    let mut keys = BTreeSet::new();
    for (key, sub) in members {
        let policy = settle::policy::ResolvedPolicy::resolve(&sub.spec.policy);
        if policy.mode != settle::api::Mode::AtLeastOnce {
            continue;
        }
        keys.insert(settle::backend::rabbitmq::mapping::routing_key(
            &policy.pattern,
        ));
        match sub.status.as_ref().and_then(|s| s.consumer.as_ref()) {
            Some(c) => {
                let since_s = sub
                    .metadata
                    .creation_timestamp
                    .as_ref()
                    .and_then(|t| u64::try_from(t.0.as_second()).ok())
                    .unwrap_or(0);
                let key = key.clone();
                owners.insert(c.name.clone(), Owner { key, since_s });
            }
            None => {
                wanted.insert(settle::backend::rabbitmq::mapping::queue_name(
                    &key.0, &key.1, &policy,
                ));
            }
        }
    }
    (owners, wanted, keys)
}

/// Whether report `r`, delivered from `source` of Subscription `key`, names that Subscription
/// and (from an instance's own queue) that queue's instance.
pub(super) fn arrived_where_it_belongs(r: &StatsReport, key: &SubKey, source: &Source) -> bool {
    if r.namespace != key.0 || r.subscription != key.1 {
        return false;
    }
    match source {
        Source::Instance(q) => *q == report::instance_queue(&key.0, &key.1, &r.instance),
        Source::Shared | Source::Index => true,
    }
}
