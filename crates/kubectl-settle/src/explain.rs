//! `kubectl settle explain SUB`: why a Subscription is not Ready or Accepted and what to do.
//! It reads the conditions (their reason and message, which name the fix) and adds a next step
//! per reason, the account, the Backend's capabilities (the one table, `policy`) and what the
//! admission rules (`policy::validate`) say of the spec against that Backend today.
//!
//! Pure: the Subscription and its Backend come in already read. It must not decide a condition
//! (the writers do) nor restate the capability table (it renders `effective_capabilities`).

use std::fmt::Write;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

use super::conditions;
use settle::api::{AckTimeout, Backend, Capabilities, Subscription};
use settle::policy::{self, BackendKind, BackendView};
use settle_operator::account::stall::reasons as stall;
use settle_operator::account::status::reasons as account;
use settle_operator::reconcile::conditions::reasons as reconcile;
use settle_operator::reconcile::conditions::types::{ACCEPTED, READY};

/// The next step for a condition's reason, beyond what its message says.
fn next_step(reason: &str, sub: &Subscription) -> String {
    let ns = sub.metadata.namespace.as_deref().unwrap_or("default");
    let backend = &sub.spec.backend_ref.name;
    match reason {
        reconcile::INVALID => "fix the field the message names (the admission rules below say the same; `settle check -f` checks a manifest offline), then `kubectl apply` it again".into(),
        reconcile::NOT_ACCEPTED => "Ready follows Accepted: fix what Accepted says first".into(),
        reconcile::BACKEND_NOT_FOUND => format!(
            "create Backend {backend:?} in namespace {ns}, or point spec.backendRef.name at one (`kubectl get backends -n {ns}`)"
        ),
        reconcile::BACKEND_NOT_READY => format!(
            "the Backend's own Ready condition says why (below, and `kubectl describe backend {backend} -n {ns}`)"
        ),
        reconcile::STREAM_NOT_FOUND => {
            "create the stream, or set spec.stream to one whose subjects cover spec.pattern".into()
        }
        reconcile::STREAM_AMBIGUOUS => "set spec.stream to the one stream to consume from".into(),
        reconcile::IMMUTABLE_FIELD => "put the spec back as the live consumer has it, or delete the consumer on the broker (its position goes with it) so Settle makes it again".into(),
        reconcile::CONSUMER_CONFLICT => "another owner holds a consumer (or queue) of that name: choose another spec.durableName, or remove the other one; one Settle did not make is taken over, with its position, by spec.adopt: IfCompatible when it matches the spec (the message says what differs) and the operator's --adopt-namespaces lists this namespace".into(),
        reconcile::BROKER_REFUSED => "the message carries the broker's own words: check its permissions and logs".into(),
        reconcile::BROKER_LIMIT => "the message names the broker's limit and what to change (raise it, or spread Subscriptions over streams); deleting a consumer on that stream frees a place at once, and Settle asks again by itself".into(),
        reconcile::UNREACHABLE
        | reconcile::AUTH_FAILED
        | reconcile::JETSTREAM_DISABLED
        | reconcile::SECRET_MISSING
        | reconcile::SECRET_NOT_LABELLED
        | reconcile::HOST_NOT_ALLOWED
        | reconcile::POD_IDENTITY_NOT_ALLOWED
        | reconcile::BAD_CONFIG => format!(
            "fix Backend {backend:?} (its settings, its Secret, or the broker) as the message says; the README's Troubleshooting has a row for {reason}"
        ),
        account::MESSAGES_EXHAUSTED => "find why the handler declines them (its logs, nacked growing), fix it, and replay the messages if they matter; it turns False by itself once the loss window passes without loss".into(),
        account::MESSAGES_STRANDED => "find why the consumer went away (`kubectl get events`, deleted on the broker, a changed durableName) and republish the messages if they matter".into(),
        stall::NOTHING_DELIVERED => "look at the application: its pods, a handler that blocks (`kubectl logs`); it turns False by itself once a handler returns".into(),
        reconcile::PAUSED_BY_SPEC => format!(
            "paused on purpose (spec.paused): nothing is offered until `kubectl settle resume {} -n {ns}` (or spec.pausedUntil passes)",
            sub.metadata.name.as_deref().unwrap_or("NAME")
        ),
        reconcile::PAUSE_NOT_APPLIED => "the pause is applied once the consumer is Ready: see Ready".into(),
        account::LEDGER_NOT_SAVED => "the counts are right and nothing is lost, but the ledger cannot be saved on the broker: fix what the message names (JetStream storage, the settle-account bucket)".into(),
        account::SOURCE_LOST => "the ledger or the reports were lost (a broker reset, a deleted bucket): counting goes on from what status showed; it turns True by itself after the loss window".into(),
        account::CAPTURE_GAP => "advisories were dropped before the operator counted them: keep it running, or raise --capture-max-bytes (or see why a status came late); exhausted may undercount by the number given".into(),
        account::DEAD_LETTERS_MISSED | account::REPORT_QUEUE_MISSING => "the operator's copy misses some of what it counts from: fix what the message names (a deleted or full queue, a missing dead-letter exchange)".into(),
        _ => "the message says what to do; the README's Troubleshooting lists every reason".into(),
    }
}

/// The explanation, as `kubectl settle explain` prints it.
pub fn explain(sub: &Subscription, backend: Option<&Backend>) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = write_explanation(&mut out, sub, backend);
    out
}

/// Each part in turn: the verdict, what is wrong, the conditions, the account, the Backend and
/// the admission rules.
fn write_explanation(
    out: &mut String,
    sub: &Subscription,
    backend: Option<&Backend>,
) -> std::fmt::Result {
    let conds: &[Condition] = sub
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    let troubles = conditions::shown(conds);
    let kind = backend.and_then(|b| BackendKind::of(&b.spec));
    write_summary(out, sub, conds, &troubles, kind)?;
    write_troubles(out, sub, &troubles)?;
    write_conditions(out, conds)?;
    writeln!(out)?;
    write_account(out, sub)?;
    writeln!(out)?;
    let capabilities = backend.and_then(policy::effective_capabilities);
    write_backend(out, sub, backend, capabilities.as_ref(), kind)?;
    write_admission(out, sub, capabilities.as_ref())
}

/// The first line's verdict, from the conditions and those that report trouble.
fn verdict(ns: &str, conds: &[Condition], troubles: &[&Condition]) -> String {
    let is_true =
        |t: &str| settle::api::condition::find(conds, t).is_some_and(|c| c.status == "True");
    if conds.is_empty() {
        format!(
            "no conditions yet: the operator has not reconciled it (is `settle operator` running, and does it watch namespace {ns}?)"
        )
    } else if !is_true(ACCEPTED) {
        "not Accepted".to_string()
    } else if !is_true(READY) {
        "not Ready".to_string()
    } else if troubles.is_empty() {
        "healthy: Accepted and Ready, and no condition reports trouble".to_string()
    } else {
        let names: Vec<&str> = troubles.iter().map(|c| c.type_.as_str()).collect();
        format!("Ready, with trouble: {}", names.join(", "))
    }
}

/// The Subscription, its verdict, and its backend, mode, pattern and consumer.
fn write_summary(
    out: &mut String,
    sub: &Subscription,
    conds: &[Condition],
    troubles: &[&Condition],
    kind: Option<BackendKind>,
) -> std::fmt::Result {
    let ns = sub.metadata.namespace.as_deref().unwrap_or("default");
    let name = sub.metadata.name.as_deref().unwrap_or_default();
    writeln!(
        out,
        "Subscription {ns}/{name}: {}",
        verdict(ns, conds, troubles)
    )?;
    writeln!(
        out,
        "  backend {} ({}), mode {:?}, pattern {}{}",
        sub.spec.backend_ref.name,
        kind.map_or("not found", BackendKind::name),
        sub.spec.policy.mode,
        sub.spec.policy.pattern,
        sub.status
            .as_ref()
            .and_then(|s| s.consumer.as_ref())
            .map(|c| format!(", consumer {}/{}", c.stream, c.name))
            .unwrap_or_default(),
    )
}

/// Each condition that reports trouble, with the next step for its reason.
fn write_troubles(
    out: &mut String,
    sub: &Subscription,
    troubles: &[&Condition],
) -> std::fmt::Result {
    if troubles.is_empty() {
        return Ok(());
    }
    writeln!(out, "\nWhat is wrong, and what to do:")?;
    for c in troubles {
        writeln!(
            out,
            "  {} ({}): {}",
            conditions::label(&c.type_, &c.status, None),
            c.reason,
            c.message
        )?;
        if conditions::healthy(c).is_some() {
            writeln!(out, "    next: {}", next_step(&c.reason, sub))?;
        }
    }
    Ok(())
}

/// Every condition, one line each, marked ok, TROUBLE or ? (a type this plugin does not know).
fn write_conditions(out: &mut String, conds: &[Condition]) -> std::fmt::Result {
    if conds.is_empty() {
        return Ok(());
    }
    writeln!(out, "\nConditions:")?;
    for c in conds {
        let mark = match conditions::healthy(c) {
            Some(true) => "ok",
            Some(false) => "TROUBLE",
            None => "?",
        };
        writeln!(
            out,
            "  {:<11} {:<7} {:<20} {:<7} since {}",
            c.type_, c.status, c.reason, mark, c.last_transition_time.0
        )?;
    }
    Ok(())
}

/// The account: `status.stats`' counters and gauges.
fn write_account(out: &mut String, sub: &Subscription) -> std::fmt::Result {
    let status = sub.status.as_ref();
    let Some(s) = status.and_then(|s| s.stats.as_ref()) else {
        return writeln!(
            out,
            "Account: no stats yet (the account writes status.stats once the runtime or the broker reports)"
        );
    };
    let c = &s.counters;
    let updated = status
        .and_then(|s| s.stats_updated_at.as_ref())
        .map(|t| format!(", updated {}", t.0))
        .unwrap_or_default();
    writeln!(out, "Account (status.stats{updated}):")?;
    writeln!(
        out,
        "  offered {}   delivered {}   released {}   lost {}",
        c.offered, c.delivered, c.released, c.lost
    )?;
    writeln!(
        out,
        "  acked {}   nacked {}   silent {}   refused {}",
        c.settlement.acked, c.settlement.nacked, c.settlement.silent, c.settlement.refused
    )?;
    writeln!(
        out,
        "  exhausted {}   stranded {}   leaseExpired {}   delayShortened {}   foreignConflicts {}",
        c.exhausted, c.stranded, c.lease_expired, c.delay_shortened, c.foreign_conflicts
    )?;
    writeln!(
        out,
        "  pending {}   ackPending {}",
        s.pending, s.ack_pending
    )
}

/// The Backend: not found, of no single kind, or what it can honour and its Ready condition.
fn write_backend(
    out: &mut String,
    sub: &Subscription,
    backend: Option<&Backend>,
    capabilities: Option<&Capabilities>,
    kind: Option<BackendKind>,
) -> std::fmt::Result {
    let ns = sub.metadata.namespace.as_deref().unwrap_or("default");
    let backend_name = sub.spec.backend_ref.name.as_str();
    let (b, caps) = match (backend, capabilities) {
        (None, _) => {
            return writeln!(
                out,
                "Backend {backend_name:?}: not found in namespace {ns}, so nothing can be said of what its broker can honour"
            );
        }
        (Some(_), None) => {
            return writeln!(
                out,
                "Backend {backend_name:?}: its spec names no single kind, so it has no capabilities"
            );
        }
        (Some(b), Some(caps)) => (b, caps),
    };
    let source = if b.status.as_ref().is_some_and(|s| s.capabilities.is_some()) {
        "from its status: the live broker and its version".to_string()
    } else {
        format!(
            "from the {} row of the capability table: not yet in its status",
            kind.map_or("?", BackendKind::name)
        )
    };
    let version = b
        .status
        .as_ref()
        .and_then(|s| s.server_version.as_deref())
        .map(|v| format!(", server {v}"))
        .unwrap_or_default();
    writeln!(
        out,
        "Backend {backend_name}{version} can honour ({source}):"
    )?;
    write_capabilities(out, caps)?;
    write_backend_ready(out, sub, b)
}

/// The Backend's Ready condition, with the next step when it is not True.
fn write_backend_ready(out: &mut String, sub: &Subscription, b: &Backend) -> std::fmt::Result {
    let backend_conds = b
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    match settle::api::condition::find(backend_conds, READY) {
        Some(c) if c.status == "True" => writeln!(out, "  Backend Ready: True ({})", c.reason),
        Some(c) => writeln!(
            out,
            "  Backend Ready: {} ({}): {}\n    next: {}",
            c.status,
            c.reason,
            c.message,
            next_step(&c.reason, sub)
        ),
        None => writeln!(out, "  Backend Ready: not written yet"),
    }
}

/// What the admission rules (`policy::validate`) say of the spec against the Backend now.
fn write_admission(
    out: &mut String,
    sub: &Subscription,
    capabilities: Option<&Capabilities>,
) -> std::fmt::Result {
    let backend_name = sub.spec.backend_ref.name.as_str();
    let view = match capabilities {
        Some(caps) => BackendView::Known {
            name: backend_name,
            capabilities: caps,
        },
        None => BackendView::Missing { name: backend_name },
    };
    let verdict = policy::validate(&sub.spec, None, view);
    writeln!(out, "\nAdmission rules against this Backend now:")?;
    if verdict.errors.is_empty() && verdict.warnings.is_empty() {
        writeln!(out, "  the spec passes every rule")?;
    }
    for e in &verdict.errors {
        writeln!(out, "  refused: {e}")?;
    }
    for w in &verdict.warnings {
        writeln!(out, "  warning: {w}")?;
    }
    Ok(())
}

/// One line per capability, with the spec fields it decides.
fn write_capabilities(out: &mut String, caps: &Capabilities) -> std::fmt::Result {
    let yes = |b: bool| if b { "yes" } else { "no" };
    let delay = match (&caps.delays_redelivery, &caps.max_redelivery_delay) {
        (false, _) => "no".to_string(),
        (true, None) => "yes, for any delay".to_string(),
        (true, Some(max)) => format!("yes, up to {max}"),
    };
    writeln!(out, "  delayed redelivery (backoff, maxNackDelay): {delay}")?;
    let ack = match caps.ack_timeout {
        AckTimeout::PerSubscription => {
            "per subscription (ackWait, slowHandler, maxProcessingTime apply)"
        }
        AckTimeout::BrokerWide => {
            "broker-wide (ackWait, slowHandler, maxProcessingTime have no effect)"
        }
        AckTimeout::Never => "never (nothing hands a message on)",
    };
    writeln!(out, "  ack timeout: {ack}")?;
    writeln!(
        out,
        "  maxInFlight: {}",
        caps.max_in_flight
            .map_or_else(|| "no limit".to_string(), |m| format!("at most {m}"))
    )?;
    writeln!(
        out,
        "  maxDeliver: {}",
        if caps.max_deliver_fixed {
            "fixed when the queue is made"
        } else {
            "can change in place"
        }
    )?;
    writeln!(
        out,
        "  spec.stream (named streams): {}",
        yes(caps.named_streams)
    )?;
    writeln!(
        out,
        "  a subject names one queue (pattern must equal durableName): {}",
        yes(caps.subject_names_queue)
    )?;
    writeln!(
        out,
        "  a restart can spend an attempt no handler saw (exhausted can undercount): {}",
        yes(caps.restart_can_spend_unseen_attempt)
    )
}

#[cfg(test)]
mod tests {
    use super::super::conditions::cond;
    use super::*;
    use settle::api::SubscriptionStatus;

    fn sub(conditions: Vec<Condition>) -> Subscription {
        let mut s: Subscription = serde_json::from_value(serde_json::json!({
            "apiVersion": "messaging.settle.dev/v1alpha1",
            "kind": "Subscription",
            "metadata": {"name": "orders", "namespace": "shop"},
            "spec": {"backendRef": {"name": "rabbit"}, "pattern": "orders.#", "mode": "AtLeastOnce",
                     "durableName": "orders", "backoff": {"initial": "1s", "max": "1m"}},
        }))
        .expect("a Subscription");
        s.status = Some(SubscriptionStatus {
            conditions,
            ..Default::default()
        });
        s
    }

    fn rabbit() -> Backend {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "messaging.settle.dev/v1alpha1",
            "kind": "Backend",
            "metadata": {"name": "rabbit", "namespace": "shop"},
            "spec": {"rabbitmq": {"urls": ["amqp://rabbit:5672"]}},
        }))
        .expect("a Backend")
    }

    #[test]
    fn a_refused_spec_names_the_reason_the_next_step_and_the_rule_from_the_table() {
        let s = sub(vec![
            cond(
                "Accepted",
                "False",
                "Invalid",
                "spec.backoff: RabbitMQ cannot delay",
            ),
            cond("Ready", "False", "NotAccepted", "not accepted"),
        ]);
        let text = explain(&s, Some(&rabbit()));
        assert!(
            text.starts_with("Subscription shop/orders: not Accepted\n"),
            "{text}"
        );
        assert!(
            text.contains("Accepted=False (Invalid): spec.backoff: RabbitMQ cannot delay"),
            "{text}"
        );
        assert!(
            text.contains("next: fix the field the message names"),
            "{text}"
        );
        assert!(
            text.contains("delayed redelivery (backoff, maxNackDelay): no"),
            "{text}"
        );
        assert!(
            text.contains("from the rabbitmq row of the capability table"),
            "{text}"
        );
        assert!(
            text.contains("refused: spec.backoff"),
            "the rules run against the table: {text}"
        );
    }

    #[test]
    fn a_healthy_subscription_says_so() {
        let mut s = sub(vec![
            cond("Accepted", "True", "Valid", ""),
            cond("Ready", "True", "ConsumerReady", ""),
            cond("Exhausting", "False", "NoRecentLoss", ""),
        ]);
        s.spec.policy.backoff = None;
        let text = explain(&s, Some(&rabbit()));
        assert!(
            text.starts_with("Subscription shop/orders: healthy"),
            "{text}"
        );
        assert!(!text.contains("What is wrong"), "{text}");
        assert!(text.contains("the spec passes every rule"), "{text}");
    }

    #[test]
    fn a_missing_backend_is_named_with_its_fix() {
        let s = sub(vec![
            cond("Accepted", "True", "Valid", ""),
            cond(
                "Ready",
                "False",
                "BackendNotFound",
                "Backend \"rabbit\" does not exist",
            ),
        ]);
        let text = explain(&s, None);
        assert!(
            text.starts_with("Subscription shop/orders: not Ready"),
            "{text}"
        );
        assert!(
            text.contains("next: create Backend \"rabbit\" in namespace shop"),
            "{text}"
        );
        assert!(
            text.contains("Backend \"rabbit\": not found in namespace shop"),
            "{text}"
        );
    }

    #[test]
    fn no_conditions_means_the_operator_has_not_seen_it() {
        let text = explain(&sub(vec![]), None);
        assert!(text.contains("no conditions yet"), "{text}");
    }
}
