//! The Backend controller against the real API server and real nats-servers, `settle operator`
//! running as a process: a reachable Backend is Ready with its version and capabilities; a closed
//! port is Unreachable; wrong credentials are AuthFailed and a fixed Secret makes it Ready with no
//! restart; a missing Secret says so; the memory backend is Ready in process; a CA from a Secret
//! makes a TLS connection with no file written (TMPDIR names no directory); Backends beyond the
//! namespace bound wait, unconnected, for a place.

use settle_testkit as common;

use std::time::Duration;

use common::operator::{NatsServer, Operator, condition, poll};
use common::subs::{
    apply, backend_ready, backend_yaml, backends, nats_backend_yaml, nats_credentials, nats_tls,
    wait_backend,
};
use common::{free_port, install_crds, kubectl_ok, namespace};
use kube::Api;
use settle::api::Backend;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backends_report_connected_unreachable_auth_failed_and_pick_up_a_fixed_secret() {
    install_crds();
    let ns = namespace("rec-backend");
    let _op = Operator::start("backend", &ns);
    let api: Api<Backend> = Api::namespaced(common::kube_client().await, &ns);
    let env = common::env();

    // Reachable: Ready, with the server's version and the capabilities of its kind.
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&backend_yaml("good", &env.nats_url)),
    );
    let good = wait_backend(&api, "good", "True", "Connected").await;
    let st = good.status.expect("status");
    let version = st.server_version.expect("serverVersion");
    assert!(version.starts_with("2."), "serverVersion {version}");
    assert_eq!(
        st.capabilities,
        Some(settle::policy::capabilities_of(
            settle::policy::BackendKind::Nats
        ))
    );
    assert_eq!(st.observed_generation, good.metadata.generation);

    // A closed port: Unreachable, and the message says what to check.
    let closed = format!("nats://127.0.0.1:{}", free_port());
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&backend_yaml("closed", &closed)),
    );
    let b = wait_backend(&api, "closed", "False", "Unreachable").await;
    let (_, _, m) = condition(&b.status.expect("status").conditions, "Ready").expect("Ready");
    assert!(m.contains("spec.nats.servers"), "{m}");

    // A server with a user and password, and a Secret with the wrong password: AuthFailed.
    let server = NatsServer::start(&["--user", "app", "--pass", "right"]);
    kubectl_ok(
        &[
            "create",
            "secret",
            "generic",
            "creds",
            "-n",
            &ns,
            "--from-literal=user=app",
            "--from-literal=password=wrong",
        ],
        None,
    );
    common::label_backend_secret(&ns, "creds");
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&nats_backend_yaml(
            "auth",
            &server.url(),
            &nats_credentials("creds"),
        )),
    );
    let b = wait_backend(&api, "auth", "False", "AuthFailed").await;
    let (_, _, m) = condition(&b.status.expect("status").conditions, "Ready").expect("Ready");
    assert!(m.contains("credentialsSecretRef"), "{m}");

    // The Secret fixed: Ready, with nothing restarted.
    let fixed = kubectl_ok(
        &[
            "create",
            "secret",
            "generic",
            "creds",
            "-n",
            &ns,
            "--from-literal=user=app",
            "--from-literal=password=right",
            "--dry-run=client",
            "-o",
            "yaml",
        ],
        None,
    );
    kubectl_ok(&["apply", "-n", &ns, "-f", "-"], Some(&fixed));
    wait_backend(&api, "auth", "True", "PlaintextCredentials").await;

    // A Secret that does not exist: SecretMissing, naming it.
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&nats_backend_yaml(
            "nosecret",
            &env.nats_url,
            &nats_credentials("absent"),
        )),
    );
    let b = wait_backend(&api, "nosecret", "False", "SecretMissing").await;
    let (_, _, m) = condition(&b.status.expect("status").conditions, "Ready").expect("Ready");
    assert!(m.contains("\"absent\""), "{m}");

    // The memory backend: Ready in process, its capabilities from its kind, no version.
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: mem}\nspec:\n  memory: {}\n",
        ),
    );
    let b = wait_backend(&api, "mem", "True", "InProcess").await;
    let st = b.status.expect("status");
    assert_eq!(st.server_version, None);
    assert_eq!(
        st.capabilities,
        Some(settle::policy::capabilities_of(
            settle::policy::BackendKind::Memory
        ))
    );
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

fn ca_secret(ns: &str, name: &str, ca_pem: &str) {
    let secret = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": {"settle.dev/backend-credentials": "true"}},
        "stringData": {"ca.crt": ca_pem},
    });
    kubectl_ok(&["apply", "-n", ns, "-f", "-"], Some(&secret.to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_backend_with_a_ca_connects_over_tls_without_writing_a_file() {
    install_crds();
    let ns = namespace("rec-backend-tls");
    let files = tempfile::tempdir().expect("tempdir");
    let (ca_pem, tls_args) = common::nats_tls_files(files.path(), "127.0.0.1");
    let args: Vec<&str> = tls_args.iter().map(String::as_str).collect();
    let server = NatsServer::start(&args);
    // As on the chart's read-only root filesystem: no directory to write a file into. TMPDIR
    // names one that does not exist, so any file the operator tried to write there would fail.
    let no_tmp = files.path().join("no-such-dir");
    let no_tmp = no_tmp.to_str().expect("utf-8 path");
    let op = Operator::spawn_env(
        "backend-tls",
        &ns,
        &["--leader-election=false"],
        &[("TMPDIR", no_tmp)],
    );
    op.wait_ready();
    let api: Api<Backend> = Api::namespaced(common::kube_client().await, &ns);

    // The CA from the Secret: Ready over TLS, with the server's version.
    ca_secret(&ns, "nats-ca", &ca_pem);
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&nats_backend_yaml(
            "tls",
            &server.url(),
            &nats_tls("nats-ca"),
        )),
    );
    let b = wait_backend(&api, "tls", "True", "Connected").await;
    assert!(
        b.status
            .and_then(|s| s.server_version)
            .is_some_and(|v| v.starts_with("2.")),
        "serverVersion is the TLS server's"
    );

    // Only that CA is trusted: a server certificate another CA signed is refused, and said so.
    let other = settle_operator::admission::certs::issue_for(
        &settle_operator::admission::certs::Sans {
            dns_names: vec![],
            ip_addresses: vec!["127.0.0.1".parse().expect("ip")],
        },
        Duration::from_secs(3600),
    )
    .expect("issue another CA");
    ca_secret(&ns, "other-ca", &other.ca_pem);
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&nats_backend_yaml(
            "wrong-ca",
            &server.url(),
            &nats_tls("other-ca"),
        )),
    );
    let m = poll(
        "Backend wrong-ca to be Ready=False",
        Duration::from_secs(60),
        || async {
            let (s, r, m, _) = backend_ready(&api, "wrong-ca").await?;
            if s == "False" {
                Ok(m)
            } else {
                Err(format!("Ready={s} {r}: {m}"))
            }
        },
    )
    .await;
    assert!(m.contains("invalid peer certificate"), "{m}");

    // And a Secret whose ca.crt is not a certificate: said so, naming the field (the reason a
    // NATS Backend's unusable Secret data has always had).
    ca_secret(&ns, "junk-ca", "not a certificate\n");
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&nats_backend_yaml(
            "junk-ca",
            &server.url(),
            &nats_tls("junk-ca"),
        )),
    );
    let b = wait_backend(&api, "junk-ca", "False", "SecretMissing").await;
    let (_, _, m) = condition(&b.status.expect("status").conditions, "Ready").expect("Ready");
    assert_eq!(
        m,
        "the CA (spec.nats.tls.caSecretRef, key \"ca.crt\") holds no PEM certificate: fix the Secret or spec.nats"
    );
    assert!(
        !std::path::Path::new(no_tmp).exists(),
        "nothing made the temporary directory"
    );
    drop(op);
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

/// Settle's Event recorder against the real API server: a repeat within the fold window is one
/// Event whose series counts it, another reason is another Event, and an Event deleted on the
/// API server (expired) is published anew rather than lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_events_fold_into_one_series_and_a_deleted_one_is_published_again() {
    use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference};
    use k8s_openapi::api::events::v1::Event as K8sEvent;
    use kube::api::{DeleteParams, ListParams, PostParams};
    use kube::{Resource, ResourceExt};
    use settle_operator::events::{Event, EventType, Recorder, Reporter};

    let ns = namespace("rec-events");
    let client = common::kube_client().await;
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let mut map = ConfigMap::default();
    map.metadata.name = Some("regarding".into());
    let map = maps
        .create(&PostParams::default(), &map)
        .await
        .expect("a ConfigMap to regard");
    let regarding: ObjectReference = map.object_ref(&());
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "settle-test".into(),
            instance: None,
        },
    );
    let warn = |reason: &str, note: &str| Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(note.into()),
        action: "Connect".into(),
        secondary: None,
    };
    for i in 0..3 {
        recorder
            .publish(&warn("Unreachable", &format!("attempt {i}")), &regarding)
            .await
            .expect("publish");
    }
    recorder
        .publish(&warn("AuthFailed", "bad password"), &regarding)
        .await
        .expect("publish");
    let events: Api<K8sEvent> = Api::namespaced(client, &ns);
    let list = events.list(&ListParams::default()).await.expect("list");
    let by_reason = |list: &[K8sEvent], reason: &str| -> Vec<K8sEvent> {
        list.iter()
            .filter(|e| e.reason.as_deref() == Some(reason))
            .cloned()
            .collect()
    };
    let unreachable = by_reason(&list.items, "Unreachable");
    assert_eq!(unreachable.len(), 1, "one Event for three: {unreachable:?}");
    assert_eq!(
        unreachable[0].series.as_ref().map(|s| s.count),
        Some(3),
        "{unreachable:?}"
    );
    assert_eq!(
        unreachable[0].note.as_deref(),
        Some("attempt 0"),
        "a repeat keeps the first note"
    );
    assert_eq!(
        unreachable[0]
            .regarding
            .as_ref()
            .and_then(|r| r.uid.clone()),
        map.uid()
    );
    assert_eq!(by_reason(&list.items, "AuthFailed").len(), 1);

    events
        .delete(&unreachable[0].name_any(), &DeleteParams::default())
        .await
        .expect("delete the Event");
    recorder
        .publish(&warn("Unreachable", "after it expired"), &regarding)
        .await
        .expect("publish after the Event was deleted");
    let list = events.list(&ListParams::default()).await.expect("list");
    let again = by_reason(&list.items, "Unreachable");
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!(again[0].note.as_deref(), Some("after it expired"));
    assert!(again[0].series.is_none(), "a new Event: {again:?}");
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

/// A namespace with more Backends than `--max-backends-per-namespace`: the oldest that many
/// connect, the others are `BackendLimit` (counted in `settle_backends_over_limit`) and make no
/// connection; deleting one gives its place to the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backends_beyond_the_namespace_bound_are_not_connected_until_a_place_frees() {
    install_crds();
    let ns = namespace("rec-backend-limit");
    let env = common::env();
    let op = Operator::start_with(
        "backend-limit",
        &ns,
        &["--leader-election=false", "--max-backends-per-namespace=2"],
    );
    let api: Api<Backend> = backends(&ns).await;
    for name in ["a", "b", "c"] {
        apply(&ns, &backend_yaml(name, &env.nats_url));
    }
    // Made in one second, they are ordered by name: a and b are the oldest two.
    wait_backend(&api, "a", "True", "Connected").await;
    wait_backend(&api, "b", "True", "Connected").await;
    let c = wait_backend(&api, "c", "False", "BackendLimit").await;
    let (_, _, m) = condition(&c.status.expect("status").conditions, "Ready").expect("Ready");
    assert!(
        m.contains(&format!("namespace {ns} has 3 Backends"))
            && m.contains("--max-backends-per-namespace"),
        "{m}"
    );
    assert_eq!(
        op.metric("settle_backends_over_limit", &[("namespace", &ns)]),
        1.0
    );
    kubectl_ok(&["delete", "backend", "a", "-n", &ns], None);
    wait_backend(&api, "c", "True", "Connected").await;
    poll("the gauge back at 0", Duration::from_secs(30), || async {
        match op.metric("settle_backends_over_limit", &[("namespace", &ns)]) {
            0.0 => Ok(()),
            n => Err(format!("{n}")),
        }
    })
    .await;
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}
