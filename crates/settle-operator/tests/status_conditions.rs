//! Two status writers share `status.conditions` on the real API server: because the list is a
//! map keyed by `type`, each field manager server-side-applies its own conditions and never
//! erases the other's (the controller writes Accepted and Ready, the account Exhausting and
//! Stranding).

use settle_testkit as common;

use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;
use settle::api::Subscription;

fn condition(t: &str, status: &str, reason: &str) -> serde_json::Value {
    json!({
        "type": t,
        "status": status,
        "reason": reason,
        "message": format!("{t} set by a test"),
        "lastTransitionTime": "2026-11-30T10:00:00Z",
    })
}

async fn apply(api: &Api<Subscription>, manager: &str, conditions: Vec<serde_json::Value>) {
    let patch = json!({
        "apiVersion": "messaging.settle.dev/v1alpha1",
        "kind": "Subscription",
        "metadata": {"name": "orders"},
        "status": {"conditions": conditions},
    });
    api.patch_status(
        "orders",
        &PatchParams::apply(manager).force(),
        &Patch::Apply(&patch),
    )
    .await
    .unwrap_or_else(|e| panic!("{manager} applies its conditions: {e}"));
}

async fn types(api: &Api<Subscription>) -> Vec<(String, String)> {
    let s = api.get_status("orders").await.expect("read status");
    let mut v: Vec<(String, String)> = s
        .status
        .map(|st| st.conditions)
        .unwrap_or_default()
        .into_iter()
        .map(|c| (c.type_, c.status))
        .collect();
    v.sort();
    v
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

#[tokio::test]
async fn two_field_managers_apply_their_own_conditions_without_erasing_each_other() {
    common::install_crds();
    let ns = common::namespace("conditions");
    let client = common::kube_client().await;
    let api: Api<Subscription> = Api::namespaced(client, &ns);
    let sub: Subscription = serde_json::from_value(json!({
        "apiVersion": "messaging.settle.dev/v1alpha1",
        "kind": "Subscription",
        "metadata": {"name": "orders"},
        "spec": {"backendRef": {"name": "nats"}, "pattern": "orders.>"},
    }))
    .unwrap();
    api.create(&PostParams::default(), &sub)
        .await
        .expect("create");

    apply(
        &api,
        "settle-reconcile",
        vec![
            condition("Accepted", "True", "Valid"),
            condition("Ready", "True", "ConsumerReady"),
        ],
    )
    .await;
    apply(
        &api,
        "settle-account",
        vec![
            condition("Exhausting", "False", "NoLoss"),
            condition("Stranding", "False", "NoneStranded"),
        ],
    )
    .await;
    assert_eq!(
        types(&api).await,
        pairs(&[
            ("Accepted", "True"),
            ("Exhausting", "False"),
            ("Ready", "True"),
            ("Stranding", "False")
        ]),
        "both writers' conditions are there"
    );

    // The controller changes its own: the account's stay.
    apply(
        &api,
        "settle-reconcile",
        vec![
            condition("Accepted", "True", "Valid"),
            condition("Ready", "False", "Unreachable"),
        ],
    )
    .await;
    assert_eq!(
        types(&api).await,
        pairs(&[
            ("Accepted", "True"),
            ("Exhausting", "False"),
            ("Ready", "False"),
            ("Stranding", "False")
        ])
    );

    // A writer that stops applying one of its conditions removes only that one.
    apply(
        &api,
        "settle-account",
        vec![condition("Exhausting", "True", "MessagesExhausted")],
    )
    .await;
    assert_eq!(
        types(&api).await,
        pairs(&[
            ("Accepted", "True"),
            ("Exhausting", "True"),
            ("Ready", "False")
        ])
    );

    common::kubectl_ok(&["delete", "namespace", &ns, "--wait=false"], None);
}
