//! Whose a live RabbitMQ queue is (docs/semantics.md R8, R13): the owner and object arguments
//! and the marks beside them, the pure [`claim`] and [`judge`] (the live queue against the
//! mapping), the lookup over the management API or AMQP, and a takeover by `settle.dev/adopt`.
//! It must not create or delete a queue (`create`, `remove`).

use super::*;

/// The owner argument of a live queue, if it has one.
pub(super) fn owner_of(arguments: &std::collections::BTreeMap<String, Arg>) -> Option<String> {
    match arguments.get(OWNER_ARG) {
        Some(Arg::Str(s)) => Some(s.clone()),
        Some(other) => Some(other.to_string()),
        None => None,
    }
}

/// The object argument (UID) of a live queue, if it has one.
pub(super) fn object_of(arguments: &std::collections::BTreeMap<String, Arg>) -> Option<String> {
    match arguments.get(OBJECT_ARG) {
        Some(Arg::Str(s)) => Some(s.clone()),
        _ => None,
    }
}

/// The owner and object arguments of a live queue: its own, or, for a queue taken over without
/// them, what its adopted mark says in their place (R13; pure).
pub fn marks_of(
    arguments: &std::collections::BTreeMap<String, Arg>,
    adopted: Option<&AdoptedMark>,
) -> (Option<String>, Option<String>) {
    match (owner_of(arguments), adopted) {
        (None, Some(m)) => (Some(m.subscription.clone()), Some(m.uid.clone())),
        (owner, _) => (owner, object_of(arguments)),
    }
}

/// What Settle can know about whose an existing queue is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Evidence {
    /// The queue's owner argument; `Some` only where the management API showed the queue
    /// (`Some(None)`: it has none).
    pub owner_arg: Option<Option<String>>,
    /// The queue's object argument (a UID), as the management API showed it.
    pub object_arg: Option<String>,
    /// The UID the Subscription's object mark (`settle.object.<ns>.<name>`) holds.
    pub mark: Option<String>,
    /// This object's status names this queue: it made it, or took it over, before.
    pub shown: bool,
}

/// Whose a live queue is, for Subscription `owner` (`namespace/name`), object `uid`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// This object's: used, and deleted with it.
    Ours,
    /// Left by the earlier object of this name with this UID, taken over by the adopt
    /// annotation: from now on this object's.
    Adopted(String),
    /// Not this object's: neither bound nor deleted.
    NotOurs(Holder),
}

/// Decides whose a live queue is (pure; docs/semantics.md R8). The UID decides: a queue is this
/// object's when its object argument or the Subscription's object mark holds this UID, or this
/// object's status names it; one another object of this name made is taken over only when the
/// annotation `settle.dev/adopt` holds that object's UID. A queue with the owner argument and no
/// UID anywhere was made by a Settle from before UIDs: this Subscription's, as it was then. Without
/// the management API, a queue nothing marks is not Settle's.
pub fn claim(ev: &Evidence, owner: &str, uid: Option<&str>, adopt: Option<&str>) -> Claim {
    match &ev.owner_arg {
        Some(None) => return Claim::NotOurs(Holder::Unmarked),
        Some(Some(o)) if o != owner => return Claim::NotOurs(Holder::Other(o.clone())),
        _ => {}
    }
    let Some(uid) = uid else {
        // An object without a UID is no API object: nothing to tell apart.
        return Claim::Ours;
    };
    if ev.shown || ev.object_arg.as_deref() == Some(uid) || ev.mark.as_deref() == Some(uid) {
        return Claim::Ours;
    }
    match ev.mark.as_ref().or(ev.object_arg.as_ref()) {
        Some(old) if adopt == Some(old.as_str()) => Claim::Adopted(old.clone()),
        Some(old) => Claim::NotOurs(Holder::Earlier {
            owner: owner.to_string(),
            uid: old.clone(),
        }),
        None if ev.owner_arg.is_some() => Claim::Ours,
        None => Claim::NotOurs(Holder::Unproven),
    }
}

/// What to do with a queue that is ours, given the mapping's and what the management API shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Arguments differ (RabbitMQ cannot change them in place): each difference.
    Immutable(Vec<String>),
    /// As wanted, after these binding repairs (none: nothing to do).
    Repair {
        bind: bool,
        unbind: Vec<mapping::Binding>,
    },
}

/// Decides about a live queue that [`claim`] found ours (pure).
pub fn judge(want: &QueueSpec, live: &mapping::LiveQueue) -> Verdict {
    let d = mapping::diff(want, live);
    if !d.arguments.is_empty() {
        return Verdict::Immutable(d.arguments.iter().map(ToString::to_string).collect());
    }
    Verdict::Repair {
        bind: d.missing_binding,
        unbind: d.stale_bindings,
    }
}

/// What is on the broker under the queue's name.
pub(super) enum Found {
    Missing,
    /// There; AMQP alone cannot show more.
    Exists,
    /// There, as the management API shows it.
    Shown(mapping::LiveQueue),
}

/// Looks the queue up: over the management API when the Backend has one, else a passive declare.
pub(super) async fn find(
    ctx: &Ctx,
    conn: &RabbitConn,
    amqp: &lapin::Connection,
    name: &str,
) -> Result<Found, BrokerError> {
    match &conn.management {
        Some(m) => {
            ctx.metrics.js("queue.info");
            match m.queue(&conn.vhost, name).await {
                Ok(Some(l)) => Ok(Found::Shown(l)),
                Ok(None) => Ok(Found::Missing),
                Err(e) => Err(BrokerError::of(e)),
            }
        }
        None => {
            ctx.metrics.js("queue.exists");
            match admin::exists(amqp, name).await {
                Ok(true) => Ok(Found::Exists),
                Ok(false) => Ok(Found::Missing),
                Err(e) => Err(BrokerError::of(e)),
            }
        }
    }
}

/// Whose the queue found is, reading the object mark only when the queue itself cannot say.
/// A queue without the owner argument may have been taken over: its adopted mark is read then,
/// and speaks for the arguments (`taken`: it did).
pub(super) async fn claim_found(
    t: &Target<'_>,
    ctx: &Ctx,
    amqp: &lapin::Connection,
    found: &Found,
    queue: &str,
    shown: bool,
) -> Whose {
    let uid = t.uid();
    let mut ev = Evidence {
        shown,
        ..Evidence::default()
    };
    let mut taken = false;
    if let Found::Shown(live) = found {
        let adopted = if owner_of(&live.arguments).is_none() {
            ctx.metrics.js("adopted.read");
            report::read_adopted(amqp, queue).await
        } else {
            None
        };
        taken = adopted.is_some();
        let (owner, object) = marks_of(&live.arguments, adopted.as_ref());
        ev.owner_arg = Some(owner);
        ev.object_arg = object;
    }
    let settled = ev
        .owner_arg
        .as_ref()
        .is_some_and(|o| o.as_deref() != Some(t.owner.as_str()))
        || ev.object_arg.is_some() && ev.object_arg.as_deref() == uid;
    if !shown && !settled {
        // An unreadable mark is no mark: without the management API, not ours (fail safe).
        ctx.metrics.js("object.read");
        ev.mark = report::read_object(amqp, &t.namespace, &t.name).await;
    }
    Whose {
        claim: claim(&ev, &t.owner, uid, t.adopt()),
        mark: ev.mark.clone(),
        taken,
    }
}

/// Whose a queue found is ([`claim_found`]).
pub(super) struct Whose {
    pub(super) claim: Claim,
    /// The object mark, when it was read.
    pub(super) mark: Option<String>,
    /// The queue was taken over without the owner argument; its adopted mark speaks for it.
    pub(super) taken: bool,
}

/// Marks queue `queue` as taken over by this object, beside it (R13).
pub(super) async fn mark_adopted(
    t: &Target<'_>,
    ctx: &Ctx,
    amqp: &lapin::Connection,
    queue: &str,
) -> Result<(), Box<SubOutcome>> {
    let mark = AdoptedMark {
        subscription: t.owner.clone(),
        uid: t.uid().unwrap_or_default().to_string(),
    };
    ctx.metrics.js("adopted.mark");
    report::mark_adopted(amqp, queue, &mark).await.map_err(|e| {
        let error = match admin::limit_of(&e.to_string()) {
            Some(l) => BrokerError::Limit(l),
            None => BrokerError::Unreachable(format!("cannot mark the queue taken over: {e}")),
        };
        Box::new(failure(error, None))
    })
}

/// Takes over a queue Settle did not make whose arguments equal the mapping's (R13): marked
/// beside it as this object's (RabbitMQ cannot add the owner and object arguments in place) and
/// in the object mark (where the runtime reads the UID), the dead-letter copy made first under
/// AtLeastOnce (R9), and the binding brought to the spec. The queue and its messages stay as
/// they are.
#[allow(clippy::too_many_arguments)]
pub(super) async fn adopt(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &RabbitConn,
    amqp: &lapin::Connection,
    want: &QueueSpec,
    live: &mapping::LiveQueue,
    here: ConsumerRef,
    changes: &mut Changes,
) -> SubOutcome {
    let (bind, unbind) = match judge(want, live) {
        Verdict::Immutable(fields) => {
            return SubOutcome::Conflict {
                kind: ObjectKind::RabbitmqQueue,
                object: here,
                owner: Holder::Unadoptable(Unadoptable::Differs(fields)),
            };
        }
        Verdict::Repair { bind, unbind } => (bind, unbind),
    };
    if t.policy.mode == Mode::AtLeastOnce {
        copy_dead_letters(t, ctx, conn, amqp, want).await;
    }
    if let Err(o) = mark_adopted(t, ctx, amqp, &want.name).await {
        return *o;
    }
    if let Err(o) = mark_object(t, ctx, amqp).await {
        return *o;
    }
    let edits = match repair(ctx, amqp, want, bind, &unbind).await {
        Ok(edits) => edits,
        Err(e) => return failure(e, t.known.clone()),
    };
    let note = format!(
        "took over queue {}, which Settle did not make, as spec.adopt IfCompatible asked: the same queue, \
         with the messages it holds{}",
        want.name,
        if edits.is_empty() {
            String::new()
        } else {
            format!("; brought to the spec in place: {}", edits.join("; "))
        }
    );
    tracing::info!(subscription = %t.owner, queue = %want.name, op = ChangeKind::Adopted.op(), "{note}");
    changes.push(ChangeKind::Adopted, note);
    SubOutcome::Ready {
        kind: ObjectKind::RabbitmqQueue,
        object: here,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use settle::api::{DeliveryPolicy, Mode};
    use settle::backend::rabbitmq::mapping::{Binding, Exchanges, LiveQueue};
    use settle::policy::ResolvedPolicy;

    fn want() -> QueueSpec {
        let p = ResolvedPolicy::resolve(&DeliveryPolicy {
            pattern: "orders.>".into(),
            mode: Mode::AtLeastOnce,
            durable_name: Some("orders".into()),
            max_deliver: Some(3),
            ..DeliveryPolicy::default()
        });
        mapping::desired("shop", "orders", &p, &Exchanges::default())
    }

    fn live_of(q: &QueueSpec) -> LiveQueue {
        LiveQueue {
            arguments: q.arguments.clone(),
            bindings: vec![q.binding.clone()],
            state: Some("running".into()),
        }
    }

    #[test]
    fn a_queue_as_mapped_needs_nothing() {
        let w = want();
        assert_eq!(
            judge(&w, &live_of(&w)),
            Verdict::Repair {
                bind: false,
                unbind: vec![]
            }
        );
    }

    fn ev(owner: Option<Option<&str>>, object: Option<&str>, mark: Option<&str>) -> Evidence {
        Evidence {
            owner_arg: owner.map(|o| o.map(str::to_string)),
            object_arg: object.map(str::to_string),
            mark: mark.map(str::to_string),
            shown: false,
        }
    }

    #[test]
    fn another_owner_or_none_is_never_ours_whatever_else_says() {
        let o = "shop/orders";
        let mut e = ev(Some(Some("other/orders")), Some("u-1"), Some("u-1"));
        e.shown = true;
        assert_eq!(
            claim(&e, o, Some("u-1"), Some("u-1")),
            Claim::NotOurs(Holder::Other("other/orders".into()))
        );
        assert_eq!(
            claim(&ev(Some(None), None, Some("u-1")), o, Some("u-1"), None),
            Claim::NotOurs(Holder::Unmarked)
        );
    }

    #[test]
    fn the_uid_decides_and_a_leftover_is_taken_only_with_the_annotation() {
        let o = "shop/orders";
        let me = Some("u-1");
        let managed = Some(Some(o));
        // This object's: its UID on the queue, in the mark, or its status naming the queue.
        assert_eq!(claim(&ev(managed, me, None), o, me, None), Claim::Ours);
        assert_eq!(claim(&ev(None, None, me), o, me, None), Claim::Ours);
        let shown = Evidence {
            shown: true,
            ..Evidence::default()
        };
        assert_eq!(claim(&shown, o, me, None), Claim::Ours, "made before marks");
        // Taken over earlier: the queue keeps the old UID, the mark holds ours.
        assert_eq!(
            claim(&ev(managed, Some("u-0"), me), o, me, None),
            Claim::Ours
        );
        // An earlier object's (queue argument, or mark without the management API).
        for e in [ev(managed, Some("u-0"), None), ev(None, None, Some("u-0"))] {
            assert_eq!(
                claim(&e, o, me, None),
                Claim::NotOurs(Holder::Earlier {
                    owner: o.into(),
                    uid: "u-0".into(),
                }),
                "{e:?}"
            );
            assert_eq!(
                claim(&e, o, me, Some("u-9")),
                Claim::NotOurs(Holder::Earlier {
                    owner: o.into(),
                    uid: "u-0".into(),
                }),
                "another UID in the annotation takes nothing: {e:?}"
            );
            assert_eq!(claim(&e, o, me, Some("u-0")), Claim::Adopted("u-0".into()));
        }
        // The mark speaks for the Subscription now: newer than a queue argument.
        assert_eq!(
            claim(&ev(managed, Some("u-0"), Some("u-5")), o, me, Some("u-5")),
            Claim::Adopted("u-5".into())
        );
    }

    #[test]
    fn with_no_uid_anywhere_the_owner_argument_is_an_older_settles_and_amqp_alone_proves_nothing() {
        let o = "shop/orders";
        let me = Some("u-1");
        assert_eq!(
            claim(&ev(Some(Some(o)), None, None), o, me, None),
            Claim::Ours
        );
        assert_eq!(
            claim(&ev(None, None, None), o, me, None),
            Claim::NotOurs(Holder::Unproven),
            "another application's same-named queue without the management API"
        );
        assert_eq!(
            claim(&ev(None, None, None), o, me, Some("anything")),
            Claim::NotOurs(Holder::Unproven),
            "nothing to adopt: no UID to name"
        );
    }

    #[test]
    fn a_queue_taken_over_is_judged_by_its_adopted_mark_so_no_other_subscription_takes_it_again() {
        let o = "shop/orders";
        let me = Some("u-1");
        let hand: std::collections::BTreeMap<String, Arg> =
            [("x-queue-type".to_string(), Arg::Str("quorum".into()))].into();
        let by = |sub: &str, uid: &str| AdoptedMark {
            subscription: sub.into(),
            uid: uid.into(),
        };
        let judged = |adopted: Option<AdoptedMark>, owner: &str, adopt: Option<&str>| {
            let (owner_arg, object_arg) = marks_of(&hand, adopted.as_ref());
            let e = Evidence {
                owner_arg: Some(owner_arg),
                object_arg,
                ..Evidence::default()
            };
            claim(&e, owner, me, adopt)
        };
        assert_eq!(judged(None, o, None), Claim::NotOurs(Holder::Unmarked));
        assert_eq!(judged(Some(by(o, "u-1")), o, None), Claim::Ours);
        // Another namespace's Subscription of the same durableName: another's, never taken.
        assert_eq!(
            judged(Some(by("team-b/orders", "u-7")), o, Some("u-7")),
            Claim::NotOurs(Holder::Other("team-b/orders".into()))
        );
        // Taken over by an earlier object of this name and kept: the annotation, as ever.
        assert_eq!(
            judged(Some(by(o, "u-0")), o, None),
            Claim::NotOurs(Holder::Earlier {
                owner: o.into(),
                uid: "u-0".into()
            })
        );
        assert_eq!(
            judged(Some(by(o, "u-0")), o, Some("u-0")),
            Claim::Adopted("u-0".into())
        );
        // A queue's own arguments always speak first.
        let mut made = hand.clone();
        made.insert(OWNER_ARG.into(), Arg::Str("other/orders".into()));
        assert_eq!(
            marks_of(&made, Some(&by(o, "u-1"))),
            (Some("other/orders".into()), None)
        );
    }

    #[test]
    fn the_marks_are_never_a_difference_so_a_hand_made_queue_of_the_same_arguments_judges_as_mapped()
     {
        let w = want().for_object(Some("u-1"));
        let mut hand = live_of(&w);
        hand.arguments.remove(OWNER_ARG);
        hand.arguments.remove(OBJECT_ARG);
        hand.bindings.clear();
        assert_eq!(
            judge(&w, &hand),
            Verdict::Repair {
                bind: true,
                unbind: vec![]
            }
        );
    }

    #[test]
    fn a_changed_argument_is_immutable_and_names_the_field() {
        let w = want();
        let mut l = live_of(&w);
        l.arguments.insert("x-delivery-limit".into(), Arg::Int(9));
        l.bindings.clear();
        match judge(&w, &l) {
            Verdict::Immutable(f) => {
                assert_eq!(f.len(), 1);
                assert!(f[0].contains("spec.maxDeliver"), "{f:?}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_changed_pattern_is_repaired_in_place() {
        let w = want();
        let mut l = live_of(&w);
        let old = Binding {
            exchange: "amq.topic".into(),
            routing_key: "orders.created".into(),
        };
        let foreign = Binding {
            exchange: "audit".into(),
            routing_key: "#".into(),
        };
        l.bindings = vec![old.clone(), foreign];
        assert_eq!(
            judge(&w, &l),
            Verdict::Repair {
                bind: true,
                unbind: vec![old]
            }
        );
    }
}
