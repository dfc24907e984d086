//! Every admission rule (docs/semantics.md A1–A15), valid and invalid, as one table over the pure
//! `validate`. The webhook and `settle check` call the same function; their own tests check the
//! wiring, this one the rules.

use settle::api::{Capabilities, Duration, SubscriptionSpec};
use settle::policy::{BackendKind, capabilities_of};
use settle::policy::{BackendView, Verdict, validate, validate_policy, validate_runtime};

/// The backend a row is checked against.
#[derive(Clone, Copy)]
enum B {
    Kind(BackendKind),
    Missing,
}

struct Row {
    name: &'static str,
    spec: &'static str,
    old: Option<&'static str>,
    backend: B,
    /// (field, a phrase the message must contain)
    errors: &'static [(&'static str, &'static str)],
    warnings: &'static [(&'static str, &'static str)],
}

const ALO: &str = "mode: AtLeastOnce\ndurableName: orders\n";

/// A row's spec: `pattern: "orders.>"` unless the row sets its own.
fn spec(body: &str) -> SubscriptionSpec {
    let pattern = if body.contains("pattern:") {
        ""
    } else {
        "pattern: \"orders.>\"\n"
    };
    let yaml = format!("backendRef: {{name: nats}}\n{pattern}{body}");
    serde_yaml::from_str(&yaml).unwrap_or_else(|e| panic!("row spec does not parse: {e}\n{yaml}"))
}

fn run(row: &Row) -> Verdict {
    let new = spec(row.spec);
    let old = row.old.map(spec);
    let caps;
    let view = match row.backend {
        B::Kind(k) => {
            caps = capabilities_of(k);
            BackendView::Known {
                name: "nats",
                capabilities: &caps,
            }
        }
        B::Missing => BackendView::Missing { name: "nats" },
    };
    validate(&new, old.as_ref(), view)
}

fn rows() -> Vec<Row> {
    use B::*;
    use BackendKind::*;
    vec![
        // --- valid specs: nothing to say
        Row {
            name: "default AtMostOnce",
            spec: "",
            old: None,
            backend: Kind(Nats),
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "full AtLeastOnce on nats",
            spec: "mode: AtLeastOnce\ndurableName: orders\nmaxDeliver: 5\nbackoff: {initial: 1s, max: 1m, multiplier: 2}\nmaxNackDelay: 10m\nackWait: 30s\nmaxProcessingTime: 5m\nmaxInFlight: 250\n",
            old: None,
            backend: Kind(Nats),
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "AtLeastOnce on memory",
            spec: ALO,
            old: None,
            backend: Kind(Memory),
            errors: &[],
            warnings: &[],
        },
        // --- A1: AtLeastOnce requires durableName, on every backend
        Row {
            name: "A1: AtLeastOnce without durableName (nats)",
            spec: "mode: AtLeastOnce\n",
            old: None,
            backend: Kind(Nats),
            errors: &[(
                "spec.durableName",
                "required under mode AtLeastOnce, on every backend",
            )],
            warnings: &[],
        },
        Row {
            name: "A1: AtLeastOnce without durableName (memory too)",
            spec: "mode: AtLeastOnce\n",
            old: None,
            backend: Kind(Memory),
            errors: &[("spec.durableName", "required under mode AtLeastOnce")],
            warnings: &[],
        },
        // --- A2: nothing comes back under AtMostOnce
        Row {
            name: "A2: backoff under AtMostOnce",
            spec: "backoff: {initial: 1s, max: 1m}\n",
            old: None,
            backend: Kind(Nats),
            errors: &[(
                "spec.backoff",
                "not allowed under mode AtMostOnce, where nothing comes back",
            )],
            warnings: &[],
        },
        Row {
            name: "A2: maxNackDelay under AtMostOnce",
            spec: "maxNackDelay: 1m\n",
            old: None,
            backend: Kind(Nats),
            errors: &[("spec.maxNackDelay", "not allowed under mode AtMostOnce")],
            warnings: &[],
        },
        Row {
            name: "A2: fields with no effect under AtMostOnce are admitted with warnings",
            spec: "maxDeliver: 3\nslowHandler: Redeliver\nackWait: 10s\nmaxProcessingTime: 1m\nmaxInFlight: 1\n",
            old: None,
            backend: Kind(Nats),
            errors: &[],
            warnings: &[
                ("spec.maxDeliver", "has no effect under mode AtMostOnce"),
                ("spec.slowHandler", "has no effect under mode AtMostOnce"),
                ("spec.ackWait", "has no effect under mode AtMostOnce"),
                (
                    "spec.maxProcessingTime",
                    "has no effect under mode AtMostOnce",
                ),
                ("spec.maxInFlight", "has no effect under mode AtMostOnce"),
            ],
        },
        // --- A3: delays need delaysRedelivery
        Row {
            name: "A3: backoff on rabbitmq",
            spec: "mode: AtLeastOnce\ndurableName: o\nbackoff: {initial: 1s, max: 1m}\n",
            old: None,
            backend: Kind(Rabbitmq),
            errors: &[("spec.backoff", "cannot delay a redelivery")],
            warnings: &[],
        },
        Row {
            name: "A3: maxNackDelay on rabbitmq",
            spec: "mode: AtLeastOnce\ndurableName: o\nmaxNackDelay: 1m\n",
            old: None,
            backend: Kind(Rabbitmq),
            errors: &[("spec.maxNackDelay", "cannot delay a redelivery")],
            warnings: &[],
        },
        Row {
            name: "A3: AtLeastOnce without delays is fine on rabbitmq",
            spec: ALO,
            old: None,
            backend: Kind(Rabbitmq),
            errors: &[],
            warnings: &[],
        },
        // --- A10: on a backend that never hands a message on (RabbitMQ), the fields that govern
        // handing it on have no effect; A7 does not apply there
        Row {
            name: "A10: ackWait, slowHandler and maxProcessingTime on rabbitmq",
            spec: "mode: AtLeastOnce\ndurableName: o\nslowHandler: Redeliver\nackWait: 1m\nmaxProcessingTime: 10s\n",
            old: None,
            backend: Kind(Rabbitmq),
            errors: &[],
            warnings: &[
                ("spec.ackWait", "consumer_timeout"),
                ("spec.slowHandler", "never hands a message on"),
                ("spec.maxProcessingTime", "has no effect on this backend"),
            ],
        },
        // --- A11: more in flight than the backend can hold per consumer cannot be mapped
        Row {
            name: "A11: maxInFlight above RabbitMQ's 16-bit prefetch",
            spec: "mode: AtLeastOnce\ndurableName: o\nmaxInFlight: 65536\n",
            old: None,
            backend: Kind(Rabbitmq),
            errors: &[("spec.maxInFlight", "set it to 65535 or less")],
            warnings: &[],
        },
        Row {
            name: "A11: maxInFlight at RabbitMQ's limit is fine",
            spec: "mode: AtLeastOnce\ndurableName: o\nmaxInFlight: 65535\n",
            old: None,
            backend: Kind(Rabbitmq),
            errors: &[],
            warnings: &[],
        },
        // --- A4: not longer than the backend can hold
        Row {
            name: "A4: backoff.max above SQS's 12h",
            spec: "pattern: o\nmode: AtLeastOnce\ndurableName: o\nbackoff: {initial: 1s, max: 13h}\n",
            old: None,
            backend: Kind(Sqs),
            errors: &[(
                "spec.backoff.max",
                "13h0m0s is longer than this backend can hold a message back (12h0m0s)",
            )],
            warnings: &[],
        },
        Row {
            name: "A4: maxNackDelay above SQS's 12h",
            spec: "pattern: o\nmode: AtLeastOnce\ndurableName: o\nmaxNackDelay: 24h\n",
            old: None,
            backend: Kind(Sqs),
            errors: &[(
                "spec.maxNackDelay",
                "24h0m0s is longer than this backend can hold a message back",
            )],
            warnings: &[],
        },
        Row {
            name: "A4: exactly 12h on SQS is fine",
            spec: "pattern: o\nmode: AtLeastOnce\ndurableName: o\nmaxDeliver: 2\nbackoff: {initial: 1s, max: 12h}\nmaxNackDelay: 12h\n",
            old: None,
            backend: Kind(Sqs),
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "A9 (DelayShortened): total wait past SQS's limit from first receive",
            spec: "pattern: o\nmode: AtLeastOnce\ndurableName: o\nmaxDeliver: 5\nbackoff: {initial: 4h, max: 8h}\n",
            old: None,
            backend: Kind(Sqs),
            errors: &[],
            warnings: &[(
                "spec.backoff",
                "the schedule waits 28h0m0s in all over 4 declines, longer than this backend can hold a message from its first receive (12h0m0s): later declines come back sooner than asked and are counted DelayShortened",
            )],
        },
        Row {
            name: "A9 (DelayShortened): unbounded attempts on SQS",
            spec: "pattern: o\nmode: AtLeastOnce\ndurableName: o\nbackoff: {initial: 1s, max: 1m}\n",
            old: None,
            backend: Kind(Sqs),
            errors: &[],
            warnings: &[(
                "spec.backoff",
                "with no maxDeliver the schedule's total wait is unbounded",
            )],
        },
        Row {
            name: "A9 (DelayShortened): a schedule that fits SQS says nothing",
            spec: "pattern: o\nmode: AtLeastOnce\ndurableName: o\nmaxDeliver: 5\nbackoff: {initial: 1s, max: 1m}\n",
            old: None,
            backend: Kind(Sqs),
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "A4: no limit on nats",
            spec: "mode: AtLeastOnce\ndurableName: o\nbackoff: {initial: 1s, max: 48h}\n",
            old: None,
            backend: Kind(Nats),
            errors: &[],
            warnings: &[],
        },
        // --- A12: on SQS a subject is a queue's name, and the durableName names the queue
        Row {
            name: "A12: a literal pattern equal to durableName on SQS",
            spec: "pattern: orders_v2\nmode: AtLeastOnce\ndurableName: orders_v2\nmaxDeliver: 5\n",
            old: None,
            backend: Kind(Sqs),
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "A12: a wildcard on SQS",
            spec: ALO,
            old: None,
            backend: Kind(Sqs),
            errors: &[(
                "spec.pattern",
                "\"orders.>\" has a wildcard, and on this backend a subject is the name of one queue",
            )],
            warnings: &[],
        },
        Row {
            name: "A12: a dotted subject on SQS (AtMostOnce too)",
            spec: "pattern: orders.created\n",
            old: None,
            backend: Kind(Sqs),
            errors: &[("spec.pattern", "has \".\"")],
            warnings: &[],
        },
        Row {
            name: "A12: a pattern other than the durableName on SQS",
            spec: "pattern: orders\nmode: AtLeastOnce\ndurableName: billing\n",
            old: None,
            backend: Kind(Sqs),
            errors: &[(
                "spec.pattern",
                "differs from spec.durableName \"billing\": on this backend the durableName names the subscription's queue",
            )],
            warnings: &[],
        },
        Row {
            name: "A12: a queue name longer than SQS takes",
            spec: "pattern: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n",
            old: None,
            backend: Kind(Sqs),
            errors: &[("spec.pattern", "is 81 characters long")],
            warnings: &[],
        },
        Row {
            name: "A12: patterns are free on nats",
            spec: "pattern: orders\nmode: AtLeastOnce\ndurableName: billing\n",
            old: None,
            backend: Kind(Nats),
            errors: &[],
            warnings: &[],
        },
        // --- A5: malformed backoff
        Row {
            name: "A5: max shorter than initial",
            spec: "mode: AtLeastOnce\ndurableName: o\nbackoff: {initial: 1m, max: 1s}\n",
            old: None,
            backend: Kind(Nats),
            errors: &[(
                "spec.backoff.max",
                "1s is shorter than spec.backoff.initial 1m0s",
            )],
            warnings: &[],
        },
        Row {
            name: "A5: multiplier below 1",
            spec: "mode: AtLeastOnce\ndurableName: o\nbackoff: {initial: 1s, max: 1m, multiplier: 0.5}\n",
            old: None,
            backend: Kind(Nats),
            errors: &[("spec.backoff.multiplier", "0.5 is below 1")],
            warnings: &[],
        },
        Row {
            name: "A5: zero initial (only reachable past the CEL check)",
            spec: "mode: AtLeastOnce\ndurableName: o\nbackoff: {initial: 0s, max: 1m}\n",
            old: None,
            backend: Kind(Nats),
            errors: &[("spec.backoff.initial", "must be greater than zero")],
            warnings: &[],
        },
        Row {
            name: "A5: multiplier exactly 1 is a constant wait",
            spec: "mode: AtLeastOnce\ndurableName: o\nbackoff: {initial: 1s, max: 1s, multiplier: 1}\n",
            old: None,
            backend: Kind(Nats),
            errors: &[],
            warnings: &[],
        },
        // --- A13: what the backend fixes when it makes the consumer (K9)
        Row {
            name: "A13: maxDeliver change on rabbitmq",
            spec: "mode: AtLeastOnce\ndurableName: orders\nmaxDeliver: 5\n",
            old: Some("mode: AtLeastOnce\ndurableName: orders\nmaxDeliver: 3\n"),
            backend: Kind(Rabbitmq),
            errors: &[(
                "spec.maxDeliver",
                "cannot change from 3 to 5 on this backend: a RabbitMQ quorum queue's delivery limit (x-delivery-limit) is fixed when the queue is made",
            )],
            warnings: &[],
        },
        Row {
            name: "A13: maxDeliver set on update on rabbitmq",
            spec: "mode: AtLeastOnce\ndurableName: orders\nmaxDeliver: 5\n",
            old: Some(ALO),
            backend: Kind(Rabbitmq),
            errors: &[("spec.maxDeliver", "cannot change from unset to 5")],
            warnings: &[],
        },
        Row {
            name: "A13: maxDeliver unchanged on rabbitmq",
            spec: "mode: AtLeastOnce\ndurableName: orders\nmaxDeliver: 3\nmaxInFlight: 10\n",
            old: Some("mode: AtLeastOnce\ndurableName: orders\nmaxDeliver: 3\n"),
            backend: Kind(Rabbitmq),
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "A13: maxDeliver changes in place on nats",
            spec: "mode: AtLeastOnce\ndurableName: orders\nmaxDeliver: 5\n",
            old: Some("mode: AtLeastOnce\ndurableName: orders\nmaxDeliver: 3\n"),
            backend: Kind(Nats),
            errors: &[],
            warnings: &[],
        },
        // --- A15: a named stream needs a backend that has them (K10)
        Row {
            name: "A15: stream on rabbitmq",
            spec: "mode: AtLeastOnce\ndurableName: orders\nstream: ORDERS\n",
            old: None,
            backend: Kind(Rabbitmq),
            errors: &[(
                "spec.stream",
                "\"ORDERS\" names a JetStream stream, and this backend has no named streams (it does not declare namedStreams): its queue is the Subscription's own",
            )],
            warnings: &[],
        },
        Row {
            name: "A15: stream on sqs",
            spec: "pattern: orders\nmode: AtLeastOnce\ndurableName: orders\nstream: ORDERS\n",
            old: None,
            backend: Kind(Sqs),
            errors: &[("spec.stream", "Remove spec.stream")],
            warnings: &[],
        },
        Row {
            name: "A15: stream under AtMostOnce on rabbitmq",
            spec: "stream: ORDERS\n",
            old: None,
            backend: Kind(Rabbitmq),
            errors: &[("spec.stream", "has no named streams")],
            warnings: &[],
        },
        Row {
            // Another field changed (an unchanged spec is A14's: admitted unjudged).
            name: "A15: stream kept on update on rabbitmq",
            spec: "mode: AtLeastOnce\ndurableName: orders\nstream: ORDERS\nmaxInFlight: 5\n",
            old: Some("mode: AtLeastOnce\ndurableName: orders\nstream: ORDERS\nmaxInFlight: 10\n"),
            backend: Kind(Rabbitmq),
            errors: &[("spec.stream", "has no named streams")],
            warnings: &[],
        },
        Row {
            name: "A15: stream on nats",
            spec: "mode: AtLeastOnce\ndurableName: orders\nstream: ORDERS\n",
            old: None,
            backend: Kind(Nats),
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "A15: stream on memory",
            spec: "mode: AtLeastOnce\ndurableName: orders\nstream: ORDERS\n",
            old: None,
            backend: Kind(Memory),
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "A15: no stream on rabbitmq",
            spec: ALO,
            old: None,
            backend: Kind(Rabbitmq),
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "A15: stream on a missing backend waits for its capabilities",
            spec: "mode: AtLeastOnce\ndurableName: orders\nstream: ORDERS\n",
            old: None,
            backend: Missing,
            errors: &[],
            warnings: &[(
                "spec.backendRef.name",
                "Backend \"nats\" does not exist in this namespace yet",
            )],
        },
        // --- A6: what the broker cannot change in place
        Row {
            name: "A6: mode change",
            spec: ALO,
            old: Some("mode: AtMostOnce\ndurableName: orders\n"),
            backend: Kind(Nats),
            errors: &[(
                "spec.mode",
                "cannot change from AtMostOnce to AtLeastOnce: the broker cannot change a consumer's ack policy in place. Delete this Subscription and create it again",
            )],
            warnings: &[],
        },
        Row {
            name: "A6: durableName change",
            spec: "mode: AtLeastOnce\ndurableName: orders2\n",
            old: Some(ALO),
            backend: Kind(Nats),
            errors: &[(
                "spec.durableName",
                "cannot change from \"orders\" to \"orders2\"",
            )],
            warnings: &[],
        },
        Row {
            name: "A6: stream set on update",
            spec: "mode: AtLeastOnce\ndurableName: orders\nstream: ORDERS\n",
            old: Some(ALO),
            backend: Kind(Nats),
            errors: &[("spec.stream", "cannot change from unset to \"ORDERS\"")],
            warnings: &[],
        },
        Row {
            name: "A6: editable fields change freely",
            spec: "mode: AtLeastOnce\ndurableName: orders\nmaxDeliver: 9\nackWait: 1m\nmaxInFlight: 10\n",
            old: Some("mode: AtLeastOnce\ndurableName: orders\nmaxDeliver: 3\n"),
            backend: Kind(Nats),
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "A6: adopt changes freely, either way, on every backend (it is read only while the consumer is not yet the Subscription's)",
            spec: "mode: AtLeastOnce\ndurableName: orders\nadopt: IfCompatible\n",
            old: Some(ALO),
            backend: Kind(Rabbitmq),
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "A6: adopt set back to Never",
            spec: "pattern: orders\nmode: AtLeastOnce\ndurableName: orders\n",
            old: Some(
                "pattern: orders\nmode: AtLeastOnce\ndurableName: orders\nadopt: IfCompatible\n",
            ),
            backend: Kind(Sqs),
            errors: &[],
            warnings: &[],
        },
        // --- A7: Redeliver makes ackWait a correctness setting
        Row {
            name: "A7: Redeliver without ackWait",
            spec: "mode: AtLeastOnce\ndurableName: o\nslowHandler: Redeliver\n",
            old: None,
            backend: Kind(Nats),
            errors: &[],
            warnings: &[(
                "spec.ackWait",
                "under Redeliver, ackWait is a correctness setting",
            )],
        },
        Row {
            name: "A7: Redeliver with ackWait",
            spec: "mode: AtLeastOnce\ndurableName: o\nslowHandler: Redeliver\nackWait: 10m\n",
            old: None,
            backend: Kind(Nats),
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "A9: ExtendLease with ackWait past the default 5m maxProcessingTime",
            spec: "mode: AtLeastOnce\ndurableName: o\nackWait: 10m\n",
            old: None,
            backend: Kind(Nats),
            errors: &[],
            warnings: &[(
                "spec.maxProcessingTime",
                "5m0s is shorter than spec.ackWait 10m0s",
            )],
        },
        Row {
            name: "A9: ExtendLease that can never extend",
            spec: "mode: AtLeastOnce\ndurableName: o\nackWait: 1m\nmaxProcessingTime: 30s\n",
            old: None,
            backend: Kind(Nats),
            errors: &[],
            warnings: &[("spec.maxProcessingTime", "the lease is never extended")],
        },
        // --- A14: an update that leaves the spec as it was is not judged again
        Row {
            name: "A14: an unchanged spec that no longer passes is admitted, with nothing to say",
            spec: "backoff: {initial: 1s, max: 1m}\nmaxDeliver: 3\n",
            old: Some("backoff: {initial: 1s, max: 1m}\nmaxDeliver: 3\n"),
            backend: Kind(Rabbitmq),
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "A14: unchanged means the same parsed values, however written",
            spec: "backoff: {initial: 1000ms, max: 60s, multiplier: 2}\ndeletionPolicy: Delete\n",
            old: Some("backoff: {initial: 1s, max: 1m}\n"),
            backend: Missing,
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "A14: a changed spec is judged as ever",
            spec: "backoff: {initial: 1s, max: 2m}\n",
            old: Some("backoff: {initial: 1s, max: 1m}\n"),
            backend: Kind(Nats),
            errors: &[("spec.backoff", "not allowed under mode AtMostOnce")],
            warnings: &[],
        },
        // --- A8: a Backend that does not exist yet
        Row {
            name: "A8: missing backend is admitted with a warning",
            spec: ALO,
            old: None,
            backend: Missing,
            errors: &[],
            warnings: &[(
                "spec.backendRef.name",
                "Backend \"nats\" does not exist in this namespace yet",
            )],
        },
        Row {
            name: "A8: missing backend does not hide policy errors",
            spec: "mode: AtLeastOnce\n",
            old: None,
            backend: Missing,
            errors: &[("spec.durableName", "required under mode AtLeastOnce")],
            warnings: &[("spec.backendRef.name", "does not exist")],
        },
        Row {
            name: "A23: paused, with or without a time (a passed one too), on every backend",
            spec: "paused: true\npausedUntil: \"2020-01-01T00:00:00Z\"\n",
            old: None,
            backend: Kind(Rabbitmq),
            errors: &[],
            warnings: &[],
        },
        Row {
            name: "A23: pausedUntil without paused is refused",
            spec: "pausedUntil: \"2030-01-01T00:00:00Z\"\n",
            old: None,
            backend: Kind(Nats),
            errors: &[(
                "spec.pausedUntil",
                "set spec.paused: true as well (kubectl settle pause NAME --until TIME)",
            )],
            warnings: &[],
        },
        Row {
            name: "A23: resumed by paused: false with the time left in place is refused",
            spec: "paused: false\npausedUntil: \"2030-01-01T00:00:00Z\"\n",
            old: Some("paused: true\npausedUntil: \"2030-01-01T00:00:00Z\"\n"),
            backend: Kind(Nats),
            errors: &[("spec.pausedUntil", "remove spec.pausedUntil too")],
            warnings: &[],
        },
    ]
}

#[test]
fn every_rule_valid_and_invalid() {
    let mut failures = Vec::new();
    for row in rows() {
        let v = run(&row);
        let check = |kind: &str,
                     got: &[settle::policy::FieldIssue],
                     want: &[(&str, &str)],
                     failures: &mut Vec<String>| {
            let got_fields: Vec<&str> = got.iter().map(|i| i.field.as_str()).collect();
            let want_fields: Vec<&str> = want.iter().map(|(f, _)| *f).collect();
            if got_fields != want_fields {
                failures.push(format!(
                    "{}: {kind} fields {got_fields:?}, wanted {want_fields:?} ({got:?})",
                    row.name
                ));
                return;
            }
            for (issue, (_, phrase)) in got.iter().zip(want) {
                if !issue.message.contains(phrase) {
                    failures.push(format!(
                        "{}: {kind} {} says {:?}, wanted it to contain {phrase:?}",
                        row.name, issue.field, issue.message
                    ));
                }
            }
        };
        check("error", &v.errors, row.errors, &mut failures);
        check("warning", &v.warnings, row.warnings, &mut failures);
        assert_eq!(v.allowed(), row.errors.is_empty(), "{}", row.name);
    }
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn every_error_says_what_to_do() {
    // Bad input gets an error naming the field and the fix: each error message carries an
    // instruction (set / remove / use / delete ... create).
    for row in rows() {
        for e in run(&row).errors {
            let m = e.message.to_lowercase();
            assert!(
                ["set ", "remove ", "use ", "delete "]
                    .iter()
                    .any(|verb| m.contains(verb)),
                "{}: {} gives no way out: {}",
                row.name,
                e.field,
                e.message
            );
        }
    }
}

#[test]
fn validate_policy_is_the_same_rules_without_the_resource() {
    // The runtime calls validate_runtime (validate_policy and the stream it was given) when a
    // subscription is added; on a create it must agree with validate, and so must validate_policy
    // alone where the spec names no stream. The pause (spec.paused, spec.pausedUntil: A23) is
    // the operator's alone: the runtime never reads it (semantics W1), so its rows are left out.
    for row in rows()
        .into_iter()
        .filter(|r| r.old.is_none() && !r.spec.contains("paused"))
    {
        let B::Kind(kind) = row.backend else { continue };
        let caps = capabilities_of(kind);
        let full = run(&row);
        let s = spec(row.spec);
        let runtime = validate_runtime(&s.policy, s.stream.as_deref(), &caps);
        assert_eq!(full, runtime, "{}", row.name);
        if s.stream.is_none() {
            let policy_only = validate_policy(&s.policy, &caps);
            assert_eq!(full, policy_only, "{}", row.name);
        }
    }
}

#[test]
fn capabilities_from_status_override_the_kind() {
    // A Backend whose status says it cannot hold a message longer than 1m.
    let caps = Capabilities {
        delays_redelivery: true,
        max_redelivery_delay: Some(Duration::from_secs(60)),
        restart_can_spend_unseen_attempt: true,
        ..Capabilities::default()
    };
    let s = spec("mode: AtLeastOnce\ndurableName: o\nbackoff: {initial: 1s, max: 2m}\n");
    let v = validate(
        &s,
        None,
        BackendView::Known {
            name: "nats",
            capabilities: &caps,
        },
    );
    assert_eq!(v.errors.len(), 1, "{v:?}");
    assert_eq!(v.errors[0].field, "spec.backoff.max");
    assert_eq!(
        v.errors[0].message,
        "2m0s is longer than this backend can hold a message back (1m0s): set it to 1m0s or less"
    );
}

/// The vectors another runtime checks its own rules against (`conformance/admission.json`,
/// read by the Go runtime's `TestTheAdmissionVectorsGiveTheSameFindings`): every create row of
/// the table a runtime judges (a known backend, no pause), with the policy as the resource
/// spells it and the findings `validate_runtime` gives, word for word. The file is checked
/// against the rules here; `SETTLE_WRITE_REFERENCE=1` writes it afresh after a rule changed.
#[test]
fn the_rows_are_the_vectors_every_runtime_checks_its_words_against() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../conformance/admission.json");
    let issues = |v: &[settle::policy::FieldIssue]| -> Vec<serde_json::Value> {
        v.iter()
            .map(|i| serde_json::json!({"field": i.field, "message": i.message}))
            .collect()
    };
    let cases: Vec<serde_json::Value> = rows()
        .into_iter()
        .filter(|r| r.old.is_none() && !r.spec.contains("paused"))
        .filter_map(|row| {
            let B::Kind(kind) = row.backend else {
                return None;
            };
            let s = spec(row.spec);
            let v = validate_runtime(&s.policy, s.stream.as_deref(), &capabilities_of(kind));
            let mut policy = serde_json::to_value(&s.policy).expect("a policy serializes");
            if let Some(stream) = &s.stream {
                policy["stream"] = serde_json::json!(stream);
            }
            Some(serde_json::json!({
                "name": row.name,
                "backend": kind.to_string(),
                "spec": policy,
                "errors": issues(&v.errors),
                "warnings": issues(&v.warnings),
            }))
        })
        .collect();
    let doc = serde_json::json!({
        "about": "Admission findings, word for word, for every runtime to check its own rules against: written from the Rust rules by crates/settle/tests/admission_rules.rs (SETTLE_WRITE_REFERENCE=1 writes it afresh). See conformance/README.md.",
        "cases": cases,
    });
    let text = serde_json::to_string_pretty(&doc).expect("json") + "\n";
    if std::env::var_os("SETTLE_WRITE_REFERENCE").is_some_and(|v| v == "1") {
        std::fs::write(&path, &text).expect("write the vectors");
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == text,
        "{} is not what the rules give: run `SETTLE_WRITE_REFERENCE=1 cargo test -p settle --test admission_rules` (or `make reference`) and commit it",
        path.display()
    );
}
