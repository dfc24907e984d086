//! Deleting a RabbitMQ Subscription's queue and its markers when the Subscription goes, only
//! when this object made or took it over; and, as a deleted Backend goes, its dead-letter copy
//! queue and the account queues its namespace's gone Subscriptions left.

use super::*;
use settle::backend::rabbitmq::pause;

/// The cleanup's broker call on RabbitMQ: deletes this Subscription's queue (with the messages
/// it holds), if it is there and this object's ([`claim`]): never a queue another made.
pub async fn remove(t: &Target<'_>, ctx: &Ctx, conn: &RabbitConn) -> Removal {
    let (ns, name, owner) = (&t.namespace, &t.name, &t.owner);
    let shown = &t.known;
    let queue_name = match shown {
        Some(c) => c.name.clone(),
        None => mapping::queue_name(ns, name, &t.policy),
    };
    let amqp = match conn.connection().await {
        Ok(c) => c,
        Err(e) => return Removal::Wait(e.to_string()),
    };
    let found = match find(ctx, conn, &amqp, &queue_name).await {
        Ok(Found::Missing) => {
            // Gone already: its pause markers, named after it, go too.
            let _ = pause::forget(&amqp, &queue_name).await;
            return Removal::Nothing;
        }
        Ok(f) => f,
        Err(e) if e.is_unreachable() => return Removal::Wait(e.to_string()),
        Err(e) => return Removal::Failed(e.to_string()),
    };
    let whose = claim_found(t, ctx, &amqp, &found, &queue_name, shown.is_some()).await;
    if let Claim::NotOurs(holder) = whose.claim {
        tracing::info!(subscription = %owner, queue = %queue_name, holder = ?holder, "the queue is not this Subscription object's: left alone");
        return Removal::Nothing;
    }
    ctx.metrics.js("queue.delete");
    match admin::delete(&amqp, &queue_name).await {
        Ok(()) => {
            let object = report::object_queue(ns, name);
            if let Err(e) = admin::delete(&amqp, &object).await {
                tracing::debug!(queue = %object, error = %e, "cannot delete the object mark");
            }
            if whose.taken {
                let adopted = report::adopted_queue(&queue_name);
                if let Err(e) = admin::delete(&amqp, &adopted).await {
                    tracing::debug!(queue = %adopted, error = %e, "cannot delete the adopted mark");
                }
            }
            if let Err(e) = pause::forget(&amqp, &queue_name).await {
                tracing::debug!(queue = %queue_name, error = %e, "cannot delete the pause markers");
            }
            conn.running_marked
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&queue_name);
            tracing::info!(subscription = %owner, queue = %queue_name, "deleted the queue");
            // Two queues fewer in the vhost: a create its limit refused may go now (the
            // account's three go once the object is gone, and say so again, `Term::freed`).
            ctx.conns
                .gates
                .freed(&(ns.clone(), t.sub.spec.backend_ref.name.clone()), None);
            Removal::Deleted(format!(
                "deleted queue {queue_name} (with any messages it held)"
            ))
        }
        Err(e) if e.is_unreachable() => Removal::Wait(e.to_string()),
        Err(e) => Removal::Failed(e.to_string()),
    }
}

/// A deleted Backend's copy of its dead-letter exchange (`settle.deadletters.<ns>.<backend>`),
/// deleted as the Backend goes: left, it would stay bound to the exchange and copy other
/// namespaces' dead letters up to its cap for good. Deleted when missing already too.
pub async fn remove_copy_queue(conn: &RabbitConn, namespace: &str, backend: &str) {
    let queue = dead_letters::copy_queue(namespace, backend);
    let amqp = match conn.connection().await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(backend = %format!("{namespace}/{backend}"), queue = %queue, error = %e, "the Backend goes, but its dead-letter copy queue cannot be deleted: it stays on the broker");
            return;
        }
    };
    match admin::delete(&amqp, &queue).await {
        Ok(()) => {
            tracing::info!(backend = %format!("{namespace}/{backend}"), queue = %queue, "the Backend goes: its dead-letter copy queue is deleted")
        }
        Err(e) => {
            tracing::warn!(backend = %format!("{namespace}/{backend}"), queue = %queue, error = %e, "the Backend goes, but its dead-letter copy queue cannot be deleted: it stays on the broker")
        }
    }
}

/// As a deleted Backend goes, the account queues of its namespace's Subscriptions that are gone
/// (`alive`: those that still exist), listed through the management API: deleted with the
/// Subscription, they are the account keeper's to drop at its next round, and a Backend deleted
/// at the same moment (a namespace deleted) ends that keeper first. Without a management API the
/// per-instance queues cannot be listed, and nothing is deleted here.
pub async fn remove_account_leftovers(conn: &RabbitConn, namespace: &str, alive: &[String]) {
    let Some(management) = &conn.management else {
        return;
    };
    let names = match management.queue_names(&conn.vhost).await {
        Ok(names) => names,
        Err(e) => {
            tracing::warn!(namespace = %namespace, error = %e, "the Backend goes, but its namespace's queues cannot be listed: account queues of gone Subscriptions may stay on the broker");
            return;
        }
    };
    let leftovers = report::leftover_account_queues(&names, namespace, alive);
    if leftovers.is_empty() {
        return;
    }
    let amqp = match conn.connection().await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(namespace = %namespace, error = %e, "the Backend goes, but the account queues of gone Subscriptions cannot be deleted: they stay on the broker");
            return;
        }
    };
    for q in leftovers {
        match admin::delete(&amqp, q).await {
            Ok(()) => {
                tracing::info!(queue = %q, "the Backend goes: the account queue of a gone Subscription is deleted")
            }
            Err(e) => {
                tracing::warn!(queue = %q, error = %e, "the Backend goes, but the account queue of a gone Subscription cannot be deleted: it stays on the broker")
            }
        }
    }
}
