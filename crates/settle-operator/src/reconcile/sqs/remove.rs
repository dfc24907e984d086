//! Deleting a Subscription's SQS queue (and the dead-letter queue Settle made for it) when the
//! Subscription goes, only when this object's tags are on it.

use super::*;

pub(super) fn waiting(e: AdminError) -> Removal {
    if e.is_unreachable() {
        Removal::Wait(e.to_string())
    } else {
        Removal::Failed(e.to_string())
    }
}

/// The cleanup's broker call on SQS: deletes this Subscription's queue if it is its own, and its
/// dead-letter queue if Settle made it and it is empty.
pub async fn remove(t: &Target<'_>, ctx: &Ctx, conn: &SqsConn) -> Removal {
    let owner = &t.owner;
    let client = conn.broker.client();
    let queue_name = match &t.known {
        Some(c) if c.stream == SQS_STREAM => c.name.clone(),
        _ => match mapping::desired(conn.broker.queue_prefix(), &t.policy) {
            Ok(w) => w.name,
            // No valid queue name: Settle never made one.
            Err(_) => return Removal::Nothing,
        },
    };
    let mut notes = Vec::new();
    ctx.metrics.js("sqs.url");
    match admin::queue_url(client, &queue_name).await {
        Err(e) => return waiting(e),
        Ok(None) => {}
        Ok(Some(url)) => {
            let owns = match judged(client, ctx, t, &url).await {
                Ok((t, _)) => t.is_ok(),
                Err(e) => return waiting(e),
            };
            if owns {
                ctx.metrics.js("sqs.delete");
                if let Err(e) = admin::delete(client, &url).await {
                    return waiting(e);
                }
                notes.push(format!("deleted SQS queue {queue_name}"));
            } else {
                tracing::info!(subscription = %owner, queue = %queue_name, "the queue is not this Subscription object's: left alone");
                return Removal::Nothing;
            }
        }
    }
    if let Err(wait) = remove_account_queues(t, ctx, client, &queue_name, &mut notes).await {
        return wait;
    }
    if let Err(wait) = remove_dead_letters(t, ctx, client, &queue_name, &mut notes).await {
        return wait;
    }
    tracing::info!(subscription = %owner, queue = %queue_name, "cleanup: {}", notes.join("; "));
    if notes.is_empty() {
        Removal::Nothing
    } else {
        Removal::Deleted(notes.join("; "))
    }
}

/// The account's queues beside the queue, deleted when they carry this object's tags.
async fn remove_account_queues(
    t: &Target<'_>,
    ctx: &Ctx,
    client: &Client,
    queue_name: &str,
    notes: &mut Vec<String>,
) -> Result<(), Removal> {
    for account_queue in [
        report::report_queue(queue_name),
        report::ledger_queue(queue_name),
    ] {
        ctx.metrics.js("sqs.url");
        match admin::queue_url(client, &account_queue).await {
            Err(e) => return Err(waiting(e)),
            Ok(None) => {}
            Ok(Some(url)) => match judged(client, ctx, t, &url).await {
                Err(e) => return Err(waiting(e)),
                Ok((Ok(_), _)) => {
                    ctx.metrics.js("sqs.delete");
                    if let Err(e) = admin::delete(client, &url).await {
                        return Err(waiting(e));
                    }
                    notes.push(format!("deleted its account queue {account_queue}"));
                }
                Ok((Err(_), _)) => {
                    tracing::info!(subscription = %t.owner, queue = %account_queue, "the account queue is not this Subscription object's: left alone");
                }
            },
        }
    }
    Ok(())
}

/// The dead-letter queue Settle made for the queue: deleted when empty, else kept and said.
async fn remove_dead_letters(
    t: &Target<'_>,
    ctx: &Ctx,
    client: &Client,
    queue_name: &str,
    notes: &mut Vec<String>,
) -> Result<(), Removal> {
    let dlq = format!("{queue_name}{DLQ_SUFFIX}");
    ctx.metrics.js("sqs.url");
    match admin::queue_url(client, &dlq).await {
        Err(e) => return Err(waiting(e)),
        Ok(None) => {}
        Ok(Some(url)) => {
            let owns = match judged(client, ctx, t, &url).await {
                Ok((t, _)) => t.is_ok(),
                Err(e) => return Err(waiting(e)),
            };
            let attributes = match admin::attributes(client, &url).await {
                Ok(a) => a.unwrap_or_default(),
                Err(e) => return Err(waiting(e)),
            };
            if dead_letter_deletable(owns, &attributes) {
                ctx.metrics.js("sqs.delete");
                if let Err(e) = admin::delete(client, &url).await {
                    return Err(waiting(e));
                }
                notes.push(format!("deleted its empty dead-letter queue {dlq}"));
            } else if owns {
                let (visible, in_flight) = admin::gauges_of(&attributes);
                notes.push(format!(
                    "kept its dead-letter queue {dlq}: it holds about {} exhausted messages (delete it when done with them)",
                    visible + in_flight
                ));
            }
        }
    }
    Ok(())
}
