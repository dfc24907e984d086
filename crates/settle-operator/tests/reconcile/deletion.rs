//! Deletion in the order a namespace deletion can take, one scene run on every broker: the
//! Backend's Secret deleted first (where it has one), then the Backend, then its Subscriptions.
//! The Backend stays (its finalizer) while they still have consumers to delete, keeping the
//! connection it made before its Secret went; the `Delete` Subscription's consumer or queue is
//! deleted, the `Retain` one's kept, and then the Backend goes (on NATS, with the account's
//! reader of the capture that was its; on RabbitMQ, with its copy of the dead-letter exchange).
//!
//! And the same deletion found by an operator that takes over before it can list one of the
//! two kinds: neither the Subscription nor the Backend goes until it can, and then the consumer
//! or queue is deleted on the broker, not left there.

use settle_testkit as common;

use std::time::Duration;

use common::operator::{Operator, TestStream, poll};
use common::subs::{apply, backend_yaml, backends, sub_yaml_on, subs, wait_gone, wait_ready};
use common::{install_crds, kubectl_ok, namespace};
use kube::api::DeleteParams;

/// One broker of the scene: its Backend (named `b`), a Subscription spec, and a look at the
/// broker object the operator made. (One per test: the size of a variant does not matter.)
#[allow(clippy::large_enum_variant)]
enum Broker {
    Nats(TestStream),
    Rabbitmq(String),
    Sqs(String),
}

impl Broker {
    /// The broker of `kind`, its names tagged with `scene` (short, unique among the scenes).
    async fn new(kind: &str, scene: &str) -> Broker {
        let env = common::env();
        let tag = format!("{scene}{}", std::process::id());
        match kind {
            "nats" => Broker::Nats(TestStream::new(&env.nats_url, "deletion").await),
            "rabbitmq" => Broker::Rabbitmq(tag),
            _ => Broker::Sqs(format!("{tag}-")),
        }
    }

    /// Applies Backend `b` in `ns` (with its Secret where the kind has one); the Secret's name.
    fn backend(&self, ns: &str) -> Option<&'static str> {
        let env = common::env();
        match self {
            Broker::Nats(_) => {
                apply(ns, &backend_yaml("b", &env.nats_url));
                None
            }
            Broker::Rabbitmq(tag) => {
                // With a dead-letter exchange: the operator keeps a copy queue for the Backend.
                let dlx = format!("{tag}.dead");
                let (status, text) = common::rabbitmq::management_with(
                    "PUT",
                    &format!("/api/exchanges/%2f/{dlx}"),
                    r#"{"type":"topic","durable":true}"#,
                );
                assert!(matches!(status, 201 | 204), "{status} {text}");
                apply(
                    ns,
                    &common::rabbitmq::env_backend_yaml(
                        "b",
                        &format!("    deadLetterExchange: {dlx}\n"),
                    ),
                );
                None
            }
            Broker::Sqs(prefix) => {
                common::sqs::sqs_backend_named(ns, "b", prefix);
                Some("aws")
            }
        }
    }

    fn spec(&self, durable: &str, retain: bool) -> String {
        let pattern = match self {
            Broker::Nats(s) => format!("{}.{durable}.>", s.prefix),
            Broker::Rabbitmq(tag) => format!("{tag}.{durable}.>"),
            Broker::Sqs(_) => durable.to_string(),
        };
        let durable = match self {
            Broker::Rabbitmq(tag) => format!("{tag}-{durable}"),
            _ => durable.to_string(),
        };
        format!(
            "  pattern: \"{pattern}\"\n  mode: AtLeastOnce\n  durableName: {durable}\n{}",
            if retain {
                "  deletionPolicy: Retain\n"
            } else {
                ""
            }
        )
    }

    /// Whether the broker holds the object the Subscription's status named.
    async fn holds(&self, name: &str) -> bool {
        match self {
            Broker::Nats(s) => s.consumer(name).await.is_some(),
            Broker::Rabbitmq(_) => common::rabbitmq::queue(name).is_some(),
            Broker::Sqs(_) => common::sqs::url(&common::sqs::client().await, name)
                .await
                .is_some(),
        }
    }

    /// On NATS, whether the account's reader of the capture for Backend `b` of `ns` exists
    /// (other brokers have none).
    async fn reader(&self, ns: &str) -> Option<bool> {
        let Broker::Nats(s) = self else {
            return None;
        };
        let capture =
            s.js.get_stream(settle::backend::nats::capture::CAPTURE_STREAM)
                .await
                .ok()?;
        let name = format!("settle-account_{ns}_b");
        Some(capture.consumer_info(&name).await.is_ok())
    }

    /// On RabbitMQ, whether Backend `b` of `ns`'s copy of its dead-letter exchange exists (other
    /// brokers have none).
    fn copy_queue(&self, ns: &str) -> Option<bool> {
        let Broker::Rabbitmq(_) = self else {
            return None;
        };
        let name = settle::backend::rabbitmq::dead_letters::copy_queue(ns, "b");
        Some(common::rabbitmq::queue(&name).is_some())
    }

    /// Removes what the scene left on purpose (the retained object).
    async fn clear(self, name: &str) {
        match self {
            Broker::Nats(s) => s.delete().await,
            Broker::Rabbitmq(tag) => {
                let _ = common::rabbitmq::management("DELETE", &format!("/api/queues/%2f/{name}"));
                let _ = common::rabbitmq::management(
                    "DELETE",
                    &format!("/api/exchanges/%2f/{tag}.dead"),
                );
            }
            Broker::Sqs(_) => {
                let c = common::sqs::client().await;
                if let Some(u) = common::sqs::url(&c, name).await {
                    let _ = c.delete_queue().queue_url(u).send().await;
                }
            }
        }
    }
}

async fn secret_then_backend_then_subscriptions(kind: &str) {
    install_crds();
    let ns = namespace(&format!("rec-deletion-{kind}"));
    let broker = Broker::new(kind, "del").await;
    let _op = Operator::start(&format!("deletion-{kind}"), &ns);
    let secret = broker.backend(&ns);
    let api = subs(&ns).await;
    apply(&ns, &sub_yaml_on("b", "gone", &broker.spec("gone", false)));
    apply(&ns, &sub_yaml_on("b", "kept", &broker.spec("kept", true)));
    let mut made = Vec::new();
    for name in ["gone", "kept"] {
        let s = wait_ready(&api, name).await;
        let c = s.status.and_then(|s| s.consumer).expect("status names it");
        assert!(broker.holds(&c.name).await, "{kind}: {c:?} made");
        made.push(c.name);
    }

    if broker.reader(&ns).await.is_some() {
        poll(
            "the account's reader of the capture",
            Duration::from_secs(30),
            || async {
                match broker.reader(&ns).await {
                    Some(true) => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            },
        )
        .await;
    }

    if broker.copy_queue(&ns).is_some() {
        poll(
            "the Backend's dead-letter copy queue",
            Duration::from_secs(30),
            || async {
                match broker.copy_queue(&ns) {
                    Some(true) => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            },
        )
        .await;
    }

    if let Some(secret) = secret {
        kubectl_ok(&["delete", "secret", secret, "-n", &ns], None);
    }
    let b_api = backends(&ns).await;
    b_api
        .delete("b", &DeleteParams::default())
        .await
        .expect("delete the Backend");
    // Past two of its checks (every 2 s), it is still there, deleting.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let b = b_api.get("b").await.expect("the Backend stays");
    assert!(b.metadata.deletion_timestamp.is_some());

    for name in ["gone", "kept"] {
        api.delete(name, &DeleteParams::default())
            .await
            .expect("delete");
    }
    for name in ["gone", "kept"] {
        wait_gone(&api, name, Duration::from_secs(60)).await;
    }
    assert!(
        !broker.holds(&made[0]).await,
        "{kind}: the Delete Subscription's {} is deleted",
        made[0]
    );
    assert!(
        broker.holds(&made[1]).await,
        "{kind}: the Retain Subscription's {} is kept",
        made[1]
    );
    poll(
        "the Backend to be gone once no Subscription needs it",
        Duration::from_secs(30),
        || async {
            match b_api.get_opt("b").await {
                Ok(None) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert_eq!(
        broker.copy_queue(&ns),
        broker.copy_queue(&ns).map(|_| false),
        "{kind}: the gone Backend's dead-letter copy queue is deleted"
    );
    if broker.reader(&ns).await.is_some() {
        poll(
            "the gone Backend's reader of the capture to be deleted",
            Duration::from_secs(30),
            || async {
                match broker.reader(&ns).await {
                    Some(false) => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            },
        )
        .await;
    }
    broker.clear(&made[1]).await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_secret_then_backend_then_subscriptions_deletes_what_delete_asks() {
    secret_then_backend_then_subscriptions("nats").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_secret_then_backend_then_subscriptions_deletes_what_delete_asks() {
    secret_then_backend_then_subscriptions("rabbitmq").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_secret_then_backend_then_subscriptions_deletes_what_delete_asks() {
    secret_then_backend_then_subscriptions("sqs").await;
}

/// The rules an operator taking over is granted: what it needs, with `kinds` of Settle's
/// (`backends`, `subscriptions`) only.
fn taker_role(name: &str, kinds: &[&str]) -> String {
    let settle: Vec<String> = kinds
        .iter()
        .flat_map(|k| [format!("\"{k}\""), format!("\"{k}/status\"")])
        .collect();
    format!(
        "apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: {name}}}
rules:
  - {{apiGroups: [\"messaging.settle.dev\"], resources: [{}], verbs: [get, list, watch, patch]}}
  - {{apiGroups: [\"\", coordination.k8s.io, events.k8s.io], resources: [\"*\"], verbs: [\"*\"]}}
  - {{apiGroups: [authentication.k8s.io, authorization.k8s.io], resources: [\"*\"], verbs: [create]}}
",
        settle.join(", ")
    )
}

/// A Subscription and its Backend deleted while no operator runs (as `kubectl delete
/// namespace` does), found by an operator that takes over and may list only `first` of the two
/// kinds for a while (RBAC: the other granted later). Until it can list both, the Subscription
/// keeps its finalizer and its consumer or queue, the Backend its finalizer; then the consumer
/// or queue is deleted on the broker and both objects go. Reconciled with one cache empty, the
/// deletion would go as if the Backend were gone (or no Subscription needed it) and leave the
/// consumer on the broker.
async fn deleted_while_no_operator_ran_waits_for_both_caches(kind: &str, first: &str) {
    install_crds();
    let ns = namespace(&format!("rec-takeover-{kind}-{first}"));
    let broker = Broker::new(kind, &format!("tk{}", &first[..1])).await;
    let mut op = Operator::start(&format!("takeover-{kind}-{first}"), &ns);
    broker.backend(&ns);
    let api = subs(&ns).await;
    apply(&ns, &sub_yaml_on("b", "gone", &broker.spec("gone", false)));
    let s = wait_ready(&api, "gone").await;
    let made = s
        .status
        .and_then(|s| s.consumer)
        .expect("status names it")
        .name;
    assert!(broker.holds(&made).await, "{kind}: {made} made");
    op.kill9();

    let b_api = backends(&ns).await;
    api.delete("gone", &DeleteParams::default())
        .await
        .expect("delete the Subscription");
    b_api
        .delete("b", &DeleteParams::default())
        .await
        .expect("delete the Backend");
    let role = ns.clone();
    let user = format!("system:serviceaccount:{ns}:taker");
    kubectl_ok(&["apply", "-f", "-"], Some(&taker_role(&role, &[first])));
    kubectl_ok(
        &[
            "create",
            "clusterrolebinding",
            &role,
            &format!("--clusterrole={role}"),
            &format!("--serviceaccount={ns}:taker"),
        ],
        None,
    );
    let kubeconfig = common::kubeconfig_as(&user, &ns);
    let kubeconfig = kubeconfig.to_string_lossy();
    let mut taker = Operator::spawn_env(
        &format!("takeover-{kind}-{first}-taker"),
        &ns,
        &["--leader-election=false"],
        &[("KUBECONFIG", &kubeconfig)],
    );
    // Past several reconciles of what it can list, both still wait.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(taker.alive(), "{kind}: the operator taking over runs");
    let sub = api.get_opt("gone").await.expect("read the Subscription");
    assert!(
        sub.is_some(),
        "{kind}, listing {first} only: the deleted Subscription keeps its finalizer"
    );
    let b = b_api.get_opt("b").await.expect("read the Backend");
    assert!(
        b.is_some(),
        "{kind}, listing {first} only: the deleted Backend keeps its finalizer"
    );
    assert!(
        broker.holds(&made).await,
        "{kind}, listing {first} only: {made} stays until the deletion can be done"
    );

    kubectl_ok(
        &["apply", "-f", "-"],
        Some(&taker_role(&role, &["backends", "subscriptions"])),
    );
    wait_gone(&api, "gone", Duration::from_secs(90)).await;
    assert!(
        !broker.holds(&made).await,
        "{kind}: the deleted Subscription's {made} is deleted on the broker"
    );
    poll(
        "the Backend to be gone once no Subscription needs it",
        Duration::from_secs(60),
        || async {
            match b_api.get_opt("b").await {
                Ok(None) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    taker.kill9();
    kubectl_ok(&["delete", "clusterrolebinding,clusterrole", &role], None);
    broker.clear(&made).await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_deleted_while_no_operator_ran_waits_for_the_backends_cache() {
    deleted_while_no_operator_ran_waits_for_both_caches("nats", "subscriptions").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_deleted_while_no_operator_ran_waits_for_the_backends_cache() {
    deleted_while_no_operator_ran_waits_for_both_caches("rabbitmq", "subscriptions").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_deleted_while_no_operator_ran_waits_for_the_backends_cache() {
    deleted_while_no_operator_ran_waits_for_both_caches("sqs", "subscriptions").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_deleted_while_no_operator_ran_waits_for_the_subscriptions_cache() {
    deleted_while_no_operator_ran_waits_for_both_caches("nats", "backends").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_deleted_while_no_operator_ran_waits_for_the_subscriptions_cache() {
    deleted_while_no_operator_ran_waits_for_both_caches("rabbitmq", "backends").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_deleted_while_no_operator_ran_waits_for_the_subscriptions_cache() {
    deleted_while_no_operator_ran_waits_for_both_caches("sqs", "backends").await;
}
