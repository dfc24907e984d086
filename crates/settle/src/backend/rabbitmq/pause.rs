//! A Subscription's pause on RabbitMQ (docs/semantics.md W3). RabbitMQ has no pause of a
//! queue or a consumer, so the runtime stops fetching, and the operator leaves the signal on the
//! broker as one of two exchanges named after the queue: [`running_marker`]
//! (`settle.running.<queue>`) while it runs, [`paused_marker`] (`settle.paused.<queue>`) while
//! it is paused. The runtime asks with passive declares, each on a channel of its own (a 404
//! closes that channel, never the consumer's), once per `SETTLE_PAUSE_POLL_INTERVAL`
//! (`backend::pause`): first the marker of the state it last saw, which answers without a
//! refusal while nothing changes (a refusal is logged as an error by the AMQP client, so a check
//! refused every few seconds would fill every application's log); only when that one is missing,
//! the other. Neither there (a Subscription made by an operator from before pauses) reads as
//! running.
//! Pausing makes the paused marker before it removes the running one, and resuming the other
//! way round, so a check between the two steps never reads a state nobody asked for.
//!
//! Why exchanges: a passive declare is the cheapest AMQP question (one round trip, no
//! management API, which applications do not have), and an exchange costs nothing at rest (no
//! process, no messages). They are `internal` (no client can publish to them), durable (a
//! broker restart keeps the pause) and carry `x-settle-subscription: <namespace>/<name>` for
//! people.
//!
//! Tenants: making or deleting either marker takes RabbitMQ's `configure` permission on its
//! name, so only a user whose configure pattern covers `settle.(paused|running).<queue>` can pause
//! or resume that queue's applications. The operator's user has it (it declares `settle.*` names
//! already); a tenant's user, whose patterns name its own queues and its own
//! `settle.(report|instances).<namespace>.` names (README, Multi-tenant brokers), has not. A user
//! whose configure pattern is `.*` on the vhost could pause any queue, and could delete any queue
//! there too: it touches them already. The check itself asks no permission.
//!
//! The operator's calls ([`pause`], [`resume`], [`mark_running`], [`forget`]) and the runtime's
//! ([`is_paused`]) are here, so the names are written once. It must not decide when to pause
//! (the controller does, from the spec).

use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Connection, ExchangeKind};

use super::admin::{AdminError, channel, classify, done, reply_code};
use super::mapping::OWNER_ARG;

/// The exchange there while queue `queue`'s Subscription is paused.
pub fn paused_marker(queue: &str) -> String {
    format!("settle.paused.{queue}")
}

/// The exchange there while it runs.
pub fn running_marker(queue: &str) -> String {
    format!("settle.running.{queue}")
}

async fn declare(conn: &Connection, name: &str, owner: &str) -> Result<(), AdminError> {
    let ch = channel(conn).await?;
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from(OWNER_ARG),
        AMQPValue::LongString(LongString::from(owner)),
    );
    let r = ch
        .exchange_declare(
            ShortString::from(name),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                durable: true,
                internal: true,
                ..ExchangeDeclareOptions::default()
            },
            args,
        )
        .await;
    match r {
        Ok(()) => {
            done(ch).await;
            Ok(())
        }
        Err(e) => Err(classify(format!("declaring the pause marker {name:?}"), &e)),
    }
}

async fn delete(conn: &Connection, name: &str) -> Result<(), AdminError> {
    let ch = channel(conn).await?;
    let r = ch
        .exchange_delete(ShortString::from(name), ExchangeDeleteOptions::default())
        .await;
    match r {
        Ok(()) => {
            done(ch).await;
            Ok(())
        }
        Err(e) if reply_code(&e) == Some(404) => Ok(()),
        Err(e) => Err(classify(format!("deleting the pause marker {name:?}"), &e)),
    }
}

/// Whether exchange `name` is there: a passive declare on a channel of its own.
async fn exists(conn: &Connection, name: &str) -> Result<bool, AdminError> {
    let ch = channel(conn).await?;
    let r = ch
        .exchange_declare(
            ShortString::from(name),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    match r {
        Ok(()) => {
            done(ch).await;
            Ok(true)
        }
        Err(e) if reply_code(&e) == Some(404) => Ok(false),
        Err(e) => Err(classify(
            format!("looking up the pause marker {name:?}"),
            &e,
        )),
    }
}

/// Pauses queue `queue` of Subscription `owner` (`namespace/name`): the paused marker made,
/// then the running one removed. Idempotent.
pub async fn pause(conn: &Connection, queue: &str, owner: &str) -> Result<(), AdminError> {
    declare(conn, &paused_marker(queue), owner).await?;
    delete(conn, &running_marker(queue)).await
}

/// Resumes it: the running marker made, then the paused one removed. Idempotent.
pub async fn resume(conn: &Connection, queue: &str, owner: &str) -> Result<(), AdminError> {
    declare(conn, &running_marker(queue), owner).await?;
    delete(conn, &paused_marker(queue)).await
}

/// Makes the running marker of a Subscription that is not paused (its applications' checks
/// then answer without a refusal). Idempotent.
pub async fn mark_running(conn: &Connection, queue: &str, owner: &str) -> Result<(), AdminError> {
    declare(conn, &running_marker(queue), owner).await
}

/// Removes both markers (the Subscription is deleted).
pub async fn forget(conn: &Connection, queue: &str) -> Result<(), AdminError> {
    delete(conn, &paused_marker(queue)).await?;
    delete(conn, &running_marker(queue)).await
}

/// Whether queue `queue`'s Subscription is paused, asked first of the marker of the state it
/// was last seen in (`was_paused`), so a check in a steady state is one passive declare that
/// succeeds: seen running, the running marker there is running, else the paused marker says;
/// seen paused, the paused marker there is paused, and its absence is running.
pub async fn is_paused(
    conn: &Connection,
    queue: &str,
    was_paused: bool,
) -> Result<bool, AdminError> {
    if was_paused {
        return exists(conn, &paused_marker(queue)).await;
    }
    if exists(conn, &running_marker(queue)).await? {
        return Ok(false);
    }
    exists(conn, &paused_marker(queue)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_markers_are_named_after_the_queue_under_settles_prefix() {
        assert_eq!(paused_marker("orders"), "settle.paused.orders");
        assert_eq!(
            running_marker("settle_shop_a"),
            "settle.running.settle_shop_a"
        );
    }
}
