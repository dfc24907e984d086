//! The Helm chart with the pinned helm and kube-score: its values schema, kube-score's verdict
//! on what it renders, and an install, upgrade and uninstall on an API server of the test's own
//! that has never seen Settle's CRDs (so "the chart installs the CRDs" is the chart's doing).
//! No pods run here (there is no kubelet), so this checks what the chart creates and what its
//! ServiceAccount may do, not the pods.

use settle_testkit as common;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use common::controlplane::{ControlPlane, tool};
use common::install::{
    Operator, assert_no_rbac_wildcard, assert_operator_rbac, assert_settle_mutating_webhook,
    assert_settle_webhook, chart, docs, helm, helm_run, kube_score, render_chart,
    shipped_mutating_configuration, shipped_webhook_configuration, webhook_behaviour,
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
        (
            "monitoring.prometheusRule.enabled=yes",
            "at '/monitoring/prometheusRule/enabled': got string, want boolean",
        ),
        (
            "monitoring.prometheusRule.notReadyFor=soon",
            "at '/monitoring/prometheusRule/notReadyFor'",
        ),
        (
            "monitoring.prometheusRule.leaderSelector={job=\"settle\"}",
            "at '/monitoring/prometheusRule/leaderSelector'",
        ),
        (
            "monitoring.prometheusRule.severity.exhausted=",
            "at '/monitoring/prometheusRule/severity/exhausted'",
        ),
        (
            "monitoring.grafanaDashboard.labels.grafana_dashboard=1",
            "at '/monitoring/grafanaDashboard/labels/grafana_dashboard': got number, want string",
        ),
        (
            "monitoring.serviceMonitor.interval=30",
            "at '/monitoring/serviceMonitor/interval'",
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
    let variants: [(&str, &[&str], &[&str]); 5] = [
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
        (
            "ServiceMonitor, PrometheusRule and dashboard",
            &MONITORING_ON,
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

/// The RBAC is what the code calls and no more; tenants get aggregated edit and view roles without
/// status; the probes use their own port; metrics.auth adds the review permissions, HTTPS and a
/// reader role's use in the ServiceMonitor.
#[test]
fn chart_rbac_is_trimmed_and_tenants_get_aggregated_roles_without_status() {
    let rules_of = |docs: &[Value], kind: &str, name: &str| -> Value {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"))["rules"]
            .clone()
    };
    let grants = |rules: &Value, group: &str, resource: &str, verb: &str| -> bool {
        rules.as_array().into_iter().flatten().any(|r| {
            let has = |key: &str, want: &str| {
                r[key]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|v| v.as_str() == Some(want))
            };
            has("apiGroups", group) && has("resources", resource) && has("verbs", verb)
        })
    };
    let default = docs(&render(&[]));
    let operator = rules_of(&default, "ClusterRole", "settle");
    for (group, resource, verb, want) in [
        (
            "messaging.settle.dev",
            "subscriptions/status",
            "patch",
            true,
        ),
        (
            "messaging.settle.dev",
            "subscriptions/status",
            "update",
            false,
        ),
        ("messaging.settle.dev", "backends/status", "get", false),
        (
            "messaging.settle.dev",
            "subscriptions/finalizers",
            "update",
            false,
        ),
        ("events.k8s.io", "events", "create", true),
        ("", "events", "create", false),
        ("authentication.k8s.io", "tokenreviews", "create", false),
        (
            "authorization.k8s.io",
            "subjectaccessreviews",
            "create",
            false,
        ),
    ] {
        assert_eq!(
            grants(&operator, group, resource, verb),
            want,
            "the operator's ClusterRole and {verb} {group}/{resource}: {operator}"
        );
    }
    let own = rules_of(&default, "Role", "settle");
    assert_eq!(
        own,
        json!([
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
            {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["settle-webhook-tls"], "verbs": ["get", "update"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["settle-operator"], "verbs": ["get", "update"]},
        ])
    );

    // Tenants: aggregated into the built-in roles, Subscriptions and Backends, never */status.
    for (name, aggregate, verbs) in [
        (
            "settle-edit",
            &["admin", "edit"][..],
            &[
                "get",
                "list",
                "watch",
                "create",
                "update",
                "patch",
                "delete",
                "deletecollection",
            ][..],
        ),
        (
            "settle-view",
            &["admin", "edit", "view"][..],
            &["get", "list", "watch"][..],
        ),
    ] {
        let role = default
            .iter()
            .find(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no ClusterRole {name}"));
        for to in ["admin", "edit", "view"] {
            let label =
                &role["metadata"]["labels"][format!("rbac.authorization.k8s.io/aggregate-to-{to}")];
            assert_eq!(
                label.as_str() == Some("true"),
                aggregate.contains(&to),
                "{name} aggregate-to-{to}: {label}"
            );
        }
        assert_eq!(
            role["rules"],
            json!([{"apiGroups": ["messaging.settle.dev"], "resources": ["subscriptions", "backends"], "verbs": verbs}]),
            "{name}"
        );
        assert!(!role["rules"].to_string().contains("/status"), "{name}");
    }
    assert_eq!(
        rules_of(&default, "ClusterRole", "settle-metrics-reader"),
        json!([{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}])
    );

    // The kubelet probes the probe port; the metrics port is plain HTTP by default.
    let deployment = find_kind(&default, "Deployment").expect("Deployment");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        container["livenessProbe"]["httpGet"],
        json!({"path": "/healthz", "port": "probe"})
    );
    assert_eq!(
        container["readinessProbe"]["httpGet"],
        json!({"path": "/readyz", "port": "probe"})
    );
    assert!(
        container["ports"]
            .as_array()
            .expect("ports")
            .contains(&json!({"name": "probe", "containerPort": 8081})),
        "{}",
        container["ports"]
    );
    let env = container["env"].to_string();
    assert!(
        env.contains(r#"{"name":"SETTLE_PROBE_ADDR","value":"0.0.0.0:8081"}"#),
        "{env}"
    );
    assert!(
        env.contains(r#"{"name":"SETTLE_METRICS_AUTH","value":"false"}"#),
        "{env}"
    );

    // metrics.auth: the review permissions, the flag, and a ServiceMonitor that speaks HTTPS
    // with the webhook's CA and Prometheus's token.
    let auth = docs(&render(&[
        "metrics.auth=true",
        "monitoring.serviceMonitor.enabled=true",
    ]));
    let operator = rules_of(&auth, "ClusterRole", "settle");
    assert!(grants(
        &operator,
        "authentication.k8s.io",
        "tokenreviews",
        "create"
    ));
    assert!(grants(
        &operator,
        "authorization.k8s.io",
        "subjectaccessreviews",
        "create"
    ));
    let env = find_kind(&auth, "Deployment").expect("Deployment")["spec"]["template"]["spec"]
        ["containers"][0]["env"]
        .to_string();
    assert!(
        env.contains(r#"{"name":"SETTLE_METRICS_AUTH","value":"true"}"#),
        "{env}"
    );
    let endpoint =
        &find_kind(&auth, "ServiceMonitor").expect("ServiceMonitor")["spec"]["endpoints"][0];
    assert_eq!(endpoint["scheme"], "https", "{endpoint}");
    assert_eq!(
        endpoint["tlsConfig"]["serverName"],
        "settle-webhook.settle-system.svc"
    );
    assert_eq!(
        endpoint["tlsConfig"]["ca"],
        json!({"secret": {"name": "settle-webhook-tls", "key": "ca.crt"}})
    );
    assert_eq!(
        endpoint["bearerTokenFile"],
        "/var/run/secrets/kubernetes.io/serviceaccount/token"
    );
    assert_no_rbac_wildcard("chart with metrics.auth", &auth);
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
        ("SETTLE_STATUS_WRITES_PER_SECOND", "20"),
        ("SETTLE_LOSS_WINDOW", "15m"),
        ("SETTLE_STALL_WINDOW", "5m"),
        ("SETTLE_RELEASE_MEMORY_INTERVAL", "30s"),
        ("SETTLE_WEBHOOK_CONFIGURATION", "settle"),
        ("SETTLE_SHUTDOWN_DELAY", "5s"),
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
        !env.iter().any(|(n, _)| n == "SETTLE_ADOPT_NAMESPACES"),
        "no namespace adopts by default: {env:?}"
    );
    assert!(
        !defaults
            .iter()
            .any(|d| d["kind"] == "Role" && d["metadata"]["name"] == "settle-secrets"),
        "no Secrets Role without watched namespaces"
    );
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    // The kubelet's grace outlasts the shutdown delay: the replica closes its ports itself.
    assert_eq!(pod["terminationGracePeriodSeconds"], 30);
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
        "controller.adoptNamespaces={team-a}",
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
        ("SETTLE_ADOPT_NAMESPACES", "team-a"),
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
        json!([
            {"ports": [{"port": 8443, "protocol": "TCP"}]},
            {"ports": [{"port": 8080, "protocol": "TCP"}]},
            {"ports": [{"port": 8081, "protocol": "TCP"}]},
        ])
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
    common::wait_crds_established(|args| cp.kubectl_ok(args, None));
    let deployment = cp.get_json(&["get", "deployment", "settle", "-n", "settle-system"]);
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
    let pdb = cp.get_json(&[
        "get",
        "poddisruptionbudget",
        "settle",
        "-n",
        "settle-system",
    ]);
    assert_eq!(pdb["spec"]["selector"], deployment["spec"]["selector"]);
    cp.kubectl_ok(
        &["get", "service", "settle-webhook", "-n", "settle-system"],
        None,
    );

    // The webhook configuration as the API server stored it behaves as the shipped one.
    let webhook = cp.get_json(&["get", "validatingwebhookconfiguration", "settle"]);
    assert_settle_webhook("the chart's webhook configuration", &webhook);
    assert_eq!(
        webhook_behaviour(&webhook),
        webhook_behaviour(&shipped_webhook_configuration()),
        "the chart's webhook and config/webhook/validating-webhook.yaml differ"
    );
    let service = &webhook["webhooks"][0]["clientConfig"]["service"];
    assert_eq!(service["name"], "settle-webhook");
    assert_eq!(service["namespace"], "settle-system");
    let mutating = cp.get_json(&["get", "mutatingwebhookconfiguration", "settle"]);
    assert_settle_mutating_webhook("the chart's mutating webhook configuration", &mutating);
    assert_eq!(
        webhook_behaviour(&mutating),
        webhook_behaviour(&shipped_mutating_configuration()),
        "the chart's mutating webhook and config/webhook/mutating-webhook.yaml differ"
    );
    assert_eq!(
        mutating["webhooks"][0]["clientConfig"]["service"],
        webhook["webhooks"][0]["clientConfig"]["service"]
            .as_object()
            .map(|s| {
                let mut s = s.clone();
                s.insert("path".into(), "/mutate".into());
                Value::Object(s)
            })
            .unwrap_or_default(),
        "both webhooks are served by the same Service"
    );

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
    let deployment = cp.get_json(&["get", "deployment", "settle", "-n", "settle-system"]);
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
    assert!(!dry.contains("Monitoring:"), "{dry}");

    // The alerts and the ServiceMonitor need the Prometheus Operator's CRDs: without them the
    // install stops, naming the kind, rather than leaving the alerts out unseen.
    let mut monitored = vec![
        "install",
        "other",
        chart.as_str(),
        "-n",
        "settle-other",
        "--dry-run=client",
    ];
    for set in MONITORING_ON {
        monitored.extend(["--set", set]);
    }
    let out = helm_run(kubeconfig, &monitored);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("no matches for kind")
            && (stderr.contains("PrometheusRule") || stderr.contains("ServiceMonitor")),
        "install with the monitoring objects and without their CRDs: {stderr}"
    );
    // With them (stand-ins that accept any content: the rules are checked by promtool above),
    // NOTES names what was installed.
    for (kind, plural) in [
        ("PrometheusRule", "prometheusrules"),
        ("ServiceMonitor", "servicemonitors"),
    ] {
        let crd = json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": format!("{plural}.monitoring.coreos.com")},
            "spec": {
                "group": "monitoring.coreos.com",
                "scope": "Namespaced",
                "names": {"kind": kind, "plural": plural},
                "versions": [{
                    "name": "v1", "served": true, "storage": true,
                    "schema": {"openAPIV3Schema": {
                        "type": "object", "x-kubernetes-preserve-unknown-fields": true
                    }}
                }]
            }
        });
        cp.kubectl_ok(&["apply", "-f", "-"], Some(&crd.to_string()));
        cp.kubectl_ok(
            &[
                "wait",
                "--for=condition=Established",
                "--timeout=60s",
                &format!("crd/{plural}.monitoring.coreos.com"),
            ],
            None,
        );
    }
    let dry = helm(kubeconfig, &monitored);
    for line in [
        "ServiceMonitor other: Prometheus scrapes /metrics on port 8080 of every replica.",
        "PrometheusRule other: SettleMessagesExhausted, SettleMessagesStranded, SettleSubscriptionNotReady, SettleSubscriptionStalled, SettleNoLeader.",
        "Grafana dashboard \"Settle\": ConfigMap other-dashboard in settle-other.",
    ] {
        assert!(dry.contains(line), "NOTES lack {line:?}:\n{dry}");
    }
    assert!(!dry.contains("honor_labels"), "{dry}");
    let dry = helm(
        kubeconfig,
        &[
            "install",
            "other",
            &chart,
            "-n",
            "settle-other",
            "--dry-run=client",
            "--set",
            "monitoring.prometheusRule.enabled=true",
        ],
    );
    assert!(
        dry.contains("with honor_labels: true"),
        "NOTES say how to scrape without the ServiceMonitor:\n{dry}"
    );

    helm(kubeconfig, &["uninstall", "settle", "-n", "settle-system"]);
    for (args, what) in [
        (
            &["get", "validatingwebhookconfiguration", "settle"][..],
            "the webhook configuration",
        ),
        (
            &["get", "mutatingwebhookconfiguration", "settle"][..],
            "the mutating webhook configuration",
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

// ---- Alerts and dashboard ----------------------------------------------------------------------

/// The monitoring objects, all enabled.
const MONITORING_ON: [&str; 3] = [
    "monitoring.serviceMonitor.enabled=true",
    "monitoring.prometheusRule.enabled=true",
    "monitoring.grafanaDashboard.enabled=true",
];

/// The delivery counters the account exports per Subscription, as
/// `settle_subscription_<stem>_total{namespace,subscription}`.
const SUBSCRIPTION_COUNTERS: [&str; 13] = [
    "offered",
    "delivered",
    "released",
    "lost",
    "acked",
    "nacked",
    "silent",
    "refused",
    "exhausted",
    "stranded",
    "lease_expired",
    "delay_shortened",
    "foreign_conflicts",
];

/// Its gauges, `settle_subscription_<name>{namespace,subscription}`.
const SUBSCRIPTION_GAUGES: [&str; 5] = ["pending", "ack_pending", "ready", "exhausting", "stalled"];

/// The account's own: its status writes, by result.
const ACCOUNT_METRICS: [&str; 1] = ["settle_account_status_writes_total"];

/// The operator's own metrics the chart may read, each registered under this exact name in src/
/// (histograms with their `_bucket`, `_sum`, `_count` series).
const OPERATOR_METRICS: [&str; 7] = [
    "settle_reconcile_total",
    "settle_consumer_operations_total",
    "settle_status_writes_total",
    "settle_leader",
    "settle_admission_requests_total",
    "settle_reconcile_duration_seconds",
    "settle_admission_duration_seconds",
];
const HISTOGRAMS: [&str; 2] = [
    "settle_reconcile_duration_seconds",
    "settle_admission_duration_seconds",
];

/// Every series name `settle operator` exports that the chart's alerts and dashboard may read.
fn exported_metrics() -> BTreeSet<String> {
    let mut names: BTreeSet<String> = SUBSCRIPTION_COUNTERS
        .iter()
        .map(|c| format!("settle_subscription_{c}_total"))
        .chain(
            SUBSCRIPTION_GAUGES
                .iter()
                .map(|g| format!("settle_subscription_{g}")),
        )
        .chain(OPERATOR_METRICS.iter().map(|m| m.to_string()))
        .chain(ACCOUNT_METRICS.iter().map(|m| m.to_string()))
        .collect();
    for h in HISTOGRAMS {
        names.remove(h);
        for suffix in ["bucket", "sum", "count"] {
            names.insert(format!("{h}_{suffix}"));
        }
    }
    names
}

/// The metric names a PromQL expression reads. A small scanner, not a parser (promtool checks
/// the syntax): strings, label matchers, ranges, numbers, Grafana variables and the label lists
/// of `by`, `without`, `on`, `ignoring` and `group_*` are skipped; an identifier that is followed
/// by `(` is a function and a keyword is a keyword; every other identifier is a metric name.
fn metric_names(expr: &str) -> BTreeSet<String> {
    const WORDS: &str = "sum min max avg group stddev stdvar count count_values bottomk topk \
        quantile and or unless bool offset inf nan";
    const LABEL_LISTS: &str = "by without on ignoring group_left group_right";
    let is = |list: &str, word: &str| list.split_whitespace().any(|w| w == word);
    let chars: Vec<char> = expr.chars().collect();
    let n = chars.len();
    // The index just past the `close` that ends what starts at `i` (quotes inside respected).
    let past = |mut i: usize, close: char| -> usize {
        let mut quote: Option<char> = None;
        while i < n {
            match (quote, chars[i]) {
                (Some(_), '\\') => i += 1,
                (Some(q), c) if c == q => quote = None,
                (None, c @ ('"' | '\'' | '`')) => quote = Some(c),
                (None, c) if c == close => return i + 1,
                _ => {}
            }
            i += 1;
        }
        n
    };
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut names = BTreeSet::new();
    let mut label_list_next = false;
    let mut i = 0;
    while i < n {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => i = past(i, c).max(i + 1),
            '{' => i = past(i + 1, '}'),
            '[' => i = past(i + 1, ']'),
            '(' if label_list_next => {
                label_list_next = false;
                i = past(i + 1, ')');
            }
            '$' => {
                i += 1;
                if chars.get(i) == Some(&'{') {
                    i = past(i + 1, '}');
                } else {
                    while i < n && ident(chars[i]) {
                        i += 1;
                    }
                }
            }
            c if c.is_ascii_digit() || c == '.' => {
                // Numbers and durations: 0.99, 1e-3, 5m, 1h30m.
                while i < n
                    && (ident(chars[i])
                        || chars[i] == '.'
                        || (matches!(chars[i], '+' | '-') && matches!(chars[i - 1], 'e' | 'E')))
                {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < n && ident(chars[i]) {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let lower = word.to_ascii_lowercase();
                let next = chars[i..].iter().find(|c| !c.is_whitespace());
                label_list_next = is(LABEL_LISTS, &lower);
                if !label_list_next && next != Some(&'(') && !is(WORDS, &lower) {
                    names.insert(word);
                }
            }
            _ => i += 1,
        }
    }
    names
}

#[test]
fn metric_names_finds_the_metrics_of_an_expression_and_nothing_else() {
    let cases: [(&str, &[&str]); 7] = [
        ("settle_leader", &["settle_leader"]),
        (
            r#"sum by (namespace, subscription) (rate(settle_subscription_delivered_total{namespace=~"$namespace", subscription="a,b(c)"}[$__rate_interval]))"#,
            &["settle_subscription_delivered_total"],
        ),
        (
            "histogram_quantile(0.99, sum by (le, controller) (rate(settle_reconcile_duration_seconds_bucket[5m])))",
            &["settle_reconcile_duration_seconds_bucket"],
        ),
        (
            "(sum(settle_leader{namespace=\"x\"}) or vector(0)) == 0",
            &["settle_leader"],
        ),
        (
            "increase(a_total[1h30m] offset 5m) > 1e-3\nor on (ns) group_left(team) b == 1 unless ignoring(x) c",
            &["a_total", "b", "c"],
        ),
        ("count without(pod) (up) > bool 0", &["up"]),
        ("sum(x) / count ( y{le=\"+Inf\"} )", &["x", "y"]),
    ];
    for (expr, wanted) in cases {
        let wanted: BTreeSet<String> = wanted.iter().map(|s| s.to_string()).collect();
        assert_eq!(metric_names(expr), wanted, "{expr}");
    }
}

fn find_kind<'a>(docs: &'a [Value], kind: &str) -> Option<&'a Value> {
    docs.iter().find(|d| d["kind"] == kind)
}

/// The alerting rules of the PrometheusRule the chart renders with `sets`.
fn rendered_rules(sets: &[&str]) -> Value {
    let docs = docs(&render(sets));
    find_kind(&docs, "PrometheusRule")
        .unwrap_or_else(|| panic!("no PrometheusRule rendered with {sets:?}"))["spec"]
        .clone()
}

/// Runs the pinned promtool in `dir`; returns whether it succeeded and what it printed.
fn promtool(dir: &Path, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(tool("promtool"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run promtool");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// Writes `spec` (a PrometheusRule's spec: a rule file) to `dir/rules.yaml`.
fn write_rules(dir: &Path, spec: &Value) {
    let yaml = serde_yaml::to_string(spec).expect("rules as YAML");
    std::fs::write(dir.join("rules.yaml"), yaml).expect("write rules.yaml");
}

#[test]
fn monitoring_objects_are_off_by_default_and_render_when_enabled() {
    let defaults = docs(&render(&[]));
    for kind in ["PrometheusRule", "ServiceMonitor"] {
        assert!(
            find_kind(&defaults, kind).is_none(),
            "{kind} rendered by default"
        );
    }
    assert!(
        !defaults.iter().any(|d| d["kind"] == "ConfigMap"),
        "a dashboard ConfigMap rendered by default"
    );

    let mut sets = MONITORING_ON.to_vec();
    sets.extend([
        "monitoring.serviceMonitor.labels.release=prometheus",
        "monitoring.prometheusRule.labels.release=prometheus",
        "monitoring.prometheusRule.annotations.owner=platform",
        "monitoring.grafanaDashboard.namespace=grafana",
        "monitoring.grafanaDashboard.annotations.grafana_folder=Messaging",
    ]);
    let on = docs(&render(&sets));

    let monitor = find_kind(&on, "ServiceMonitor").expect("ServiceMonitor");
    assert_eq!(monitor["metadata"]["labels"]["release"], "prometheus");
    let service = on
        .iter()
        .find(|d| d["kind"] == "Service")
        .expect("the operator's Service");
    let selector = monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("matchLabels");
    for (k, v) in selector {
        assert_eq!(
            &service["metadata"]["labels"][k], v,
            "the ServiceMonitor selects the operator's Service"
        );
    }
    let port = &monitor["spec"]["endpoints"][0];
    assert_eq!(port["port"], "metrics");
    assert!(
        service["spec"]["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .any(|p| p["name"] == "metrics"),
        "the Service has a port named metrics: {service}"
    );
    assert_eq!(port["path"], "/metrics");
    assert_eq!(
        port["honorLabels"], true,
        "the Subscription's namespace label must survive the scrape"
    );

    let rule = find_kind(&on, "PrometheusRule").expect("PrometheusRule");
    assert_eq!(rule["metadata"]["labels"]["release"], "prometheus");
    assert_eq!(rule["metadata"]["annotations"]["owner"], "platform");
    let alerts: Vec<&str> = rule["spec"]["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules"))
        .map(|r| r["alert"].as_str().expect("alert"))
        .collect();
    assert_eq!(
        alerts,
        [
            "SettleMessagesExhausted",
            "SettleMessagesStranded",
            "SettleSubscriptionNotReady",
            "SettleSubscriptionStalled",
            "SettleNoLeader"
        ]
    );

    let dashboard = find_kind(&on, "ConfigMap").expect("dashboard ConfigMap");
    assert_eq!(dashboard["metadata"]["namespace"], "grafana");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(
        dashboard["metadata"]["annotations"]["grafana_folder"],
        "Messaging"
    );
    let shipped = std::fs::read_to_string(root().join("charts/settle/dashboards/settle.json"))
        .expect("charts/settle/dashboards/settle.json");
    assert_eq!(
        dashboard["data"]["settle.json"].as_str().map(str::trim_end),
        Some(shipped.trim_end()),
        "the ConfigMap carries dashboards/settle.json as it is"
    );
}

/// The PrometheusRule's rules, as a rule file, pass `promtool check rules`, with the defaults
/// and with every alert setting changed; a broken copy fails it (so the check is real); and
/// `promtool test rules` runs tests/promtool/alerts.test.yaml: series in, the alerts that must
/// fire (labels and annotations as written) and those that must not.
#[test]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let dir = tempfile::tempdir().expect("temp dir");
    let variants: [&[&str]; 2] = [
        &[],
        &[
            "controller.lossWindow=1h30m",
            "controller.stallWindow=45m",
            "monitoring.prometheusRule.notReadyFor=30m",
            "monitoring.prometheusRule.noLeaderFor=2m",
            "monitoring.prometheusRule.leaderSelector=job=\"settle\"\\,cluster=\"eu\"",
            "monitoring.prometheusRule.alertLabels.team=platform",
            "monitoring.prometheusRule.severity.exhausted=page",
        ],
    ];
    for sets in variants {
        let mut all = vec!["monitoring.prometheusRule.enabled=true"];
        all.extend(sets);
        let spec = rendered_rules(&all);
        write_rules(dir.path(), &spec);
        let (ok, out) = promtool(
            dir.path(),
            &["check", "rules", "--lint-fatal", "rules.yaml"],
        );
        assert!(ok, "promtool check rules with {sets:?}:\n{out}");
        assert!(out.contains("SUCCESS: 5 rules found"), "{sets:?}:\n{out}");
        if !sets.is_empty() {
            let text = serde_json::to_string(&spec).expect("json");
            for part in [
                "[1h30m]",
                "the larger of 45m",
                "settle_leader{job=\\\"settle\\\",cluster=\\\"eu\\\"}",
                "\"for\":\"30m\"",
                "\"for\":\"2m\"",
                "\"team\":\"platform\"",
                "\"severity\":\"page\"",
            ] {
                assert!(text.contains(part), "{part} missing from {text}");
            }
        }
    }

    // A rule that does not parse fails the check, naming it.
    let mut broken = rendered_rules(&["monitoring.prometheusRule.enabled=true"]);
    broken["groups"][0]["rules"][0]["expr"] =
        json!("increase(settle_subscription_exhausted_total[15m] > 0");
    write_rules(dir.path(), &broken);
    let (ok, out) = promtool(dir.path(), &["check", "rules", "rules.yaml"]);
    assert!(
        !ok && out.contains("SettleMessagesExhausted"),
        "a broken expression passed promtool check rules:\n{out}"
    );

    // The unit tests, against the rules of the default values.
    write_rules(
        dir.path(),
        &rendered_rules(&["monitoring.prometheusRule.enabled=true"]),
    );
    std::fs::copy(
        root().join("crates/settle-e2e/tests/promtool/alerts.test.yaml"),
        dir.path().join("alerts.test.yaml"),
    )
    .expect("copy crates/settle-e2e/tests/promtool/alerts.test.yaml");
    let (ok, out) = promtool(dir.path(), &["test", "rules", "alerts.test.yaml"]);
    assert!(ok && out.contains("SUCCESS"), "promtool test rules:\n{out}");
}

/// Every PromQL expression of the dashboard: its panels' targets (rows' panels too) and its
/// template variables' queries (`label_values(SELECTOR, LABEL)` reads SELECTOR).
fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    fn panels<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for p in list.as_array().into_iter().flatten() {
            out.push(p);
            panels(&p["panels"], out);
        }
    }
    let mut all = Vec::new();
    panels(&dashboard["panels"], &mut all);
    let mut queries = Vec::new();
    for p in all {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().expect("every target has an expr");
            queries.push((format!("panel {:?}", p["title"]), expr.to_string()));
        }
    }
    for v in dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
    {
        if v["type"] != "query" {
            continue;
        }
        let q = v["query"]["query"].as_str().expect("variable query");
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|r| r.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable {}: not label_values(...): {q}", v["name"]));
        let selector = inner.rsplit_once(',').map_or(inner, |(s, _)| s);
        queries.push((format!("variable {}", v["name"]), selector.to_string()));
    }
    queries
}

/// The alerts and the dashboard read only metrics the operator exports: a metric renamed in src/
/// or misspelt in the chart fails here, instead of an alert that can never fire.
#[test]
fn alerts_and_dashboard_read_only_metrics_the_operator_exports() {
    let exported = exported_metrics();

    // The controllers' metrics are registered under these literal names in src/. The account's
    // per-Subscription names are built from their stems, so they are listed above as it defines
    // them (and in the README's metrics table).
    let mut src = String::new();
    let mut dirs = vec![
        root().join("crates/settle/src"),
        root().join("crates/settle-operator/src"),
    ];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read the crates' src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                src += &std::fs::read_to_string(&path).expect("read source");
            }
        }
    }
    for name in OPERATOR_METRICS {
        assert!(
            src.contains(&format!("\"{name}\"")),
            "{name} is not registered anywhere in src/"
        );
    }

    let mut sets = MONITORING_ON.to_vec();
    sets.push("monitoring.prometheusRule.leaderSelector=job=\"settle\"");
    let docs = docs(&render(&sets));
    let mut read = BTreeSet::new();
    let mut wrong = Vec::new();

    let rules = &find_kind(&docs, "PrometheusRule").expect("PrometheusRule")["spec"];
    for rule in rules["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules"))
    {
        let expr = rule["expr"].as_str().expect("expr");
        let names = metric_names(expr);
        if names.is_empty() {
            wrong.push(format!("alert {}: reads no metric: {expr}", rule["alert"]));
        }
        for name in names {
            if !exported.contains(&name) {
                wrong.push(format!("alert {}: {name} is not exported", rule["alert"]));
            }
            read.insert(name);
        }
        for annotation in ["summary", "description"] {
            let text = rule["annotations"][annotation].as_str().unwrap_or("");
            assert!(text.len() > 20, "alert {}: no {annotation}", rule["alert"]);
        }
        assert!(
            rule["labels"]["severity"].is_string(),
            "alert {}: no severity",
            rule["alert"]
        );
    }
    let description = |alert: &str| -> String {
        rules["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .find(|r| r["alert"] == alert)
            .map(|r| r["annotations"]["description"].to_string())
            .unwrap_or_default()
    };
    for alert in [
        "SettleMessagesExhausted",
        "SettleMessagesStranded",
        "SettleSubscriptionNotReady",
        "SettleSubscriptionStalled",
    ] {
        assert!(
            description(alert).contains(
                "kubectl describe subscription {{ $labels.subscription }} -n {{ $labels.namespace }}"
            ),
            "{alert} does not say what to run: {}",
            description(alert)
        );
    }

    let text = find_kind(&docs, "ConfigMap").expect("dashboard")["data"]["settle.json"]
        .as_str()
        .expect("settle.json")
        .to_string();
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    assert_eq!(dashboard["uid"], "settle-subscriptions");
    let queries = dashboard_queries(&dashboard);
    assert!(queries.len() > 20, "{queries:?}");
    for (whose, expr) in &queries {
        let names = metric_names(expr);
        if names.is_empty() {
            wrong.push(format!("dashboard {whose}: reads no metric: {expr}"));
        }
        for name in names {
            if !exported.contains(&name) {
                wrong.push(format!("dashboard {whose}: {name} is not exported"));
            }
            read.insert(name);
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));

    // What the alerts and the dashboard are for is all there.
    for name in [
        "settle_subscription_delivered_total",
        "settle_subscription_acked_total",
        "settle_subscription_nacked_total",
        "settle_subscription_silent_total",
        "settle_subscription_exhausted_total",
        "settle_subscription_stranded_total",
        "settle_subscription_pending",
        "settle_subscription_ack_pending",
        "settle_subscription_ready",
        "settle_subscription_exhausting",
        "settle_subscription_stalled",
        "settle_reconcile_total",
        "settle_status_writes_total",
        "settle_leader",
    ] {
        assert!(
            read.contains(name),
            "neither alerts nor dashboard read {name}"
        );
    }

    // Panels: unique ids, each in the 24-column grid, none overlapping another.
    let mut ids = BTreeSet::new();
    let mut boxes: Vec<(String, [i64; 4])> = Vec::new();
    for p in dashboard["panels"].as_array().expect("panels") {
        assert!(ids.insert(p["id"].as_i64().expect("id")), "id twice: {p}");
        let g = &p["gridPos"];
        let b = ["x", "y", "w", "h"].map(|k| g[k].as_i64().expect("gridPos"));
        assert!(
            b[0] >= 0 && b[0] + b[2] <= 24,
            "{} is off the grid",
            p["title"]
        );
        for (other, o) in &boxes {
            let apart = b[0] + b[2] <= o[0]
                || o[0] + o[2] <= b[0]
                || b[1] + b[3] <= o[1]
                || o[1] + o[3] <= b[1];
            assert!(apart, "panels {} and {other} overlap", p["title"]);
        }
        boxes.push((p["title"].to_string(), b));
        if p["type"] != "row" {
            assert_eq!(
                p["datasource"]["uid"], "${datasource}",
                "{} uses the dashboard's data source variable",
                p["title"]
            );
        }
    }
}

/// The KEDA recipe in docs/guide/keda.md: the `prometheus` trigger's `query:`
/// under the marker `keda-prometheus` reads only metrics the operator exports, passes `promtool
/// check rules`, and evaluates to the Subscription's pending + ack_pending, and no other
/// Subscription's.
#[test]
fn the_keda_recipes_query_reads_exported_metrics_and_is_pending_plus_ack_pending() {
    let guide = std::fs::read_to_string(common::root().join("docs/guide/keda.md"))
        .expect("docs/guide/keda.md");
    let recipe = guide
        .split("<!-- keda-prometheus")
        .nth(1)
        .expect("docs/guide/keda.md has the KEDA recipe's marker <!-- keda-prometheus");
    let query = recipe
        .lines()
        .take_while(|l| !l.starts_with("```") || l.starts_with("```yaml"))
        .find_map(|l| l.trim().strip_prefix("query: "))
        .expect("the recipe's ScaledObject has a query:");
    let names = metric_names(query);
    let exported = exported_metrics();
    assert!(!names.is_empty(), "{query}");
    for name in &names {
        assert!(
            exported.contains(name),
            "the KEDA recipe reads {name}, which the operator does not export: {query}"
        );
    }

    let dir = tempfile::tempdir().expect("temp dir");
    let rules =
        json!({"groups": [{"name": "keda", "rules": [{"record": "keda:lag", "expr": query}]}]});
    write_rules(dir.path(), &rules);
    let (ok, out) = promtool(dir.path(), &["check", "rules", "rules.yaml"]);
    assert!(ok, "promtool check rules on the KEDA query:\n{out}");
    let series = |name: &str, sub: &str, value: u32| json!({"series": format!("{name}{{namespace=\"shop\",subscription=\"{sub}\"}}"), "values": format!("{value}x5")});
    let test = json!({
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                series("settle_subscription_pending", "orders", 7),
                series("settle_subscription_ack_pending", "orders", 3),
                series("settle_subscription_pending", "refunds", 100),
                series("settle_subscription_ack_pending", "refunds", 50),
            ],
            "promql_expr_test": [{
                "expr": "keda:lag",
                "eval_time": "2m",
                "exp_samples": [{"labels": "keda:lag", "value": 10}],
            }],
        }],
    });
    std::fs::write(
        dir.path().join("keda.test.yaml"),
        serde_yaml::to_string(&test).expect("yaml"),
    )
    .expect("write the test");
    let (ok, out) = promtool(dir.path(), &["test", "rules", "keda.test.yaml"]);
    assert!(ok, "the KEDA query over two Subscriptions' series:\n{out}");
}
