//! Typed calls to the JetStream API for streams and consumers, with errors a caller can tell
//! apart (a stream that does not exist is not a server that cannot be reached). NATS's file of
//! the operator's calls (create, inspect, update, pause, delete a consumer; find a stream; list
//! a stream's consumers with their gauges), as `rabbitmq/admin.rs` and `sqs/admin.rs` are theirs.
//!
//! Used by the runtime (to create or bind a consumer), the controller (to converge one) and the
//! account (the gauges). It
//! must not decide what a consumer looks like (that is `consumer`) nor retry: callers choose.

use async_nats::jetstream::{self, consumer, response::Response};
use async_nats::jetstream::{ErrorCode, context::RequestErrorKind};
use serde::{Deserialize, Serialize};

use super::mapping::ConsumerConfig;
use crate::backend::limit::{BrokerLimit, SetBy};
use crate::backend::{Classify, Failure};
use crate::bus::BusError;
use crate::policy::BackendKind;

/// Why a JetStream call failed, in the terms a Subscription's status speaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NatsError {
    /// The server did not answer (down, restarting, or unreachable from here).
    #[error("the NATS server did not answer ({0}): is it running and reachable?")]
    Unreachable(String),
    /// Nothing answers on the JetStream API.
    #[error("JetStream is not enabled on the NATS server (start nats-server with -js)")]
    JetStreamDisabled,
    /// A stream named explicitly does not exist.
    #[error("stream {0:?} does not exist: create it, or fix spec.stream")]
    StreamNotFound(String),
    /// No stream's subjects cover the pattern.
    #[error("no stream carries {0:?}: create a stream whose subjects cover it, or set spec.stream")]
    NoStreamFor(String),
    /// More than one stream carries the pattern.
    #[error("several streams carry {pattern:?} ({}): set spec.stream to one of them", streams.join(", "))]
    StreamAmbiguous {
        pattern: String,
        streams: Vec<String>,
    },
    /// The JetStream API refused the call.
    #[error("the JetStream API refused: {description} (error code {code})")]
    Api { code: u64, description: String },
    /// The JetStream API refused a create for a limit ([`LIMIT_CODES`]): asking again will not
    /// help until a consumer goes or the limit is raised.
    #[error(transparent)]
    Limit(BrokerLimit),
}

/// JetStream's "maximum consumers limit reached" (the stream's `max_consumers`, or the
/// account's when lower; server/errors.json `JSMaximumConsumersLimitErr`).
pub const MAX_CONSUMERS: u64 = 10_026;

/// The error codes of a create refused for a limit: 10026 (above), and the account's or
/// server's resources: 10002 (`JSAccountResourcesExceededErr`), 10023
/// (`JSInsufficientResourcesErr`), 10028 (`JSMemoryResourcesExceededErr`), 10047
/// (`JSStorageResourcesExceededErr`).
pub const LIMIT_CODES: [u64; 5] = [MAX_CONSUMERS, 10_002, 10_023, 10_028, 10_047];

/// A create's refusal, typed: a limit (by its code) or another refusal.
fn create_refusal(stream: &str, code: u64, description: String) -> NatsError {
    match code {
        MAX_CONSUMERS => NatsError::Limit(BrokerLimit::StreamConsumers {
            stream: stream.to_string(),
            max: None,
            set_by: SetBy::Unknown,
        }),
        c if LIMIT_CODES.contains(&c) => {
            NatsError::Limit(BrokerLimit::Resources { code, description })
        }
        _ => NatsError::Api { code, description },
    }
}

/// Only a server that does not answer is unreachable; the rest are the server's (or the
/// platform's) refusals, each with its own reason in status.
impl Classify for NatsError {
    fn class(&self) -> Failure {
        match self {
            NatsError::Unreachable(_) => Failure::Unreachable,
            _ => Failure::Refused,
        }
    }
}

impl NatsError {
    fn from_api(e: &jetstream::Error) -> NatsError {
        match e.error_code() {
            ErrorCode::JETSTREAM_NOT_ENABLED | ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT => {
                NatsError::JetStreamDisabled
            }
            code => NatsError::Api {
                code: code.0,
                description: e.to_string(),
            },
        }
    }

    fn from_request(e: &jetstream::context::RequestError) -> NatsError {
        match e.kind() {
            RequestErrorKind::NoResponders => NatsError::JetStreamDisabled,
            _ => NatsError::Unreachable(e.to_string()),
        }
    }

    /// The JetStream error code, when the API refused.
    pub fn code(&self) -> Option<u64> {
        match self {
            NatsError::Api { code, .. } => Some(*code),
            NatsError::Limit(BrokerLimit::Resources { code, .. }) => Some(*code),
            NatsError::Limit(BrokerLimit::StreamConsumers { .. }) => Some(MAX_CONSUMERS),
            _ => None,
        }
    }

    /// The limit that refused a create, if that is why it failed.
    pub fn limit(&self) -> Option<&BrokerLimit> {
        match self {
            NatsError::Limit(l) => Some(l),
            _ => None,
        }
    }
}

impl From<NatsError> for BusError {
    fn from(e: NatsError) -> BusError {
        BusError::Broker {
            backend: BackendKind::Nats,
            source: Box::new(e),
        }
    }
}

async fn call<T: for<'de> Deserialize<'de>>(
    js: &jetstream::Context,
    subject: String,
    body: &(impl Serialize + ?Sized),
) -> Result<Result<T, jetstream::Error>, NatsError> {
    match js.request::<_, _, Response<T>>(subject, body).await {
        Ok(Response::Ok(v)) => Ok(Ok(v)),
        Ok(Response::Err { error }) => Ok(Err(error)),
        Err(e) => Err(NatsError::from_request(&e)),
    }
}

fn refused(e: &jetstream::Error) -> NatsError {
    NatsError::from_api(e)
}

#[derive(Deserialize)]
struct StreamNames {
    #[serde(default)]
    streams: Option<Vec<String>>,
}

/// The stream a Subscription consumes from: `explicit` if given (it must exist), else the one
/// stream whose subjects overlap `pattern`.
pub async fn resolve_stream(
    js: &jetstream::Context,
    explicit: Option<&str>,
    pattern: &str,
) -> Result<String, NatsError> {
    if let Some(name) = explicit {
        let info: Result<serde_json::Value, _> =
            call(js, format!("STREAM.INFO.{name}"), &serde_json::json!({})).await?;
        return match info {
            Ok(_) => Ok(name.to_string()),
            Err(e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND => {
                Err(NatsError::StreamNotFound(name.to_string()))
            }
            Err(e) => Err(refused(&e)),
        };
    }
    let names: StreamNames = call(
        js,
        "STREAM.NAMES".to_string(),
        &serde_json::json!({ "subject": pattern }),
    )
    .await?
    .map_err(|e| refused(&e))?;
    let mut streams = names.streams.unwrap_or_default();
    streams.sort();
    match streams.len() {
        0 => Err(NatsError::NoStreamFor(pattern.to_string())),
        1 => Ok(streams.remove(0)),
        _ => Err(NatsError::StreamAmbiguous {
            pattern: pattern.to_string(),
            streams,
        }),
    }
}

/// A consumer's info, or `None` when it (or its stream) does not exist.
pub async fn consumer_info(
    js: &jetstream::Context,
    stream: &str,
    name: &str,
) -> Result<Option<consumer::Info>, NatsError> {
    match call(
        js,
        format!("CONSUMER.INFO.{stream}.{name}"),
        &serde_json::json!({}),
    )
    .await?
    {
        Ok(info) => Ok(Some(info)),
        Err(e)
            if e.error_code() == ErrorCode::CONSUMER_NOT_FOUND
                || e.error_code() == ErrorCode::STREAM_NOT_FOUND =>
        {
            Ok(None)
        }
        Err(e) => Err(refused(&e)),
    }
}

/// The most consumers one listing reads (its pages are the server's, 256 consumers each): past
/// it, the rest of a stream's consumers are not listed (a caller asks those alone).
pub const MAX_LISTED: usize = 100_000;

#[derive(Deserialize)]
struct ConsumerPage {
    #[serde(default)]
    total: usize,
    #[serde(default)]
    consumers: Option<Vec<consumer::Info>>,
}

/// Each consumer of `stream` by name with its gauges (`num_pending`, `num_ack_pending`), in
/// pages of the server's size: one call reads 256 consumers, where asking each would cost a
/// call apiece. `None` when the stream does not exist.
pub async fn consumer_gauges(
    js: &jetstream::Context,
    stream: &str,
) -> Result<Option<std::collections::HashMap<String, (u64, u64)>>, NatsError> {
    let mut out = std::collections::HashMap::new();
    // Counted by what the pages held, not by the names kept: a consumer deleted between two
    // pages shifts the next one back, and a page of names already seen must not be asked again.
    let mut offset = 0;
    loop {
        let page: ConsumerPage = match call(
            js,
            format!("CONSUMER.LIST.{stream}"),
            &serde_json::json!({ "offset": offset }),
        )
        .await?
        {
            Ok(page) => page,
            Err(e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND => return Ok(None),
            Err(e) => return Err(refused(&e)),
        };
        let consumers = page.consumers.unwrap_or_default();
        let read = consumers.len();
        offset += read;
        for info in consumers {
            let ack_pending = u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX);
            out.insert(info.name, (info.num_pending, ack_pending));
        }
        if read == 0 || offset >= page.total || offset >= MAX_LISTED {
            return Ok(Some(out));
        }
    }
}

#[derive(Serialize)]
struct CreateRequest<'a> {
    stream_name: &'a str,
    config: serde_json::Value,
    action: &'a str,
}

async fn put(
    js: &jetstream::Context,
    c: &ConsumerConfig,
    action: &str,
    pause_until: Option<k8s_openapi::jiff::Timestamp>,
) -> Result<consumer::Info, NatsError> {
    let mut config = serde_json::to_value(c.to_server())
        .map_err(|e| NatsError::Unreachable(format!("cannot encode the consumer config: {e}")))?;
    if let (Some(t), Some(map)) = (pause_until, config.as_object_mut()) {
        // Honoured on a create only (an update ignores it: pause_consumer changes a pause).
        map.insert(
            "pause_until".into(),
            serde_json::Value::String(t.to_string()),
        );
    }
    let body = CreateRequest {
        stream_name: &c.stream,
        config,
        action,
    };
    call(
        js,
        format!("CONSUMER.CREATE.{}.{}", c.stream, c.name),
        &body,
    )
    .await?
    .map_err(|e| refused(&e))
}

/// Creates the consumer. Fails if one of that name exists with another config, and with
/// [`NatsError::Limit`] when a limit refuses it (which limit: [`consumer_limit`]).
pub async fn create_consumer(
    js: &jetstream::Context,
    c: &ConsumerConfig,
) -> Result<consumer::Info, NatsError> {
    create_consumer_paused(js, c, None).await
}

/// As [`create_consumer`], the consumer paused from its first moment until `pause_until` when
/// set (so a Subscription made paused never offers a message).
pub async fn create_consumer_paused(
    js: &jetstream::Context,
    c: &ConsumerConfig,
    pause_until: Option<k8s_openapi::jiff::Timestamp>,
) -> Result<consumer::Info, NatsError> {
    match put(js, c, "create", pause_until).await {
        Err(NatsError::Api { code, description }) => {
            Err(create_refusal(&c.stream, code, description))
        }
        other => other,
    }
}

#[derive(Deserialize)]
struct StreamLimits {
    config: StreamMax,
    #[serde(default)]
    state: StreamCount,
}

#[derive(Deserialize)]
struct StreamMax {
    #[serde(default)]
    max_consumers: i64,
}

#[derive(Default, Deserialize)]
struct StreamCount {
    #[serde(default)]
    consumer_count: i64,
}

#[derive(Deserialize)]
struct AccountLimits {
    #[serde(default)]
    limits: AccountMax,
}

#[derive(Default, Deserialize)]
struct AccountMax {
    #[serde(default)]
    max_consumers: i64,
}

/// Which limit refused a consumer on `stream` (error 10026): the stream's own `max_consumers`
/// when the stream holds that many, else the account's (one or two calls: STREAM.INFO, then
/// INFO).
pub async fn consumer_limit(
    js: &jetstream::Context,
    stream: &str,
) -> Result<BrokerLimit, NatsError> {
    let info: StreamLimits = call(js, format!("STREAM.INFO.{stream}"), &serde_json::json!({}))
        .await?
        .map_err(|e| refused(&e))?;
    let (own, count) = (info.config.max_consumers, info.state.consumer_count);
    if own > 0 && count >= own {
        return Ok(BrokerLimit::StreamConsumers {
            stream: stream.to_string(),
            max: Some(own),
            set_by: SetBy::Stream,
        });
    }
    let account: AccountLimits = call(js, "INFO".to_string(), &serde_json::json!({}))
        .await?
        .map_err(|e| refused(&e))?;
    let max = account.limits.max_consumers;
    Ok(BrokerLimit::StreamConsumers {
        stream: stream.to_string(),
        max: (max > 0).then_some(max),
        set_by: if max > 0 {
            SetBy::Account
        } else {
            SetBy::Unknown
        },
    })
}

/// Updates the consumer's editable fields in place. Fails if it does not exist.
pub async fn update_consumer(
    js: &jetstream::Context,
    c: &ConsumerConfig,
) -> Result<consumer::Info, NatsError> {
    put(js, c, "update", None).await
}

#[derive(Serialize)]
struct PauseRequest {
    #[serde(skip_serializing_if = "Option::is_none")]
    pause_until: Option<String>,
}

#[derive(Deserialize)]
struct PauseResponse {
    #[serde(default)]
    paused: bool,
    #[serde(default)]
    pause_until: Option<String>,
}

/// Pauses the consumer until `until` (`CONSUMER.PAUSE`, nats-server 2.11+), or resumes it
/// (`None`), and returns the pause the server now holds. The server ignores `pause_until` in a
/// consumer update, so this is the only way to change it (semantics W2).
pub async fn pause_consumer(
    js: &jetstream::Context,
    stream: &str,
    name: &str,
    until: Option<k8s_openapi::jiff::Timestamp>,
) -> Result<super::pause::LivePause, NatsError> {
    let body = PauseRequest {
        pause_until: until.map(|t| t.to_string()),
    };
    let r: PauseResponse = call(js, format!("CONSUMER.PAUSE.{stream}.{name}"), &body)
        .await?
        .map_err(|e| refused(&e))?;
    let until = r
        .pause_until
        .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
        .and_then(|t| k8s_openapi::jiff::Timestamp::from_second(t.as_second()).ok());
    Ok(super::pause::LivePause {
        paused: r.paused,
        until: until.filter(|_| r.paused),
    })
}

/// Deletes a consumer; `Ok(false)` when it (or its stream) did not exist.
pub async fn delete_consumer(
    js: &jetstream::Context,
    stream: &str,
    name: &str,
) -> Result<bool, NatsError> {
    match call::<serde_json::Value>(
        js,
        format!("CONSUMER.DELETE.{stream}.{name}"),
        &serde_json::json!({}),
    )
    .await?
    {
        Ok(_) => Ok(true),
        Err(e)
            if e.error_code() == ErrorCode::CONSUMER_NOT_FOUND
                || e.error_code() == ErrorCode::STREAM_NOT_FOUND =>
        {
            Ok(false)
        }
        Err(e) => Err(refused(&e)),
    }
}

/// Whether JetStream answers for this connection's account: `Err(JetStreamDisabled)` when the
/// server runs without it, `Err(Unreachable)` when nothing answers in time.
pub async fn account_info(js: &jetstream::Context) -> Result<(), NatsError> {
    call::<serde_json::Value>(js, "INFO".to_string(), &serde_json::json!({}))
        .await?
        .map(|_| ())
        .map_err(|e| refused(&e))
}
