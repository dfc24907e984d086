//! One AdmissionReview body in, one answer out, without a network: [`review`] reads the
//! Subscription (and the stored one on UPDATE), looks up its Backend and asks the one
//! `admission::validate` for the verdict.
//!
//! This file must not write admission rules (they live in `rules.rs`), must not change anything
//! anywhere (`dryRun` requests are answered exactly like the others), and must never panic on
//! what a client sends: malformed input gets a 400 or a denial that says why, and a Backend it
//! cannot read fails closed.

use http::StatusCode;
use kube::core::admission::{AdmissionResponse, META_API_VERSION_V1, META_KIND};
use kube::core::{Status, TypeMeta};
use serde::Deserialize;

use super::LOOKUP_TIMEOUT;
use super::lookup::{BackendLookup, LookupError};
use crate::admission::{BackendView, read_subscription, validate};
use crate::api::{Capabilities, GROUP};
use crate::backend::{BackendKind, capabilities_of};

/// `admission.k8s.io/v1beta1`, still accepted and answered in kind.
const META_API_VERSION_V1BETA1: &str = "admission.k8s.io/v1beta1";

/// The part of an AdmissionReview the webhook reads. `object` and `oldObject` stay raw JSON so
/// that an object that is not a valid Subscription still gets an answer carrying the uid.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReviewIn {
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    kind: String,
    request: Option<RequestIn>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RequestIn {
    uid: String,
    kind: KindIn,
    #[serde(default)]
    sub_resource: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    operation: String,
    #[serde(default)]
    object: Option<serde_json::Value>,
    #[serde(default)]
    old_object: Option<serde_json::Value>,
    #[serde(default)]
    dry_run: Option<bool>,
}

#[derive(Deserialize)]
struct KindIn {
    #[serde(default)]
    group: String,
    #[serde(default)]
    kind: String,
}

/// One answer, and what the metrics and log need to know about it.
pub(super) struct Answer {
    pub(super) status: StatusCode,
    pub(super) body: Vec<u8>,
    pub(super) operation: String,
    pub(super) allowed: bool,
}

/// Answers one AdmissionReview body: HTTP 200 with an AdmissionReview response (allowed, or
/// denied with the reason), or HTTP 400 with a plain-text reason when the body is not an
/// AdmissionReview at all. Never panics; takes at most about [`LOOKUP_TIMEOUT`].
pub async fn review(body: &[u8], backends: &dyn BackendLookup) -> (StatusCode, Vec<u8>) {
    let answer = answer(body, backends).await;
    (answer.status, answer.body)
}

pub(super) async fn answer(body: &[u8], backends: &dyn BackendLookup) -> Answer {
    let bad_request = |reason: String| {
        tracing::warn!(%reason, "refused a request that is not an AdmissionReview");
        Answer {
            status: StatusCode::BAD_REQUEST,
            body: reason.into_bytes(),
            operation: "unknown".into(),
            allowed: false,
        }
    };
    let review: ReviewIn = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return bad_request(format!("the body is not an AdmissionReview: {e}\n")),
    };
    if review.kind != META_KIND {
        return bad_request(format!(
            "the body is not an AdmissionReview: kind is {:?}, expected {META_KIND:?}\n",
            review.kind
        ));
    }
    if review.api_version != META_API_VERSION_V1 && review.api_version != META_API_VERSION_V1BETA1 {
        return bad_request(format!(
            "unsupported AdmissionReview apiVersion {:?}: expected {META_API_VERSION_V1:?}\n",
            review.api_version
        ));
    }
    let Some(request) = review.request else {
        return bad_request("the AdmissionReview has no request\n".into());
    };
    if request.uid.is_empty() {
        return bad_request("the AdmissionReview request has an empty uid\n".into());
    }

    let decision = decide(&request, backends).await;
    let allowed = decision.error.is_none();
    let namespace = request.namespace.as_deref().unwrap_or("");
    let name = request.name.as_deref().unwrap_or("");
    tracing::info!(
        uid = %request.uid,
        object = %format!("{namespace}/{name}"),
        kind = %request.kind.kind,
        operation = %request.operation,
        dry_run = request.dry_run.unwrap_or(false),
        allowed,
        warnings = decision.warnings.len(),
        reason = decision.error.as_ref().map(|s| s.message.as_str()).unwrap_or(""),
        "admission decision"
    );

    let mut response = AdmissionResponse::invalid("");
    response.types = TypeMeta {
        api_version: review.api_version,
        kind: META_KIND.to_string(),
    };
    response.uid = request.uid;
    response.allowed = allowed;
    response.result = decision.error.unwrap_or_default();
    response.warnings = (!decision.warnings.is_empty()).then_some(decision.warnings);
    match serde_json::to_vec(&response.into_review()) {
        Ok(body) => Answer {
            status: StatusCode::OK,
            body,
            operation: request.operation,
            allowed,
        },
        // Cannot happen for these types; still an answer, not a panic.
        Err(e) => Answer {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            body: format!("could not encode the answer: {e}\n").into_bytes(),
            operation: request.operation,
            allowed: false,
        },
    }
}

/// What to answer: `error` is the denial (none: allowed); warnings go out either way.
#[derive(Default)]
struct Decision {
    error: Option<Status>,
    warnings: Vec<String>,
}

impl Decision {
    fn allow() -> Self {
        Decision::default()
    }

    fn deny(code: u16, reason: &str, message: String) -> Self {
        Decision {
            error: Some(Status::failure(&message, reason).with_code(code)),
            warnings: Vec::new(),
        }
    }
}

async fn decide(request: &RequestIn, backends: &dyn BackendLookup) -> Decision {
    // Backends (and anything else) are checked by the API server's CEL rules; status and other
    // subresources carry no spec change to judge, and must never be blocked by a spec that got
    // in while the webhook was down.
    if request.kind.group != GROUP
        || request.kind.kind != "Subscription"
        || request
            .sub_resource
            .as_deref()
            .is_some_and(|s| !s.is_empty())
    {
        return Decision::allow();
    }
    let update = match request.operation.as_str() {
        "CREATE" => false,
        "UPDATE" => true,
        "DELETE" | "CONNECT" => return Decision::allow(),
        other => {
            return Decision::deny(
                400,
                "BadRequest",
                format!("unknown admission operation {other:?}"),
            );
        }
    };

    let Some(object) = &request.object else {
        return Decision::deny(
            400,
            "BadRequest",
            "the admission request carries no object to validate".into(),
        );
    };
    let new = match read_subscription(object) {
        Ok(s) => s,
        Err(why) => {
            return Decision::deny(
                400,
                "BadRequest",
                format!("the Subscription could not be read: {why}"),
            );
        }
    };
    let old = if update {
        match request.old_object.as_ref().map(read_subscription) {
            Some(Ok(old)) => Some(old),
            Some(Err(why)) => {
                return Decision::deny(
                    400,
                    "BadRequest",
                    format!(
                        "the stored Subscription could not be read ({why}): delete it and create it again"
                    ),
                );
            }
            None => {
                return Decision::deny(
                    400,
                    "BadRequest",
                    "the UPDATE request carries no oldObject to compare with".into(),
                );
            }
        }
    } else {
        None
    };

    let Some(namespace) = request
        .namespace
        .as_deref()
        .or(new.metadata.namespace.as_deref())
        .filter(|n| !n.is_empty())
    else {
        return Decision::deny(
            400,
            "BadRequest",
            "the admission request names no namespace".into(),
        );
    };
    let backend_name = new.spec.backend_ref.name.as_str();
    let found =
        match tokio::time::timeout(LOOKUP_TIMEOUT, backends.get(namespace, backend_name)).await {
            Ok(Ok(found)) => found,
            Ok(Err(e)) => return lookup_failed(namespace, backend_name, &e),
            Err(_) => {
                return lookup_failed(
                    namespace,
                    backend_name,
                    &LookupError::Timeout(LOOKUP_TIMEOUT),
                );
            }
        };

    let capabilities: Option<Capabilities> = match &found {
        None => None,
        Some(backend) => match backend.status.as_ref().and_then(|s| s.capabilities.clone()) {
            Some(caps) => Some(caps),
            None => match BackendKind::of(&backend.spec) {
                Some(kind) => Some(capabilities_of(kind)),
                None => {
                    return Decision::deny(
                        422,
                        "Invalid",
                        format!(
                            "spec.backendRef.name: Backend {namespace}/{backend_name} names no single backend kind, so \
                             what it can honour is unknown: fix the Backend (set exactly one of nats, memory)"
                        ),
                    );
                }
            },
        },
    };
    let view = match &capabilities {
        Some(capabilities) => BackendView::Known {
            name: backend_name,
            capabilities,
        },
        None => BackendView::Missing { name: backend_name },
    };

    let verdict = validate(&new.spec, old.as_ref().map(|o| &o.spec), view);
    let warnings = verdict.warnings.iter().map(ToString::to_string).collect();
    if verdict.allowed() {
        Decision {
            error: None,
            warnings,
        }
    } else {
        let mut d = Decision::deny(422, "Invalid", verdict.error_text());
        d.warnings = warnings;
        d
    }
}

fn lookup_failed(namespace: &str, name: &str, e: &LookupError) -> Decision {
    tracing::warn!(backend = %format!("{namespace}/{name}"), error = %e, "admission could not read a Backend; denying");
    Decision::deny(
        503,
        "ServiceUnavailable",
        format!(
            "the Settle admission webhook could not read Backend {namespace}/{name} ({e}), so it cannot tell whether \
             the backend can honour this Subscription: retry in a moment"
        ),
    )
}
