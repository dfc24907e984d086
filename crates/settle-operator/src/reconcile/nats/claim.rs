//! Taking over a JetStream consumer Settle did not make, or an earlier object's (J8, J9): one
//! update writes this object's marks and brings the editable fields to the spec, on the same
//! consumer. It must not create or delete a consumer (`create`, `remove`).

use super::*;

/// Takes over a consumer Settle did not make that equals `want` where JetStream cannot change
/// it in place (J9): one update writes this object's marks and brings the editable fields
/// (`d.editable`) to the spec, on the same consumer, so its position (what it delivered, its
/// acknowledgement floor, what waits for an ack) stays as it was. Two Subscriptions that take
/// the same consumer at once (namespaces sharing a broker, both allowed): the later update's
/// marks hold, and the other's next check finds it another's.
#[allow(clippy::too_many_arguments)]
pub(super) async fn adopt(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &NatsConn,
    want: &mapping::ConsumerConfig,
    d: &mapping::Diff,
    before: &async_nats::jetstream::consumer::Info,
    here: ConsumerRef,
    changes: &mut Changes,
) -> SubOutcome {
    ctx.metrics.js("update");
    let after = match admin::update_consumer(&conn.js, want).await {
        Ok(info) => info,
        Err(error) => return broker_failure(error, t.known.clone()),
    };
    let edits = d
        .editable
        .iter()
        // The marks are the takeover itself, said once.
        .filter(|f| f.field != "metadata" && f.field != "description")
        .map(ToString::to_string)
        .collect::<Vec<_>>();
    let note = format!(
        "took over consumer {} on stream {}, which Settle did not make, as spec.adopt IfCompatible asked: \
         the same consumer (created {}), with its position (delivered up to stream sequence {}, {} delivered \
         and not yet acknowledged, {} pending){}",
        want.name,
        want.stream,
        before.created,
        after.delivered.stream_sequence,
        after.num_ack_pending,
        after.num_pending,
        if edits.is_empty() {
            String::new()
        } else {
            format!("; brought to the spec in place: {}", edits.join("; "))
        }
    );
    tracing::info!(subscription = %t.owner, stream = %want.stream, consumer = %want.name, op = ChangeKind::Adopted.op(), "{note}");
    changes.push(ChangeKind::Adopted, note);
    ready(here)
}
