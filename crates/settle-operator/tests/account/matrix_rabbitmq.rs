//! The tenant attack matrix on RabbitMQ, configured as `docs/guide/multi-tenant.md` leads: a
//! vhost per tenant, each tenant's applications a user of its own vhost only, each Backend
//! naming its tenant's vhost (`spec.rabbitmq.vhost`) and its reporting user (`reportUsers`).
//! Tenant A's application runs throughout; tenant B, with its own user, vhost and namespace,
//! tries the matrix's broker attacks (`matrix.rs`). Then A's next message must count exactly
//! one more, nothing ever stepped down.

use settle_testkit as common;

use std::time::Duration;

use common::account::{App, OPERATOR_FLAGS, watch};
use common::operator::Operator;
use common::rabbitmq::{
    LimitedVhost, User, env_backend_yaml, management_json, publish_topic, vhost_url,
};
use common::subs::{apply, subs, wait_condition, wait_ready};
use common::{install_crds, kubectl_ok, namespace};

use super::matrix::{self, Column};
use super::tenants::{nacked, settled};

/// A Subscription on Backend `rabbit` in `ns` with durable name `durable`, and more of its spec.
fn subscription(ns: &str, name: &str, pattern: &str, durable: &str, more: &str) -> String {
    format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  backendRef: {{name: rabbit}}\n  pattern: \"{pattern}\"\n  mode: AtLeastOnce\n  durableName: {durable}\n  maxDeliver: 3\n{more}"
    )
}

/// The Subscription queues of `vhost` (not Settle's own `settle.*`) whose name holds `tag`.
fn queues_in(vhost: &str, tag: &str) -> Vec<String> {
    let all = management_json("GET", &format!("/api/queues/{vhost}?columns=name"));
    let mut found: Vec<String> = all
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|q| q["name"].as_str())
        .filter(|name| name.contains(tag) && !name.starts_with("settle."))
        .map(str::to_string)
        .collect();
    found.sort();
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_rabbitmq_with_a_vhost_per_tenant_no_attack_of_b_reaches_a() {
    install_crds();
    let test = "matrix-rabbit";
    let pid = std::process::id();
    let env = common::env();
    let (a, b) = (namespace("matrix-rabbit-a"), namespace("matrix-rabbit-b"));
    let vhosts = [
        LimitedVhost::create(&format!("settle-matrix-a-{pid}")),
        LimitedVhost::create(&format!("settle-matrix-b-{pid}")),
    ];
    // Each tenant's applications: its own vhost, reports and its queues only (the guide's
    // patterns, on the tenant's vhost).
    let users: Vec<User> = [("a", &a), ("b", &b)]
        .iter()
        .zip(&vhosts)
        .map(|((t, ns), vhost)| {
            User::create_in(
                &vhost.0,
                &format!("settle-matrix-{t}-{pid}"),
                &format!("^settle\\.(report|instances)\\.{ns}\\..*$"),
                &format!("^(amq\\.default|amq\\.topic|settle\\.(report|instances)\\.{ns}\\..*)$"),
                &format!("^(mx.*|settle\\.(report|object)\\.{ns}\\..*)$"),
            )
        })
        .collect();
    let op = Operator::start_with(test, &format!("{a},{b}"), &OPERATOR_FLAGS);
    for ((ns, vhost), user) in [&a, &b].iter().zip(&vhosts).zip(&users) {
        apply(
            ns,
            &env_backend_yaml(
                "rabbit",
                &format!(
                    "    vhost: {}\n    reportUsers: [\"{}\"]\n",
                    vhost.0, user.name
                ),
            ),
        );
    }
    let tag = format!("mx{pid}");
    let text = subscription(&a, "orders", &format!("{tag}.>"), &tag, "");
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
        &[(
            "SETTLE_RABBITMQ_URL",
            users[0].url_on(&vhosts[0].0).as_str(),
        )],
        &manifest,
        "nack",
    );
    app.wait_ready().await;
    let guest = lapin::Connection::connect(
        &vhost_url(&env.rabbitmq_url, &vhosts[0].0),
        lapin::ConnectionProperties::default(),
    )
    .await
    .expect("connect to A's vhost");
    let publish = |n: usize| publish_topic(&guest, [(format!("{tag}.m{n}"), n.to_string())]);
    publish(1).await;
    publish(2).await;
    let before = settled(&api, "A's two messages exhausted", nacked(2)).await;
    let (seen, watcher) = watch(&api, "orders");
    let a_queue = queues_in(&vhosts[0].0, &tag);
    assert_eq!(a_queue, vec![tag.clone()], "A's queue");

    let mut column = Column::new("RabbitMQ, a vhost per tenant");
    // Read, settle, forge, hide, fill: each needs a connection to A's vhost, which B's user
    // cannot open; its own vhost holds nothing of A's.
    let refused = lapin::Connection::connect(
        &users[1].url_on(&vhosts[0].0),
        lapin::ConnectionProperties::default(),
    )
    .await;
    let err = refused
        .err()
        .unwrap_or_else(|| panic!("B's user connected to A's vhost"))
        .to_string();
    println!("B's connection to A's vhost: {err}");
    let by =
        "by RabbitMQ (B's user has no permission on A's vhost: its connection to it is refused)";
    for attack in [
        matrix::READ,
        matrix::SETTLE,
        matrix::FORGE,
        matrix::HIDE,
        matrix::FILL,
    ] {
        column.refused(attack, by);
    }
    // Squat and adopt: B's Subscriptions name A's queue (`durableName`), the second with the
    // annotation naming A's object and `adopt: IfCompatible`.
    apply(
        &b,
        &subscription(&b, "squat", &format!("{tag}b.>"), &tag, ""),
    );
    let b_api = subs(&b).await;
    wait_ready(&b_api, "squat").await;
    apply(
        &b,
        &subscription(
            &b,
            "adopt",
            &format!("{tag}c.>"),
            &tag,
            "  adopt: IfCompatible\n",
        )
        .replace(
            "metadata: {name: adopt, ",
            &format!("metadata: {{annotations: {{settle.dev/adopt: \"{a_uid}\"}}, name: adopt, "),
        ),
    );
    wait_condition(
        &b_api,
        "adopt",
        "Ready",
        "False",
        "ConsumerConflict",
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        queues_in(&vhosts[0].0, &tag),
        a_queue,
        "A's vhost gained a queue of B's"
    );
    assert_eq!(
        queues_in(&vhosts[1].0, &tag).len(),
        1,
        "B's squat made its queue in B's vhost"
    );
    column.no_effect(
        matrix::SQUAT,
        "B's queue of that name was made in B's vhost; A's vhost holds A's queue only",
    );
    column.no_effect(
        matrix::ADOPT,
        "B's annotation names A's object, but the name is looked up in B's vhost (there B's own `squat` holds it: ConsumerConflict)",
    );

    publish(3).await;
    matrix::a_counts_its_next_message(&api, &before).await;
    common::account::assert_never_decreased(&seen);
    column.finish();

    watcher.abort();
    drop(app);
    let _ = guest.close(200, "done".into()).await;
    let _ = std::fs::remove_file(&manifest);
    for ns in [&a, &b] {
        kubectl_ok(&["delete", "namespace", ns, "--wait=false"], None);
    }
    drop(op);
    drop(users);
    drop(vhosts);
}
