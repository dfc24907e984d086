//! Which Subscriptions a change concerns: those of a Backend (when it changes or its connection
//! comes back), the one that owns a consumer (when an advisory says the consumer changed on the
//! broker), the Backends that name a Secret (when it changes).
//!
//! Pure: functions over the cached objects. It must not call the API or the broker.

use settle::api::{Backend, ConsumerRef, Subscription};
use settle::backend::nats::mapping::consumer_name;
use settle::policy::ResolvedPolicy;

/// The Subscriptions in `namespace` that use Backend `backend`.
pub fn subscriptions_of<'a, I>(subs: I, namespace: &str, backend: &str) -> Vec<&'a Subscription>
where
    I: IntoIterator<Item = &'a Subscription>,
{
    subs.into_iter()
        .filter(|s| {
            s.metadata.namespace.as_deref() == Some(namespace) && s.spec.backend_ref.name == backend
        })
        .collect()
}

/// The consumer name a Subscription maps to (the one mapping's name).
pub fn consumer_name_of(sub: &Subscription) -> Option<String> {
    let ns = sub.metadata.namespace.as_deref()?;
    let name = sub.metadata.name.as_deref()?;
    Some(consumer_name(
        ns,
        name,
        &ResolvedPolicy::resolve(&sub.spec.policy),
    ))
}

/// The Subscriptions on Backend `namespace/backend` that own consumer `stream/consumer`: the one
/// whose status names it, else those whose spec maps to that name (and to that stream, when the
/// spec names one).
pub fn owners_of_consumer<'a, I>(
    subs: I,
    namespace: &str,
    backend: &str,
    stream: &str,
    consumer: &str,
) -> Vec<&'a Subscription>
where
    I: IntoIterator<Item = &'a Subscription>,
{
    let wanted = ConsumerRef {
        stream: stream.to_string(),
        name: consumer.to_string(),
    };
    subscriptions_of(subs, namespace, backend)
        .into_iter()
        .filter(
            |s| match s.status.as_ref().and_then(|st| st.consumer.as_ref()) {
                Some(c) => *c == wanted,
                None => {
                    consumer_name_of(s).as_deref() == Some(consumer)
                        && s.spec.stream.as_deref().is_none_or(|x| x == stream)
                }
            },
        )
        .collect()
}

/// The Backends in `namespace` that name Secret `secret` (credentials or CA).
pub fn backends_naming_secret<'a, I>(backends: I, namespace: &str, secret: &str) -> Vec<&'a Backend>
where
    I: IntoIterator<Item = &'a Backend>,
{
    backends
        .into_iter()
        .filter(|b| b.metadata.namespace.as_deref() == Some(namespace))
        .filter(|b| secrets_of(b).contains(&secret))
        .collect()
}

/// The Secrets a Backend names (credentials, CA), whatever its kind.
pub fn secrets_of(b: &Backend) -> Vec<&str> {
    let s = &b.spec;
    let refs = [
        s.nats
            .as_ref()
            .and_then(|n| n.credentials_secret_ref.as_ref()),
        s.nats
            .as_ref()
            .and_then(|n| n.tls.as_ref())
            .and_then(|t| t.ca_secret_ref.as_ref()),
        s.rabbitmq
            .as_ref()
            .and_then(|r| r.credentials_secret_ref.as_ref()),
        s.rabbitmq
            .as_ref()
            .and_then(|r| r.tls.as_ref())
            .and_then(|t| t.ca_secret_ref.as_ref()),
        s.sqs
            .as_ref()
            .and_then(|q| q.credentials_secret_ref.as_ref()),
    ];
    refs.into_iter()
        .flatten()
        .map(|r| r.name.as_str())
        .collect()
}

/// Whether `namespace` is watched (`watched` empty means all).
pub fn watched(watched: &[String], namespace: Option<&str>) -> bool {
    watched.is_empty() || namespace.is_some_and(|ns| watched.iter().any(|w| w == ns))
}

#[cfg(test)]
mod tests {
    use super::*;
    use settle::api::{
        BackendRef, BackendSpec, DeliveryPolicy, Mode, NatsBackendSpec, NatsTlsSpec, SecretRef,
        SubscriptionSpec, SubscriptionStatus,
    };

    fn sub(ns: &str, name: &str, backend: &str, durable: Option<&str>) -> Subscription {
        let mut s = Subscription::new(
            name,
            SubscriptionSpec {
                backend_ref: BackendRef {
                    name: backend.into(),
                },
                stream: None,
                deletion_policy: Default::default(),
                adopt: Default::default(),
                paused: false,
                paused_until: None,
                policy: DeliveryPolicy {
                    pattern: "orders.>".into(),
                    mode: if durable.is_some() {
                        Mode::AtLeastOnce
                    } else {
                        Mode::AtMostOnce
                    },
                    durable_name: durable.map(str::to_string),
                    ..Default::default()
                },
            },
        );
        s.metadata.namespace = Some(ns.into());
        s
    }

    fn names(v: Vec<&Subscription>) -> Vec<String> {
        let mut n: Vec<String> = v
            .iter()
            .map(|s| {
                format!(
                    "{}/{}",
                    s.metadata.namespace.as_deref().unwrap_or(""),
                    s.metadata.name.as_deref().unwrap_or("")
                )
            })
            .collect();
        n.sort();
        n
    }

    fn many() -> Vec<Subscription> {
        let mut all = Vec::new();
        for ns in ["shop", "billing"] {
            for backend in ["nats", "other"] {
                for i in 0..20 {
                    let durable = format!("d{i}-{backend}");
                    all.push(sub(
                        ns,
                        &format!("s{i}-{backend}"),
                        backend,
                        (i % 2 == 0).then_some(durable.as_str()),
                    ));
                }
            }
        }
        all
    }

    #[test]
    fn a_backend_maps_to_exactly_its_subscriptions_in_its_namespace() {
        let all = many();
        for ns in ["shop", "billing"] {
            for backend in ["nats", "other"] {
                let got = subscriptions_of(&all, ns, backend);
                assert_eq!(got.len(), 20, "{ns}/{backend}");
                assert!(
                    got.iter()
                        .all(|s| s.metadata.namespace.as_deref() == Some(ns)
                            && s.spec.backend_ref.name == backend)
                );
            }
        }
        assert!(subscriptions_of(&all, "nowhere", "nats").is_empty());
        assert!(subscriptions_of(&all, "shop", "missing").is_empty());
    }

    #[test]
    fn a_consumer_maps_to_the_subscription_whose_spec_names_it() {
        let all = many();
        for ns in ["shop", "billing"] {
            for i in 0..20 {
                let want = format!("{ns}/s{i}-nats");
                let consumer = if i % 2 == 0 {
                    format!("d{i}-nats")
                } else {
                    format!("settle_{ns}_s{i}-nats")
                };
                assert_eq!(
                    names(owners_of_consumer(&all, ns, "nats", "ORDERS", &consumer)),
                    vec![want],
                    "{consumer}"
                );
                assert!(
                    owners_of_consumer(&all, ns, "other", "ORDERS", &consumer).is_empty(),
                    "another Backend's consumer of the same name is another consumer"
                );
            }
        }
        assert!(owners_of_consumer(&all, "shop", "nats", "ORDERS", "unknown").is_empty());
    }

    #[test]
    fn the_status_consumer_wins_over_the_spec_and_pins_the_stream() {
        let mut s = sub("shop", "a", "nats", Some("orders"));
        s.status = Some(SubscriptionStatus {
            consumer: Some(ConsumerRef {
                stream: "ORDERS".into(),
                name: "orders".into(),
            }),
            ..Default::default()
        });
        let all = vec![s];
        assert_eq!(
            owners_of_consumer(&all, "shop", "nats", "ORDERS", "orders").len(),
            1
        );
        assert!(owners_of_consumer(&all, "shop", "nats", "OTHER", "orders").is_empty());
    }

    #[test]
    fn an_explicit_stream_must_match() {
        let mut s = sub("shop", "a", "nats", Some("orders"));
        s.spec.stream = Some("ORDERS".into());
        let all = vec![s];
        assert_eq!(
            owners_of_consumer(&all, "shop", "nats", "ORDERS", "orders").len(),
            1
        );
        assert!(owners_of_consumer(&all, "shop", "nats", "EU", "orders").is_empty());
    }

    fn backend(ns: &str, name: &str, creds: Option<&str>, ca: Option<&str>) -> Backend {
        let mut b = Backend::new(
            name,
            BackendSpec {
                nats: Some(NatsBackendSpec {
                    servers: vec!["nats://x:4222".into()],
                    credentials_secret_ref: creds.map(|n| SecretRef { name: n.into() }),
                    tls: ca.map(|n| NatsTlsSpec {
                        ca_secret_ref: Some(SecretRef { name: n.into() }),
                    }),
                }),
                ..BackendSpec::default()
            },
        );
        b.metadata.namespace = Some(ns.into());
        b
    }

    #[test]
    fn a_secret_maps_to_the_backends_that_name_it_in_its_namespace() {
        let all = vec![
            backend("shop", "a", Some("creds"), None),
            backend("shop", "b", None, Some("creds")),
            backend("shop", "c", Some("other"), Some("ca")),
            backend("billing", "d", Some("creds"), None),
            backend("shop", "e", None, None),
        ];
        let got = |ns, secret| -> Vec<String> {
            backends_naming_secret(&all, ns, secret)
                .iter()
                .filter_map(|b| b.metadata.name.clone())
                .collect()
        };
        assert_eq!(got("shop", "creds"), vec!["a", "b"]);
        assert_eq!(got("shop", "ca"), vec!["c"]);
        assert_eq!(got("billing", "creds"), vec!["d"]);
        assert!(got("shop", "unknown").is_empty());
    }

    #[test]
    fn an_empty_watch_list_watches_every_namespace() {
        assert!(watched(&[], Some("x")));
        assert!(watched(&["a".into(), "b".into()], Some("b")));
        assert!(!watched(&["a".into()], Some("b")));
        assert!(!watched(&["a".into()], None));
    }

    #[test]
    fn the_secrets_of_every_kind_are_named() {
        use settle::api::{RabbitmqBackendSpec, RabbitmqTlsSpec, SqsBackendSpec};
        let r = |n: &str| Some(SecretRef { name: n.into() });
        let rabbit = Backend::new(
            "r",
            BackendSpec {
                rabbitmq: Some(RabbitmqBackendSpec {
                    urls: vec!["amqp://x".into()],
                    credentials_secret_ref: r("rabbit-creds"),
                    tls: Some(RabbitmqTlsSpec {
                        ca_secret_ref: r("rabbit-ca"),
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            },
        );
        assert_eq!(secrets_of(&rabbit), vec!["rabbit-creds", "rabbit-ca"]);
        let sqs = Backend::new(
            "s",
            BackendSpec {
                sqs: Some(SqsBackendSpec {
                    credentials_secret_ref: r("aws"),
                    ..Default::default()
                }),
                ..Default::default()
            },
        );
        assert_eq!(secrets_of(&sqs), vec!["aws"]);
    }
}
