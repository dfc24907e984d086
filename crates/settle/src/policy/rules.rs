//! The admission rules: `validate(spec, old, backend) -> Verdict`, and `unchanged`, the rule (A14)
//! that lets an update which leaves the spec as it was through without judging it again.
//!
//! One pure function serves the webhook, `settle check`, the controller (which re-checks before
//! it touches a broker) and the handler runtime (`validate_runtime`, when a subscription is
//! added). It must stay pure: no I/O, no clock, no Kubernetes client. Every error names the field
//! and the fix.

use std::fmt;

use super::{DEFAULT_MAX_PROCESSING_TIME, Schedule};
use crate::api::{
    AckTimeout, Capabilities, DeliveryPolicy, Duration, Mode, SlowHandler, SubscriptionSpec,
};

/// What admission concluded: errors refuse the spec; warnings admit it and are shown to the user.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub errors: Vec<FieldIssue>,
    pub warnings: Vec<FieldIssue>,
}

/// One finding about one field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldIssue {
    /// The field's path, e.g. `spec.durableName`.
    pub field: String,
    /// What is wrong and what to do instead.
    pub message: String,
}

impl fmt::Display for FieldIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl Verdict {
    pub fn allowed(&self) -> bool {
        self.errors.is_empty()
    }

    pub(super) fn error(&mut self, field: &str, message: impl Into<String>) {
        self.errors.push(FieldIssue {
            field: field.to_string(),
            message: message.into(),
        });
    }

    pub(super) fn warn(&mut self, field: &str, message: impl Into<String>) {
        self.warnings.push(FieldIssue {
            field: field.to_string(),
            message: message.into(),
        });
    }

    /// All errors in one line, as the webhook and the CLI print them.
    pub fn error_text(&self) -> String {
        self.errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// The Backend a Subscription refers to, as far as admission knows it.
#[derive(Clone, Copy, Debug)]
pub enum BackendView<'a> {
    /// The Backend exists; these are its capabilities (from its status, or from its kind).
    Known {
        name: &'a str,
        capabilities: &'a Capabilities,
    },
    /// No Backend of that name exists yet: admit, warn, and let the controller report it (A8).
    Missing { name: &'a str },
}

/// The admission rules (docs/semantics.md A1–A15) for a Subscription create (`old` is `None`) or
/// update (`old` is the stored spec).
pub fn validate(
    spec: &SubscriptionSpec,
    old: Option<&SubscriptionSpec>,
    backend: BackendView<'_>,
) -> Verdict {
    let mut v = Verdict::default();
    // A14: an update that leaves the spec as it was asks nothing new of the broker.
    if unchanged(spec, old) {
        return v;
    }
    match backend {
        BackendView::Known { capabilities, .. } => {
            policy_rules(&mut v, &spec.policy, Some(capabilities));
            stream_rules(&mut v, spec.stream.as_deref(), capabilities);
        }
        BackendView::Missing { name } => {
            policy_rules(&mut v, &spec.policy, None);
            v.warn(
                "spec.backendRef.name",
                format!(
                    "Backend {name:?} does not exist in this namespace yet; the Subscription is admitted, \
                     its capability checks run when the Backend exists, and until then it is not Ready"
                ),
            );
        }
    }
    pause_rules(&mut v, spec);
    if let Some(old) = old {
        immutable_rules(&mut v, spec, old);
        if let BackendView::Known { capabilities, .. } = backend {
            fixed_on_backend(&mut v, spec, old, capabilities);
        }
    }
    v
}

/// A23: `pausedUntil` says until when a pause lasts, so it needs `paused: true`. Alone it would
/// read as "paused until then" to one person and "resumes then" to another, and pause nothing:
/// refused. A time already passed is not refused (every pause with a time passes it, and the
/// rules have no clock): it means resumed.
fn pause_rules(v: &mut Verdict, spec: &SubscriptionSpec) {
    if !spec.paused
        && let Some(until) = &spec.paused_until
    {
        v.error(
            "spec.pausedUntil",
            format!(
                "{} is set without spec.paused: true; it only says when a pause ends. To pause until then \
                 set spec.paused: true as well (kubectl settle pause NAME --until TIME); to resume, \
                 remove spec.pausedUntil too (kubectl settle resume NAME)",
                until.0
            ),
        );
    }
}

/// A14: whether an update leaves the spec as it was, compared as parsed values (so `30s` and
/// `30000ms`, or a default left out and the same value written, are the same spec). Such an
/// update (a label, an annotation, the operator's own finalizer, and so every step of a
/// deletion) is admitted whatever the rules now say of the spec: judging it again could only
/// refuse what is already stored, and would block its cleanup. A create (`old` is `None`) is
/// never unchanged.
pub fn unchanged(spec: &SubscriptionSpec, old: Option<&SubscriptionSpec>) -> bool {
    old.is_some_and(|old| old == spec)
}

/// A13: what this backend fixes when it makes the consumer (K9).
fn fixed_on_backend(
    v: &mut Verdict,
    new: &SubscriptionSpec,
    old: &SubscriptionSpec,
    caps: &Capabilities,
) {
    let (before, after) = (old.policy.max_deliver, new.policy.max_deliver);
    if caps.max_deliver_fixed && before != after {
        let show = |x: Option<i64>| x.map_or_else(|| "unset".to_string(), |n| n.to_string());
        v.error(
            "spec.maxDeliver",
            format!(
                "cannot change from {} to {} on this backend: a RabbitMQ quorum queue's delivery limit \
                 (x-delivery-limit) is fixed when the queue is made. Keep maxDeliver, or delete this \
                 Subscription and create it again with the new value (its queue and the messages in it go with it)",
                show(before),
                show(after)
            ),
        );
    }
}

/// The rules that depend only on the delivery policy and the backend's capabilities.
pub fn validate_policy(policy: &DeliveryPolicy, capabilities: &Capabilities) -> Verdict {
    let mut v = Verdict::default();
    policy_rules(&mut v, policy, Some(capabilities));
    v
}

/// What the handler runtime checks when a subscription is added: the delivery policy's rules
/// ([`validate_policy`]) and the stream it was given (A15). On a create, the same verdict as
/// [`validate`] for the same spec and capabilities.
pub fn validate_runtime(
    policy: &DeliveryPolicy,
    stream: Option<&str>,
    capabilities: &Capabilities,
) -> Verdict {
    let mut v = validate_policy(policy, capabilities);
    stream_rules(&mut v, stream, capabilities);
    v
}

/// A15: a named stream needs a backend that has them (K10); elsewhere the queue is the
/// Subscription's own, found by its pattern and durableName.
fn stream_rules(v: &mut Verdict, stream: Option<&str>, caps: &Capabilities) {
    if let Some(stream) = stream
        && !caps.named_streams
    {
        v.error(
            "spec.stream",
            format!(
                "{stream:?} names a JetStream stream, and this backend has no named streams (it does not declare \
                 namedStreams): its queue is the Subscription's own (on RabbitMQ bound to the Backend's exchange \
                 by spec.pattern, on SQS named by spec.durableName). Remove spec.stream"
            ),
        );
    }
}

// Long on purpose: the delivery policy's admission rules (A1, A2, A3, A5, A7, A9–A12) one after
// another, each a guarded `v.error`/`v.warn` with its field and fix, so the code reads as the
// table docs/semantics.md gives.
fn policy_rules(v: &mut Verdict, p: &DeliveryPolicy, caps: Option<&Capabilities>) {
    let at_least_once = p.mode == Mode::AtLeastOnce;

    // A1: AtLeastOnce needs a durable name, on every backend (semantics M3).
    if at_least_once && p.durable_name.as_deref().is_none_or(str::is_empty) {
        v.error(
            "spec.durableName",
            "required under mode AtLeastOnce, on every backend: set spec.durableName to a stable name \
             (for example the Subscription's name) so redeliveries survive a restart",
        );
    }

    // A5: a malformed schedule is refused whatever the mode (semantics B8).
    if let Some(b) = &p.backoff {
        if b.initial.is_zero() {
            v.error(
                "spec.backoff.initial",
                "must be greater than zero: set the wait after the first decline, e.g. 1s",
            );
        }
        if b.max < b.initial {
            v.error(
                "spec.backoff.max",
                format!(
                    "{} is shorter than spec.backoff.initial {}: set max to at least initial",
                    b.max, b.initial
                ),
            );
        }
        if !(b.multiplier.is_finite() && b.multiplier >= 1.0) {
            v.error(
                "spec.backoff.multiplier",
                format!("{} is below 1: a multiplier of at least 1 keeps waits from shrinking; use 2 to double each wait", b.multiplier),
            );
        }
    }

    // A12: where a subject names one queue (SQS), a pattern must be a name the queue can carry,
    // and the subscription's own queue, so that what is published to it reaches it.
    if let Some(caps) = caps
        && caps.subject_names_queue
    {
        queue_pattern_rules(v, p);
    }

    if !at_least_once {
        // A2: no delays under AtMostOnce, where nothing comes back (semantics B7, M1).
        if p.backoff.is_some() {
            v.error(
                "spec.backoff",
                "not allowed under mode AtMostOnce, where nothing comes back: remove spec.backoff, or set spec.mode: AtLeastOnce",
            );
        }
        if p.max_nack_delay.is_some() {
            v.error(
                "spec.maxNackDelay",
                "not allowed under mode AtMostOnce, where nothing comes back: remove spec.maxNackDelay, or set spec.mode: AtLeastOnce",
            );
        }
        // Fields that only matter when the broker waits for a settlement.
        let no_effect = [
            ("spec.maxDeliver", p.max_deliver.is_some()),
            ("spec.slowHandler", p.slow_handler.is_some()),
            ("spec.ackWait", p.ack_wait.is_some()),
            ("spec.maxProcessingTime", p.max_processing_time.is_some()),
            ("spec.maxInFlight", p.max_in_flight.is_some()),
        ];
        for (field, set) in no_effect {
            if set {
                v.warn(field, "has no effect under mode AtMostOnce (nothing is acknowledged or redelivered); remove it, or set spec.mode: AtLeastOnce");
            }
        }
        return;
    }

    // A3, A4: delays need a backend that can hold a message back, for that long (semantics B7).
    if let Some(caps) = caps {
        let delays = [
            ("spec.backoff", p.backoff.as_ref().map(|b| b.max)),
            ("spec.maxNackDelay", p.max_nack_delay),
        ];
        for (field, delay) in delays {
            let Some(delay) = delay else { continue };
            if !caps.delays_redelivery {
                v.error(
                    field,
                    "this backend cannot delay a redelivery (it does not declare delaysRedelivery): remove the field, \
                     or use a backend that can, such as nats",
                );
            } else if let Some(limit) = caps.max_redelivery_delay
                && delay > limit
            {
                let what = if field == "spec.backoff" {
                    "spec.backoff.max"
                } else {
                    field
                };
                v.error(what, format!("{delay} is longer than this backend can hold a message back ({limit}): set it to {limit} or less"));
            }
        }
    }

    // A9: a backend with a limit from the first receive (SQS) redelivers sooner than asked once a
    // message's total wait passes it, and counts DelayShortened (semantics C10). Admitted, but
    // said.
    if let (Some(caps), Some(b)) = (caps, &p.backoff)
        && let Some(limit) = caps.max_redelivery_delay
        && caps.delays_redelivery
        && b.max <= limit
    {
        let total = p.max_deliver.map(|n| {
            let declines = u32::try_from(n.saturating_sub(1))
                .unwrap_or(u32::MAX)
                .min(10_000);
            (1..=declines)
                .map(|a| Schedule::from(b).delay_after(a))
                .sum::<std::time::Duration>()
        });
        let text = match total {
            Some(total) if total > limit.get() => Some(format!(
                "the schedule waits {} in all over {} declines, longer than this backend can hold a message from its first receive ({limit})",
                Duration(total),
                p.max_deliver.unwrap_or(1) - 1
            )),
            None => Some(format!(
                "with no maxDeliver the schedule's total wait is unbounded, and this backend can hold a message at most {limit} from its first receive"
            )),
            _ => None,
        };
        if let Some(text) = text {
            v.warn(
                "spec.backoff",
                format!("{text}: later declines come back sooner than asked and are counted DelayShortened; set maxDeliver or shorten the schedule"),
            );
        }
    }

    // A11: more unsettled deliveries than the backend can hold per consumer cannot be mapped
    // (RabbitMQ's prefetch-count is 16 bits): refused, never silently capped (semantics K7).
    if let Some(caps) = caps
        && let Some(limit) = caps.max_in_flight
        && let Some(n) = p.max_in_flight
        && i64::from(n) > i64::from(limit)
    {
        v.error(
            "spec.maxInFlight",
            format!(
                "{n} is more than this backend can hold unsettled per consumer ({limit}): set it to {limit} or less"
            ),
        );
    }

    // A10: on a backend that never hands a message on while its channel lives, the fields that
    // govern handing it on do nothing; A7 and A9's lease rule do not apply there (semantics K6).
    if caps.is_some_and(|c| c.ack_timeout == AckTimeout::BrokerWide) {
        let no_effect = [
            ("spec.ackWait", p.ack_wait.is_some()),
            ("spec.slowHandler", p.slow_handler.is_some()),
            ("spec.maxProcessingTime", p.max_processing_time.is_some()),
        ];
        for (field, set) in no_effect {
            if set {
                v.warn(
                    field,
                    "has no effect on this backend: it never hands a message on while the channel that received it lives; \
                     a handler that runs past the broker's own consumer_timeout (RabbitMQ: 30m unless the broker sets it) \
                     gets its channel closed, and every unsettled message on it is redelivered. Remove the field",
                );
            }
        }
        return;
    }

    // A7: under Redeliver, ackWait is a correctness setting (semantics H3).
    if p.slow_handler == Some(SlowHandler::Redeliver) && p.ack_wait.is_none() {
        v.warn(
            "spec.ackWait",
            "slowHandler Redeliver without an explicit ackWait: under Redeliver, ackWait is a correctness setting; \
             set it longer than your slowest handler run, or duplicate work is routine",
        );
    }
    // A9: under ExtendLease the lease is extended only until maxProcessingTime, 5m unless set
    // (semantics H5).
    let max_processing = p
        .max_processing_time
        .map_or(DEFAULT_MAX_PROCESSING_TIME, Duration::get);
    if p.slow_handler != Some(SlowHandler::Redeliver)
        && let Some(ack_wait) = p.ack_wait
        && max_processing < ack_wait.get()
    {
        v.warn(
            "spec.maxProcessingTime",
            format!(
                "{} is shorter than spec.ackWait {ack_wait}: under ExtendLease the lease is never extended; \
                 raise maxProcessingTime or lower ackWait",
                Duration(max_processing)
            ),
        );
    }
}

/// The longest queue name SQS accepts.
const QUEUE_NAME_MAX: usize = 80;

/// A12: on a backend whose subjects name queues, the pattern is one literal queue name (after
/// the Backend's queue prefix), and it is the durableName when there is one.
fn queue_pattern_rules(v: &mut Verdict, p: &DeliveryPolicy) {
    let pattern = p.pattern.as_str();
    let bad: Vec<char> = pattern
        .chars()
        .filter(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
        .collect();
    if !bad.is_empty() {
        let what = if bad.iter().any(|c| *c == '*' || *c == '>') {
            "a wildcard".to_string()
        } else {
            format!("{:?}", bad.iter().collect::<String>())
        };
        v.error(
            "spec.pattern",
            format!(
                "{pattern:?} has {what}, and on this backend a subject is the name of one queue (it has no subjects to match): set spec.pattern to one literal name of letters, digits, '-' and '_', the same as spec.durableName"
            ),
        );
        return;
    }
    if pattern.len() > QUEUE_NAME_MAX {
        v.error(
            "spec.pattern",
            format!(
                "is {} characters long, and a queue name has at most {QUEUE_NAME_MAX}: set a shorter name",
                pattern.len()
            ),
        );
        return;
    }
    if let Some(durable) = p.durable_name.as_deref().filter(|d| !d.is_empty())
        && durable != pattern
    {
        v.error(
            "spec.pattern",
            format!(
                "{pattern:?} differs from spec.durableName {durable:?}: on this backend the durableName names the subscription's queue and a subject is a queue's name, so messages published to {pattern:?} would never reach it; set spec.pattern to {durable:?}"
            ),
        );
    }
}

/// A6: what the broker cannot change in place on an existing consumer.
fn immutable_rules(v: &mut Verdict, new: &SubscriptionSpec, old: &SubscriptionSpec) {
    fn show<T: fmt::Debug>(x: &Option<T>) -> String {
        match x {
            Some(x) => format!("{x:?}"),
            None => "unset".to_string(),
        }
    }
    let changes = [
        (
            "spec.backendRef.name",
            format!("{:?}", old.backend_ref.name),
            format!("{:?}", new.backend_ref.name),
            "backend",
        ),
        (
            "spec.stream",
            show(&old.stream),
            show(&new.stream),
            "stream",
        ),
        (
            "spec.mode",
            format!("{:?}", old.policy.mode),
            format!("{:?}", new.policy.mode),
            "ack policy",
        ),
        (
            "spec.shape",
            format!("{:?}", old.policy.shape),
            format!("{:?}", new.policy.shape),
            "delivery shape",
        ),
        (
            "spec.durableName",
            show(&old.policy.durable_name),
            show(&new.policy.durable_name),
            "durable name",
        ),
    ];
    for (field, before, after, what) in changes {
        if before != after {
            v.error(
                field,
                format!(
                    "cannot change from {before} to {after}: the broker cannot change a consumer's {what} in place. \
                     Delete this Subscription and create it again with the new value (its consumer and unsettled deliveries go with it)"
                ),
            );
        }
    }
}
