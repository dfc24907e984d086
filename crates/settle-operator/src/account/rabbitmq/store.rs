//! A RabbitMQ Subscription's account queues on the broker: declared and its snapshot read at
//! load (left in the ledger queue), a snapshot saved with a publisher confirm, and the leftover
//! account queues of Subscriptions deleted while no operator ran swept away.
//!
//! It must not count (that is the ledger) nor decide when to save (that is `settle`).

use std::collections::BTreeSet;

use kube::ResourceExt;
use lapin::options::{BasicGetOptions, BasicPublishOptions, BasicRejectOptions};
use lapin::types::ShortString;
use lapin::{Channel, Connection};
use serde::{Deserialize, Serialize};

use super::{Broken, RabbitKeeper, SubKey, broken};
use crate::account::ledger::Snapshot;
use crate::account::status::LossLog;
use settle::backend::rabbitmq::{admin, dead_letters, report};

/// What is kept in a Subscription's ledger queue.
#[derive(Default, Serialize, Deserialize)]
pub(super) struct Saved {
    pub(super) ledger: Snapshot,
    pub(super) loss: LossLog,
    /// The instances' report queues registered in the index.
    #[serde(default)]
    pub(super) instances: BTreeSet<String>,
}

impl RabbitKeeper {
    /// Deletes the account queues of this namespace's Subscriptions that no longer exist
    /// (deleted while no operator ran): reports, index, instances, ledger and object mark; and
    /// the dead-letter copy queues of Backends gone or without a dead-letter exchange. Needs
    /// the management API to list queues; without it they stay (bounded) until the
    /// Subscription's name is used again.
    pub(super) async fn sweep(&self, conn: &Connection) {
        let Some(reader) = (self.queues)(&self.backend.0, &self.backend.1) else {
            return;
        };
        let Ok(names) = reader.names().await else {
            return;
        };
        let ns = &self.backend.0;
        let alive: Vec<String> = self
            .subs
            .state()
            .iter()
            .filter(|s| s.namespace().as_deref() == Some(ns.as_str()))
            .map(|s| s.name_any())
            .collect();
        // Copy queues of dead letters: a Backend's while it has a dead-letter exchange.
        let copying: Vec<String> = self
            .backends
            .state()
            .iter()
            .filter(|b| {
                b.namespace().as_deref() == Some(ns.as_str())
                    && b.spec
                        .rabbitmq
                        .as_ref()
                        .is_some_and(|r| r.dead_letter_exchange.is_some())
            })
            .map(|b| dead_letters::copy_queue(ns, &b.name_any()))
            .collect();
        let copies = dead_letters::copy_queue(ns, "");
        for q in names
            .iter()
            .filter(|q| q.starts_with(&copies) && !copying.contains(*q))
        {
            match admin::delete(conn, q).await {
                Ok(()) => {
                    tracing::info!(queue = %q, "deleted the dead-letter copy queue of a Backend gone, or without a dead-letter exchange")
                }
                Err(e) => {
                    tracing::debug!(queue = %q, error = %e, "cannot delete a leftover copy queue")
                }
            }
        }
        for q in report::leftover_account_queues(&names, ns, &alive) {
            match admin::delete(conn, q).await {
                Ok(()) => {
                    tracing::info!(queue = %q, "deleted the account queue of a Subscription deleted while no operator ran");
                    (self.freed)(&self.backend.0, &self.backend.1);
                }
                Err(e) => {
                    tracing::debug!(queue = %q, error = %e, "cannot delete a leftover account queue")
                }
            }
        }
    }
}

/// Declares a Subscription's account queues (report, ledger, index: made with its queue by the
/// controller, declared again here for a queue made before that) and reads its snapshot, leaving
/// it in the queue (`basic.get`, then `basic.reject` with requeue). A channel of its own: a
/// refused declare closes it.
pub(super) async fn load(conn: &Connection, key: &SubKey) -> Result<Option<Saved>, Broken> {
    let ch = conn
        .create_channel()
        .await
        .map_err(|e| broken("opening a channel", e))?;
    report::declare_account(&ch, &key.0, &key.1)
        .await
        .map_err(|e| broken(&format!("declaring {:?}", e.queue), e.error))?;
    let ledger_q = report::ledger_queue(&key.0, &key.1);
    let ledger_q = ledger_q.as_str();
    let got = ch
        .basic_get(
            ShortString::from(ledger_q),
            BasicGetOptions { no_ack: false },
        )
        .await
        .map_err(|e| broken(&format!("reading {ledger_q:?}"), e))?;
    let saved = match got {
        None => None,
        Some(msg) => {
            let saved = match serde_json::from_slice::<Saved>(&msg.delivery.data) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(queue = %ledger_q, error = %e, "a saved ledger is unreadable: starting from what status shows");
                    None
                }
            };
            ch.basic_reject(
                msg.delivery.delivery_tag,
                BasicRejectOptions { requeue: true },
            )
            .await
            .map_err(|e| broken(&format!("putting back {ledger_q:?}"), e))?;
            saved
        }
    };
    let _ = ch.close(200, ShortString::from("loaded")).await;
    Ok(saved)
}

/// Publishes a snapshot to its ledger queue (persistent, through the default exchange) and
/// waits for the broker's confirm; the older snapshot is dropped by the queue's bound.
pub(super) async fn save(saver: &Channel, ledger_q: &str, body: &[u8]) -> Result<(), Broken> {
    let confirm = saver
        .basic_publish(
            ShortString::from(""),
            ShortString::from(ledger_q),
            BasicPublishOptions::default(),
            body,
            report::persistent_json(),
        )
        .await
        .map_err(|e| broken(&format!("saving a ledger to {ledger_q:?}"), e))?;
    let confirmation = tokio::time::timeout(report::CONFIRM_TIMEOUT, confirm)
        .await
        .map_err(|_| {
            Broken(format!(
                "no confirm for the ledger to {ledger_q:?} within {:?}",
                report::CONFIRM_TIMEOUT
            ))
        })?
        .map_err(|e| broken(&format!("saving a ledger to {ledger_q:?}"), e))?;
    if confirmation.is_nack() {
        return Err(Broken(format!(
            "the broker refused a ledger to {ledger_q:?} (basic.nack)"
        )));
    }
    Ok(())
}
