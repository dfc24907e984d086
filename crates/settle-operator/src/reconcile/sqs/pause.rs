//! The pause tag of an SQS queue (`settle-paused`, semantics W4) kept as the spec says.
//! It must not touch the queue's attributes otherwise.

use super::*;
use settle::backend::sqs::pause;

/// The queue's pause tag equal to the spec's (semantics W4): read with its owner tags, so a
/// steady state costs nothing more; tagged or untagged only when it differs (a tag removed by
/// hand comes back).
pub(super) async fn keep_paused(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &SqsConn,
    object: &ConsumerRef,
    found: &Found,
    changes: &mut Changes,
) -> Result<(), SubOutcome> {
    let want = pause::value(t.pause);
    if want == found.paused {
        return Ok(());
    }
    let client = conn.broker.client();
    let (result, kind, note) = match &want {
        Some(v) => {
            ctx.metrics.js("sqs.tag");
            (
                pause::set(client, &found.url, v).await,
                ChangeKind::Paused,
                format!(
                    "paused SQS queue {} {}: tagged {}={v}, every application stops receiving within its pause poll interval",
                    object.name,
                    t.pause.until_text(),
                    pause::TAG
                ),
            )
        }
        None => {
            ctx.metrics.js("sqs.untag");
            (
                pause::clear(client, &found.url).await,
                ChangeKind::Resumed,
                format!(
                    "resumed SQS queue {}: removed its tag {}",
                    object.name,
                    pause::TAG
                ),
            )
        }
    };
    if let Err(e) = result {
        return Err(failure(e, &Some(object.clone())));
    }
    tracing::info!(subscription = %t.owner, queue = %object.name, op = kind.op(), "{note}");
    changes.push(kind, note);
    Ok(())
}
