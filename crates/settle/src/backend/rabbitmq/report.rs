//! Stats reports on RabbitMQ (docs/stats-report.md). Each running instance life reports to a
//! queue of its own, `settle.report.<namespace>.<subscription>.<instance>`, that holds one
//! message, its newest report (`x-max-length: 1`, `drop-head`): reports are cumulative, so the
//! newest is all that matters, and no other instance's reports can ever push it out. The
//! instance registers that queue once, in its Subscription's index queue
//! `settle.instances.<namespace>.<subscription>`, which refuses rather than drops when full
//! (`reject-publish`), so a registration is confirmed or retried, never lost. Every publish is
//! `mandatory` and confirmed within a timeout: a report to a queue that is gone comes back, and
//! the queue is declared and registered again. The operator's account consumes the index and
//! every registered queue, and keeps its ledger in `settle.ledger.<namespace>.<subscription>`;
//! it still consumes `settle.stats.<namespace>.<subscription>`, where runtimes before instance
//! queues reported (bounded, `drop-head`).
//!
//! [`queue_arguments`] is the one place their arguments are built; the runtime and the operator
//! both declare through [`declare`], so they declare identically.
//!
//! The operator also marks which Subscription object (UID) a queue was made for, in a third
//! one-message queue, `settle.object.<namespace>.<subscription>`: AMQP cannot read a queue's
//! arguments, so this is where a runtime bound to the queue learns the UID it reports its
//! counts for ([`mark_object`], [`read_object`]; docs/semantics.md C15). A queue Settle did not
//! make, taken over by `spec.adopt: IfCompatible`, cannot take the owner and object arguments
//! (RabbitMQ cannot change arguments in place): they are kept beside it, by its name, in a fourth
//! one-message queue, `settle.adopted.<queue>` ([`mark_adopted`], [`read_adopted`]; R13).
//!
//! Reports and registrations carry the connection's user as `user_id`, which RabbitMQ
//! validates (it refuses a message whose `user_id` is not the connection's user): the operator
//! counts a report only from a user its Backend lists (`reportUsers`), since on a shared vhost
//! anyone who may publish to the default exchange can reach any queue.
//!
//! It must not interpret a report (the operator's ledger does).

use std::collections::HashSet;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, BasicRejectOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel};
use serde::Deserialize;

use super::{RabbitBroker, amqp};
use crate::bus::{BusError, StatsSink};
use crate::policy::BackendKind;

/// Reports a Subscription's (legacy) shared report queue keeps at most (the oldest dropped beyond).
pub const REPORTS_MAX_LENGTH: i64 = 10_000;
/// Snapshots a Subscription's ledger queue keeps: the newest only. Also an instance's report
/// queue (its newest report) and the object mark.
pub const LEDGER_MAX_LENGTH: i64 = 1;
/// Instance queues a Subscription's index registers at most before it refuses more (each
/// instance life registers once; folded instances' queues are deleted).
pub const INDEX_MAX_LENGTH: i64 = 100_000;
/// How long a publish waits for the broker's confirm.
pub const CONFIRM_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The queue one instance life of a Subscription reports to (its newest report only).
pub fn instance_queue(namespace: &str, subscription: &str, instance: &str) -> String {
    format!("settle.report.{namespace}.{subscription}.{instance}")
}

/// The queue in which a Subscription's instances register their report queues.
pub fn index_queue(namespace: &str, subscription: &str) -> String {
    format!("settle.instances.{namespace}.{subscription}")
}

/// What an index message says: which queue an instance reports to.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct Registration {
    pub queue: String,
}

/// Declares the index queue of a Subscription (durable, refusing when full).
pub async fn declare_index(ch: &Channel, name: &str) -> Result<(), lapin::Error> {
    ch.queue_declare(
        ShortString::from(name),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        arguments(INDEX_MAX_LENGTH, "reject-publish"),
    )
    .await
    .map(|_| ())
}

/// Why a confirmed publish did not land.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("{0}")]
    Amqp(#[from] lapin::Error),
    /// The queue does not exist (the mandatory publish came back).
    #[error("queue {0:?} does not exist (the report came back)")]
    Returned(String),
    /// The broker refused it (a full queue that refuses rather than drops).
    #[error("the broker refused the publish to {0:?} (basic.nack: full?)")]
    Refused(String),
    #[error("no confirm for the publish to {0:?} within {1:?}")]
    Timeout(String, std::time::Duration),
}

/// Publishes `body` to `queue` through the default exchange, persistent and mandatory, on a
/// channel with publisher confirms, and waits for the confirm (at most [`CONFIRM_TIMEOUT`]).
pub async fn publish_confirmed(ch: &Channel, queue: &str, body: &[u8]) -> Result<(), PublishError> {
    publish_confirmed_as(ch, queue, body, None).await
}

/// As [`publish_confirmed`], with `user_id` set to `user` (the connection's own user: RabbitMQ
/// refuses a message whose `user_id` is not, so the reader knows who wrote it).
pub async fn publish_confirmed_as(
    ch: &Channel,
    queue: &str,
    body: &[u8],
    user: Option<&str>,
) -> Result<(), PublishError> {
    let mut properties = persistent_json();
    if let Some(user) = user {
        properties = properties.with_user_id(ShortString::from(user));
    }
    let confirm = ch
        .basic_publish(
            ShortString::from(""),
            ShortString::from(queue),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            body,
            properties,
        )
        .await?;
    let confirmation = tokio::time::timeout(CONFIRM_TIMEOUT, confirm)
        .await
        .map_err(|_| PublishError::Timeout(queue.to_string(), CONFIRM_TIMEOUT))??;
    if confirmation.is_nack() {
        return Err(PublishError::Refused(queue.to_string()));
    }
    if confirmation.take_message().is_some() {
        return Err(PublishError::Returned(queue.to_string()));
    }
    Ok(())
}

/// The queue a Subscription's reports go to.
pub fn report_queue(namespace: &str, subscription: &str) -> String {
    format!("settle.stats.{namespace}.{subscription}")
}

/// The queue a Subscription's account snapshot is kept in.
pub fn ledger_queue(namespace: &str, subscription: &str) -> String {
    format!("settle.ledger.{namespace}.{subscription}")
}

/// The queues the operator's account keeps for a Subscription: its (legacy) report queue, its
/// ledger and its index. The controller declares them before the Subscription's own queue and
/// object mark (each a place under a vhost's `max-queues`), so a vhost's limit refuses a
/// Subscription whole, never its account alone; the account deletes them once the object is
/// gone.
pub fn account_queues(namespace: &str, subscription: &str) -> [String; 3] {
    [
        report_queue(namespace, subscription),
        ledger_queue(namespace, subscription),
        index_queue(namespace, subscription),
    ]
}

/// Of `names` (a vhost's queues), the account queues of namespace `namespace` that belong to
/// no Subscription in `alive` (the namespace's Subscriptions that still exist): the report,
/// ledger, index and object queues and each instance's report queue
/// (`settle.report.<namespace>.<subscription>.<instance>`; a name may hold dots). Pure.
pub fn leftover_account_queues<'a>(
    names: &'a [String],
    namespace: &str,
    alive: &[String],
) -> Vec<&'a str> {
    names
        .iter()
        .filter(|q| {
            let Some((kind, rest)) = ["stats", "ledger", "instances", "object", "report"]
                .iter()
                .find_map(|kind| {
                    q.strip_prefix(&format!("settle.{kind}.{namespace}."))
                        .map(|rest| (*kind, rest))
                })
            else {
                return false;
            };
            let owned = if kind == "report" {
                alive.iter().any(|a| rest.starts_with(&format!("{a}.")))
            } else {
                alive.iter().any(|a| a == rest)
            };
            !owned
        })
        .map(String::as_str)
        .collect()
}

/// An account queue the broker refused to declare.
#[derive(Debug, thiserror::Error)]
#[error("declaring {queue:?}: {error}")]
pub struct AccountRefused {
    pub queue: String,
    /// The account queues declared before it, in this call.
    pub declared: Vec<String>,
    pub error: lapin::Error,
}

/// Declares [`account_queues`], in that order, with their arguments; the queue refused, and
/// what was declared before it, when one is (the refusal closes `ch`).
pub async fn declare_account(
    ch: &Channel,
    namespace: &str,
    subscription: &str,
) -> Result<(), AccountRefused> {
    let [reports, ledger, index] = account_queues(namespace, subscription);
    let refused = |queue: String, declared: &[String], error| AccountRefused {
        queue,
        declared: declared.to_vec(),
        error,
    };
    let mut declared = Vec::new();
    if let Err(e) = declare(ch, &reports, REPORTS_MAX_LENGTH).await {
        return Err(refused(reports, &declared, e));
    }
    declared.push(reports);
    if let Err(e) = declare(ch, &ledger, LEDGER_MAX_LENGTH).await {
        return Err(refused(ledger, &declared, e));
    }
    declared.push(ledger);
    declare_index(ch, &index)
        .await
        .map_err(|e| refused(index, &declared, e))
}

/// The queue holding the UID of the Subscription object the Subscription's queue was made for.
pub fn object_queue(namespace: &str, subscription: &str) -> String {
    format!("settle.object.{namespace}.{subscription}")
}

/// What the object queue holds.
#[derive(PartialEq, serde::Serialize, Deserialize)]
struct ObjectMark {
    uid: String,
}

/// The queue that says whose a queue Settle did not make is, once a Subscription took it over
/// (`spec.adopt: IfCompatible`): RabbitMQ cannot add the owner and object arguments to a queue
/// in place, so they are kept beside it, by the queue's name, where any Subscription of any
/// namespace that names the queue reads them (docs/semantics.md R13).
pub fn adopted_queue(queue: &str) -> String {
    format!("settle.adopted.{queue}")
}

/// What the adopted queue holds: what the owner and object arguments would say.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct AdoptedMark {
    /// `namespace/name` of the Subscription that took the queue over.
    pub subscription: String,
    /// Its object's UID.
    pub uid: String,
}

/// Marks `namespace/subscription`'s queue as made for object `uid` (the operator, before it
/// declares the queue): the one message of its object queue, replaced when it names another.
pub async fn mark_object(
    conn: &lapin::Connection,
    namespace: &str,
    subscription: &str,
    uid: &str,
) -> Result<(), lapin::Error> {
    let mark = ObjectMark {
        uid: uid.to_string(),
    };
    put_mark(conn, &object_queue(namespace, subscription), &mark).await
}

/// The UID of the object `namespace/subscription`'s queue was made for, as the operator marked
/// it (None: not marked, or the mark cannot be read). The runtime reads it when it binds.
pub async fn read_object(
    conn: &lapin::Connection,
    namespace: &str,
    subscription: &str,
) -> Option<String> {
    get_mark::<ObjectMark>(conn, &object_queue(namespace, subscription))
        .await
        .map(|m| m.uid)
}

/// Marks queue `queue`, which Settle did not make, as taken over by `mark`'s Subscription
/// object (the operator, before it uses the queue).
pub async fn mark_adopted(
    conn: &lapin::Connection,
    queue: &str,
    mark: &AdoptedMark,
) -> Result<(), lapin::Error> {
    put_mark(conn, &adopted_queue(queue), mark).await
}

/// Who took queue `queue` over, if a Subscription did (None: nobody, or it cannot be read).
pub async fn read_adopted(conn: &lapin::Connection, queue: &str) -> Option<AdoptedMark> {
    get_mark(conn, &adopted_queue(queue)).await
}

/// Makes `mark` the one message of the one-message queue `queue`, unless it already is.
async fn put_mark<T>(conn: &lapin::Connection, queue: &str, mark: &T) -> Result<(), lapin::Error>
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq,
{
    let ch = conn.create_channel().await?;
    let result = async {
        declare(&ch, queue, LEDGER_MAX_LENGTH).await?;
        let held = ch
            .basic_get(ShortString::from(queue), BasicGetOptions { no_ack: false })
            .await?;
        if let Some(msg) = &held
            && serde_json::from_slice::<T>(&msg.delivery.data).is_ok_and(|m| &m == mark)
        {
            ch.basic_reject(
                msg.delivery.delivery_tag,
                BasicRejectOptions { requeue: true },
            )
            .await?;
            return Ok(());
        }
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        let body = serde_json::to_vec(mark).unwrap_or_default();
        ch.basic_publish(
            ShortString::from(""),
            ShortString::from(queue),
            BasicPublishOptions::default(),
            &body,
            persistent_json(),
        )
        .await?
        .await?;
        if let Some(msg) = held {
            ch.basic_ack(msg.delivery.delivery_tag, BasicAckOptions::default())
                .await?;
        }
        Ok(())
    }
    .await;
    if ch.status().connected() {
        let _ = ch.close(200, ShortString::from("marked")).await;
    }
    result
}

/// How long a read of a mark waits for it while another reader holds it.
const MARK_HELD_FOR_AT_MOST: std::time::Duration = std::time::Duration::from_secs(2);

/// The one message of the one-message queue `queue`, read and put back (None: no queue, no
/// message, or not a `T`). A read takes the message and puts it back, so for that moment the
/// queue looks empty to another reader (the applications of a Subscription read its mark at
/// once when a broker comes back, and the operator replaces it): an empty queue is read again
/// every 50 ms for up to [`MARK_HELD_FOR_AT_MOST`] before it counts as unmarked, or the
/// reader would count for the object it was bound to before.
async fn get_mark<T: serde::de::DeserializeOwned>(
    conn: &lapin::Connection,
    queue: &str,
) -> Option<T> {
    // A missing queue closes the channel (404): one of its own.
    let ch = conn.create_channel().await.ok()?;
    let deadline = tokio::time::Instant::now() + MARK_HELD_FOR_AT_MOST;
    let held = loop {
        match ch
            .basic_get(ShortString::from(queue), BasicGetOptions { no_ack: false })
            .await
        {
            Ok(None) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            other => break other.ok().flatten(),
        }
    };
    let mark = match held {
        Some(msg) => {
            let mark = serde_json::from_slice::<T>(&msg.delivery.data).ok();
            let _ = ch
                .basic_reject(
                    msg.delivery.delivery_tag,
                    BasicRejectOptions { requeue: true },
                )
                .await;
            mark
        }
        None => None,
    };
    if ch.status().connected() {
        let _ = ch.close(200, ShortString::from("read")).await;
    }
    mark
}

/// The arguments of a report or ledger queue: classic, at most `max_length` messages, the
/// oldest dropped when a new one comes.
pub fn queue_arguments(max_length: i64) -> FieldTable {
    arguments(max_length, "drop-head")
}

fn arguments(max_length: i64, overflow: &str) -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString(LongString::from("classic")),
    );
    t.insert(
        ShortString::from("x-max-length"),
        AMQPValue::LongLongInt(max_length),
    );
    t.insert(
        ShortString::from("x-overflow"),
        AMQPValue::LongString(LongString::from(overflow)),
    );
    t
}

/// Declares (durable) the report or ledger queue `name` holding at most `max_length`
/// messages. A refusal closes `ch`.
pub async fn declare(ch: &Channel, name: &str, max_length: i64) -> Result<(), lapin::Error> {
    ch.queue_declare(
        ShortString::from(name),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        queue_arguments(max_length),
    )
    .await
    .map(|_| ())
}

/// The properties of a report or snapshot: JSON, persistent.
pub fn persistent_json() -> BasicProperties {
    BasicProperties::default()
        .with_content_type(ShortString::from("application/json"))
        .with_delivery_mode(2)
}

/// The part of a report that names its queue.
#[derive(Deserialize)]
struct Owner {
    namespace: String,
    subscription: String,
    instance: String,
}

impl RabbitBroker {
    /// Declares an instance's report queue and registers it in its Subscription's index, once
    /// per broker (before its first report, and again after the queue was found gone).
    async fn register(&self, owner: &Owner, queue: &str) -> Result<(), BusError> {
        if self
            .reports_declared
            .lock()
            .is_ok_and(|d| d.contains(queue))
        {
            return Ok(());
        }
        // A refused declare closes its channel: one of its own.
        let ch = self
            .conn()
            .await?
            .create_channel()
            .await
            .map_err(amqp("cannot open a channel"))?;
        let index = index_queue(&owner.namespace, &owner.subscription);
        let registered = async {
            declare(&ch, queue, LEDGER_MAX_LENGTH).await?;
            declare_index(&ch, &index).await?;
            ch.confirm_select(lapin::options::ConfirmSelectOptions::default())
                .await?;
            let body = serde_json::to_vec(&Registration {
                queue: queue.to_string(),
            })
            .unwrap_or_default();
            publish_confirmed_as(&ch, &index, &body, self.user.as_deref()).await
        }
        .await;
        if ch.status().connected() {
            let _ = ch.close(200, ShortString::from("registered")).await;
        }
        registered.map_err(|e| {
            BusError::backend(
                BackendKind::Rabbitmq,
                format!("cannot register the report queue {queue:?} in {index:?}: {e}"),
            )
        })?;
        if let Ok(mut d) = self.reports_declared.lock() {
            d.insert(queue.to_string());
        }
        Ok(())
    }
}

impl StatsSink for RabbitBroker {
    /// Publishes one report (persistent, mandatory, confirmed) to its instance's own report
    /// queue; `key` is not used, the report names its Subscription and instance. A report that
    /// comes back (its queue gone) is an error: the queue is declared and registered again at
    /// the next report.
    fn put(&self, _key: String, value: Bytes) -> BoxFuture<'_, Result<(), BusError>> {
        async move {
            let owner: Owner = serde_json::from_slice(&value).map_err(|e| {
                BusError::backend(
                    BackendKind::Rabbitmq,
                    format!("a stats report without its Subscription: {e}"),
                )
            })?;
            let queue = instance_queue(&owner.namespace, &owner.subscription, &owner.instance);
            self.register(&owner, &queue).await?;
            let ch = self.publisher().await?;
            match publish_confirmed_as(&ch, &queue, &value, self.user.as_deref()).await {
                Ok(()) => Ok(()),
                Err(e) => {
                    if matches!(e, PublishError::Returned(_))
                        && let Ok(mut d) = self.reports_declared.lock()
                    {
                        d.remove(&queue);
                    }
                    Err(BusError::backend(
                        BackendKind::Rabbitmq,
                        format!("a report to {queue:?} did not land: {e}"),
                    ))
                }
            }
        }
        .boxed()
    }
}

/// Reports declared by this process, shared by a broker's clones.
pub(super) type Declared = std::sync::Arc<std::sync::Mutex<HashSet<String>>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_account_queues_of_gone_subscriptions_are_leftovers_and_no_others() {
        let names: Vec<String> = [
            "settle.stats.shop.gone",
            "settle.ledger.shop.gone",
            "settle.instances.shop.gone",
            "settle.object.shop.gone",
            "settle.report.shop.gone.pid-1-2",
            "settle.report.shop.orders.v2.pid-1-2",
            "settle.ledger.shop.orders.v2",
            "settle.ledger.shop.orders",
            "settle.ledger.other.gone",
            "settle.deadletters.shop.rabbit",
            "orders",
        ]
        .map(String::from)
        .to_vec();
        let alive = ["orders".to_string(), "orders.v2".to_string()];
        assert_eq!(
            leftover_account_queues(&names, "shop", &alive),
            [
                "settle.stats.shop.gone",
                "settle.ledger.shop.gone",
                "settle.instances.shop.gone",
                "settle.object.shop.gone",
                "settle.report.shop.gone.pid-1-2",
            ]
        );
    }

    #[test]
    fn queue_names_are_the_subscriptions_own() {
        assert_eq!(report_queue("shop", "orders"), "settle.stats.shop.orders");
        assert_eq!(ledger_queue("shop", "orders"), "settle.ledger.shop.orders");
        assert_ne!(report_queue("a", "b"), report_queue("a", "c"));
    }

    #[test]
    fn arguments_bound_the_queue_and_drop_the_oldest() {
        let t = queue_arguments(REPORTS_MAX_LENGTH);
        let get = |k: &str| t.inner().get(&ShortString::from(k)).cloned();
        assert_eq!(
            get("x-max-length"),
            Some(AMQPValue::LongLongInt(REPORTS_MAX_LENGTH))
        );
        assert_eq!(
            get("x-overflow"),
            Some(AMQPValue::LongString(LongString::from("drop-head")))
        );
        assert_eq!(
            get("x-queue-type"),
            Some(AMQPValue::LongString(LongString::from("classic")))
        );
        assert_eq!(t.inner().len(), 3);
    }
}
