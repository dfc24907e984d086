//! The one mapping from a Subscription to a RabbitMQ queue and its binding: [`desired`] (the
//! quorum queue Settle wants, with its arguments and the binding of the pattern), [`normalise`]
//! (a live queue's arguments as the management API shows them, in the same shape) and [`diff`]
//! (what differs, split into what a binding change repairs in place and what only a new queue
//! can change).
//!
//! The runtime declares code-defined queues with it and checks operator-made ones against it;
//! the operator's reconcile builds queues with it. Pure: no I/O. It must not decide what to do
//! about a difference (the callers do), and no other file may build queue arguments.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::api::Mode;
use crate::policy::ResolvedPolicy;

/// The exchange queues are bound to and messages published on, unless the Backend names one.
pub const DEFAULT_EXCHANGE: &str = "amq.topic";
/// The argument naming the Subscription (`namespace/name`) a queue belongs to. RabbitMQ stores
/// arguments it does not know and shows them in the management API; it never compares them.
pub const OWNER_ARG: &str = "x-settle-subscription";
/// The argument naming the Subscription object (its UID) the operator made a queue for
/// (docs/semantics.md R8). Set when the queue is made and never compared: RabbitMQ cannot change
/// it in place, so a queue taken over from an earlier object keeps that object's UID here.
pub const OBJECT_ARG: &str = "x-settle-object";
/// How long the broker keeps an unused queue that a code-defined subscription declared under a
/// derived name: no operator is there to delete it.
pub const CODE_DEFINED_EXPIRES: Duration = Duration::from_secs(300);

/// Where queues are bound and where exhausted messages go: the Backend's settings.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Exchanges {
    /// The topic exchange of every binding and every publish.
    pub exchange: String,
    /// The queues' `x-dead-letter-exchange`, when set.
    pub dead_letter: Option<String>,
}

impl Default for Exchanges {
    fn default() -> Self {
        Exchanges {
            exchange: DEFAULT_EXCHANGE.to_string(),
            dead_letter: None,
        }
    }
}

/// A queue argument's value, as AMQP and the management API both carry it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Arg {
    Str(String),
    Int(i64),
}

impl fmt::Display for Arg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Arg::Str(s) => write!(f, "{s:?}"),
            Arg::Int(n) => write!(f, "{n}"),
        }
    }
}

/// One binding of a queue: exchange and routing key.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Binding {
    pub exchange: String,
    pub routing_key: String,
}

/// A queue as Settle manages it: its name, every argument it sets, and its one binding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueSpec {
    /// The queue's name: durableName, or `settle_<namespace>_<name>`.
    pub name: String,
    /// Arguments, by name (always durable, never exclusive or auto-delete: a quorum queue).
    pub arguments: BTreeMap<String, Arg>,
    pub binding: Binding,
}

/// The queue name Settle uses for a Subscription: its `durableName`, or, without one (only
/// possible under AtMostOnce), a stable name from namespace and Subscription name. Kubernetes
/// names contain no `_`, so `settle_<namespace>_<name>` (with `.` as `_`) never collides.
pub fn queue_name(namespace: &str, subscription: &str, policy: &ResolvedPolicy) -> String {
    match &policy.durable_name {
        Some(durable) => durable.clone(),
        None => format!("settle_{namespace}_{}", subscription.replace('.', "_")),
    }
}

/// The topic-exchange routing key of a subject pattern: `*` (one word) stays `*`, `>` (the
/// rest) becomes `#`. RabbitMQ's `#` also matches zero words, so `orders.#` also routes a
/// message published on `orders` itself.
pub fn routing_key(pattern: &str) -> String {
    pattern
        .split('.')
        .map(|w| if w == ">" { "#" } else { w })
        .collect::<Vec<_>>()
        .join(".")
}

/// The queue Settle wants for Subscription `namespace/subscription`.
pub fn desired(
    namespace: &str,
    subscription: &str,
    policy: &ResolvedPolicy,
    exchanges: &Exchanges,
) -> QueueSpec {
    let alo = policy.mode == Mode::AtLeastOnce;
    let mut arguments = BTreeMap::from([
        ("x-queue-type".to_string(), Arg::Str("quorum".into())),
        (
            OWNER_ARG.to_string(),
            Arg::Str(format!("{namespace}/{subscription}")),
        ),
    ]);
    if alo {
        // A quorum queue drops (or dead-letters) a message returned more than x-delivery-limit
        // times: attempts = returns + 1, so maxDeliver N is a limit of N-1. The runtime rejects
        // the last declined attempt itself (counted Exhausted); the limit also stops attempts
        // spent with no handler (a channel closed mid-delivery).
        if let Some(max) = policy.max_deliver {
            arguments.insert(
                "x-delivery-limit".into(),
                Arg::Int(i64::from(max.saturating_sub(1))),
            );
        }
        if let Some(dlx) = &exchanges.dead_letter {
            arguments.insert("x-dead-letter-exchange".into(), Arg::Str(dlx.clone()));
        }
    }
    QueueSpec {
        name: queue_name(namespace, subscription, policy),
        arguments,
        binding: Binding {
            exchange: exchanges.exchange.clone(),
            routing_key: routing_key(&policy.pattern),
        },
    }
}

/// The queue a runtime with no operator declares for itself: [`desired`], except that one under
/// a derived name expires when unused (`x-expires`).
pub fn desired_by_runtime(
    namespace: &str,
    subscription: &str,
    policy: &ResolvedPolicy,
    exchanges: &Exchanges,
) -> QueueSpec {
    let mut q = desired(namespace, subscription, policy, exchanges);
    if policy.durable_name.is_none() {
        q.arguments.insert(
            "x-expires".into(),
            Arg::Int(i64::try_from(CODE_DEFINED_EXPIRES.as_millis()).unwrap_or(i64::MAX)),
        );
    }
    q
}

impl QueueSpec {
    /// The arguments as a `queue.declare` carries them.
    pub fn arguments_table(&self) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in &self.arguments {
            let v = match v {
                Arg::Str(s) => AMQPValue::LongString(LongString::from(s.as_str())),
                Arg::Int(n) => AMQPValue::LongLongInt(*n),
            };
            t.insert(ShortString::from(k.as_str()), v);
        }
        t
    }

    /// This queue marked as made for Subscription object `uid` (the operator's queues).
    pub fn for_object(mut self, uid: Option<&str>) -> Self {
        if let Some(uid) = uid {
            self.arguments
                .insert(OBJECT_ARG.to_string(), Arg::Str(uid.to_string()));
        }
        self
    }

    /// The Subscription (`namespace/name`) this queue belongs to, if Settle made it.
    pub fn owner(&self) -> Option<&str> {
        match self.arguments.get(OWNER_ARG) {
            Some(Arg::Str(s)) => Some(s),
            _ => None,
        }
    }
}

/// A live queue as the management API shows it (`GET /api/queues/<vhost>/<name>` and its
/// bindings).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LiveQueue {
    pub arguments: BTreeMap<String, Arg>,
    pub bindings: Vec<Binding>,
    /// Its `state` in the management API (`running`, `down`, …); none where no process has
    /// reported statistics for it yet, or none runs it.
    pub state: Option<String>,
}

/// A live queue's `arguments` object in the shape of [`QueueSpec::arguments`]: whole numbers as
/// integers, strings as strings, anything else as its JSON text.
pub fn normalise(arguments: &serde_json::Map<String, serde_json::Value>) -> BTreeMap<String, Arg> {
    arguments
        .iter()
        .map(|(k, v)| {
            let a = match v {
                serde_json::Value::String(s) => Arg::Str(s.clone()),
                serde_json::Value::Number(n) if n.as_i64().is_some() => {
                    Arg::Int(n.as_i64().unwrap_or_default())
                }
                other => Arg::Str(other.to_string()),
            };
            (k.clone(), a)
        })
        .collect()
}

/// One argument that differs between the desired and the live queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArgDiff {
    pub argument: String,
    /// The Subscription or Backend field it comes from, when there is one.
    pub spec_field: Option<&'static str>,
    pub desired: Option<Arg>,
    pub live: Option<Arg>,
}

impl fmt::Display for ArgDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |a: &Option<Arg>| a.as_ref().map_or("none".to_string(), Arg::to_string);
        write!(f, "{}", self.argument)?;
        if let Some(spec) = self.spec_field {
            write!(f, " ({spec})")?;
        }
        write!(
            f,
            ": wants {}, the queue has {}",
            show(&self.desired),
            show(&self.live)
        )
    }
}

/// What differs between a desired and a live queue.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Diff {
    /// Arguments that differ. RabbitMQ cannot change a queue's arguments in place: only a new
    /// queue (or a broker policy) can.
    pub arguments: Vec<ArgDiff>,
    /// The binding of the pattern is missing (repaired in place with `queue.bind`).
    pub missing_binding: bool,
    /// Bindings on Settle's exchange with another routing key (an old pattern), removed in place
    /// with `queue.unbind`. Bindings on other exchanges are not Settle's and are left alone.
    pub stale_bindings: Vec<Binding>,
}

impl Diff {
    pub fn is_empty(&self) -> bool {
        self.arguments.is_empty() && !self.missing_binding && self.stale_bindings.is_empty()
    }
}

/// The Subscription or Backend field each argument comes from.
fn spec_field(argument: &str) -> Option<&'static str> {
    match argument {
        "x-delivery-limit" => Some("spec.maxDeliver"),
        "x-dead-letter-exchange" => Some("Backend spec.rabbitmq.deadLetterExchange"),
        "x-queue-type" => Some("spec.mode"),
        _ => None,
    }
}

/// What differs between `want` (from [`desired`]) and `live` (from [`normalise`] and the
/// management API's bindings).
pub fn diff(want: &QueueSpec, live: &LiveQueue) -> Diff {
    let mut d = Diff::default();
    let names: std::collections::BTreeSet<&String> =
        want.arguments.keys().chain(live.arguments.keys()).collect();
    // The marks say whose the queue is, not what it is: the owner is judged before (R8), the
    // object mark is set once, when the queue is made, and a queue taken over (R13) has
    // neither. Never a difference.
    for name in names
        .into_iter()
        .filter(|n| n.as_str() != OBJECT_ARG && n.as_str() != OWNER_ARG)
    {
        let (a, b) = (want.arguments.get(name), live.arguments.get(name));
        if a != b {
            d.arguments.push(ArgDiff {
                argument: name.clone(),
                spec_field: spec_field(name),
                desired: a.cloned(),
                live: b.cloned(),
            });
        }
    }
    d.missing_binding = !live.bindings.contains(&want.binding);
    d.stale_bindings = live
        .bindings
        .iter()
        .filter(|b| b.exchange == want.binding.exchange && **b != want.binding)
        .cloned()
        .collect();
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::DeliveryPolicy;

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

    fn args(pairs: &[(&str, Arg)]) -> BTreeMap<String, Arg> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    fn s(v: &str) -> Arg {
        Arg::Str(v.into())
    }

    #[test]
    fn routing_keys_keep_star_and_turn_the_tail_into_hash() {
        let cases = [
            ("orders.created", "orders.created"),
            ("orders.*", "orders.*"),
            ("orders.>", "orders.#"),
            ("*.created", "*.created"),
            ("*.*.>", "*.*.#"),
            (">", "#"),
            ("a.*.c.>", "a.*.c.#"),
            // Only a whole word is a wildcard.
            ("a>b.c", "a>b.c"),
            ("orders.>x", "orders.>x"),
        ];
        for (pattern, key) in cases {
            assert_eq!(routing_key(pattern), key, "{pattern}");
        }
    }

    #[test]
    fn at_least_once_maps_max_deliver_to_a_delivery_limit_one_lower() {
        // A quorum queue with x-delivery-limit L delivers a message L+1 times.
        let cases = [(1, 0), (2, 1), (3, 2), (10, 9)];
        for (max_deliver, limit) in cases {
            let q = desired(
                "shop",
                "orders",
                &policy(|p| p.max_deliver = Some(max_deliver)),
                &Exchanges::default(),
            );
            assert_eq!(
                q.arguments.get("x-delivery-limit"),
                Some(&Arg::Int(limit)),
                "maxDeliver {max_deliver}"
            );
        }
    }

    #[test]
    fn at_least_once_maps_every_field() {
        let ex = Exchanges {
            exchange: "events".into(),
            dead_letter: Some("dead".into()),
        };
        let q = desired("shop", "orders", &policy(|p| p.max_deliver = Some(5)), &ex);
        assert_eq!(q.name, "orders");
        assert_eq!(
            q.arguments,
            args(&[
                ("x-queue-type", s("quorum")),
                ("x-delivery-limit", Arg::Int(4)),
                ("x-dead-letter-exchange", s("dead")),
                (OWNER_ARG, s("shop/orders")),
            ])
        );
        assert_eq!(
            q.binding,
            Binding {
                exchange: "events".into(),
                routing_key: "orders.#".into()
            }
        );
        assert_eq!(q.owner(), Some("shop/orders"));
    }

    #[test]
    fn without_max_deliver_there_is_no_limit() {
        let q = desired("shop", "orders", &policy(|_| {}), &Exchanges::default());
        assert!(!q.arguments.contains_key("x-delivery-limit"), "{q:?}");
        assert_eq!(q.binding.exchange, "amq.topic");
    }

    #[test]
    fn at_most_once_has_a_derived_name_no_limit_and_no_dead_letters() {
        let ex = Exchanges {
            exchange: "amq.topic".into(),
            dead_letter: Some("dead".into()),
        };
        let p = policy(|p| {
            p.mode = Mode::AtMostOnce;
            p.durable_name = None;
            p.max_deliver = Some(3);
        });
        let a = desired("shop", "orders.eu", &p, &ex);
        assert_eq!(a, desired("shop", "orders.eu", &p, &ex), "stable");
        assert_eq!(a.name, "settle_shop_orders_eu");
        assert_eq!(
            a.arguments,
            args(&[
                ("x-queue-type", s("quorum")),
                (OWNER_ARG, s("shop/orders.eu"))
            ])
        );
        assert_ne!(desired("other", "orders.eu", &p, &ex).name, a.name);
    }

    #[test]
    fn the_runtime_lets_a_derived_queue_expire_and_keeps_a_named_one() {
        let derived = policy(|p| {
            p.mode = Mode::AtMostOnce;
            p.durable_name = None;
        });
        let q = desired_by_runtime("shop", "o", &derived, &Exchanges::default());
        assert_eq!(q.arguments.get("x-expires"), Some(&Arg::Int(300_000)));
        let named = policy(|_| {});
        let q = desired_by_runtime("shop", "o", &named, &Exchanges::default());
        assert_eq!(q, desired("shop", "o", &named, &Exchanges::default()));
    }

    #[test]
    fn the_declare_table_carries_every_argument_with_its_type() {
        let q = desired(
            "shop",
            "orders",
            &policy(|p| p.max_deliver = Some(3)),
            &Exchanges::default(),
        );
        let t = q.arguments_table();
        let inner = t.inner();
        assert_eq!(inner.len(), q.arguments.len());
        assert_eq!(
            inner.get(&ShortString::from("x-delivery-limit")),
            Some(&AMQPValue::LongLongInt(2))
        );
        assert_eq!(
            inner.get(&ShortString::from("x-queue-type")),
            Some(&AMQPValue::LongString(LongString::from("quorum")))
        );
    }

    fn live_of(q: &QueueSpec) -> LiveQueue {
        // What the management API shows for a queue declared from `q`.
        let json = serde_json::to_value(
            q.arguments
                .iter()
                .map(|(k, v)| {
                    let v = match v {
                        Arg::Str(s) => serde_json::Value::from(s.clone()),
                        Arg::Int(n) => serde_json::Value::from(*n),
                    };
                    (k.clone(), v)
                })
                .collect::<serde_json::Map<_, _>>(),
        )
        .unwrap();
        LiveQueue {
            arguments: normalise(json.as_object().unwrap()),
            bindings: vec![q.binding.clone()],
            state: Some("running".into()),
        }
    }

    #[test]
    fn a_queue_made_from_the_mapping_shows_no_difference() {
        for p in [
            policy(|_| {}),
            policy(|p| p.max_deliver = Some(4)),
            policy(|p| {
                p.mode = Mode::AtMostOnce;
                p.durable_name = None;
            }),
        ] {
            let q = desired_by_runtime("shop", "o", &p, &Exchanges::default());
            let d = diff(&q, &live_of(&q));
            assert!(d.is_empty(), "{d:?}");
        }
    }

    #[test]
    fn the_object_mark_is_carried_but_never_a_difference() {
        let q =
            desired("shop", "o", &policy(|_| {}), &Exchanges::default()).for_object(Some("u-1"));
        assert_eq!(q.arguments.get(OBJECT_ARG), Some(&s("u-1")));
        let mut other = live_of(&q);
        other.arguments.insert(OBJECT_ARG.into(), s("u-0"));
        assert!(diff(&q, &other).is_empty(), "taken over from u-0");
        other.arguments.remove(OBJECT_ARG);
        assert!(
            diff(&q, &other).is_empty(),
            "made before queues carried a UID"
        );
    }

    #[test]
    fn differences_name_the_argument_and_the_field() {
        let want = desired(
            "shop",
            "o",
            &policy(|p| p.max_deliver = Some(5)),
            &Exchanges::default(),
        );
        type Change = Box<dyn Fn(&mut LiveQueue)>;
        let cases: Vec<(&str, Change, &str)> = vec![
            (
                "another limit",
                Box::new(|l| {
                    l.arguments.insert("x-delivery-limit".into(), Arg::Int(9));
                }),
                "x-delivery-limit (spec.maxDeliver): wants 4, the queue has 9",
            ),
            (
                "no limit",
                Box::new(|l| {
                    l.arguments.remove("x-delivery-limit");
                }),
                "x-delivery-limit (spec.maxDeliver): wants 4, the queue has none",
            ),
            (
                "a classic queue",
                Box::new(|l| {
                    l.arguments.insert("x-queue-type".into(), s("classic"));
                }),
                "x-queue-type (spec.mode): wants \"quorum\", the queue has \"classic\"",
            ),
            (
                "an argument Settle does not set",
                Box::new(|l| {
                    l.arguments.insert("x-max-length".into(), Arg::Int(10));
                }),
                "x-max-length: wants none, the queue has 10",
            ),
        ];
        for (name, change, text) in cases {
            let mut live = live_of(&want);
            change(&mut live);
            let d = diff(&want, &live);
            assert_eq!(d.arguments.len(), 1, "{name}: {d:?}");
            assert_eq!(d.arguments[0].to_string(), text, "{name}");
            assert!(!d.missing_binding && d.stale_bindings.is_empty(), "{name}");
        }
    }

    #[test]
    fn a_changed_pattern_is_a_missing_binding_and_a_stale_one_on_settles_exchange_only() {
        let want = desired("shop", "o", &policy(|_| {}), &Exchanges::default());
        let old = Binding {
            exchange: "amq.topic".into(),
            routing_key: "orders.created".into(),
        };
        let foreign = Binding {
            exchange: "audit".into(),
            routing_key: "#".into(),
        };
        let mut live = live_of(&want);
        live.bindings = vec![old.clone(), foreign];
        let d = diff(&want, &live);
        assert!(d.arguments.is_empty());
        assert!(d.missing_binding);
        assert_eq!(d.stale_bindings, vec![old]);
    }

    #[test]
    fn management_api_values_normalise_to_the_mapping_types() {
        let json = serde_json::json!({
            "x-queue-type": "quorum", "x-delivery-limit": 2, "x-weird": true, "x-ratio": 0.5
        });
        let n = normalise(json.as_object().unwrap());
        assert_eq!(n["x-queue-type"], s("quorum"));
        assert_eq!(n["x-delivery-limit"], Arg::Int(2));
        assert_eq!(n["x-weird"], s("true"));
        assert_eq!(n["x-ratio"], s("0.5"));
    }
}
