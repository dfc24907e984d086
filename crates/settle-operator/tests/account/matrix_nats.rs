//! The tenant attack matrix on NATS, configured as `docs/guide/multi-tenant.md` leads: a NATS
//! account per tenant namespace (the operator's user and the tenant's in it), one operator
//! for both, its webhook registered fail-closed for both namespaces. Tenant A's application
//! runs throughout; tenant B tries every attack of the matrix (`matrix.rs`) with its own
//! application user, its own namespace and whatever a tenant may apply there. Then A's next
//! message must count exactly one more, with `Accounted` True and nothing ever stepped down.
//! The operator's rows (memory, status writes, webhook, Secrets, importer) are the same code
//! for every broker and run here once, with bounds set low enough that B reaches them.

use settle_testkit as common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::account::{App, NACK_SPEC, OPERATOR_FLAGS, publish_to, report_of, stats_in, watch};
use common::operator::{NatsServer, Operator, TestStream, poll};
use common::subs::{apply, subs, wait_condition, wait_ready};
use common::{free_port, install_crds, kubectl, kubectl_ok, namespace};
use futures::StreamExt;
use kube::api::{Api, PostParams};
use settle::api::{ConsumerStats, Subscription};
use settle::backend::nats::mapping::{OWNER_KEY, UID_KEY};

use super::matrix::{self, Column};
use super::nats_accounts::{filler_report, nats_accounts_config};
use super::tenants::{credentials_secret, nacked, nats_as, settled};

/// `--max-early-report-bytes` here: what B's 16 Backends reading its filled bucket pass.
const EARLY_BUDGET: f64 = 2.0 * 1024.0 * 1024.0;

/// A's consumer's marks: whose it is, and for which object.
async fn marks(js: &async_nats::jetstream::Context) -> (Option<String>, Option<String>) {
    let stream = js.get_stream("ORDERS").await.expect("A's stream");
    let info = stream.consumer_info("orders").await.expect("A's consumer");
    let m = &info.config.metadata;
    (m.get(OWNER_KEY).cloned(), m.get(UID_KEY).cloned())
}

/// A Subscription in `ns` on `prefix` with durable name `durable`, and more of its spec.
fn subscription(ns: &str, name: &str, prefix: &str, durable: &str, more: &str) -> String {
    format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{prefix}.{name}.>\"\n  mode: AtLeastOnce\n  durableName: {durable}\n  maxDeliver: 3\n{more}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_nats_with_an_account_per_tenant_no_attack_of_b_reaches_a() {
    install_crds();
    let test = "matrix-nats";
    let pid = std::process::id();
    let (a, b) = (namespace("matrix-nats-a"), namespace("matrix-nats-b"));
    let config = tempfile::NamedTempFile::new().expect("a config file");
    std::fs::write(config.path(), nats_accounts_config(&["a", "b"])).expect("write the config");
    let log = common::root().join(format!("target/nats-{test}-{pid}.log"));
    let server = NatsServer::start(&[
        "-c",
        config.path().to_str().expect("utf-8"),
        "-l",
        log.to_str().expect("utf-8"),
    ]);
    let url = server.url();
    let webhook_port = free_port();
    let webhook_addr = format!("127.0.0.1:{webhook_port}");
    let configuration = format!("settle-matrix-{pid}");
    common::register_subscription_webhook(
        &configuration,
        "settle-matrix",
        &pid.to_string(),
        webhook_port,
    );
    let mut flags = OPERATOR_FLAGS.to_vec();
    flags.extend([
        "--report-bucket-max-bytes",
        "1048576",
        "--max-early-report-bytes",
        "2097152",
        "--status-writes-per-second",
        "5",
        "--webhook-addr",
        &webhook_addr,
        "--webhook-configuration",
        &configuration,
    ]);
    let op = Operator::spawn_env(test, &format!("{a},{b}"), &flags, &[]);
    op.wait_ready();
    let mut js = Vec::new();
    for (t, ns) in [("a", &a), ("b", &b)] {
        kubectl_ok(
            &["label", "namespace", ns, &format!("settle-matrix={pid}")],
            None,
        );
        let (admin, _) = nats_as(&url, &format!("settle-{t}"), &format!("settle-{t}-pw")).await;
        let context = async_nats::jetstream::new(admin);
        context
            .create_stream(async_nats::jetstream::stream::Config {
                name: "ORDERS".into(),
                subjects: vec![format!("mx.{t}.{pid}.>")],
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("create team-{t}'s stream: {e}"));
        apply(
            ns,
            &credentials_secret(&[
                ("user", &format!("settle-{t}")),
                ("password", &format!("settle-{t}-pw")),
            ]),
        );
        apply(
            ns,
            &format!(
                "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: nats}}\nspec:\n  nats:\n    servers: [\"{url}\"]\n    credentialsSecretRef: {{name: broker-creds}}\n"
            ),
        );
        js.push(context);
    }
    let (a_prefix, b_prefix) = (format!("mx.a.{pid}"), format!("mx.b.{pid}"));

    // A: Subscription `orders` and its application, two messages each declined 3 times.
    let text = format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {a}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{a_prefix}.>\"\n{NACK_SPEC}"
    );
    apply(&a, &text);
    let api = subs(&a).await;
    let a_uid = wait_ready(&api, "orders").await.metadata.uid;
    let manifest = common::root().join(format!("target/account-{test}-{pid}.yaml"));
    std::fs::write(&manifest, &text).expect("manifest");
    let app_url = format!("nats://team-a:team-a-pw@127.0.0.1:{}", server.port);
    let app = App::start(&[("SETTLE_NATS_URL", app_url.as_str())], &manifest, "nack");
    app.wait_ready().await;
    let stream = TestStream {
        js: js[0].clone(),
        name: "ORDERS".into(),
        prefix: a_prefix.clone(),
    };
    publish_to(&stream, ["1".to_string(), "2".to_string()]).await;
    let before = settled(&api, "A's two messages exhausted", nacked(2)).await;
    let (seen, watcher) = watch(&api, "orders");
    let a_marks = marks(&js[0]).await;
    assert_eq!(a_marks, (Some(format!("{a}/orders")), a_uid.clone()));

    let mut column = Column::new("NATS, an account per tenant");
    let mut operator = Column::new("The operator, whatever the broker");
    let (team_b, _) = nats_as(&url, "team-b", "team-b-pw").await;
    let team_b_js = async_nats::jetstream::new(team_b.clone());
    let b_bucket = team_b_js
        .get_key_value("settle-stats")
        .await
        .expect("B's report bucket");

    // Read: B listens to every subject its account has (checked after A's next message).
    let mut everything = team_b.subscribe(">").await.expect("B subscribes to >");

    // Forge: a report with a huge `exhausted` at A's very key, and at B's own key naming A.
    let inflated = ConsumerStats {
        offered: 900_000,
        delivered: 900_000,
        exhausted: 900_000,
        ..Default::default()
    };
    for key_ns in [&a, &b] {
        let (_, body) = report_of(&a, "orders", "orders", "pod-0", 1, inflated);
        let key = settle::bus::report::report_key(key_ns, "orders", "pod-0");
        b_bucket
            .put(&key, body.into())
            .await
            .expect("B writes its own bucket");
    }

    // Squat and adopt: B's Subscriptions name A's consumer (`orders` on `ORDERS`), the second
    // with the annotation naming A's object and `adopt: IfCompatible`.
    apply(&b, &subscription(&b, "squat", &b_prefix, "orders", ""));
    let b_api = subs(&b).await;
    wait_ready(&b_api, "squat").await;
    let a_uid_text = a_uid.clone().unwrap_or_default();
    apply(
        &b,
        &subscription(&b, "adopt", &b_prefix, "orders", "  adopt: IfCompatible\n").replace(
            "metadata: {name: adopt, ",
            &format!(
                "metadata: {{annotations: {{settle.dev/adopt: \"{a_uid_text}\"}}, name: adopt, "
            ),
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
        marks(&js[0]).await,
        a_marks,
        "B's Subscriptions took A's consumer"
    );
    column.no_effect(
        matrix::SQUAT,
        "B's `orders` is a consumer of B's own account; A's keeps A's marks",
    );
    column.no_effect(
        matrix::ADOPT,
        "B's annotation names A's object, but the name is looked up in B's account (there, B's own `squat` holds it: ConsumerConflict); A's consumer keeps A's marks",
    );

    // Secrets: a Backend naming a Secret of A's namespace cannot be written.
    let steal = format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: steal, namespace: {b}}}\nspec:\n  nats:\n    servers: [\"{url}\"]\n    credentialsSecretRef: {{name: broker-creds, namespace: {a}}}\n"
    );
    let out = kubectl(&["apply", "-f", "-"], Some(&steal));
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !out.status.success() && said.contains("unknown field"),
        "a Backend naming another namespace's Secret was taken: {said}"
    );
    operator.refused(
        matrix::SECRETS,
        "by the API server (`credentialsSecretRef` has no namespace: a Backend reads a labelled Secret of its own namespace only)",
    );

    // Importer: a NACK Consumer of B's whose `creds` carries a second YAML document.
    let nack = tempfile::NamedTempFile::new().expect("a manifest file");
    let injected = serde_json::to_string(
        "/etc/nats/user.creds\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {name: pwned}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: cluster-admin}\nsubjects: [{kind: ServiceAccount, name: default, namespace: b}]\n",
    )
    .expect("JSON");
    std::fs::write(
        nack.path(),
        format!(
            "apiVersion: jetstream.nats.io/v1beta2\nkind: Consumer\nmetadata: {{name: orders, namespace: {b}}}\nspec:\n  servers: [\"{url}\"]\n  streamName: ORDERS\n  durableName: orders\n  ackPolicy: explicit\n  ackWait: 30s\n  creds: {injected}\n"
        ),
    )
    .expect("write the NACK manifest");
    let out = std::process::Command::new(common::bin("settle"))
        .args(["import", "nack", "--allow-changes", "-f"])
        .arg(nack.path())
        .output()
        .expect("settle import nack runs");
    let (printed, said) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(
        printed
            .lines()
            .chain(said.lines())
            .all(|l| !l.trim_start().starts_with("kind: ClusterRoleBinding")),
        "the importer wrote B's document: {printed}"
    );
    assert!(
        format!("{printed}{said}").contains("not a plain file path"),
        "the importer did not refuse B's creds: {printed}{said}"
    );
    operator.refused(
        matrix::IMPORTER,
        "by `settle import nack` (a `creds`, `nkey` or CA that is not a plain path is a finding; nothing of it is written)",
    );

    // Fill: B fills its own bucket until the broker refuses.
    let mut refused = None;
    for i in 0..64 {
        let key = settle::bus::report::report_key(&b, "filler", &format!("i{i}"));
        if let Err(e) = b_bucket
            .put(&key, filler_report(&b, &format!("i{i}"), 60_000).into())
            .await
        {
            refused = Some(e.to_string());
            break;
        }
    }
    assert!(
        refused.is_some(),
        "B's 1 MiB bucket took 64 reports of 60 KB"
    );

    // Memory: 15 more Backends of B's, each keeper reading B's full bucket of reports for no
    // Subscription: 16 MiB to hold against the process's budget of 2 MiB.
    for i in 1..16 {
        apply(
            &b,
            &format!(
                "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: nats-{i}}}\nspec:\n  nats:\n    servers: [\"{url}\"]\n    credentialsSecretRef: {{name: broker-creds}}\n"
            ),
        );
    }
    let dropped = || {
        op.metric(
            "settle_account_reports_total",
            &[("outcome", "early_dropped")],
        )
    };
    let mut most: f64 = 0.0;
    poll(
        "B's Backends dropping what the early budget cannot hold",
        Duration::from_secs(90),
        || {
            most = most.max(op.metric("settle_account_early_report_bytes", &[]));
            let d = dropped();
            async move {
                if d > 0.0 {
                    Ok(())
                } else {
                    Err(format!("dropped {d}"))
                }
            }
        },
    )
    .await;
    for _ in 0..20 {
        most = most.max(op.metric("settle_account_early_report_bytes", &[]));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(most <= EARLY_BUDGET, "held {most} bytes past the budget");
    // Room again, for the flood below.
    for i in 0..64 {
        let _ = b_bucket
            .purge(settle::bus::report::report_key(
                &b,
                "filler",
                &format!("i{i}"),
            ))
            .await;
    }
    for i in 1..16 {
        kubectl_ok(&["delete", "backend", &format!("nats-{i}"), "-n", &b], None);
    }

    // Status writes: 8 Subscriptions of B's losing a message every half second each, against
    // a budget of 5 writes a second.
    for i in 0..8 {
        apply(
            &b,
            &subscription(&b, &format!("flood-{i}"), &b_prefix, &format!("f{i}"), ""),
        );
    }
    for i in 0..8 {
        wait_ready(&b_api, &format!("flood-{i}")).await;
    }
    let flooding = Arc::new(AtomicBool::new(true));
    let flood = {
        let (b_bucket, b, flooding) = (b_bucket.clone(), b.clone(), flooding.clone());
        tokio::spawn(async move {
            let instance = settle::bus::report::default_instance();
            let mut seq = 0u64;
            while flooding.load(Ordering::Relaxed) {
                seq += 1;
                for i in 0..8 {
                    let stats = ConsumerStats {
                        offered: seq,
                        delivered: seq,
                        exhausted: seq,
                        settlement: settle::api::Settlement {
                            nacked: seq,
                            ..Default::default()
                        },
                        ..Default::default()
                    };
                    let (key, body) = report_of(
                        &b,
                        &format!("flood-{i}"),
                        &format!("f{i}"),
                        &instance,
                        seq,
                        stats,
                    );
                    let _ = b_bucket.put(key, body.into()).await;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };

    // Webhook: B sends 400 Subscription creates (dry run: the webhook answers each) 16 at a
    // time, while A applies a Subscription.
    let answered = Arc::new(AtomicU64::new(0));
    let webhook_flood = {
        let (b, answered) = (b.clone(), answered.clone());
        let client = common::kube_client().await;
        tokio::spawn(async move {
            let api: Api<Subscription> = Api::namespaced(client, &b);
            let params = PostParams {
                dry_run: true,
                ..Default::default()
            };
            futures::stream::iter(0..400)
                .map(|i| {
                    let (api, params, answered) = (api.clone(), params.clone(), answered.clone());
                    let sub: Subscription = serde_yaml::from_str(&format!(
                        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: dry-{i}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"x.{i}.>\"\n  mode: AtLeastOnce\n  durableName: dry{i}\n  maxDeliver: 3\n"
                    ))
                    .expect("a Subscription");
                    async move {
                        if api.create(&params, &sub).await.is_ok() {
                            answered.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
                .buffer_unordered(16)
                .count()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let late = subscription(&a, "late", &a_prefix, "late", "");
    let out = tokio::task::spawn_blocking(move || kubectl(&["apply", "-f", "-"], Some(&late)))
        .await
        .expect("kubectl ran");
    assert!(
        out.status.success(),
        "A's apply was not admitted during B's flood: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sent = webhook_flood.await.expect("the flood ran");
    assert_eq!(sent, 400);
    let answered = answered.load(Ordering::Relaxed);
    assert!(answered > 0, "none of B's dry runs was answered");
    operator.no_effect(
        matrix::WEBHOOK,
        "A's `kubectl apply` was admitted while B's 400 creates were answered",
    );

    // Hide: B deletes, in its account, the consumer named as A's, A's report key, and the
    // advisory capture and ledger bucket the operator keeps there.
    let _ = team_b
        .request("$JS.API.CONSUMER.DELETE.ORDERS.orders", "".into())
        .await;
    let _ = b_bucket
        .delete(settle::bus::report::report_key(&a, "orders", "pod-0"))
        .await;
    for stream in [
        settle::backend::nats::capture::CAPTURE_STREAM.to_string(),
        format!("KV_{}", settle::backend::nats::capture::ACCOUNT_BUCKET),
    ] {
        let _ = team_b_js.delete_stream(&stream).await;
    }

    // A's next message, while B's flood goes on and B settles every acknowledgement subject
    // it can guess for it (`+TERM` would end it silently).
    publish_to(&stream, ["3".to_string()]).await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    for dc in 1..=3 {
        for dseq in 7..=9 {
            let _ = team_b
                .publish(
                    format!("$JS.ACK.ORDERS.orders.{dc}.3.{dseq}.{now}.0"),
                    "+TERM".into(),
                )
                .await;
        }
    }
    matrix::a_counts_its_next_message(&api, &before).await;
    flooding.store(false, Ordering::Relaxed);
    flood.await.expect("the flood ran");
    let flooded = stats_in(&b_api, "flood-0").await;
    assert!(
        flooded.exhausted > 0,
        "B's flood never reached status: {flooded:?}"
    );
    common::account::assert_never_decreased(&seen);
    column.no_effect(
        matrix::FORGE,
        "B's puts, at A's very key and at its own naming A, land in B's own bucket; A's counts moved only with A's messages",
    );
    column.no_effect(
        matrix::SETTLE,
        "B's `+TERM` on every acknowledgement subject of A's message it could guess reached B's account only; A's message was declined 3 times and counted",
    );
    column.no_effect(
        matrix::HIDE,
        "B deleted the consumer, report key, capture and ledger of those names in its own account; A's next loss counted",
    );
    column.no_effect(
        matrix::FILL,
        "B filled its own bucket until its broker refused; A's bucket is A's and A stayed `Accounted=True`",
    );
    operator.no_effect(
        matrix::MEMORY,
        "16 Backends of B's holding 16 MiB of reports for no Subscription: the operator held at most `--max-early-report-bytes` in all, dropped and counted the rest",
    );
    operator.no_effect(
        matrix::STATUS,
        "8 Subscriptions of B's losing messages all the time against a budget of 5 writes a second: namespaces take turns, A's loss reached status",
    );

    // Read: everything B's `>` got meanwhile, none of it A's.
    let mut overheard = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while let Ok(Some(m)) = tokio::time::timeout_at(deadline, everything.next()).await {
        // A's messages, its application's inbox, its application's reports; B's own puts at
        // A's key names (`pod-0`) are B's.
        let subject = m.subject.to_string();
        let report_of_a =
            subject.starts_with(&format!("$KV.settle-stats.{a}.")) && !subject.ends_with(".pod-0");
        if subject.contains(&a_prefix) || subject.starts_with(&format!("_INBOX.{a}")) || report_of_a
        {
            overheard.push(subject);
        }
    }
    assert!(overheard.is_empty(), "B overheard A: {overheard:?}");
    column.no_effect(
        matrix::READ,
        "B subscribed to `>`: its account carries nothing of A's (A's messages, acknowledgements, inboxes)",
    );
    println!(
        "B's webhook flood: {answered} of 400 answered; early reports held at most {:.1} MiB, {} dropped",
        most / 1024.0 / 1024.0,
        dropped()
    );
    column.finish();
    operator.finish();

    watcher.abort();
    drop(app);
    let _ = std::fs::remove_file(&manifest);
    kubectl(
        &["delete", "validatingwebhookconfiguration", &configuration],
        None,
    );
    for ns in [&a, &b] {
        kubectl_ok(&["delete", "namespace", ns, "--wait=false"], None);
    }
}
