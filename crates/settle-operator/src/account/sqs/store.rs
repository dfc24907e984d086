//! An SQS Subscription's ledger queue: the snapshots of its account, newest by generation,
//! read at load (older ones deleted, the newest left there), sent on each save and pruned after
//! it; and the batch delete the keeper acknowledges reports with.
//!
//! It must not count (that is the ledger) nor decide when to save (that is the keeper).

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{DeleteMessageBatchRequestEntry, QueueAttributeName};
use serde::{Deserialize, Serialize};
use std::time::Duration;

use super::BATCH;
use crate::account::ledger::Snapshot;
use crate::account::status::LossLog;
use settle::backend::sqs::report;

/// How long a snapshot read (at load, or to delete older ones) stays hidden at most.
const LEDGER_HIDE_SECS: i32 = 5;

/// What is kept in a Subscription's ledger queue.
#[derive(Default, Serialize, Deserialize)]
pub(super) struct Saved {
    /// Each save's number, one more than the last: the highest is the newest.
    pub(super) generation: u64,
    pub(super) ledger: Snapshot,
    pub(super) loss: LossLog,
}

pub(super) fn secs(d: Duration) -> i32 {
    i32::try_from(d.as_secs()).unwrap_or(i32::MAX)
}

/// What a ledger queue held.
pub(super) enum Loaded {
    /// The newest snapshot (none: never saved, or lost).
    Saved(Option<Box<Saved>>),
    /// A snapshot is in flight (another reader holds it for a few seconds): read again later,
    /// as a receive now could miss it.
    Busy,
}

/// Reads the newest snapshot of a ledger queue, deleting older ones, and leaves the newest
/// there (visible again at once). The queue is FIFO with one message group, oldest first.
pub(super) async fn load(client: &Client, url: &str) -> Result<Loaded, String> {
    let attrs = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .map_err(|e| format!("GetQueueAttributes: {}", e.into_service_error()))?;
    let in_flight = attrs
        .attributes
        .as_ref()
        .and_then(|a| a.get(&QueueAttributeName::ApproximateNumberOfMessagesNotVisible))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    if in_flight > 0 {
        return Ok(Loaded::Busy);
    }
    let mut best: Option<(Saved, String)> = None;
    // Bounded: each round deletes all but one of up to ten.
    for _ in 0..100 {
        let got = client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(BATCH)
            .visibility_timeout(LEDGER_HIDE_SECS)
            .wait_time_seconds(0)
            .send()
            .await
            .map_err(|e| format!("ReceiveMessage: {}", e.into_service_error()))?;
        let messages = got.messages.unwrap_or_default();
        let full = messages.len() >= usize::try_from(BATCH).unwrap_or(10);
        let mut older = Vec::new();
        for m in messages {
            let Some(receipt) = m.receipt_handle else {
                continue;
            };
            match serde_json::from_str::<Saved>(m.body.as_deref().unwrap_or_default()) {
                Ok(s)
                    if best
                        .as_ref()
                        .is_none_or(|(b, _)| s.generation >= b.generation) =>
                {
                    if let Some((_, r)) = best.replace((s, receipt.clone()))
                        && r != receipt
                    {
                        older.push(r);
                    }
                }
                Ok(_) => older.push(receipt),
                Err(e) => {
                    tracing::warn!(error = %e, "an unreadable snapshot in a ledger queue: skipped and deleted");
                    older.push(receipt);
                }
            }
        }
        delete_all(client, url, &older).await?;
        if let Some((_, receipt)) = &best {
            let _ = client
                .change_message_visibility()
                .queue_url(url)
                .receipt_handle(receipt)
                .visibility_timeout(0)
                .send()
                .await;
        }
        if !full {
            break;
        }
    }
    Ok(Loaded::Saved(best.map(|(s, _)| Box::new(s))))
}

/// Sends a snapshot to its ledger queue.
pub(super) async fn store(client: &Client, url: &str, saved: &Saved) -> Result<(), String> {
    let body = serde_json::to_string(saved).map_err(|e| format!("encoding a ledger: {e}"))?;
    if body.len() > report::LEDGER_MAX_BYTES as usize {
        return Err(format!(
            "the snapshot is {} bytes, past SQS's largest message ({} bytes): fewer live instances (--max-instances-per-subscription, --fold-after) keep it smaller",
            body.len(),
            report::LEDGER_MAX_BYTES
        ));
    }
    client
        .send_message()
        .queue_url(url)
        .message_body(body)
        .message_group_id(report::LEDGER_GROUP)
        .send()
        .await
        .map_err(|e| {
            format!(
                "SendMessage to the ledger queue: {}",
                e.into_service_error()
            )
        })?;
    Ok(())
}

/// Deletes the snapshots older than `generation` from a ledger queue (the oldest come first);
/// the newest is made visible again at once.
pub(super) async fn prune(client: &Client, url: &str, generation: u64) -> Result<(), String> {
    let got = client
        .receive_message()
        .queue_url(url)
        .max_number_of_messages(BATCH)
        .visibility_timeout(LEDGER_HIDE_SECS)
        .wait_time_seconds(0)
        .send()
        .await
        .map_err(|e| format!("ReceiveMessage: {}", e.into_service_error()))?;
    let mut older = Vec::new();
    for m in got.messages.unwrap_or_default() {
        let Some(receipt) = m.receipt_handle else {
            continue;
        };
        let g = serde_json::from_str::<Saved>(m.body.as_deref().unwrap_or_default())
            .map_or(0, |s| s.generation);
        if g < generation {
            older.push(receipt);
        } else {
            let _ = client
                .change_message_visibility()
                .queue_url(url)
                .receipt_handle(&receipt)
                .visibility_timeout(0)
                .send()
                .await;
        }
    }
    delete_all(client, url, &older).await
}

/// Deletes the messages of these receipts, ten at a time.
pub(super) async fn delete_all(
    client: &Client,
    url: &str,
    receipts: &[String],
) -> Result<(), String> {
    for chunk in receipts.chunks(10) {
        let entries: Vec<DeleteMessageBatchRequestEntry> = chunk
            .iter()
            .enumerate()
            .filter_map(|(i, r)| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(r)
                    .build()
                    .ok()
            })
            .collect();
        client
            .delete_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| format!("DeleteMessageBatch: {}", e.into_service_error()))?;
    }
    Ok(())
}
