//! A JetStream consumer's pause kept equal to the spec's (`CONSUMER.PAUSE`, read back from the
//! info; never through the config diff). It must not change the consumer's config.

use super::*;
use settle::backend::nats::pause;

/// The consumer's pause equal to the spec's (semantics W2): read back from `CONSUMER.INFO`
/// (`live`, when the converge step read it or made the consumer, else [`read_pause`]), and set
/// with `CONSUMER.PAUSE` only when it differs ([`set_pause`]), so a consumer resumed (or
/// paused) by hand is put back ([`note_pause`]).
pub(super) async fn keep_paused(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &NatsConn,
    object: &ConsumerRef,
    live: Option<LivePause>,
    changes: &mut Changes,
) -> Result<(), SubOutcome> {
    let live = match live {
        Some(l) => l,
        None => read_pause(ctx, conn, object).await?,
    };
    if live.matches(t.pause) {
        return Ok(());
    }
    set_pause(t, ctx, conn, object).await?;
    note_pause(t, object, &live, changes);
    Ok(())
}

/// The consumer's pause as `CONSUMER.INFO` shows it.
async fn read_pause(
    ctx: &Ctx,
    conn: &NatsConn,
    object: &ConsumerRef,
) -> Result<LivePause, SubOutcome> {
    ctx.metrics.js("info");
    match admin::consumer_info(&conn.js, &object.stream, &object.name).await {
        Ok(Some(info)) => Ok(LivePause::of(&info)),
        Ok(None) => Err(broker_failure(
            NatsError::Unreachable("the consumer went while it was checked".into()),
            Some(object.clone()),
        )),
        Err(e) => Err(broker_failure(e, Some(object.clone()))),
    }
}

/// `CONSUMER.PAUSE` as the spec asks; an answer that does not match (a server before 2.11) is a
/// broker failure.
async fn set_pause(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &NatsConn,
    object: &ConsumerRef,
) -> Result<(), SubOutcome> {
    ctx.metrics.js("pause");
    let now = match admin::pause_consumer(
        &conn.js,
        &object.stream,
        &object.name,
        pause::request(t.pause),
    )
    .await
    {
        Ok(now) => now,
        Err(e) => return Err(broker_failure(e, Some(object.clone()))),
    };
    if !now.matches(t.pause) {
        return Err(broker_failure(
            NatsError::Api {
                code: 0,
                description: format!(
                    "CONSUMER.PAUSE answered paused={} (until {:?}) where the spec asks to be {} (JetStream's pause needs nats-server 2.11 or newer)",
                    now.paused,
                    now.until.map(|t| t.to_string()),
                    if t.pause.is_paused() {
                        "paused"
                    } else {
                        "running"
                    }
                ),
            },
            Some(object.clone()),
        ));
    }
    Ok(())
}

/// The pause set, said: resumed, or paused (and what it was before, `live`).
fn note_pause(t: &Target<'_>, object: &ConsumerRef, live: &LivePause, changes: &mut Changes) {
    let (kind, note) = match t.pause {
        Pause::Running => (
            ChangeKind::Resumed,
            format!(
                "resumed consumer {} on stream {}",
                object.name, object.stream
            ),
        ),
        p => (
            ChangeKind::Paused,
            format!(
                "paused consumer {} on stream {} {} (it was {})",
                object.name,
                object.stream,
                p.until_text(),
                if live.paused {
                    "paused until another time"
                } else {
                    "running"
                }
            ),
        ),
    };
    tracing::info!(subscription = %t.owner, stream = %object.stream, consumer = %object.name, op = kind.op(), "{note}");
    changes.push(kind, note);
}
