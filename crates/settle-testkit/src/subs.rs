//! Subscriptions and Backends for the controller tests: manifests applied with real kubectl,
//! status read through the API, waits on conditions, and the Events recorded on an object.

use std::time::Duration;

use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::ListParams;
use settle::api::{Backend, Subscription, SubscriptionStatus};

use super::kubectl_ok;
use super::operator::{condition, poll};

/// Applies `yaml` in `ns` with real kubectl.
pub fn apply(ns: &str, yaml: &str) {
    kubectl_ok(&["apply", "-n", ns, "-f", "-"], Some(yaml));
}

/// A NATS Backend `name` on `servers`.
pub fn backend_yaml(name: &str, servers: &str) -> String {
    nats_backend_yaml(name, servers, "")
}

/// A NATS Backend `name` on `servers` (one URL, or a comma-separated list: one entry each),
/// then `nats` (more lines of `spec.nats`, indented four spaces: [`nats_tls`],
/// [`nats_credentials`]).
pub fn nats_backend_yaml(name: &str, servers: &str, nats: &str) -> String {
    let servers = servers
        .split(',')
        .map(|s| format!("\"{s}\""))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Backend\nmetadata: {{name: {name}}}\nspec:\n  nats:\n    servers: [{servers}]\n{nats}"
    )
}

/// `spec.nats`'s line trusting the CA in Secret `ca_secret`.
pub fn nats_tls(ca_secret: &str) -> String {
    format!("    tls: {{caSecretRef: {{name: {ca_secret}}}}}\n")
}

/// `spec.nats`'s line naming the credentials in Secret `secret`.
pub fn nats_credentials(secret: &str) -> String {
    format!("    credentialsSecretRef: {{name: {secret}}}\n")
}

/// A Subscription `name` on Backend `nats` with `spec` (indented two spaces, after backendRef).
pub fn sub_yaml(name: &str, spec: &str) -> String {
    format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: {name}}}\nspec:\n  backendRef: {{name: nats}}\n{spec}"
    )
}

pub async fn subs(ns: &str) -> Api<Subscription> {
    Api::namespaced(super::kube_client().await, ns)
}

pub async fn backends(ns: &str) -> Api<Backend> {
    Api::namespaced(super::kube_client().await, ns)
}

/// Waits until Subscription `name` shows condition `type_` with `status` and `reason`, for its
/// current generation; returns it.
pub async fn wait_condition(
    api: &Api<Subscription>,
    name: &str,
    type_: &str,
    status: &str,
    reason: &str,
    limit: Duration,
) -> Subscription {
    poll(
        &format!("Subscription {name} to show {type_}={status} ({reason})"),
        limit,
        || async {
            let (s, st) = sub_status(api, name).await?;
            if st.observed_generation != s.metadata.generation {
                return Err(format!(
                    "observedGeneration {:?}, generation {:?}",
                    st.observed_generation, s.metadata.generation
                ));
            }
            let (cs, cr, m) =
                condition(&st.conditions, type_).ok_or(format!("no {type_} condition yet"))?;
            if cs == status && cr == reason {
                Ok(s)
            } else {
                Err(format!("{type_}={cs} {cr}: {m}"))
            }
        },
    )
    .await
}

pub async fn wait_ready(api: &Api<Subscription>, name: &str) -> Subscription {
    wait_condition(
        api,
        name,
        "Ready",
        "True",
        "ConsumerReady",
        Duration::from_secs(60),
    )
    .await
}

/// Waits until Subscription `name` no longer exists.
/// Deletes every Subscription and Backend of `ns` at once, as the namespace controller does when
/// the namespace is deleted (`kubectl delete --all --wait=false`: their finalizers are the
/// operator's to remove).
pub fn delete_all_at_once(ns: &str) {
    kubectl_ok(
        &[
            "delete",
            "subscriptions,backends",
            "--all",
            "-n",
            ns,
            "--wait=false",
        ],
        None,
    );
}

/// Deletes Subscription `name` as a user does when no operator runs to remove its finalizer:
/// `kubectl delete --wait=false`, then the finalizer taken off by hand. What the operator would
/// have cleaned up (consumer, queues, ledger) stays on the broker.
pub fn delete_by_hand(ns: &str, name: &str) {
    kubectl_ok(
        &["delete", "subscription", name, "-n", ns, "--wait=false"],
        None,
    );
    let target = format!("subscription/{name}");
    kubectl_ok(&no_finalizers(&target, ns), None);
}

/// The `kubectl` arguments that take the finalizers off `target` (`KIND/NAME`) in `ns`.
pub fn no_finalizers<'a>(target: &'a str, ns: &'a str) -> [&'a str; 7] {
    [
        "patch",
        target,
        "-n",
        ns,
        "--type=merge",
        "-p",
        r#"{"metadata":{"finalizers":null}}"#,
    ]
}

pub async fn wait_gone(api: &Api<Subscription>, name: &str, limit: Duration) {
    poll(
        &format!("Subscription {name} to be gone"),
        limit,
        || async {
            match api.get_opt(name).await.map_err(|e| e.to_string())? {
                None => Ok(()),
                Some(s) => Err(format!(
                    "still there, finalizers {:?}, deletionTimestamp {:?}",
                    s.metadata.finalizers, s.metadata.deletion_timestamp
                )),
            }
        },
    )
    .await
}

/// The Events recorded on object `name` in `ns`, as `(reason, note)`.
pub async fn events(ns: &str, name: &str) -> Vec<(String, String)> {
    let api: Api<Event> = Api::namespaced(super::kube_client().await, ns);
    api.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect()
}

/// Waits until an Event with `reason` is recorded on `name`; returns its note.
pub async fn wait_event(ns: &str, name: &str, reason: &str) -> String {
    poll(
        &format!("an Event {reason} on {name}"),
        Duration::from_secs(30),
        || async {
            let all = events(ns, name).await;
            all.iter()
                .find(|(r, _)| r == reason)
                .map(|(_, n)| n.clone())
                .ok_or(format!("events: {all:?}"))
        },
    )
    .await
}

/// A Subscription `name` on Backend `backend` with `spec` (indented two spaces, after backendRef).
pub fn sub_yaml_on(backend: &str, name: &str, spec: &str) -> String {
    format!(
        "apiVersion: messaging.settle.dev/v1alpha1\nkind: Subscription\nmetadata: {{name: {name}}}\nspec:\n  backendRef: {{name: {backend}}}\n{spec}"
    )
}

/// Waits until Backend `name`'s Ready condition has `status` and `reason`; returns it.
pub async fn wait_backend(api: &Api<Backend>, name: &str, status: &str, reason: &str) -> Backend {
    wait_backend_within(api, name, status, reason, Duration::from_secs(60)).await
}

/// [`wait_backend`], for at most `limit`.
pub async fn wait_backend_within(
    api: &Api<Backend>,
    name: &str,
    status: &str,
    reason: &str,
    limit: Duration,
) -> Backend {
    poll(
        &format!("Backend {name} to be Ready={status} ({reason})"),
        limit,
        || async {
            let (s, r, m, b) = backend_ready(api, name).await?;
            if s == status && r == reason {
                Ok(b)
            } else {
                Err(format!("Ready={s} {r}: {m}"))
            }
        },
    )
    .await
}

/// Waits until Backend `name` shows condition `type_` with `status` and `reason`; returns its
/// message.
pub async fn wait_backend_condition(
    api: &Api<Backend>,
    name: &str,
    type_: &str,
    status: &str,
    reason: &str,
    limit: Duration,
) -> String {
    poll(
        &format!("Backend {name} to show {type_}={status} ({reason})"),
        limit,
        || async {
            let b = api
                .get_opt(name)
                .await
                .map_err(|e| e.to_string())?
                .ok_or("no such Backend")?;
            let st = b.status.unwrap_or_default();
            let (s, r, m) =
                condition(&st.conditions, type_).ok_or(format!("no {type_} condition yet"))?;
            if s == status && r == reason {
                Ok(m)
            } else {
                Err(format!("{type_}={s} {r}: {m}"))
            }
        },
    )
    .await
}

/// Subscription `name` now, and its status (empty while it has none); `Err` says why there is
/// no such Subscription.
pub async fn sub_status(
    api: &Api<Subscription>,
    name: &str,
) -> Result<(Subscription, SubscriptionStatus), String> {
    let s = api
        .get_opt(name)
        .await
        .map_err(|e| e.to_string())?
        .ok_or("no such Subscription")?;
    let st = s.status.clone().unwrap_or_default();
    Ok((s, st))
}

/// Backend `name`'s Ready condition now, as (status, reason, message), and the Backend; `Err`
/// says why there is none yet.
pub async fn backend_ready(
    api: &Api<Backend>,
    name: &str,
) -> Result<(String, String, String, Backend), String> {
    let b = api
        .get_opt(name)
        .await
        .map_err(|e| e.to_string())?
        .ok_or("no such Backend")?;
    let st = b.status.clone().unwrap_or_default();
    let (s, r, m) = condition(&st.conditions, "Ready").ok_or("no Ready condition yet")?;
    Ok((s, r, m, b))
}

/// Each Subscription's Ready condition `(status, reason, message)`, by name (`None`: none yet,
/// or the object is gone).
pub type Readiness = Vec<(String, Option<(String, String, String)>)>;

/// The Ready condition of each of `names`.
pub async fn readiness(api: &Api<Subscription>, names: &[String]) -> Readiness {
    let mut all = Vec::new();
    for n in names {
        let ready = api
            .get_opt(n)
            .await
            .ok()
            .flatten()
            .and_then(|s| s.status)
            .and_then(|st| condition(&st.conditions, "Ready"));
        all.push((n.clone(), ready));
    }
    all
}

/// Waits until the Ready conditions of `names` satisfy `done`.
pub async fn wait_readiness(
    api: &Api<Subscription>,
    names: &[String],
    what: &str,
    limit: Duration,
    done: impl Fn(&Readiness) -> bool,
) {
    poll(what, limit, || async {
        let seen = readiness(api, names).await;
        if done(&seen) {
            Ok(())
        } else {
            Err(format!("{seen:?}"))
        }
    })
    .await
}

/// A ValidatingAdmissionPolicy in the API server refusing every status write of Subscription
/// `name` in `ns` that names a consumer: the controller's status, as if it had not arrived yet
/// (the account writer's counters, which name none, still pass). Opened by [`StatusGate::open`]
/// (or on drop).
pub struct StatusGate {
    policy: String,
}

impl StatusGate {
    /// Closes the gate and waits until the API server enforces it (its policies are read
    /// through an informer: a probe ConfigMap the policy also refuses tells when).
    pub async fn close(ns: &str, name: &str) -> StatusGate {
        let policy = format!("settle-test-gate-{ns}-{name}");
        let probe = format!("{policy}-probe");
        kubectl_ok(
            &["apply", "-f", "-"],
            Some(&format!(
                "apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicy\nmetadata: {{name: {policy}}}\nspec:\n  failurePolicy: Fail\n  matchConstraints:\n    resourceRules:\n    - apiGroups: [messaging.settle.dev]\n      apiVersions: [\"*\"]\n      operations: [UPDATE]\n      resources: [subscriptions/status]\n    - apiGroups: [\"\"]\n      apiVersions: [v1]\n      operations: [CREATE]\n      resources: [configmaps]\n  validations:\n  - expression: \"has(object.kind) && object.kind == 'ConfigMap' ? object.metadata.name != '{probe}' : (object.metadata.name != '{name}' || !has(object.status) || !has(object.status.consumer))\"\n    message: held back by the test's gate\n---\napiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicyBinding\nmetadata: {{name: {policy}}}\nspec:\n  policyName: {policy}\n  validationActions: [Deny]\n  matchResources:\n    namespaceSelector:\n      matchLabels: {{kubernetes.io/metadata.name: {ns}}}\n"
            )),
        );
        poll(
            "the API server to enforce the status gate",
            Duration::from_secs(30),
            || async {
                let out = super::kubectl(
                    &["create", "configmap", &probe, "-n", ns, "--dry-run=server"],
                    None,
                );
                let said = String::from_utf8_lossy(&out.stderr).into_owned();
                if said.contains("held back by the test's gate") {
                    Ok(())
                } else if out.status.success() {
                    Err("the probe was admitted".to_string())
                } else {
                    Err(said)
                }
            },
        )
        .await;
        StatusGate { policy }
    }

    /// Opens the gate: the controller's next status write passes.
    pub fn open(&mut self) {
        if self.policy.is_empty() {
            return;
        }
        for kind in [
            "validatingadmissionpolicybinding",
            "validatingadmissionpolicy",
        ] {
            kubectl_ok(&["delete", kind, &self.policy, "--ignore-not-found"], None);
        }
        self.policy.clear();
    }
}

impl Drop for StatusGate {
    fn drop(&mut self) {
        self.open();
    }
}
