//! A NATS Backend's changes reach the account: on a nats-server of the test's own with users,
//! the Backend's Secret moves from one user to another, the first user is revoked (the server's
//! configuration reloaded), and the Subscription's losses keep being counted on the new
//! connection while no connection of the server uses the old user; the Secret's label removed
//! (consent withdrawn), no connection uses its user at all. The server's `/connz` says which
//! user each connection authenticated as.

use settle_testkit as common;

use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;

use common::account::{publish_to, settled_at, stats_in};
use common::operator::{NatsServer, Operator, TestStream, poll};
use common::subs::{apply, subs, wait_ready};
use common::{free_port, http_get, install_crds, kubectl_ok, namespace};

/// The server's users: `admin` (the test's own client) and the Backend's `users`.
fn config(users: &[&str]) -> String {
    let users: Vec<String> = std::iter::once("admin")
        .chain(users.iter().copied())
        .map(|u| format!("    {{user: {u}, password: {u}-pw}}"))
        .collect();
    format!(
        "authorization {{\n  users: [\n{}\n  ]\n}}\n",
        users.join("\n")
    )
}

/// The users the server's client connections authenticated as, one entry a connection.
fn users_connected(monitor: u16) -> Vec<String> {
    let Some(text) = http_get(monitor, "/connz?auth=1&limit=1000") else {
        return vec!["<the monitor did not answer>".into()];
    };
    let body = text.split("\r\n\r\n").nth(1).unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    v["connections"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| c["authorized_user"].as_str().unwrap_or("?").to_string())
        .collect()
}

fn secret(ns: &str, user: &str) {
    apply(
        ns,
        &format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: broker-creds\n  labels: {{settle.dev/backend-credentials: \"true\"}}\nstringData:\n  user: {user}\n  password: {user}-pw\n"
        ),
    );
}

/// `n` messages delivered once each and left: with maxDeliver 1 and a pull waiting past the
/// 1 s ack wait, the server says MAX_DELIVERIES for each.
async fn lose(stream: &TestStream, consumer: &str, n: usize) {
    let pull: jetstream::consumer::PullConsumer = stream
        .js
        .get_stream(&stream.name)
        .await
        .expect("the stream")
        .get_consumer(consumer)
        .await
        .expect("the consumer");
    publish_to(stream, (0..n).map(|i| format!("lost {i}"))).await;
    let mut delivered = 0;
    for _ in 0..20 {
        let mut batch = pull
            .fetch()
            .max_messages(n)
            .expires(Duration::from_millis(500))
            .messages()
            .await
            .expect("fetch");
        while let Some(Ok(_)) = batch.next().await {
            delivered += 1;
        }
        if delivered >= n {
            break;
        }
    }
    assert_eq!(delivered, n, "each delivered once");
    let mut wait = pull
        .fetch()
        .max_messages(1)
        .expires(Duration::from_secs(3))
        .messages()
        .await
        .expect("a pull past the ack wait");
    while wait.next().await.is_some() {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_rotated_credentials_reach_the_account_and_no_connection_keeps_the_old_user() {
    install_crds();
    let ns = namespace("rotate-nats");
    let file = tempfile::NamedTempFile::new().expect("a config file");
    std::fs::write(file.path(), config(&["old", "new"])).expect("write the config");
    let monitor = free_port();
    let server = NatsServer::start(&[
        "-c",
        file.path().to_str().expect("utf-8"),
        "-m",
        &monitor.to_string(),
    ]);
    let admin = async_nats::ConnectOptions::new()
        .user_and_password("admin".into(), "admin-pw".into())
        .connect(server.url())
        .await
        .expect("connect as admin");
    let js = jetstream::new(admin);
    let tag = format!("rotate_{}", std::process::id());
    let stream = TestStream {
        js: js.clone(),
        name: format!("ROTATE_{}", std::process::id()),
        prefix: format!("rec.{tag}"),
    };
    js.create_stream(jetstream::stream::Config {
        name: stream.name.clone(),
        subjects: vec![format!("{}.>", stream.prefix)],
        ..Default::default()
    })
    .await
    .expect("create the stream");
    let _op = Operator::start_with(
        "rotate-nats",
        &ns,
        &["--leader-election=false", "--stats-interval", "1s"],
    );
    secret(&ns, "old");
    apply(
        &ns,
        &format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: nats}}\nspec:\n  nats:\n    servers: [\"{}\"]\n    credentialsSecretRef: {{name: broker-creds}}\n",
            server.url()
        ),
    );
    apply(
        &ns,
        &format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{}.>\"\n  mode: AtLeastOnce\n  durableName: orders\n  maxDeliver: 1\n  ackWait: 1s\n",
            stream.prefix
        ),
    );
    let api = subs(&ns).await;
    wait_ready(&api, "orders").await;
    let exhausted = |n: u64| move |s: &settle::api::ConsumerStats| s.exhausted == n;
    lose(&stream, "orders", 2).await;
    settled_at(
        "the first two losses counted as user old",
        Duration::from_secs(30),
        || stats_in(&api, "orders"),
        exhausted(2),
    )
    .await;

    // Rotated: the Secret names the new user; then the old one is revoked on the server.
    secret(&ns, "new");
    poll(
        "no connection as the old user",
        Duration::from_secs(20),
        || async {
            let users = users_connected(monitor);
            if users.iter().any(|u| u == "old") || !users.iter().any(|u| u == "new") {
                Err(format!("{users:?}"))
            } else {
                Ok(())
            }
        },
    )
    .await;
    std::fs::write(file.path(), config(&["new"])).expect("revoke old");
    let pid = server.pid().expect("the server runs");
    assert!(
        std::process::Command::new("kill")
            .args(["-HUP", &pid.to_string()])
            .status()
            .expect("signal")
            .success(),
        "reload the server's configuration"
    );
    lose(&stream, "orders", 3).await;
    settled_at(
        "the next three losses counted within 20 s, as user new",
        Duration::from_secs(20),
        || stats_in(&api, "orders"),
        exhausted(5),
    )
    .await;
    let users = users_connected(monitor);
    assert!(!users.iter().any(|u| u == "old"), "{users:?}");

    // Consent withdrawn: no connection of the operator uses the Secret's user any more.
    kubectl_ok(
        &[
            "label",
            "secret",
            "broker-creds",
            "-n",
            &ns,
            "settle.dev/backend-credentials-",
        ],
        None,
    );
    poll(
        "no connection as the withdrawn user",
        Duration::from_secs(20),
        || async {
            let users = users_connected(monitor);
            if users.iter().any(|u| u == "new") {
                Err(format!("{users:?}"))
            } else {
                Ok(())
            }
        },
    )
    .await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}
