//! The account's report source deleted on the broker behind everyone's back (the campaign's
//! `ReportsDeleted` fault): on NATS the report bucket `settle-stats` (every instance's latest
//! report, of every Subscription on the server); on RabbitMQ every report queue of the
//! Subscription's instances (each its newest report); on SQS the Subscription's report queue
//! (the reports the account has not counted yet). Reports are cumulative, so a running
//! instance's next one carries all it counted; a SIGKILLed instance's last ones, not yet read,
//! are gone for good.
//!
//! It must not judge what the loss costs: the checker does (semantics C17, Q8).

use std::time::{Duration, Instant};

use settle::bus::report::REPORT_BUCKET;

use super::broker::{Target, queue_names};
use crate::account::report_keys;
use crate::rabbitmq::management_at;

/// How long reports may take to reach the broker again after the deletion.
const BACK_WITHIN: Duration = Duration::from_secs(60);

impl Target {
    /// Deletes the report source of Subscription `orders` in `ns`, and waits until a report
    /// of it is on the broker again; says what was deleted.
    pub(super) async fn delete_reports(&self, ns: &str) -> String {
        let what = self.delete_reports_once(ns).await;
        let deadline = Instant::now() + BACK_WITHIN;
        while !self.reports_there(ns).await {
            assert!(
                Instant::now() < deadline,
                "no report on the broker within {} s after {what} was deleted",
                BACK_WITHIN.as_secs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        what
    }

    async fn delete_reports_once(&self, ns: &str) -> String {
        match self {
            Target::Nats(s, _) | Target::NatsCluster(s, _) => {
                s.js.delete_key_value(REPORT_BUCKET)
                    .await
                    .expect("the report bucket deleted");
                format!("the report bucket {REPORT_BUCKET}")
            }
            Target::Rabbitmq { server, .. } => {
                let names = rabbitmq_report_queues(&server.management_url(), ns);
                for name in &names {
                    let (status, body) = management_at(
                        &server.management_url(),
                        "DELETE",
                        &format!("/api/queues/%2f/{}", encoded(name)),
                        "",
                    );
                    // One an instance's fold removed meanwhile is gone already.
                    assert!(
                        matches!(status, 200 | 204 | 404),
                        "report queue {name} deleted: {status} {body}"
                    );
                }
                format!("{} report queue(s) {}", names.len(), names.join(", "))
            }
            Target::Sqs { client, prefix, .. } => {
                let name = settle::backend::sqs::report::report_queue(&format!("{prefix}orders"));
                let url = crate::sqs::url(client, &name)
                    .await
                    .expect("the report queue");
                client
                    .delete_queue()
                    .queue_url(&url)
                    .send()
                    .await
                    .expect("the report queue deleted");
                format!("the report queue {name}")
            }
        }
    }

    /// Whether a report of Subscription `orders` in `ns` is on the broker (NATS, RabbitMQ:
    /// a running instance wrote one again) or its report queue is there (SQS: the operator
    /// made it again; reports go to it from then on).
    async fn reports_there(&self, ns: &str) -> bool {
        match self {
            Target::Nats(s, _) | Target::NatsCluster(s, _) => {
                match s.js.get_key_value(REPORT_BUCKET).await {
                    Ok(kv) => report_keys(&kv, &format!("{ns}.orders."))
                        .await
                        .is_ok_and(|k| !k.is_empty()),
                    Err(_) => false,
                }
            }
            Target::Rabbitmq { server, .. } => {
                !rabbitmq_report_queues(&server.management_url(), ns).is_empty()
            }
            Target::Sqs { client, prefix, .. } => {
                let name = settle::backend::sqs::report::report_queue(&format!("{prefix}orders"));
                crate::sqs::url(client, &name).await.is_some()
            }
        }
    }
}

/// The report queues of Subscription `orders`' instances in `ns` on the node at `management`.
fn rabbitmq_report_queues(management: &str, ns: &str) -> Vec<String> {
    let prefix = settle::backend::rabbitmq::report::instance_queue(ns, "orders", "");
    queue_names(management)
        .unwrap_or_default()
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

/// `name` as one segment of a management API path.
fn encoded(name: &str) -> String {
    name.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
