//! The operator's AMQP connection to a real RabbitMQ: without the management API, queues are still
//! made and made again (a missing queue's refused passive declare is no dropped connection), and a
//! connection the broker closes is made again and used; a connection cut moments after it opens,
//! again and again, is made again later and later (not many times a second), the Backend saying
//! why meanwhile, and once one is kept, the Backend is Connected again.

use std::time::{Duration, Instant};

use super::rabbitmq::{delete_queue, wait_queue};
use settle_testkit as common;

use common::operator::{Operator, condition, poll};
use common::partition::Partition;
use common::rabbitmq::{bindings, management, queue};
use common::subs::{apply, backends, sub_yaml_on, subs, wait_backend, wait_event, wait_ready};
use common::{install_crds, kubectl_ok, namespace};
use serde_json::Value;
use settle::backend::rabbitmq::management::segment;

/// The broker's names of the AMQP connections operator `pid` holds.
fn connections_of(pid: u32) -> Vec<String> {
    let (status, body) = management("GET", "/api/connections");
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    v.as_array()
        .expect("a list")
        .iter()
        .filter(|c| {
            c["client_properties"]["connection_name"]
                .as_str()
                .is_some_and(|n| n.ends_with(&format!("-{pid}")))
        })
        .filter_map(|c| c["name"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_management_api_queues_are_still_made_and_a_closed_connection_is_made_again() {
    install_crds();
    let ns = namespace("rec-rabbit-amqp");
    let env = common::env();
    let op = Operator::start_with(
        "rabbitmq-amqp",
        &ns,
        &["--leader-election=false", "--drift-interval", "1s"],
    );
    let tag = format!("am{}", std::process::id());
    apply(
        &ns,
        &format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: plain}}\nspec:\n  rabbitmq:\n    urls: [\"{}\"]\n",
            env.rabbitmq_url
        ),
    );
    let b = wait_backend(&backends(&ns).await, "plain", "True", "Connected").await;
    let st = b.status.expect("status");
    assert_eq!(st.server_version, None, "AMQP does not show the version");
    let (_, _, m) = condition(&st.conditions, "Ready").expect("Ready");
    assert!(m.contains("managementUrl"), "{m}");

    let durable = format!("{tag}-plain");
    apply(
        &ns,
        &sub_yaml_on(
            "plain",
            "plain",
            &format!(
                "  pattern: \"{tag}.plain.>\"\n  mode: AtLeastOnce\n  durableName: {durable}\n  maxDeliver: 4\n"
            ),
        ),
    );
    let api = subs(&ns).await;
    wait_ready(&api, "plain").await;
    let q = queue(&durable).expect("made");
    assert_eq!(q["arguments"]["x-delivery-limit"], 3);
    assert_eq!(
        bindings(&durable),
        vec![("amq.topic".to_string(), format!("{tag}.plain.#"))]
    );

    // Deleted on the broker: made again (found missing by a passive declare, whose refusal
    // closes its channel: that is not a dropped connection).
    delete_queue(&durable);
    wait_queue(&durable, "the queue to be made again", |q| q.is_some()).await;
    wait_event(&ns, "plain", "Recreated").await;
    let disconnects =
        |op: &Operator| op.metric("settle_drift_triggers_total", &[("source", "disconnect")]);
    assert_eq!(disconnects(&op), 0.0, "a closed channel is no disconnect");

    // The broker closes the operator's connection: it is made again, and used.
    let pid = op.pid();
    let before = poll(
        "the operator's AMQP connection",
        Duration::from_secs(30),
        || async {
            let c = connections_of(pid);
            if c.is_empty() {
                Err("none".to_string())
            } else {
                Ok(c)
            }
        },
    )
    .await;
    for name in &before {
        let (status, body) = management("DELETE", &format!("/api/connections/{}", segment(name)));
        assert_eq!(status, 204, "close {name}: {body}");
    }
    poll(
        "the drop to be noticed",
        Duration::from_secs(30),
        || async {
            let n = disconnects(&op);
            if n >= 1.0 {
                Ok(())
            } else {
                Err(format!("{n}"))
            }
        },
    )
    .await;
    poll("a new AMQP connection", Duration::from_secs(30), || async {
        let now = connections_of(pid);
        if now.iter().any(|c| !before.contains(c)) {
            Ok(())
        } else {
            Err(format!("{now:?}"))
        }
    })
    .await;
    delete_queue(&durable);
    // (Kubernetes folds a repeated Event into one, so the operations are counted instead.)
    let recreated =
        |op: &Operator| op.metric("settle_consumer_operations_total", &[("op", "recreate")]);
    let made_before = recreated(&op);
    delete_queue(&durable);
    poll(
        "the queue made again over the new connection",
        Duration::from_secs(30),
        || async {
            let n = recreated(&op);
            if n > made_before && queue(&durable).is_some() {
                Ok(())
            } else {
                Err(format!("{n} recreated"))
            }
        },
    )
    .await;

    // Deletion removes the queue its status names.
    kubectl_ok(&["delete", "subscriptions", "--all", "-n", &ns], None);
    assert!(queue(&durable).is_none(), "deleted with its Subscription");
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

/// How long every connection the operator makes is cut a moment after it opens.
const CUTTING: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_connection_cut_again_and_again_is_made_again_at_a_slowing_pace() {
    install_crds();
    let ns = namespace("rec-rabbit-redial");
    let env = common::env();
    // The operator reaches the broker through a forwarder that counts its connections and can
    // cut each one a moment after it opens.
    let url = env.rabbitmq_url.clone();
    let (rest, _) = url
        .rsplit_once('/')
        .expect("amqp://user:pass@host:port/vhost");
    let (_, upstream) = rest.rsplit_once('@').expect("credentials in the URL");
    let cutter = Partition::to(upstream.parse().expect("host:port")).await;
    let through = url.replace(upstream, &format!("127.0.0.1:{}", cutter.port));
    let _op = Operator::start("rabbitmq-redial", &ns);
    apply(
        &ns,
        &format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: plain}}\nspec:\n  rabbitmq:\n    urls: [\"{through}\"]\n"
        ),
    );
    let api = backends(&ns).await;
    wait_backend(&api, "plain", "True", "Connected").await;

    // Every connection is cut 200 ms after it opens. Made again at once each time, that is
    // some forty in ten seconds; paced (at once twice, then 0.5, 1, 2, 4 s after each drop),
    // about seven.
    let before = cutter.accepted();
    cutter.cut_after(Some(Duration::from_millis(200)));
    let cutting = Instant::now();
    let mut said = None;
    while cutting.elapsed() < CUTTING {
        if said.is_none() {
            let b = api.get("plain").await.expect("get the Backend");
            if let Some((st, reason, m)) = b
                .status
                .as_ref()
                .and_then(|s| condition(&s.conditions, "Ready"))
                && m.contains("within seconds of their making")
            {
                said = Some((st, reason, m));
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let made = cutter.accepted() - before;
    assert!(
        (3..=10).contains(&made),
        "{made} connections made in {CUTTING:?} of cutting each 200 ms after it opened"
    );
    let (st, reason, m) = said.expect("the Backend said why it waits");
    assert_eq!(
        (st.as_str(), reason.as_str()),
        ("False", "Unreachable"),
        "{m}"
    );
    assert!(m.contains("the broker's log says why"), "{m}");

    // Left alone, the next one is made once its pause is over, and kept.
    cutter.cut_after(None);
    wait_backend(&api, "plain", "True", "Connected").await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

/// Two namespaces' Backends on one vhost: the newer is refused (`Ready=False SharedVhost`, not
/// connected, no Subscription of it made) until both consent (`spec.rabbitmq.sharedVhost`);
/// one side's consent is not enough. With both, each is Ready and says what a shared vhost
/// leaves unprotected, and the newer one's Subscription gets its queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vhost_another_namespace_uses_is_refused_to_the_newer_backend_until_both_consent() {
    install_crds();
    let (a, b) = (
        namespace("rec-rabbit-share-a"),
        namespace("rec-rabbit-share-b"),
    );
    let vhost =
        common::rabbitmq::LimitedVhost::create(&format!("settle-share-{}", std::process::id()));
    let op = Operator::start_with(
        "rec-rabbit-share",
        &format!("{a},{b}"),
        &["--leader-election=false"],
    );
    let backend = |consent: bool| {
        common::rabbitmq::env_backend_yaml(
            "rabbit",
            &format!(
                "    vhost: {}\n{}",
                vhost.0,
                if consent {
                    "    sharedVhost: true\n"
                } else {
                    ""
                }
            ),
        )
    };
    apply(&a, &backend(false));
    wait_backend(&backends(&a).await, "rabbit", "True", "Connected").await;
    apply(&b, &backend(false));
    let b_backends = backends(&b).await;
    let refused = wait_backend(&b_backends, "rabbit", "False", "SharedVhost").await;
    let said = condition(&refused.status.expect("status").conditions, "Ready")
        .map(|(_, _, m)| m)
        .unwrap_or_default();
    assert!(said.contains("ask that namespace to set it"), "{said}");
    apply(
        &b,
        &sub_yaml_on(
            "rabbit",
            "orders",
            "  pattern: shared.>\n  mode: AtLeastOnce\n  durableName: shared-orders\n  maxDeliver: 3\n",
        ),
    );
    // One side's consent is not enough.
    apply(&b, &backend(true));
    tokio::time::sleep(Duration::from_secs(3)).await;
    wait_backend(&b_backends, "rabbit", "False", "SharedVhost").await;
    assert_eq!(
        vhost.queues(),
        0,
        "a refused Backend made queues on the vhost"
    );
    // Both: each Ready, saying what is not protected.
    apply(&a, &backend(true));
    for (ns, api) in [(&a, backends(&a).await), (&b, b_backends.clone())] {
        let ok = wait_backend(&api, "rabbit", "True", "SharedVhost").await;
        let said = condition(&ok.status.expect("status").conditions, "Ready")
            .map(|(_, _, m)| m)
            .unwrap_or_default();
        assert!(
            said.contains("connected")
                && said.contains("ledger, object-mark and adopted-mark queues"),
            "{ns}: {said}"
        );
    }
    wait_ready(&subs(&b).await, "orders").await;
    for ns in [&a, &b] {
        kubectl_ok(&["delete", "namespace", ns, "--wait=false"], None);
    }
    drop(op);
}
