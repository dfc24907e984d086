//! Deleting a Subscription's JetStream consumer when the Subscription goes, only when this
//! object made or took it over.

use super::*;

pub(super) fn waiting(e: NatsError) -> Removal {
    match e {
        NatsError::Unreachable(m) => Removal::Wait(m),
        e => Removal::Failed(e.to_string()),
    }
}

/// The cleanup's broker call on NATS: deletes this Subscription's consumer, if it is there and
/// its own.
pub async fn remove(t: &Target<'_>, ctx: &Ctx, conn: &NatsConn) -> Removal {
    if !conn.connected() {
        return Removal::Wait("the Backend's connection is down".into());
    }
    let target = match t.known.clone() {
        Some(c) => c,
        None => {
            ctx.metrics.js("stream");
            match admin::resolve_stream(&conn.js, t.sub.spec.stream.as_deref(), &t.policy.pattern)
                .await
            {
                Ok(stream) => ConsumerRef {
                    name: mapping::consumer_name(&t.namespace, &t.name, &t.policy),
                    stream,
                },
                Err(NatsError::Unreachable(m)) => return Removal::Wait(m),
                // No stream, or several: Settle never made a consumer for it.
                Err(_) => return Removal::Nothing,
            }
        }
    };
    ctx.metrics.js("info");
    let info = match admin::consumer_info(&conn.js, &target.stream, &target.name).await {
        Ok(Some(i)) => i,
        Ok(None) => return Removal::Nothing,
        Err(e) => return waiting(e),
    };
    let owner = &t.owner;
    if !mapping::normalise(&target.stream, &target.name, &info.config).belongs_to(owner, t.uid()) {
        tracing::info!(subscription = %owner, consumer = %target.name, "the consumer is not this Subscription's: left alone");
        return Removal::Nothing;
    }
    conn.mark_own(Own::Deleted, &target.stream, &target.name);
    ctx.metrics.js("delete");
    if let Err(e) = admin::delete_consumer(&conn.js, &target.stream, &target.name).await {
        return waiting(e);
    }
    // A place on the stream: a create its limit refused may go now.
    ctx.conns.gates.freed(&keys(t).0, Some(&target.stream));
    tracing::info!(subscription = %owner, stream = %target.stream, consumer = %target.name, "deleted the consumer");
    Removal::Deleted(format!(
        "deleted consumer {} on stream {}",
        target.name, target.stream
    ))
}
