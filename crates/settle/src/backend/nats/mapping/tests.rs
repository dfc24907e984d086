//! The table tests of `mapping` (its pure rules, case by case).

use super::*;
use crate::api::{self, DeliveryPolicy, SlowHandler};

fn policy(f: impl FnOnce(&mut DeliveryPolicy)) -> ResolvedPolicy {
    let mut p = DeliveryPolicy {
        pattern: "orders.>".into(),
        mode: Mode::AtLeastOnce,
        durable_name: Some("orders".into()),
        ..DeliveryPolicy::default()
    };
    f(&mut p);
    ResolvedPolicy::resolve(&p)
}

fn server_view(c: &ConsumerConfig) -> ConsumerConfig {
    // What a server returns for a consumer created from `c`: the request's config, with the
    // server's own metadata added.
    let mut live = c.to_server();
    live.metadata.insert("_nats.req.level".into(), "0".into());
    live.metadata.insert("_nats.ver".into(), "2.15.3".into());
    normalise(&c.stream, &c.name, &live)
}

#[test]
fn at_least_once_maps_every_policy_field() {
    let p = policy(|p| {
        p.max_deliver = Some(5);
        p.ack_wait = Some(api::Duration::from_secs(10));
        p.max_in_flight = Some(7);
    });
    let c = desired("shop", "orders", "ORDERS", &p);
    assert_eq!(c.name, "orders");
    assert_eq!(c.stream, "ORDERS");
    assert_eq!(c.ack_policy, AckPolicy::Explicit);
    assert_eq!(c.deliver_policy, DeliverPolicy::All);
    assert_eq!(c.ack_wait, Duration::from_secs(10));
    assert_eq!(c.max_deliver, 5);
    assert_eq!(c.max_ack_pending, 7);
    assert_eq!(c.filter_subject, "orders.>");
    assert!(c.backoff.is_empty(), "never a backoff list");
    assert_eq!(c.owner(), Some("shop/orders"));
}

#[test]
fn defaults_are_safe_thirty_seconds_unlimited_and_the_prefetch_default() {
    let c = desired("shop", "orders", "ORDERS", &policy(|_| {}));
    assert_eq!(c.ack_wait, Duration::from_secs(30));
    assert_eq!(c.max_deliver, -1);
    assert_eq!(c.max_ack_pending, 250);
}

#[test]
fn at_most_once_gets_a_stable_derived_name_and_no_acks() {
    let p = policy(|p| {
        p.mode = Mode::AtMostOnce;
        p.durable_name = None;
    });
    let a = desired("shop", "orders.eu", "ORDERS", &p);
    let b = desired("shop", "orders.eu", "ORDERS", &p);
    assert_eq!(a, b, "the same Subscription maps to the same consumer");
    assert_eq!(a.name, "settle_shop_orders_eu");
    assert_eq!(a.ack_policy, AckPolicy::None);
    assert_eq!(a.deliver_policy, DeliverPolicy::New);
    assert_eq!(a.max_deliver, -1);
    assert_ne!(
        desired("other", "orders.eu", "ORDERS", &p).name,
        a.name,
        "namespaces do not share consumers"
    );
}

#[test]
fn derived_names_never_collide_across_namespace_and_name_boundaries() {
    let p = policy(|p| {
        p.mode = Mode::AtMostOnce;
        p.durable_name = None;
    });
    // Kubernetes namespaces have no '.' or '_', names no '_': the first '_' after the prefix
    // ends the namespace.
    let names: Vec<String> = [("a-b", "c"), ("a", "b-c"), ("a", "b.c"), ("a-b", "c.d")]
        .iter()
        .map(|(ns, n)| consumer_name(ns, n, &p))
        .collect();
    let mut unique = names.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), names.len(), "{names:?}");
}

#[test]
fn what_the_server_returns_for_a_desired_consumer_compares_equal() {
    for p in [
        policy(|_| {}),
        policy(|p| p.max_deliver = Some(3)),
        policy(|p| {
            p.mode = Mode::AtMostOnce;
            p.durable_name = None;
        }),
        policy(|p| p.slow_handler = Some(SlowHandler::Redeliver)),
    ] {
        let want = desired("shop", "orders", "ORDERS", &p);
        let live = server_view(&want);
        assert_eq!(diff(&want, &live), Diff::default(), "{p:?}");
    }
}

#[test]
fn normalise_fills_the_defaults_the_server_applies() {
    let want = desired("shop", "orders", "ORDERS", &policy(|_| {}));
    let mut sent = want.to_server();
    // A consumer created by someone else with nothing but the essentials: the server fills
    // ack wait, max deliver, max ack pending and max waiting itself.
    sent.ack_wait = Duration::ZERO;
    sent.max_deliver = 0;
    sent.max_ack_pending = 0;
    sent.max_waiting = 0;
    let live = normalise("ORDERS", "orders", &sent);
    assert_eq!(live.ack_wait, Duration::from_secs(30));
    assert_eq!(live.max_deliver, -1);
    assert_eq!(live.max_ack_pending, 1000);
    assert_eq!(live.max_waiting, 512);
}

#[test]
fn a_single_filter_in_filter_subjects_is_the_filter_subject() {
    let want = desired("shop", "orders", "ORDERS", &policy(|_| {}));
    let mut sent = want.to_server();
    sent.filter_subject = String::new();
    sent.filter_subjects = vec!["orders.>".into()];
    assert!(diff(&want, &normalise("ORDERS", "orders", &sent)).is_empty());
}

#[test]
fn editable_fields_are_editable_and_identity_fields_are_not() {
    let base = desired("shop", "orders", "ORDERS", &policy(|_| {}));
    type Edit = Box<dyn Fn(&mut ConsumerConfig)>;
    let cases: Vec<(&str, Edit, bool)> = vec![
        (
            "ack_wait",
            Box::new(|c| c.ack_wait = Duration::from_secs(5)),
            true,
        ),
        ("max_deliver", Box::new(|c| c.max_deliver = 9), true),
        ("max_ack_pending", Box::new(|c| c.max_ack_pending = 1), true),
        (
            "filter_subject",
            Box::new(|c| c.filter_subject = "x.>".into()),
            true,
        ),
        (
            "backoff",
            Box::new(|c| c.backoff = vec![Duration::from_secs(1)]),
            true,
        ),
        (
            "description",
            Box::new(|c| c.description = "edited".into()),
            true,
        ),
        (
            "metadata",
            Box::new(|c| {
                c.metadata.clear();
            }),
            true,
        ),
        (
            "inactive_threshold",
            Box::new(|c| c.inactive_threshold = Duration::from_secs(60)),
            true,
        ),
        (
            "ack_policy",
            Box::new(|c| c.ack_policy = AckPolicy::None),
            false,
        ),
        (
            "deliver_policy",
            Box::new(|c| c.deliver_policy = DeliverPolicy::New),
            false,
        ),
        ("durable_name", Box::new(|c| c.name = "other".into()), false),
        ("stream", Box::new(|c| c.stream = "OTHER".into()), false),
        ("deliver_subject", Box::new(|c| c.push = true), false),
        ("max_waiting", Box::new(|c| c.max_waiting = 1), false),
        (
            "replay_policy",
            Box::new(|c| c.replay_policy = ReplayPolicy::Original),
            false,
        ),
    ];
    for (field, edit, in_place) in cases {
        let mut live = base.clone();
        edit(&mut live);
        let d = diff(&base, &live);
        let (hit, other) = if in_place {
            (&d.editable, &d.immutable)
        } else {
            (&d.immutable, &d.editable)
        };
        assert_eq!(hit.len(), 1, "{field}: {d:?}");
        assert_eq!(hit[0].field, field);
        assert!(other.is_empty(), "{field}: {d:?}");
    }
}

#[test]
fn a_field_diff_says_which_spec_field_and_both_values() {
    let base = desired("shop", "orders", "ORDERS", &policy(|_| {}));
    let mut live = base.clone();
    live.max_deliver = 3;
    let d = diff(&base, &live);
    assert_eq!(
        d.editable[0].to_string(),
        "max_deliver (spec.maxDeliver): wants -1, the consumer has 3"
    );
}

/// The admission rule on immutable fields and `diff` agree: an update the rule admits changes
/// only fields the server edits in place, and every update that changes a field only a new
/// consumer can change is refused by the rule.
#[test]
fn the_admission_rule_on_immutable_fields_and_diff_agree() {
    use crate::api::{BackendRef, Backoff, SubscriptionSpec};
    use crate::policy::{BackendKind, BackendView, capabilities_of, validate};

    let spec = |mode: Mode, durable: Option<&str>| SubscriptionSpec {
        backend_ref: BackendRef {
            name: "nats".into(),
        },
        stream: None,
        deletion_policy: Default::default(),
        adopt: Default::default(),
        paused: false,
        paused_until: None,
        policy: DeliveryPolicy {
            pattern: "orders.>".into(),
            mode,
            durable_name: durable.map(str::to_string),
            ..DeliveryPolicy::default()
        },
    };
    type Edit = fn(&mut SubscriptionSpec);
    let edits: &[(&str, Edit)] = &[
        ("nothing", |_| {}),
        ("pattern", |s| s.policy.pattern = "orders.eu.>".into()),
        ("maxDeliver", |s| s.policy.max_deliver = Some(4)),
        ("ackWait", |s| {
            s.policy.ack_wait = Some(api::Duration::from_secs(9))
        }),
        ("maxInFlight", |s| s.policy.max_in_flight = Some(3)),
        ("maxProcessingTime", |s| {
            s.policy.max_processing_time = Some(api::Duration::from_secs(600))
        }),
        ("slowHandler", |s| {
            s.policy.slow_handler = Some(SlowHandler::ExtendLease)
        }),
        ("backoff", |s| {
            s.policy.backoff = Some(Backoff {
                initial: api::Duration::from_secs(1),
                max: api::Duration::from_secs(10),
                multiplier: 2.0,
            })
        }),
        ("maxNackDelay", |s| {
            s.policy.max_nack_delay = Some(api::Duration::from_secs(30))
        }),
        ("stream", |s| s.stream = Some("OTHER".into())),
        ("durableName", |s| {
            s.policy.durable_name = Some("renamed".into())
        }),
        ("durableName removed", |s| s.policy.durable_name = None),
        ("mode", |s| {
            s.policy.mode = match s.policy.mode {
                Mode::AtLeastOnce => Mode::AtMostOnce,
                Mode::AtMostOnce => Mode::AtLeastOnce,
            }
        }),
        ("backendRef", |s| s.backend_ref.name = "other".into()),
        ("adopt", |s| s.adopt = crate::api::Adopt::IfCompatible),
    ];
    let caps = capabilities_of(BackendKind::Nats);
    let mapped = |s: &SubscriptionSpec| {
        desired(
            "shop",
            "orders",
            s.stream.as_deref().unwrap_or("ORDERS"),
            &ResolvedPolicy::resolve(&s.policy),
        )
    };
    let mut checked = 0;
    for base in [
        spec(Mode::AtLeastOnce, Some("orders")),
        spec(Mode::AtMostOnce, None),
        spec(Mode::AtMostOnce, Some("metrics")),
    ] {
        for (first, e1) in edits {
            for (second, e2) in edits {
                let mut new = base.clone();
                e1(&mut new);
                e2(&mut new);
                let verdict = validate(
                    &new,
                    Some(&base),
                    BackendView::Known {
                        name: "nats",
                        capabilities: &caps,
                    },
                );
                let immutable_refusal = verdict
                    .errors
                    .iter()
                    .any(|e| e.message.contains("cannot change from"));
                let d = diff(&mapped(&new), &mapped(&base));
                if !immutable_refusal {
                    assert!(
                        d.immutable.is_empty(),
                        "{first} + {second} on {:?}: admitted, but the consumer needs recreating: {:?}",
                        base.policy.mode,
                        d.immutable
                    );
                }
                if !d.immutable.is_empty() {
                    assert!(
                        immutable_refusal,
                        "{first} + {second}: diff says {:?} cannot change in place, admission let it through",
                        d.immutable
                    );
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 3 * edits.len() * edits.len());
}
