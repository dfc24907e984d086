//! Where the account reads and keeps its facts on a NATS server: the stream that captures the
//! delivery advisories (the broker emits them once, to whoever listens at that instant, so a
//! stream listens for the operator and keeps them while it is down or changing leader), a
//! durable consumer per Backend that is the operator's checkpoint in it, the runtime's report
//! bucket, and the bucket the account persists each Subscription's ledger in.
//!
//! Broker I/O only. It must not count anything (that is `account`).

use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, stream};

use super::admin::NatsError;
use super::advisory::DELIVERY_SUBJECTS;
use crate::bus::report::{REPORT_BUCKET, REPORT_BUCKET_MAX_BYTES, REPORT_BUCKET_MAX_VALUE_BYTES};

/// The stream capturing delivery advisories for every Backend on this server.
pub const CAPTURE_STREAM: &str = "SETTLE_ADVISORIES";
/// How long a captured advisory is kept unread (an operator down longer than this loses them).
pub const CAPTURE_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
/// How many advisories the capture keeps at most (the oldest go first).
pub const CAPTURE_MAX_MESSAGES: i64 = 5_000_000;
/// How long an advisory delivered to the account's reader waits for its acknowledgement before
/// it comes again: the account acknowledges within a round (half a second) of saving it, and
/// declines what a broken session held; one that was on its way when the session broke (in the
/// client's buffer, never seen) comes again after this.
pub const READER_ACK_WAIT: Duration = Duration::from_secs(30);
/// The bucket of persisted ledgers: `<namespace>.<subscription>` → JSON.
pub const ACCOUNT_BUCKET: &str = "settle-account";

fn unreachable(what: &str, e: impl std::fmt::Display) -> NatsError {
    NatsError::Unreachable(format!("{what}: {e}"))
}

/// The capture stream (made at `replicas`, or brought up to date, at most `max_bytes` on the
/// server) and this Backend's durable reader of it. `reader` must be unique per Backend: two Backends on one
/// server each read every advisory. The capture keeps an advisory for at most
/// [`CAPTURE_MAX_AGE`], [`CAPTURE_MAX_MESSAGES`] and `max_bytes`, whichever is reached first;
/// a reader that falls behind those sees a gap in the capture's sequence (the account says so).
pub async fn open(
    js: &jetstream::Context,
    reader: &str,
    max_bytes: i64,
    replicas: usize,
) -> Result<consumer::PullConsumer, NatsError> {
    let config = stream::Config {
        name: CAPTURE_STREAM.to_string(),
        description: Some(
            "Settle: delivery advisories (max deliveries, terminated, nacked, consumer created/deleted) kept for the operator's account".into(),
        ),
        subjects: DELIVERY_SUBJECTS.iter().map(|s| s.to_string()).collect(),
        max_age: CAPTURE_MAX_AGE,
        max_messages: CAPTURE_MAX_MESSAGES,
        max_bytes,
        storage: stream::StorageType::File,
        // Made at its replicas at once: one made at one and raised has a window in which its
        // leader's loss leaves the copies still catching up unable to elect another.
        num_replicas: replicas.max(1),
        ..Default::default()
    };
    let stream = match js.get_stream(CAPTURE_STREAM).await {
        Ok(mut s) => {
            let info = s
                .info()
                .await
                .map_err(|e| unreachable("reading the capture stream", e))?;
            if info.config.subjects != config.subjects
                || info.config.max_bytes != config.max_bytes
                || info.config.max_messages != config.max_messages
            {
                // Its replicas kept: a config without them would scale a clustered capture to
                // one (`replicate` sets them).
                let config = stream::Config {
                    num_replicas: info.config.num_replicas,
                    ..config
                };
                js.update_stream(&config)
                    .await
                    .map_err(|e| unreachable("updating the capture stream", e))?;
            }
            s
        }
        Err(_) => js
            .get_or_create_stream(config)
            .await
            .map_err(|e| unreachable("creating the capture stream", e))?,
    };
    let mut reader: consumer::PullConsumer = stream
        .get_or_create_consumer(reader, reader_config(reader, consumer::DeliverPolicy::All))
        .await
        .map_err(|e| unreachable("creating the account's reader of the capture stream", e))?;
    // A reader made by an earlier version waited 120 s: brought to this one in place (its
    // position and deliver policy kept).
    let config = reader.cached_info().config.clone();
    if config.ack_wait != READER_ACK_WAIT {
        stream
            .update_consumer(consumer::Config {
                ack_wait: READER_ACK_WAIT,
                ..config
            })
            .await
            .map_err(|e| unreachable("updating the account's reader of the capture stream", e))?;
        reader
            .info()
            .await
            .map_err(|e| unreachable("reading the account's reader of the capture stream", e))?;
    }
    Ok(reader)
}

/// Brings the capture stream and the account's buckets (`settle-account`, `settle-stats`) that
/// exist to `replicas` in place (a JetStream cluster moves or copies their data; the reader
/// consumer follows its stream). A stream missing is left to whoever makes it.
pub async fn replicate(js: &jetstream::Context, replicas: usize) -> Result<(), NatsError> {
    for name in [
        CAPTURE_STREAM.to_string(),
        format!("KV_{ACCOUNT_BUCKET}"),
        format!("KV_{REPORT_BUCKET}"),
    ] {
        let Ok(mut stream) = js.get_stream(&name).await else {
            continue;
        };
        let info = stream
            .info()
            .await
            .map_err(|e| unreachable(&format!("reading stream {name}"), e))?;
        // Zero is how a config made without replicas reads: one.
        if info.config.num_replicas.max(1) == replicas {
            continue;
        }
        let config = stream::Config {
            num_replicas: replicas,
            ..info.config.clone()
        };
        js.update_stream(&config)
            .await
            .map_err(|e| unreachable(&format!("setting the replicas of stream {name}"), e))?;
        tracing::info!(stream = %name, from = info.config.num_replicas, to = replicas, "brought the account's stream to its replicas");
    }
    Ok(())
}

/// A durable reader of the capture, delivering from `from`.
fn reader_config(reader: &str, from: consumer::DeliverPolicy) -> consumer::pull::Config {
    consumer::pull::Config {
        durable_name: Some(reader.to_string()),
        description: Some("Settle: the account's checkpoint in the advisory capture".into()),
        ack_policy: consumer::AckPolicy::Explicit,
        deliver_policy: from,
        ack_wait: READER_ACK_WAIT,
        max_ack_pending: 50_000,
        ..Default::default()
    }
}

/// Takes a Backend's checkpoint in the capture over from the reader named `old` to `new` (a
/// name changed by an upgrade): when `new` does not exist yet, it is made to deliver from just
/// after what `old` acknowledged (what `old` had delivered unacknowledged comes again: those
/// advisories were not in a saved ledger, or are skipped by the ledger's capture sequence).
/// `old` is left for [`drop_reader`]: two Backends whose legacy names were alike shared it, and
/// each takes its copy. The capture keeps advisories by its limits, not by its readers'
/// interest, so a reader deleted drops none. The leader Lease keeps an operator of the former
/// version from reading meanwhile.
pub async fn take_over_reader(
    js: &jetstream::Context,
    old: &str,
    new: &str,
) -> Result<(), NatsError> {
    if old == new {
        return Ok(());
    }
    let Ok(stream) = js.get_stream(CAPTURE_STREAM).await else {
        // No capture yet: no reader to take over.
        return Ok(());
    };
    let Ok(mut former) = stream.get_consumer::<consumer::pull::Config>(old).await else {
        return Ok(());
    };
    if stream
        .get_consumer::<consumer::pull::Config>(new)
        .await
        .is_ok()
    {
        return Ok(());
    }
    let acked = former
        .info()
        .await
        .map_err(|e| unreachable("reading the account's former reader of the capture", e))?
        .ack_floor
        .stream_sequence;
    stream
        .create_consumer(reader_config(
            new,
            consumer::DeliverPolicy::ByStartSequence {
                start_sequence: acked.saturating_add(1),
            },
        ))
        .await
        .map_err(|e| unreachable("creating the account's reader of the capture stream", e))?;
    tracing::info!(from = %old, to = %new, after = acked, "the account's reader of the capture has a new name: it continues after what the former one acknowledged");
    Ok(())
}

/// Deletes the capture reader `name` if it exists (a former name once taken over, or a deleted
/// Backend's).
pub async fn drop_reader(js: &jetstream::Context, name: &str) -> Result<(), NatsError> {
    let Ok(stream) = js.get_stream(CAPTURE_STREAM).await else {
        return Ok(());
    };
    if stream.consumer_info(name).await.is_err() {
        return Ok(());
    }
    stream
        .delete_consumer(name)
        .await
        .map_err(|e| unreachable("deleting a reader of the capture", e))?;
    tracing::info!(reader = %name, "deleted a reader of the capture");
    Ok(())
}

/// The report bucket's size bounds (the operator's `--report-bucket-max-value-bytes` and
/// `--report-bucket-max-bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketLimits {
    /// The largest value the broker takes (a larger put is refused by the broker).
    pub max_value_bytes: i32,
    /// The most bytes the bucket holds (beyond, the broker refuses new values).
    pub max_bytes: i64,
}

impl Default for BucketLimits {
    fn default() -> Self {
        BucketLimits {
            max_value_bytes: REPORT_BUCKET_MAX_VALUE_BYTES,
            max_bytes: REPORT_BUCKET_MAX_BYTES,
        }
    }
}

/// A KV bucket, made if missing (history 1, at `replicas`); with `limits`, made with them, or
/// brought to them when it was made otherwise (by an older runtime or operator, or with other
/// flags). Replicas of a bucket that exists are [`replicate`]'s.
pub async fn bucket(
    js: &jetstream::Context,
    name: &str,
    description: &str,
    limits: Option<BucketLimits>,
    replicas: usize,
) -> Result<kv::Store, NatsError> {
    if let Ok(s) = js.get_key_value(name).await {
        if let Some(limits) = limits {
            bring_to(js, name, limits).await?;
        }
        return Ok(s);
    }
    let (max_value_size, max_bytes) = limits.map_or((-1, -1), |l| (l.max_value_bytes, l.max_bytes));
    match js
        .create_key_value(kv::Config {
            bucket: name.to_string(),
            description: description.to_string(),
            history: 1,
            max_value_size,
            max_bytes,
            num_replicas: replicas.max(1),
            ..Default::default()
        })
        .await
    {
        Ok(s) => Ok(s),
        // Made meanwhile by someone else (a runtime, with its own defaults): brought to
        // `limits` all the same.
        Err(e) => {
            let s = js
                .get_key_value(name)
                .await
                .map_err(|_| unreachable(&format!("creating KV bucket {name}"), e))?;
            if let Some(limits) = limits {
                bring_to(js, name, limits).await?;
            }
            Ok(s)
        }
    }
}

/// A bucket's stream brought to `limits` (an update in place: both bounds can change).
async fn bring_to(
    js: &jetstream::Context,
    name: &str,
    limits: BucketLimits,
) -> Result<(), NatsError> {
    let stream_name = format!("KV_{name}");
    let mut stream = js
        .get_stream(&stream_name)
        .await
        .map_err(|e| unreachable(&format!("opening the stream of bucket {name}"), e))?;
    let info = stream
        .info()
        .await
        .map_err(|e| unreachable(&format!("reading the stream of bucket {name}"), e))?;
    let mut config = info.config.clone();
    if config.max_message_size == limits.max_value_bytes && config.max_bytes == limits.max_bytes {
        return Ok(());
    }
    tracing::info!(
        bucket = name,
        from_max_value_bytes = config.max_message_size,
        from_max_bytes = config.max_bytes,
        max_value_bytes = limits.max_value_bytes,
        max_bytes = limits.max_bytes,
        "bringing the report bucket to its size bounds"
    );
    config.max_message_size = limits.max_value_bytes;
    config.max_bytes = limits.max_bytes;
    js.update_stream(&config)
        .await
        .map_err(|e| unreachable(&format!("bounding bucket {name}"), e))?;
    Ok(())
}

/// The runtime's report bucket, made (at `replicas`) or brought to `limits`.
pub async fn reports(
    js: &jetstream::Context,
    limits: BucketLimits,
    replicas: usize,
) -> Result<kv::Store, NatsError> {
    bucket(
        js,
        REPORT_BUCKET,
        "Settle runtime stats reports: <namespace>.<subscription>.<instance> -> JSON (docs/stats-report.md)",
        Some(limits),
        replicas,
    )
    .await
}

/// The account's ledger bucket, made at `replicas` if missing.
pub async fn ledgers(js: &jetstream::Context, replicas: usize) -> Result<kv::Store, NatsError> {
    bucket(
        js,
        ACCOUNT_BUCKET,
        "Settle operator: each Subscription's persisted ledger (folded instances, the broker's tally)",
        None,
        replicas,
    )
    .await
}

/// Removes one stored report, by its key and the revision it was read at (a purge checked
/// against that revision, so a newer report of the same key is never removed): a folded
/// instance's report, whose counters the ledger now holds, or a report of a Subscription object
/// that is gone. The bucket keeps a purge marker of a few bytes in its place (a KV bucket
/// denies deleting its messages outright).
pub async fn drop_report(
    js: &jetstream::Context,
    key: &str,
    revision: u64,
) -> Result<(), NatsError> {
    let reports = js
        .get_key_value(REPORT_BUCKET)
        .await
        .map_err(|e| unreachable("opening the report bucket", e))?;
    reports
        .purge_expect_revision(key, Some(revision))
        .await
        .map_err(|e| unreachable("removing a report", e))
}
