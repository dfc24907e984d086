//! The ack fields of a NACK Consumer: with acks (AtLeastOnce) each is mapped onto the
//! Subscription's policy (`ackWait`, `maxDeliver`, `maxAckPending` as `maxInFlight`, `backoff` as
//! the nearest schedule) or flagged; without acks (AtMostOnce) they had no effect, which is said.

use super::super::{ConsumerSpec, DEFAULT_ACK_WAIT};
use super::{
    Findings, MAX_IN_FLIGHT, SERVER_MAX_ACK_PENDING, Severity, UNSAFE_ACK_WAIT, go_duration,
    schedule_of, spec_default,
};
use settle::api::DeliveryPolicy;

/// The fields that matter with acks (AtLeastOnce); false when one cannot be written at all.
pub(super) fn acked_fields(
    spec: &ConsumerSpec,
    policy: &mut DeliveryPolicy,
    f: &mut Findings,
) -> bool {
    if !ack_wait(spec, policy, f) || !max_deliver(spec, policy, f) {
        return false;
    }
    max_ack_pending(spec, policy, f);
    backoff(spec, policy, f)
}

/// `ackWait` as the Subscription's, unless it is too short to be safe; false when unreadable.
fn ack_wait(spec: &ConsumerSpec, policy: &mut DeliveryPolicy, f: &mut Findings) -> bool {
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
    true
}

/// `maxDeliver` as the Subscription's; false when below -1.
fn max_deliver(spec: &ConsumerSpec, policy: &mut DeliveryPolicy, f: &mut Findings) -> bool {
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
    true
}

/// `maxAckPending` as `maxInFlight` (the server's default when unset, Settle's limit at most).
fn max_ack_pending(spec: &ConsumerSpec, policy: &mut DeliveryPolicy, f: &mut Findings) {
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
}

/// `backoff`'s list as the nearest Settle schedule; false when a step is zero or unreadable.
fn backoff(spec: &ConsumerSpec, policy: &mut DeliveryPolicy, f: &mut Findings) -> bool {
    if spec.backoff.is_empty() {
        return true;
    }
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
    true
}

/// Without acks (AtMostOnce) the ack fields have no effect: said, not written.
pub(super) fn unacked_fields(spec: &ConsumerSpec, f: &mut Findings) {
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
