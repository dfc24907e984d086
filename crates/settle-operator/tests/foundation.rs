//! The floor every other test stands on: the CRDs match the Rust types, install into a real
//! kube-apiserver, accept the samples, and the API server itself refuses malformed input with
//! a message naming the field; and a real nats-server with JetStream answers.

use settle_testkit as common;

use common::{install_crds, kubectl, kubectl_ok, namespace, root};

#[test]
fn crds_dir_matches_the_rust_types() {
    let generated = settle::api::crds_yaml().expect("CRDs serialize");
    let path = root().join("crds/settle.yaml");
    let on_disk = std::fs::read_to_string(&path).expect("crds/settle.yaml exists");
    assert!(
        generated == on_disk,
        "crds/settle.yaml is out of date with src/api: run `make crds` (cargo run -- crds > crds/settle.yaml) and commit it"
    );
}

#[test]
fn chart_crds_match_crds_dir() {
    let chart = root().join("charts/settle/crds/settle.yaml");
    let Ok(in_chart) = std::fs::read_to_string(&chart) else {
        panic!("{} is missing: run `make crds`", chart.display());
    };
    let on_disk =
        std::fs::read_to_string(root().join("crds/settle.yaml")).expect("crds/settle.yaml exists");
    assert!(
        in_chart == on_disk,
        "charts/settle/crds/settle.yaml differs from crds/settle.yaml: run `make crds`"
    );
}

#[test]
fn every_sample_applies() {
    install_crds();
    let ns = namespace("samples");
    let dir = root().join("config/samples");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("config/samples exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "yaml") && !p.ends_with("kustomization.yaml")
        })
        .collect();
    files.sort();
    assert!(
        files.len() >= 4,
        "expected the Backend and Subscription samples, found {files:?}"
    );
    for f in &files {
        let out = kubectl_ok(&["apply", "-n", &ns, "-f", common::path_str(f)], None);
        assert!(out.contains("created"), "{}: {out}", f.display());
    }
    let listed = kubectl_ok(
        &["get", "subscriptions,backends", "-n", &ns, "-o", "name"],
        None,
    );
    for name in [
        "subscription.messaging.settle.dev/orders",
        "backend.messaging.settle.dev/nats",
    ] {
        assert!(listed.contains(name), "{name} not listed in {listed}");
    }
    // Printer columns: Mode is shown.
    let table = kubectl_ok(&["get", "subscriptions", "-n", &ns], None);
    assert!(
        table.contains("MODE")
            && table.contains("DELIVERED")
            && table.contains("EXHAUSTED")
            && table.contains("STRANDED"),
        "{table}"
    );
    assert!(table.contains("AtLeastOnce"), "{table}");
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

/// Applies a manifest that must be refused, and returns the API server's message.
fn refused(ns: &str, manifest: &str) -> String {
    let out = kubectl(&["apply", "-n", ns, "-f", "-"], Some(manifest));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "expected the API server to refuse:\n{manifest}\nbut it said: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

fn subscription(name: &str, extra: &str) -> String {
    format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: {name}}}\nspec:\n  backendRef: {{name: nats}}\n  pattern: \"a.>\"\n{extra}"
    )
}

#[test]
fn api_server_refuses_bad_subscriptions_naming_the_field() {
    install_crds();
    let ns = namespace("cel");
    let cases = [
        (
            "  ackWait: 30 seconds\n",
            r#"spec.ackWait: Invalid value: "30 seconds": must be a duration such as 500ms, 30s, 5m or 1h30m (a number and a unit: ns, us, ms, s, m, h)"#,
        ),
        (
            "  maxNackDelay: -5s\n  mode: AtLeastOnce\n",
            r#"spec.maxNackDelay: Invalid value: "-5s": must not be negative"#,
        ),
        (
            "  maxProcessingTime: 0s\n",
            r#"spec.maxProcessingTime: Invalid value: "0s": must be greater than zero"#,
        ),
        (
            "  mode: AtLeastOnce\n  backoff: {initial: 1x, max: 1m}\n",
            r#"spec.backoff.initial: Invalid value: "1x": must be a duration such as 500ms"#,
        ),
        (
            "  mode: AtLeastOnce\n  backoff: {initial: 1s, max: 0ms}\n",
            r#"spec.backoff.max: Invalid value: "0ms": must be greater than zero"#,
        ),
        (
            "  mode: Sometimes\n",
            r#"spec.mode: Unsupported value: "Sometimes": supported values: "AtMostOnce", "AtLeastOnce""#,
        ),
        (
            "  slowHandler: Maybe\n",
            r#"spec.slowHandler: Unsupported value: "Maybe": supported values: "ExtendLease", "Redeliver""#,
        ),
        (
            "  maxInFlight: 0\n",
            "spec.maxInFlight: Invalid value: 0: spec.maxInFlight in body should be greater than or equal to 1",
        ),
        (
            "  mode: AtLeastOnce\n  durableName: d\n  maxDeliver: 0\n",
            "spec.maxDeliver: Invalid value: 0: spec.maxDeliver in body should be greater than or equal to 1",
        ),
        (
            "  shape: Queue\n",
            r#"spec.shape: Unsupported value: "Queue": supported values: "Fanout""#,
        ),
    ];
    for (i, (extra, want)) in cases.iter().enumerate() {
        let msg = refused(&ns, &subscription(&format!("bad-{i}"), extra));
        assert!(msg.contains(want), "case {i}: wanted {want:?} in:\n{msg}");
    }
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[test]
fn api_server_refuses_backends_without_exactly_one_kind() {
    install_crds();
    let ns = namespace("backendkinds");
    let want =
        "spec: Invalid value: exactly one backend kind must be set: nats, rabbitmq, sqs or memory";
    let two = "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: two}\nspec:\n  nats: {servers: [\"nats://x:4222\"]}\n  memory: {}\n";
    let zero = "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: zero}\nspec: {}\n";
    let sqs_too = "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: sqs-too}\nspec:\n  memory: {}\n  sqs: {region: eu-west-1}\n";
    for manifest in [two, zero, sqs_too] {
        let msg = refused(&ns, manifest);
        assert!(msg.contains(want), "wanted {want:?} in:\n{msg}");
    }
    let sqs = "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: queues}\nspec:\n  sqs: {region: eu-west-1, endpoint: \"http://127.0.0.1:9324\", queuePrefix: shop-}\n";
    kubectl_ok(&["apply", "-n", &ns, "-f", "-"], Some(sqs));
    let no_servers = "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {name: empty}\nspec:\n  nats: {servers: []}\n";
    let msg = refused(&ns, no_servers);
    assert!(msg.contains("spec.nats.servers: Invalid value: 0: spec.nats.servers in body should have at least 1 items"), "{msg}");
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[test]
fn api_server_refuses_a_change_of_a_backends_kind_naming_the_field() {
    install_crds();
    let ns = namespace("backendkind");
    let backend = |spec: &str| {
        format!(
            "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: orders}}\nspec:\n{spec}"
        )
    };
    let nats = backend("  nats: {servers: [\"nats://127.0.0.1:4222\"]}\n");
    kubectl_ok(&["apply", "-n", &ns, "-f", "-"], Some(&nats));
    let want = r#"The Backend "orders" is invalid: spec: Invalid value: the backend kind (nats, rabbitmq, sqs, memory) cannot change; delete the Backend and create a new one"#;
    // kubectl apply of the same Backend as another kind (the old kind removed), and a merge patch
    // doing the same: refused, and the stored Backend is still the nats one.
    for (how, out) in [
        (
            "apply",
            kubectl(
                &["apply", "-n", &ns, "-f", "-"],
                Some(&backend(
                    "  rabbitmq: {urls: [\"amqp://127.0.0.1:5672\"]}\n",
                )),
            ),
        ),
        (
            "patch",
            kubectl(
                &[
                    "patch",
                    "backend",
                    "orders",
                    "-n",
                    &ns,
                    "--type=merge",
                    "-p",
                    r#"{"spec":{"nats":null,"memory":{}}}"#,
                ],
                None,
            ),
        ),
    ] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{how}: a kind change was accepted");
        assert!(
            stderr.contains(want),
            "{how}: wanted {want:?} in:\n{stderr}"
        );
    }
    let kinds = kubectl_ok(
        &[
            "get",
            "backend",
            "orders",
            "-n",
            &ns,
            "-o",
            "jsonpath={.spec}",
        ],
        None,
    );
    assert!(
        kinds.contains("\"nats\"") && !kinds.contains("rabbitmq") && !kinds.contains("memory"),
        "{kinds}"
    );
    // What may change still does: the servers of the same kind.
    kubectl_ok(
        &["apply", "-n", &ns, "-f", "-"],
        Some(&backend("  nats: {servers: [\"nats://127.0.0.1:4223\"]}\n")),
    );
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}

#[test]
fn kubectl_explain_shows_the_doc_comments() {
    install_crds();
    // Discovery is cached by kubectl; retry briefly right after the CRDs are established.
    let mut last = String::new();
    for _ in 0..20 {
        let out = kubectl(&["explain", "subscription.spec.backoff"], None);
        last = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    assert!(
        last.contains("How long a declined (nacked or silent) message waits before its next"),
        "{last}"
    );
    assert!(
        last.contains("multiplier") && last.contains("The wait after the first decline"),
        "{last}"
    );
    let mode = kubectl_ok(&["explain", "subscription.spec.mode"], None);
    assert!(mode.contains("requires durableName"), "{mode}");
}

#[tokio::test]
async fn nats_server_runs_jetstream() {
    let env = common::env();
    let client = async_nats::connect(&env.nats_url)
        .await
        .expect("connect to nats-server");
    let version = client.server_info().version;
    assert!(
        version.starts_with("2.15"),
        "the pinned nats-server is 2.15.x, got {version}"
    );
    let js = async_nats::jetstream::new(client);
    let name = format!("FOUNDATION_{}", std::process::id());
    let subject = format!("foundation.{}", std::process::id());
    let mut stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{subject}.>")],
            ..Default::default()
        })
        .await
        .expect("create stream");
    js.publish(format!("{subject}.one"), "hello".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    let info = stream.info().await.expect("stream info");
    assert_eq!(info.state.messages, 1);
    js.delete_stream(&name).await.expect("delete stream");
}
