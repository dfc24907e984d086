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

/// The cleanup's broker call on SQS: deletes this Subscription's queue if it is its own
/// (`remove_queue`), its account queues (`remove_account_queues`), and its dead-letter queue if
/// Settle made it and it is empty (`remove_dead_letter_queue`).
pub async fn remove(t: &Target<'_>, ctx: &Ctx, conn: &SqsConn) -> Removal {
    let owner = &t.owner;
    let client = conn.broker.client();
    let Some(queue_name) = queue_name(t, conn) else {
        // No valid queue name: Settle never made one.
        return Removal::Nothing;
    };
    let mut notes = Vec::new();
    if let Err(r) = remove_queue(client, ctx, t, &queue_name, &mut notes).await {
        return r;
    }
    if let Err(r) = remove_account_queues(client, ctx, t, &queue_name, &mut notes).await {
        return r;
    }
    if let Err(r) = remove_dead_letter_queue(client, ctx, t, &queue_name, &mut notes).await {
        return r;
    }
    tracing::info!(subscription = %owner, queue = %queue_name, "cleanup: {}", notes.join("; "));
    if notes.is_empty() {
        Removal::Nothing
    } else {
        Removal::Deleted(notes.join("; "))
    }
}

/// The queue's name: as status shows it, else as the mapping makes it (`None`: no valid name).
fn queue_name(t: &Target<'_>, conn: &SqsConn) -> Option<String> {
    match &t.known {
        Some(c) if c.stream == SQS_STREAM => Some(c.name.clone()),
        _ => mapping::desired(conn.broker.queue_prefix(), &t.policy)
            .ok()
            .map(|w| w.name),
    }
}

/// The queue deleted when it is this object's; one that is not ends the cleanup
/// (`Err(Removal::Nothing)`): nothing beside it is touched.
async fn remove_queue(
    client: &Client,
    ctx: &Ctx,
    t: &Target<'_>,
    queue_name: &str,
    notes: &mut Vec<String>,
) -> Result<(), Removal> {
    ctx.metrics.js("sqs.url");
    let Some(url) = admin::queue_url(client, queue_name)
        .await
        .map_err(waiting)?
    else {
        return Ok(());
    };
    let owns = match judged(client, ctx, t, &url).await {
        Ok((t, _)) => t.is_ok(),
        Err(e) => return Err(waiting(e)),
    };
    if !owns {
        tracing::info!(subscription = %t.owner, queue = %queue_name, "the queue is not this Subscription object's: left alone");
        return Err(Removal::Nothing);
    }
    ctx.metrics.js("sqs.delete");
    admin::delete(client, &url).await.map_err(waiting)?;
    notes.push(format!("deleted SQS queue {queue_name}"));
    Ok(())
}

/// The account's report and ledger queues, each deleted when it is this object's.
async fn remove_account_queues(
    client: &Client,
    ctx: &Ctx,
    t: &Target<'_>,
    queue_name: &str,
    notes: &mut Vec<String>,
) -> Result<(), Removal> {
    for account_queue in [
        report::report_queue(queue_name),
        report::ledger_queue(queue_name),
    ] {
        ctx.metrics.js("sqs.url");
        let Some(url) = admin::queue_url(client, &account_queue)
            .await
            .map_err(waiting)?
        else {
            continue;
        };
        match judged(client, ctx, t, &url).await {
            Err(e) => return Err(waiting(e)),
            Ok((Ok(_), _)) => {
                ctx.metrics.js("sqs.delete");
                admin::delete(client, &url).await.map_err(waiting)?;
                notes.push(format!("deleted its account queue {account_queue}"));
            }
            Ok((Err(_), _)) => {
                tracing::info!(subscription = %t.owner, queue = %account_queue, "the account queue is not this Subscription object's: left alone");
            }
        }
    }
    Ok(())
}

/// The dead-letter queue deleted when it is this object's and empty; kept, and said, when it
/// holds exhausted messages.
async fn remove_dead_letter_queue(
    client: &Client,
    ctx: &Ctx,
    t: &Target<'_>,
    queue_name: &str,
    notes: &mut Vec<String>,
) -> Result<(), Removal> {
    let dlq = format!("{queue_name}{DLQ_SUFFIX}");
    ctx.metrics.js("sqs.url");
    let Some(url) = admin::queue_url(client, &dlq).await.map_err(waiting)? else {
        return Ok(());
    };
    let owns = match judged(client, ctx, t, &url).await {
        Ok((t, _)) => t.is_ok(),
        Err(e) => return Err(waiting(e)),
    };
    let attributes = admin::attributes(client, &url)
        .await
        .map_err(waiting)?
        .unwrap_or_default();
    if dead_letter_deletable(owns, &attributes) {
        ctx.metrics.js("sqs.delete");
        admin::delete(client, &url).await.map_err(waiting)?;
        notes.push(format!("deleted its empty dead-letter queue {dlq}"));
    } else if owns {
        let (visible, in_flight) = admin::gauges_of(&attributes);
        notes.push(format!(
            "kept its dead-letter queue {dlq}: it holds about {} exhausted messages (delete it when done with them)",
            visible + in_flight
        ));
    }
    Ok(())
}
