//! Making a RabbitMQ Subscription's queue: the object mark first, the account's queues and the
//! dead-letter copy before the queue, so a vhost's limit refuses the Subscription whole.
//! It must not decide whose an existing queue is (`claim`).

use super::*;

/// Makes and binds the Backend's dead-letter copy queue, if it has a dead-letter exchange,
/// before the queue that dead-letters is made (R9): the account then sees that queue's dead
/// letters from its start. Afterwards the account keeps it (made again, bound again). A failure
/// is logged: the account says what it cannot count, and the queue does not wait for it.
pub(super) async fn copy_dead_letters(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &RabbitConn,
    amqp: &lapin::Connection,
    want: &QueueSpec,
) {
    let Some(dlx) = &conn.exchanges.dead_letter else {
        return;
    };
    let ns = &t.namespace;
    let backend = &t.sub.spec.backend_ref.name;
    ctx.metrics.js("deadletters.copy");
    let copy = dead_letters::ensure_copy(
        amqp,
        ns,
        backend,
        dlx,
        std::slice::from_ref(&want.binding.routing_key),
        ctx.dead_letter_copy_max_length,
        None,
    )
    .await
    .map(|(copy, _)| copy);
    let who = &t.owner;
    match copy {
        Ok(
            dead_letters::Copy::Whole { made: true }
            | dead_letters::Copy::Partial { made: true, .. },
        ) => {
            tracing::info!(subscription = %who, queue = %dead_letters::copy_queue(ns, backend), "made the Backend's dead-letter copy queue")
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(subscription = %who, error = %e, "cannot make the Backend's dead-letter copy queue")
        }
    }
}

/// Marks the Subscription's queue as made for this object (its UID), where the runtime reads it.
pub(super) async fn mark_object(
    t: &Target<'_>,
    ctx: &Ctx,
    amqp: &lapin::Connection,
) -> Result<(), Box<SubOutcome>> {
    let Some(uid) = t.uid() else {
        return Ok(());
    };
    ctx.metrics.js("object.mark");
    report::mark_object(amqp, &t.namespace, &t.name, uid)
        .await
        .map_err(|e| {
            // The mark is a queue too: a vhost's queue limit refuses it first.
            let error = match admin::limit_of(&e.to_string()) {
                Some(l) => BrokerError::Limit(l),
                None => BrokerError::Unreachable(format!("cannot mark the queue's object: {e}")),
            };
            Box::new(failure(error, None))
        })
}

/// Makes the account's queues of the Subscription ([`report::account_queues`]) before its
/// own: each is a place under a vhost's `max-queues`, so a limit refuses the Subscription
/// before it holds a queue its account could not follow. Refused, it takes back what this call
/// declared that is empty and unused (a new Subscription's), so a refused Subscription holds no
/// place another could take (a refused declare closes only the channel opened for it).
pub(super) async fn make_account_queues(
    t: &Target<'_>,
    ctx: &Ctx,
    amqp: &lapin::Connection,
) -> Result<(), Box<SubOutcome>> {
    let unreachable = |e: String| {
        Box::new(failure(
            BrokerError::Unreachable(format!("cannot make the account's queues: {e}")),
            None,
        ))
    };
    ctx.metrics.js("account.declare");
    let ch = amqp
        .create_channel()
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    let refused = match report::declare_account(&ch, &t.namespace, &t.name).await {
        Ok(()) => {
            let _ = ch.close(200, "made".into()).await;
            return Ok(());
        }
        Err(r) => r,
    };
    let Some(limit) = admin::limit_of(&refused.error.to_string()) else {
        return Err(unreachable(refused.to_string()));
    };
    for q in &refused.declared {
        ctx.metrics.js("account.take_back");
        if let Err(e) = admin::delete_if_idle(amqp, q).await {
            tracing::debug!(queue = %q, error = %e, "cannot take back an account queue a limit left alone");
        }
    }
    Err(Box::new(failure(BrokerError::Limit(limit), None)))
}

/// Declares and binds the queue, and says what it did: made for the first time, or again after
/// it was deleted on the broker.
pub(super) async fn create(
    t: &Target<'_>,
    ctx: &Ctx,
    amqp: &lapin::Connection,
    want: &QueueSpec,
    here: &ConsumerRef,
) -> Result<super::super::step::Change, SubOutcome> {
    // The object mark first: a runtime that finds the queue finds whose it is, and so does the
    // next check without the management API (R8).
    let (ns, name, known) = (&t.namespace, &t.name, &t.known);
    ctx.metrics.js("object.read");
    let before = report::read_object(amqp, ns, name).await;
    make_account_queues(t, ctx, amqp).await.map_err(|o| *o)?;
    mark_object(t, ctx, amqp).await.map_err(|o| *o)?;
    ctx.metrics.js("queue.declare");
    match admin::declare(amqp, want).await {
        Ok(()) => {}
        Err(AdminError::Differs { text, .. }) => {
            // Made meanwhile by someone else, with other arguments: not this object's. The mark
            // written for it is taken back, so it claims nothing (R8); judged on the next check.
            let undone = match &before {
                Some(old) => report::mark_object(amqp, ns, name, old)
                    .await
                    .map_err(|e| e.to_string()),
                None => admin::delete(amqp, &report::object_queue(ns, name))
                    .await
                    .map_err(|e| e.to_string()),
            };
            if let Err(e) = undone {
                tracing::warn!(subscription = %t.owner, queue = %want.name, error = %e, "cannot take back the object mark of a queue made meanwhile by someone else");
            }
            return Err(failure(BrokerError::Refused(text), known.clone()));
        }
        Err(e) => return Err(failure(BrokerError::of(e), known.clone())),
    }
    ctx.metrics.js("queue.bind");
    if let Err(e) = admin::bind(amqp, &want.name, &want.binding).await {
        return Err(failure(BrokerError::of(e), known.clone()));
    }
    let again = known.as_ref() == Some(here);
    let (kind, note) = if again {
        (
            ChangeKind::Recreated,
            format!(
                "queue {} was missing from the broker (deleted there): made it again and bound it to {} with {}",
                want.name, want.binding.exchange, want.binding.routing_key
            ),
        )
    } else {
        (
            ChangeKind::Created,
            format!(
                "created quorum queue {} bound to {} with {}",
                want.name, want.binding.exchange, want.binding.routing_key
            ),
        )
    };
    tracing::info!(subscription = %t.owner, queue = %want.name, op = kind.op(), "queue");
    Ok(super::super::step::Change { kind, note })
}
