//! The SQS calls the operator makes on queues Settle manages: find a queue, read its attributes
//! and its owner tags, create it (tagged with the Subscription and the object it belongs to),
//! tag it for another object, change its attributes, delete it, and read its gauges. Every call asks the server (no cached URL: a queue
//! deleted there must be seen as gone), and a failure is told apart as unreachable, refused
//! credentials or a refused call.
//!
//! It must not decide what a queue looks like (that is [`super::mapping`]) nor what to do about a
//! difference (the reconcile does).

use std::collections::{BTreeMap, HashMap};

use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::QueueAttributeName;

use super::queue_missing;
use crate::backend::{Classify, Failure};

/// The tag naming the Subscription (`namespace/name`) a queue (or dead-letter queue) belongs to.
pub const OWNER_TAG: &str = "settle-subscription";
/// The tag naming the Subscription object (its UID) a queue (or dead-letter queue) belongs to:
/// the one that decides (docs/semantics.md Q7). [`OWNER_TAG`] stays for people.
pub const OBJECT_TAG: &str = "settle-object";
/// The tag that pauses a queue's applications (`super::pause`, semantics W4).
pub const PAUSE_TAG: &str = "settle-paused";

/// A queue's owner tags, as far as it has them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnerTags {
    /// [`OWNER_TAG`]: `namespace/name`.
    pub subscription: Option<String>,
    /// [`OBJECT_TAG`]: the object's UID (none on queues made before Settle tagged one).
    pub object: Option<String>,
    /// [`PAUSE_TAG`]: the pause the operator left, read with the owner.
    pub paused: Option<String>,
}

/// A failed SQS call.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    /// No answer (refused, timed out, unresolvable): try again later.
    #[error("SQS {operation} got no answer: {detail}")]
    Unreachable {
        operation: &'static str,
        detail: String,
    },
    /// The server refused the credentials or their permissions.
    #[error("SQS {operation} refused the credentials: {detail}")]
    AuthFailed {
        operation: &'static str,
        detail: String,
    },
    /// The server refused the call.
    #[error("SQS {operation} refused: {detail}")]
    Refused {
        operation: &'static str,
        detail: String,
    },
}

impl Classify for AdminError {
    fn class(&self) -> Failure {
        match self {
            AdminError::Unreachable { .. } => Failure::Unreachable,
            AdminError::AuthFailed { .. } => Failure::AuthFailed,
            AdminError::Refused { .. } => Failure::Refused,
        }
    }
}

/// Whether an error code means the credentials (or their permissions) were refused.
pub fn is_auth_code(code: &str) -> bool {
    matches!(
        code,
        "InvalidClientTokenId"
            | "SignatureDoesNotMatch"
            | "AccessDenied"
            | "AccessDeniedException"
            | "UnrecognizedClientException"
            | "InvalidAccessKeyId"
            | "MissingAuthenticationToken"
            | "ExpiredToken"
    ) || code.ends_with("#AccessDenied")
}

pub(super) fn classify<E, R>(operation: &'static str, e: SdkError<E, R>) -> AdminError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    let unreachable = matches!(
        e,
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) | SdkError::ResponseError(_)
    );
    let unparsable = matches!(e, SdkError::ResponseError(_));
    let code = e.code().map(str::to_string);
    let full = super::api(operation, e).to_string();
    // What the server sent (its message, an unparsable answer) never reaches status, where the
    // error goes: an endpoint a Backend names could reflect anything. Only the error code, when
    // it looks like one, and a fixed text; the rest at DEBUG, truncated.
    let detail = if unparsable {
        "the answer could not be read as SQS's (the full error is in the operator's debug log)"
            .to_string()
    } else if unreachable {
        full.clone()
    } else {
        match code.as_deref().filter(|c| plausible_code(c)) {
            Some(c) => format!("the server answered error code {c}"),
            None => "the server answered an error without a recognisable code".to_string(),
        }
    };
    if !unreachable || unparsable {
        tracing::debug!(operation, error = %full.chars().take(256).collect::<String>(), "SQS error (truncated)");
    }
    let code = code.filter(|c| plausible_code(c));
    classify_parts(operation, unreachable, code.as_deref(), detail)
}

/// An error code as SQS spells them (`InvalidClientTokenId`,
/// `AWS.SimpleQueueService.NonExistentQueue`, `com.amazonaws.sqs#QueueDoesNotExist`): short,
/// without spaces; anything else is not repeated.
fn plausible_code(c: &str) -> bool {
    !c.is_empty()
        && c.len() <= 96
        && c.chars()
            .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '.' | '#' | '_' | '-' | ':'))
}

/// The kind of a failed call from its parts: whether the request was never answered, the error
/// code, and the whole message. A request that could not be signed because no credentials were
/// found is never sent (the SDK reports it as a dispatch failure), but it is the credentials
/// that are missing, not the server.
pub fn classify_parts(
    operation: &'static str,
    unanswered: bool,
    code: Option<&str>,
    detail: String,
) -> AdminError {
    if unanswered && detail.contains("loading credentials") {
        AdminError::AuthFailed {
            operation,
            detail: format!(
                "{detail} (no credentials: name a Secret in spec.sqs.credentialsSecretRef, or give the pod an identity)"
            ),
        }
    } else if unanswered {
        AdminError::Unreachable { operation, detail }
    } else if code.is_some_and(is_auth_code) {
        AdminError::AuthFailed { operation, detail }
    } else {
        AdminError::Refused { operation, detail }
    }
}

/// Whether the server answers, and the credentials are good: lists queues under `prefix`
/// (one page, at most one result); returns how many it listed.
pub async fn ping(client: &Client, prefix: &str) -> Result<usize, AdminError> {
    let mut call = client.list_queues().max_results(1);
    if !prefix.is_empty() {
        call = call.queue_name_prefix(prefix);
    }
    let out = call.send().await.map_err(|e| classify("ListQueues", e))?;
    Ok(out.queue_urls.map_or(0, |u| u.len()))
}

/// The URL of queue `name`, if it exists.
pub async fn queue_url(client: &Client, name: &str) -> Result<Option<String>, AdminError> {
    match client.get_queue_url().queue_name(name).send().await {
        Ok(out) => Ok(out.queue_url),
        Err(e) if queue_missing(&e) => Ok(None),
        Err(e) => Err(classify("GetQueueUrl", e)),
    }
}

/// Every attribute of the queue at `url`, by SQS's names; `None` when it is gone.
pub async fn attributes(
    client: &Client,
    url: &str,
) -> Result<Option<BTreeMap<String, String>>, AdminError> {
    match client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
    {
        Ok(out) => Ok(Some(
            out.attributes
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k.as_str().to_string(), v))
                .collect(),
        )),
        Err(e) if queue_missing(&e) => Ok(None),
        Err(e) => Err(classify("GetQueueAttributes", e)),
    }
}

/// The Subscription and object the queue at `url` belongs to (its owner tags).
pub async fn owner(client: &Client, url: &str) -> Result<OwnerTags, AdminError> {
    let out = client
        .list_queue_tags()
        .queue_url(url)
        .send()
        .await
        .map_err(|e| classify("ListQueueTags", e))?;
    let mut tags = out.tags.unwrap_or_default();
    Ok(OwnerTags {
        subscription: tags.remove(OWNER_TAG),
        object: tags.remove(OBJECT_TAG),
        paused: tags.remove(PAUSE_TAG),
    })
}

/// Tags the queue at `url` as object `uid`'s (SQS changes tags in place).
pub async fn tag_object(client: &Client, url: &str, uid: &str) -> Result<(), AdminError> {
    client
        .tag_queue()
        .queue_url(url)
        .tags(OBJECT_TAG, uid)
        .send()
        .await
        .map_err(|e| classify("TagQueue", e))?;
    Ok(())
}

/// Tags queue `url` as `owner`'s (object `uid`): a queue Settle did not make, taken over
/// (`spec.adopt: IfCompatible`, docs/semantics.md Q11).
pub async fn tag_owner(
    client: &Client,
    url: &str,
    owner: &str,
    uid: Option<&str>,
) -> Result<(), AdminError> {
    let mut call = client.tag_queue().queue_url(url).tags(OWNER_TAG, owner);
    if let Some(uid) = uid {
        call = call.tags(OBJECT_TAG, uid);
    }
    call.send().await.map_err(|e| classify("TagQueue", e))?;
    Ok(())
}

fn attribute_map(attributes: BTreeMap<String, String>) -> HashMap<QueueAttributeName, String> {
    attributes
        .into_iter()
        .map(|(k, v)| (QueueAttributeName::from(k.as_str()), v))
        .collect()
}

/// Creates queue `name` with `attributes`, tagged as `owner`'s (object `uid`); returns its URL.
pub async fn create(
    client: &Client,
    name: &str,
    attributes: BTreeMap<String, String>,
    owner: &str,
    uid: Option<&str>,
) -> Result<String, AdminError> {
    let mut call = client
        .create_queue()
        .queue_name(name)
        .set_attributes(Some(attribute_map(attributes)))
        .tags(OWNER_TAG, owner);
    if let Some(uid) = uid {
        call = call.tags(OBJECT_TAG, uid);
    }
    let out = call.send().await.map_err(|e| classify("CreateQueue", e))?;
    Ok(out.queue_url.unwrap_or_default())
}

/// Sets `attributes` on the queue at `url` (an empty RedrivePolicy removes it).
pub async fn set_attributes(
    client: &Client,
    url: &str,
    attributes: BTreeMap<String, String>,
) -> Result<(), AdminError> {
    client
        .set_queue_attributes()
        .queue_url(url)
        .set_attributes(Some(attribute_map(attributes)))
        .send()
        .await
        .map_err(|e| classify("SetQueueAttributes", e))?;
    Ok(())
}

/// Deletes the queue at `url` with what it holds; a queue already gone is no error.
pub async fn delete(client: &Client, url: &str) -> Result<(), AdminError> {
    match client.delete_queue().queue_url(url).send().await {
        Ok(_) => Ok(()),
        Err(e) if queue_missing(&e) => Ok(()),
        Err(e) => Err(classify("DeleteQueue", e)),
    }
}

/// The account's gauges for queue `name` (its full name, prefix included), `(pending,
/// ack_pending)`: `ApproximateNumberOfMessages` (visible, waiting to be received) and
/// `ApproximateNumberOfMessagesNotVisible` (received and not yet deleted, or declined and held
/// back). SQS's counts are approximate and lag by up to a minute. `None` when the queue does not
/// exist.
pub async fn queue_gauges(client: &Client, name: &str) -> Result<Option<(u64, u64)>, AdminError> {
    let Some(url) = queue_url(client, name).await? else {
        return Ok(None);
    };
    let Some(a) = attributes(client, &url).await? else {
        return Ok(None);
    };
    Ok(Some(gauges_of(&a)))
}

/// `(pending, ack_pending)` from a queue's attributes.
pub fn gauges_of(attributes: &BTreeMap<String, String>) -> (u64, u64) {
    let n = |k: &str| {
        attributes
            .get(k)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (
        n("ApproximateNumberOfMessages"),
        n("ApproximateNumberOfMessagesNotVisible"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauges_read_the_two_counts() {
        let a: BTreeMap<String, String> = [
            ("ApproximateNumberOfMessages", "7"),
            ("ApproximateNumberOfMessagesNotVisible", "2"),
            ("ApproximateNumberOfMessagesDelayed", "9"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(gauges_of(&a), (7, 2));
        assert_eq!(gauges_of(&BTreeMap::new()), (0, 0));
    }

    #[test]
    fn failures_are_told_apart() {
        let kind = |unanswered, code, detail: &str| match classify_parts(
            "ListQueues",
            unanswered,
            code,
            detail.to_string(),
        ) {
            AdminError::Unreachable { .. } => "unreachable",
            AdminError::AuthFailed { .. } => "auth",
            AdminError::Refused { .. } => "refused",
        };
        assert_eq!(
            kind(true, None, "dispatch failure: connection refused"),
            "unreachable"
        );
        assert_eq!(
            kind(
                true,
                None,
                "dispatch failure: other: an error occurred while loading credentials: no IMDS"
            ),
            "auth"
        );
        assert_eq!(kind(false, Some("InvalidClientTokenId"), "x"), "auth");
        assert_eq!(kind(false, Some("InvalidAttributeValue"), "x"), "refused");
        assert_eq!(kind(false, None, "x"), "refused");
    }

    #[test]
    fn only_plausible_error_codes_are_repeated() {
        assert!(plausible_code("InvalidClientTokenId"));
        assert!(plausible_code("com.amazonaws.sqs#QueueDoesNotExist"));
        assert!(!plausible_code("<html>secret page</html>"));
        assert!(!plausible_code(&"A".repeat(200)));
        assert!(!plausible_code(""));
    }

    #[test]
    fn auth_codes_are_told_apart() {
        for c in [
            "InvalidClientTokenId",
            "SignatureDoesNotMatch",
            "AccessDenied",
        ] {
            assert!(is_auth_code(c), "{c}");
        }
        for c in ["QueueDoesNotExist", "InvalidAttributeValue", ""] {
            assert!(!is_auth_code(c), "{c}");
        }
    }
}
