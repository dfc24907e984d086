//! What an install of Settle must look like, shared by the tests of the Helm chart, the kustomize
//! bases and the webhook: the shipped webhook configuration's shape, the operator's RBAC as the
//! README states it (asked of the real API server with `kubectl auth can-i`), and kube-score's
//! verdict on rendered manifests.
//!
//! It renders (the pinned helm's `helm template`) but installs nothing: each test does that its
//! own way, on an API server of its choosing.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use serde::Deserialize;
use serde_json::{Value, json};

use super::controlplane::{ControlPlane, tool};
use super::root;

/// The chart's folder.
pub fn chart() -> String {
    super::path_str(&root().join("charts/settle")).to_string()
}

/// Runs the pinned helm, against `kubeconfig` if given, with its state under target/helm.
pub fn helm_run(kubeconfig: Option<&Path>, args: &[&str]) -> Output {
    let mut cmd = Command::new(tool("helm"));
    cmd.args(args)
        .env("HELM_CACHE_HOME", root().join("target/helm/cache"))
        .env("HELM_CONFIG_HOME", root().join("target/helm/config"))
        .env("HELM_DATA_HOME", root().join("target/helm/data"));
    match kubeconfig {
        Some(k) => cmd.env("KUBECONFIG", k),
        // helm template needs no cluster; make sure it does not find one.
        None => cmd.env("KUBECONFIG", root().join("target/helm/no-cluster")),
    };
    cmd.output().expect("helm runs")
}

/// helm that must succeed; returns stdout and stderr.
pub fn helm(kubeconfig: Option<&Path>, args: &[&str]) -> String {
    let out = helm_run(kubeconfig, args);
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "helm {args:?} failed:\n{text}");
    text
}

/// `helm template` of the chart as release `settle` in `settle-system` with `--set`s: what
/// `helm install settle charts/settle -n settle-system` would create (CRDs with `include_crds`).
pub fn render_chart(sets: &[&str], include_crds: bool) -> String {
    let chart = chart();
    let mut args = vec!["template", "settle", chart.as_str(), "-n", "settle-system"];
    if include_crds {
        args.push("--include-crds");
    }
    for s in sets {
        args.extend(["--set", s]);
    }
    helm(None, &args)
}

/// The documents of a multi-document YAML stream, as JSON values (empty documents skipped).
pub fn docs(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| Value::deserialize(doc).expect("valid YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

/// The ValidatingWebhookConfiguration shipped in config/webhook/ (also part of config/default).
pub fn shipped_webhook_configuration() -> Value {
    let path = root().join("config/webhook/validating-webhook.yaml");
    let text = std::fs::read_to_string(&path).expect("config/webhook/validating-webhook.yaml");
    let mut all = docs(&text);
    assert_eq!(all.len(), 1, "{} holds one object", path.display());
    all.remove(0)
}

/// The MutatingWebhookConfiguration shipped in config/webhook/ (also part of config/default).
pub fn shipped_mutating_configuration() -> Value {
    let path = root().join("config/webhook/mutating-webhook.yaml");
    let text = std::fs::read_to_string(&path).expect("config/webhook/mutating-webhook.yaml");
    let mut all = docs(&text);
    assert_eq!(all.len(), 1, "{} holds one object", path.display());
    all.remove(0)
}

/// A shipped webhook configuration renamed `name`, each of its webhooks reached by `url:` at
/// `https://127.0.0.1:{port}` on its shipped path, and called only for the namespaces labelled
/// `label=value` (so parallel tests are unaffected).
pub fn by_url(mut configuration: Value, name: &str, port: u16, label: &str, value: &str) -> Value {
    configuration["metadata"]["name"] = json!(name);
    for hook in configuration["webhooks"]
        .as_array_mut()
        .expect("a webhook configuration has webhooks")
    {
        let path = hook["clientConfig"]["service"]["path"]
            .as_str()
            .expect("a shipped webhook names its path")
            .to_string();
        hook["clientConfig"] = json!({"url": format!("https://127.0.0.1:{port}{path}")});
        hook["namespaceSelector"] = json!({"matchLabels": {label: value}});
    }
    configuration
}

/// Asserts what every shipped mutating configuration promises: one webhook, for Subscriptions'
/// CREATE and UPDATE only, failing open (the controller adds the finalizer without it), never
/// called again, at `/mutate`. `what` names the configuration in failures.
pub fn assert_settle_mutating_webhook(what: &str, configuration: &Value) {
    assert_eq!(
        configuration["kind"], "MutatingWebhookConfiguration",
        "{what}"
    );
    let hooks = configuration["webhooks"]
        .as_array()
        .unwrap_or_else(|| panic!("{what}: no webhooks in {configuration}"));
    assert_eq!(hooks.len(), 1, "{what}: exactly one webhook");
    let hook = &hooks[0];
    assert_eq!(
        hook["name"], "finalizer.subscriptions.messaging.settle.dev",
        "{what}"
    );
    assert_eq!(hook["failurePolicy"], "Ignore", "{what}: fails open");
    assert_eq!(hook["reinvocationPolicy"], "Never", "{what}");
    assert_served(what, hook, "subscriptions", "/mutate");
}

/// Asserts what every shipped webhook configuration promises: two webhooks, Subscriptions then
/// Backends, each fail closed, called only for CREATE and UPDATE of its resource (nothing else
/// in the cluster waits on Settle), at `/validate`. `what` names the configuration in failures.
pub fn assert_settle_webhook(what: &str, configuration: &Value) {
    let hooks = configuration["webhooks"]
        .as_array()
        .unwrap_or_else(|| panic!("{what}: no webhooks in {configuration}"));
    assert_eq!(hooks.len(), 2, "{what}: exactly two webhooks");
    for (hook, resource) in hooks.iter().zip(["subscriptions", "backends"]) {
        assert_one_webhook(&format!("{what}, {resource}"), hook, resource);
    }
}

fn assert_one_webhook(what: &str, hook: &Value, resource: &str) {
    assert_eq!(
        hook["name"],
        format!("{resource}.messaging.settle.dev"),
        "{what}"
    );
    assert_eq!(hook["failurePolicy"], "Fail", "{what}: fails closed");
    assert_served(what, hook, resource, "/validate");
}

/// What both kinds of Settle's webhook promise: no side effects, equivalent matching, v1
/// reviews, called only for CREATE and UPDATE of `resource`, at `path` of the operator.
fn assert_served(what: &str, hook: &Value, resource: &str, path: &str) {
    assert_eq!(hook["sideEffects"], "None", "{what}");
    assert_eq!(hook["matchPolicy"], "Equivalent", "{what}");
    assert_eq!(hook["admissionReviewVersions"], json!(["v1"]), "{what}");
    assert_eq!(
        hook["rules"],
        json!([{
            "apiGroups": ["messaging.settle.dev"],
            "apiVersions": ["v1alpha1"],
            "operations": ["CREATE", "UPDATE"],
            "resources": [resource],
            "scope": "Namespaced",
        }]),
        "{what}: only {resource}, only CREATE and UPDATE"
    );
    let served = hook["clientConfig"]["service"]["path"]
        .as_str()
        .or_else(|| {
            hook["clientConfig"]["url"]
                .as_str()
                .and_then(|u| u.find(path).map(|i| &u[i..]))
        })
        .unwrap_or_else(|| panic!("{what}: no clientConfig path in {hook}"));
    assert_eq!(served, path, "{what}: the operator serves {path}");
}

/// The webhook fields that must not differ between two shipped configurations (all but where
/// the API server reaches the webhook and which namespaces it covers).
pub fn webhook_behaviour(configuration: &Value) -> Value {
    let hooks = configuration["webhooks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    Value::Array(
        hooks
            .iter()
            .map(|hook| {
                json!({
                    "name": hook["name"],
                    "rules": hook["rules"],
                    "failurePolicy": hook["failurePolicy"],
                    "matchPolicy": hook["matchPolicy"],
                    "sideEffects": hook["sideEffects"],
                    "timeoutSeconds": hook["timeoutSeconds"],
                    "admissionReviewVersions": hook["admissionReviewVersions"],
                    "path": hook["clientConfig"]["service"]["path"],
                })
            })
            .collect(),
    )
}

/// Who the operator is in an install, for `kubectl auth can-i --as`.
pub struct Operator<'a> {
    /// Its namespace and ServiceAccount.
    pub namespace: &'a str,
    pub service_account: &'a str,
    /// Its webhook certificate Secret, its Lease and its ValidatingWebhookConfiguration (and the
    /// MutatingWebhookConfiguration of the same name).
    pub certificate_secret: &'a str,
    pub lease: &'a str,
    pub webhook_configuration: &'a str,
}

/// Asks the real API server what the operator's ServiceAccount may do and asserts the README's
/// table: Secrets readable only in `watched` (everywhere with `all_secrets`) plus its own
/// certificate, status writable but spec not, its finalizer, Events, its Lease in its own
/// namespace only, its own webhook configurations only, nothing else. All rows are asked before
/// one assertion lists every row that differs.
pub fn assert_operator_rbac(
    cp: &ControlPlane,
    op: &Operator<'_>,
    watched: &[&str],
    unwatched: &[&str],
    all_secrets: bool,
) {
    let own = op.namespace;
    let cert = format!("secrets/{}", op.certificate_secret);
    let lease = format!("leases/{}", op.lease);
    let vwc = format!(
        "validatingwebhookconfigurations/{}",
        op.webhook_configuration
    );
    let mwc = format!("mutatingwebhookconfigurations/{}", op.webhook_configuration);
    let other = unwatched.first().copied().unwrap_or("default");
    // (verb, resource[/name], subresource, namespace ("" = cluster or all), expected)
    let mut rows: Vec<(&str, String, &str, String, bool)> = vec![
        ("get", cert.clone(), "", own.into(), true),
        ("update", cert.clone(), "", own.into(), true),
        ("create", "secrets".into(), "", own.into(), true),
        ("delete", cert.clone(), "", own.into(), false),
        (
            "get",
            "secrets/someone-elses".into(),
            "",
            own.into(),
            all_secrets || watched.contains(&own),
        ),
        ("create", "secrets".into(), "", other.into(), false),
        ("list", "secrets".into(), "", "".into(), all_secrets),
        (
            "get",
            "subscriptions.messaging.settle.dev".into(),
            "",
            other.into(),
            true,
        ),
        (
            "watch",
            "subscriptions.messaging.settle.dev".into(),
            "",
            "".into(),
            true,
        ),
        (
            "patch",
            "subscriptions.messaging.settle.dev".into(),
            "status",
            other.into(),
            true,
        ),
        // Status is written by server-side apply (patch), never by update.
        (
            "update",
            "subscriptions.messaging.settle.dev".into(),
            "status",
            other.into(),
            false,
        ),
        // patch on the object itself is for the finalizer only; it never writes a spec.
        (
            "patch",
            "subscriptions.messaging.settle.dev".into(),
            "",
            other.into(),
            true,
        ),
        (
            "update",
            "subscriptions.messaging.settle.dev".into(),
            "",
            other.into(),
            false,
        ),
        (
            "create",
            "subscriptions.messaging.settle.dev".into(),
            "",
            other.into(),
            false,
        ),
        (
            "delete",
            "subscriptions.messaging.settle.dev".into(),
            "",
            other.into(),
            false,
        ),
        // The operator sets no ownerReferences, so it needs nothing on finalizers.
        (
            "update",
            "subscriptions.messaging.settle.dev".into(),
            "finalizers",
            other.into(),
            false,
        ),
        (
            "list",
            "backends.messaging.settle.dev".into(),
            "",
            "".into(),
            true,
        ),
        (
            "patch",
            "backends.messaging.settle.dev".into(),
            "status",
            other.into(),
            true,
        ),
        (
            "patch",
            "backends.messaging.settle.dev".into(),
            "",
            other.into(),
            false,
        ),
        (
            "delete",
            "backends.messaging.settle.dev".into(),
            "",
            other.into(),
            false,
        ),
        // kube's Recorder writes events.k8s.io/v1 Events only.
        ("create", "events".into(), "", other.into(), false),
        (
            "create",
            "events.events.k8s.io".into(),
            "",
            other.into(),
            true,
        ),
        ("delete", "events".into(), "", other.into(), false),
        (
            "create",
            "leases.coordination.k8s.io".into(),
            "",
            own.into(),
            true,
        ),
        ("update", lease.clone(), "", own.into(), true),
        ("get", lease.clone(), "", own.into(), true),
        // Its own Lease only, and only the verbs the code calls.
        (
            "get",
            "leases.coordination.k8s.io/someone-elses".into(),
            "",
            own.into(),
            false,
        ),
        ("patch", lease.clone(), "", own.into(), false),
        (
            "watch",
            "leases.coordination.k8s.io".into(),
            "",
            own.into(),
            false,
        ),
        // metrics.auth is off by default: no token or access reviews.
        (
            "create",
            "tokenreviews.authentication.k8s.io".into(),
            "",
            "".into(),
            false,
        ),
        (
            "create",
            "leases.coordination.k8s.io".into(),
            "",
            other.into(),
            false,
        ),
        ("update", lease.clone(), "", other.into(), false),
        ("patch", vwc.clone(), "", "".into(), true),
        ("patch", mwc.clone(), "", "".into(), true),
        ("get", mwc.clone(), "", "".into(), true),
        (
            "patch",
            "validatingwebhookconfigurations/someone-else".into(),
            "",
            "".into(),
            false,
        ),
        (
            "patch",
            "mutatingwebhookconfigurations/someone-else".into(),
            "",
            "".into(),
            false,
        ),
        (
            "create",
            "mutatingwebhookconfigurations".into(),
            "",
            "".into(),
            false,
        ),
        (
            "create",
            "validatingwebhookconfigurations".into(),
            "",
            "".into(),
            false,
        ),
        ("get", "pods".into(), "", own.into(), false),
        ("get", "configmaps".into(), "", own.into(), false),
        ("create", "deployments.apps".into(), "", own.into(), false),
        ("*", "*".into(), "", "".into(), false),
    ];
    for ns in watched {
        for verb in ["get", "list", "watch"] {
            rows.push((verb, "secrets".into(), "", ns.to_string(), true));
        }
        rows.push(("create", "secrets".into(), "", ns.to_string(), false));
    }
    for ns in unwatched {
        for verb in ["get", "list", "watch"] {
            rows.push((verb, "secrets".into(), "", ns.to_string(), all_secrets));
        }
    }

    let sa = format!("system:serviceaccount:{own}:{}", op.service_account);
    let mut wrong = Vec::new();
    for (verb, resource, sub, ns, want) in &rows {
        let mut args = vec![
            "auth",
            "can-i",
            verb,
            resource.as_str(),
            "--as",
            sa.as_str(),
        ];
        if !sub.is_empty() {
            args.extend(["--subresource", sub]);
        }
        if ns.is_empty() {
            args.push("--all-namespaces");
        } else {
            args.extend(["-n", ns.as_str()]);
        }
        let out = cp.kubectl(&args, None);
        let answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let got = match answer.as_str() {
            "yes" => true,
            "no" => false,
            _ => panic!(
                "kubectl {args:?} answered neither yes nor no: {answer} {}",
                String::from_utf8_lossy(&out.stderr)
            ),
        };
        if got != *want {
            let sub = if sub.is_empty() {
                String::new()
            } else {
                format!(" --subresource {sub}")
            };
            let place = if ns.is_empty() {
                "cluster-wide".to_string()
            } else {
                format!("in {ns}")
            };
            wrong.push(format!(
                "  {verb} {resource}{sub} {place}: {} (wanted {})",
                if got { "yes" } else { "no" },
                if *want { "yes" } else { "no" }
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} RBAC answers for {sa} are not what the README says:\n{}",
        wrong.len(),
        rows.len(),
        wrong.join("\n")
    );
}

/// No Role or ClusterRole among `manifests` uses a wildcard in apiGroups, resources or verbs.
pub fn assert_no_rbac_wildcard(what: &str, manifests: &[Value]) {
    let mut roles = 0;
    for doc in manifests {
        if !matches!(doc["kind"].as_str(), Some("Role" | "ClusterRole")) {
            continue;
        }
        roles += 1;
        for rule in doc["rules"].as_array().into_iter().flatten() {
            for key in ["apiGroups", "resources", "verbs"] {
                let wild = rule[key]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|v| v.as_str().is_some_and(|s| s.contains('*')));
                assert!(
                    !wild,
                    "{what}: wildcard in {key} of {} {}: {rule}",
                    doc["kind"], doc["metadata"]["name"]
                );
            }
        }
    }
    assert!(
        roles >= 2,
        "{what}: expected a ClusterRole and a Role, found {roles}"
    );
}

/// kube-score's verdict on rendered manifests.
pub struct KubeScore {
    /// CRITICAL findings that nothing declines: `Kind/name: check-id: summary`.
    pub critical: Vec<String>,
    /// WARNING findings, for the record.
    pub warnings: Vec<String>,
    /// Checks declined by `kube-score/ignore` annotations that would otherwise be CRITICAL.
    pub declined: BTreeSet<String>,
    /// Every check id named by a `kube-score/ignore` annotation.
    pub annotated: BTreeSet<String>,
}

fn run_kube_score(manifests: &str, extra: &[&str]) -> Vec<Value> {
    let mut child = Command::new(tool("kube-score"))
        .args([
            "score",
            "--output-format",
            "json",
            "--kubernetes-version",
            "v1.36",
        ])
        .args(extra)
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kube-score");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(manifests.as_bytes())
        .expect("write manifests to kube-score");
    let out = child.wait_with_output().expect("kube-score ran");
    // It exits 1 when it finds something critical; the JSON says what.
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "kube-score printed no JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn criticals(report: &[Value]) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for object in report {
        for check in object["checks"].as_array().into_iter().flatten() {
            if check["skipped"] != json!(true) && check["grade"] == json!(1) {
                let summaries: Vec<&str> = check["comments"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|c| c["summary"].as_str())
                    .collect();
                found.push((
                    check["check"]["id"].as_str().unwrap_or("?").to_string(),
                    format!(
                        "{}: {}: {}",
                        object["object_name"].as_str().unwrap_or("?"),
                        check["check"]["id"].as_str().unwrap_or("?"),
                        summaries.join("; ")
                    ),
                ));
            }
        }
    }
    found
}

pub fn kube_score(manifests: &str) -> KubeScore {
    let report = run_kube_score(manifests, &[]);
    let critical: Vec<(String, String)> = criticals(&report);
    let mut warnings = Vec::new();
    for object in &report {
        for check in object["checks"].as_array().into_iter().flatten() {
            if check["skipped"] != json!(true) && check["grade"] == json!(5) {
                warnings.push(format!(
                    "{}: {}",
                    object["object_name"].as_str().unwrap_or("?"),
                    check["check"]["id"]
                ));
            }
        }
    }
    let undeclined = run_kube_score(manifests, &["--disable-ignore-checks-annotations"]);
    let declined = criticals(&undeclined)
        .into_iter()
        .map(|(id, _)| id)
        .filter(|id| !critical.iter().any(|(c, _)| c == id))
        .collect();
    let annotated = docs(manifests)
        .iter()
        .filter_map(|d| {
            d["metadata"]["annotations"]["kube-score/ignore"]
                .as_str()
                .map(str::to_string)
        })
        .flat_map(|s| {
            s.split(',')
                .map(|id| id.trim().to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    KubeScore {
        critical: critical.into_iter().map(|(_, line)| line).collect(),
        warnings,
        declined,
        annotated,
    }
}

/// The same value with every whole float written as an integer (`1.0` and `1` are the same
/// number to the API server, and YAML tools print them either way).
pub fn normalise_numbers(v: &Value) -> Value {
    match v {
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 9e15 => json!(f as i64),
            _ => v.clone(),
        },
        Value::Array(items) => Value::Array(items.iter().map(normalise_numbers).collect()),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), normalise_numbers(v)))
                .collect(),
        ),
        _ => v.clone(),
    }
}

/// Where two values first differ, as a path and both sides; None when they are equal.
pub fn first_difference(a: &Value, b: &Value) -> Option<String> {
    fn walk(a: &Value, b: &Value, path: &str) -> Option<String> {
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                keys.into_iter().find_map(|k| {
                    walk(
                        x.get(k).unwrap_or(&Value::Null),
                        y.get(k).unwrap_or(&Value::Null),
                        &format!("{path}.{k}"),
                    )
                })
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
                .iter()
                .zip(y)
                .enumerate()
                .find_map(|(i, (p, q))| walk(p, q, &format!("{path}[{i}]"))),
            _ if a == b => None,
            _ => Some(format!("{path}: {a} vs {b}")),
        }
    }
    walk(a, b, "")
}
