//! The Helm chart with the pinned helm and kube-score: its values schema, kube-score's verdict
//! on what it renders, and an install, upgrade and uninstall on an API server of the test's own
//! that has never seen Settle's CRDs (so "the chart installs the CRDs" is the chart's doing).
//! No pods run here (there is no kubelet), so this checks what the chart creates and what its
//! ServiceAccount may do, not the pods.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use common::controlplane::ControlPlane;
use common::install::{
    Operator, assert_no_rbac_wildcard, assert_operator_rbac, assert_settle_webhook, chart, docs,
    helm, helm_run, kube_score, render_chart, shipped_webhook_configuration, webhook_behaviour,
};
use common::root;

fn render(sets: &[&str]) -> String {
    render_chart(sets, false)
}

#[test]
fn values_schema_refuses_bad_values_naming_them() {
    let chart = chart();
    let lint = helm(None, &["lint", "--strict", &chart]);
    assert!(
        lint.contains("1 chart(s) linted, 0 chart(s) failed"),
        "{lint}"
    );
    render(&[]); // the defaults are valid

    // (--set, what helm's error must name)
    let cases = [
        ("replicas=abc", "at '/replicas': got string, want integer"),
        ("replicas=0", "at '/replicas': minimum"),
        ("replica=3", "additional properties 'replica' not allowed"),
        ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
        ("image.digest=latest", "at '/image/digest'"),
        ("logFormat=xml", "at '/logFormat'"),
        ("watchNamespaces={Team_A}", "at '/watchNamespaces/0'"),
        (
            "rbac.secretsClusterWide=yes",
            "at '/rbac/secretsClusterWide': got string, want boolean",
        ),
        (
            "leaderElection.enabled=maybe",
            "at '/leaderElection/enabled'",
        ),
        (
            "controller.resyncInterval=5",
            "at '/controller/resyncInterval': got number, want string",
        ),
        (
            "controller.resyncInterval=soon",
            "at '/controller/resyncInterval'",
        ),
        (
            "controller.concurrency=0",
            "at '/controller/concurrency': minimum",
        ),
        ("webhook.failurePolicy=Maybe", "at '/webhook/failurePolicy'"),
        ("webhook.port=70000", "at '/webhook/port': maximum"),
        (
            "webhook.certificate.mode=vault",
            "at '/webhook/certificate/mode'",
        ),
        (
            "securityContext.runAsUser=1000",
            "at '/securityContext/runAsUser': minimum",
        ),
        (
            "securityContext.runAsGroup=0",
            "at '/securityContext/runAsGroup': minimum",
        ),
        ("resources.limits.cpu=lots", "at '/resources/limits/cpu'"),
        (
            "resources.limits.gpu=1",
            "additional properties 'gpu' not allowed",
        ),
        (
            "podDisruptionBudget.maxUnavailable=half",
            "at '/podDisruptionBudget/maxUnavailable'",
        ),
        (
            "networkPolicy.brokers.ports={0}",
            "at '/networkPolicy/brokers/ports/0': minimum",
        ),
    ];
    let mut wrong = Vec::new();
    for (set, wanted) in cases {
        let out = helm_run(
            None,
            &[
                "template",
                "settle",
                &chart,
                "-n",
                "settle-system",
                "--set",
                set,
            ],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() || !stderr.contains(wanted) {
            wrong.push(format!(
                "--set {set}: exit {}, wanted an error containing {wanted:?}, got:\n{stderr}",
                out.status
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// kube-score on the chart rendered with its defaults and with the other values a platform
/// team sets: nothing CRITICAL that is not declined, and every decline is the one values.yaml
/// explains.
#[test]
fn kube_score_finds_nothing_critical_in_the_chart() {
    let values = std::fs::read_to_string(root().join("charts/settle/values.yaml")).expect("values");
    let variants: [(&str, &[&str], &[&str]); 4] = [
        (
            "defaults",
            &[],
            &["container-image-pull-policy", "pod-networkpolicy"],
        ),
        (
            "NetworkPolicy on, pulled Always",
            &["networkPolicy.enabled=true", "image.pullPolicy=Always"],
            &[],
        ),
        (
            "watched namespaces, cert-manager, digest",
            &[
                "watchNamespaces={team-a,team-b}",
                "webhook.certificate.mode=certManager",
                "webhook.certificate.certManagerIssuer.kind=ClusterIssuer",
                "webhook.certificate.certManagerIssuer.name=ca",
                "image.digest=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            ],
            &["container-image-pull-policy", "pod-networkpolicy"],
        ),
        (
            "one replica, Secrets cluster-wide",
            &["replicas=1", "rbac.secretsClusterWide=true"],
            &["container-image-pull-policy", "pod-networkpolicy"],
        ),
    ];
    for (name, sets, declined) in variants {
        let rendered = render(sets);
        let kinds: BTreeSet<String> = docs(&rendered)
            .iter()
            .filter_map(|d| d["kind"].as_str().map(str::to_string))
            .collect();
        for kind in ["Deployment", "PodDisruptionBudget", "Service"] {
            assert!(
                kinds.contains(kind),
                "{name}: no {kind} rendered: {kinds:?}"
            );
        }
        let score = kube_score(&rendered);
        assert!(
            score.critical.is_empty(),
            "{name}: kube-score reports CRITICAL findings nothing declines:\n{}",
            score.critical.join("\n")
        );
        let wanted: BTreeSet<String> = declined.iter().map(|s| s.to_string()).collect();
        assert_eq!(
            score.declined, wanted,
            "{name}: the checks declined (CRITICAL without their kube-score/ignore annotation)"
        );
        assert_eq!(
            score.annotated, wanted,
            "{name}: every kube-score/ignore names a check that would otherwise be CRITICAL"
        );
        for id in &score.declined {
            assert!(
                values.contains(id.as_str()),
                "{name}: {id} is declined but values.yaml does not say why"
            );
        }
        println!(
            "{name}: 0 critical, {} warnings {:?}, declined {:?}",
            score.warnings.len(),
            score.warnings,
            score.declined
        );
    }
}

#[test]
fn chart_rbac_has_no_wildcard() {
    for sets in [
        &[][..],
        &["watchNamespaces={a,b}"][..],
        &[
            "rbac.secretsClusterWide=true",
            "leaderElection.enabled=false",
        ][..],
    ] {
        assert_no_rbac_wildcard(&format!("chart with {sets:?}"), &docs(&render(sets)));
    }
}

/// The operator settings fixed for the controllers come from values, and only the listed
/// namespaces get a Secrets Role.
#[test]
fn chart_renders_the_operator_settings_from_values() {
    let find = |docs: &[Value], kind: &str, name: &str, ns: &str| -> Option<Value> {
        docs.iter()
            .find(|d| {
                d["kind"] == kind
                    && d["metadata"]["name"] == name
                    && d["metadata"]["namespace"].as_str().unwrap_or("") == ns
            })
            .cloned()
    };
    let env_of = |deployment: &Value| -> Vec<(String, String)> {
        deployment["spec"]["template"]["spec"]["containers"][0]["env"]
            .as_array()
            .expect("env")
            .iter()
            .map(|e| {
                let value = match e.get("value") {
                    Some(v) => v.as_str().expect("string value").to_string(),
                    None => format!(
                        "fieldRef:{}",
                        e["valueFrom"]["fieldRef"]["fieldPath"]
                            .as_str()
                            .unwrap_or("?")
                    ),
                };
                (e["name"].as_str().expect("name").to_string(), value)
            })
            .collect()
    };

    let defaults = docs(&render(&[]));
    let deployment = find(&defaults, "Deployment", "settle", "settle-system").expect("Deployment");
    let env = env_of(&deployment);
    for (name, value) in [
        ("POD_NAME", "fieldRef:metadata.name"),
        ("SETTLE_NAMESPACE", "fieldRef:metadata.namespace"),
        ("SETTLE_LEADER_ELECTION", "true"),
        ("SETTLE_LEASE_NAME", "settle-operator"),
        ("SETTLE_RESYNC_INTERVAL", "5m"),
        ("SETTLE_CONCURRENCY", "4"),
        ("SETTLE_STATS_INTERVAL", "10s"),
        ("SETTLE_LOSS_WINDOW", "15m"),
        ("SETTLE_WEBHOOK_CONFIGURATION", "settle"),
    ] {
        assert!(
            env.contains(&(name.to_string(), value.to_string())),
            "{name}={value} missing from {env:?}"
        );
    }
    assert!(
        !env.iter().any(|(n, _)| n == "SETTLE_WATCH_NAMESPACES"),
        "no watch list by default (all namespaces): {env:?}"
    );
    assert!(
        !defaults
            .iter()
            .any(|d| d["kind"] == "Role" && d["metadata"]["name"] == "settle-secrets"),
        "no Secrets Role without watched namespaces"
    );
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(pod["securityContext"]["runAsUser"], 65532);
    assert_eq!(pod["securityContext"]["runAsGroup"], 65532);
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(
        container["securityContext"]["allowPrivilegeEscalation"],
        false
    );
    assert_eq!(container["resources"]["limits"]["cpu"], "1");
    assert_eq!(
        container["resources"]["requests"]["ephemeral-storage"],
        "64Mi"
    );
    assert_eq!(container["image"], "ghcr.io/settle-dev/settle:0.1.0");
    let anti =
        &pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0];
    assert_eq!(
        anti["podAffinityTerm"]["topologyKey"],
        "kubernetes.io/hostname"
    );
    assert_eq!(
        anti["podAffinityTerm"]["labelSelector"]["matchLabels"],
        deployment["spec"]["selector"]["matchLabels"],
        "the anti-affinity selects this Deployment's own pods"
    );
    let pdb = find(&defaults, "PodDisruptionBudget", "settle", "settle-system").expect("PDB");
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    assert_eq!(pdb["spec"]["selector"], deployment["spec"]["selector"]);
    assert!(find(&defaults, "NetworkPolicy", "settle", "settle-system").is_none());

    let set = docs(&render(&[
        "watchNamespaces={team-a,team-b}",
        "leaderElection.enabled=false",
        "leaderElection.leaseName=mine",
        "controller.concurrency=16",
        "controller.resyncInterval=1m",
        "image.digest=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        "networkPolicy.enabled=true",
        "webhook.certificate.mode=certManager",
        "webhook.certificate.certManagerIssuer.kind=ClusterIssuer",
        "webhook.certificate.certManagerIssuer.name=ca",
    ]));
    let deployment = find(&set, "Deployment", "settle", "settle-system").expect("Deployment");
    let env = env_of(&deployment);
    for (name, value) in [
        ("SETTLE_WATCH_NAMESPACES", "team-a,team-b"),
        ("SETTLE_LEADER_ELECTION", "false"),
        ("SETTLE_LEASE_NAME", "mine"),
        ("SETTLE_CONCURRENCY", "16"),
        ("SETTLE_RESYNC_INTERVAL", "1m"),
        ("SETTLE_WEBHOOK_CONFIGURATION", ""),
    ] {
        assert!(
            env.contains(&(name.to_string(), value.to_string())),
            "{name}={value} missing from {env:?}"
        );
    }
    assert_eq!(
        deployment["spec"]["template"]["spec"]["containers"][0]["image"],
        "ghcr.io/settle-dev/settle@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    );
    for ns in ["team-a", "team-b"] {
        let role = find(&set, "Role", "settle-secrets", ns)
            .unwrap_or_else(|| panic!("no Secrets Role in {ns}"));
        assert_eq!(
            role["rules"],
            json!([{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "watch"]}])
        );
        let binding = find(&set, "RoleBinding", "settle-secrets", ns).expect("binding");
        assert_eq!(
            binding["subjects"],
            json!([{"kind": "ServiceAccount", "name": "settle", "namespace": "settle-system"}])
        );
    }
    // cert-manager serves the certificate and leader election is off: no own-namespace Role.
    assert!(find(&set, "Role", "settle", "settle-system").is_none());
    let policy = find(&set, "NetworkPolicy", "settle", "settle-system").expect("NetworkPolicy");
    assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress", "Egress"]));
    assert_eq!(
        policy["spec"]["ingress"],
        json!([{"ports": [{"port": 8443, "protocol": "TCP"}]}, {"ports": [{"port": 8080, "protocol": "TCP"}]}])
    );
    assert_eq!(
        policy["spec"]["egress"],
        json!([
            {"ports": [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]},
            {"ports": [{"port": 4222, "protocol": "TCP"}]},
            {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
        ])
    );
}

fn get_json(cp: &ControlPlane, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    serde_json::from_str(&cp.kubectl_ok(&all, None)).expect("kubectl -o json")
}

/// Polls until `kubectl get` of the object fails (it is gone).
fn wait_gone(cp: &ControlPlane, args: &[&str], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while cp.kubectl(args, None).status.success() {
        assert!(Instant::now() < deadline, "{what} still exists after 60s");
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn chart_installs_on_an_api_server_without_crds_then_upgrades_and_uninstalls() {
    let cp = ControlPlane::start("helm-chart");
    let kubeconfig = Some(cp.kubeconfig.as_path());
    let chart = chart();
    let before = cp.kubectl_ok(&["get", "crd", "-o", "name"], None);
    assert!(
        !before.contains("messaging.settle.dev"),
        "a fresh API server has no Settle CRDs: {before}"
    );
    for ns in ["team-a", "team-b"] {
        cp.kubectl_ok(&["create", "namespace", ns], None);
    }

    let installed = helm(
        kubeconfig,
        &[
            "install",
            "settle",
            &chart,
            "-n",
            "settle-system",
            "--create-namespace",
            "--set",
            "image.tag=test",
            "--set",
            "watchNamespaces={team-a}",
        ],
    );
    // NOTES.txt tells what was installed and how to check it.
    for line in [
        "kubectl -n settle-system rollout status deployment/settle",
        "get lease settle-operator",
        "Watched namespaces: team-a.",
        "Secrets: the operator may read Secrets only in team-a",
        "The webhook fails closed",
    ] {
        assert!(
            installed.contains(line),
            "NOTES lack {line:?}:\n{installed}"
        );
    }
    assert!(!installed.contains("WARNING"), "{installed}");

    // The CRDs are the chart's doing: they were not there before.
    cp.kubectl_ok(
        &[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/backends.messaging.settle.dev",
            "crd/subscriptions.messaging.settle.dev",
        ],
        None,
    );
    let deployment = get_json(&cp, &["get", "deployment", "settle", "-n", "settle-system"]);
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["image"], "ghcr.io/settle-dev/settle:test");
    assert_eq!(container["args"], json!(["operator"]));
    let env: Vec<&str> = container["env"]
        .as_array()
        .expect("env")
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    for var in [
        "SETTLE_NAMESPACE",
        "SETTLE_WEBHOOK_ADDR",
        "SETTLE_WEBHOOK_CONFIGURATION",
        "SETTLE_WEBHOOK_DNS_NAMES",
        "SETTLE_WATCH_NAMESPACES",
        "SETTLE_LEADER_ELECTION",
        "SETTLE_LEASE_NAME",
        "POD_NAME",
    ] {
        assert!(env.contains(&var), "{var} missing from {env:?}");
    }
    let pdb = get_json(
        &cp,
        &[
            "get",
            "poddisruptionbudget",
            "settle",
            "-n",
            "settle-system",
        ],
    );
    assert_eq!(pdb["spec"]["selector"], deployment["spec"]["selector"]);
    cp.kubectl_ok(
        &["get", "service", "settle-webhook", "-n", "settle-system"],
        None,
    );

    // The webhook configuration as the API server stored it behaves as the shipped one.
    let webhook = get_json(&cp, &["get", "validatingwebhookconfiguration", "settle"]);
    assert_settle_webhook("the chart's webhook configuration", &webhook);
    assert_eq!(
        webhook_behaviour(&webhook),
        webhook_behaviour(&shipped_webhook_configuration()),
        "the chart's webhook and config/webhook/validating-webhook.yaml differ"
    );
    let service = &webhook["webhooks"][0]["clientConfig"]["service"];
    assert_eq!(service["name"], "settle-webhook");
    assert_eq!(service["namespace"], "settle-system");

    // What the operator's ServiceAccount may do: as the README says, and no more.
    let operator = Operator {
        namespace: "settle-system",
        service_account: "settle",
        certificate_secret: "settle-webhook-tls",
        lease: "settle-operator",
        webhook_configuration: "settle",
    };
    assert_operator_rbac(&cp, &operator, &["team-a"], &["team-b", "default"], false);

    // Upgrades keep values and change what they are told to; asked for, Secrets cluster-wide.
    helm(
        kubeconfig,
        &[
            "upgrade",
            "settle",
            &chart,
            "-n",
            "settle-system",
            "--reuse-values",
            "--set",
            "replicas=3",
            "--set",
            "rbac.secretsClusterWide=true",
        ],
    );
    let deployment = get_json(&cp, &["get", "deployment", "settle", "-n", "settle-system"]);
    assert_eq!(deployment["spec"]["replicas"], 3);
    assert_eq!(
        deployment["spec"]["template"]["spec"]["containers"][0]["image"],
        "ghcr.io/settle-dev/settle:test"
    );
    assert_operator_rbac(&cp, &operator, &["team-a"], &["team-b", "default"], true);
    wait_gone(
        &cp,
        &["get", "role", "settle-secrets", "-n", "team-a"],
        "the per-namespace Secrets Role (superseded by the ClusterRole)",
    );

    // Without watched namespaces nor cluster-wide Secrets, NOTES warns what Backends will lack.
    let dry = helm(
        kubeconfig,
        &[
            "install",
            "other",
            &chart,
            "-n",
            "settle-other",
            "--dry-run=client",
        ],
    );
    assert!(
        dry.contains("WARNING: the operator watches every namespace but may read no Secret"),
        "{dry}"
    );

    helm(kubeconfig, &["uninstall", "settle", "-n", "settle-system"]);
    for (args, what) in [
        (
            &["get", "validatingwebhookconfiguration", "settle"][..],
            "the webhook configuration",
        ),
        (
            &["get", "deployment", "settle", "-n", "settle-system"][..],
            "the Deployment",
        ),
        (&["get", "clusterrole", "settle"][..], "the ClusterRole"),
        (
            &["get", "rolebinding", "settle", "-n", "settle-system"][..],
            "the RoleBinding",
        ),
    ] {
        wait_gone(&cp, args, what);
    }
    // Helm keeps CRDs (and so everyone's Subscriptions) on uninstall.
    cp.kubectl_ok(&["get", "crd/subscriptions.messaging.settle.dev"], None);
    cp.kubectl_ok(&["get", "crd/backends.messaging.settle.dev"], None);
}
