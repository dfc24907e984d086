//! Whether a RabbitMQ Backend's vhost is one that Backends of other namespaces use too. On one
//! vhost anyone who may publish through the default exchange reaches every queue, so a tenant
//! can write another's ledger, object-mark and adopted-mark queues, whose writer the operator
//! cannot check; a vhost is therefore shared only with the consent of the Backends on it
//! (`spec.rabbitmq.sharedVhost: true`). The older Backend keeps its place: a Backend on a vhost
//! that an older Backend of another namespace uses, where not both consent, is refused; with
//! consent it connects and its status says what is not protected.
//!
//! It must not connect, read Secrets or write status: it judges from the specs in the cache (the
//! hosts of `spec.rabbitmq.urls` and the vhost), so it sees the Backends this operator watches,
//! not other clusters or applications that use the vhost directly, and says what the Backend's
//! `Ready` then says ([`said`]).

use std::collections::BTreeSet;

use kube::ResourceExt;
use lapin::uri::AMQPUri;

use super::Ctx;
use super::conditions::reasons;
use super::status::BackendOutcome;
use settle::api::{Backend, RabbitmqBackendSpec};

/// What a Backend's vhost is to it.
#[derive(Debug, PartialEq, Eq)]
pub enum Sharing {
    /// No Backend of another namespace is on it, or only newer ones (theirs is the refusal).
    Alone,
    /// Shared with `others` Backends of other namespaces, and this one and every older one
    /// consent.
    Consented { vhost: String, others: usize },
    /// An older Backend of another namespace is on it and not both consent: the message says
    /// what to do.
    Refused(String),
}

/// Where a RabbitMQ Backend's queues live: the brokers (`host:port`) and the vhost.
fn place(spec: &RabbitmqBackendSpec) -> Option<(BTreeSet<String>, String)> {
    let mut hosts = BTreeSet::new();
    let mut vhost = None;
    for url in &spec.urls {
        let Ok(uri) = url.parse::<AMQPUri>() else {
            continue;
        };
        hosts.insert(format!(
            "{}:{}",
            uri.authority.host.to_ascii_lowercase(),
            uri.authority.port
        ));
        vhost.get_or_insert(uri.vhost);
    }
    let vhost = spec.vhost.clone().or(vhost)?;
    (!hosts.is_empty()).then_some((hosts, vhost))
}

fn consents(b: &Backend) -> bool {
    b.spec
        .rabbitmq
        .as_ref()
        .and_then(|r| r.shared_vhost)
        .unwrap_or(false)
}

/// Older first: by creation time, then namespace and name.
fn age(b: &Backend) -> (Option<i128>, String, String) {
    (
        b.creation_timestamp().map(|t| t.0.as_nanosecond()),
        b.namespace().unwrap_or_default(),
        b.name_any(),
    )
}

/// How `b`'s vhost is shared among `all` (the Backends this operator watches).
pub fn judge<'a>(b: &Backend, all: impl IntoIterator<Item = &'a Backend>) -> Sharing {
    let Some((hosts, vhost)) = b.spec.rabbitmq.as_ref().and_then(place) else {
        return Sharing::Alone;
    };
    let ns = b.namespace();
    let mut others = 0;
    let mut older_refusing = None;
    for o in all {
        if o.namespace() == ns || o.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let Some((o_hosts, o_vhost)) = o.spec.rabbitmq.as_ref().and_then(place) else {
            continue;
        };
        if o_vhost != vhost || o_hosts.is_disjoint(&hosts) {
            continue;
        }
        others += 1;
        if age(o) < age(b) && !(consents(b) && consents(o)) && older_refusing.is_none() {
            older_refusing = Some(consents(o));
        }
    }
    match older_refusing {
        Some(they_consent) => Sharing::Refused(format!(
            "vhost {vhost:?} on these brokers is used by an older Backend of another namespace: on \
             one vhost any tenant that may publish through the default exchange can write the \
             other's ledger and mark queues, so this Backend is not connected; give this \
             namespace a vhost of its own (spec.rabbitmq.vhost), or, to share it knowingly, set \
             spec.rabbitmq.sharedVhost: true on this Backend{}",
            if they_consent {
                ""
            } else {
                " and ask that namespace to set it on theirs"
            }
        )),
        None if others > 0 && consents(b) => Sharing::Consented { vhost, others },
        None => Sharing::Alone,
    }
}

/// [`judge`] over the operator's cache.
pub fn of(ctx: &Ctx, b: &Backend) -> Sharing {
    if b.spec.rabbitmq.is_none() {
        return Sharing::Alone;
    }
    let all = ctx.backends.state();
    judge(b, all.iter().map(AsRef::as_ref))
}

/// What a connected Backend on a consented shared vhost adds to its Ready message.
pub fn unprotected(vhost: &str, others: usize) -> String {
    format!(
        "vhost {vhost:?} is shared with {others} Backend(s) of other namespaces \
         (spec.rabbitmq.sharedVhost): their tenants can write this Backend's Subscriptions' \
         ledger, object-mark and adopted-mark queues through the default exchange, so a restart \
         may read a forged ledger and a takeover a forged mark; a vhost per namespace protects them"
    )
}

/// Connected on a vhost shared with consent: Ready, and what is not protected said (after the
/// plaintext warning, when there is one).
pub fn said(outcome: BackendOutcome, sharing: &Sharing) -> BackendOutcome {
    let Sharing::Consented { vhost, others } = sharing else {
        return outcome;
    };
    let note = unprotected(vhost, *others);
    match outcome {
        BackendOutcome::Connected {
            kind,
            version,
            detail,
        } => BackendOutcome::Warned {
            reason: reasons::SHARED_VHOST,
            message: format!(
                "{}; {note}",
                BackendOutcome::Connected {
                    kind,
                    version: version.clone(),
                    detail
                }
                .want()
                .message
            ),
            version,
        },
        BackendOutcome::Warned {
            reason,
            version,
            message,
        } => BackendOutcome::Warned {
            reason,
            version,
            message: format!("{message}; {note}"),
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use settle::api::BackendSpec;

    fn backend(
        ns: &str,
        name: &str,
        at: i64,
        url: &str,
        vhost: Option<&str>,
        share: bool,
    ) -> Backend {
        let mut b = Backend::new(
            name,
            BackendSpec {
                rabbitmq: Some(RabbitmqBackendSpec {
                    urls: vec![url.into()],
                    vhost: vhost.map(Into::into),
                    shared_vhost: share.then_some(true),
                    ..Default::default()
                }),
                ..Default::default()
            },
        );
        b.metadata.namespace = Some(ns.into());
        b.metadata.creation_timestamp = Some(Time(
            k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + at).expect("a time"),
        ));
        b
    }

    #[test]
    fn the_newer_backend_on_another_namespaces_vhost_is_refused_until_both_consent() {
        let a = backend("a", "r", 0, "amqp://rabbit:5672/%2f", None, false);
        let b = backend("b", "r", 1, "amqp://Rabbit:5672", Some("/"), false);
        let all = [a.clone(), b.clone()];
        assert_eq!(judge(&a, &all), Sharing::Alone, "the older keeps its place");
        let Sharing::Refused(m) = judge(&b, &all) else {
            panic!("the newer is refused")
        };
        assert!(m.contains("ask that namespace"), "{m}");
        // One side's consent is not enough.
        let b_consents = backend("b", "r", 1, "amqp://rabbit:5672", Some("/"), true);
        let all = [a.clone(), b_consents.clone()];
        assert!(matches!(judge(&b_consents, &all), Sharing::Refused(_)));
        let a_consents = backend("a", "r", 0, "amqp://rabbit:5672/%2f", None, true);
        let all = [a_consents.clone(), b_consents.clone()];
        assert_eq!(
            judge(&b_consents, &all),
            Sharing::Consented {
                vhost: "/".into(),
                others: 1
            }
        );
        assert_eq!(
            judge(&a_consents, &all),
            Sharing::Consented {
                vhost: "/".into(),
                others: 1
            }
        );
    }

    #[test]
    fn other_vhosts_other_brokers_and_the_same_namespace_share_nothing() {
        let a = backend("a", "r", 0, "amqp://rabbit:5672", Some("team-a"), false);
        let others = [
            backend("b", "r", 1, "amqp://rabbit:5672", Some("team-b"), false),
            backend("c", "r", 1, "amqp://other:5672", Some("team-a"), false),
            backend("a", "r2", 1, "amqp://rabbit:5672", Some("team-a"), false),
            backend("d", "r", 1, "amqp://rabbit:5671", Some("team-a"), false),
        ];
        for o in &others {
            assert_eq!(judge(o, [&a, o]), Sharing::Alone, "{:?}", o.spec);
        }
    }
}
