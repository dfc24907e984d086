//! The Backend rules' table tests: good Backends of every kind, URLs and Secret names, the
//! Secret opt-in label, the host allow-list, SQS pod identity, plaintext warnings, and updates.

use super::*;
use crate::api::{
    MemoryBackendSpec, NatsBackendSpec, NatsTlsSpec, RabbitmqBackendSpec, SecretRef, SqsBackendSpec,
};

fn labelled(_: &str) -> SecretView {
    SecretView::Labelled
}

fn nats(servers: &[&str], secret: Option<&str>) -> BackendSpec {
    BackendSpec {
        nats: Some(NatsBackendSpec {
            servers: servers.iter().map(ToString::to_string).collect(),
            credentials_secret_ref: secret.map(|n| SecretRef { name: n.into() }),
            tls: None,
        }),
        ..BackendSpec::default()
    }
}

fn rabbit(urls: &[&str], management: Option<&str>, secret: Option<&str>) -> BackendSpec {
    BackendSpec {
        rabbitmq: Some(RabbitmqBackendSpec {
            urls: urls.iter().map(ToString::to_string).collect(),
            management_url: management.map(Into::into),
            credentials_secret_ref: secret.map(|n| SecretRef { name: n.into() }),
            ..RabbitmqBackendSpec::default()
        }),
        ..BackendSpec::default()
    }
}

fn sqs(endpoint: Option<&str>, region: Option<&str>, secret: Option<&str>) -> BackendSpec {
    BackendSpec {
        sqs: Some(SqsBackendSpec {
            endpoint: endpoint.map(Into::into),
            region: region.map(Into::into),
            credentials_secret_ref: secret.map(|n| SecretRef { name: n.into() }),
            queue_prefix: None,
        }),
        ..BackendSpec::default()
    }
}

fn errors(v: &Verdict) -> Vec<String> {
    v.errors.iter().map(ToString::to_string).collect()
}

#[test]
fn good_backends_of_every_kind_pass() {
    let rules = BackendRules::default();
    let cases = [
        nats(&["tls://nats.messaging:4222", "nats://10.0.0.7:4222"], None),
        nats(&["tls://[::1]:4222"], Some("nats-creds")),
        rabbit(
            &["amqps://rabbit.messaging:5671/%2f"],
            Some("https://rabbit.messaging:15672"),
            Some("rabbit"),
        ),
        sqs(
            Some("https://sqs.eu-west-1.amazonaws.com"),
            None,
            Some("aws"),
        ),
        BackendSpec {
            memory: Some(MemoryBackendSpec {}),
            ..BackendSpec::default()
        },
    ];
    for spec in cases {
        let v = validate_backend(&spec, None, "team-a", &labelled, &rules);
        assert!(v.allowed(), "{spec:?}: {:?}", errors(&v));
        assert!(v.warnings.is_empty(), "{spec:?}: {:?}", v.warnings);
    }
}

#[test]
fn urls_are_checked_per_kind_and_never_repeat_a_password() {
    let rules = BackendRules::default();
    let cases: &[(BackendSpec, &str, &str)] = &[
        (
            nats(&["amqp://nats:4222"], None),
            "spec.nats.servers[0]",
            "has scheme \"amqp\", and this backend takes nats:// or tls://",
        ),
        (
            nats(&["nats.messaging:4222"], None),
            "spec.nats.servers[0]",
            "it has no scheme://",
        ),
        (
            nats(&["nats://nats:99999"], None),
            "spec.nats.servers[0]",
            "is not a port",
        ),
        (
            nats(&["nats://"], None),
            "spec.nats.servers[0]",
            "names no host",
        ),
        (
            rabbit(&["http://rabbit:5672"], None, None),
            "spec.rabbitmq.urls[0]",
            "takes amqp:// or amqps://",
        ),
        (
            rabbit(&["amqp://rabbit:5672"], Some("amqp://rabbit:15672"), None),
            "spec.rabbitmq.managementUrl",
            "takes http:// or https://",
        ),
        (
            sqs(Some("ftp://sqs"), None, Some("aws")),
            "spec.sqs.endpoint",
            "takes http:// or https://",
        ),
        (
            sqs(None, Some("EU West"), Some("aws")),
            "spec.sqs.region",
            "is not a region name",
        ),
        (
            nats(&[&format!("nats://{}:4222", "a".repeat(600))], None),
            "spec.nats.servers[0]",
            "more than 512",
        ),
    ];
    for (spec, field, says) in cases {
        let e = errors(&validate_backend(spec, None, "ns", &labelled, &rules));
        assert!(
            e.iter().any(|e| e.starts_with(field) && e.contains(says)),
            "{spec:?}: wanted {field}: …{says}…, got {e:?}"
        );
    }
    let spec = rabbit(&["amqp://guest:s3cr3t@rabbit:5672/%2f"], None, None);
    let e = errors(&validate_backend(&spec, None, "ns", &labelled, &rules));
    assert!(
        e.iter().any(
            |e| e.starts_with("spec.rabbitmq.urls[0]: holds credentials")
                && e.contains("spec.rabbitmq.credentialsSecretRef")
        ),
        "{e:?}"
    );
    assert!(!e.iter().any(|e| e.contains("s3cr3t")), "{e:?}");
    let many: Vec<String> = (0..17).map(|i| format!("nats://n{i}:4222")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    let e = errors(&validate_backend(
        &nats(&many, None),
        None,
        "ns",
        &labelled,
        &rules,
    ));
    assert!(
        e.iter()
            .any(|e| e.starts_with("spec.nats.servers: lists 17 URLs")),
        "{e:?}"
    );
}

#[test]
fn secret_names_must_be_dns_names() {
    let e = errors(&validate_backend(
        &nats(&["nats://n:4222"], Some("Bad_Name")),
        None,
        "ns",
        &labelled,
        &BackendRules::default(),
    ));
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].starts_with("spec.nats.credentialsSecretRef.name: \"Bad_Name\" is not a Secret name"),
        "{e:?}"
    );
}

#[test]
fn an_unlabelled_secret_is_refused_naming_the_field_and_the_label() {
    let mut spec = nats(&["tls://n:4222"], Some("creds"));
    if let Some(n) = spec.nats.as_mut() {
        n.tls = Some(NatsTlsSpec {
            ca_secret_ref: Some(SecretRef { name: "ca".into() }),
        });
    }
    let views = |name: &str| match name {
        "creds" => SecretView::Unlabelled,
        _ => SecretView::Missing,
    };
    let rules = BackendRules::default();
    let v = validate_backend(&spec, None, "team-a", &views, &rules);
    let e = errors(&v);
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].starts_with("spec.nats.credentialsSecretRef.name: Secret \"creds\" does not carry the label settle.dev/backend-credentials=true"), "{e:?}");
    assert!(
        e[0].contains("kubectl label secret creds -n team-a settle.dev/backend-credentials=true"),
        "{e:?}"
    );
    assert_eq!(
        v.warnings.len(),
        1,
        "the missing CA is a warning: {:?}",
        v.warnings
    );
    assert_eq!(v.warnings[0].field, "spec.nats.tls.caSecretRef.name");
    // The controller refuses the unlabelled one too, and says nothing of the missing one.
    let c = backend_access(&spec, "team-a", &views, &rules);
    assert_eq!(errors(&c), e);
    assert!(c.warnings.is_empty());
}

#[test]
fn hosts_outside_the_allow_list_are_refused() {
    let rules = BackendRules {
        allowed_hosts: vec![
            "*.messaging.svc".parse().unwrap(),
            "10.0.0.7".parse().unwrap(),
        ],
        ..BackendRules::default()
    };
    let ok = [
        nats(&["nats://nats.messaging.svc:4222", "nats://10.0.0.7"], None),
        nats(&["nats://A.B.Messaging.SVC:4222"], None),
    ];
    for spec in ok {
        assert!(
            backend_access(&spec, "ns", &labelled, &rules).allowed(),
            "{spec:?}"
        );
    }
    let refused = [
        (
            nats(&["nats://messaging.svc:4222"], None),
            "spec.nats.servers[0]",
        ),
        (
            nats(&["nats://evil.example:4222"], None),
            "spec.nats.servers[0]",
        ),
        (
            rabbit(
                &["amqp://x.messaging.svc"],
                Some("http://metadata.internal"),
                None,
            ),
            "spec.rabbitmq.managementUrl",
        ),
        (sqs(None, Some("eu-west-1"), Some("aws")), "spec.sqs.region"),
        (sqs(None, None, Some("aws")), "spec.sqs.region"),
    ];
    for (spec, field) in refused {
        let e = errors(&backend_access(&spec, "ns", &labelled, &rules));
        assert_eq!(e.len(), 1, "{spec:?}: {e:?}");
        assert!(
            e[0].starts_with(field) && e[0].contains("--allowed-broker-hosts")
                || e[0].contains("names no host"),
            "{e:?}"
        );
    }
    assert!("".parse::<HostPattern>().is_err());
    assert!("*.".parse::<HostPattern>().is_err());
    assert!("a/b".parse::<HostPattern>().is_err());
}

#[test]
fn sqs_pod_identity_only_where_the_installer_allows_it() {
    let spec = sqs(None, Some("eu-west-1"), None);
    let none = BackendRules::default();
    let e = errors(&backend_access(&spec, "team-a", &labelled, &none));
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].starts_with("spec.sqs.credentialsSecretRef: required in namespace team-a"),
        "{e:?}"
    );
    assert!(
        e[0].contains("--sqs-pod-identity-namespaces (none)"),
        "{e:?}"
    );
    let listed = BackendRules {
        pod_identity_namespaces: vec!["platform".into()],
        ..BackendRules::default()
    };
    assert!(backend_access(&spec, "platform", &labelled, &listed).allowed());
    assert!(!backend_access(&spec, "team-a", &labelled, &listed).allowed());
    // With a Secret, any namespace.
    let with = sqs(None, Some("eu-west-1"), Some("aws"));
    assert!(backend_access(&with, "team-a", &labelled, &none).allowed());
}

#[test]
fn plaintext_with_credentials_is_a_warning_not_a_refusal() {
    let rules = BackendRules::default();
    for (spec, field) in [
        (nats(&["nats://n:4222"], Some("c")), "spec.nats.servers[0]"),
        (
            rabbit(&["amqp://r:5672"], None, Some("c")),
            "spec.rabbitmq.urls[0]",
        ),
        (
            rabbit(&["amqps://r:5671"], Some("http://r:15672"), Some("c")),
            "spec.rabbitmq.managementUrl",
        ),
        (
            sqs(Some("http://e:9324"), None, Some("c")),
            "spec.sqs.endpoint",
        ),
    ] {
        let v = validate_backend(&spec, None, "ns", &labelled, &rules);
        assert!(v.allowed(), "{:?}", errors(&v));
        assert_eq!(v.warnings.len(), 1, "{spec:?}: {:?}", v.warnings);
        assert_eq!(v.warnings[0].field, field);
        assert!(v.warnings[0].message.contains("unencrypted"));
    }
    // Without credentials, or over TLS, nothing to say.
    assert!(plaintext_with_credentials(&nats(&["nats://n:4222"], None)).is_empty());
    assert!(plaintext_with_credentials(&nats(&["tls://n:4222"], Some("c"))).is_empty());
}

#[test]
fn an_unchanged_spec_or_a_kind_change() {
    let rules = BackendRules::default();
    let old = nats(&["nats://guest:pw@n:4222"], None);
    // A14: unchanged (even one that would be refused now) is admitted.
    assert!(validate_backend(&old, Some(&old), "ns", &labelled, &rules).allowed());
    let new = rabbit(&["amqp://r:5672"], None, None);
    let e = errors(&validate_backend(&new, Some(&old), "ns", &labelled, &rules));
    assert!(
        e.iter()
            .any(|e| e.starts_with("spec: the backend kind") && e.contains("cannot change")),
        "{e:?}"
    );
}
