//! The copy of a Backend's dead letters the operator counts (docs/semantics.md R9–R12). A
//! quorum queue sends the messages it dead-letters to the Backend's dead-letter exchange
//! (`spec.rabbitmq.deadLetterExchange`): the runtime's rejected last attempts (`x-death` reason
//! `rejected`) and the last attempts a crash spent, which the queue dead-letters at its
//! `x-delivery-limit` (`delivery_limit`). One classic queue per Backend,
//! `settle.deadletters.<namespace>.<backend>`, is bound there beside the user's own queues, so
//! it receives a copy of each dead letter (an exchange routes a message to every matching
//! queue): the user's dead-letter queue keeps every message.
//!
//! Here: the copy queue's name and arguments, how to bind it for each exchange type (learned
//! with AMQP alone, [`exchange_kind`]), [`ensure_copy`] (the operator's one way to make and bind
//! it), and the pure reading of one dead letter ([`last_death`], [`counts_as_exhausted`],
//! [`message_id`]).
//!
//! It must not decide what a dead letter counts for (the account's ledger does) nor which
//! Subscription it belongs to (the account's keeper, by the queue the controller verified).

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Connection, ExchangeKind};

use super::admin::{AdminError, channel, classify, done, reply_code};

/// The argument that says which Backend a copy queue counts for (for people and the sweep).
pub const BACKEND_ARG: &str = "x-settle-backend";

/// The `x-death` reasons that are a message running out of attempts: the runtime's
/// `basic.reject` without requeue of a declined last attempt (it rejects nothing else without
/// requeue), and the quorum queue's own drop past `x-delivery-limit` (a last attempt no handler
/// settled: a crash, a closed channel). `expired` (a per-message TTL the publisher set) and
/// `maxlen` (a length limit a policy set) are not: those messages never ran out of attempts.
pub const EXHAUSTED_REASONS: [&str; 2] = ["rejected", "delivery_limit"];

/// The copy queue of Backend `namespace/backend`.
pub fn copy_queue(namespace: &str, backend: &str) -> String {
    format!("settle.deadletters.{namespace}.{backend}")
}

/// The copy queue's arguments: classic, at most `max_length` copies, the oldest dropped beyond
/// (the keeper notices a full queue and says the count may be short), tagged with its Backend.
pub fn copy_arguments(namespace: &str, backend: &str, max_length: i64) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in [
        ("x-queue-type", "classic".to_string()),
        ("x-overflow", "drop-head".to_string()),
        (BACKEND_ARG, format!("{namespace}/{backend}")),
    ] {
        t.insert(
            ShortString::from(k),
            AMQPValue::LongString(LongString::from(v)),
        );
    }
    t.insert(
        ShortString::from("x-max-length"),
        AMQPValue::LongLongInt(max_length),
    );
    t
}

/// An exchange's type, as far as copying its dead letters goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    Fanout,
    Topic,
    Direct,
    Headers,
    /// A plugin's type (`x-consistent-hash`, …), or one the broker would not say.
    Other(String),
}

/// How the copy queue is bound to a dead-letter exchange of `kind` so that it receives every
/// dead letter the exchange routes anywhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CopyBinding {
    /// One binding with this key (fanout: any key; topic: `#`).
    Key(String),
    /// A headers exchange: `x-match: all` with no header matches every message.
    AllHeaders,
    /// A direct exchange routes by the exact routing key, which a dead letter keeps from its
    /// publish: one binding per Subscription's routing key, exact only for patterns without
    /// wildcards.
    PerRoutingKey,
    /// No binding copies every dead letter.
    Impossible(String),
}

/// The binding that copies what a dead-letter exchange of `kind` routes.
pub fn copy_binding(kind: &Kind) -> CopyBinding {
    match kind {
        Kind::Fanout => CopyBinding::Key(String::new()),
        Kind::Topic => CopyBinding::Key("#".into()),
        Kind::Headers => CopyBinding::AllHeaders,
        Kind::Direct => CopyBinding::PerRoutingKey,
        Kind::Other(t) => CopyBinding::Impossible(format!(
            "the dead-letter exchange is of type {t:?}, which routes by rules no binding of the \
             operator's can copy"
        )),
    }
}

/// Whether a direct exchange's binding `key` receives every message a Subscription bound by
/// routing key `key` on the topic exchange receives: only when it has no wildcard.
pub fn literal(key: &str) -> bool {
    !key.split('.').any(|w| w == "*" || w == "#")
}

/// What [`ensure_copy`] could do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Copy {
    /// Every dead letter is copied. `made`: the queue was missing and is made now.
    Whole { made: bool },
    /// The queue is there, but some dead letters cannot be copied (why).
    Partial { made: bool, why: String },
    /// Nothing is copied (why): the exchange is missing or of a type no binding copies.
    None(String),
}

/// The type named by a refusal to redeclare an exchange with another type (`inequivalent arg
/// 'type' for exchange 'x' in vhost '/': received 'topic' but current is 'fanout'`).
pub fn current_type(refusal: &str) -> Option<String> {
    if !refusal.contains("'type'") {
        return None;
    }
    let rest = refusal.split("current is '").nth(1)?;
    rest.split('\'').next().map(str::to_string)
}

fn kind_of(name: &str) -> Kind {
    match name {
        "fanout" => Kind::Fanout,
        "topic" => Kind::Topic,
        "direct" => Kind::Direct,
        "headers" => Kind::Headers,
        other => Kind::Other(other.to_string()),
    }
}

/// The type of exchange `name` (`None`: it does not exist), with AMQP alone: a passive declare,
/// then a declare as a durable topic exchange, which RabbitMQ compares type first (an equal one
/// changes nothing; another type is refused naming the current one). Each on its own channel.
/// With the type `known` from an earlier look, only the passive declare: the refusal that
/// learns a type closes its channel, which the AMQP client logs as an error, so a caller that
/// looks again and again keeps the type and learns it again only now and then.
pub async fn exchange_kind(
    conn: &Connection,
    name: &str,
    known: Option<&Kind>,
) -> Result<Option<Kind>, AdminError> {
    let what = || format!("looking up exchange {name:?}");
    let ch = channel(conn).await?;
    let passive = ch
        .exchange_declare(
            ShortString::from(name),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    match passive {
        Ok(()) => {
            done(ch).await;
            if let Some(k) = known {
                return Ok(Some(k.clone()));
            }
        }
        Err(e) if reply_code(&e) == Some(404) => return Ok(None),
        Err(e) => return Err(classify(what(), &e)),
    }
    let ch = channel(conn).await?;
    let probe = ch
        .exchange_declare(
            ShortString::from(name),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    match probe {
        Ok(()) => {
            done(ch).await;
            Ok(Some(Kind::Topic))
        }
        Err(e) if reply_code(&e) == Some(406) => {
            // Type is compared first: any other inequivalence means it is a topic exchange.
            Ok(Some(
                current_type(&e.to_string()).map_or(Kind::Topic, |t| kind_of(&t)),
            ))
        }
        Err(e) if reply_code(&e) == Some(403) => Ok(Some(Kind::Other(
            "unknown (the operator's user may not configure it, so its type cannot be learned)"
                .into(),
        ))),
        Err(e) => Err(classify(what(), &e)),
    }
}

/// Makes Backend `namespace/backend`'s copy queue when it is missing (an existing one is kept
/// as it is: a changed bound applies to a queue made anew) and binds it to dead-letter exchange
/// `dlx` so it receives a copy of every dead letter; `keys` are the routing keys of the
/// Backend's Subscriptions (a direct exchange is bound once per literal one). `known`: the
/// exchange's type from an earlier look ([`exchange_kind`]). Returns what it could do and the
/// type it bound for (`None`: the exchange does not exist).
pub async fn ensure_copy(
    conn: &Connection,
    namespace: &str,
    backend: &str,
    dlx: &str,
    keys: &[String],
    max_length: i64,
    known: Option<&Kind>,
) -> Result<(Copy, Option<Kind>), AdminError> {
    let Some(kind) = exchange_kind(conn, dlx, known).await? else {
        return Ok((
            Copy::None(format!(
                "the dead-letter exchange {dlx:?} does not exist, so RabbitMQ drops what the \
                 queues dead-letter: declare it (and bind your dead-letter queue to it)"
            )),
            None,
        ));
    };
    let binding = copy_binding(&kind);
    if let CopyBinding::Impossible(why) = binding {
        return Ok((Copy::None(why), Some(kind)));
    }
    let name = copy_queue(namespace, backend);
    let made = !super::admin::exists(conn, &name).await?;
    let ch = channel(conn).await?;
    if made {
        declare_copy(&ch, &name, namespace, backend, max_length).await?;
    }
    let (binds, partial) = copy_binds(binding, dlx, keys);
    bind_copy(&ch, &name, dlx, binds).await?;
    done(ch).await;
    let copy = match partial {
        Some(why) => Copy::Partial { made, why },
        None => Copy::Whole { made },
    };
    Ok((copy, Some(kind)))
}

/// Declares the copy queue `name` on `ch`.
async fn declare_copy(
    ch: &lapin::Channel,
    name: &str,
    namespace: &str,
    backend: &str,
    max_length: i64,
) -> Result<(), AdminError> {
    ch.queue_declare(
        ShortString::from(name),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        copy_arguments(namespace, backend, max_length),
    )
    .await
    .map_err(|e| classify(format!("declaring queue {name:?}"), &e))?;
    Ok(())
}

/// The bindings (key, arguments) that make `binding` on dead-letter exchange `dlx`, for
/// Subscriptions bound by `keys`; and, when some dead letters cannot be copied, why.
fn copy_binds(
    binding: CopyBinding,
    dlx: &str,
    keys: &[String],
) -> (Vec<(String, FieldTable)>, Option<String>) {
    let mut binds: Vec<(String, FieldTable)> = Vec::new();
    let mut partial = None;
    match binding {
        CopyBinding::Key(k) => binds.push((k, FieldTable::default())),
        CopyBinding::AllHeaders => {
            let mut t = FieldTable::default();
            t.insert(
                ShortString::from("x-match"),
                AMQPValue::LongString(LongString::from("all")),
            );
            binds.push((String::new(), t));
        }
        CopyBinding::PerRoutingKey => {
            let mut wild = Vec::new();
            for k in keys {
                if literal(k) {
                    binds.push((k.clone(), FieldTable::default()));
                } else {
                    wild.push(k.clone());
                }
            }
            if !wild.is_empty() {
                partial = Some(format!(
                    "the dead-letter exchange {dlx:?} is a direct exchange, which routes a dead \
                     letter by its exact routing key: the dead letters of Subscriptions bound with \
                     wildcards ({}) cannot all be copied; make it a topic or fanout exchange",
                    wild.join(", ")
                ));
            }
        }
        CopyBinding::Impossible(_) => {}
    }
    (binds, partial)
}

/// Binds the copy queue `name` to `dlx` with each of `binds`, in order, on `ch`.
async fn bind_copy(
    ch: &lapin::Channel,
    name: &str,
    dlx: &str,
    binds: Vec<(String, FieldTable)>,
) -> Result<(), AdminError> {
    for (key, args) in binds {
        ch.queue_bind(
            ShortString::from(name),
            ShortString::from(dlx),
            ShortString::from(key.as_str()),
            QueueBindOptions::default(),
            args,
        )
        .await
        .map_err(|e| {
            classify(
                format!("binding queue {name:?} to {dlx:?} with {key:?}"),
                &e,
            )
        })?;
    }
    Ok(())
}

/// The dead-lettering that put a message where it is now: the newest `x-death` entry (RabbitMQ
/// keeps them newest first, one per queue and reason, with a count).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Death {
    /// The queue that dead-lettered it.
    pub queue: String,
    pub reason: String,
    /// How many times that queue dead-lettered it for that reason.
    pub count: i64,
    /// When (seconds; 0 when absent).
    pub time: u64,
    /// The exchange and routing keys it was published with (empty when absent).
    pub exchange: String,
    pub routing_keys: Vec<String>,
}

fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

fn int(v: &AMQPValue) -> Option<i64> {
    match v {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::Timestamp(n) => i64::try_from(*n).ok(),
        _ => None,
    }
}

/// The newest dead-lettering of a message, from its `x-death` header (or, without one, the
/// `x-first-death-queue` and `-reason` headers); `None` for a message never dead-lettered.
pub fn last_death(props: &BasicProperties) -> Option<Death> {
    let headers = props.headers().as_ref()?.inner();
    if let Some(AMQPValue::FieldArray(entries)) = headers.get(&ShortString::from("x-death"))
        && let Some(AMQPValue::FieldTable(head)) = entries.as_slice().first()
    {
        let h = head.inner();
        let get = |k: &str| h.get(&ShortString::from(k));
        return Some(Death {
            queue: get("queue").and_then(text)?,
            reason: get("reason").and_then(text)?,
            count: get("count").and_then(int).unwrap_or(1),
            time: get("time")
                .and_then(int)
                .and_then(|t| u64::try_from(t).ok())
                .unwrap_or(0),
            exchange: get("exchange").and_then(text).unwrap_or_default(),
            routing_keys: match get("routing-keys") {
                Some(AMQPValue::FieldArray(keys)) => {
                    keys.as_slice().iter().filter_map(text).collect()
                }
                _ => Vec::new(),
            },
        });
    }
    let get = |k: &str| headers.get(&ShortString::from(k)).and_then(text);
    Some(Death {
        queue: get("x-first-death-queue")?,
        reason: get("x-first-death-reason")?,
        count: 1,
        time: 0,
        exchange: get("x-first-death-exchange").unwrap_or_default(),
        routing_keys: Vec::new(),
    })
}

/// Whether a dead-lettering for `reason` is a message running out of attempts.
pub fn counts_as_exhausted(reason: &str) -> bool {
    EXHAUSTED_REASONS.contains(&reason)
}

/// What names one dead-lettering of one message, the same each time its copy is delivered
/// (redelivered after an operator stopped between saving its count and acknowledging it): the
/// queue, the dead-lettering's count and time (a message replayed from a dead-letter queue and
/// exhausted again is a new loss: its count grows), the exchange and routing keys it was
/// published with, the message's `message_id` (user producers may set none) and a hash of its
/// body (FNV-1a, stable across operator versions). Two messages alike in all of these (no id,
/// the same body and routing key, dead-lettered by one queue in the same second) get one name:
/// the account tells them apart by the redelivered flag (a first delivery always counts).
pub fn message_id(death: &Death, props: &BasicProperties, body: &[u8]) -> String {
    let body_hash = body.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!(
        "{}|{}|{}|{}|{}|{}|{body_hash:016x}",
        death.queue,
        death.count,
        death.time,
        death.exchange,
        death.routing_keys.join(","),
        props
            .message_id()
            .as_ref()
            .map(|s| s.as_str())
            .unwrap_or("")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::FieldArray;

    fn dead(entries: Vec<(&str, &str, i64, u64)>) -> BasicProperties {
        let arr: Vec<AMQPValue> = entries
            .into_iter()
            .map(|(q, r, c, t)| {
                let mut e = FieldTable::default();
                e.insert("queue".into(), AMQPValue::LongString(q.into()));
                e.insert("reason".into(), AMQPValue::LongString(r.into()));
                e.insert("count".into(), AMQPValue::LongLongInt(c));
                e.insert("time".into(), AMQPValue::Timestamp(t));
                AMQPValue::FieldTable(e)
            })
            .collect();
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(arr)),
        );
        BasicProperties::default().with_headers(h)
    }

    #[test]
    fn only_running_out_of_attempts_counts_as_exhausted() {
        // The runtime's reject of a declined last attempt, and the quorum queue's own drop past
        // x-delivery-limit (a crash spent the last attempt): both ran out of attempts.
        assert!(counts_as_exhausted("rejected"));
        assert!(counts_as_exhausted("delivery_limit"));
        // A publisher's per-message TTL, a policy's length limit: never ran out of attempts.
        assert!(!counts_as_exhausted("expired"));
        assert!(!counts_as_exhausted("maxlen"));
        assert!(!counts_as_exhausted(""));
    }

    #[test]
    fn the_newest_death_is_the_one_that_put_the_message_here() {
        let p = dead(vec![
            ("orders", "delivery_limit", 2, 1_700),
            ("orders-dlq", "expired", 1, 1_600),
        ]);
        assert_eq!(
            last_death(&p),
            Some(Death {
                queue: "orders".into(),
                reason: "delivery_limit".into(),
                count: 2,
                time: 1_700,
                exchange: String::new(),
                routing_keys: Vec::new(),
            })
        );
        let mut h = FieldTable::default();
        h.insert(
            "x-first-death-queue".into(),
            AMQPValue::LongString("orders".into()),
        );
        h.insert(
            "x-first-death-reason".into(),
            AMQPValue::LongString("rejected".into()),
        );
        let first = BasicProperties::default().with_headers(h);
        assert_eq!(
            last_death(&first).map(|d| d.reason),
            Some("rejected".into())
        );
        assert_eq!(last_death(&BasicProperties::default()), None);
    }

    #[test]
    fn a_dead_letter_keeps_its_key_and_a_second_exhaustion_gets_another() {
        let p = dead(vec![("orders", "rejected", 1, 1_700)]);
        let d = last_death(&p).expect("death");
        assert_eq!(message_id(&d, &p, b"a"), message_id(&d, &p, b"a"));
        assert_ne!(message_id(&d, &p, b"a"), message_id(&d, &p, b"b"));
        let again = dead(vec![("orders", "rejected", 2, 1_700)]);
        let d2 = last_death(&again).expect("death");
        assert_ne!(message_id(&d, &p, b"a"), message_id(&d2, &again, b"a"));
        let with_id = p.clone().with_message_id("m-1".into());
        assert_ne!(message_id(&d, &p, b"a"), message_id(&d, &with_id, b"a"));
    }

    #[test]
    fn each_exchange_type_gets_the_binding_that_copies_all_it_routes() {
        assert_eq!(copy_binding(&Kind::Fanout), CopyBinding::Key(String::new()));
        assert_eq!(copy_binding(&Kind::Topic), CopyBinding::Key("#".into()));
        assert_eq!(copy_binding(&Kind::Headers), CopyBinding::AllHeaders);
        assert_eq!(copy_binding(&Kind::Direct), CopyBinding::PerRoutingKey);
        assert!(matches!(
            copy_binding(&Kind::Other("x-consistent-hash".into())),
            CopyBinding::Impossible(_)
        ));
        assert!(literal("orders.created"));
        assert!(!literal("orders.#"));
        assert!(!literal("orders.*.eu"));
    }

    #[test]
    fn a_refused_redeclare_names_the_exchange_type() {
        let e = "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'dead' in vhost '/': \
                 received 'topic' but current is 'fanout'";
        assert_eq!(current_type(e), Some("fanout".into()));
        assert_eq!(
            current_type("PRECONDITION_FAILED - inequivalent arg 'durable' for exchange 'dead'"),
            None
        );
    }
}
