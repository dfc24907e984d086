//! SQS as the tests reach it, and the account's SQS scene. Reached with the AWS SDK on the
//! environment's ElasticMQ, not through Settle's controllers: a broker or client, a queue's URL,
//! attributes, depth and messages, and an SQS Backend (its credentials in a labelled Secret)
//! with a queue prefix of the test's own. The scene: a namespace, that Backend, the operator, a
//! Subscription `orders` (its manifest on disk for the application), the application on the
//! `settle` library (`examples/account_app.rs`) on SQS, messages sent straight to the queue with
//! the AWS SDK, and the never-decreasing watcher of `tests/common/account.rs`.

use std::collections::BTreeMap;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::QueueAttributeName;
use settle::backend::sqs::{SqsBroker, SqsCredentials, SqsSettings};

use super::account::{AccountScene, App, Base};
use super::operator::Operator;
use super::subs::{apply, backends, wait_backend};
use super::{install_crds, kubectl_ok, namespace};

/// A broker on the environment's ElasticMQ, with queue prefix `prefix`.
pub async fn broker(prefix: &str) -> SqsBroker {
    let endpoint = super::env().sqs_endpoint;
    SqsBroker::connect(SqsSettings {
        region: Some("elasticmq".into()),
        endpoint: Some(endpoint.clone()),
        credentials: SqsCredentials::Static {
            access_key_id: "test".into(),
            secret_access_key: "test".into(),
        },
        queue_prefix: prefix.to_string(),
    })
    .await
    .unwrap_or_else(|e| panic!("an SQS client on ElasticMQ at {endpoint}: {e}"))
}

/// An SQS client on the environment's ElasticMQ.
pub async fn client() -> Client {
    broker("").await.client().clone()
}

/// Backend `sqs` in `ns` on the environment's ElasticMQ with queue prefix `prefix`, its
/// credentials in Secret `aws` (made here, labelled for Backends). Does not wait for it.
pub fn sqs_backend(ns: &str, prefix: &str) {
    sqs_backend_named(ns, "sqs", prefix);
}

/// [`sqs_backend`], the Backend named `name`.
pub fn sqs_backend_named(ns: &str, name: &str, prefix: &str) {
    sqs_backend_at(ns, name, prefix, &super::env().sqs_endpoint);
}

/// [`sqs_backend_named`] on the SQS endpoint `endpoint` (a forwarder to ElasticMQ, say).
pub fn sqs_backend_at(ns: &str, name: &str, prefix: &str, endpoint: &str) {
    aws_secret(ns);
    apply(
        ns,
        &format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: {name}}}\nspec:\n  sqs:\n    region: elasticmq\n    endpoint: \"{endpoint}\"\n    queuePrefix: \"{prefix}\"\n    credentialsSecretRef: {{name: aws}}\n"
        ),
    );
}

/// Secret `aws` in `ns`, labelled for Backends: ElasticMQ's test credentials.
fn aws_secret(ns: &str) {
    kubectl_ok(
        &[
            "create",
            "secret",
            "generic",
            "aws",
            "-n",
            ns,
            "--from-literal=accessKeyId=test",
            "--from-literal=secretAccessKey=test",
        ],
        None,
    );
    super::label_backend_secret(ns, "aws");
}

/// The tags of queue `name` (its owner marks among them); the queue must exist.
pub async fn tags(c: &Client, name: &str) -> BTreeMap<String, String> {
    let u = url(c, name).await.expect("the queue exists");
    c.list_queue_tags()
        .queue_url(u)
        .send()
        .await
        .expect("tags")
        .tags
        .unwrap_or_default()
        .into_iter()
        .collect()
}

/// The URL of queue `name`, if it exists.
pub async fn url(c: &Client, name: &str) -> Option<String> {
    c.get_queue_url()
        .queue_name(name)
        .send()
        .await
        .ok()
        .and_then(|o| o.queue_url)
}

/// Queue `name`'s attributes by name, `None` when it does not exist.
pub async fn attributes_of(c: &Client, name: &str) -> Option<BTreeMap<String, String>> {
    let u = url(c, name).await?;
    let a = c
        .get_queue_attributes()
        .queue_url(u)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .expect("attributes")
        .attributes
        .unwrap_or_default();
    Some(
        a.into_iter()
            .map(|(k, v)| (k.as_str().to_string(), v))
            .collect(),
    )
}

/// Queue `name`'s attributes by name; the queue must exist.
pub async fn attributes(c: &Client, name: &str) -> BTreeMap<String, String> {
    attributes_of(c, name)
        .await
        .unwrap_or_else(|| panic!("queue {name} exists"))
}

/// Queue `name`'s messages, visible and in flight (0 when it does not exist).
pub async fn depth(c: &Client, name: &str) -> u64 {
    let Some(a) = attributes_of(c, name).await else {
        return 0;
    };
    let n = |k: QueueAttributeName| {
        a.get(k.as_str())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    n(QueueAttributeName::ApproximateNumberOfMessages)
        + n(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
}

/// Every message of queue `name` (ids), looked at with a short visibility timeout and made
/// visible again: what the user sees there.
pub async fn message_ids(c: &Client, name: &str) -> Vec<String> {
    let Some(u) = url(c, name).await else {
        return Vec::new();
    };
    let mut ids = Vec::new();
    let mut receipts = Vec::new();
    for _ in 0..20 {
        let got = c
            .receive_message()
            .queue_url(&u)
            .max_number_of_messages(10)
            .visibility_timeout(5)
            .send()
            .await
            .expect("receive");
        let m = got.messages.unwrap_or_default();
        if m.is_empty() {
            break;
        }
        for m in m {
            ids.extend(m.message_id);
            receipts.extend(m.receipt_handle);
        }
    }
    for r in receipts {
        let _ = c
            .change_message_visibility()
            .queue_url(&u)
            .receipt_handle(r)
            .visibility_timeout(0)
            .send()
            .await;
    }
    ids.sort();
    ids.dedup();
    ids
}

/// The operator flags of the SQS scenes: no leader election, status written every second, and
/// queues deleted on the server made again within 10 s (long enough to see it said in status).
pub const SQS_OPERATOR_FLAGS: [&str; 5] = [
    "--leader-election=false",
    "--stats-interval",
    "1s",
    "--drift-interval",
    "10s",
];

/// An account scene on ElasticMQ: [`Base`] on a queue prefix of the test's own.
pub struct SqsScene {
    pub base: Base,
    pub prefix: String,
    pub sqs: Client,
    pub app_env: Vec<(String, String)>,
}

impl std::ops::Deref for SqsScene {
    type Target = Base;
    fn deref(&self) -> &Base {
        &self.base
    }
}

impl std::ops::DerefMut for SqsScene {
    fn deref_mut(&mut self) -> &mut Base {
        &mut self.base
    }
}

impl SqsScene {
    /// The scene with Subscription `orders` (`spec` after `backendRef`, pattern and
    /// durableName `orders`), and `app_env` for every application.
    pub async fn new(test: &str, spec: &str, app_env: &[(&str, &str)]) -> SqsScene {
        SqsScene::with_flags(test, spec, app_env, &SQS_OPERATOR_FLAGS).await
    }

    /// As [`SqsScene::new`], the operator running with `flags`.
    pub async fn with_flags(
        test: &str,
        spec: &str,
        app_env: &[(&str, &str)],
        flags: &[&'static str],
    ) -> SqsScene {
        install_crds();
        let ns = namespace(test);
        let env = super::env();
        let op = Operator::start_with(test, &ns, flags);
        let prefix = format!("{}{}-", test.replace('-', ""), std::process::id());
        sqs_backend(&ns, &prefix);
        wait_backend(&backends(&ns).await, "sqs", "True", "PlaintextCredentials").await;
        let manifest_text = format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {ns}}}\nspec:\n  backendRef: {{name: sqs}}\n  pattern: orders\n  durableName: orders\n{spec}"
        );
        let base = Base::subscribe(test, ns, op, flags, &manifest_text).await;
        let mut all = vec![
            ("SETTLE_SQS_ENDPOINT".to_string(), env.sqs_endpoint.clone()),
            ("SETTLE_SQS_QUEUE_PREFIX".to_string(), prefix.clone()),
        ];
        all.extend(app_env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        SqsScene {
            base,
            prefix,
            sqs: client().await,
            app_env: all,
        }
    }

    /// The Subscription's queue's full name.
    pub fn queue(&self) -> String {
        format!("{}orders", self.prefix)
    }

    pub fn app(&self, handler: &str) -> App {
        let env: Vec<(&str, &str)> = self
            .app_env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        App::start(&env, &self.manifest, handler)
    }

    /// Sends `bodies` to the Subscription's queue.
    pub async fn publish(&self, bodies: impl IntoIterator<Item = String>) {
        let u = url(&self.sqs, &self.queue())
            .await
            .expect("the Subscription's queue exists");
        for body in bodies {
            self.sqs
                .send_message()
                .queue_url(&u)
                .message_body(body)
                .send()
                .await
                .expect("send");
        }
    }

    pub async fn finish(self) {
        self.base.finish();
    }
}

impl AccountScene for SqsScene {
    fn app(&self, handler: &str) -> App {
        SqsScene::app(self, handler)
    }

    async fn replace_app(&self, app: App) -> App {
        let mut app = app;
        app.sigterm();
        assert!(app.wait_exit(Duration::from_secs(30)), "a graceful stop");
        // Its last long poll (1 s) has ended on the server before anything more is sent.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        SqsScene::app(self, "nack")
    }

    async fn publish(&self, bodies: Vec<String>) {
        SqsScene::publish(self, bodies).await;
    }
}
