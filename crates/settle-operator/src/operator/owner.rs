//! Who owns what the operator makes for itself. Its Lease and its self-managed webhook
//! certificate Secret are not in the chart (the operator creates them at its first start), so
//! `helm uninstall` would leave them behind. They are owned by the operator's own ServiceAccount,
//! which the install creates and the uninstall deletes: the garbage collector then deletes them
//! too. The ServiceAccount is found by asking the API server who the operator is (a
//! SelfSubjectReview, which every authenticated user may make), so no permission is added.
//!
//! It must not stop the operator: outside a pod (a user's kubeconfig), or when the review fails,
//! nothing gets an owner and one line says so. It must not write any object itself.

use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Api;
use kube::api::PostParams;

/// The owner reference to ServiceAccount `namespace`/`name` of the user `username` with `uid`,
/// when that user is a ServiceAccount of `namespace` (`system:serviceaccount:<ns>:<name>`).
pub fn service_account_owner(username: &str, uid: &str, namespace: &str) -> Option<OwnerReference> {
    let rest = username.strip_prefix("system:serviceaccount:")?;
    let (ns, name) = rest.split_once(':')?;
    if ns != namespace || name.is_empty() || name.contains(':') || uid.is_empty() {
        return None;
    }
    Some(OwnerReference {
        api_version: "v1".into(),
        kind: "ServiceAccount".into(),
        name: name.into(),
        uid: uid.into(),
        // Neither: the operator's ServiceAccount is deleted whatever it owns, and setting
        // blockOwnerDeletion would need a permission on the ServiceAccount's finalizers.
        controller: None,
        block_owner_deletion: None,
    })
}

/// The operator's own ServiceAccount in `namespace`, as an owner reference; `None` (logged) when
/// the operator does not run as one.
pub async fn own_service_account(client: &kube::Client, namespace: &str) -> Option<OwnerReference> {
    let api: Api<SelfSubjectReview> = Api::all(client.clone());
    let review = match api
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
    {
        Ok(r) => r,
        Err(e) => {
            tracing::info!(error = %e, "cannot tell which ServiceAccount this is (SelfSubjectReview); the Lease and the certificate Secret get no owner");
            return None;
        }
    };
    let user = review.status.and_then(|s| s.user_info).unwrap_or_default();
    let username = user.username.unwrap_or_default();
    let owner = service_account_owner(&username, &user.uid.unwrap_or_default(), namespace);
    match &owner {
        Some(o) => tracing::info!(
            service_account = %o.name,
            "the Lease and the certificate Secret this operator creates are owned by its ServiceAccount (deleted with it)"
        ),
        None => tracing::info!(
            user = %username,
            "not a ServiceAccount of namespace {namespace}: the Lease and the certificate Secret get no owner"
        ),
    }
    owner
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_service_account_of_the_operators_namespace_owns() {
        let o = service_account_owner(
            "system:serviceaccount:settle-system:settle",
            "u-1",
            "settle-system",
        )
        .expect("owner");
        assert_eq!(
            (o.kind.as_str(), o.name.as_str(), o.uid.as_str()),
            ("ServiceAccount", "settle", "u-1")
        );
        assert_eq!(o.api_version, "v1");
        for (user, uid, ns) in [
            ("system:serviceaccount:other:settle", "u-1", "settle-system"),
            (
                "system:serviceaccount:settle-system:",
                "u-1",
                "settle-system",
            ),
            (
                "system:serviceaccount:settle-system:settle",
                "",
                "settle-system",
            ),
            ("kubernetes-admin", "u-1", "settle-system"),
            (
                "system:serviceaccount:settle-system:a:b",
                "u-1",
                "settle-system",
            ),
        ] {
            assert_eq!(
                service_account_owner(user, uid, ns),
                None,
                "{user} {uid:?} {ns}"
            );
        }
    }
}
