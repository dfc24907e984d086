//! One NACK Consumer's fields, each mapped onto a Subscription field or flagged.
//!
//! What Settle can take over is fixed by its one mapping (`backend::nats::mapping::desired`):
//! a pull consumer with deliver policy `all`, replay `instant`, ack policy `explicit`
//! (AtLeastOnce) or `none` (AtMostOnce) and the server's `max_waiting`; JetStream cannot change
//! those in place, so a consumer that differs in one of them is a [`Severity::Change`] that says
//! what taking it over costs. What JetStream can change in place (ack wait, max deliver, max ack
//! pending, the filter, backoff, ...) is written so that Settle's first update changes nothing
//! that affects delivery, or flagged when it must.

use std::time::Duration as StdDuration;

use super::super::{Finding, Severity, SubscriptionPlan};
use super::{ConsumerSpec, DEFAULT_ACK_WAIT, Status};
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
    let mut refused = false;

    if stream.is_empty() {
        f.add(
            Severity::Refused,
            "spec.streamName",
            "not set: NACK made no consumer for it. Set streamName on the NACK Consumer, or write the Subscription by hand",
        );
        refused = true;
    } else if !valid_stream_name(&stream) {
        f.add(
            Severity::Refused,
            "spec.streamName",
            format!(
                "{stream:?} is not a stream name Settle can name (at most 255 characters, no whitespace, \
                 '.', '*', '>', '/' or '\\'): write the Subscription without spec.stream, by its pattern"
            ),
        );
        refused = true;
    }
    if durable.is_empty() {
        f.add(
            Severity::Refused,
            "spec.durableName",
            "not set: NACK made an ephemeral consumer, which has no position to keep. Write a new \
             Subscription with a durableName instead",
        );
        refused = true;
    } else if !valid_durable_name(&durable) {
        f.add(
            Severity::Refused,
            "spec.durableName",
            format!(
                "{durable:?}: a Settle durableName is at most 255 letters, digits, '_' and '-', and \
                 JetStream cannot rename a consumer. Make a new consumer with a Subscription of another \
                 durableName, and delete this one when it has drained"
            ),
        );
        refused = true;
    }

    let pattern = pattern(spec, stream_subjects, &mut f);
    refused |= pattern.is_none();

    // The fields JetStream cannot change in place: each must be what Settle's mapping makes.
    let deliver = spec.deliver_policy.as_deref().unwrap_or("all");
    if deliver != "all" {
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
                cannot_take_over(&stream, &durable)
            ),
        );
    }
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
                cannot_take_over(&stream, &durable)
            ),
        );
    } else if let Some(r) = spec.rate_limit_bps.filter(|r| *r > 0) {
        f.add(
            Severity::Change,
            "spec.rateLimitBps",
            format!("{r}: Settle sets no rate limit; its first update of the consumer clears it"),
        );
    }
    let replay = spec.replay_policy.as_deref().unwrap_or("instant");
    if replay != "instant" {
        f.add(
            Severity::Change,
            "spec.replayPolicy",
            format!(
                "{replay}: Settle's consumers replay instantly. {}",
                cannot_take_over(&stream, &durable)
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
                cannot_take_over(&stream, &durable)
            ),
        );
    }

    let ack = spec.ack_policy.as_deref().unwrap_or("none");
    let mode = match ack {
        "explicit" => Mode::AtLeastOnce,
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
            Mode::AtMostOnce
        }
        "all" => {
            f.add(
                Severity::Change,
                "spec.ackPolicy",
                format!(
                    "all: acknowledging one message acknowledges every earlier one; Settle \
                     acknowledges each message (mode: AtLeastOnce, ack policy explicit). {}",
                    cannot_take_over(&stream, &durable)
                ),
            );
            Mode::AtLeastOnce
        }
        other => {
            f.add(
                Severity::Refused,
                "spec.ackPolicy",
                format!("{other:?} is not one of NACK's ack policies (none, all, explicit)"),
            );
            refused = true;
            Mode::AtLeastOnce
        }
    };

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

    let deletion_policy = if spec.prevent_delete {
        f.add(
            Severity::Note,
            "spec.preventDelete",
            "true: written as deletionPolicy: Retain (deleting the Subscription leaves the consumer on the broker)",
        );
        DeletionPolicy::Retain
    } else {
        DeletionPolicy::Delete
    };

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

/// The fields that matter with acks (AtLeastOnce); false when one cannot be written at all.
fn acked_fields(spec: &ConsumerSpec, policy: &mut DeliveryPolicy, f: &mut Findings) -> bool {
    let text = spec.ack_wait.as_deref().unwrap_or(DEFAULT_ACK_WAIT);
    match go_duration(text) {
        Err(e) => {
            f.add(Severity::Refused, "spec.ackWait", e);
            return false;
        }
        Ok(d) if d.get() < UNSAFE_ACK_WAIT => {
            let default = if spec_default(&spec.ack_wait, DEFAULT_ACK_WAIT) {
                " (NACK's default: the NACK Consumer does not set ackWait)"
            } else {
                ""
            };
            f.add(
                Severity::Change,
                "spec.ackWait",
                format!(
                    "{text}{default} is unsafe: the server redelivers a message {text} after sending \
                     it unless it is acknowledged by then, so nearly every message is handed out again \
                     while its first handler still runs. Written without ackWait (Settle's default, \
                     30s), which Settle's first update sets on the consumer. To migrate without a \
                     change, set spec.ackWait on the NACK Consumer first"
                ),
            );
        }
        Ok(d) => policy.ack_wait = Some(d),
    }

    match spec.max_deliver {
        Some(n) if n >= 1 => policy.max_deliver = Some(n),
        Some(n) if n < -1 => {
            f.add(
                Severity::Refused,
                "spec.maxDeliver",
                format!("{n}: below -1, which NACK's CRD refuses"),
            );
            return false;
        }
        _ => f.add(
            Severity::Note,
            "spec.maxDeliver",
            "unlimited (NACK's default): a message no handler can process comes back forever and \
             holds a place in maxInFlight. Written as it is (maxDeliver unset); set spec.maxDeliver \
             on the Subscription to bound it (Settle counts the last declined attempt Exhausted)",
        ),
    }

    match spec.max_ack_pending {
        None | Some(0) => {
            policy.max_in_flight = Some(SERVER_MAX_ACK_PENDING);
            f.add(
                Severity::Note,
                "spec.maxAckPending",
                format!(
                    "not set: the server's default, {SERVER_MAX_ACK_PENDING}, written as maxInFlight: \
                     {SERVER_MAX_ACK_PENDING} (Settle's own default would be 250)"
                ),
            );
        }
        Some(n) if !(0..=MAX_IN_FLIGHT).contains(&n) => {
            policy.max_in_flight = Some(MAX_IN_FLIGHT as i32);
            f.add(
                Severity::Change,
                "spec.maxAckPending",
                format!(
                    "{n} ({}): Settle holds at most {MAX_IN_FLIGHT} unsettled deliveries; written as \
                     maxInFlight: {MAX_IN_FLIGHT}",
                    if n < 0 { "unlimited" } else { "above Settle's limit" }
                ),
            );
        }
        Some(n) => policy.max_in_flight = i32::try_from(n).ok(),
    }

    if !spec.backoff.is_empty() {
        let mut steps = Vec::new();
        for b in &spec.backoff {
            match go_duration(b) {
                Ok(d) if !d.is_zero() => steps.push(d.get()),
                Ok(_) => {
                    f.add(Severity::Refused, "spec.backoff", format!("{b}: zero"));
                    return false;
                }
                Err(e) => {
                    f.add(Severity::Refused, "spec.backoff", e);
                    return false;
                }
            }
        }
        let (backoff, exact) = schedule_of(&steps);
        let shown: Vec<&str> = spec.backoff.iter().map(String::as_str).collect();
        f.add(
            Severity::Change,
            "spec.backoff",
            format!(
                "[{}]: the server times the redeliveries of unacknowledged messages by this list. \
                 Settle keeps no list on the consumer (its first update clears it): its runtime \
                 delays each declined attempt, a nack or silence, by spec.backoff {{initial: {}, \
                 max: {}, multiplier: {}}}{}; a message whose handler died comes back after ackWait",
                shown.join(", "),
                backoff.initial,
                backoff.max,
                backoff.multiplier,
                if exact {
                    ", the same steps"
                } else {
                    ", the nearest geometric schedule (not the same steps)"
                }
            ),
        );
        policy.backoff = Some(backoff);
    }
    true
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

/// Without acks (AtMostOnce) the ack fields have no effect: said, not written.
fn unacked_fields(spec: &ConsumerSpec, f: &mut Findings) {
    let mut ignored = Vec::new();
    if let Some(w) = spec.ack_wait.as_deref().filter(|w| *w != DEFAULT_ACK_WAIT) {
        ignored.push(format!("ackWait {w}"));
    }
    if let Some(n) = spec.max_deliver.filter(|n| *n > 0) {
        ignored.push(format!("maxDeliver {n}"));
    }
    if !spec.backoff.is_empty() {
        ignored.push(format!("backoff {:?}", spec.backoff));
    }
    if let Some(n) = spec.max_ack_pending.filter(|n| *n != 0) {
        ignored.push(format!("maxAckPending {n}"));
    }
    if !ignored.is_empty() {
        f.add(
            Severity::Note,
            "spec.ackPolicy",
            format!(
                "none, so {} had no effect (nothing is acknowledged); not written",
                ignored.join(", ")
            ),
        );
    }
}

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
