//! The pause markers of a RabbitMQ queue (semantics W3) kept as the spec says.
//! It must not touch the queue itself.

use super::*;
use settle::backend::rabbitmq::pause;

/// The pause markers (semantics W3) as the spec says: while paused, `settle.paused.<queue>`
/// and no `settle.running.<queue>` (looked up on each check, made when missing: a pause lifted
/// by hand comes back); when resumed, the other way round, once; while running, the running
/// marker made once per connection (its applications' checks then answer without a refusal).
pub(super) async fn keep_paused(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &RabbitConn,
    object: &ConsumerRef,
    changes: &mut Changes,
) -> Result<(), SubOutcome> {
    let queue = &object.name;
    let shown_paused = matches!(t.pause_shown.as_deref(), Some(s) if s != "False");
    let marked = || {
        conn.running_marked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(queue)
    };
    if !t.pause.is_paused() && !shown_paused && marked() {
        return Ok(());
    }
    let known = Some(object.clone());
    let broker = |e| failure(BrokerError::of(e), known.clone());
    let amqp = conn
        .connection()
        .await
        .map_err(|e| failure(BrokerError::of(e), known.clone()))?;
    let note_marked = |running: bool| {
        let mut m = conn
            .running_marked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if running {
            m.insert(queue.clone());
        } else {
            m.remove(queue);
        }
    };
    if t.pause.is_paused() {
        ctx.metrics.js("queue.pause_marker");
        // As an application that last saw it running asks: the running marker must be gone.
        if pause::is_paused(&amqp, queue, false)
            .await
            .map_err(broker)?
        {
            return Ok(());
        }
        ctx.metrics.js("queue.pause");
        pause::pause(&amqp, queue, &t.owner).await.map_err(broker)?;
        note_marked(false);
        let note = format!(
            "paused queue {queue} {}: made the marker exchange {} (and removed {}), every application stops consuming within its pause poll interval",
            t.pause.until_text(),
            pause::paused_marker(queue),
            pause::running_marker(queue)
        );
        tracing::info!(subscription = %t.owner, %queue, op = ChangeKind::Paused.op(), "{note}");
        changes.push(ChangeKind::Paused, note);
    } else if shown_paused {
        ctx.metrics.js("queue.resume");
        pause::resume(&amqp, queue, &t.owner)
            .await
            .map_err(broker)?;
        note_marked(true);
        let note = format!(
            "resumed queue {queue}: removed the marker exchange {}",
            pause::paused_marker(queue)
        );
        tracing::info!(subscription = %t.owner, %queue, op = ChangeKind::Resumed.op(), "{note}");
        changes.push(ChangeKind::Resumed, note);
    } else {
        ctx.metrics.js("queue.running_marker");
        pause::mark_running(&amqp, queue, &t.owner)
            .await
            .map_err(broker)?;
        note_marked(true);
    }
    Ok(())
}
