//! Tenants with NATS accounts of their own (the default `docs/guide/multi-tenant.md` leads
//! with): on a nats-server of the test's own with an account per tenant, each tenant's Backend
//! connecting as the operator's user of that account and its application as the tenant's, the
//! same stream name in both. team-b listens to every subject its account has, writes junk to
//! its report bucket (removed by the operator, said on its Backend) and fills it with reports the operator must
//! keep: team-b's Subscription says `Accounted=False ReportStoreFull` (and is whole again once
//! team-b makes room), while team-a's counts stay exact, never step down, and its account stays
//! whole.

use settle_testkit as common;

use std::time::Duration;

use common::account::{App, NACK_SPEC, OPERATOR_FLAGS, publish_to, watch};
use common::operator::{NatsServer, Operator, TestStream, poll};
use common::subs::{apply, subs, wait_condition, wait_ready};
use common::{install_crds, kubectl_ok, namespace};
use serde_json::json;

use super::tenants::{credentials_secret, nacked, nats_as, settled};

/// The nats-server configuration `docs/guide/multi-tenant.md` leads with: a NATS account per
/// tenant namespace, with JetStream limits of its own, holding the operator's user for that
/// tenant's Backend (`settle-<n>`) and the tenant's applications' user (`team-<n>`).
pub(super) fn nats_accounts_config(tenants: &[&str]) -> String {
    let accounts: Vec<String> = tenants
        .iter()
        .map(|t| {
            format!(
                "  TEAM_{up}: {{\n    jetstream: {{max_file: 1G, max_mem: 64M, max_streams: 16, max_consumers: 64}}\n    users: [\n      {{user: settle-{t}, password: settle-{t}-pw}}\n      {{user: team-{t}, password: team-{t}-pw}}\n    ]\n  }}",
                up = t.to_uppercase()
            )
        })
        .collect();
    format!("accounts {{\n{}\n}}\n", accounts.join("\n"))
}

/// A stats report of `ns`'s code-defined subscription `filler` from instance `instance`,
/// padded to about `bytes` (a field the operator does not read): counted for no Subscription,
/// fresh, so the operator keeps it in the bucket.
pub(super) fn filler_report(ns: &str, instance: &str, bytes: usize) -> Vec<u8> {
    let now = settle::bus::report::now_ms();
    serde_json::to_vec(&json!({
        "version": settle::bus::report::REPORT_VERSION,
        "namespace": ns, "subscription": "filler", "instance": instance, "backend": "nats",
        "mode": "AtLeastOnce", "startedAtMs": now, "reportedAtMs": now, "sequence": 1,
        "stats": {}, "runtime": {"handlerErrors": 0, "panics": 0},
        "padding": "x".repeat(bytes),
    }))
    .expect("JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_nats_tenants_with_accounts_of_their_own_share_nothing_and_a_full_report_bucket_is_said()
{
    install_crds();
    let test = "tenant-accounts";
    let (a, b) = (
        namespace("tenant-accounts-a"),
        namespace("tenant-accounts-b"),
    );
    let config = tempfile::NamedTempFile::new().expect("a config file");
    std::fs::write(config.path(), nats_accounts_config(&["a", "b"])).expect("write the config");
    let log = common::root().join(format!("target/nats-{test}-{}.log", std::process::id()));
    let server = NatsServer::start(&[
        "-c",
        config.path().to_str().expect("utf-8"),
        "-l",
        log.to_str().expect("utf-8"),
    ]);
    let url = server.url();
    // The smallest report bucket the operator allows (1 MiB), so a tenant fills its own fast.
    let mut flags = OPERATOR_FLAGS.to_vec();
    flags.extend(["--report-bucket-max-bytes", "1048576"]);
    let op = Operator::spawn_env(test, &format!("{a},{b}"), &flags, &[]);
    op.wait_ready();

    let mut streams = Vec::new();
    let mut apis = Vec::new();
    let mut apps = Vec::new();
    let mut manifests = Vec::new();
    for (t, ns) in [("a", &a), ("b", &b)] {
        let (admin, _) = nats_as(&url, &format!("settle-{t}"), &format!("settle-{t}-pw")).await;
        let js = async_nats::jetstream::new(admin);
        let prefix = format!("acct.{t}.{}", std::process::id());
        // The same stream name in both accounts: neither sees the other's.
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "ORDERS".into(),
            subjects: vec![format!("{prefix}.>")],
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
        let text = format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: orders, namespace: {ns}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"{prefix}.>\"\n{NACK_SPEC}"
        );
        apply(ns, &text);
        let api = subs(ns).await;
        wait_ready(&api, "orders").await;
        let manifest = common::root().join(format!(
            "target/account-{test}-{t}-{}.yaml",
            std::process::id()
        ));
        std::fs::write(&manifest, &text).expect("manifest");
        let app_url = format!("nats://team-{t}:team-{t}-pw@127.0.0.1:{}", server.port);
        let app = App::start(&[("SETTLE_NATS_URL", app_url.as_str())], &manifest, "nack");
        app.wait_ready().await;
        streams.push(TestStream {
            js,
            name: "ORDERS".into(),
            prefix,
        });
        apis.push(api);
        apps.push(app);
        manifests.push(manifest);
    }
    for stream in &streams {
        publish_to(stream, ["1".to_string(), "2".to_string()]).await;
    }
    for api in &apis {
        settled(api, "two messages exhausted", nacked(2)).await;
    }
    let (seen, watcher) = watch(&apis[0], "orders");

    // Read: team-b listens to every subject its account has, and asks for team-a's bucket.
    let (team_b, _) = nats_as(&url, "team-b", "team-b-pw").await;
    let mut everything = team_b.subscribe(">").await.expect("team-b subscribes to >");
    let team_b_js = async_nats::jetstream::new(team_b.clone());
    let b_bucket = team_b_js
        .get_key_value("settle-stats")
        .await
        .expect("team-b's own report bucket");

    // Junk under its own namespace, naming no Subscription, is removed from team-b's bucket
    // by the operator and said on team-b's Backend.
    let junk = settle::bus::report::report_key(&b, "nobody", "junk-1");
    b_bucket
        .put(&junk, "not a report".into())
        .await
        .expect("team-b writes junk");
    poll("the junk removed", Duration::from_secs(30), || async {
        match b_bucket.get(&junk).await {
            Ok(None) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    let said = common::subs::wait_backend_condition(
        &common::subs::backends(&b).await,
        "nats",
        "Accounted",
        "False",
        "ReportsDropped",
        Duration::from_secs(30),
    )
    .await;
    assert!(said.contains("as unreadable"), "{said}");

    // Fill: team-b fills its own bucket with reports the operator must keep (fresh, of a
    // code-defined subscription) until the broker refuses one.
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
    let refused = refused.expect("the broker took 64 reports of 60 KB in a 1 MiB bucket");
    let fill = team_b_js
        .get_stream("KV_settle-stats")
        .await
        .expect("the bucket's stream")
        .cached_info()
        .clone();
    println!(
        "team-b's bucket refused a put ({refused}) holding {} of {} bytes",
        fill.state.bytes, fill.config.max_bytes
    );
    let full = wait_condition(
        &apis[1],
        "orders",
        "Accounted",
        "False",
        "ReportStoreFull",
        Duration::from_secs(30),
    )
    .await;
    println!(
        "team-b's Subscription says: {:?}",
        full.status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Accounted"))
            .map(|c| &c.message)
    );
    assert_eq!(
        op.metric(
            "settle_account_report_store_full",
            &[("backend", &format!("{b}/nats"))]
        ),
        1.0
    );
    assert_eq!(
        op.metric(
            "settle_account_report_store_full",
            &[("backend", &format!("{a}/nats"))]
        ),
        0.0
    );

    // Team-a: its stream and bucket are its own; one more message counts exactly one more,
    // and its account stays whole.
    let missing = team_b_js
        .get_stream("ORDERS")
        .await
        .expect("team-b's own ORDERS");
    let subjects = missing.cached_info().config.subjects.clone();
    assert_eq!(
        subjects,
        vec![format!("{}.>", streams[1].prefix)],
        "team-b sees another stream"
    );
    publish_to(&streams[0], ["3".to_string()]).await;
    settled(&apis[0], "team-a's third message exhausted", nacked(3)).await;
    wait_condition(
        &apis[0],
        "orders",
        "Accounted",
        "True",
        "Kept",
        Duration::from_secs(5),
    )
    .await;
    // Everything team-b's `>` got meanwhile (its own account's traffic), none of it team-a's.
    let mut overheard = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while let Ok(Some(m)) =
        tokio::time::timeout_at(deadline, futures::StreamExt::next(&mut everything)).await
    {
        let subject = m.subject.to_string();
        if subject.contains(&streams[0].prefix) || subject.contains(a.as_str()) {
            overheard.push(subject);
        }
    }
    assert!(
        overheard.is_empty(),
        "team-b overheard team-a: {overheard:?}"
    );
    common::account::assert_never_decreased(&seen);

    // Room again: team-b removes its filler, and its Subscription's account is whole again.
    for i in 0..64 {
        let key = settle::bus::report::report_key(&b, "filler", &format!("i{i}"));
        let _ = b_bucket.purge(&key).await;
    }
    wait_condition(
        &apis[1],
        "orders",
        "Accounted",
        "True",
        "Kept",
        Duration::from_secs(30),
    )
    .await;

    watcher.abort();
    drop(apps);
    for m in manifests {
        let _ = std::fs::remove_file(m);
    }
    for ns in [&a, &b] {
        kubectl_ok(&["delete", "namespace", ns, "--wait=false"], None);
    }
}
