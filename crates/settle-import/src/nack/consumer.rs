//! One NACK Consumer's fields, each mapped onto a Subscription field or flagged.
//!
//! What Settle can take over is fixed by its one mapping (`backend::nats::mapping::desired`):
//! a pull consumer with deliver policy `all`, replay `instant`, ack policy `explicit`
//! (AtLeastOnce) or `none` (AtMostOnce) and the server's `max_waiting`; JetStream cannot change
//! those in place, so a consumer that differs in one of them is a [`Severity::Change`] that says
//! what taking it over costs. What JetStream can change in place (ack wait, max deliver, max ack
//! pending, the filter, backoff, ...) is written so that Settle's first update changes nothing
//! that affects delivery, or flagged when it must; the ack fields are mapped in [`acks`].

mod acks;

use std::time::Duration as StdDuration;

use super::super::{Finding, Severity, SubscriptionPlan};
use super::{ConsumerSpec, Status};
use acks::{acked_fields, unacked_fields};
use settle::api::{
    Adopt, BackendRef, Backoff, DeletionPolicy, DeliveryPolicy, Duration, Mode, SubscriptionSpec,
};
use settle::policy::schedule_delay;

/// JetStream's `max_ack_pending` when a consumer with acks does not set it (nats-server 2.10+).
pub const SERVER_MAX_ACK_PENDING: i32 = 1000;
/// JetStream's `max_waiting` for a pull consumer that does not set it; Settle's too.
const SERVER_MAX_WAITING: i64 = 512;
/// The most `maxInFlight` Settle admits (its CRD's maximum).
const MAX_IN_FLIGHT: i64 = 1_000_000;
/// An ack wait shorter than this hands a message out again while its handler still runs.
const UNSAFE_ACK_WAIT: StdDuration = StdDuration::from_secs(1);

struct Findings(Vec<Finding>);

impl Findings {
    fn add(&mut self, severity: Severity, field: &str, message: impl Into<String>) {
        self.0.push(Finding {
            severity,
            field: field.to_string(),
            message: message.into(),
        });
    }
}

/// A Go duration (`1ns`, `30s`, `1m30s`, `1.5s`, `10µs`) as Settle's.
pub fn go_duration(text: &str) -> Result<Duration, String> {
    text.replace(['µ', 'μ'], "u")
        .parse::<Duration>()
        .map_err(|e| e.to_string())
}

/// What taking over a consumer that differs where JetStream cannot change it costs, and how.
fn cannot_take_over(stream: &str, durable: &str) -> String {
    format!(
        "JetStream cannot change this in place, so Settle cannot take the consumer over: the \
         Subscription stays Ready=False ConsumerConflict (naming the field) until you delete the \
         consumer (nats consumer rm {stream} {durable}); Settle then makes a new one, which starts \
         at the stream's first message: the consumer's position and its unacknowledged messages \
         are not kept. To keep them, leave this consumer with NACK"
    )
}

/// The Subscription for NACK Consumer `namespace/name` (its spec with NACK's defaults applied),
/// with every finding; `stream_subjects` are the subjects of its Stream, when the input has it.
/// The Backend is filled in by the caller.
pub fn plan(
    namespace: &str,
    name: &str,
    spec: &ConsumerSpec,
    stream_subjects: Option<&[String]>,
) -> SubscriptionPlan {
    let mut f = Findings(Vec::new());
    let stream = spec.stream_name.clone().unwrap_or_default();
    let durable = spec.durable_name.clone().unwrap_or_default();
    let consumer = format!("{stream}/{durable}");
    let mut refused = !names_valid(&stream, &durable, &mut f);

    let pattern = pattern(spec, stream_subjects, &mut f);
    refused |= pattern.is_none();

    fixed_fields(spec, &stream, &durable, &mut f);
    let (mode, ack_refused) = mode(spec, &stream, &durable, &mut f);
    refused |= ack_refused;

    let mut policy = DeliveryPolicy {
        pattern: pattern.unwrap_or_default(),
        mode,
        durable_name: Some(durable.clone()),
        ..DeliveryPolicy::default()
    };
    match mode {
        Mode::AtLeastOnce => refused |= !acked_fields(spec, &mut policy, &mut f),
        Mode::AtMostOnce => unacked_fields(spec, &mut f),
    }
    other_fields(spec, &mut f);
    let deletion_policy = deletion_policy(spec, &mut f);

    SubscriptionPlan {
        namespace: namespace.to_string(),
        name: name.to_string(),
        consumer,
        spec: (!refused).then(|| SubscriptionSpec {
            backend_ref: BackendRef::default(),
            stream: Some(stream),
            deletion_policy,
            // Take over the consumer NACK made when it matches, keeping its position.
            adopt: Adopt::IfCompatible,
            paused: false,
            paused_until: None,
            policy,
        }),
        findings: f.0,
    }
}

/// `streamName` and `durableName`, which Settle names the consumer by; false when either is
/// missing or not a name Settle can write.
fn names_valid(stream: &str, durable: &str, f: &mut Findings) -> bool {
    let mut valid = true;
    if stream.is_empty() {
        f.add(
            Severity::Refused,
            "spec.streamName",
            "not set: NACK made no consumer for it. Set streamName on the NACK Consumer, or write the Subscription by hand",
        );
        valid = false;
    } else if !valid_stream_name(stream) {
        f.add(
            Severity::Refused,
            "spec.streamName",
            format!(
                "{stream:?} is not a stream name Settle can name (at most 255 characters, no whitespace, \
                 '.', '*', '>', '/' or '\\'): write the Subscription without spec.stream, by its pattern"
            ),
        );
        valid = false;
    }
    if durable.is_empty() {
        f.add(
            Severity::Refused,
            "spec.durableName",
            "not set: NACK made an ephemeral consumer, which has no position to keep. Write a new \
             Subscription with a durableName instead",
        );
        valid = false;
    } else if !valid_durable_name(durable) {
        f.add(
            Severity::Refused,
            "spec.durableName",
            format!(
                "{durable:?}: a Settle durableName is at most 255 letters, digits, '_' and '-', and \
                 JetStream cannot rename a consumer. Make a new consumer with a Subscription of another \
                 durableName, and delete this one when it has drained"
            ),
        );
        valid = false;
    }
    valid
}

/// The fields JetStream cannot change in place: each must be what Settle's mapping makes.
fn fixed_fields(spec: &ConsumerSpec, stream: &str, durable: &str, f: &mut Findings) {
    deliver_policy(spec, stream, durable, f);
    push_fields(spec, stream, durable, f);
    let replay = spec.replay_policy.as_deref().unwrap_or("instant");
    if replay != "instant" {
        f.add(
            Severity::Change,
            "spec.replayPolicy",
            format!(
                "{replay}: Settle's consumers replay instantly. {}",
                cannot_take_over(stream, durable)
            ),
        );
    }
    if let Some(w) = spec
        .max_waiting
        .filter(|w| *w != 0 && *w != SERVER_MAX_WAITING)
    {
        f.add(
            Severity::Change,
            "spec.maxWaiting",
            format!(
                "{w}: Settle's consumers keep the server's {SERVER_MAX_WAITING}. {}",
                cannot_take_over(stream, durable)
            ),
        );
    }
}

/// `deliverPolicy` (with its start): Settle's consumers deliver `all`.
fn deliver_policy(spec: &ConsumerSpec, stream: &str, durable: &str, f: &mut Findings) {
    let deliver = spec.deliver_policy.as_deref().unwrap_or("all");
    if deliver == "all" {
        return;
    }
    let start = match deliver {
        "byStartSequence" => format!(" (optStartSeq {})", spec.opt_start_seq.unwrap_or(0)),
        "byStartTime" => format!(
            " (optStartTime {})",
            spec.opt_start_time.as_deref().unwrap_or("unset")
        ),
        _ => String::new(),
    };
    f.add(
        Severity::Change,
        "spec.deliverPolicy",
        format!(
            "{deliver}{start}: Settle makes every named consumer with deliver policy all. {}",
            cannot_take_over(stream, durable)
        ),
    );
}

/// A push consumer's fields (Settle's are pull consumers), or a pull consumer's rate limit.
fn push_fields(spec: &ConsumerSpec, stream: &str, durable: &str, f: &mut Findings) {
    if let Some(subject) = &spec.deliver_subject {
        let mut push = vec![format!("deliverSubject {subject:?}")];
        if let Some(g) = &spec.deliver_group {
            push.push(format!("deliverGroup {g:?}"));
        }
        if spec.flow_control {
            push.push("flowControl".into());
        }
        if let Some(h) = &spec.heartbeat_interval {
            push.push(format!("heartbeatInterval {h}"));
        }
        if let Some(r) = spec.rate_limit_bps.filter(|r| *r > 0) {
            push.push(format!("rateLimitBps {r}"));
        }
        f.add(
            Severity::Change,
            "spec.deliverSubject",
            format!(
                "a push consumer ({}); Settle's consumers are pull consumers, which its runtime \
                 fetches from. {}",
                push.join(", "),
                cannot_take_over(stream, durable)
            ),
        );
    } else if let Some(r) = spec.rate_limit_bps.filter(|r| *r > 0) {
        f.add(
            Severity::Change,
            "spec.rateLimitBps",
            format!("{r}: Settle sets no rate limit; its first update of the consumer clears it"),
        );
    }
}

/// The Subscription's mode from `ackPolicy`, and whether the policy is refused.
fn mode(spec: &ConsumerSpec, stream: &str, durable: &str, f: &mut Findings) -> (Mode, bool) {
    match spec.ack_policy.as_deref().unwrap_or("none") {
        "explicit" => (Mode::AtLeastOnce, false),
        "none" => {
            f.add(
                Severity::Unsafe,
                "spec.ackPolicy",
                format!(
                    "none{}: the server forgets each message as it sends it, so a handler that fails \
                     or a pod that dies loses it, and nothing is redelivered. Carried over as mode: \
                     AtMostOnce (Settle counts every settlement and acts on none). For redelivery, \
                     make a new consumer: a Subscription with mode: AtLeastOnce and another \
                     durableName (JetStream cannot change a consumer's ack policy in place), and \
                     delete this one when it has drained",
                    if spec_default(&spec.ack_policy, "none") {
                        " (NACK's default: the NACK Consumer does not set ackPolicy)"
                    } else {
                        ""
                    }
                ),
            );
            (Mode::AtMostOnce, false)
        }
        "all" => {
            f.add(
                Severity::Change,
                "spec.ackPolicy",
                format!(
                    "all: acknowledging one message acknowledges every earlier one; Settle \
                     acknowledges each message (mode: AtLeastOnce, ack policy explicit). {}",
                    cannot_take_over(stream, durable)
                ),
            );
            (Mode::AtLeastOnce, false)
        }
        other => {
            f.add(
                Severity::Refused,
                "spec.ackPolicy",
                format!("{other:?} is not one of NACK's ack policies (none, all, explicit)"),
            );
            (Mode::AtLeastOnce, true)
        }
    }
}

/// `preventDelete` as the Subscription's deletion policy.
fn deletion_policy(spec: &ConsumerSpec, f: &mut Findings) -> DeletionPolicy {
    if spec.prevent_delete {
        f.add(
            Severity::Note,
            "spec.preventDelete",
            "true: written as deletionPolicy: Retain (deleting the Subscription leaves the consumer on the broker)",
        );
        DeletionPolicy::Retain
    } else {
        DeletionPolicy::Delete
    }
}

/// Whether the NACK Consumer left `field` to the CRD's default `default`.
fn spec_default(field: &Option<String>, default: &str) -> bool {
    field.as_deref().is_none_or(|v| v == default)
}

/// `spec.pattern` from the filter, or from the Stream's subjects when there is no filter.
fn pattern(spec: &ConsumerSpec, subjects: Option<&[String]>, f: &mut Findings) -> Option<String> {
    match (&spec.filter_subject, spec.filter_subjects.as_slice()) {
        (Some(_), [_, ..]) => {
            f.add(
                Severity::Refused,
                "spec.filterSubjects",
                "set beside filterSubject: NACK refuses both, so it made no consumer for this resource",
            );
            None
        }
        (Some(s), []) => Some(s.clone()),
        (None, [one]) => {
            f.add(
                Severity::Note,
                "spec.filterSubjects",
                format!("one subject, written as pattern {one:?} (the same messages)"),
            );
            Some(one.clone())
        }
        (None, [_, _, ..]) => {
            f.add(
                Severity::Refused,
                "spec.filterSubjects",
                format!(
                    "{:?}: a Subscription has one pattern. Make one Subscription per subject (new \
                     consumers, other durableNames), or keep this consumer with NACK",
                    spec.filter_subjects
                ),
            );
            None
        }
        (None, []) => match subjects {
            Some([one]) => {
                f.add(
                    Severity::Note,
                    "spec.filterSubject",
                    format!(
                        "not set: the consumer takes the whole stream, whose one subject is {one:?}; \
                         written as that pattern, which Settle sets as the consumer's filter in place \
                         (the same messages)"
                    ),
                );
                Some(one.clone())
            }
            Some(_) => {
                f.add(
                    Severity::Note,
                    "spec.filterSubject",
                    "not set: the consumer takes the whole stream; written as pattern \">\" (every \
                     subject of the stream), which Settle sets as the consumer's filter in place",
                );
                Some(">".to_string())
            }
            None => {
                f.add(
                    Severity::Refused,
                    "spec.filterSubject",
                    "not set, and the input has no NACK Stream of this streamName to read its \
                     subjects from: add the Stream resource to the input (or use --from-cluster), or \
                     set filterSubject on the NACK Consumer",
                );
                None
            }
        },
    }
}

/// The nearest Settle schedule to a list of delays, and whether it gives the same steps (the
/// server repeats the last step, as Settle's `max` does).
pub fn schedule_of(steps: &[StdDuration]) -> (Backoff, bool) {
    let initial = steps[0];
    let max = steps.iter().copied().max().unwrap_or(initial);
    let multiplier = if steps.len() >= 2 && !initial.is_zero() {
        (steps[1].as_secs_f64() / initial.as_secs_f64()).max(1.0)
    } else {
        1.0
    };
    // Two decimals, as a person would write it.
    let multiplier = (multiplier * 100.0).round() / 100.0;
    let exact = steps.iter().enumerate().all(|(i, s)| {
        let d = schedule_delay(initial, max, multiplier, i as u32 + 1);
        d.abs_diff(*s) <= StdDuration::from_millis(1)
    });
    (
        Backoff {
            initial: Duration(initial),
            max: Duration(max),
            multiplier,
        },
        exact,
    )
}

// Long on purpose: a table, one independent row per field read top to bottom; split, it would only scatter.
/// The fields that do not decide which messages are delivered when.
fn other_fields(spec: &ConsumerSpec, f: &mut Findings) {
    if spec.headers_only {
        f.add(
            Severity::Change,
            "spec.headersOnly",
            "true: Settle delivers whole messages; its first update of the consumer turns headers-only \
             off, so handlers receive the bodies",
        );
    }
    if let Some(r) = spec.replicas.filter(|r| *r > 0) {
        f.add(
            Severity::Change,
            "spec.replicas",
            format!(
                "{r}: Settle's consumers have the stream's replica count; its first update asks for it"
            ),
        );
    }
    if spec.mem_storage {
        f.add(
            Severity::Change,
            "spec.memStorage",
            "true: Settle's consumers keep their state in the stream's storage; its first update asks \
             for that, which the server may refuse (the Subscription is then not Ready, with the \
             server's words)",
        );
    }
    if let Some(s) = &spec.sample_freq {
        f.add(
            Severity::Note,
            "spec.sampleFreq",
            format!(
                "{s}: ack sampling advisories are not kept (Settle's first update turns them off); \
                 Settle's account counts every delivery in status instead"
            ),
        );
    }
    let mut pulls = Vec::new();
    if let Some(n) = spec.max_request_batch.filter(|n| *n > 0) {
        pulls.push(format!("maxRequestBatch {n}"));
    }
    if let Some(d) = &spec.max_request_expires {
        pulls.push(format!("maxRequestExpires {d}"));
    }
    if let Some(n) = spec.max_request_max_bytes.filter(|n| *n > 0) {
        pulls.push(format!("maxRequestMaxBytes {n}"));
    }
    if !pulls.is_empty() {
        f.add(
            Severity::Note,
            "spec.maxRequestBatch",
            format!(
                "{}: Settle's runtime sizes its own pulls (at most maxInFlight); its first update \
                 clears the limit",
                pulls.join(", ")
            ),
        );
    }
    if let Some(d) = &spec.description {
        f.add(
            Severity::Note,
            "spec.description",
            format!("{d:?}: replaced by Settle's own (settle subscription NAMESPACE/NAME)"),
        );
    }
    if !spec.metadata.is_empty() {
        let keys: Vec<&str> = spec.metadata.keys().map(String::as_str).collect();
        f.add(
            Severity::Note,
            "spec.metadata",
            format!(
                "{}: replaced by Settle's own marks (settle.dev/subscription, settle.dev/uid); put \
                 them on the Subscription as labels or annotations if you need them",
                keys.join(", ")
            ),
        );
    }
    if spec.prevent_update {
        f.add(
            Severity::Note,
            "spec.preventUpdate",
            "true: no equivalent; Settle brings a consumer that drifted back to its Subscription",
        );
    }
}

/// What NACK's own status says, when the consumer may not be what the spec asks.
pub fn status_findings(plan: &mut SubscriptionPlan, status: &Status) {
    if let Some(ready) = status.conditions.iter().find(|c| c.type_ == "Ready")
        && ready.status != "True"
    {
        plan.findings.push(Finding {
            severity: Severity::Note,
            field: "status.conditions".into(),
            message: format!(
                "NACK reports Ready={} ({}: {}): the consumer may not exist or may differ from the \
                 spec; Settle takes it over only if it matches, and makes it when it is missing \
                 (from the stream's first message)",
                ready.status, ready.reason, ready.message
            ),
        });
    }
}

fn valid_durable_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn valid_stream_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && !s
            .chars()
            .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\'))
}
