//! The admission webhook's wiring, in process: what `review` answers for each kind of request
//! (allowed, denied with the exact message, warnings, immutable updates, missing or unreadable
//! Backends, Backend status over kind defaults, dryRun, DELETE), one HTTPS round trip through the
//! real server (with a certificate swap that needs no restart, and the metrics), the body limit
//! and the turns in which bodies are read, updates that never block a cleanup (an unchanged spec,
//! an object being deleted: A14), and property tests that throw garbage at `review`: it
//! never panics, always answers, and answers malformed input with a 400 or a denial that says
//! why; and that the webhook's lean reader of objects reads as `read_subscription` does.
//!
//! The rules themselves are pinned by `crates/settle/tests/admission_rules.rs`; this file must not re-test them.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use proptest::prelude::*;
use serde_json::{Value, json};
use settle::api::{Backend, Subscription};
use settle::policy::{BackendKind, capabilities_of};
use settle::policy::{BackendRules, BackendView, SecretView, validate};
use settle_operator::admission::certs::{self, CertBundle, CertResolver, Sans};
use settle_operator::admission::webhook::{
    BackendLookup, LookupError, Server, StaticLookup, WebhookConfig, review, review_with,
};
use settle_operator::admission::{read_subscription, read_subscription_under_review};

const NS: &str = "team-a";

fn backend(name: &str, spec: Value, status: Option<Value>) -> Backend {
    let mut object = json!({
        "apiVersion": "messaging.settle.dev/v1alpha1",
        "kind": "Backend",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    });
    if let Some(status) = status {
        object["status"] = status;
    }
    serde_json::from_value(object).expect("test Backend parses")
}

/// `nats` (kind defaults: delays any amount), `rabbit-like` (a nats Backend whose status says it
/// cannot delay), `memory`.
fn lookup() -> StaticLookup {
    StaticLookup::new()
        .with(backend("nats", json!({"nats": {"servers": ["nats://nats:4222"]}}), None))
        .with(backend(
            "rabbit-like",
            json!({"nats": {"servers": ["nats://nats:4222"]}}),
            Some(json!({"capabilities": {"delaysRedelivery": false, "restartCanSpendUnseenAttempt": true}})),
        ))
        .with(backend("memory", json!({"memory": {}}), None))
}

fn subscription(spec: Value) -> Value {
    json!({
        "apiVersion": "messaging.settle.dev/v1alpha1",
        "kind": "Subscription",
        "metadata": {"name": "orders", "namespace": NS, "uid": "d1d8b0a4-1"},
        "spec": spec,
    })
}

fn request(operation: &str, object: Option<Value>, old: Option<Value>) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "messaging.settle.dev", "version": "v1alpha1", "kind": "Subscription"},
            "resource": {"group": "messaging.settle.dev", "version": "v1alpha1", "resource": "subscriptions"},
            "name": "orders",
            "namespace": NS,
            "operation": operation,
            "userInfo": {"username": "alice"},
            "object": object,
            "oldObject": old,
            "dryRun": false,
        }
    })
}

/// The parts of an answer the tests look at.
#[derive(Debug)]
struct Answer {
    uid: String,
    allowed: bool,
    code: Option<u64>,
    reason: Option<String>,
    message: Option<String>,
    warnings: Vec<String>,
}

async fn ask_with(review_body: &Value, backends: &dyn BackendLookup) -> Answer {
    let (status, body) = review(&serde_json::to_vec(review_body).expect("encode"), backends).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "body: {}",
        String::from_utf8_lossy(&body)
    );
    parse_answer(&body)
}

async fn ask(review_body: &Value) -> Answer {
    ask_with(review_body, &lookup()).await
}

fn parse_answer(body: &[u8]) -> Answer {
    let v: Value = serde_json::from_slice(body).expect("the answer is JSON");
    assert_eq!(v["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(v["kind"], "AdmissionReview");
    let r = &v["response"];
    Answer {
        uid: r["uid"].as_str().expect("uid").to_string(),
        allowed: r["allowed"].as_bool().expect("allowed"),
        code: r["status"]["code"].as_u64(),
        reason: r["status"]["reason"].as_str().map(str::to_string),
        message: r["status"]["message"].as_str().map(str::to_string),
        warnings: r["warnings"]
            .as_array()
            .map(|w| {
                w.iter()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default(),
    }
}

const DURABLE_MSG: &str = "spec.durableName: required under mode AtLeastOnce, on every backend: set spec.durableName to a stable name \
     (for example the Subscription's name) so redeliveries survive a restart";

#[tokio::test]
async fn valid_subscription_is_allowed_without_warnings() {
    let a = ask(&request(
        "CREATE",
        Some(subscription(json!({
            "backendRef": {"name": "nats"}, "pattern": "orders.>", "mode": "AtLeastOnce", "durableName": "orders",
            "backoff": {"initial": "1s", "max": "1m"}, "ackWait": "30s"
        }))),
        None,
    ))
    .await;
    assert_eq!(a.uid, "705ab4f5-6393-11e8-b7cc-42010a800002");
    assert!(a.allowed, "{a:?}");
    assert!(a.warnings.is_empty(), "{a:?}");
}

#[tokio::test]
async fn errors_deny_with_every_message_code_422_and_reason_invalid() {
    let a = ask(&request(
        "CREATE",
        Some(subscription(json!({
            "backendRef": {"name": "nats"}, "pattern": "orders.>", "mode": "AtLeastOnce",
            "backoff": {"initial": "1s", "max": "1m", "multiplier": 0.5}
        }))),
        None,
    ))
    .await;
    assert!(!a.allowed);
    assert_eq!(a.code, Some(422));
    assert_eq!(a.reason.as_deref(), Some("Invalid"));
    assert_eq!(
        a.message.as_deref(),
        Some(
            format!(
                "{DURABLE_MSG}; spec.backoff.multiplier: 0.5 is below 1: a multiplier of at least 1 keeps waits from shrinking; \
                 use 2 to double each wait"
            )
            .as_str()
        )
    );
}

#[tokio::test]
async fn warnings_are_admission_warnings_also_on_denials() {
    // Allowed, with a warning.
    let a = ask(&request(
        "CREATE",
        Some(subscription(
            json!({"backendRef": {"name": "nats"}, "pattern": "orders.>", "maxDeliver": 5}),
        )),
        None,
    ))
    .await;
    assert!(a.allowed);
    assert_eq!(
        a.warnings,
        vec![
            "spec.maxDeliver: has no effect under mode AtMostOnce (nothing is acknowledged or redelivered); remove it, \
             or set spec.mode: AtLeastOnce"
                .to_string()
        ]
    );

    // Denied, and the warning still goes out.
    let a = ask(&request(
        "CREATE",
        Some(subscription(json!({
            "backendRef": {"name": "nats"}, "pattern": "orders.>", "mode": "AtLeastOnce", "slowHandler": "Redeliver"
        }))),
        None,
    ))
    .await;
    assert!(!a.allowed);
    assert_eq!(a.message.as_deref(), Some(DURABLE_MSG));
    assert_eq!(a.warnings.len(), 1, "{a:?}");
    assert!(
        a.warnings[0]
            .starts_with("spec.ackWait: slowHandler Redeliver without an explicit ackWait"),
        "{a:?}"
    );
}

#[tokio::test]
async fn update_of_an_immutable_field_is_denied_naming_it() {
    let old = subscription(
        json!({"backendRef": {"name": "nats"}, "pattern": "orders.>", "mode": "AtLeastOnce", "durableName": "orders"}),
    );
    let new = subscription(
        json!({"backendRef": {"name": "nats"}, "pattern": "orders.>", "mode": "AtLeastOnce", "durableName": "orders-v2"}),
    );
    let a = ask(&request("UPDATE", Some(new.clone()), Some(old.clone()))).await;
    assert!(!a.allowed);
    assert_eq!(
        a.message.as_deref(),
        Some(
            "spec.durableName: cannot change from \"orders\" to \"orders-v2\": the broker cannot change a consumer's durable name in place. \
             Delete this Subscription and create it again with the new value (its consumer and unsettled deliveries go with it)"
        )
    );
    // The same object as CREATE is fine: the rule needs the old object.
    assert!(ask(&request("CREATE", Some(new), None)).await.allowed);
    // An UPDATE that changes nothing immutable is fine.
    let tweak = subscription(
        json!({"backendRef": {"name": "nats"}, "pattern": "orders.>", "mode": "AtLeastOnce", "durableName": "orders", "maxDeliver": 3}),
    );
    assert!(
        ask(&request("UPDATE", Some(tweak), Some(old)))
            .await
            .allowed
    );
}

/// AtMostOnce with a backoff: refused on every backend (A2), so it can only be stored if it got
/// in while the webhook was not registered.
fn invalid_spec() -> Value {
    json!({"backendRef": {"name": "nats"}, "pattern": "orders.>", "backoff": {"initial": "1s", "max": "1m"}})
}

#[tokio::test]
async fn an_update_that_leaves_an_invalid_spec_as_it_was_is_allowed_without_a_lookup() {
    let old = subscription(invalid_spec());
    // A label and the operator's finalizer; the spec written differently but the same values.
    let mut new = old.clone();
    new["metadata"]["labels"] = json!({"team": "a"});
    new["metadata"]["finalizers"] = json!(["messaging.settle.dev/consumer"]);
    new["spec"]["backoff"] = json!({"initial": "1000ms", "max": "60s", "multiplier": 2.0});
    // Neither the rules nor the Backend are asked: a lookup that fails does not matter (A14).
    let a = ask_with(
        &request("UPDATE", Some(new), Some(old.clone())),
        &FailingLookup,
    )
    .await;
    assert!(a.allowed, "{a:?}");
    assert_eq!(
        a.warnings,
        Vec::<String>::new(),
        "no warnings for what was already stored"
    );
    assert_eq!(a.message, None);

    // A change of the spec is judged as ever, and is still refused.
    let mut changed = old.clone();
    changed["spec"]["pattern"] = json!("orders.eu.>");
    let a = ask(&request("UPDATE", Some(changed), Some(old))).await;
    assert!(!a.allowed);
    assert_eq!(
        a.message.as_deref(),
        Some(
            "spec.backoff: not allowed under mode AtMostOnce, where nothing comes back: remove spec.backoff, or set spec.mode: AtLeastOnce"
        )
    );
}

#[tokio::test]
async fn any_update_of_a_subscription_being_deleted_is_allowed() {
    // The finalizer removal of a Subscription being deleted: its spec no longer passes, the
    // Backend cannot be read, and even the stored object does not read. Allowed (A14).
    let mut new = subscription(invalid_spec());
    new["metadata"]["deletionTimestamp"] = json!("2026-12-01T10:00:00Z");
    let mut old = new.clone();
    old["metadata"]["finalizers"] = json!(["messaging.settle.dev/consumer"]);
    old["spec"]["maxDeliver"] = json!("five");
    let a = ask_with(
        &request("UPDATE", Some(new.clone()), Some(old)),
        &FailingLookup,
    )
    .await;
    assert!(a.allowed, "{a:?}");
    assert_eq!(a.warnings, Vec::<String>::new());

    // A deletionTimestamp that is not a time is named, as any field is.
    new["metadata"]["deletionTimestamp"] = json!(5);
    let a = ask(&request("UPDATE", Some(new.clone()), Some(new))).await;
    assert!(!a.allowed);
    assert!(
        a.message
            .as_deref()
            .is_some_and(|m| m
                .starts_with("the Subscription could not be read: metadata.deletionTimestamp: ")),
        "{a:?}"
    );
}

#[tokio::test]
async fn update_without_old_object_is_denied_saying_why() {
    let new = subscription(json!({"backendRef": {"name": "nats"}, "pattern": "orders.>"}));
    let a = ask(&request("UPDATE", Some(new), None)).await;
    assert!(!a.allowed);
    assert_eq!(
        a.message.as_deref(),
        Some("the UPDATE request carries no oldObject to compare with")
    );
}

#[tokio::test]
async fn missing_backend_is_admitted_with_a_warning() {
    let a = ask(&request(
        "CREATE",
        Some(subscription(
            json!({"backendRef": {"name": "nope"}, "pattern": "orders.>"}),
        )),
        None,
    ))
    .await;
    assert!(a.allowed, "{a:?}");
    assert_eq!(
        a.warnings,
        vec![
            "spec.backendRef.name: Backend \"nope\" does not exist in this namespace yet; the Subscription is admitted, \
             its capability checks run when the Backend exists, and until then it is not Ready"
                .to_string()
        ]
    );
}

#[tokio::test]
async fn backend_in_another_namespace_does_not_count() {
    let other = StaticLookup::new().with({
        let mut b = backend("nats", json!({"nats": {"servers": ["nats://x"]}}), None);
        b.metadata.namespace = Some("elsewhere".into());
        b
    });
    let a = ask_with(
        &request(
            "CREATE",
            Some(subscription(
                json!({"backendRef": {"name": "nats"}, "pattern": "a"}),
            )),
            None,
        ),
        &other,
    )
    .await;
    assert!(a.allowed);
    assert!(
        a.warnings
            .iter()
            .any(|w| w.starts_with("spec.backendRef.name: Backend \"nats\" does not exist")),
        "{a:?}"
    );
}

#[tokio::test]
async fn backend_status_capabilities_win_over_kind_defaults() {
    let spec = |backend: &str| {
        subscription(json!({
            "backendRef": {"name": backend}, "pattern": "orders.>", "mode": "AtLeastOnce", "durableName": "orders",
            "backoff": {"initial": "1s", "max": "1m"}
        }))
    };
    // Kind defaults (nats, empty status): delays are fine.
    assert!(
        ask(&request("CREATE", Some(spec("nats")), None))
            .await
            .allowed
    );
    // Same kind, but the status says it cannot delay: refused.
    let a = ask(&request("CREATE", Some(spec("rabbit-like")), None)).await;
    assert!(!a.allowed);
    assert_eq!(
        a.message.as_deref(),
        Some(
            "spec.backoff: this backend cannot delay a redelivery (it does not declare delaysRedelivery): remove the field, \
             or use a backend that can, such as nats"
        )
    );
}

#[tokio::test]
async fn dry_run_is_answered_exactly_like_a_real_request() {
    let spec = subscription(
        json!({"backendRef": {"name": "nats"}, "pattern": "orders.>", "mode": "AtLeastOnce", "maxDeliver": 5}),
    );
    let real = request("CREATE", Some(spec), None);
    let mut dry = real.clone();
    dry["request"]["dryRun"] = json!(true);
    let lookup = lookup();
    let (s1, b1) = review(&serde_json::to_vec(&real).unwrap(), &lookup).await;
    let (s2, b2) = review(&serde_json::to_vec(&dry).unwrap(), &lookup).await;
    assert_eq!((s1, &b1), (s2, &b2));
    assert!(!parse_answer(&b1).allowed);
}

#[tokio::test]
async fn delete_connect_status_and_other_kinds_are_allowed() {
    let bad = subscription(
        json!({"backendRef": {"name": "nats"}, "pattern": "orders.>", "mode": "AtLeastOnce"}),
    );
    for op in ["DELETE", "CONNECT"] {
        let a = ask(&request(op, None, Some(bad.clone()))).await;
        assert!(a.allowed, "{op}: {a:?}");
    }
    // The status subresource never carries a spec change.
    let mut status = request("UPDATE", Some(bad.clone()), Some(bad.clone()));
    status["request"]["subResource"] = json!("status");
    assert!(ask(&status).await.allowed);
    // Other kinds are not Settle's to judge.
    let mut other = request("CREATE", Some(json!({"spec": "not even an object"})), None);
    other["request"]["kind"] = json!({"group": "", "version": "v1", "kind": "ConfigMap"});
    assert!(ask(&other).await.allowed);
}

fn backend_request(operation: &str, spec: Value, old: Option<Value>) -> Value {
    let object = |spec: Value| {
        json!({
            "apiVersion": "messaging.settle.dev/v1alpha1",
            "kind": "Backend",
            "metadata": {"name": "queues", "namespace": NS},
            "spec": spec,
        })
    };
    let mut r = request(operation, Some(object(spec)), old.map(object));
    r["request"]["kind"] =
        json!({"group": "messaging.settle.dev", "version": "v1alpha1", "kind": "Backend"});
    r["request"]["name"] = json!("queues");
    r
}

async fn ask_backend(body: &Value, lookup: &dyn BackendLookup, rules: &BackendRules) -> Answer {
    let (status, reply) =
        review_with(&serde_json::to_vec(body).expect("encode"), lookup, rules).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&reply)
    );
    parse_answer(&reply)
}

#[tokio::test]
async fn backends_are_judged_with_the_labels_of_the_secrets_they_name() {
    let lookup = StaticLookup::new()
        .with_secret(NS, "labelled", true)
        .with_secret(NS, "plain", false);
    let rules = BackendRules {
        allowed_hosts: vec!["*.messaging.svc".parse().expect("a pattern")],
        ..BackendRules::default()
    };
    let nats = |secret: &str, server: &str| json!({"nats": {"servers": [server], "credentialsSecretRef": {"name": secret}}});
    // Labelled, allowed host: admitted, warned that nats:// carries the credentials in plaintext.
    let a = ask_backend(
        &backend_request(
            "CREATE",
            nats("labelled", "nats://n.messaging.svc:4222"),
            None,
        ),
        &lookup,
        &rules,
    )
    .await;
    assert!(a.allowed, "{a:?}");
    assert_eq!(a.warnings.len(), 1, "{a:?}");
    assert!(
        a.warnings[0].starts_with("spec.nats.servers[0]: sends the credentials"),
        "{a:?}"
    );
    // Unlabelled: refused, naming the field and the label.
    let a = ask_backend(
        &backend_request("CREATE", nats("plain", "tls://n.messaging.svc:4222"), None),
        &lookup,
        &rules,
    )
    .await;
    assert!(!a.allowed);
    assert_eq!(a.code, Some(422));
    let m = a.message.unwrap_or_default();
    assert!(m.starts_with("spec.nats.credentialsSecretRef.name: Secret \"plain\" does not carry the label settle.dev/backend-credentials=true"), "{m}");
    // A host outside the allow-list, and credentials in a URL (never repeated).
    let a = ask_backend(
        &backend_request(
            "CREATE",
            json!({"rabbitmq": {"urls": ["amqp://guest:hunter2@evil.example:5672"]}}),
            None,
        ),
        &lookup,
        &rules,
    )
    .await;
    let m = a.message.unwrap_or_default();
    assert!(!a.allowed);
    assert!(
        m.contains("spec.rabbitmq.urls[0]: holds credentials"),
        "{m}"
    );
    assert!(
        m.contains("host \"evil.example\" is not among the broker hosts"),
        "{m}"
    );
    assert!(!m.contains("hunter2"), "{m}");
    // SQS without a Secret: pod identity, refused unless the namespace is listed.
    let sqs = json!({"sqs": {"region": "eu-west-1"}});
    let open = BackendRules::default();
    let a = ask_backend(
        &backend_request("CREATE", sqs.clone(), None),
        &lookup,
        &open,
    )
    .await;
    assert!(!a.allowed);
    assert!(
        a.message
            .unwrap_or_default()
            .starts_with("spec.sqs.credentialsSecretRef: required in namespace team-a")
    );
    let listed = BackendRules {
        pod_identity_namespaces: vec![NS.into()],
        ..BackendRules::default()
    };
    assert!(
        ask_backend(
            &backend_request("CREATE", sqs.clone(), None),
            &lookup,
            &listed
        )
        .await
        .allowed
    );
    // A14: an unchanged spec, or a Backend being deleted, is allowed whatever it names now.
    let stale = nats("plain", "nats://n.messaging.svc:4222");
    let a = ask_backend(
        &backend_request("UPDATE", stale.clone(), Some(stale.clone())),
        &lookup,
        &rules,
    )
    .await;
    assert!(a.allowed && a.warnings.is_empty(), "{a:?}");
    let mut deleting = backend_request(
        "UPDATE",
        stale.clone(),
        Some(nats("labelled", "nats://n.messaging.svc:4222")),
    );
    deleting["request"]["object"]["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    assert!(ask_backend(&deleting, &lookup, &rules).await.allowed);
    // An unreadable Backend is a 400 that names the field.
    let a = ask_backend(
        &backend_request("CREATE", json!({"nats": {"servers": "one"}}), None),
        &lookup,
        &rules,
    )
    .await;
    assert!(!a.allowed);
    assert_eq!(a.code, Some(400));
    assert!(
        a.message
            .unwrap_or_default()
            .starts_with("the Backend could not be read: spec.nats.servers")
    );
    // A Secret lookup that fails denies (fail closed).
    let a = ask_backend(
        &backend_request(
            "CREATE",
            nats("labelled", "tls://n.messaging.svc:4222"),
            None,
        ),
        &FailingLookup,
        &rules,
    )
    .await;
    assert!(!a.allowed);
    assert_eq!(a.code, Some(503));
}

#[tokio::test]
async fn unreadable_object_is_denied_saying_which_field() {
    let a = ask(&request(
        "CREATE",
        Some(subscription(
            json!({"backendRef": {"name": "nats"}, "pattern": "orders.>", "ackWait": 30}),
        )),
        None,
    ))
    .await;
    assert!(!a.allowed);
    assert_eq!(a.code, Some(400));
    let message = a.message.expect("a message");
    assert!(
        message.starts_with("the Subscription could not be read: spec.ackWait: "),
        "{message}"
    );
    assert!(
        message.contains("invalid type: integer `30`, expected a string"),
        "{message}"
    );

    let a = ask(&request("CREATE", Some(json!(42)), None)).await;
    assert!(!a.allowed);
    assert!(
        a.message
            .expect("message")
            .starts_with("the Subscription could not be read: invalid type: integer `42`")
    );

    let a = ask(&request("CREATE", None, None)).await;
    assert_eq!(
        a.message.as_deref(),
        Some("the admission request carries no object to validate")
    );
}

#[tokio::test]
async fn only_name_namespace_and_spec_are_read_so_odd_metadata_elsewhere_does_not_matter() {
    // The API server has checked metadata long before; the webhook reads name, namespace and
    // spec and skips the rest unparsed (a full ObjectMeta would refuse these annotations).
    let mut object = subscription(json!({"backendRef": {"name": "nats"}, "pattern": "a"}));
    object["metadata"]["annotations"] = json!([1, {"deep": [null, 2.5]}, "x"]);
    object["metadata"]["managedFields"] = json!("not a list");
    object["status"] = json!({"stats": "not stats"});
    let a = ask(&request("CREATE", Some(object.clone()), None)).await;
    assert!(a.allowed, "{a:?}");
    // The spec is still read field by field, naming the field, as read_subscription does.
    object["spec"]["maxDeliver"] = json!("five");
    let a = ask(&request("CREATE", Some(object), None)).await;
    assert_eq!(
        a.message.as_deref(),
        Some(
            "the Subscription could not be read: spec.maxDeliver: invalid type: string \"five\", expected i64"
        )
    );
    // And the name and namespace are read: a wrong type there is named too.
    let mut object = subscription(json!({"backendRef": {"name": "nats"}, "pattern": "a"}));
    object["metadata"]["namespace"] = json!(7);
    let a = ask(&request("CREATE", Some(object), None)).await;
    assert_eq!(
        a.message.as_deref(),
        Some(
            "the Subscription could not be read: metadata.namespace: invalid type: integer `7`, expected a string"
        )
    );
}

#[tokio::test]
async fn not_an_admission_review_is_a_400_with_a_reason() {
    for (body, phrase) in [
        (&b"hello"[..], "the body is not an AdmissionReview"),
        (br#"{"kind":"Pod","apiVersion":"v1"}"#, "kind is \"Pod\""),
        (br#"{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v2"}"#, "unsupported AdmissionReview apiVersion"),
        (br#"{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1"}"#, "has no request"),
        (br#"{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1","request":{"uid":"","kind":{},"operation":"CREATE"}}"#, "empty uid"),
    ] {
        let (status, reply) = review(body, &lookup()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let reply = String::from_utf8(reply).expect("utf-8");
        assert!(reply.contains(phrase), "{reply:?} should contain {phrase:?}");
    }
}

struct FailingLookup;
impl BackendLookup for FailingLookup {
    fn get<'a>(
        &'a self,
        _: &'a str,
        _: &'a str,
    ) -> BoxFuture<'a, Result<Option<Arc<Backend>>, LookupError>> {
        Box::pin(async { Err(LookupError::Other("connection refused".into())) })
    }

    fn secret<'a>(
        &'a self,
        _: &'a str,
        _: &'a str,
    ) -> BoxFuture<'a, Result<SecretView, LookupError>> {
        Box::pin(async { Err(LookupError::Other("connection refused".into())) })
    }
}

struct HangingLookup;
impl BackendLookup for HangingLookup {
    fn get<'a>(
        &'a self,
        _: &'a str,
        _: &'a str,
    ) -> BoxFuture<'a, Result<Option<Arc<Backend>>, LookupError>> {
        Box::pin(futures::future::pending())
    }

    fn secret<'a>(
        &'a self,
        _: &'a str,
        _: &'a str,
    ) -> BoxFuture<'a, Result<SecretView, LookupError>> {
        Box::pin(futures::future::pending())
    }
}

#[tokio::test]
async fn lookup_error_fails_closed_with_retry_advice() {
    let body = request(
        "CREATE",
        Some(subscription(
            json!({"backendRef": {"name": "nats"}, "pattern": "a"}),
        )),
        None,
    );
    let a = ask_with(&body, &FailingLookup).await;
    assert!(!a.allowed);
    assert_eq!(a.code, Some(503));
    assert_eq!(
        a.message.as_deref(),
        Some(
            "the Settle admission webhook could not read Backend team-a/nats (connection refused), so it cannot tell whether \
             the backend can honour this Subscription: retry in a moment"
        )
    );
}

#[tokio::test(start_paused = true)]
async fn hanging_lookup_times_out_and_fails_closed() {
    let body = request(
        "CREATE",
        Some(subscription(
            json!({"backendRef": {"name": "nats"}, "pattern": "a"}),
        )),
        None,
    );
    let a = ask_with(&body, &HangingLookup).await;
    assert!(!a.allowed);
    assert!(a.message.expect("message").contains("(timed out after 3s)"));
}

// ---------------------------------------------------------------------------------------------
// Over HTTPS.

type HttpsClient = Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Full<Bytes>,
>;

/// A TLS client configuration that trusts only `ca_pem`.
fn tls_trusting(ca_pem: &str) -> rustls::ClientConfig {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.expect("CA PEM")).expect("CA added");
    }
    rustls::ClientConfig::builder_with_provider(certs::crypto_provider())
        .with_safe_default_protocol_versions()
        .expect("protocols")
        .with_root_certificates(roots)
        .with_no_client_auth()
}

fn client_trusting(ca_pem: &str) -> HttpsClient {
    let tls = tls_trusting(ca_pem);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_http1()
        .enable_http2()
        .build();
    Client::builder(TokioExecutor::new()).build(https)
}

/// A client that sends every request over one HTTP/2 connection, as the API server does.
fn h2_client_trusting(ca_pem: &str) -> HttpsClient {
    let tls = tls_trusting(ca_pem);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_http2()
        .build();
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(https)
}

async fn post(
    client: &HttpsClient,
    addr: SocketAddr,
    path: &str,
    body: Vec<u8>,
) -> Result<(StatusCode, Vec<u8>), String> {
    let req = http::Request::post(format!("https://127.0.0.1:{}{path}", addr.port()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| format!("{e:?}"))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes()
        .to_vec();
    Ok((status, body))
}

fn local_sans() -> Sans {
    Sans {
        dns_names: vec!["localhost".into()],
        ip_addresses: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
    }
}

#[tokio::test]
async fn https_round_trip_rotation_without_restart_and_metrics() {
    let first: CertBundle =
        certs::issue_for(&local_sans(), Duration::from_secs(3600)).expect("issue");
    let resolver = Arc::new(
        CertResolver::from_pem(first.cert_pem.as_bytes(), first.key_pem.as_bytes())
            .expect("resolver"),
    );
    let registry = prometheus::Registry::new();
    let config = WebhookConfig::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
    let server = Server::bind(config, Arc::new(lookup()), resolver.clone(), &registry)
        .await
        .expect("bind");
    let addr = server.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));

    let client = client_trusting(&first.ca_pem);
    let denied = request(
        "CREATE",
        Some(subscription(
            json!({"backendRef": {"name": "nats"}, "pattern": "a", "mode": "AtLeastOnce"}),
        )),
        None,
    );
    let (status, body) = post(
        &client,
        addr,
        "/validate",
        serde_json::to_vec(&denied).unwrap(),
    )
    .await
    .expect("POST /validate");
    assert_eq!(status, StatusCode::OK);
    let a = parse_answer(&body);
    assert!(!a.allowed);
    assert_eq!(a.message.as_deref(), Some(DURABLE_MSG));

    let (status, body) = post(&client, addr, "/validate", b"not json".to_vec())
        .await
        .expect("POST garbage");
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&body).starts_with("the body is not an AdmissionReview"));

    let health = client
        .request(
            http::Request::get(format!("https://127.0.0.1:{}/healthz", addr.port()))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .expect("GET /healthz");
    assert_eq!(health.status(), StatusCode::OK);

    // Rotate to a certificate from a new CA: new connections see it, without a restart.
    let second = certs::issue_for(&local_sans(), Duration::from_secs(3600)).expect("issue");
    resolver
        .set_pem(second.cert_pem.as_bytes(), second.key_pem.as_bytes())
        .expect("swap");
    let fresh = client_trusting(&second.ca_pem);
    let allowed = request(
        "CREATE",
        Some(subscription(
            json!({"backendRef": {"name": "nats"}, "pattern": "a"}),
        )),
        None,
    );
    let (status, body) = post(
        &fresh,
        addr,
        "/validate",
        serde_json::to_vec(&allowed).unwrap(),
    )
    .await
    .expect("POST after rotation");
    assert_eq!(status, StatusCode::OK);
    assert!(parse_answer(&body).allowed);
    // A client that trusts only the old CA is refused on a new connection.
    let stale = client_trusting(&first.ca_pem);
    let err = post(
        &stale,
        addr,
        "/validate",
        serde_json::to_vec(&allowed).unwrap(),
    )
    .await
    .expect_err("old CA must not verify");
    assert!(err.to_lowercase().contains("certificate"), "{err}");

    // Metrics: one denied CREATE, one allowed CREATE, one unreadable body.
    let text = {
        let mut buf = Vec::new();
        prometheus::Encoder::encode(
            &prometheus::TextEncoder::new(),
            &registry.gather(),
            &mut buf,
        )
        .unwrap();
        String::from_utf8(buf).unwrap()
    };
    assert!(
        text.contains(r#"settle_admission_requests_total{allowed="false",operation="CREATE"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"settle_admission_requests_total{allowed="true",operation="CREATE"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"settle_admission_requests_total{allowed="false",operation="unknown"} 1"#),
        "{text}"
    );
    assert!(
        text.contains("settle_admission_duration_seconds_count 3"),
        "{text}"
    );

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(15), running)
        .await
        .expect("stops")
        .expect("joins")
        .expect("runs cleanly");
}

/// The text of every metric in `registry`.
fn metrics_text(registry: &prometheus::Registry) -> String {
    let mut buf = Vec::new();
    prometheus::Encoder::encode(
        &prometheus::TextEncoder::new(),
        &registry.gather(),
        &mut buf,
    )
    .unwrap();
    String::from_utf8(buf).unwrap()
}

/// POSTs `review` over HTTP/1.1 but sends only half of its body; returns the raw answer.
async fn half_a_body(addr: SocketAddr, ca_pem: String, review: Vec<u8>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tls = http1_over_tls(addr, &ca_pem).await;
    let head = format!(
        "POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        review.len()
    );
    tls.write_all(head.as_bytes()).await.expect("head");
    tls.write_all(&review[..review.len() / 2])
        .await
        .expect("half");
    tls.flush().await.expect("flush");
    let mut answer = Vec::new();
    let _ = tls.read_to_end(&mut answer).await;
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test]
async fn bodies_are_read_one_turn_at_a_time_and_too_large_ones_refused_unread() {
    let bundle = certs::issue_for(&local_sans(), Duration::from_secs(3600)).expect("issue");
    let resolver = Arc::new(
        CertResolver::from_pem(bundle.cert_pem.as_bytes(), bundle.key_pem.as_bytes())
            .expect("resolver"),
    );
    let registry = prometheus::Registry::new();
    let mut config = WebhookConfig::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
    config.max_concurrent_reviews = 1;
    config.max_body_bytes = 64 << 10;
    config.body_timeout = Duration::from_secs(1);
    let server = Server::bind(config, Arc::new(lookup()), resolver, &registry)
        .await
        .expect("bind");
    let addr = server.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));
    let client = client_trusting(&bundle.ca_pem);
    let review = serde_json::to_vec(&request(
        "CREATE",
        Some(subscription(
            json!({"backendRef": {"name": "nats"}, "pattern": "a"}),
        )),
        None,
    ))
    .unwrap();

    // Too large by its Content-Length: refused before any of it is read.
    let (status, body) = post(&client, addr, "/validate", vec![b' '; (64 << 10) + 1])
        .await
        .expect("POST a large body");
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(body, b"the body is larger than 65536 bytes\n");

    // A client that sends half its body holds the only turn until its body timeout; a review
    // sent meanwhile waits for the turn, and is answered once the turn is given back.
    let wait_for = |sample: &'static str| {
        let registry = registry.clone();
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !metrics_text(&registry).contains(sample) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "waited 10s for {sample}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    let slow = tokio::spawn(half_a_body(addr, bundle.ca_pem.clone(), review.clone()));
    wait_for("settle_webhook_reviews_reading 1").await;
    let queued = {
        let (client, review) = (client.clone(), review.clone());
        tokio::spawn(async move { post(&client, addr, "/validate", review).await })
    };
    wait_for("settle_webhook_reviews_waiting 1").await;
    assert!(
        !queued.is_finished(),
        "a review must wait while the only turn is held"
    );
    let slow = slow.await.expect("the slow client");
    assert!(slow.starts_with("HTTP/1.1 408"), "{slow}");
    assert!(
        slow.ends_with("the body did not arrive in time\n"),
        "{slow}"
    );
    let (status, body) = queued
        .await
        .expect("the queued review")
        .expect("POST while the turn was held");
    assert_eq!(status, StatusCode::OK);
    assert!(parse_answer(&body).allowed);

    // The turn is back: the next review is answered.
    let (status, body) = post(&client, addr, "/validate", review)
        .await
        .expect("POST after");
    assert_eq!(status, StatusCode::OK);
    assert!(parse_answer(&body).allowed);

    let text = metrics_text(&registry);
    for line in [
        r#"settle_webhook_requests_rejected_total{reason="too_large"} 1"#,
        r#"settle_webhook_requests_rejected_total{reason="busy"} 0"#,
        r#"settle_webhook_requests_rejected_total{reason="slow_body"} 1"#,
        r#"settle_admission_requests_total{allowed="true",operation="CREATE"} 2"#,
        "settle_webhook_reviews_reading 0",
        "settle_webhook_reviews_waiting 0",
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(15), running)
        .await
        .expect("stops")
        .expect("joins")
        .expect("runs cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_bodies_waiting_on_one_http2_connection_do_not_starve_the_one_being_read() {
    // One turn, four 1.5 MiB reviews at once on one connection: the three waiting must not fill
    // the connection's flow-control window and leave the one being read without data.
    let bundle = certs::issue_for(&local_sans(), Duration::from_secs(3600)).expect("issue");
    let resolver = Arc::new(
        CertResolver::from_pem(bundle.cert_pem.as_bytes(), bundle.key_pem.as_bytes())
            .expect("resolver"),
    );
    let registry = prometheus::Registry::new();
    let mut config = WebhookConfig::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
    config.max_concurrent_reviews = 1;
    config.body_timeout = Duration::from_secs(30);
    let server = Server::bind(config, Arc::new(lookup()), resolver, &registry)
        .await
        .expect("bind");
    let addr = server.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));
    let client = h2_client_trusting(&bundle.ca_pem);
    let mut object = subscription(json!({"backendRef": {"name": "nats"}, "pattern": "a"}));
    object["metadata"]["annotations"] = json!({"big": "x".repeat(3 << 19)});
    let review = serde_json::to_vec(&request("CREATE", Some(object), None)).unwrap();
    let answers: Vec<_> = (0..4)
        .map(|_| {
            let (client, review) = (client.clone(), review.clone());
            tokio::spawn(async move { post(&client, addr, "/validate", review).await })
        })
        .collect();
    for answer in answers {
        let (status, body) = tokio::time::timeout(Duration::from_secs(60), answer)
            .await
            .expect("answered within 60s")
            .expect("joins")
            .expect("POST");
        assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
        assert!(parse_answer(&body).allowed);
    }
    assert!(metrics_text(&registry).contains("settle_webhook_connections_open 1"));
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(15), running)
        .await
        .expect("stops")
        .expect("joins")
        .expect("runs cleanly");
}

// ---------------------------------------------------------------------------------------------
// Property tests: garbage in, an answer out.

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime")
}

/// Every answer is a 400 with a plain reason, or a 200 AdmissionReview whose denial says why.
fn check_answer(status: StatusCode, body: &[u8]) -> Result<Option<Answer>, TestCaseError> {
    if status == StatusCode::BAD_REQUEST {
        prop_assert!(!body.is_empty(), "a 400 must say why");
        return Ok(None);
    }
    prop_assert_eq!(
        status,
        StatusCode::OK,
        "unexpected status; body {}",
        String::from_utf8_lossy(body)
    );
    let a = parse_answer(body);
    if !a.allowed {
        prop_assert!(
            a.message.as_deref().is_some_and(|m| !m.is_empty()),
            "a denial must say why: {:?}",
            a
        );
    }
    Ok(Some(a))
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        "[a-zA-Z0-9.>*_ -]{0,12}".prop_map(Value::String),
        prop_oneof![
            Just("1s"),
            Just("0s"),
            Just("-1s"),
            Just("1h30m"),
            Just("5m"),
            Just("13h"),
            Just("x")
        ]
        .prop_map(|s| json!(s)),
        prop_oneof![
            Just("AtLeastOnce"),
            Just("AtMostOnce"),
            Just("Redeliver"),
            Just("ExtendLease"),
            Just("Fanout")
        ]
        .prop_map(|s| json!(s)),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("spec".to_string()),
                    Just("metadata".to_string()),
                    Just("backendRef".to_string()),
                    Just("name".to_string()),
                    Just("mode".to_string()),
                    Just("backoff".to_string()),
                    "[a-zA-Z]{1,8}",
                ],
                inner,
                0..5
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// The spec fields a Subscription may carry, with good and bad values.
fn spec_field() -> impl Strategy<Value = (&'static str, Value)> {
    let duration = prop_oneof![
        Just("1s"),
        Just("500ms"),
        Just("1m"),
        Just("13h"),
        Just("0s"),
        Just("30s")
    ]
    .prop_map(|s| json!(s));
    prop_oneof![
        Just(("mode", json!("AtLeastOnce"))),
        Just(("mode", json!("AtMostOnce"))),
        Just(("durableName", json!("orders"))),
        Just(("slowHandler", json!("Redeliver"))),
        Just(("slowHandler", json!("ExtendLease"))),
        (1i64..10).prop_map(|n| ("maxDeliver", json!(n))),
        (1i32..500).prop_map(|n| ("maxInFlight", json!(n))),
        duration.clone().prop_map(|d| ("ackWait", d)),
        duration.clone().prop_map(|d| ("maxProcessingTime", d)),
        duration.clone().prop_map(|d| ("maxNackDelay", d)),
        (duration.clone(), duration, 0.0f64..4.0)
            .prop_map(|(i, m, x)| ("backoff", json!({"initial": i, "max": m, "multiplier": x}))),
        json_value().prop_map(|v| ("stream", v)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_get_an_answer(body in prop::collection::vec(any::<u8>(), 0..512)) {
        let (status, reply) = runtime().block_on(review(&body, &lookup()));
        check_answer(status, &reply)?;
    }

    #[test]
    fn random_json_gets_an_answer(v in json_value()) {
        let (status, reply) = runtime().block_on(review(&serde_json::to_vec(&v).unwrap(), &lookup()));
        check_answer(status, &reply)?;
    }

    #[test]
    fn reviews_with_garbage_objects_get_an_answer(
        object in json_value(),
        old in json_value(),
        op in prop_oneof![Just("CREATE"), Just("UPDATE"), Just("DELETE"), Just("PATCH")],
    ) {
        let (status, reply) = runtime().block_on(review(&serde_json::to_vec(&request(op, Some(object), Some(old))).unwrap(), &lookup()));
        let a = check_answer(status, &reply)?;
        // The envelope is fine, so the answer is always an AdmissionReview for this uid.
        let a = a.expect("an AdmissionReview answer");
        prop_assert_eq!(a.uid.as_str(), "705ab4f5-6393-11e8-b7cc-42010a800002");
    }

    #[test]
    fn a_spec_with_one_field_garbled_is_denied_saying_why(
        fields in prop::collection::vec(spec_field(), 0..6),
        garbled in prop_oneof![Just("backendRef"), Just("pattern"), Just("mode"), Just("backoff"), Just("ackWait"), Just("maxDeliver")],
        junk in json_value(),
    ) {
        let mut spec = json!({"backendRef": {"name": "nats"}, "pattern": "orders.>"});
        for (k, v) in fields { spec[k] = v; }
        spec[garbled] = junk;
        let (status, reply) = runtime().block_on(review(&serde_json::to_vec(&request("CREATE", Some(subscription(spec.clone())), None)).unwrap(), &lookup()));
        let a = check_answer(status, &reply)?.expect("an AdmissionReview answer");
        if serde_json::from_value::<Subscription>(subscription(spec)).is_err() {
            prop_assert!(!a.allowed);
            prop_assert!(a.message.unwrap_or_default().starts_with("the Subscription could not be read: "));
        }
    }

    /// The webhook's lean reader (name, namespace, deletionTimestamp, spec; the rest skipped
    /// unparsed) accepts exactly what `read_subscription` accepts there, and fails naming the
    /// same field, with the same text but for one wording of serde_json's.
    #[test]
    fn the_lean_reader_reads_and_fails_like_read_subscription(
        fields in prop::collection::vec(spec_field(), 0..6),
        garbled in prop::option::of(prop_oneof![Just("backendRef"), Just("pattern"), Just("mode"), Just("backoff"), Just("ackWait"), Just("maxDeliver"), Just("stream")]),
        junk in json_value(),
        whole in prop::option::of(json_value()),
        deleting in prop::option::of(prop_oneof![
            Just(json!("2026-12-01T10:00:00Z")),
            Just(json!("2026-12-01T10:00:00.5+02:00")),
            Just(json!(null)),
            Just(json!("yesterday")),
            json_value(),
        ]),
    ) {
        let mut spec = json!({"backendRef": {"name": "nats"}, "pattern": "orders.>"});
        for (k, v) in fields { spec[k] = v; }
        if let Some(field) = garbled { spec[field] = junk; }
        // Sometimes not even an object with a spec.
        let object = whole.unwrap_or_else(|| {
            let mut object = subscription(spec);
            if let Some(at) = deleting { object["metadata"]["deletionTimestamp"] = at; }
            object
        });
        let text = serde_json::to_string(&object).unwrap();
        let full = read_subscription(&serde_json::from_str(&text).unwrap());
        let lean = read_subscription_under_review(&text);
        match (full, lean) {
            (Ok(full), Ok(lean)) => {
                prop_assert_eq!(full.spec, lean.spec);
                prop_assert_eq!(full.metadata.name, lean.metadata.name);
                prop_assert_eq!(full.metadata.namespace, lean.metadata.namespace);
                prop_assert_eq!(full.metadata.deletion_timestamp, lean.metadata.deletion_timestamp);
            }
            // The lean reader does not read status (the API server ignores it on this call).
            (Err(full), Ok(_)) if full.starts_with("status") => {}
            (Err(full), Err(lean)) if full != lean => {
                // Same field; serde_json words a few type errors differently when it reads text
                // than when it reads a parsed value: an enum field (mode, shape, slowHandler)
                // holding neither a string nor a one-key object, a struct field holding a list
                // of the wrong length. The API server's schema refuses those values first.
                let field = |m: &str| m.split_once(": ").map(|(f, _)| f.to_string());
                prop_assert_eq!(field(&full), field(&lean), "{} vs {}", full, lean);
                let text_wording = lean.ends_with(": expected value")
                    || lean.ends_with(": trailing characters")
                    || (full.ends_with("expected map with a single key") && lean.contains("unknown variant"));
                prop_assert!(text_wording, "{} vs {}", full, lean);
            }
            (Err(_), Err(_)) => {}
            (full, lean) => prop_assert!(false, "the readers disagree: {:?} vs {:?}", full.err(), lean.err()),
        }
    }
}

/// How many cases of `verdict_matches_validate` got as far as comparing, by kind.
#[derive(Debug, Default)]
struct Compared {
    all: u32,
    allowed: u32,
    denied: u32,
    updates: u32,
    warned: u32,
}

/// For every spec that reads, the webhook's verdict is exactly `validate`'s. Cases whose spec
/// does not read are rejected (`prop_assume!`), not counted as passes: the runner draws others
/// until 256 have been compared, and the counts below show the comparison covered both verdicts,
/// updates and warnings.
#[test]
fn verdict_matches_validate() {
    use proptest::test_runner::{Config, TestRunner};
    let compared = std::sync::Mutex::new(Compared::default());
    let mut runner = TestRunner::new(Config {
        cases: 256,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (
        prop::collection::vec(spec_field(), 0..8),
        prop::option::of(prop::collection::vec(spec_field(), 0..8)),
        prop_oneof![
            Just("nats"),
            Just("rabbit-like"),
            Just("memory"),
            Just("missing")
        ],
    );
    runner
        .run(&strategy, |(fields, old_fields, backend)| {
            let make = |fields: Vec<(&'static str, Value)>| {
                let mut spec = json!({"backendRef": {"name": backend}, "pattern": "orders.>"});
                for (k, v) in fields {
                    spec[k] = v;
                }
                subscription(spec)
            };
            let new = make(fields);
            let old = old_fields.map(make);
            // Parsed from the same text the webhook reads, so floats round the same way.
            let read =
                |v: &Value| serde_json::from_slice::<Subscription>(&serde_json::to_vec(v).unwrap());
            let new_sub = read(&new);
            prop_assume!(new_sub.is_ok(), "the new spec does not read");
            let new_sub = new_sub.unwrap();
            let old_sub = old.as_ref().map(read).transpose();
            prop_assume!(old_sub.is_ok(), "the old spec does not read");
            let old_sub = old_sub.unwrap();
            let op = if old.is_some() { "UPDATE" } else { "CREATE" };
            let (status, reply) = runtime().block_on(review(
                &serde_json::to_vec(&request(op, Some(new), old)).unwrap(),
                &lookup(),
            ));
            let a = check_answer(status, &reply)?.expect("an AdmissionReview answer");

            let cannot_delay = settle::api::Capabilities {
                delays_redelivery: false,
                max_redelivery_delay: None,
                restart_can_spend_unseen_attempt: true,
                // A status without the field reads as having named streams (as the lookup's does).
                named_streams: true,
                ..Default::default()
            };
            let nats = capabilities_of(BackendKind::Nats);
            let memory = capabilities_of(BackendKind::Memory);
            let view = match backend {
                "nats" => BackendView::Known {
                    name: backend,
                    capabilities: &nats,
                },
                "rabbit-like" => BackendView::Known {
                    name: backend,
                    capabilities: &cannot_delay,
                },
                "memory" => BackendView::Known {
                    name: backend,
                    capabilities: &memory,
                },
                _ => BackendView::Missing { name: backend },
            };
            let verdict = validate(&new_sub.spec, old_sub.as_ref().map(|s| &s.spec), view);
            prop_assert_eq!(a.allowed, verdict.allowed());
            if !verdict.allowed() {
                prop_assert_eq!(a.message.clone(), Some(verdict.error_text()));
            }
            let expected: Vec<String> = verdict.warnings.iter().map(ToString::to_string).collect();
            prop_assert_eq!(&a.warnings, &expected);
            let mut c = compared.lock().unwrap();
            c.all += 1;
            if a.allowed {
                c.allowed += 1
            } else {
                c.denied += 1
            }
            if old_sub.is_some() {
                c.updates += 1
            }
            if !expected.is_empty() {
                c.warned += 1
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let c = compared.into_inner().unwrap();
    println!("verdict_matches_validate compared {c:?}");
    assert_eq!(c.all, 256, "every counted case ran the comparison: {c:?}");
    for (what, n) in [
        ("allowed", c.allowed),
        ("denied", c.denied),
        ("updates", c.updates),
        ("with warnings", c.warned),
    ] {
        assert!(n >= 25, "at least 25 of the compared cases {what}: {c:?}");
    }
}

/// A TLS connection to `addr` without ALPN: HTTP/1.1, as the API server calls webhooks.
async fn http1_over_tls(
    addr: SocketAddr,
    ca_pem: &str,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let tls = tls_trusting(ca_pem);
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name");
    tokio_rustls::TlsConnector::from(Arc::new(tls))
        .connect(name, tcp)
        .await
        .expect("TLS")
}

#[tokio::test]
async fn while_draining_each_http1_answer_closes_its_connection_so_none_is_reused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let bundle: CertBundle =
        certs::issue_for(&local_sans(), Duration::from_secs(3600)).expect("issue");
    let resolver = Arc::new(
        CertResolver::from_pem(bundle.cert_pem.as_bytes(), bundle.key_pem.as_bytes())
            .expect("resolver"),
    );
    let registry = prometheus::Registry::new();
    let config = WebhookConfig::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
    let (drain, draining) = tokio::sync::watch::channel(false);
    let server = Server::bind(config, Arc::new(lookup()), resolver, &registry)
        .await
        .expect("bind")
        .draining_from(draining);
    let addr = server.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));
    const ASK: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
    let mut conn = http1_over_tls(addr, &bundle.ca_pem).await;

    // Before: kept alive, so the same connection answers a second time.
    for _ in 0..2 {
        conn.write_all(ASK).await.expect("ask");
        let mut buf = vec![0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf))
            .await
            .expect("an answer in time")
            .expect("read");
        let answer = String::from_utf8_lossy(&buf[..n]).to_lowercase();
        assert!(answer.starts_with("http/1.1 200"), "{answer}");
        assert!(!answer.contains("connection: close"), "{answer}");
    }

    // Draining: the answer says so, and the server closes the connection after it.
    drain.send(true).expect("draining");
    conn.write_all(ASK).await.expect("ask");
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut all))
        .await
        .expect("the server closes the connection after its answer")
        .ok();
    let answer = String::from_utf8_lossy(&all).to_lowercase();
    assert!(answer.starts_with("http/1.1 200"), "{answer}");
    assert!(answer.contains("connection: close"), "{answer}");
    assert!(answer.ends_with("ok\n"), "{answer}");

    let _ = stop.send(());
    running.await.expect("joined").expect("ran");
}
