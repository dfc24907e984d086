//! The matrix on SQS (ElasticMQ): each Subscription its own queue, made with the attributes the
//! runtime's mapping gives it and filled with `n_each` messages before each round. Bare: the
//! aws-sdk-sqs loop the runtime itself runs, without the runtime: a ReceiveMessage for as many
//! messages as there are free slots (at most 10), asking for the attributes the runtime asks for,
//! a DeleteMessage per message, up to maxInFlight under way. Settle: `SqsBroker` on the same
//! client.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_sqs::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_sqs::error::BoxError;
use aws_sdk_sqs::types::{
    MessageSystemAttributeName, QueueAttributeName, SendMessageBatchRequestEntry,
};
use futures::StreamExt;
use settle::backend::sqs::{SqsBroker, SqsCredentials, SqsSettings, mapping};
use settle::policy::ResolvedPolicy;
use tokio::sync::Semaphore;

use super::{Cell, Harness, Side, Stopwatch, Taken, policy, settle_round};

pub struct Sqs {
    client: Client,
    requests: Requests,
    /// Requests each side sent while its clock ran, since the cell was prepared.
    sent: [BTreeMap<String, u64>; 2],
}

/// Counts the requests a client sends, by operation (the JSON protocol's `X-Amz-Target`,
/// `AmazonSQS.ReceiveMessage`), so the matrix can say what each side asked of the broker.
#[derive(Clone, Debug, Default)]
struct Requests(Arc<Mutex<BTreeMap<String, u64>>>);

impl Requests {
    fn snapshot(&self) -> BTreeMap<String, u64> {
        self.0.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

impl Intercept for Requests {
    fn name(&self) -> &'static str {
        "matrix-requests"
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let op = context
            .request()
            .headers()
            .get("x-amz-target")
            .map_or("?", |t| t.trim_start_matches("AmazonSQS."));
        if let Ok(mut m) = self.0.lock() {
            *m.entry(op.to_string()).or_default() += 1;
        }
        Ok(())
    }
}

fn settings(endpoint: &str) -> SqsSettings {
    SqsSettings {
        region: Some("elasticmq".into()),
        endpoint: Some(endpoint.to_string()),
        credentials: SqsCredentials::Static {
            access_key_id: "test".into(),
            secret_access_key: "test".into(),
        },
        queue_prefix: String::new(),
    }
}

impl Sqs {
    pub async fn connect(endpoint: &str) -> Sqs {
        let broker = SqsBroker::connect(settings(endpoint))
            .await
            .unwrap_or_else(|e| panic!("connect to ElasticMQ at {endpoint}: {e}"));
        let requests = Requests::default();
        let client = Client::from_conf(
            broker
                .client()
                .config()
                .to_builder()
                .interceptor(requests.clone())
                .build(),
        );
        Sqs {
            client,
            requests,
            sent: Default::default(),
        }
    }

    fn queues(cell: &Cell, side: Side) -> Vec<String> {
        (0..cell.subs).map(|i| cell.name(side, i)).collect()
    }

    async fn url(&self, name: &str) -> String {
        self.client
            .get_queue_url()
            .queue_name(name)
            .send()
            .await
            .expect("GetQueueUrl")
            .queue_url
            .unwrap_or_default()
    }

    /// Sends `n` messages to the queue at `url`, in batches under SQS's 256 KiB, 16 at once.
    async fn fill(&self, cell: &Cell, url: &str, n: u64) {
        let per = (200usize << 10).div_euclid(cell.payload).clamp(1, 10) as u64;
        let body = String::from_utf8(cell.body().to_vec()).expect("ascii");
        let batches = (0..n).step_by(per as usize).map(|first| {
            let entries: Vec<_> = (first..(first + per).min(n))
                .map(|i| {
                    SendMessageBatchRequestEntry::builder()
                        .id(format!("m{i}"))
                        .message_body(body.clone())
                        .build()
                        .expect("entry")
                })
                .collect();
            let (client, url) = (self.client.clone(), url.to_string());
            async move {
                let out = client
                    .send_message_batch()
                    .queue_url(url)
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .expect("SendMessageBatch");
                assert!(out.failed.is_empty(), "some sends failed: {:?}", out.failed);
            }
        });
        futures::stream::iter(batches)
            .buffer_unordered(16)
            .collect::<Vec<()>>()
            .await;
    }
}

impl Harness for Sqs {
    fn pid_file(&self) -> &'static str {
        "elasticmq.pid"
    }

    fn broker(&self) -> &'static str {
        "SQS (ElasticMQ)"
    }

    fn bare(&self) -> &'static str {
        "bare aws-sdk-sqs receive/delete loops"
    }

    fn warm_up(&self, cell: &Cell) -> u64 {
        if cell.in_flight == 1 { 200 } else { 1_000 }
    }

    fn max_each(&self, cell: &Cell) -> u64 {
        // At most 32 MiB in the queues of one round: ElasticMQ runs with a 512 MiB heap, and
        // 128 MiB of 64 KiB messages ran it out of heap (it stops on that).
        (32u64 << 20) / cell.payload as u64 / cell.subs as u64
    }

    async fn prepare(&mut self, cell: &Cell, _n_each: u64) {
        self.sent = Default::default();
        for side in [Side::Bare, Side::Settle] {
            for q in Self::queues(cell, side) {
                let want = mapping::desired("", &ResolvedPolicy::resolve(&policy(&q, &q, cell)))
                    .expect("queue spec");
                self.client
                    .create_queue()
                    .queue_name(&want.name)
                    .set_attributes(Some(
                        mapping::attributes(&want, None)
                            .into_iter()
                            .map(|(k, v)| (QueueAttributeName::from(k.as_str()), v))
                            .collect(),
                    ))
                    .send()
                    .await
                    .expect("CreateQueue");
            }
        }
    }

    async fn round(&mut self, cell: &Cell, side: Side, _round: usize, n_each: u64) -> Taken {
        let queues = Self::queues(cell, side);
        let mut urls = Vec::new();
        for q in &queues {
            let url = self.url(q).await;
            self.fill(cell, &url, n_each).await;
            urls.push(url);
        }
        let before = self.requests.snapshot();
        let taken = match side {
            Side::Bare => {
                let clock = Stopwatch::start();
                let tasks: Vec<_> = urls
                    .into_iter()
                    .map(|url| {
                        let (client, cell) = (self.client.clone(), *cell);
                        tokio::spawn(async move { bare(client, url, &cell, n_each).await })
                    })
                    .collect();
                for t in tasks {
                    t.await.expect("bare consumer");
                }
                clock.stop()
            }
            Side::Settle => {
                // The bare side's client, warm: neither side opens connections on its clock
                // (a fresh client per round measured the same, 0.93 against 0.94).
                let broker = SqsBroker::from_client(self.client.clone(), "")
                    .with_long_poll(Duration::from_secs(1));
                let subs = queues.into_iter().map(|q| (q.clone(), q)).collect();
                settle_round(broker, cell, subs, n_each * cell.subs as u64).await
            }
        };
        let sent = &mut self.sent[usize::from(side == Side::Settle)];
        for (op, n) in self.requests.snapshot() {
            let d = n - before.get(&op).copied().unwrap_or(0);
            if d > 0 {
                *sent.entry(op).or_default() += d;
            }
        }
        taken
    }

    fn requests(&mut self, side: Side, consumed: u64) -> Option<String> {
        let sent = std::mem::take(&mut self.sent[usize::from(side == Side::Settle)]);
        let per: Vec<String> = sent
            .iter()
            .map(|(op, n)| format!("{op} {:.3}", *n as f64 / consumed as f64))
            .collect();
        Some(per.join(", "))
    }

    async fn finish(&mut self, cell: &Cell) {
        for side in [Side::Bare, Side::Settle] {
            for q in Self::queues(cell, side) {
                let url = self.url(&q).await;
                let _ = self.client.delete_queue().queue_url(url).send().await;
            }
        }
    }
}

/// Receives while there are free slots (at most 10 a receive) and deletes each message, up to
/// maxInFlight received and not yet deleted; returns once `n` are deleted.
async fn bare(client: Client, url: String, cell: &Cell, n: u64) {
    let slots = Arc::new(Semaphore::new(usize::from(cell.in_flight)));
    let mut received = 0;
    while received < n {
        let first = slots.clone().acquire_owned().await.expect("open");
        let mut held = vec![first];
        while held.len() < 10 {
            match slots.clone().try_acquire_owned() {
                Ok(p) => held.push(p),
                Err(_) => break,
            }
        }
        // What the runtime asks for, because a consumer with its contract needs it: the attempt
        // (maxDeliver), the first receive (SQS's twelve-hour hold) and the headers.
        let out = client
            .receive_message()
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_system_attribute_names(
                MessageSystemAttributeName::ApproximateFirstReceiveTimestamp,
            )
            .message_attribute_names("All")
            .queue_url(&url)
            .max_number_of_messages(held.len() as i32)
            .wait_time_seconds(1)
            .visibility_timeout(30)
            .send()
            .await
            .expect("ReceiveMessage");
        for m in out.messages.unwrap_or_default() {
            let Some(permit) = held.pop() else { break };
            received += 1;
            super::handicap();
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                client
                    .delete_message()
                    .queue_url(url)
                    .receipt_handle(m.receipt_handle.unwrap_or_default())
                    .send()
                    .await
                    .expect("DeleteMessage");
                drop(permit);
            });
        }
    }
    let all = u32::from(cell.in_flight);
    let _ = slots.acquire_many(all).await.expect("open");
}
