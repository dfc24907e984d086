//! The tenant attack matrix on SQS (ElasticMQ): tenants apart by queue prefix, as
//! `docs/guide/multi-tenant.md` says. ElasticMQ enforces no IAM, so the attacks IAM refuses on
//! AWS (reading, settling, forging into, emptying or filling another prefix's queues) cannot be
//! tried here; what the operator decides can: B, in a namespace of its own, writes a Backend on
//! A's queue prefix (nothing stops a tenant from naming it) and a Subscription of A's name, then
//! asks it to adopt A's object. A's application runs throughout; A's next message must count
//! exactly one more, nothing ever stepped down.

use settle_testkit as common;

use std::time::Duration;

use common::account::{App, watch};
use common::operator::Operator;
use common::sqs::{SQS_OPERATOR_FLAGS, client, sqs_backend, tags, url};
use common::subs::{apply, backends, subs, wait_backend, wait_condition, wait_ready};
use common::{install_crds, kubectl_ok, namespace};

use super::matrix::{self, Column};
use super::tenants::{nacked, settled};

const SPEC: &str = "  mode: AtLeastOnce\n  maxDeliver: 3\n  ackWait: 2s\n";

/// Subscription `orders` in `ns`, with annotations `annotations` and more of its spec.
fn orders(ns: &str, annotations: &str, more: &str) -> String {
    format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {ns}{annotations}}}\nspec:\n  backendRef: {{name: sqs}}\n  pattern: orders\n  durableName: orders\n{SPEC}{more}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_sqs_b_cannot_take_a_queue_under_as_prefix() {
    install_crds();
    let test = "matrix-sqs";
    let pid = std::process::id();
    let env = common::env();
    let (a, b) = (namespace("matrix-sqs-a"), namespace("matrix-sqs-b"));
    let op = Operator::start_with(test, &format!("{a},{b}"), &SQS_OPERATOR_FLAGS);
    let prefix = format!("matrixsqs{pid}-");
    sqs_backend(&a, &prefix);
    wait_backend(&backends(&a).await, "sqs", "True", "PlaintextCredentials").await;
    let text = orders(&a, "", "");
    apply(&a, &text);
    let api = subs(&a).await;
    let a_uid = wait_ready(&api, "orders")
        .await
        .metadata
        .uid
        .unwrap_or_default();
    let manifest = common::root().join(format!("target/account-{test}-{pid}.yaml"));
    std::fs::write(&manifest, &text).expect("manifest");
    let app = App::start(
        &[
            ("SETTLE_SQS_ENDPOINT", env.sqs_endpoint.as_str()),
            ("SETTLE_SQS_QUEUE_PREFIX", prefix.as_str()),
        ],
        &manifest,
        "nack",
    );
    app.wait_ready().await;
    let sqs = client().await;
    let queue = format!("{prefix}orders");
    let queue_url = url(&sqs, &queue).await.expect("A's queue");
    let send = |body: &str| {
        sqs.send_message()
            .queue_url(&queue_url)
            .message_body(body)
            .send()
    };
    for body in ["1", "2"] {
        send(body).await.expect("send");
    }
    let before = settled(&api, "A's two messages exhausted", nacked(2)).await;
    let (seen, watcher) = watch(&api, "orders");
    let a_tags = tags(&sqs, &queue).await;
    assert_eq!(a_tags.get("settle-object"), Some(&a_uid), "{a_tags:?}");

    let mut column = Column::new("SQS, a queue prefix per tenant");
    // Squat: B's Backend on A's queue prefix, B's Subscription of A's name: A's very queue.
    sqs_backend(&b, &prefix);
    wait_backend(&backends(&b).await, "sqs", "True", "PlaintextCredentials").await;
    apply(&b, &orders(&b, "", ""));
    let b_api = subs(&b).await;
    wait_condition(
        &b_api,
        "orders",
        "Ready",
        "False",
        "ConsumerConflict",
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        tags(&sqs, &queue).await,
        a_tags,
        "B's Subscription marked A's queue"
    );
    column.refused(
        matrix::SQUAT,
        "by the operator (the queue's owner tags name A's Subscription: B's is `ConsumerConflict`; the queue untouched, and left to A when B's Subscription is deleted)",
    );
    // Adopt: the annotation naming A's object, and `adopt: IfCompatible`.
    apply(
        &b,
        &orders(
            &b,
            &format!(", annotations: {{settle.dev/adopt: \"{a_uid}\"}}"),
            "  adopt: IfCompatible\n",
        ),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    wait_condition(
        &b_api,
        "orders",
        "Ready",
        "False",
        "ConsumerConflict",
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        tags(&sqs, &queue).await,
        a_tags,
        "B's adoption took A's queue"
    );
    column.refused(
        matrix::ADOPT,
        "by the operator (adoption takes an earlier object's queue of the same namespace and name only: B's stays `ConsumerConflict`)",
    );

    // B's Subscription deleted (`deletionPolicy: Delete`): A's queue is not B's to delete.
    kubectl_ok(
        &[
            "delete",
            "subscription",
            "orders",
            "-n",
            &b,
            "--timeout=60s",
        ],
        None,
    );
    assert_eq!(
        tags(&sqs, &queue).await,
        a_tags,
        "B's deletion touched A's queue"
    );

    send("3").await.expect("send");
    matrix::a_counts_its_next_message(&api, &before).await;
    common::account::assert_never_decreased(&seen);
    column.finish();

    watcher.abort();
    drop(app);
    let _ = std::fs::remove_file(&manifest);
    for ns in [&a, &b] {
        kubectl_ok(&["delete", "namespace", ns, "--wait=false"], None);
    }
    drop(op);
}
