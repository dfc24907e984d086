//! Reading a Subscription out of untrusted input (an AdmissionReview's object, a manifest on
//! disk), with an error that names the field. Parsing only: the rules live in `rules`.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_path_to_error::Segment;

use settle::api::{DeliveryPolicy, Subscription};

/// Reads a Subscription, naming the field that does not fit, e.g.
/// `spec.ackWait: invalid type: integer `30`, expected a string`.
pub fn read_subscription(value: &serde_json::Value) -> Result<Subscription, String> {
    read(Input::Value(value))
}

pub use under_review::Subscription as SubscriptionUnderReview;

mod under_review {
    use serde::Deserialize;
    use serde::de::IgnoredAny;

    use super::MetadataUnderReview;
    use settle::api::SubscriptionSpec;

    /// What admission judges of a Subscription: its name, namespace, deletionTimestamp and
    /// spec, and nothing else.
    ///
    /// Read from JSON text by [`read_subscription_under_review`](super::read_subscription_under_review).
    /// Every other field (annotations, labels, managedFields, status) is skipped as
    /// `serde::de::IgnoredAny` skips it: checked to be well-formed JSON, never built into
    /// strings or maps. So an object carrying half a million annotations costs the webhook its
    /// text and one scan, not a tree many times its size.
    // Named as the full type is, with its three fields in its order, so that serde words its
    // errors the same way ("expected struct Subscription with 3 elements").
    #[derive(Clone, Debug, Deserialize)]
    pub struct Subscription {
        pub metadata: MetadataUnderReview,
        pub spec: SubscriptionSpec,
        #[serde(default)]
        #[allow(dead_code)]
        status: Option<IgnoredAny>,
    }
}

/// The three fields of `metadata` admission reads; the others are skipped unparsed. Read as
/// `ObjectMeta` reads (a map only, the last of a repeated key winning, each field of the type
/// `ObjectMeta` gives it), so errors read the same.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetadataUnderReview {
    pub name: Option<String>,
    pub namespace: Option<String>,
    /// Set once the object is being deleted: what is left to do to it is its cleanup, which
    /// admission never blocks (docs/semantics.md A14).
    pub deletion_timestamp: Option<Time>,
}

impl<'de> Deserialize<'de> for MetadataUnderReview {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = MetadataUnderReview;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("ObjectMeta")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<MetadataUnderReview, A::Error> {
                let mut meta = MetadataUnderReview::default();
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "name" => meta.name = map.next_value()?,
                        "namespace" => meta.namespace = map.next_value()?,
                        "deletionTimestamp" => meta.deletion_timestamp = map.next_value()?,
                        _ => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                        }
                    }
                }
                Ok(meta)
            }
        }
        deserializer.deserialize_struct(
            "ObjectMeta",
            &["name", "namespace", "deletionTimestamp"],
            Fields,
        )
    }
}

/// Reads what admission judges of a Subscription from its JSON text (an AdmissionReview's
/// `object`), naming the field that does not fit as [`read_subscription`] does. The wording
/// after the field is serde_json's for text, which differs from its wording for a parsed value
/// in a few cases only (an enum field holding neither a string nor a one-key object, an object
/// field holding a list): values the API server's schema refuses before any webhook sees them.
pub fn read_subscription_under_review(json: &str) -> Result<SubscriptionUnderReview, String> {
    read(Input::Json(json))
}

/// The one reading path of both: the first error, with its field path.
fn read<T: DeserializeOwned>(input: Input<'_>) -> Result<T, String> {
    input.parse::<T>().map_err(|failed| {
        // The policy fields are flattened into the spec, and serde loses the path through a
        // flatten: parse the policy alone to say which of its fields is wrong.
        match input.parse::<PolicyOf>() {
            Err(policy) if policy.in_spec => policy.to_string(),
            _ => failed.to_string(),
        }
    })
}

/// The spec read as a bare policy, only to find the path of an error inside it.
#[derive(Deserialize)]
struct PolicyOf {
    #[allow(dead_code)]
    spec: DeliveryPolicy,
}

#[derive(Clone, Copy)]
enum Input<'a> {
    Value(&'a serde_json::Value),
    Json(&'a str),
}

/// Where reading failed, and why.
struct Failure {
    /// serde's path, `.` at the root.
    path: String,
    /// Whether the path starts at `spec`.
    in_spec: bool,
    message: String,
}

impl Input<'_> {
    fn parse<T: DeserializeOwned>(self) -> Result<T, Failure> {
        let failure = |e: serde_path_to_error::Error<serde_json::Error>| Failure {
            path: e.path().to_string(),
            in_spec: matches!(e.path().iter().next(), Some(Segment::Map { key }) if key == "spec"),
            message: without_position(e.inner()),
        };
        match self {
            Input::Value(value) => serde_path_to_error::deserialize(value).map_err(failure),
            Input::Json(text) => {
                let mut de = serde_json::Deserializer::from_str(text);
                let read = serde_path_to_error::deserialize(&mut de).map_err(failure)?;
                de.end().map_err(|e| Failure {
                    path: ".".to_string(),
                    in_spec: false,
                    message: without_position(&e),
                })?;
                Ok(read)
            }
        }
    }
}

/// serde_json's message without the ` at line 1 column 162` it adds when reading text: the
/// field path says where, in terms the author of the object knows.
fn without_position(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let position = format!(" at line {} column {}", e.line(), e.column());
    match text.strip_suffix(&position) {
        Some(message) if e.line() != 0 => message.to_string(),
        _ => text,
    }
}

/// `path: message`, leaving out the path at the root (serde writes the root as `.`).
impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.path.as_str() {
            "." => f.write_str(&self.message),
            field => write!(f, "{field}: {}", self.message),
        }
    }
}
