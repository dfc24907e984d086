//! Adoption on every broker (docs/semantics.md J9, R13, Q11): `settle operator` as a process
//! against the real API server and the environment's nats-server, RabbitMQ and ElasticMQ, each
//! object made by hand with the broker's own client (async-nats, the management API and AMQP,
//! the AWS SDK), an application on the `settle` runtime as a process. The scenarios are written
//! once (`common::adopt`); this file holds each broker's hands. SQS can change every attribute
//! Settle sets in place, so no SQS queue is incompatible: the refusal does not run there.

use settle_testkit as common;

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use common::adopt::{
    HandMade, Look, adopted_with_its_position, an_incompatible_one_is_refused_and_left_untouched,
    another_namespace_never_takes_it,
};
use common::operator::TestStream;
use common::subs::{apply, backend_yaml};
use futures::StreamExt;

/// A JetStream consumer made with async-nats, on a stream of the test's own.
struct Jet {
    stream: TestStream,
    url: String,
    held: Vec<jetstream::Message>,
}

impl HandMade for Jet {
    async fn new(test: &str) -> Jet {
        let url = common::env().nats_url;
        Jet {
            stream: TestStream::new(&url, test).await,
            url,
            held: Vec::new(),
        }
    }

    fn backend(&self, ns: &str) {
        apply(ns, &backend_yaml("nats", &self.url));
    }

    fn spec(&self) -> String {
        format!(
            "  backendRef: {{name: nats}}\n  pattern: \"{}.>\"\n  mode: AtLeastOnce\n  durableName: orders\n  ackWait: 20s\n",
            self.stream.prefix
        )
    }

    fn app_env(&self) -> Vec<(&'static str, String)> {
        vec![("SETTLE_NATS_URL", self.url.clone())]
    }

    async fn make(&mut self, compatible: bool) {
        // What an application would write, leaving the rest to the server's defaults.
        let (ack_policy, deliver_policy) = if compatible {
            (consumer::AckPolicy::Explicit, consumer::DeliverPolicy::All)
        } else {
            (consumer::AckPolicy::All, consumer::DeliverPolicy::New)
        };
        self.stream
            .js
            .get_stream(&self.stream.name)
            .await
            .expect("the stream")
            .create_consumer(consumer::pull::Config {
                durable_name: Some("orders".into()),
                description: Some("made by hand".into()),
                ack_policy,
                deliver_policy,
                ack_wait: Duration::from_secs(20),
                filter_subject: format!("{}.>", self.stream.prefix),
                max_ack_pending: 250,
                ..Default::default()
            })
            .await
            .expect("a consumer made by hand");
    }

    fn differing(&self) -> &'static [&'static str] {
        &[
            "ack_policy (spec.mode): wants Explicit, the consumer has All",
            "deliver_policy (spec.durableName): wants All, the consumer has New",
        ]
    }

    async fn publish(&mut self, n: usize) -> Vec<String> {
        let bodies = common::account::bodies(n);
        common::account::publish_to(&self.stream, bodies.clone()).await;
        bodies
    }

    async fn hold(&mut self, n: usize) -> Vec<String> {
        let c: consumer::PullConsumer = self
            .stream
            .js
            .get_stream(&self.stream.name)
            .await
            .expect("the stream")
            .get_consumer("orders")
            .await
            .expect("the consumer");
        while self.held.len() < n {
            let mut batch = c
                .fetch()
                .max_messages(n - self.held.len())
                .expires(Duration::from_secs(2))
                .messages()
                .await
                .expect("fetch");
            while let Some(m) = batch.next().await {
                // Never acknowledged: it comes back when the ack wait runs out.
                self.held.push(m.expect("a message"));
            }
        }
        self.held
            .iter()
            .map(|m| String::from_utf8_lossy(&m.payload).to_string())
            .collect()
    }

    async fn let_go(&mut self) {
        self.held.clear();
    }

    async fn look(&self) -> Option<Look> {
        let info = self.stream.consumer("orders").await?;
        let mut config = info.config.clone();
        // The server's map, in a stable order.
        let metadata: std::collections::BTreeMap<_, _> = config.metadata.drain().collect();
        Some(Look {
            identity: format!(
                "created {}, delivered up to stream sequence {}",
                info.created, info.delivered.stream_sequence
            ),
            config: format!(
                "{config:?}; metadata {metadata:?}; delivered {:?}; ack floor {:?}",
                info.delivered, info.ack_floor
            ),
            pending: info.num_pending,
            unsettled: u64::try_from(info.num_ack_pending).unwrap_or_default(),
        })
    }

    async fn finish(self) {
        self.stream.delete().await;
    }
}

/// A consumer migrated onto Settle through a Backend of its own (a NACK consumer, namespace
/// by namespace) brings none of its past losses: three messages ran out of attempts on it while
/// the operator's capture recorded them (another Backend on the server), then a new Backend's
/// Subscription takes it over. The new Backend's reader reads the capture from its start, and
/// every loss written before the object was made counts for nobody (`earlier_consumer`):
/// exhausted stays 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_taken_over_through_a_new_backend_counts_none_of_its_past_losses() {
    common::install_crds();
    let test = "adopt-js-hist";
    let (old_ns, new_ns) = (
        common::namespace("adopt-js-hist-old"),
        common::namespace("adopt-js-hist-new"),
    );
    let hand = Jet::new(test).await;
    let op = common::operator::Operator::start_with(
        test,
        &format!("{old_ns},{new_ns}"),
        &[
            "--leader-election=false",
            "--stats-interval",
            "1s",
            "--adopt-namespaces",
            &new_ns,
        ],
    );
    // A Backend the operator keeps on this server already: its capture records the losses.
    hand.backend(&old_ns);
    common::subs::wait_backend(
        &common::subs::backends(&old_ns).await,
        "nats",
        "True",
        "Connected",
    )
    .await;
    let stream = hand
        .stream
        .js
        .get_stream(&hand.stream.name)
        .await
        .expect("the stream");
    let c: consumer::PullConsumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some("orders".into()),
            ack_policy: consumer::AckPolicy::Explicit,
            deliver_policy: consumer::DeliverPolicy::All,
            ack_wait: Duration::from_secs(1),
            max_deliver: 2,
            filter_subject: format!("{}.>", hand.stream.prefix),
            ..Default::default()
        })
        .await
        .expect("a consumer made by hand");
    common::account::publish_to(&hand.stream, common::account::bodies(3)).await;
    // Each message handed out twice and never settled: it runs out of attempts, which the
    // server says (an advisory) when a third pull would have had it.
    for _ in 0..3 {
        let mut batch = c
            .fetch()
            .max_messages(3)
            .expires(Duration::from_secs(3))
            .messages()
            .await
            .expect("fetch");
        while let Some(m) = batch.next().await {
            m.expect("a message");
        }
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }
    let capture = settle::backend::nats::capture::CAPTURE_STREAM;
    let subject = format!(
        "{}.{}.orders",
        settle::backend::nats::advisory::MAX_DELIVERIES.trim_end_matches(".>"),
        hand.stream.name
    );
    common::operator::poll(
        "the three losses in the capture",
        Duration::from_secs(30),
        || async {
            let s = hand
                .stream
                .js
                .get_stream(capture)
                .await
                .map_err(|e| e.to_string())?;
            let info = s
                .info_with_subjects(subject.clone())
                .await
                .map_err(|e| e.to_string())?;
            let subjects: Vec<_> = info.collect().await;
            let subjects: Vec<(String, usize)> = subjects.into_iter().flatten().collect();
            let n: usize = subjects.iter().map(|(_, n)| n).sum();
            if n >= 3 {
                Ok(())
            } else {
                Err(format!("{n} so far under {subject}: {subjects:?}"))
            }
        },
    )
    .await;
    // Kubernetes times have whole seconds: the object is made two seconds after the losses.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let earlier_before = op.metric(
        "settle_account_advisories_total",
        &[("kind", "earlier_consumer")],
    );
    hand.backend(&new_ns);
    let text = format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {new_ns}}}\nspec:\n{}  maxDeliver: 2\n  adopt: IfCompatible\n",
        hand.spec()
    );
    apply(&new_ns, &text);
    let api = common::subs::subs(&new_ns).await;
    common::subs::wait_ready(&api, "orders").await;
    // The new Backend's reader has read the capture's old losses, each refused.
    common::operator::poll(
        "the new Backend's reader to refuse the three old losses",
        Duration::from_secs(60),
        || async {
            let n = op.metric(
                "settle_account_advisories_total",
                &[("kind", "earlier_consumer")],
            );
            if n >= earlier_before + 3.0 {
                Ok(())
            } else {
                Err(format!("{n}"))
            }
        },
    )
    .await;
    let shown = common::account::settled_at(
        "the taken-over consumer's account at rest",
        Duration::from_secs(30),
        || common::account::stats_in(&api, "orders"),
        |_| true,
    )
    .await;
    assert_eq!(
        shown.exhausted, 0,
        "its past losses were counted: {shown:?}"
    );
    drop(op);
    for ns in [&old_ns, &new_ns] {
        common::kubectl_ok(&["delete", "namespace", ns, "--wait=false"], None);
    }
    hand.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_made_consumer_is_taken_over_with_its_position_and_nothing_delivered_twice() {
    adopted_with_its_position::<Jet>("adopt-js").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_made_consumer_that_differs_where_jetstream_cannot_change_it_is_refused_untouched() {
    an_incompatible_one_is_refused_and_left_untouched::<Jet>("adopt-js-no").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_namespace_never_takes_a_consumer_over_on_a_shared_stream() {
    another_namespace_never_takes_it::<Jet>("adopt-js-ns").await;
}

mod rabbitmq {
    use super::*;
    use common::rabbitmq::{encode, env_backend_yaml, management_json, management_with};
    use lapin::options::{BasicConsumeOptions, BasicQosOptions, QueueDeleteOptions};
    use lapin::types::FieldTable;

    /// A quorum queue declared by hand over the management API, bound to nothing; its
    /// messages put straight into it; a client of AMQP holding some.
    pub struct Rabbit {
        queue: String,
        amqp: lapin::Connection,
        holder: Option<(lapin::Channel, lapin::Consumer)>,
    }

    impl HandMade for Rabbit {
        async fn new(test: &str) -> Rabbit {
            let env = common::env();
            Rabbit {
                queue: format!("{}_{}", test.replace('-', "_"), std::process::id()),
                amqp: lapin::Connection::connect(
                    &env.rabbitmq_url,
                    lapin::ConnectionProperties::default(),
                )
                .await
                .expect("AMQP"),
                holder: None,
            }
        }

        /// On the default vhost, which the scenes' namespaces share on purpose (adoption
        /// across namespaces of one vhost), so each Backend consents to share it.
        fn backend(&self, ns: &str) {
            apply(
                ns,
                &env_backend_yaml(
                    "rabbit",
                    "    sharedVhost: true
",
                ),
            );
        }

        fn spec(&self) -> String {
            format!(
                "  backendRef: {{name: rabbit}}\n  pattern: \"{}.>\"\n  mode: AtLeastOnce\n  durableName: {}\n  maxDeliver: 3\n",
                self.queue, self.queue
            )
        }

        fn app_env(&self) -> Vec<(&'static str, String)> {
            vec![("SETTLE_RABBITMQ_URL", common::env().rabbitmq_url)]
        }

        async fn make(&mut self, compatible: bool) {
            // maxDeliver 3 is x-delivery-limit 2 (R1).
            let arguments = if compatible {
                r#"{"x-queue-type":"quorum","x-delivery-limit":2}"#
            } else {
                r#"{"x-queue-type":"quorum","x-delivery-limit":9,"x-max-length":1000}"#
            };
            let (status, body) = management_with(
                "PUT",
                &format!("/api/queues/%2f/{}", encode(&self.queue)),
                &format!(r#"{{"durable":true,"arguments":{arguments}}}"#),
            );
            assert!(matches!(status, 201 | 204), "PUT queue: {status} {body}");
        }

        fn differing(&self) -> &'static [&'static str] {
            &[
                "x-delivery-limit (spec.maxDeliver): wants 2, the queue has 9",
                "x-max-length: wants none, the queue has 1000",
            ]
        }

        async fn publish(&mut self, n: usize) -> Vec<String> {
            common::rabbitmq::put_messages(&self.queue, n);
            (0..n).map(|i| format!("m{i}")).collect()
        }

        async fn hold(&mut self, n: usize) -> Vec<String> {
            let ch = self.amqp.create_channel().await.expect("channel");
            ch.basic_qos(
                u16::try_from(n).unwrap_or(u16::MAX),
                BasicQosOptions::default(),
            )
            .await
            .expect("qos");
            let mut c = ch
                .basic_consume(
                    self.queue.as_str().into(),
                    "by-hand".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .expect("consume");
            let mut bodies = Vec::new();
            while bodies.len() < n {
                let d = c.next().await.expect("a delivery").expect("a delivery");
                bodies.push(String::from_utf8_lossy(&d.data).to_string());
            }
            self.holder = Some((ch, c));
            bodies
        }

        async fn let_go(&mut self) {
            // A closed channel gives back what it held (R5).
            if let Some((ch, _)) = self.holder.take() {
                ch.close(200, "let go".into()).await.expect("close");
            }
        }

        async fn look(&self) -> Option<Look> {
            let (status, _) =
                common::rabbitmq::management("GET", &format!("/api/queues/%2f/{}", self.queue));
            if status == 404 {
                return None;
            }
            let q = management_json("GET", &format!("/api/queues/%2f/{}", self.queue));
            let n = |k: &str| q[k].as_u64().unwrap_or_default();
            Some(Look {
                identity: q["arguments"].to_string(),
                config: format!(
                    "{} {} bindings {:?}",
                    q["arguments"],
                    q["durable"],
                    common::rabbitmq::bindings(&self.queue)
                ),
                pending: n("messages_ready"),
                unsettled: n("messages_unacknowledged"),
            })
        }

        async fn finish(self) {
            if let Ok(ch) = self.amqp.create_channel().await {
                let _ = ch
                    .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hand_declared_queue_is_taken_over_with_its_messages_and_nothing_delivered_twice() {
        adopted_with_its_position::<Rabbit>("adopt-rmq").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hand_declared_queue_of_other_arguments_is_refused_untouched() {
        an_incompatible_one_is_refused_and_left_untouched::<Rabbit>("adopt-rmq-no").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_namespace_never_takes_a_queue_over_on_a_shared_vhost() {
        another_namespace_never_takes_it::<Rabbit>("adopt-rmq-ns").await;
    }
}

mod sqs {
    use super::*;
    use aws_sdk_sqs::types::QueueAttributeName;

    /// An SQS queue made with the AWS SDK under a queue prefix of the test's own, untagged.
    pub struct Sqs {
        prefix: String,
        client: aws_sdk_sqs::Client,
    }

    impl Sqs {
        fn name(&self) -> String {
            format!("{}orders", self.prefix)
        }
    }

    impl HandMade for Sqs {
        async fn new(test: &str) -> Sqs {
            Sqs {
                prefix: format!("{}{}-", test.replace('-', ""), std::process::id()),
                client: common::sqs::client().await,
            }
        }

        fn backend(&self, ns: &str) {
            common::sqs::sqs_backend(ns, &self.prefix);
        }

        fn spec(&self) -> String {
            "  backendRef: {name: sqs}\n  pattern: orders\n  mode: AtLeastOnce\n  durableName: orders\n  ackWait: 20s\n".into()
        }

        fn app_env(&self) -> Vec<(&'static str, String)> {
            vec![
                ("SETTLE_SQS_ENDPOINT", common::env().sqs_endpoint),
                ("SETTLE_SQS_QUEUE_PREFIX", self.prefix.clone()),
            ]
        }

        async fn make(&mut self, compatible: bool) {
            assert!(compatible, "SQS can change all Settle sets in place");
            self.client
                .create_queue()
                .queue_name(self.name())
                .attributes(QueueAttributeName::VisibilityTimeout, "20")
                .send()
                .await
                .expect("a queue made by hand");
        }

        fn differing(&self) -> &'static [&'static str] {
            &[]
        }

        async fn publish(&mut self, n: usize) -> Vec<String> {
            let url = common::sqs::url(&self.client, &self.name())
                .await
                .expect("the queue");
            let bodies = common::account::bodies(n);
            for b in &bodies {
                self.client
                    .send_message()
                    .queue_url(&url)
                    .message_body(b)
                    .send()
                    .await
                    .expect("send");
            }
            bodies
        }

        async fn hold(&mut self, n: usize) -> Vec<String> {
            let url = common::sqs::url(&self.client, &self.name())
                .await
                .expect("the queue");
            let mut bodies = Vec::new();
            while bodies.len() < n {
                let got = self
                    .client
                    .receive_message()
                    .queue_url(&url)
                    .max_number_of_messages(i32::try_from(10.min(n - bodies.len())).unwrap_or(1))
                    .send()
                    .await
                    .expect("receive");
                // Never deleted: visible again when the visibility timeout (20 s) runs out.
                bodies.extend(
                    got.messages
                        .unwrap_or_default()
                        .into_iter()
                        .filter_map(|m| m.body),
                );
            }
            bodies
        }

        async fn let_go(&mut self) {}

        async fn look(&self) -> Option<Look> {
            let a = common::sqs::attributes_of(&self.client, &self.name()).await?;
            let n = |k: &str| a.get(k).and_then(|v| v.parse().ok()).unwrap_or_default();
            Some(Look {
                identity: a.get("CreatedTimestamp").cloned().unwrap_or_default(),
                config: format!("{a:?}"),
                pending: n("ApproximateNumberOfMessages"),
                unsettled: n("ApproximateNumberOfMessagesNotVisible"),
            })
        }

        async fn finish(self) {
            if let Some(url) = common::sqs::url(&self.client, &self.name()).await {
                let _ = self.client.delete_queue().queue_url(url).send().await;
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hand_made_sqs_queue_is_taken_over_with_its_messages_and_nothing_delivered_twice() {
        adopted_with_its_position::<Sqs>("adopt-sqs").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_namespace_never_takes_an_sqs_queue_over_under_a_shared_prefix() {
        another_namespace_never_takes_it::<Sqs>("adopt-sqs-ns").await;
    }
}
