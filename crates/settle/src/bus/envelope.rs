//! Reading an event out of a transport message: CloudEvents (binary and structured content
//! modes), a MassTransit JSON envelope, or a raw payload; and spotting transport headers that
//! contradict the envelope (docs/semantics.md C11).
//!
//! Pure parsing: no counting, no I/O. The envelope's values always win; the transport's
//! contradicting values are kept aside in `Foreign`.

use bytes::Bytes;
use serde_json::Value;

/// How the event was carried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// No envelope: the payload is the data.
    Raw,
    /// CloudEvents binary content mode: attributes in `ce-*` headers, the payload is the data.
    CloudEventsBinary,
    /// CloudEvents structured content mode: one JSON document with attributes and `data`.
    CloudEventsStructured,
    /// A MassTransit JSON envelope (`messageId`, `correlationId`, `message`, …).
    MassTransit,
}

/// The event's identity, as its envelope states it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvelopeEvent {
    pub format: Format,
    pub id: Option<String>,
    pub source: Option<String>,
    pub event_type: Option<String>,
    pub correlation_id: Option<String>,
    pub content_type: Option<String>,
}

/// Transport headers that contradicted the envelope; the envelope's value was kept.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Foreign {
    pub headers: Vec<(String, String)>,
}

impl Foreign {
    pub fn get(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn is_empty(&self) -> bool {
        self.headers.is_empty()
    }
}

/// The event's data, where it sits.
#[derive(Clone, Debug)]
pub(crate) enum Data {
    Bytes(Bytes),
    Json(Value),
}

pub(crate) struct Parsed {
    pub event: EnvelopeEvent,
    pub foreign: Foreign,
    pub data: Data,
}

/// Transport header names that carry a correlation id, and a message id.
const CORRELATION_HEADERS: [&str; 3] = ["correlation-id", "correlation_id", "correlationid"];
const MESSAGE_ID_HEADERS: [&str; 3] = ["message-id", "message_id", "messageid"];

pub(crate) fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

fn str_field(v: &Value, key: &str) -> Option<String> {
    match v.get(key) {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Null) | None => None,
        Some(other) => Some(other.to_string()),
    }
}

fn looks_like(payload: &[u8], key: &[u8]) -> bool {
    payload.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
        && payload.windows(key.len()).any(|w| w == key)
}

/// Reads the event out of a message's headers and payload.
pub(crate) fn parse(headers: &[(String, String)], payload: &Bytes) -> Parsed {
    // Fast path: no headers and not a JSON object, so no envelope.
    if headers.is_empty() && payload.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return raw(None, payload);
    }
    let content_type = header(headers, "content-type").map(str::to_string);
    let ct = content_type.as_deref().unwrap_or("").to_ascii_lowercase();

    if let Some(parsed) = cloudevents_binary(headers, &content_type, payload) {
        return parsed;
    }
    if let Some(parsed) = cloudevents_structured(&ct, &content_type, payload) {
        return parsed;
    }
    if let Some(parsed) = masstransit(headers, &ct, &content_type, payload) {
        return parsed;
    }
    raw(content_type, payload)
}

/// No envelope: the payload is the data.
fn raw(content_type: Option<String>, payload: &Bytes) -> Parsed {
    Parsed {
        event: EnvelopeEvent {
            format: Format::Raw,
            id: None,
            source: None,
            event_type: None,
            correlation_id: None,
            content_type,
        },
        foreign: Foreign::default(),
        data: Data::Bytes(payload.clone()),
    }
}

/// Binary mode: the attributes are headers (`ce-` prefix; `ce_` as some transports spell it).
/// `None` when there is no `specversion` header.
fn cloudevents_binary(
    headers: &[(String, String)],
    content_type: &Option<String>,
    payload: &Bytes,
) -> Option<Parsed> {
    let ce = |attr: &str| {
        header(headers, &format!("ce-{attr}"))
            .or_else(|| header(headers, &format!("ce_{attr}")))
            .map(str::to_string)
    };
    ce("specversion")?;
    Some(Parsed {
        event: EnvelopeEvent {
            format: Format::CloudEventsBinary,
            id: ce("id"),
            source: ce("source"),
            event_type: ce("type"),
            correlation_id: ce("correlationid"),
            content_type: content_type.clone(),
        },
        foreign: Foreign::default(),
        data: Data::Bytes(payload.clone()),
    })
}

/// Structured mode: one JSON object with the attributes and `data`. `None` when the content
/// type (`ct`, lowercased) or, without one, the payload does not say so, or it is not an object.
fn cloudevents_structured(
    ct: &str,
    content_type: &Option<String>,
    payload: &Bytes,
) -> Option<Parsed> {
    let structured = ct.starts_with("application/cloudevents+json")
        || (ct.is_empty() && looks_like(payload, b"\"specversion\""));
    if !structured {
        return None;
    }
    let Ok(mut doc @ Value::Object(_)) = serde_json::from_slice::<Value>(payload) else {
        return None;
    };
    let data = match doc.get_mut("data").map(Value::take) {
        Some(v) => Data::Json(v),
        None => Data::Bytes(Bytes::new()),
    };
    Some(Parsed {
        event: EnvelopeEvent {
            format: Format::CloudEventsStructured,
            id: str_field(&doc, "id"),
            source: str_field(&doc, "source"),
            event_type: str_field(&doc, "type"),
            correlation_id: str_field(&doc, "correlationid"),
            content_type: str_field(&doc, "datacontenttype").or(content_type.clone()),
        },
        foreign: Foreign::default(),
        data,
    })
}

/// A MassTransit JSON envelope, with the transport headers that contradict it. `None` when the
/// content type (`ct`, lowercased) or, without one, the payload does not say so, or it is not
/// an object.
fn masstransit(
    headers: &[(String, String)],
    ct: &str,
    content_type: &Option<String>,
    payload: &Bytes,
) -> Option<Parsed> {
    let masstransit = ct.starts_with("application/vnd.masstransit+json")
        || (ct.is_empty() && looks_like(payload, b"\"messageType\""));
    if !masstransit {
        return None;
    }
    let Ok(mut doc @ Value::Object(_)) = serde_json::from_slice::<Value>(payload) else {
        return None;
    };
    let event = EnvelopeEvent {
        format: Format::MassTransit,
        id: str_field(&doc, "messageId"),
        source: str_field(&doc, "sourceAddress"),
        event_type: doc
            .get("messageType")
            .and_then(|t| t.get(0))
            .and_then(Value::as_str)
            .map(str::to_string),
        correlation_id: str_field(&doc, "correlationId"),
        content_type: content_type.clone(),
    };
    let foreign = contradicting_headers(headers, &event);
    let data = Data::Json(
        doc.get_mut("message")
            .map(Value::take)
            .unwrap_or(Value::Null),
    );
    Some(Parsed {
        event,
        foreign,
        data,
    })
}

/// The correlation-id and message-id transport headers whose value differs from the envelope's.
fn contradicting_headers(headers: &[(String, String)], event: &EnvelopeEvent) -> Foreign {
    let mut foreign = Foreign::default();
    for (names, envelope_value) in [
        (CORRELATION_HEADERS, &event.correlation_id),
        (MESSAGE_ID_HEADERS, &event.id),
    ] {
        let Some(envelope_value) = envelope_value else {
            continue;
        };
        for (k, v) in headers {
            if names.iter().any(|n| k.eq_ignore_ascii_case(n)) && v != envelope_value {
                foreign.headers.push((k.clone(), v.clone()));
            }
        }
    }
    foreign
}
