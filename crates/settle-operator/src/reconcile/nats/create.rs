//! Making a Subscription's JetStream consumer, and what a stream's `max_consumers` refusal
//! then says. It must not decide whose an existing consumer is (`claim`, the pipeline).

use super::*;
use settle::backend::nats::pause;

/// The Backend's and the Subscription's keys, as the gates know them.
pub(super) fn keys(t: &Target<'_>) -> (BackendKey, Who) {
    (
        (t.namespace.clone(), t.sub.spec.backend_ref.name.clone()),
        (t.namespace.clone(), t.name.clone()),
    )
}

pub(super) fn limited(limit: BrokerLimit) -> SubOutcome {
    SubOutcome::Broker {
        error: NatsError::Limit(limit).into(),
        consumer: None,
    }
}

/// A create refused for `limit`: named (which limit, read once while the gate is closed) and
/// its gate closed.
pub(super) async fn refused(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &NatsConn,
    limit: BrokerLimit,
) -> SubOutcome {
    let (backend, who) = keys(t);
    let limit = match limit {
        BrokerLimit::StreamConsumers {
            stream, max: None, ..
        } => {
            match ctx
                .conns
                .gates
                .known(&backend, &LimitScope::Stream(stream.clone()))
            {
                Some(known) => known,
                None => {
                    ctx.metrics.js("stream");
                    admin::consumer_limit(&conn.js, &stream).await.unwrap_or(
                        BrokerLimit::StreamConsumers {
                            stream,
                            max: None,
                            set_by: SetBy::Unknown,
                        },
                    )
                }
            }
        }
        other => other,
    };
    let delay = ctx.conns.gates.refused(&backend, limit.clone(), &who);
    tracing::info!(subscription = %t.owner, limit = limit.label(), retry_in = ?delay, "the broker refused the consumer for a limit: creates it holds back wait");
    limited(limit)
}

pub(super) fn ready(object: ConsumerRef) -> SubOutcome {
    SubOutcome::Ready {
        kind: ObjectKind::Consumer,
        object,
    }
}

/// Creates `want`, paused from the start when the spec asks; returns its pause.
pub(super) async fn create(
    conn: &NatsConn,
    ctx: &Ctx,
    want: &mapping::ConsumerConfig,
    pause: Pause,
) -> Result<LivePause, NatsError> {
    conn.mark_own(Own::Created, &want.stream, &want.name);
    ctx.metrics.js("create");
    match admin::create_consumer_paused(&conn.js, want, pause::request(pause)).await {
        Ok(info) => {
            conn.note_made(&want.stream, &want.name);
            Ok(LivePause::of(&info))
        }
        // Made meanwhile by a racing reconcile (an old leader's last call): converge next time.
        Err(e) if e.code() == Some(CONSUMER_EXISTS) => Err(NatsError::Unreachable(
            "the consumer was created concurrently; checking it again".into(),
        )),
        Err(e) => Err(e),
    }
}
