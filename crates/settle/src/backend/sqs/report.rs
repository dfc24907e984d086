//! Stats reports on SQS (docs/stats-report.md, "On SQS"). Each Subscription has two queues of
//! the account beside its queue and dead-letter queue, both made, tagged and deleted by the
//! operator:
//!
//! - the report queue `<queue>-settle-stats.fifo`, where every instance of the Subscription's
//!   runtime sends its cumulative report (message group: the instance, so one instance's reports
//!   stay in order and never hold up another's; content-based deduplication);
//! - the ledger queue `<queue>-settle-ledger.fifo`, where the operator keeps the newest snapshot
//!   of the Subscription's account (one message group: the oldest snapshot comes first).
//!
//! Both are FIFO queues, whose names must end in `.fifo`: a name admission can never give a
//! Subscription's own queue (a pattern or durableName has no `.`), so they cannot clash with a
//! user's queue. A name past SQS's 80 characters keeps the queue name's start and a hash of the
//! whole.
//!
//! The runtime learns the Subscription object (UID) its counts belong to from the `settle-object`
//! tag of the operator's queue when it binds, and sends to a report queue only the operator made:
//! a missing one is an error the bus logs and retries at the next interval (reports are
//! cumulative, so nothing is lost meanwhile).
//!
//! It must not interpret a report (the operator's ledger does) nor make a queue.

use std::collections::BTreeMap;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use serde::Deserialize;

use super::mapping::{MESSAGE_RETENTION_PERIOD, NAME_MAX};
use super::{SqsBroker, SqsError, api, lock, queue_missing};
use crate::bus::{BusError, StatsSink};

/// The end of a Subscription's report queue's name.
pub const REPORTS_SUFFIX: &str = "-settle-stats.fifo";
/// The end of a Subscription's ledger queue's name.
pub const LEDGER_SUFFIX: &str = "-settle-ledger.fifo";
/// The largest report the report queue takes (`MaximumMessageSize`; a real report is under
/// 1 KiB): SQS refuses a larger one before any reader holds it.
pub const REPORT_MAX_BYTES: u32 = 65_536;
/// The largest snapshot the ledger queue takes: SQS's largest message, 256 KiB.
pub const LEDGER_MAX_BYTES: u32 = 262_144;
/// How long a report or snapshot is kept unread: SQS's longest, 14 days (an operator down
/// longer loses the final reports of instances that ended meanwhile).
pub const RETENTION_SECS: u32 = 14 * 24 * 3600;
/// The message group of every snapshot in a ledger queue.
pub const LEDGER_GROUP: &str = "ledger";

/// The name of the account queue of kind `suffix` beside queue `queue` (the Subscription's
/// queue's full name, prefix included): `<queue><suffix>`, or, past SQS's 80 characters, the
/// queue name's start, `-`, 8 hex digits of a hash of the whole, and the suffix.
fn beside(queue: &str, suffix: &str) -> String {
    let full = format!("{queue}{suffix}");
    if full.len() <= NAME_MAX {
        return full;
    }
    let hash = fnv(queue.as_bytes());
    let keep = NAME_MAX - suffix.len() - 9;
    // Queue names are ASCII (letters, digits, '-', '_'): any cut is on a character boundary.
    let start: String = queue.chars().take(keep).collect();
    format!("{start}-{:08x}{suffix}", hash as u32)
}

/// The report queue of the Subscription whose queue is `queue`.
pub fn report_queue(queue: &str) -> String {
    beside(queue, REPORTS_SUFFIX)
}

/// The ledger queue of the Subscription whose queue is `queue`.
pub fn ledger_queue(queue: &str) -> String {
    beside(queue, LEDGER_SUFFIX)
}

/// Whether `name` is an account queue's name (report or ledger).
pub fn is_account_queue(name: &str) -> bool {
    name.ends_with(REPORTS_SUFFIX) || name.ends_with(LEDGER_SUFFIX)
}

/// The attributes of a report queue (FIFO, content-based deduplication, bounded messages).
pub fn report_attributes() -> BTreeMap<String, String> {
    fifo_attributes(REPORT_MAX_BYTES)
}

/// The attributes of a ledger queue.
pub fn ledger_attributes() -> BTreeMap<String, String> {
    fifo_attributes(LEDGER_MAX_BYTES)
}

fn fifo_attributes(max_bytes: u32) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("FifoQueue".to_string(), "true".to_string()),
        ("ContentBasedDeduplication".to_string(), "true".to_string()),
        ("MaximumMessageSize".to_string(), max_bytes.to_string()),
        (
            MESSAGE_RETENTION_PERIOD.to_string(),
            RETENTION_SECS.to_string(),
        ),
    ])
}

/// The message group of one instance's reports: its name where SQS takes it (at most 128
/// characters of letters, digits and punctuation), else a hash of it.
pub fn group_of(instance: &str) -> String {
    let fits = !instance.is_empty()
        && instance.len() <= 128
        && instance.chars().all(|c| c.is_ascii_graphic());
    if fits {
        instance.to_string()
    } else {
        format!("instance-{:016x}", fnv(instance.as_bytes()))
    }
}

/// FNV-1a: stable across versions and processes.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Where a bound subscription's reports go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum ReportsTo {
    /// The operator's report queue of this name.
    Queue(String),
    /// Nowhere: a code-defined subscription, which no Subscription resource accounts for.
    Nowhere,
}

/// The part of a report that says where it goes.
#[derive(Deserialize)]
struct Owner {
    subscription: String,
    instance: String,
}

impl SqsBroker {
    /// Sends one report to its Subscription's report queue.
    async fn send_report(&self, value: Bytes) -> Result<(), SqsError> {
        let owner: Owner = serde_json::from_slice(&value).map_err(|e| SqsError::Api {
            operation: "SendMessage",
            message: format!("a stats report without its Subscription: {e}"),
        })?;
        let to = lock(&self.reports).get(&owner.subscription).cloned();
        let queue = match to {
            Some(ReportsTo::Queue(q)) => q,
            Some(ReportsTo::Nowhere) => return Ok(()),
            None => {
                return Err(SqsError::Api {
                    operation: "SendMessage",
                    message: format!(
                        "subscription {:?} is not bound to the operator's queue yet: its report waits",
                        owner.subscription
                    ),
                });
            }
        };
        let Some(url) = self.queue_url(&queue).await? else {
            return Err(SqsError::QueueMissing {
                name: queue,
                hint: " (the report queue: the operator makes it beside the Subscription's queue; the report is sent again at the next interval)".into(),
            });
        };
        let body = String::from_utf8_lossy(&value).into_owned();
        let sent = self
            .client
            .send_message()
            .queue_url(&url)
            .message_body(body)
            .message_group_id(group_of(&owner.instance))
            .send()
            .await;
        match sent {
            Ok(_) => Ok(()),
            Err(e) => {
                if queue_missing(&e) {
                    self.forget_url(&queue);
                }
                Err(api("SendMessage", e))
            }
        }
    }
}

impl StatsSink for SqsBroker {
    /// Sends one report to the report queue of the Subscription it names (the one this broker
    /// bound it to); `key` is not used. A report queue that does not exist (yet, or any more) is
    /// an error: the bus sends the report again at the next interval.
    fn put(&self, _key: String, value: Bytes) -> BoxFuture<'_, Result<(), BusError>> {
        async move { self.send_report(value).await.map_err(BusError::from) }.boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn account_queues_sit_beside_the_queue_and_never_pass_80_characters() {
        assert_eq!(report_queue("orders"), "orders-settle-stats.fifo");
        assert_eq!(ledger_queue("t1-orders"), "t1-orders-settle-ledger.fifo");
        let long = "q".repeat(80);
        let other = format!("{}x", "q".repeat(79));
        for q in [&long, &other] {
            for name in [report_queue(q), ledger_queue(q)] {
                assert_eq!(name.len(), NAME_MAX, "{name}");
                assert!(name.starts_with("qqqq"), "{name}");
                assert!(is_account_queue(&name), "{name}");
            }
        }
        assert_ne!(report_queue(&long), report_queue(&other));
        // The Go runtime (clients/go/sqs, TestTheReportQueueIsTheOperators) holds this value.
        assert_eq!(
            report_queue(&long),
            "qqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqq-04945995-settle-stats.fifo"
        );
        assert!(!is_account_queue("orders-dlq"));
    }

    #[test]
    fn an_instance_is_its_own_message_group() {
        assert_eq!(
            group_of("orders-7f9c-1796011200000"),
            "orders-7f9c-1796011200000"
        );
        assert!(group_of(&"x".repeat(300)).starts_with("instance-"));
        assert!(group_of("a b").starts_with("instance-"));
        assert_eq!(group_of(&"x".repeat(300)), group_of(&"x".repeat(300)));
    }
}
