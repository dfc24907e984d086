//! The mutating half of admission: [`mutate`] answers one AdmissionReview body sent to
//! `POST /mutate` by putting the operator's finalizer (`api::FINALIZER`) on a Subscription that
//! lacks it, at CREATE and UPDATE, as a JSON Patch. The API server stores the Subscription with
//! it, so the controller does not write it afterwards: one API request fewer for every new
//! Subscription (docs/semantics.md A14).
//!
//! It refuses nothing and judges nothing: every review is allowed, with the patch or without.
//! A Subscription being deleted (`deletionTimestamp` set) is left as it is (the API server
//! forbids a new finalizer then, and a cleanup must never wait on Settle); so is one whose
//! metadata cannot be read (the validating webhook says why). The webhook is installed with
//! `failurePolicy: Ignore`: when it cannot be reached, the controller adds the finalizer as ever.
//!
//! This file must not decide admission (that is `review`'s, through `policy`), must not patch
//! anything but the finalizer list, and must never panic on what a client sends.

use http::StatusCode;
use k8s_openapi::ByteString;
use serde::Deserialize;

use super::review::{Answer, RequestIn, envelope};
use settle::api::{FINALIZER, GROUP};

/// Answers one AdmissionReview body: HTTP 200, allowed, with the finalizer patch if the
/// Subscription needs it (then `true`); or HTTP 400 when the body is not an AdmissionReview.
pub(super) fn mutate(body: &[u8]) -> (Answer, bool) {
    let (api_version, request) = match envelope(body) {
        Ok(read) => read,
        Err(bad_request) => return (bad_request, false),
    };
    let patch = finalizer_patch(&request);
    let mut response = serde_json::json!({"uid": request.uid, "allowed": true});
    if let Some(patch) = &patch {
        response["patchType"] = "JSONPatch".into();
        response["patch"] =
            serde_json::to_value(ByteString(patch.to_string().into_bytes())).unwrap_or_default();
    }
    tracing::debug!(
        uid = %request.uid,
        operation = %request.operation,
        finalizer_added = patch.is_some(),
        "admission mutated"
    );
    let review = serde_json::json!({
        "apiVersion": api_version,
        "kind": "AdmissionReview",
        "response": response,
    });
    let answer = Answer {
        status: StatusCode::OK,
        body: review.to_string().into_bytes(),
        operation: request.operation,
        allowed: true,
    };
    (answer, patch.is_some())
}

/// Of an object, the metadata the patch depends on; the rest is skipped unparsed.
#[derive(Deserialize)]
struct ObjectHead {
    #[serde(default)]
    metadata: MetadataHead,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct MetadataHead {
    #[serde(default)]
    finalizers: Option<Vec<String>>,
    #[serde(default)]
    deletion_timestamp: Option<String>,
}

/// The JSON Patch that puts the finalizer on, if this request is a Subscription's CREATE or
/// UPDATE without it and not being deleted.
fn finalizer_patch(request: &RequestIn<'_>) -> Option<serde_json::Value> {
    if request.kind.group != GROUP
        || request.kind.kind != "Subscription"
        || request
            .sub_resource
            .as_deref()
            .is_some_and(|s| !s.is_empty())
        || !matches!(request.operation.as_str(), "CREATE" | "UPDATE")
    {
        return None;
    }
    let head: ObjectHead = serde_json::from_str(request.object?.get()).ok()?;
    if head.metadata.deletion_timestamp.is_some() {
        return None;
    }
    match head.metadata.finalizers {
        Some(list) if list.iter().any(|f| f == FINALIZER) => None,
        Some(list) if !list.is_empty() => Some(serde_json::json!([
            {"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER}
        ])),
        _ => Some(serde_json::json!([
            {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]}
        ])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn review(operation: &str, metadata: Value) -> Vec<u8> {
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-1",
                "kind": {"group": GROUP, "version": "v1alpha1", "kind": "Subscription"},
                "operation": operation,
                "object": {"metadata": metadata, "spec": {"mode": "AtMostOnce"}},
            }
        })
        .to_string()
        .into_bytes()
    }

    /// The response, and the patch it carries decoded (Null when none).
    fn answered(body: &[u8]) -> (Value, Value) {
        let (answer, _) = mutate(body);
        assert_eq!(answer.status, StatusCode::OK);
        let out: Value = serde_json::from_slice(&answer.body).expect("json");
        let response = out["response"].clone();
        assert_eq!(response["uid"], "u-1");
        assert_eq!(response["allowed"], true, "{response}");
        let patch = match response["patch"].as_str() {
            Some(_) => {
                assert_eq!(response["patchType"], "JSONPatch");
                let bytes: ByteString =
                    serde_json::from_value(response["patch"].clone()).expect("base64");
                serde_json::from_slice(&bytes.0).expect("patch json")
            }
            None => Value::Null,
        };
        (response, patch)
    }

    #[test]
    fn a_new_subscription_gets_the_finalizer_and_nothing_else() {
        let (_, patch) = answered(&review("CREATE", json!({"name": "a"})));
        assert_eq!(
            patch,
            json!([{"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]}])
        );
        let (_, patch) = answered(&review("UPDATE", json!({"finalizers": ["theirs"]})));
        assert_eq!(
            patch,
            json!([{"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER}])
        );
    }

    #[test]
    fn one_that_has_it_or_is_being_deleted_is_left_alone() {
        let has = json!({"finalizers": ["theirs", FINALIZER]});
        assert_eq!(answered(&review("UPDATE", has)).1, Value::Null);
        let deleting = json!({"deletionTimestamp": "2026-12-04T00:00:00Z"});
        assert_eq!(answered(&review("UPDATE", deleting)).1, Value::Null);
        assert_eq!(answered(&review("DELETE", json!({}))).1, Value::Null);
    }

    #[test]
    fn other_kinds_subresources_and_unreadable_metadata_are_allowed_untouched() {
        let mut backend: Value =
            serde_json::from_slice(&review("CREATE", json!({}))).expect("json");
        backend["request"]["kind"]["kind"] = "Backend".into();
        assert_eq!(answered(backend.to_string().as_bytes()).1, Value::Null);
        let mut status: Value = serde_json::from_slice(&review("UPDATE", json!({}))).expect("json");
        status["request"]["subResource"] = "status".into();
        assert_eq!(answered(status.to_string().as_bytes()).1, Value::Null);
        let odd = json!({"finalizers": "not a list"});
        assert_eq!(answered(&review("CREATE", odd)).1, Value::Null);
    }

    #[test]
    fn what_is_not_an_admission_review_is_a_400() {
        let (answer, patched) = mutate(b"{\"kind\":\"Pod\"}");
        assert_eq!(answer.status, StatusCode::BAD_REQUEST);
        assert!(!patched);
    }
}
