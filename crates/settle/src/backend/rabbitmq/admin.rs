//! The AMQP calls the operator makes on queues Settle manages: is a queue there and how many
//! messages it holds ready (a passive declare, which the runtime's wait for an operator-made queue
//! asks too), declare it from the mapping, bind and unbind it, delete it. Each call uses a channel
//! of its own (a refused call closes its channel), closed after.
//!
//! It must not decide what a queue looks like (that is [`super::mapping`]) nor what to do about a
//! difference (the reconcile does).

use lapin::options::{QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection};

use super::mapping::{Binding, QueueSpec};
use crate::backend::limit::BrokerLimit;
use crate::backend::{Classify, Failure};

/// A refused or failed AMQP call.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    /// The connection is down or the call got no answer: try again later.
    #[error("RabbitMQ did not answer: {0}")]
    Unreachable(String),
    /// A queue of that name exists with other arguments (`406 PRECONDITION_FAILED`): RabbitMQ
    /// cannot change a queue's arguments in place.
    #[error("RabbitMQ refused to declare queue {queue:?} with the mapped arguments: {text}")]
    Differs { queue: String, text: String },
    /// The broker refused the call (the reply code and text say why).
    #[error("RabbitMQ refused {what}: {text}")]
    Refused { what: String, text: String },
    /// A declare refused for a limit (a vhost's `max-queues`, the cluster's
    /// `cluster_queue_limit`): `406 PRECONDITION_FAILED` (RabbitMQ) or `403` (LavinMQ), its text
    /// naming the limit ([`limit_of`]).
    #[error(transparent)]
    Limit(BrokerLimit),
    /// The queue was deleted between two calls on it (a bind after its declare, `404 NOT_FOUND`):
    /// what the broker holds is not known, so it is looked at again.
    #[error("queue {0:?} was deleted on the broker while Settle worked on it; checking it again")]
    Gone(String),
}

impl Classify for AdminError {
    fn class(&self) -> Failure {
        match self {
            AdminError::Unreachable(_) | AdminError::Gone(_) => Failure::Unreachable,
            AdminError::Differs { .. } | AdminError::Refused { .. } | AdminError::Limit(_) => {
                Failure::Refused
            }
        }
    }

    fn limit(&self) -> Option<BrokerLimit> {
        match self {
            AdminError::Limit(l) => Some(l.clone()),
            _ => None,
        }
    }
}

/// The limit a refused declare names, from the broker's text: "queue limit in vhost 'V' (N) is
/// reached", "queue limit in cluster (N) is reached" (rabbit_amqqueue's wording).
pub fn limit_of(text: &str) -> Option<BrokerLimit> {
    let number = |rest: &str| -> Option<i64> {
        let inner = rest.strip_prefix('(')?.split(')').next()?;
        inner.replace(',', "").trim().parse().ok()
    };
    if let Some((_, rest)) = text.split_once("queue limit in vhost '") {
        let (vhost, after) = rest.split_once('\'')?;
        return Some(BrokerLimit::VhostQueues {
            vhost: vhost.to_string(),
            max: number(after.trim_start()),
        });
    }
    let (_, rest) = text.split_once("queue limit in cluster")?;
    Some(BrokerLimit::ClusterQueues {
        max: number(rest.trim_start()),
    })
}

/// The AMQP reply code of a channel-level refusal, if the broker sent one.
pub(super) fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => Some(p.get_id()),
        _ => None,
    }
}

/// A failed call as the caller must tell it: refused by the broker (a 4xx reply), or not reached.
pub(super) fn classify(what: String, e: &lapin::Error) -> AdminError {
    match reply_code(e) {
        // Channel-level refusals: the broker answered.
        Some(c) if (400..500).contains(&c) => AdminError::Refused {
            what,
            text: e.to_string(),
        },
        _ => AdminError::Unreachable(format!("{what}: {e}")),
    }
}

pub(super) async fn channel(conn: &Connection) -> Result<Channel, AdminError> {
    conn.create_channel()
        .await
        .map_err(|e| AdminError::Unreachable(format!("cannot open a channel: {e}")))
}

pub(super) async fn done(ch: Channel) {
    if ch.status().connected() {
        let _ = ch.close(200, ShortString::from("done")).await;
    }
}

/// Whether queue `name` exists (a passive declare).
pub async fn exists(conn: &Connection, name: &str) -> Result<bool, AdminError> {
    Ok(depth(conn, name).await?.is_some())
}

/// How many messages queue `name` holds ready (`None`: it is gone), by a passive declare.
pub async fn depth(conn: &Connection, name: &str) -> Result<Option<u32>, AdminError> {
    let ch = channel(conn).await?;
    let r = ch
        .queue_declare(
            ShortString::from(name),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    match r {
        Ok(q) => {
            done(ch).await;
            Ok(Some(q.message_count()))
        }
        Err(e) if reply_code(&e) == Some(404) => Ok(None),
        Err(e) => Err(classify(format!("looking up queue {name:?}"), &e)),
    }
}

/// Declares `want` (durable, with its arguments); an existing queue with other compared
/// arguments is [`AdminError::Differs`].
pub async fn declare(conn: &Connection, want: &QueueSpec) -> Result<(), AdminError> {
    let ch = channel(conn).await?;
    let r = ch
        .queue_declare(
            ShortString::from(want.name.as_str()),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            want.arguments_table(),
        )
        .await;
    match r {
        Ok(_) => {
            done(ch).await;
            Ok(())
        }
        Err(e)
            if matches!(reply_code(&e), Some(403 | 406))
                && let Some(l) = limit_of(&e.to_string()) =>
        {
            Err(AdminError::Limit(l))
        }
        Err(e) if reply_code(&e) == Some(406) => Err(AdminError::Differs {
            queue: want.name.clone(),
            text: e.to_string(),
        }),
        Err(e) => Err(classify(format!("declaring queue {:?}", want.name), &e)),
    }
}

/// Binds queue `name` to `b.exchange` with `b.routing_key` (binding twice is harmless).
pub async fn bind(conn: &Connection, name: &str, b: &Binding) -> Result<(), AdminError> {
    let ch = channel(conn).await?;
    let r = ch
        .queue_bind(
            ShortString::from(name),
            ShortString::from(b.exchange.as_str()),
            ShortString::from(b.routing_key.as_str()),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await;
    match r {
        Ok(()) => {
            done(ch).await;
            Ok(())
        }
        // The queue, not the exchange, missing: RabbitMQ's 404 names which.
        Err(e)
            if reply_code(&e) == Some(404)
                && e.to_string().contains(&format!("no queue '{name}'")) =>
        {
            Err(AdminError::Gone(name.to_string()))
        }
        Err(e) => Err(classify(
            format!(
                "binding queue {name:?} to exchange {:?} with {:?}",
                b.exchange, b.routing_key
            ),
            &e,
        )),
    }
}

/// Removes one binding of queue `name`.
pub async fn unbind(conn: &Connection, name: &str, b: &Binding) -> Result<(), AdminError> {
    let ch = channel(conn).await?;
    let r = ch
        .queue_unbind(
            ShortString::from(name),
            ShortString::from(b.exchange.as_str()),
            ShortString::from(b.routing_key.as_str()),
            FieldTable::default(),
        )
        .await;
    match r {
        Ok(()) => {
            done(ch).await;
            Ok(())
        }
        Err(e) => Err(classify(
            format!("unbinding {:?} from queue {name:?}", b.routing_key),
            &e,
        )),
    }
}

/// Deletes queue `name` with whatever it holds; a queue already gone is no error.
pub async fn delete(conn: &Connection, name: &str) -> Result<(), AdminError> {
    let ch = channel(conn).await?;
    let r = ch
        .queue_delete(ShortString::from(name), QueueDeleteOptions::default())
        .await;
    match r {
        Ok(_) => {
            done(ch).await;
            Ok(())
        }
        Err(e) if reply_code(&e) == Some(404) => Ok(()),
        Err(e) => Err(classify(format!("deleting queue {name:?}"), &e)),
    }
}

/// Deletes queue `name` only if it holds no message and no consumer reads it (`if-empty`,
/// `if-unused`): whether it went (a queue in use, or holding something, stays).
pub async fn delete_if_idle(conn: &Connection, name: &str) -> Result<bool, AdminError> {
    let ch = channel(conn).await?;
    let r = ch
        .queue_delete(
            ShortString::from(name),
            QueueDeleteOptions {
                if_unused: true,
                if_empty: true,
                ..QueueDeleteOptions::default()
            },
        )
        .await;
    match r {
        Ok(_) => {
            done(ch).await;
            Ok(true)
        }
        Err(e) if reply_code(&e) == Some(404) => Ok(true),
        Err(e) if reply_code(&e) == Some(406) => Ok(false),
        Err(e) => Err(classify(format!("deleting queue {name:?}"), &e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_limit_is_read_from_the_brokers_words() {
        assert_eq!(
            limit_of(
                "PRECONDITION_FAILED - cannot declare queue 'q1': queue limit in vhost 'shop' (10) is reached"
            ),
            Some(BrokerLimit::VhostQueues {
                vhost: "shop".into(),
                max: Some(10)
            })
        );
        assert_eq!(
            limit_of(
                "PRECONDITION_FAILED - cannot declare queue 'q': queue limit in cluster (10,000) is reached"
            ),
            Some(BrokerLimit::ClusterQueues { max: Some(10_000) })
        );
        assert_eq!(
            limit_of("PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue 'q'"),
            None
        );
    }
}
