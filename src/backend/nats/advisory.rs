//! The JetStream advisories that say a consumer changed on the broker: deleted, created, or
//! created/updated through the API (the API audit advisory). The operator listens to them on
//! each Backend's connection to repair drift within about a second.
//!
//! Pure: subjects and parsing only. It must not decide what to do about a change.

use serde::Deserialize;

/// A consumer was deleted: `…DELETED.<stream>.<consumer>`.
pub const CONSUMER_DELETED: &str = "$JS.EVENT.ADVISORY.CONSUMER.DELETED.>";
/// A consumer was created: `…CREATED.<stream>.<consumer>`.
pub const CONSUMER_CREATED: &str = "$JS.EVENT.ADVISORY.CONSUMER.CREATED.>";
/// Every JetStream API call (the audit advisory); consumer updates show only here.
pub const API_AUDIT: &str = "$JS.EVENT.ADVISORY.API";

/// What happened to which consumer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsumerChange {
    pub kind: ChangeKind,
    pub stream: String,
    pub consumer: String,
    /// The connection name of the client that made the change (API audit only).
    pub client: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChangeKind {
    Deleted,
    Created,
    /// A create or update request through the API.
    Written,
}

#[derive(Deserialize)]
struct Audit {
    #[serde(default)]
    subject: String,
    #[serde(default)]
    client: Option<AuditClient>,
}

#[derive(Deserialize)]
struct AuditClient {
    #[serde(default)]
    name: Option<String>,
}

/// The consumer change an advisory message reports, if it reports one.
pub fn parse(subject: &str, payload: &[u8]) -> Option<ConsumerChange> {
    let change = |kind, rest: &str, client| {
        let mut t = rest.split('.');
        let stream = t.next().filter(|s| !s.is_empty())?.to_string();
        let consumer = t.next().filter(|s| !s.is_empty())?.to_string();
        Some(ConsumerChange {
            kind,
            stream,
            consumer,
            client,
        })
    };
    if let Some(rest) = subject.strip_prefix("$JS.EVENT.ADVISORY.CONSUMER.DELETED.") {
        return change(ChangeKind::Deleted, rest, None);
    }
    if let Some(rest) = subject.strip_prefix("$JS.EVENT.ADVISORY.CONSUMER.CREATED.") {
        return change(ChangeKind::Created, rest, None);
    }
    if subject == API_AUDIT {
        let audit: Audit = serde_json::from_slice(payload).ok()?;
        let client = audit.client.and_then(|c| c.name);
        // Consumer names and stream names hold no '.', so the filter subject that may follow
        // (`CONSUMER.CREATE.<stream>.<consumer>.<filter>`) is left out by taking two tokens.
        let rest = audit
            .subject
            .strip_prefix("$JS.API.CONSUMER.CREATE.")
            .or_else(|| {
                audit
                    .subject
                    .strip_prefix("$JS.API.CONSUMER.DURABLE.CREATE.")
            })?;
        return change(ChangeKind::Written, rest, client);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deleted_and_created_advisories_name_stream_and_consumer() {
        assert_eq!(
            parse("$JS.EVENT.ADVISORY.CONSUMER.DELETED.ORDERS.orders", b"{}"),
            Some(ConsumerChange {
                kind: ChangeKind::Deleted,
                stream: "ORDERS".into(),
                consumer: "orders".into(),
                client: None
            })
        );
        assert_eq!(
            parse("$JS.EVENT.ADVISORY.CONSUMER.CREATED.S.settle_shop_a", b"")
                .map(|c| (c.kind, c.consumer)),
            Some((ChangeKind::Created, "settle_shop_a".into()))
        );
    }

    #[test]
    fn the_api_audit_reports_consumer_writes_with_the_client_name() {
        let cases = [
            (
                "$JS.API.CONSUMER.CREATE.ORDERS.orders",
                Some(("ORDERS", "orders")),
            ),
            (
                "$JS.API.CONSUMER.CREATE.ORDERS.orders.orders.>",
                Some(("ORDERS", "orders")),
            ),
            (
                "$JS.API.CONSUMER.DURABLE.CREATE.ORDERS.d",
                Some(("ORDERS", "d")),
            ),
            ("$JS.API.CONSUMER.INFO.ORDERS.orders", None),
            ("$JS.API.STREAM.CREATE.ORDERS", None),
            ("$JS.API.CONSUMER.CREATE.ORDERS", None),
        ];
        for (api_subject, want) in cases {
            let payload = serde_json::json!({
                "type": "io.nats.jetstream.advisory.v1.api_audit",
                "subject": api_subject,
                "client": {"name": "someone"},
                "request": "{}",
            });
            let got = parse(API_AUDIT, payload.to_string().as_bytes());
            match want {
                None => assert_eq!(got, None, "{api_subject}"),
                Some((stream, consumer)) => {
                    let got = got.unwrap_or_else(|| panic!("{api_subject}: nothing parsed"));
                    assert_eq!(got.kind, ChangeKind::Written);
                    assert_eq!(
                        (got.stream.as_str(), got.consumer.as_str()),
                        (stream, consumer)
                    );
                    assert_eq!(got.client.as_deref(), Some("someone"));
                }
            }
        }
    }

    #[test]
    fn other_messages_report_nothing() {
        assert_eq!(parse("$JS.EVENT.ADVISORY.STREAM.CREATED.S", b"{}"), None);
        assert_eq!(parse(API_AUDIT, b"not json"), None);
        assert_eq!(parse("$JS.EVENT.ADVISORY.CONSUMER.DELETED.", b""), None);
        assert_eq!(parse("$JS.EVENT.ADVISORY.CONSUMER.DELETED.S", b""), None);
    }
}
