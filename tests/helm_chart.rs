//! The Helm chart on a real API server with the pinned helm: lint, install, upgrade, uninstall.
//! No pods run here (there is no kubelet), so this checks what the chart creates, not the pods.

mod common;

use std::process::Command;

use common::{kubectl, kubectl_ok, root};

fn helm(args: &[&str]) -> String {
    let env = common::env();
    let out = Command::new(&env.helm)
        .args(args)
        .env("KUBECONFIG", &env.kubeconfig)
        .env("HELM_CACHE_HOME", root().join("target/helm/cache"))
        .env("HELM_CONFIG_HOME", root().join("target/helm/config"))
        .env("HELM_DATA_HOME", root().join("target/helm/data"))
        .output()
        .expect("helm runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "helm {args:?} failed:\n{text}");
    text
}

#[test]
fn chart_installs_upgrades_and_uninstalls() {
    let chart = root().join("charts/settle");
    let chart = common::path_str(&chart);
    let lint = helm(&["lint", "--strict", chart]);
    assert!(
        lint.contains("1 chart(s) linted, 0 chart(s) failed"),
        "{lint}"
    );

    let ns = format!("settle-helm-{}", std::process::id());
    let release = format!("settle-{}", std::process::id());
    // Scope the webhook to namespaces carrying a label nobody has, so the other tests running
    // on this API server are not sent to a webhook with no pods behind it.
    let selector =
        format!("webhook.namespaceSelector.matchLabels.settle\\.dev/helm-test={release}");
    helm(&[
        "install",
        &release,
        chart,
        "-n",
        &ns,
        "--create-namespace",
        "--set",
        &selector,
        "--set",
        "image.tag=test",
    ]);

    for crd in [
        "crd/backends.messaging.settle.dev",
        "crd/subscriptions.messaging.settle.dev",
    ] {
        kubectl_ok(&["get", crd], None);
    }
    let image = kubectl_ok(
        &[
            "get",
            "deployment",
            &release,
            "-n",
            &ns,
            "-o",
            "jsonpath={.spec.template.spec.containers[0].image}",
        ],
        None,
    );
    assert_eq!(image, "ghcr.io/settle-dev/settle:test");
    let args = kubectl_ok(
        &[
            "get",
            "deployment",
            &release,
            "-n",
            &ns,
            "-o",
            "jsonpath={.spec.template.spec.containers[0].args}",
        ],
        None,
    );
    assert_eq!(args, r#"["operator"]"#);
    let env = kubectl_ok(
        &[
            "get",
            "deployment",
            &release,
            "-n",
            &ns,
            "-o",
            "jsonpath={.spec.template.spec.containers[0].env[*].name}",
        ],
        None,
    );
    for var in [
        "SETTLE_NAMESPACE",
        "SETTLE_WEBHOOK_ADDR",
        "SETTLE_WEBHOOK_CONFIGURATION",
        "SETTLE_WEBHOOK_DNS_NAMES",
    ] {
        assert!(env.contains(var), "{var} missing from {env}");
    }
    let webhook = kubectl_ok(
        &[
            "get",
            "validatingwebhookconfiguration",
            &release,
            "-o",
            "json",
        ],
        None,
    );
    let webhook: serde_json::Value = serde_json::from_str(&webhook).expect("json");
    let hook = &webhook["webhooks"][0];
    assert_eq!(hook["failurePolicy"], "Fail");
    assert_eq!(hook["sideEffects"], "None");
    assert_eq!(
        hook["clientConfig"]["service"]["name"],
        format!("{release}-webhook")
    );
    assert_eq!(hook["clientConfig"]["service"]["namespace"], ns.as_str());
    assert_eq!(hook["rules"][0]["resources"][0], "subscriptions");
    kubectl_ok(
        &["get", "service", &format!("{release}-webhook"), "-n", &ns],
        None,
    );

    // The operator's service account may do what the operator does, and no more.
    let sa = format!("system:serviceaccount:{ns}:{release}");
    let can = |verb: &str, resource: &str, extra: &[&str]| {
        let mut args = vec!["auth", "can-i", verb, resource, "--as", &sa];
        args.extend_from_slice(extra);
        String::from_utf8_lossy(&kubectl(&args, None).stdout)
            .trim()
            .to_string()
    };
    assert_eq!(
        can(
            "patch",
            "subscriptions.messaging.settle.dev/status",
            &["-n", "default"]
        ),
        "yes"
    );
    assert_eq!(can("create", "secrets", &["-n", &ns]), "yes");
    assert_eq!(can("create", "secrets", &["-n", "default"]), "no");
    assert_eq!(
        can(
            "patch",
            &format!("validatingwebhookconfigurations/{release}"),
            &[]
        ),
        "yes"
    );
    assert_eq!(
        can("patch", "validatingwebhookconfigurations/someone-else", &[]),
        "no"
    );
    assert_eq!(
        can(
            "delete",
            "subscriptions.messaging.settle.dev",
            &["-n", "default"]
        ),
        "no"
    );

    helm(&[
        "upgrade",
        &release,
        chart,
        "-n",
        &ns,
        "--reuse-values",
        "--set",
        "replicas=3",
    ]);
    let replicas = kubectl_ok(
        &[
            "get",
            "deployment",
            &release,
            "-n",
            &ns,
            "-o",
            "jsonpath={.spec.replicas}",
        ],
        None,
    );
    assert_eq!(replicas, "3");

    helm(&["uninstall", &release, "-n", &ns]);
    let gone = kubectl(&["get", "validatingwebhookconfiguration", &release], None);
    assert!(
        !gone.status.success(),
        "the webhook configuration is removed with the release"
    );
    let gone = kubectl(&["get", "deployment", &release, "-n", &ns], None);
    assert!(
        !gone.status.success(),
        "the deployment is removed with the release"
    );
    // Helm keeps CRDs (and so everyone's Subscriptions) on uninstall.
    kubectl_ok(&["get", "crd/subscriptions.messaging.settle.dev"], None);
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}
