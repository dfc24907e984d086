//! The operator's RBAC as the README states it, asked of the real API server with `kubectl auth
//! can-i`, and that no role uses a wildcard.

use serde_json::Value;

use crate::controlplane::ControlPlane;

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
        // Likewise for a Backend's finalizer (it stays while its Subscriptions delete their
        // consumers); never its spec.
        (
            "patch",
            "backends.messaging.settle.dev".into(),
            "",
            other.into(),
            true,
        ),
        (
            "update",
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
