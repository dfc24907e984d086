//! The JetStream advisories the operator reads: those that say a consumer changed on the broker
//! (deleted, created, or created/updated through the API: the audit advisory), which repair drift
//! within about a second, and those that say what became of a delivery (its attempts ran out, it
//! was terminated, it was nacked), which the account captures into a stream it owns; and a
//! stream's update (its limits may have been raised).
//!
//! Pure: subjects and parsing only. It must not decide what to do about a change.

use serde::Deserialize;

/// A consumer was deleted: `…DELETED.<stream>.<consumer>`.
pub const CONSUMER_DELETED: &str = "$JS.EVENT.ADVISORY.CONSUMER.DELETED.>";
/// A stream was updated (its `max_consumers` may have been raised): `…STREAM.UPDATED.<stream>`.
pub const STREAM_UPDATED: &str = "$JS.EVENT.ADVISORY.STREAM.UPDATED.*";

/// The stream a [`STREAM_UPDATED`] advisory names.
pub fn updated_stream(subject: &str) -> Option<&str> {
    subject
        .strip_prefix("$JS.EVENT.ADVISORY.STREAM.UPDATED.")
        .filter(|s| !s.is_empty() && !s.contains('.'))
}

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
    /// A create, update, pause or resume request through the API.
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
            })
            // A pause or resume by hand (`nats consumer pause|resume`): the controller pauses
            // it again as the spec says (semantics W2).
            .or_else(|| audit.subject.strip_prefix("$JS.API.CONSUMER.PAUSE."))?;
        return change(ChangeKind::Written, rest, client);
    }
    None
}

/// A message's attempts ran out: `…MAX_DELIVERIES.<stream>.<consumer>`.
pub const MAX_DELIVERIES: &str = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>";
/// A delivery was terminated (`+TERM`): `…MSG_TERMINATED.<stream>.<consumer>`.
pub const MSG_TERMINATED: &str = "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.>";
/// A delivery was nacked (`-NAK`): `…MSG_NAKED.<stream>.<consumer>`.
pub const MSG_NAKED: &str = "$JS.EVENT.ADVISORY.CONSUMER.MSG_NAKED.>";

/// Every advisory the account captures: messages whose attempts ran out or were terminated, and
/// consumers made or removed (a consumer made again starts its delivery counts afresh). Not
/// `MSG_NAKED`: the runtime counts its nacks, and every nack of every consumer on the server
/// would fill the capture.
pub const DELIVERY_SUBJECTS: [&str; 4] = [
    MAX_DELIVERIES,
    MSG_TERMINATED,
    CONSUMER_CREATED,
    CONSUMER_DELETED,
];

/// What became of one delivery, as the broker saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeliveryKind {
    /// Its last attempt went unsettled past ack wait, or was nacked: the broker dropped it.
    MaxDeliveries,
    /// A client terminated it.
    Terminated,
    /// A client nacked it.
    Naked,
}

/// One delivery advisory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeliveryEvent {
    pub kind: DeliveryKind,
    pub stream: String,
    pub consumer: String,
    /// The message, by its stream sequence.
    pub stream_seq: u64,
    /// Deliveries of the message so far (the attempt the event concerns).
    pub deliveries: u64,
    /// When the server wrote the advisory, in nanoseconds since the epoch (its own clock, as
    /// a consumer's `created`): absent when the advisory carries no readable timestamp.
    pub at_ns: Option<i128>,
}

/// An RFC 3339 time, as nats-server writes them, in nanoseconds since the epoch.
pub fn rfc3339_ns(text: &str) -> Option<i128> {
    text.parse::<k8s_openapi::jiff::Timestamp>()
        .ok()
        .map(|t| t.as_nanosecond())
}

#[derive(Deserialize)]
struct Delivery {
    stream: String,
    consumer: String,
    stream_seq: u64,
    #[serde(default)]
    deliveries: u64,
    #[serde(default)]
    timestamp: Option<String>,
}

/// The delivery event an advisory message reports, if it reports one.
pub fn parse_delivery(subject: &str, payload: &[u8]) -> Option<DeliveryEvent> {
    let kind = if subject.starts_with("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.") {
        DeliveryKind::MaxDeliveries
    } else if subject.starts_with("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.") {
        DeliveryKind::Terminated
    } else if subject.starts_with("$JS.EVENT.ADVISORY.CONSUMER.MSG_NAKED.") {
        DeliveryKind::Naked
    } else {
        return None;
    };
    let d: Delivery = serde_json::from_slice(payload).ok()?;
    Some(DeliveryEvent {
        kind,
        stream: d.stream,
        consumer: d.consumer,
        stream_seq: d.stream_seq,
        deliveries: d.deliveries,
        at_ns: d.timestamp.as_deref().and_then(rfc3339_ns),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_update_names_its_stream() {
        assert_eq!(
            updated_stream("$JS.EVENT.ADVISORY.STREAM.UPDATED.ORDERS"),
            Some("ORDERS")
        );
        assert_eq!(updated_stream("$JS.EVENT.ADVISORY.STREAM.UPDATED."), None);
        assert_eq!(
            updated_stream("$JS.EVENT.ADVISORY.STREAM.CREATED.ORDERS"),
            None
        );
    }

    #[test]
    fn delivery_advisories_name_the_message_and_its_attempt() {
        // As nats-server writes them (io.nats.jetstream.advisory.v1.max_deliver / terminated / nak).
        let payload = br#"{"type":"io.nats.jetstream.advisory.v1.max_deliver","id":"x","timestamp":"2026-11-30T10:00:00Z","stream":"ORDERS","consumer":"orders","stream_seq":42,"deliveries":3}"#;
        assert_eq!(
            parse_delivery(
                "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.ORDERS.orders",
                payload
            ),
            Some(DeliveryEvent {
                kind: DeliveryKind::MaxDeliveries,
                stream: "ORDERS".into(),
                consumer: "orders".into(),
                stream_seq: 42,
                deliveries: 3,
                at_ns: rfc3339_ns("2026-11-30T10:00:00Z"),
            })
        );
        let term = br#"{"stream":"S","consumer":"c","consumer_seq":9,"stream_seq":7,"deliveries":5,"reason":""}"#;
        assert_eq!(
            parse_delivery("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.S.c", term).map(|e| (
                e.kind,
                e.stream_seq,
                e.deliveries
            )),
            Some((DeliveryKind::Terminated, 7, 5))
        );
        assert_eq!(
            parse_delivery("$JS.EVENT.ADVISORY.CONSUMER.MSG_NAKED.S.c", term).map(|e| e.kind),
            Some(DeliveryKind::Naked)
        );
        assert_eq!(
            parse_delivery("$JS.EVENT.ADVISORY.CONSUMER.DELETED.S.c", term),
            None,
            "not a delivery advisory"
        );
        assert_eq!(
            parse_delivery("$JS.EVENT.ADVISORY.CONSUMER.MSG_NAKED.S.c", b"{}"),
            None,
            "no message named"
        );
    }

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
            (
                "$JS.API.CONSUMER.PAUSE.ORDERS.orders",
                Some(("ORDERS", "orders")),
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
