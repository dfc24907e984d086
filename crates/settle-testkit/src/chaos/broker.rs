//! Where a campaign runs: per broker, the Backend applied in the campaign's namespace (its
//! credentials in a Secret, [`super::credentials`]), the Subscription's broker fields, the
//! applications' environment, its publisher ([`super::publisher`]), the consumer or queue
//! deleted on the broker, what is left on it, and what is removed afterwards. NATS: a
//! nats-server of the campaign's own (so it can be SIGKILLed), with users, and a stream on it;
//! the NATS cluster: the environment's three servers and a stream of three replicas; RabbitMQ:
//! a node of the campaign's own (so it can be SIGKILLed), with a dead-letter exchange, and a
//! routing key on `amq.topic` into the Subscription's quorum queue; SQS: a queue prefix of its
//! own, reached through a forwarder that a broker fault holds (a service does not crash; it
//! becomes unreachable). The broker taken down is [`super::outages`]; its report source
//! deleted, [`super::reports`].
//!
//! It must not decide when a fault happens nor judge status: the campaign does.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use settle::backend::nats::capture::{ACCOUNT_BUCKET, CAPTURE_STREAM};
use settle::bus::report::REPORT_BUCKET;

use super::credentials::{Access, Kind, SECRET, USERS, nats_config, rabbitmq_user, secret};
use super::publisher::Publisher;
use crate::account::report_keys;
use crate::nats_cluster::{Cluster, cluster};
use crate::operator::{NatsServer, TestStream};
use crate::partition::Partition;
use crate::rabbitmq::{management_at, rabbitmq_backend_yaml};
use crate::rabbitmq_server::RabbitServer;
use crate::subs::{apply, backends, nats_backend_yaml, nats_credentials, wait_backend};

/// The brokers a campaign runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Broker {
    Nats,
    /// The environment's JetStream cluster (`hack/env.sh up --nats-cluster`).
    NatsCluster,
    Rabbitmq,
    Sqs,
}

impl Broker {
    pub const ALL: [Broker; 4] = [
        Broker::Nats,
        Broker::NatsCluster,
        Broker::Rabbitmq,
        Broker::Sqs,
    ];

    /// `nats`, `nats-cluster`, `rabbitmq` or `sqs`.
    pub fn parse(name: &str) -> Option<Broker> {
        Broker::ALL.into_iter().find(|b| b.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Broker::Nats => "nats",
            Broker::NatsCluster => "nats-cluster",
            Broker::Rabbitmq => "rabbitmq",
            Broker::Sqs => "sqs",
        }
    }

    /// Whether it can hold a declined message back (K1): the Subscription then has a
    /// `maxNackDelay` and the handlers' `nack_after` is taken; elsewhere it is refused (B3).
    pub fn delays(self) -> bool {
        self != Broker::Rabbitmq
    }

    /// Whether a consumer made again is offered every message the broker still holds (NATS:
    /// the stream keeps them, and a consumer delivers from the first stored, J1), rather than
    /// only those published after it (a queue deleted takes its messages with it).
    pub fn offers_stored(self) -> bool {
        matches!(self, Broker::Nats | Broker::NatsCluster)
    }

    /// The least time between a Subscription's deletion and its applying again. SQS refuses
    /// to make a queue of a deleted one's name for 60 s, so every running instance finds the
    /// queue gone (a receive waits at most 20 s) and reads its mark again before it receives
    /// from the new object's queue (semantics Q7); ElasticMQ makes it at once, and holds a
    /// receive waiting on a deleted queue until its wait ends (the client then tries it again),
    /// so the campaign waits well past a receive's 20 s instead. Elsewhere a second.
    pub fn recreate_after(self) -> Duration {
        match self {
            Broker::Sqs => Duration::from_secs(30),
            Broker::Nats | Broker::NatsCluster | Broker::Rabbitmq => Duration::from_secs(1),
        }
    }

    /// The operators' flags this broker needs beyond the campaign's: on the cluster the
    /// account's capture and buckets at three replicas, so a server lost loses none of them.
    ///
    /// And `--fold-after`: a SIGKILLed instance is folded soon, so its unfinished attempts
    /// count as Released and I1 holds at rest (C16); but not sooner than a fault can cut a live
    /// instance off while the keeper hears the bucket, for one silent that long is, by C16,
    /// counted dead, and its attempts Released though its handlers finish them. On one server
    /// (and on SQS behind the held forwarder) a fault cuts the keeper off with the instances,
    /// so it is deaf meanwhile and 5 s will do; on the cluster a paused server (up to 10 s,
    /// the cluster healthy a few seconds later) cuts off only its own clients: 20 s.
    ///
    /// And on RabbitMQ and SQS, which announce no deleted queue, `--drift-interval 2s`: a queue
    /// deleted on the broker is made again within it, rather than within the default 30 s.
    pub(super) fn operator_flags(self) -> &'static [&'static str] {
        match self {
            Broker::NatsCluster => &["--account-replicas", "3", "--fold-after", "20s"],
            Broker::Nats => &["--fold-after", "5s"],
            Broker::Rabbitmq | Broker::Sqs => &["--fold-after", "5s", "--drift-interval", "2s"],
        }
    }
}

/// The campaign's place on its broker.
pub(super) enum Target {
    Nats(Box<TestStream>, NatsServer),
    NatsCluster(Box<TestStream>, Cluster),
    Rabbitmq {
        /// The publisher's connection, held by a broker fault from before the kill until it
        /// is made again, so no message is in flight when the broker dies (one whose confirm
        /// was lost would be sent twice).
        amqp: Arc<tokio::sync::Mutex<lapin::Connection>>,
        tag: String,
        server: Box<RabbitServer>,
    },
    Sqs {
        client: aws_sdk_sqs::Client,
        url: String,
        prefix: String,
        /// Between ElasticMQ and everyone but the publisher: the operators and applications
        /// reach SQS through it, and a broker fault holds it.
        link: Box<Partition>,
    },
}

impl Target {
    /// The Backend of `broker` applied in `ns` and Ready, and the Subscription's broker fields
    /// (`backendRef`, `pattern`, `durableName`, and `ackWait` and `maxNackDelay` where the
    /// broker has them: a silent attempt comes back after 2 s, a handler working 3 s has its
    /// lease extended, and `nack_after` takes up to 2 s; on RabbitMQ silence declines at once,
    /// R3), with what the applications need.
    pub(super) async fn make(
        broker: Broker,
        ns: &str,
    ) -> (Target, String, Vec<(String, String)>, Access) {
        let env = crate::env();
        let tag = format!("chaos{}", std::process::id());
        match broker {
            Broker::Nats => {
                // Users: the campaign's clients, the applications, and the operators' (the
                // Backend's Secret), which a fault rotates.
                let config =
                    crate::root().join(format!("target/chaos-nats-{}.conf", std::process::id()));
                std::fs::write(&config, nats_config(&[USERS[0]]))
                    .expect("the server's configuration");
                let monitor = crate::free_port();
                let server = NatsServer::start(&[
                    "-c",
                    &config.to_string_lossy(),
                    "-m",
                    &monitor.to_string(),
                ]);
                let (url, port) = (server.url(), server.port);
                let stream =
                    TestStream::new(&format!("nats://admin:admin-pw@127.0.0.1:{port}"), "chaos")
                        .await;
                let access = Access {
                    kind: Kind::Nats { config, monitor },
                    user: 0,
                };
                secret(ns, &access.kind, USERS[0]);
                apply(
                    ns,
                    &nats_backend_yaml("nats", &url, &nats_credentials(SECRET)),
                );
                let fields = format!(
                    "  backendRef: {{name: nats}}\n  pattern: \"{}.>\"\n  durableName: orders\n  ackWait: 2s\n  maxNackDelay: 2s\n",
                    stream.prefix
                );
                let app_env = vec![(
                    "SETTLE_NATS_URL".into(),
                    format!("nats://app:app-pw@127.0.0.1:{port}"),
                )];
                (
                    Target::Nats(Box::new(stream), server),
                    fields,
                    app_env,
                    access,
                )
            }
            Broker::NatsCluster => {
                let cluster = cluster();
                cluster.wait_healthy().await;
                let urls = cluster.url_list();
                let stream = TestStream::replicated(&urls, "chaos", 3).await;
                apply(ns, &nats_backend_yaml("nats", &urls, ""));
                let fields = format!(
                    "  backendRef: {{name: nats}}\n  pattern: \"{}.>\"\n  durableName: orders\n  ackWait: 2s\n  maxNackDelay: 2s\n",
                    stream.prefix
                );
                let app_env = vec![("SETTLE_NATS_URL".into(), urls)];
                (
                    Target::NatsCluster(Box::new(stream), cluster),
                    fields,
                    app_env,
                    Access {
                        kind: Kind::None,
                        user: 0,
                    },
                )
            }
            Broker::Rabbitmq => {
                let server = tokio::task::block_in_place(RabbitServer::start);
                // A dead-letter exchange, so the broker's own losses (a last attempt a crash
                // spent, R6) are counted too and Exhausted is exact (R9, I4).
                let (status, body) = management_at(
                    &server.management_url(),
                    "PUT",
                    "/api/exchanges/%2f/chaos.dlx",
                    r#"{"type":"fanout","durable":true}"#,
                );
                assert!(
                    matches!(status, 201 | 204),
                    "the dead-letter exchange: {status} {body}"
                );
                // The operators connect as a user of their own (the applications and the
                // campaign as guest), which a fault rotates.
                let access = Access {
                    kind: Kind::Rabbitmq {
                        management: server.management_url(),
                    },
                    user: 0,
                };
                rabbitmq_user(&server.management_url(), USERS[0]);
                secret(ns, &access.kind, USERS[0]);
                apply(
                    ns,
                    &rabbitmq_backend_yaml(
                        "rabbit",
                        &server.url(),
                        &server.management_url(),
                        &format!(
                            "    deadLetterExchange: chaos.dlx\n    credentialsSecretRef: {{name: {SECRET}}}\n"
                        ),
                    ),
                );
                wait_backend(
                    &backends(ns).await,
                    "rabbit",
                    "True",
                    "PlaintextCredentials",
                )
                .await;
                let amqp = amqp_connect(&server.url()).await;
                let fields = format!(
                    "  backendRef: {{name: rabbit}}\n  pattern: \"{tag}.>\"\n  durableName: {tag}\n"
                );
                let app_env = vec![("SETTLE_RABBITMQ_URL".into(), server.url())];
                (
                    Target::Rabbitmq {
                        amqp: Arc::new(tokio::sync::Mutex::new(amqp)),
                        tag,
                        server: Box::new(server),
                    },
                    fields,
                    app_env,
                    access,
                )
            }
            Broker::Sqs => {
                let prefix = format!("{tag}-");
                let elasticmq: std::net::SocketAddr = env
                    .sqs_endpoint
                    .trim_start_matches("http://")
                    .trim_end_matches('/')
                    .parse()
                    .expect("the SQS endpoint is an IP:port");
                let link = Partition::to(elasticmq).await;
                let endpoint = format!("http://127.0.0.1:{}", link.port);
                let access = Access {
                    kind: Kind::Sqs,
                    user: 0,
                };
                secret(ns, &access.kind, USERS[0]);
                apply(
                    ns,
                    &format!(
                        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: sqs}}\nspec:\n  sqs:\n    region: elasticmq\n    endpoint: \"{endpoint}\"\n    queuePrefix: \"{prefix}\"\n    credentialsSecretRef: {{name: {SECRET}}}\n"
                    ),
                );
                wait_backend(&backends(ns).await, "sqs", "True", "PlaintextCredentials").await;
                let fields =
                    "  backendRef: {name: sqs}\n  pattern: orders\n  durableName: orders\n  ackWait: 2s\n  maxNackDelay: 2s\n".into();
                let app_env = vec![
                    ("SETTLE_SQS_ENDPOINT".into(), endpoint),
                    ("SETTLE_SQS_QUEUE_PREFIX".into(), prefix.clone()),
                ];
                let client = crate::sqs::client().await;
                // Filled once the Subscription made the queue ([`Target::ready`]).
                let url = format!("{prefix}orders");
                (
                    Target::Sqs {
                        client,
                        url,
                        prefix,
                        link: Box::new(link),
                    },
                    fields,
                    app_env,
                    access,
                )
            }
        }
    }

    /// The broker it is on.
    pub(super) fn broker(&self) -> Broker {
        match self {
            Target::Nats(..) => Broker::Nats,
            Target::NatsCluster(..) => Broker::NatsCluster,
            Target::Rabbitmq { .. } => Broker::Rabbitmq,
            Target::Sqs { .. } => Broker::Sqs,
        }
    }

    /// Called once the Subscription is Ready: what publishing needs from its broker objects.
    pub(super) async fn ready(&mut self) {
        if let Target::Sqs { client, url, .. } = self
            && !url.starts_with("http")
        {
            *url = crate::sqs::url(client, url)
                .await
                .expect("the Subscription's queue exists");
        }
    }

    /// A publisher of message `id` (its body the id), confirmed by the broker.
    pub(super) fn publisher(&self) -> Publisher {
        match self {
            Target::Nats(s, _) | Target::NatsCluster(s, _) => {
                Publisher::Nats(Box::new(s.js.clone()), s.prefix.clone())
            }
            Target::Rabbitmq { amqp, tag, .. } => Publisher::Rabbitmq(amqp.clone(), tag.clone()),
            Target::Sqs { client, url, .. } => Publisher::Sqs(client.clone(), url.clone()),
        }
    }

    /// What is still on the broker of the campaign's Subscription and Backend (namespace `ns`)
    /// once both are deleted: NATS, a consumer of the campaign's stream, a report or ledger key
    /// under the namespace, the Backend's reader of the capture; RabbitMQ, a queue of the
    /// campaign's routing key or named for the namespace; SQS, a queue under the prefix (but a
    /// dead-letter queue holding Exhausted messages, which deletion keeps by design).
    pub(super) async fn leftovers(&self, ns: &str) -> Vec<String> {
        let mut left = Vec::new();
        match self {
            Target::Nats(s, _) | Target::NatsCluster(s, _) => {
                if let Ok(stream) = s.js.get_stream(&s.name).await {
                    let mut names = stream.consumer_names();
                    while let Some(Ok(name)) = names.next().await {
                        left.push(format!("consumer {name} of stream {}", s.name));
                    }
                }
                for bucket in [REPORT_BUCKET, ACCOUNT_BUCKET] {
                    if let Ok(kv) = s.js.get_key_value(bucket).await {
                        let keys = report_keys(&kv, &format!("{ns}."))
                            .await
                            .unwrap_or_default();
                        left.extend(keys.into_iter().map(|k| format!("key {k} of {bucket}")));
                    }
                }
                if let Ok(capture) = s.js.get_stream(CAPTURE_STREAM).await {
                    let mut names = capture.consumer_names();
                    while let Some(Ok(name)) = names.next().await {
                        if name.contains(ns) {
                            left.push(format!("reader {name} of {CAPTURE_STREAM}"));
                        }
                    }
                }
            }
            Target::Rabbitmq { tag, server, .. } => {
                let names = queue_names(&server.management_url()).unwrap_or_else(|e| {
                    left.push(format!("the queue list: {e}"));
                    Vec::new()
                });
                left.extend(
                    names
                        .iter()
                        .filter(|n| n.contains(ns) || n.contains(tag.as_str()))
                        .map(|n| format!("queue {n}")),
                );
            }
            Target::Sqs { client, prefix, .. } => {
                let urls = match client.list_queues().queue_name_prefix(prefix).send().await {
                    Ok(out) => out.queue_urls().to_vec(),
                    Err(e) => {
                        left.push(format!("the queue list: {e}"));
                        Vec::new()
                    }
                };
                for url in urls {
                    // A dead-letter queue holding Exhausted messages is kept for a person to
                    // look at (docs/guide/reconcile.md, Deletion): only an empty one is left.
                    if url.ends_with("-dlq") && holds_messages(client, &url).await {
                        continue;
                    }
                    left.push(format!("queue {url}"));
                }
            }
        }
        left
    }

    /// Whether reports wait on the broker for the account to count them. On SQS the keeper
    /// deletes a report once the snapshot holding it is saved: a report queue holding one
    /// (visible, or held by a keeper, a dead leader's included) is not counted in status yet.
    /// NATS keeps every report in its bucket and RabbitMQ each instance's newest in its queue:
    /// there only a status that stays the same says the account is at rest.
    pub(super) async fn reports_waiting(&self) -> bool {
        match self {
            Target::Sqs { client, prefix, .. } => {
                let name = settle::backend::sqs::report::report_queue(&format!("{prefix}orders"));
                match crate::sqs::url(client, &name).await {
                    Some(url) => holds_messages(client, &url).await,
                    None => false,
                }
            }
            Target::Nats(..) | Target::NatsCluster(..) | Target::Rabbitmq { .. } => false,
        }
    }

    /// The Subscription's consumer (NATS) or queue (RabbitMQ, SQS: with the messages it
    /// holds) deleted on the broker, behind the operator's back, and waited for until the
    /// operator has made it again (at most 60 s); says what was deleted.
    ///
    /// Also how long before it returns the consumer was made again: on NATS, by the server's
    /// clock, for the one made again offers the same messages afresh, and an answer to it
    /// given before the campaign saw it must not be taken for the deleted one's (the campaign
    /// polls every 100 ms, and saw one 0.6 s after the operator had made it, its attempts
    /// already answered); elsewhere no time (a queue made again holds none of the deleted
    /// one's messages).
    pub(super) async fn delete_consumer(&self) -> (String, Duration) {
        let what = self.delete_consumer_once().await;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !self.consumer_there().await {
            assert!(
                std::time::Instant::now() < deadline,
                "{what} not made again within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let ago = match self {
            Target::Nats(s, _) | Target::NatsCluster(s, _) => {
                s.consumer("orders").await.and_then(|info| {
                    std::time::SystemTime::now()
                        .duration_since(std::time::SystemTime::from(info.created))
                        .ok()
                })
            }
            Target::Rabbitmq { .. } | Target::Sqs { .. } => None,
        };
        (what, ago.unwrap_or_default())
    }

    async fn delete_consumer_once(&self) -> String {
        match self {
            Target::Nats(s, _) | Target::NatsCluster(s, _) => {
                let stream = s.js.get_stream(&s.name).await.expect("the stream");
                stream
                    .delete_consumer("orders")
                    .await
                    .expect("the consumer deleted");
                format!("consumer orders of stream {}", s.name)
            }
            Target::Rabbitmq { tag, server, .. } => {
                let (status, body) = management_at(
                    &server.management_url(),
                    "DELETE",
                    &format!("/api/queues/%2f/{tag}"),
                    "",
                );
                assert!(
                    matches!(status, 200 | 204),
                    "the queue deleted: {status} {body}"
                );
                format!("queue {tag}")
            }
            Target::Sqs { client, url, .. } => {
                client
                    .delete_queue()
                    .queue_url(url)
                    .send()
                    .await
                    .expect("the queue deleted");
                format!("queue {url}")
            }
        }
    }

    /// Whether the Subscription's consumer or queue is there (made again by the operator
    /// after [`Target::delete_consumer`]).
    async fn consumer_there(&self) -> bool {
        match self {
            Target::Nats(s, _) | Target::NatsCluster(s, _) => s.consumer("orders").await.is_some(),
            Target::Rabbitmq { tag, server, .. } => {
                // Bound too: a message published before the binding is made is dropped.
                let (status, body) = management_at(
                    &server.management_url(),
                    "GET",
                    &format!("/api/queues/%2f/{tag}/bindings"),
                    "",
                );
                status == 200 && body.contains("amq.topic")
            }
            Target::Sqs { client, prefix, .. } => {
                crate::sqs::url(client, &format!("{prefix}orders"))
                    .await
                    .is_some()
            }
        }
    }

    /// What the campaign made on the broker beside the Subscription's own objects, removed
    /// (on the cluster, once every server is back and healthy).
    pub(super) async fn remove(self) {
        match self {
            Target::Nats(stream, _server) => stream.delete().await,
            Target::NatsCluster(stream, cluster) => {
                cluster.wait_healthy().await;
                stream.delete().await;
            }
            Target::Rabbitmq { .. } | Target::Sqs { .. } => {}
        }
    }
}

/// The name of every queue of vhost `/` on the node whose management API is `management`, or
/// what it answered instead.
pub(super) fn queue_names(management: &str) -> Result<Vec<String>, String> {
    let (status, body) = management_at(management, "GET", "/api/queues/%2f?columns=name", "");
    if status != 200 {
        return Err(format!("{status} {body}"));
    }
    Ok(serde_json::from_str::<Vec<serde_json::Value>>(&body)
        .unwrap_or_default()
        .iter()
        .filter_map(|q| q["name"].as_str().map(str::to_string))
        .collect())
}

/// A connection to RabbitMQ at `url`.
pub(super) async fn amqp_connect(url: &str) -> lapin::Connection {
    lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("connect to RabbitMQ at {url}: {e}"))
}

/// Whether SQS queue `url` holds a message (visible or not).
async fn holds_messages(client: &aws_sdk_sqs::Client, url: &str) -> bool {
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let Ok(out) = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(A::ApproximateNumberOfMessages)
        .attribute_names(A::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
    else {
        return false;
    };
    out.attributes()
        .into_iter()
        .flatten()
        .any(|(_, v)| v.parse::<u64>().is_ok_and(|n| n > 0))
}
