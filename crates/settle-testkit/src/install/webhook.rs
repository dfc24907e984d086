//! The shipped webhook configurations (validating and mutating): reading them, pointing them at
//! a test's operator by URL, and asserting what they promise.

use serde_json::{Value, json};

use super::helm::docs;
use crate::root;

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
