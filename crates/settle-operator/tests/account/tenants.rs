//! Tenants cannot forge each other's account (reports are bound to their writer) nor read
//! each other's deliveries (replies arrive under the tenant's own inbox prefix):
//! on a nats-server of the test's own with one user per tenant and permissions as the README's
//! "Multi-tenant brokers" gives them, and on the shared RabbitMQ with users of the test's own,
//! the victim's Subscription gets real deliveries, then another tenant tries every forgery it
//! can (a report put to the victim's key, one to its own key naming the victim, a huge
//! `exhausted`), and the victim's own credentials write implausible reports (a huge sequence,
//! a life started in the future). The broker refuses what the permissions forbid, the operator
//! drops the rest (counted in `settle_account_reports_total{outcome}`), and the victim's status
//! stays exact: the next real delivery shows as one more, never frozen.

use settle_testkit as common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::account::{
    App, NACK_SPEC, OPERATOR_FLAGS, forged, publish_to, settled_at, stats_in, wait_dropped, watch,
};
use common::operator::{NatsServer, Operator, TestStream, poll};
use common::rabbitmq::{User, env_backend_yaml, management, publish_topic};
use common::subs::{apply, subs, wait_ready};
use common::{install_crds, kubectl_ok, namespace};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use serde_json::{Value, json};
use settle::api::{ConsumerStats, Subscription};

const OPERATOR_PASSWORD: &str = "operator-pw";

/// The account of `n` messages each declined on all of their 3 attempts.
pub(super) fn nacked(n: u64) -> impl Fn(&ConsumerStats) -> bool {
    move |s: &ConsumerStats| {
        s.offered == 3 * n
            && s.delivered == 3 * n
            && s.settlement.nacked == 3 * n
            && s.exhausted == n
            && s.released == 0
            && s.lost == 0
    }
}

/// Waits until status shows `want`, then that it stays so for 3 s; returns it.
pub(super) async fn settled(
    api: &kube::Api<Subscription>,
    what: &str,
    want: impl Fn(&ConsumerStats) -> bool,
) -> ConsumerStats {
    settled_at(
        what,
        Duration::from_secs(90),
        || stats_in(api, "orders"),
        want,
    )
    .await
}

/// The nats-server configuration: the operator's user, and per tenant namespace `(ns, stream)`
/// a user that may publish its reports under its own namespace only, fetch and acknowledge on
/// its own stream, receive replies under its own inbox prefix only (`_INBOX.<ns>`, the
/// runtime's), and never publish advisories.
fn nats_config(tenants: &[(&str, &str, &str)]) -> String {
    let mut users = vec![format!(
        "    {{user: settle, password: {OPERATOR_PASSWORD}, permissions: {{publish: {{allow: [\">\"], deny: [\"$JS.EVENT.>\"]}}, subscribe: {{allow: [\">\"]}}}}}}"
    )];
    for (user, ns, stream) in tenants {
        users.push(format!(
            "    {{user: {user}, password: {user}-pw, permissions: {{\n      publish: {{allow: [\"$JS.API.INFO\", \"$JS.API.STREAM.NAMES\", \"$JS.API.STREAM.INFO.KV_settle-stats\", \"$KV.settle-stats.{ns}.>\", \"$JS.API.STREAM.INFO.{stream}\", \"$JS.API.CONSUMER.INFO.{stream}.>\", \"$JS.API.CONSUMER.MSG.NEXT.{stream}.>\", \"$JS.ACK.{stream}.>\"], deny: [\"$JS.EVENT.>\"]}}\n      subscribe: {{allow: [\"_INBOX.{ns}.>\"]}}\n    }}}}"
        ));
    }
    format!(
        "authorization {{\n  users: [\n{}\n  ]\n}}\n",
        users.join("\n")
    )
}

/// A NATS client as `user`, and every event (server errors included) its connection saw.
pub(super) async fn nats_as(
    url: &str,
    user: &str,
    password: &str,
) -> (async_nats::Client, Arc<Mutex<Vec<String>>>) {
    nats_in(url, user, password, "_INBOX").await
}

/// [`nats_as`] with replies under `inbox` (a tenant's user may receive under its own only).
pub(super) async fn nats_in(
    url: &str,
    user: &str,
    password: &str,
    inbox: &str,
) -> (async_nats::Client, Arc<Mutex<Vec<String>>>) {
    let events: Arc<Mutex<Vec<String>>> = Arc::default();
    let sink = events.clone();
    let client = async_nats::ConnectOptions::new()
        .user_and_password(user.into(), password.into())
        .custom_inbox_prefix(inbox)
        .request_timeout(Some(Duration::from_secs(3)))
        .event_callback(move |e| {
            sink.lock().expect("events").push(e.to_string());
            async {}
        })
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect to {url} as {user}: {e}"));
    (client, events)
}

pub(super) fn credentials_secret(keys: &[(&str, &str)]) -> String {
    let data: Vec<String> = keys
        .iter()
        .map(|(k, v)| format!("  {k}: \"{v}\""))
        .collect();
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: broker-creds\n  labels: {{settle.dev/backend-credentials: \"true\"}}\nstringData:\n{}\n",
        data.join("\n")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_nats_another_tenants_forged_reports_are_refused_or_dropped_and_the_victims_status_stays_exact()
 {
    install_crds();
    let test = "tenants-nats";
    let victim = namespace("tenants-nats-a");
    let attacker = namespace("tenants-nats-b");
    let tag = format!("tenants_{}", std::process::id());
    let stream_name = format!("TENANTS_{}", std::process::id());
    let config = tempfile::NamedTempFile::new().expect("a config file");
    std::fs::write(
        config.path(),
        nats_config(&[
            ("team-a", &victim, &stream_name),
            ("team-b", &attacker, &format!("{stream_name}_B")),
        ]),
    )
    .expect("write the nats-server config");
    // Its log (permission violations included) beside the test's.
    let log = common::root().join(format!("target/nats-{test}-{}.log", std::process::id()));
    let server = NatsServer::start(&[
        "-c",
        config.path().to_str().expect("utf-8"),
        "-l",
        log.to_str().expect("utf-8"),
    ]);
    let url = server.url();
    let (admin, _) = nats_as(&url, "settle", OPERATOR_PASSWORD).await;
    let js = async_nats::jetstream::new(admin);
    let prefix = format!("rec.{tag}");
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream_name.clone(),
        subjects: vec![format!("{prefix}.>")],
        ..Default::default()
    })
    .await
    .expect("create the victim's stream");
    let stream = TestStream {
        js: js.clone(),
        name: stream_name.clone(),
        prefix: prefix.clone(),
    };

    let op = Operator::spawn_env(test, &format!("{victim},{attacker}"), &OPERATOR_FLAGS, &[]);
    op.wait_ready();
    // Each tenant's Backend connects as the operator's user; its applications as the tenant.
    for ns in [&victim, &attacker] {
        apply(
            ns,
            &credentials_secret(&[("user", "settle"), ("password", OPERATOR_PASSWORD)]),
        );
        apply(
            ns,
            &format!(
                "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: nats}}\nspec:\n  nats:\n    servers: [\"{url}\"]\n    credentialsSecretRef: {{name: broker-creds}}\n"
            ),
        );
    }
    let manifest_text = format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {victim}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{prefix}.>\"\n{NACK_SPEC}"
    );
    apply(&victim, &manifest_text);
    let api = subs(&victim).await;
    wait_ready(&api, "orders").await;
    let manifest =
        common::root().join(format!("target/account-{test}-{}.yaml", std::process::id()));
    std::fs::write(&manifest, &manifest_text).expect("manifest");
    let (seen, watcher) = watch(&api, "orders");
    let team_a_url = format!("nats://team-a:team-a-pw@127.0.0.1:{}", server.port);
    let app = App::start(
        &[("SETTLE_NATS_URL", team_a_url.as_str())],
        &manifest,
        "nack",
    );
    app.wait_ready().await;

    publish_to(&stream, ["1".to_string(), "2".to_string()]).await;
    let before = settled(
        &api,
        "two messages exhausted in the victim's status",
        nacked(2),
    )
    .await;

    // The victim's instance and its latest report, as the operator's user reads them.
    let bucket = js
        .get_key_value("settle-stats")
        .await
        .expect("the report bucket");
    let victim_prefix = format!(
        "{}.",
        settle::bus::report::report_key(&victim, "orders", "_")
            .rsplit_once('.')
            .map_or("", |(p, _)| p)
    );
    let key = poll(
        "the victim's report in the bucket",
        Duration::from_secs(30),
        || async {
            use futures::TryStreamExt;
            let keys: Vec<String> = bucket
                .keys()
                .await
                .map_err(|e| e.to_string())?
                .try_collect()
                .await
                .map_err(|e| e.to_string())?;
            keys.into_iter()
                .find(|k| k.starts_with(&victim_prefix))
                .ok_or(format!("none under {victim_prefix}"))
        },
    )
    .await;
    let real: Value =
        serde_json::from_slice(&bucket.get(&key).await.expect("read").expect("the report"))
            .expect("JSON");
    let instance = real["instance"].as_str().expect("an instance").to_string();
    let sequence = real["sequence"].as_u64().expect("a sequence");
    let huge_exhausted = forged(
        &real,
        &[
            ("sequence", json!(sequence + 1)),
            ("stats.exhausted", json!(900_002)),
        ],
    );

    // team-b: a put to the victim's key is refused by the broker (its permissions).
    let (team_b, events) = nats_in(
        &url,
        "team-b",
        "team-b-pw",
        &settle::backend::nats::connect::inbox_prefix(&attacker),
    )
    .await;
    let team_b_js = async_nats::jetstream::new(team_b);
    let team_b_bucket = team_b_js
        .get_key_value("settle-stats")
        .await
        .expect("team-b may read the bucket's info");
    let put = team_b_bucket.put(&key, huge_exhausted.clone().into()).await;
    assert!(
        put.is_err(),
        "the broker stored team-b's put to the victim's key {key}"
    );
    poll(
        "the broker's permission error for team-b's put",
        Duration::from_secs(10),
        || async {
            let seen = events.lock().expect("events").clone();
            if seen.iter().any(|e| {
                e.contains("Permissions Violation")
                    && e.contains(&format!("$KV.settle-stats.{key}"))
            }) {
                Ok(())
            } else {
                Err(format!("{seen:?}"))
            }
        },
    )
    .await;
    // team-b's own key, its body naming the victim: the broker stores it, the operator drops it.
    let own_key = settle::bus::report::report_key(&attacker, "orders", &instance);
    team_b_bucket
        .put(&own_key, huge_exhausted.clone().into())
        .await
        .expect("team-b may write its own keys");
    wait_dropped(&op, "misfiled", 1.0).await;
    // Its key names no Subscription of team-b's: said on team-b's Backend.
    let said = common::subs::wait_backend_condition(
        &common::subs::backends(&attacker).await,
        "nats",
        "Accounted",
        "False",
        "ReportsDropped",
        Duration::from_secs(30),
    )
    .await;
    assert!(said.contains("as misfiled"), "{said}");

    // The victim's own credentials (a buggy or hijacked application of the same tenant): a
    // huge sequence, and a life started at the end of time, are implausible and dropped.
    let (team_a, _) = nats_in(
        &url,
        "team-a",
        "team-a-pw",
        &settle::backend::nats::connect::inbox_prefix(&victim),
    )
    .await;
    let team_a_bucket = async_nats::jetstream::new(team_a)
        .get_key_value("settle-stats")
        .await
        .expect("team-a's bucket");
    team_a_bucket
        .put(
            &key,
            forged(
                &real,
                &[
                    ("sequence", json!(u64::MAX)),
                    ("stats.exhausted", json!(900_002)),
                ],
            )
            .into(),
        )
        .await
        .expect("team-a may write its own key");
    wait_dropped(&op, "sequence_jump", 1.0).await;
    team_a_bucket
        .put(
            &key,
            forged(
                &real,
                &[
                    ("sequence", json!(sequence + 1)),
                    ("startedAtMs", json!(u64::MAX)),
                    ("stats.exhausted", json!(900_002)),
                ],
            )
            .into(),
        )
        .await
        .expect("team-a may write its own key");
    wait_dropped(&op, "from_the_future", 1.0).await;

    assert_eq!(
        stats_in(&api, "orders").await,
        before,
        "a forgery moved the victim's status"
    );
    // team-b listens where replies go: every inbox, and the victim's. The server refuses both
    // subscriptions, so the victim's next pulled message (and its `$JS.ACK` subject, with which
    // team-b could settle it) reaches team-b through neither.
    let (reader, reader_events) = nats_in(
        &url,
        "team-b",
        "team-b-pw",
        &settle::backend::nats::connect::inbox_prefix(&attacker),
    )
    .await;
    let mut read = Vec::new();
    for subject in ["_INBOX.>".to_string(), format!("_INBOX.{victim}.>")] {
        read.push(
            reader
                .subscribe(subject.clone())
                .await
                .unwrap_or_else(|e| panic!("subscribe to {subject}: {e}")),
        );
    }
    // Not frozen either: one more real message counts exactly one more.
    publish_to(&stream, ["3".to_string()]).await;
    let after = settled(
        &api,
        "the third message exhausted in the victim's status",
        nacked(3),
    )
    .await;
    assert_eq!(after.exhausted, before.exhausted + 1, "{after:?}");
    common::account::assert_never_decreased(&seen);
    for (subject, sub) in ["_INBOX.>".to_string(), format!("_INBOX.{victim}.>")]
        .iter()
        .zip(read.iter_mut())
    {
        let got =
            tokio::time::timeout(Duration::from_millis(200), futures::StreamExt::next(sub)).await;
        assert!(
            !matches!(got, Ok(Some(_))),
            "team-b read a reply meant for the victim on {subject}: {got:?}"
        );
        poll(
            &format!("the broker's refusal of team-b's subscription to {subject}"),
            Duration::from_secs(10),
            || async {
                let seen = reader_events.lock().expect("events").clone();
                if seen.iter().any(|e| {
                    e.contains("Permissions Violation for Subscription")
                        && e.contains(subject.as_str())
                }) {
                    Ok(())
                } else {
                    Err(format!("{seen:?}"))
                }
            },
        )
        .await;
    }

    watcher.abort();
    drop(app);
    let _ = std::fs::remove_file(&manifest);
    for ns in [&victim, &attacker] {
        kubectl_ok(&["delete", "namespace", ns, "--wait=false"], None);
    }
}

/// Publishes `body` to `queue` through the default exchange with `user_id` (if any), and waits
/// for the broker's confirm: `Err` when the broker closed the channel instead.
async fn publish_as(
    conn: &lapin::Connection,
    queue: &str,
    body: &[u8],
    user_id: Option<&str>,
) -> Result<(), String> {
    let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let mut props = lapin::BasicProperties::default().with_delivery_mode(2);
    if let Some(u) = user_id {
        props = props.with_user_id(u.into());
    }
    let confirm = ch
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            body,
            props,
        )
        .await
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    if !confirm.is_ack() {
        return Err(format!("not confirmed: {confirm:?}"));
    }
    let _ = ch.close(200, "published".into()).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_rabbitmq_only_the_backends_report_users_count_and_the_victims_status_stays_exact() {
    install_crds();
    let test = "tenants-rabbit";
    let ns = namespace(test);
    let env = common::env();
    let pid = std::process::id();
    // The victim's application user, and another tenant that may publish through the default
    // exchange (as it must, to report on its own queues) and nothing else.
    let victim = User::create(&format!("settle-victim-{pid}"), ".*", ".*", ".*");
    let attacker = User::create(
        &format!("settle-attacker-{pid}"),
        "^$",
        "^amq\\.default$",
        "^$",
    );
    let op = Operator::start_with(test, &ns, &OPERATOR_FLAGS);
    apply(
        &ns,
        &env_backend_yaml(
            "rabbit",
            &format!("    reportUsers: [\"{}\"]\n", victim.name),
        ),
    );
    let tag = format!("tenants{pid}");
    let manifest_text = format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {ns}}}\nspec:\n  backendRef: {{name: rabbit}}\n  pattern: \"{tag}.>\"\n  mode: AtLeastOnce\n  durableName: {tag}\n  maxDeliver: 3\n"
    );
    apply(&ns, &manifest_text);
    let api = subs(&ns).await;
    wait_ready(&api, "orders").await;
    let manifest = common::root().join(format!("target/account-{test}-{pid}.yaml"));
    std::fs::write(&manifest, &manifest_text).expect("manifest");
    let (seen, watcher) = watch(&api, "orders");
    let app = App::start(
        &[("SETTLE_RABBITMQ_URL", victim.url().as_str())],
        &manifest,
        "nack",
    );
    app.wait_ready().await;

    let guest =
        lapin::Connection::connect(&env.rabbitmq_url, lapin::ConnectionProperties::default())
            .await
            .expect("connect to RabbitMQ");
    let publish = |n: usize| publish_topic(&guest, [(format!("{tag}.m{n}"), n.to_string())]);
    publish(1).await;
    publish(2).await;
    // The victim's runtime reports as its own user, which the Backend lists: counted.
    let before = settled(
        &api,
        "two messages exhausted in the victim's status",
        nacked(2),
    )
    .await;

    // The victim's instance queue, and a report as it would write it.
    let queue_prefix = settle::backend::rabbitmq::report::instance_queue(&ns, "orders", "");
    let (status, body) = management("GET", "/api/queues/%2f?columns=name");
    assert_eq!(status, 200, "{body}");
    let queues: Vec<Value> = serde_json::from_str(&body).expect("JSON");
    let queue = queues
        .iter()
        .filter_map(|q| q["name"].as_str())
        .find(|q| q.starts_with(&queue_prefix))
        .unwrap_or_else(|| panic!("no report queue under {queue_prefix}: {body}"))
        .to_string();
    let instance = queue[queue_prefix.len()..].to_string();
    let real = json!({
        "version": 1, "namespace": ns, "subscription": "orders", "durableName": tag,
        "instance": instance, "backend": "rabbitmq", "mode": "AtLeastOnce",
        "startedAtMs": 1, "reportedAtMs": 2, "sequence": 1_000_000,
        "stats": {"offered": 6, "delivered": 6, "settlement": {"nacked": 6}, "exhausted": 900_002},
        "runtime": {"handlerErrors": 0, "panics": 0}
    });
    let huge_exhausted = forged(&real, &[]);

    // The other tenant, claiming to be the victim: refused by the broker (user_id is validated).
    let intruder =
        lapin::Connection::connect(&attacker.url(), lapin::ConnectionProperties::default())
            .await
            .expect("connect as the other tenant");
    let refused = publish_as(&intruder, &queue, &huge_exhausted, Some(&victim.name)).await;
    let err = refused.expect_err("the broker took a user_id that is not the connection's user");
    assert!(err.contains("user_id"), "{err}");
    // As itself (its own user_id, or none): the broker delivers, the operator drops.
    publish_as(&intruder, &queue, &huge_exhausted, Some(&attacker.name))
        .await
        .expect("the other tenant may publish through the default exchange");
    wait_dropped(&op, "wrong_writer", 1.0).await;
    let shared = settle::backend::rabbitmq::report::report_queue(&ns, "orders");
    publish_as(&intruder, &shared, &huge_exhausted, None)
        .await
        .expect("publish without a user_id");
    wait_dropped(&op, "wrong_writer", 2.0).await;

    // The victim's own user: a body naming another instance than its queue, and a huge
    // sequence, are dropped.
    let own = lapin::Connection::connect(&victim.url(), lapin::ConnectionProperties::default())
        .await
        .expect("connect as the victim");
    publish_as(
        &own,
        &queue,
        &forged(&real, &[("instance", json!("someone-else"))]),
        Some(&victim.name),
    )
    .await
    .expect("the victim may publish");
    wait_dropped(&op, "misfiled", 1.0).await;
    publish_as(
        &own,
        &queue,
        &forged(&real, &[("sequence", json!(u64::MAX))]),
        Some(&victim.name),
    )
    .await
    .expect("the victim may publish");
    wait_dropped(&op, "sequence_jump", 1.0).await;

    assert_eq!(
        stats_in(&api, "orders").await,
        before,
        "a forgery moved the victim's status"
    );
    publish(3).await;
    let after = settled(
        &api,
        "the third message exhausted in the victim's status",
        nacked(3),
    )
    .await;
    assert_eq!(after.exhausted, before.exhausted + 1, "{after:?}");
    common::account::assert_never_decreased(&seen);

    watcher.abort();
    drop(app);
    let _ = std::fs::remove_file(&manifest);
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
    drop(victim);
    drop(attacker);
}
