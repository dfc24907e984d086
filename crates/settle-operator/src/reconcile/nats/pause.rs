//! A JetStream consumer's pause kept equal to the spec's (`CONSUMER.PAUSE`, read back from the
//! info; never through the config diff). It must not change the consumer's config.

use super::*;
use settle::backend::nats::pause;

/// The consumer's pause equal to the spec's (semantics W2): read back from `CONSUMER.INFO`
/// (`live`, when the converge step read it or made the consumer), and set with `CONSUMER.PAUSE`
/// only when it differs, so a consumer resumed (or paused) by hand is put back.
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
        None => {
            ctx.metrics.js("info");
            match admin::consumer_info(&conn.js, &object.stream, &object.name).await {
                Ok(Some(info)) => LivePause::of(&info),
                Ok(None) => {
                    return Err(broker_failure(
                        NatsError::Unreachable("the consumer went while it was checked".into()),
                        Some(object.clone()),
                    ));
                }
                Err(e) => return Err(broker_failure(e, Some(object.clone()))),
            }
        }
    };
    if live.matches(t.pause) {
        return Ok(());
    }
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
    let (kind, note) = said(t.pause, object, live.paused);
    tracing::info!(subscription = %t.owner, stream = %object.stream, consumer = %object.name, op = kind.op(), "{note}");
    changes.push(kind, note);
    Ok(())
}

/// What the Event says of a pause set to `pause` on `object`, which `was_paused` before.
fn said(pause: Pause, object: &ConsumerRef, was_paused: bool) -> (ChangeKind, String) {
    match pause {
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
                if was_paused {
                    "paused until another time"
                } else {
                    "running"
                }
            ),
        ),
    }
}
