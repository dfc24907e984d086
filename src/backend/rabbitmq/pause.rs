//! A Subscription's pause on RabbitMQ (docs/semantics.md W3). RabbitMQ has no pause of a
//! queue or a consumer, so the runtime stops fetching, and the operator leaves the signal on the
//! broker: while the Subscription is paused, an exchange named after its queue,
//! [`marker`] = `settle.paused.<queue>`, exists. The runtime checks it with a passive declare on a
//! channel of its own (a 404 closes that channel, never the consumer's), once per
//! `SETTLE_PAUSE_POLL_INTERVAL` (`backend::pause`).
//!
//! Why an exchange: a passive declare is the cheapest AMQP question (one round trip, no
//! management API, which applications do not have), and exchanges cost nothing at rest. It is
//! `internal` (no client can publish to it), durable (a broker restart keeps the pause) and
//! carries `x-settle-subscription: <namespace>/<name>` for people.
//!
//! Tenants: making or deleting the marker takes RabbitMQ's `configure` permission on its name,
//! so only a user whose configure pattern covers `settle.paused.<queue>` can pause or resume that
//! queue's applications. The operator's user has it (it declares `settle.*` names already);
//! a tenant's user, whose patterns name its own queues and its own `settle.(report|instances)
//! .<namespace>.` names (README, Multi-tenant brokers), has not. A user whose configure pattern
//! is `.*` on the vhost could pause any queue, and could delete any queue there too: it
//! touches them already. The check itself asks no permission.
//!
//! The operator's calls ([`set`], [`clear`]) and the runtime's ([`is_set`]) are here, so the
//! name is written once. It must not decide when to pause (the controller does, from the spec).

use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Connection, ExchangeKind};

use super::admin::{AdminError, channel, classify, done, reply_code};
use super::queue::OWNER_ARG;

/// The marker exchange of queue `queue`: present while its Subscription is paused.
pub fn marker(queue: &str) -> String {
    format!("settle.paused.{queue}")
}

/// Leaves the marker of `queue` for Subscription `owner` (`namespace/name`); idempotent.
pub async fn set(conn: &Connection, queue: &str, owner: &str) -> Result<(), AdminError> {
    let name = marker(queue);
    let ch = channel(conn).await?;
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from(OWNER_ARG),
        AMQPValue::LongString(LongString::from(owner)),
    );
    let r = ch
        .exchange_declare(
            ShortString::from(name.as_str()),
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

/// Removes the marker of `queue` (none there is fine).
pub async fn clear(conn: &Connection, queue: &str) -> Result<(), AdminError> {
    let name = marker(queue);
    let ch = channel(conn).await?;
    let r = ch
        .exchange_delete(
            ShortString::from(name.as_str()),
            ExchangeDeleteOptions::default(),
        )
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

/// Whether the marker of `queue` is there: a passive declare on a channel of its own.
pub async fn is_set(conn: &Connection, queue: &str) -> Result<bool, AdminError> {
    let name = marker(queue);
    let ch = channel(conn).await?;
    let r = ch
        .exchange_declare(
            ShortString::from(name.as_str()),
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
        Err(e) => Err(classify(format!("looking up the pause marker {name:?}"), &e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_is_named_after_the_queue_under_settles_prefix() {
        assert_eq!(marker("orders"), "settle.paused.orders");
        assert_eq!(marker("settle_shop_a"), "settle.paused.settle_shop_a");
    }
}
