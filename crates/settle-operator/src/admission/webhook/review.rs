//! One AdmissionReview body in, one answer out, without a network: [`review`] reads the
//! Subscription (and the stored one on UPDATE), looks up its Backend and asks the one
//! `policy::validate` for the verdict; for a Backend, it looks up the labels of the Secrets it
//! names and asks `policy::validate_backend` (A16–A21).
//!
//! Reading ([`read`]) is synchronous and keeps only what the answer needs, owned, so that the
//! server can let go of the body (and its turn to read one) before the Backend lookup waits.
//! Of the objects it reads the name, namespace, deletionTimestamp and spec; annotations and the
//! rest are skipped unparsed.
//!
//! It never blocks a cleanup (docs/semantics.md A14): an UPDATE of an object (Subscription or
//! Backend) being deleted
//! (`deletionTimestamp` set), or one that leaves the spec as it was (`policy::unchanged`: a
//! label, the operator's finalizer), is allowed from the body alone, without looking up the
//! Backend, so neither a spec that is no longer valid nor a Backend that cannot be read keeps a
//! Subscription or its namespace Terminating.
//!
//! This file must not write admission rules (they live in `policy::rules`), must not change anything
//! anywhere (`dryRun` requests are answered exactly like the others), and must never panic on
//! what a client sends: malformed input gets a 400 or a denial that says why, and a Backend it
//! cannot read fails closed. Allowed requests are logged at DEBUG, denials at INFO, requests
//! that cannot be answered properly at WARN.

use http::StatusCode;
use kube::core::admission::{AdmissionResponse, META_API_VERSION_V1, META_KIND};
use kube::core::{Status, TypeMeta};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::LOOKUP_TIMEOUT;
use super::lookup::{BackendLookup, LookupError};
use crate::admission::{SubscriptionUnderReview, read_subscription_under_review};
use settle::api::{BackendSpec, Capabilities, GROUP};
use settle::policy::{
    BackendRules, BackendView, SecretView, Verdict, backend_unchanged, effective_capabilities,
    secrets_named, unchanged, validate, validate_backend,
};

/// `admission.k8s.io/v1beta1`, still accepted and answered in kind.
const META_API_VERSION_V1BETA1: &str = "admission.k8s.io/v1beta1";

/// The part of an AdmissionReview the webhook reads; every other field is skipped unparsed.
/// `object` and `oldObject` stay raw JSON text, borrowed from the body, so that an object that is
/// not a valid Subscription still gets an answer carrying the uid.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReviewIn<'a> {
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    kind: String,
    #[serde(borrow)]
    request: Option<RequestIn<'a>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct RequestIn<'a> {
    pub(super) uid: String,
    pub(super) kind: KindIn,
    #[serde(default)]
    pub(super) sub_resource: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    pub(super) operation: String,
    #[serde(default, borrow)]
    pub(super) object: Option<&'a RawValue>,
    #[serde(default, borrow)]
    old_object: Option<&'a RawValue>,
    #[serde(default)]
    dry_run: Option<bool>,
}

#[derive(Deserialize)]
pub(super) struct KindIn {
    #[serde(default)]
    pub(super) group: String,
    #[serde(default)]
    pub(super) kind: String,
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
/// Backends are judged with the default [`BackendRules`] (any host, pod identity nowhere).
pub async fn review(body: &[u8], backends: &dyn BackendLookup) -> (StatusCode, Vec<u8>) {
    review_with(body, backends, &BackendRules::default()).await
}

/// [`review`], judging Backends by the installer's `rules`.
pub async fn review_with(
    body: &[u8],
    backends: &dyn BackendLookup,
    rules: &BackendRules,
) -> (StatusCode, Vec<u8>) {
    let answer = match read(body) {
        Ok(review) => answer(review, backends, rules).await,
        Err(bad_request) => bad_request,
    };
    (answer.status, answer.body)
}

/// What admission reads of a Backend: its metadata's three fields and its spec.
#[derive(Deserialize)]
struct BackendUnderReview {
    metadata: crate::admission::MetadataUnderReview,
    spec: BackendSpec,
}

fn read_backend(json: &str) -> Result<BackendUnderReview, String> {
    let mut de = serde_json::Deserializer::from_str(json);
    serde_path_to_error::deserialize(&mut de).map_err(|e| e.to_string())
}

/// One AdmissionReview, read: what its answer needs, owned.
pub(super) struct Review {
    api_version: String,
    uid: String,
    kind: String,
    operation: String,
    /// `namespace/name`, for the log.
    object: String,
    dry_run: bool,
    next: Next,
}

/// What is left to do once the body is read.
enum Next {
    /// Decided from the body alone.
    Decided(Box<Decision>),
    /// The Subscription(s) read; the verdict needs the Backend.
    Judge {
        namespace: String,
        new: Box<SubscriptionUnderReview>,
        old: Option<Box<SubscriptionUnderReview>>,
    },
    /// A Backend read; the verdict needs the labels of the Secrets it names.
    JudgeBackend {
        namespace: String,
        new: Box<BackendSpec>,
        old: Option<Box<BackendSpec>>,
    },
}

/// Reads the envelope of one body, without I/O: its apiVersion and its request, checked to be an
/// AdmissionReview's with a uid; or the 400 to answer. Shared by both webhooks.
pub(super) fn envelope(body: &[u8]) -> Result<(String, RequestIn<'_>), Answer> {
    let bad_request = |reason: String| {
        tracing::warn!(%reason, "refused a request that is not an AdmissionReview");
        Answer {
            status: StatusCode::BAD_REQUEST,
            body: reason.into_bytes(),
            operation: "unknown".into(),
            allowed: false,
        }
    };
    let review: ReviewIn<'_> = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            return Err(bad_request(format!(
                "the body is not an AdmissionReview: {e}\n"
            )));
        }
    };
    if review.kind != META_KIND {
        return Err(bad_request(format!(
            "the body is not an AdmissionReview: kind is {:?}, expected {META_KIND:?}\n",
            review.kind
        )));
    }
    if review.api_version != META_API_VERSION_V1 && review.api_version != META_API_VERSION_V1BETA1 {
        return Err(bad_request(format!(
            "unsupported AdmissionReview apiVersion {:?}: expected {META_API_VERSION_V1:?}\n",
            review.api_version
        )));
    }
    let Some(request) = review.request else {
        return Err(bad_request("the AdmissionReview has no request\n".into()));
    };
    if request.uid.is_empty() {
        return Err(bad_request(
            "the AdmissionReview request has an empty uid\n".into(),
        ));
    }
    Ok((review.api_version, request))
}

/// Reads one body, without I/O: the review, or the 400 to answer when it is not an
/// AdmissionReview at all.
pub(super) fn read(body: &[u8]) -> Result<Review, Answer> {
    let (api_version, request) = envelope(body)?;
    let next = prepare(&request);
    let namespace = request.namespace.as_deref().unwrap_or("");
    let name = request.name.as_deref().unwrap_or("");
    Ok(Review {
        api_version,
        object: format!("{namespace}/{name}"),
        uid: request.uid,
        kind: request.kind.kind,
        operation: request.operation,
        dry_run: request.dry_run.unwrap_or(false),
        next,
    })
}

/// Decides a review read by [`read`] (looking up its Backend if need be) and encodes the answer.
pub(super) async fn answer(
    review: Review,
    backends: &dyn BackendLookup,
    rules: &BackendRules,
) -> Answer {
    let decision = match review.next {
        Next::Decided(decision) => *decision,
        Next::Judge {
            namespace,
            new,
            old,
        } => judge(&namespace, &new, old.as_deref(), backends).await,
        Next::JudgeBackend {
            namespace,
            new,
            old,
        } => judge_backend(&namespace, &new, old.as_deref(), backends, rules).await,
    };
    let allowed = decision.error.is_none();
    if allowed {
        tracing::debug!(
            uid = %review.uid,
            object = %review.object,
            kind = %review.kind,
            operation = %review.operation,
            dry_run = review.dry_run,
            warnings = decision.warnings.len(),
            because = decision.because.unwrap_or("the rules admit it"),
            "admission allowed"
        );
    } else {
        tracing::info!(
            uid = %review.uid,
            object = %review.object,
            kind = %review.kind,
            operation = %review.operation,
            dry_run = review.dry_run,
            warnings = decision.warnings.len(),
            reason = decision.error.as_ref().map(|s| s.message.as_str()).unwrap_or(""),
            "admission denied"
        );
    }

    let mut response = AdmissionResponse::invalid("");
    response.types = TypeMeta {
        api_version: review.api_version,
        kind: META_KIND.to_string(),
    };
    response.uid = review.uid;
    response.allowed = allowed;
    response.result = decision.error.unwrap_or_default();
    response.warnings = (!decision.warnings.is_empty()).then_some(decision.warnings);
    match serde_json::to_vec(&response.into_review()) {
        Ok(body) => Answer {
            status: StatusCode::OK,
            body,
            operation: review.operation,
            allowed,
        },
        // Cannot happen for these types; still an answer, not a panic.
        Err(e) => {
            tracing::warn!(error = %e, "could not encode an admission answer");
            Answer {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                body: format!("could not encode the answer: {e}\n").into_bytes(),
                operation: review.operation,
                allowed: false,
            }
        }
    }
}

/// What to answer: `error` is the denial (none: allowed); warnings go out either way.
#[derive(Default)]
struct Decision {
    error: Option<Status>,
    warnings: Vec<String>,
    /// Why it was allowed without the rules, for the DEBUG log line.
    because: Option<&'static str>,
}

impl Decision {
    fn allow() -> Self {
        Decision::default()
    }

    /// Allowed without judging the spec (no warnings), saying why in the log.
    fn allow_because(because: &'static str) -> Self {
        Decision {
            because: Some(because),
            ..Decision::default()
        }
    }

    fn deny(code: u16, reason: &str, message: String) -> Self {
        Decision {
            error: Some(Status::failure(&message, reason).with_code(code)),
            ..Decision::default()
        }
    }
}

/// The part of the decision the body alone settles, and the reading of the Subscription(s).
fn prepare(request: &RequestIn<'_>) -> Next {
    if not_judged(request) {
        return Next::Decided(Box::new(Decision::allow()));
    }
    let update = match is_update(&request.operation) {
        Ok(update) => update,
        Err(decided) => return decided,
    };
    let Some(object) = request.object else {
        return bad_request("the admission request carries no object to validate".into());
    };
    if request.kind.kind == "Backend" {
        return prepare_backend(request, object, update);
    }
    prepare_subscription(request, object, update)
}

/// Whether the request is allowed without a look: anything else is not Settle's; status and
/// other subresources carry no spec change to judge, and must never be blocked by a spec that
/// got in while the webhook was down.
fn not_judged(request: &RequestIn<'_>) -> bool {
    request.kind.group != GROUP
        || !matches!(request.kind.kind.as_str(), "Subscription" | "Backend")
        || request
            .sub_resource
            .as_deref()
            .is_some_and(|s| !s.is_empty())
}

/// Whether the operation is an UPDATE (else a CREATE), the two that are judged; the others are
/// decided here: DELETE and CONNECT allowed, anything else denied.
fn is_update(operation: &str) -> Result<bool, Next> {
    match operation {
        "CREATE" => Ok(false),
        "UPDATE" => Ok(true),
        "DELETE" | "CONNECT" => Err(Next::Decided(Box::new(Decision::allow()))),
        other => Err(bad_request(format!(
            "unknown admission operation {other:?}"
        ))),
    }
}

/// Denied from the body alone, 400.
fn bad_request(message: String) -> Next {
    Next::Decided(Box::new(Decision::deny(400, "BadRequest", message)))
}

/// A Subscription's part of [`prepare`]: read it (and the stored one), and allow an UPDATE of
/// one being deleted or with its spec unchanged from the body alone (A14).
fn prepare_subscription(request: &RequestIn<'_>, object: &RawValue, update: bool) -> Next {
    let new = match read_subscription_under_review(object.get()) {
        Ok(s) => s,
        Err(why) => return bad_request(format!("the Subscription could not be read: {why}")),
    };
    // A14: the cleanup of an object being deleted is never blocked; nothing of the stored object
    // needs reading for that.
    if update && new.metadata.deletion_timestamp.is_some() {
        return Next::Decided(Box::new(Decision::allow_because(
            "the Subscription is being deleted (A14)",
        )));
    }
    let old = if update {
        match read_stored_subscription(request) {
            Ok(old) => Some(Box::new(old)),
            Err(denied) => return denied,
        }
    } else {
        None
    };
    // A14: an update that leaves the spec as it was is admitted before the Backend is looked up,
    // so neither a spec the Backend no longer honours nor a lookup that fails can refuse it.
    if unchanged(&new.spec, old.as_ref().map(|o| &o.spec)) {
        return Next::Decided(Box::new(Decision::allow_because(
            "the spec did not change (A14)",
        )));
    }

    let Some(namespace) = request
        .namespace
        .as_deref()
        .or(new.metadata.namespace.as_deref())
        .filter(|n| !n.is_empty())
    else {
        return bad_request("the admission request names no namespace".into());
    };
    Next::Judge {
        namespace: namespace.to_string(),
        new: Box::new(new),
        old,
    }
}

/// The stored Subscription an UPDATE carries (`oldObject`); or the 400 when it has none or it
/// cannot be read.
fn read_stored_subscription(request: &RequestIn<'_>) -> Result<SubscriptionUnderReview, Next> {
    match request
        .old_object
        .map(|o| read_subscription_under_review(o.get()))
    {
        Some(Ok(old)) => Ok(old),
        Some(Err(why)) => Err(bad_request(format!(
            "the stored Subscription could not be read ({why}): delete it and create it again"
        ))),
        None => Err(bad_request(
            "the UPDATE request carries no oldObject to compare with".into(),
        )),
    }
}

/// A Backend's part of [`prepare`]: read it (and the stored one), and allow an UPDATE of one
/// being deleted or with its spec unchanged from the body alone (A14).
fn prepare_backend(request: &RequestIn<'_>, object: &RawValue, update: bool) -> Next {
    let deny =
        |message: String| Next::Decided(Box::new(Decision::deny(400, "BadRequest", message)));
    let new = match read_backend(object.get()) {
        Ok(b) => b,
        Err(why) => return deny(format!("the Backend could not be read: {why}")),
    };
    if update && new.metadata.deletion_timestamp.is_some() {
        return Next::Decided(Box::new(Decision::allow_because(
            "the Backend is being deleted (A14)",
        )));
    }
    let old = if update {
        match request.old_object.map(|o| read_backend(o.get())) {
            Some(Ok(old)) => Some(Box::new(old.spec)),
            Some(Err(why)) => {
                return deny(format!(
                    "the stored Backend could not be read ({why}): delete it and create it again"
                ));
            }
            None => return deny("the UPDATE request carries no oldObject to compare with".into()),
        }
    } else {
        None
    };
    if backend_unchanged(&new.spec, old.as_deref()) {
        return Next::Decided(Box::new(Decision::allow_because(
            "the Backend's spec did not change (A14)",
        )));
    }
    let Some(namespace) = request
        .namespace
        .as_deref()
        .or(new.metadata.namespace.as_deref())
        .filter(|n| !n.is_empty())
    else {
        return deny("the admission request names no namespace".into());
    };
    Next::JudgeBackend {
        namespace: namespace.to_string(),
        new: Box::new(new.spec),
        old,
    }
}

/// The verdict on a Backend read by [`prepare_backend`]: each Secret it names is looked up (its
/// labels only), then `policy::validate_backend` judges. A lookup that fails denies (fail
/// closed), as for Subscriptions.
async fn judge_backend(
    namespace: &str,
    new: &BackendSpec,
    old: Option<&BackendSpec>,
    backends: &dyn BackendLookup,
    rules: &BackendRules,
) -> Decision {
    let mut views = std::collections::HashMap::new();
    for (_, name) in secrets_named(new) {
        if views.contains_key(name) {
            continue;
        }
        let view =
            match tokio::time::timeout(LOOKUP_TIMEOUT, backends.secret(namespace, name)).await {
                Ok(Ok(view)) => view,
                Ok(Err(e)) => return secret_lookup_failed(namespace, name, &e),
                Err(_) => {
                    return secret_lookup_failed(
                        namespace,
                        name,
                        &LookupError::Timeout(LOOKUP_TIMEOUT),
                    );
                }
            };
        views.insert(name.to_string(), view);
    }
    let secrets = |name: &str| views.get(name).copied().unwrap_or(SecretView::Unknown);
    decision_of(&validate_backend(new, old, namespace, &secrets, rules))
}

fn secret_lookup_failed(namespace: &str, name: &str, e: &LookupError) -> Decision {
    tracing::warn!(secret = %format!("{namespace}/{name}"), error = %e, "admission could not read a Secret's labels; denying");
    Decision::deny(
        503,
        "ServiceUnavailable",
        format!(
            "the Settle admission webhook could not read the labels of Secret {namespace}/{name} ({e}), so it cannot tell \
             whether the Secret may be used by a Backend: retry in a moment"
        ),
    )
}

/// The verdict on a Subscription read by [`prepare`], against its Backend.
async fn judge(
    namespace: &str,
    new: &SubscriptionUnderReview,
    old: Option<&SubscriptionUnderReview>,
    backends: &dyn BackendLookup,
) -> Decision {
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
        Some(backend) => match effective_capabilities(backend) {
            Some(caps) => Some(caps),
            None => {
                return Decision::deny(
                    422,
                    "Invalid",
                    format!(
                        "spec.backendRef.name: Backend {namespace}/{backend_name} names no single backend kind, so \
                         what it can honour is unknown: fix the Backend (set exactly one of nats, rabbitmq, sqs, memory)"
                    ),
                );
            }
        },
    };
    let view = match &capabilities {
        Some(capabilities) => BackendView::Known {
            name: backend_name,
            capabilities,
        },
        None => BackendView::Missing { name: backend_name },
    };

    decision_of(&validate(&new.spec, old.map(|o| &o.spec), view))
}

/// A verdict of `policy` as the webhook answers it: allowed, or denied 422 with every error;
/// its warnings either way.
fn decision_of(verdict: &Verdict) -> Decision {
    let warnings = verdict.warnings.iter().map(ToString::to_string).collect();
    if verdict.allowed() {
        Decision {
            warnings,
            ..Decision::default()
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
