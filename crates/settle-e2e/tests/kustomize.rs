//! The kustomize bases in config/: `kubectl kustomize config/default` is the chart's default
//! install (the same objects, the same CRDs as crds/), kube-score finds nothing critical in it,
//! and it applies to a real API server of the test's own (`--dry-run=server` first, then for
//! real), where its ServiceAccount may do what the README says and no more.

use settle_testkit as common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;

use common::controlplane::{ControlPlane, kubectl_at};
use common::install::{
    Operator, assert_no_rbac_wildcard, assert_operator_rbac, assert_settle_mutating_webhook,
    assert_settle_webhook, docs, first_difference, kube_score, normalise_numbers, render_chart,
    shipped_mutating_configuration, shipped_webhook_configuration, webhook_behaviour,
};
use common::root;

/// `kubectl kustomize config/<base>`.
fn kustomize(base: &str) -> String {
    let dir = root().join("config").join(base);
    // kubectl kustomize reads files only; any kubeconfig will do.
    let out = kubectl_at(
        &root().join("target/no-kubeconfig"),
        &["kustomize", common::path_str(&dir)],
        None,
    );
    assert!(
        out.status.success(),
        "kubectl kustomize config/{base}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Objects by "Kind namespace/name".
fn by_key(objects: Vec<Value>) -> BTreeMap<String, Value> {
    objects
        .into_iter()
        .map(|o| {
            let key = format!(
                "{} {}/{}",
                o["kind"].as_str().unwrap_or("?"),
                o["metadata"]["namespace"].as_str().unwrap_or(""),
                o["metadata"]["name"].as_str().unwrap_or("?")
            );
            (key, o)
        })
        .collect()
}

#[test]
fn kustomize_crds_are_the_crds_dir() {
    let crds = std::fs::read_to_string(root().join("crds/settle.yaml")).expect("crds/settle.yaml");
    let copy = std::fs::read_to_string(root().join("config/crd/settle.yaml"))
        .expect("config/crd/settle.yaml");
    assert!(
        copy == crds,
        "config/crd/settle.yaml differs from crds/settle.yaml: run `make crds`"
    );
    let rendered = by_key(docs(&kustomize("crd")));
    let wanted = by_key(docs(&crds));
    assert_eq!(
        rendered.keys().collect::<Vec<_>>(),
        vec![
            "CustomResourceDefinition /backends.messaging.settle.dev",
            "CustomResourceDefinition /subscriptions.messaging.settle.dev"
        ]
    );
    let default = by_key(docs(&kustomize("default")));
    for (key, crd) in &wanted {
        for (what, got) in [
            ("config/crd", rendered.get(key)),
            ("config/default", default.get(key)),
        ] {
            let got = normalise_numbers(got.unwrap_or(&Value::Null));
            if let Some(diff) = first_difference(&got, &normalise_numbers(crd)) {
                panic!(
                    "kubectl kustomize {what}: {key} is not the one in crds/settle.yaml: at {diff}"
                );
            }
        }
    }
}

/// config/default and `helm install settle charts/settle -n settle-system` with the chart's
/// defaults create the same objects, field for field; only the labels Helm adds differ.
#[test]
fn kustomize_default_is_the_charts_default_install() {
    let mut kustomized = by_key(docs(&kustomize("default")));
    let mut charted = by_key(docs(&render_chart(&[], true)));
    let namespace = kustomized
        .remove("Namespace /settle-system")
        .expect("config/default creates the namespace settle-system");
    assert_eq!(namespace["metadata"]["name"], "settle-system");
    assert_eq!(
        kustomized.keys().collect::<Vec<_>>(),
        charted.keys().collect::<Vec<_>>(),
        "config/default and the chart create different objects"
    );
    let mut differ = Vec::new();
    for (key, k) in kustomized.iter_mut() {
        let c = charted.get_mut(key).expect("same keys");
        // Helm adds its own labels (managed-by, chart, version); the rest must be the same.
        let k_labels = k["metadata"]["labels"].take();
        let c_labels = c["metadata"]["labels"].take();
        for (name, value) in k_labels.as_object().into_iter().flatten() {
            if &c_labels[name] != value {
                differ.push(format!(
                    "{key}: label {name}={value}, the chart's is {}",
                    c_labels[name]
                ));
            }
        }
        if let Some(diff) = first_difference(&normalise_numbers(k), &normalise_numbers(c)) {
            differ.push(format!("{key}: config/default vs chart at {diff}"));
        }
    }
    assert!(
        differ.is_empty(),
        "config/default differs from the chart's defaults:\n{}",
        differ.join("\n")
    );
}

#[test]
fn kube_score_finds_nothing_critical_in_kustomize_default() {
    let rendered = kustomize("default");
    let score = kube_score(&rendered);
    assert!(
        score.critical.is_empty(),
        "kube-score reports CRITICAL findings nothing declines in config/default:\n{}",
        score.critical.join("\n")
    );
    let declined: Vec<&str> = score.declined.iter().map(String::as_str).collect();
    assert_eq!(
        declined,
        ["container-image-pull-policy", "pod-networkpolicy"]
    );
    assert_eq!(score.annotated, score.declined);
    assert_no_rbac_wildcard("config/default", &docs(&rendered));
}

#[test]
fn kustomize_default_applies_to_a_real_api_server() {
    let cp = ControlPlane::start("kustomize");
    let rendered = kustomize("default");
    let objects = docs(&rendered);

    // A server-side dry run needs the namespace its objects go into to exist already.
    cp.kubectl_ok(&["create", "namespace", "settle-system"], None);
    let dry = cp.kubectl_ok(&["apply", "--dry-run=server", "-f", "-"], Some(&rendered));
    for o in &objects {
        let name = o["metadata"]["name"].as_str().expect("name");
        assert!(
            dry.lines()
                .any(|l| l.contains(&format!("/{name} ")) && l.ends_with("(server dry run)")),
            "{} {name} not in the dry run's answer:\n{dry}",
            o["kind"]
        );
    }
    let crds = cp.kubectl_ok(&["get", "crd", "-o", "name"], None);
    assert!(!crds.contains("settle"), "a dry run stores nothing: {crds}");

    // For real: the CRDs are served, and the operator's ServiceAccount may do what it needs.
    cp.kubectl_ok(&["apply", "--server-side", "-f", "-"], Some(&rendered));
    common::wait_crds_established(|args| cp.kubectl_ok(args, None));
    let webhook: Value = serde_json::from_str(&cp.kubectl_ok(
        &[
            "get",
            "validatingwebhookconfiguration",
            "settle",
            "-o",
            "json",
        ],
        None,
    ))
    .expect("json");
    assert_settle_webhook("config/default's webhook configuration", &webhook);
    assert_eq!(
        webhook_behaviour(&webhook),
        webhook_behaviour(&shipped_webhook_configuration())
    );
    let mutating = cp.get_json(&["get", "mutatingwebhookconfiguration", "settle"]);
    assert_settle_mutating_webhook("config/default's mutating webhook", &mutating);
    assert_eq!(
        webhook_behaviour(&mutating),
        webhook_behaviour(&shipped_mutating_configuration())
    );
    let operator = Operator {
        namespace: "settle-system",
        service_account: "settle",
        certificate_secret: "settle-webhook-tls",
        lease: "settle-operator",
        webhook_configuration: "settle",
    };
    cp.kubectl_ok(&["create", "namespace", "team-a"], None);
    assert_operator_rbac(&cp, &operator, &[], &["team-a", "default"], false);

    // The Deployment as stored (no kubelet here, so no pods): the object the API server accepted.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = cp.kubectl(
            &[
                "get",
                "deployment",
                "settle",
                "-n",
                "settle-system",
                "-o",
                "jsonpath={.spec.replicas}",
            ],
            None,
        );
        if String::from_utf8_lossy(&out.stdout) == "2" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the Deployment settle with 2 replicas is not stored after 30s"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}
