//! Reading a Subscription out of untrusted input (an AdmissionReview's object, a manifest on
//! disk), with an error that names the field. Parsing only: the rules live in `rules`.

use crate::api::{DeliveryPolicy, Subscription};

/// Reads a Subscription, naming the field that does not fit, e.g.
/// `spec.ackWait: invalid type: integer `30`, expected a string`.
pub fn read_subscription(value: &serde_json::Value) -> Result<Subscription, String> {
    serde_path_to_error::deserialize::<_, Subscription>(value).map_err(|e| {
        // The policy fields are flattened into the spec, and serde loses the path through a
        // flatten: parse the policy alone to say which of its fields is wrong.
        let policy = value
            .get("spec")
            .and_then(|s| serde_path_to_error::deserialize::<_, DeliveryPolicy>(s).err());
        match policy {
            Some(p) => at("spec", &p.path().to_string(), &p.into_inner().to_string()),
            None => at("", &e.path().to_string(), &e.into_inner().to_string()),
        }
    })
}

/// `prefix.path: message`, leaving out the parts that are empty (serde writes the root as `.`).
fn at(prefix: &str, path: &str, message: &str) -> String {
    let path = if path == "." { "" } else { path };
    let field = match (prefix, path) {
        ("", "") => return message.to_string(),
        (p, "") => p.to_string(),
        ("", q) => q.to_string(),
        (p, q) => format!("{p}.{q}"),
    };
    format!("{field}: {message}")
}
