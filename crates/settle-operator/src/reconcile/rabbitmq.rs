//! The Subscription controller's broker step on RabbitMQ: the quorum queue from the one mapping
//! (`backend::rabbitmq::queue::desired`), bound to the Backend's exchange by the pattern; made
//! when missing (again when deleted on the broker), its binding repaired in place, an argument
//! RabbitMQ cannot change in place reported `ImmutableField` with the argument and its field
//! named; deleted when the Subscription goes. Under AtLeastOnce on a Backend with a dead-letter
//! exchange, the Backend's dead-letter copy queue is made and bound before the queue is made
//! (R9), so the account sees every dead letter of the queue from its start (the account keeps
//! it from then on, and deletes it).
//!
//! Only a queue this Subscription object made (or took over by the `settle.dev/adopt`
//! annotation) is bound or deleted; any other is left alone (`ConsumerConflict`): [`claim`]
//! decides, from the queue's owner and object arguments, the object mark
//! `settle.object.<ns>.<name>` (written before the queue is declared) and the status
//! (docs/semantics.md R8). A queue Settle did not make (no owner argument) is taken over only
//! when `spec.adopt: IfCompatible` asks, the namespace may (`--adopt-namespaces`), the management
//! API shows its arguments and they equal the mapping's; the owner and object arguments it cannot
//! take are then kept beside it, in `settle.adopted.<queue>`, and read in their place (R13). With the Backend's management API (spec.rabbitmq.managementUrl) the
//! live queue's arguments, bindings and owner are read and compared. Without it only AMQP is
//! there: a missing queue is made and, once the object mark says it is this object's, its binding
//! declared again on every check; a differing argument shows as the broker's refusal to
//! redeclare the queue; a queue that exists with no mark of this object is not Settle's.
//!
//! The account's queues of the Subscription (report, ledger, index) are made before its queue
//! (the account deletes them once the object is gone): each is a place under a vhost's
//! `max-queues`, so the limit refuses a Subscription whole, never its account alone.
//!
//! A paused Subscription has the marker exchange `settle.paused.<queue>` its applications check,
//! a running one `settle.running.<queue>` (`backend::rabbitmq::pause`, W3), kept as the spec
//! says and deleted with the queue.
//!
//! It must not write status or Events, add finalizers or decide requeues (the pipeline in
//! [`super::subscription`] does: this step returns what it changed, [`super::step`]), nor re-state an admission rule: the pipeline's one
//! `policy::validate` has refused what this broker cannot honour (`spec.stream`, A15) before
//! this step runs.

use super::Ctx;
use super::connections::RabbitConn;
use super::status::{ADOPT_ANNOTATION, BrokerError, Holder, ObjectKind, SubOutcome, Unadoptable};
use super::step::{Adoption, ChangeKind, Changes, Converged, Removal, Target};
use settle::api::ConsumerRef;
use settle::api::Mode;
use settle::backend::Classify;
use settle::backend::rabbitmq::admin::{self, AdminError};
use settle::backend::rabbitmq::deadletter;
use settle::backend::rabbitmq::pause;
use settle::backend::rabbitmq::queue::{self, Arg, OBJECT_ARG, OWNER_ARG, QueueSpec};
use settle::backend::rabbitmq::report::{self, AdoptedMark};

fn failure(error: BrokerError, known: Option<ConsumerRef>) -> SubOutcome {
    // Only while the broker cannot answer is the queue known from before still shown.
    let consumer = error.is_unreachable().then_some(known).flatten();
    SubOutcome::Broker { error, consumer }
}

/// The owner argument of a live queue, if it has one.
fn owner_of(arguments: &std::collections::BTreeMap<String, Arg>) -> Option<String> {
    match arguments.get(OWNER_ARG) {
        Some(Arg::Str(s)) => Some(s.clone()),
        Some(other) => Some(other.to_string()),
        None => None,
    }
}

/// The object argument (UID) of a live queue, if it has one.
fn object_of(arguments: &std::collections::BTreeMap<String, Arg>) -> Option<String> {
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
        unbind: Vec<queue::Binding>,
    },
}

/// Decides about a live queue that [`claim`] found ours (pure).
pub fn judge(want: &QueueSpec, live: &queue::LiveQueue) -> Verdict {
    let d = queue::diff(want, live);
    if !d.arguments.is_empty() {
        return Verdict::Immutable(d.arguments.iter().map(ToString::to_string).collect());
    }
    Verdict::Repair {
        bind: d.missing_binding,
        unbind: d.stale_bindings,
    }
}

/// What is on the broker under the queue's name.
enum Found {
    Missing,
    /// There; AMQP alone cannot show more.
    Exists,
    /// There, as the management API shows it.
    Shown(queue::LiveQueue),
}

/// Looks the queue up: over the management API when the Backend has one, else a passive declare.
async fn find(
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
async fn claim_found(
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
struct Whose {
    claim: Claim,
    /// The object mark, when it was read.
    mark: Option<String>,
    /// The queue was taken over without the owner argument; its adopted mark speaks for it.
    taken: bool,
}

/// Step 5 on RabbitMQ: the queue exists, is bound, and matches the spec, its pause marker
/// included, or why not.
pub async fn ensure(t: &Target<'_>, ctx: &Ctx, conn: &RabbitConn) -> Converged {
    let mut changes = Changes::default();
    let mut outcome = converge(t, ctx, conn, &mut changes).await;
    if let SubOutcome::Ready { object, .. } = &outcome
        && let Err(failed) = keep_paused(t, ctx, conn, object, &mut changes).await
    {
        outcome = failed;
    }
    changes.with(outcome)
}

/// The pause markers (semantics W3) as the spec says: while paused, `settle.paused.<queue>`
/// and no `settle.running.<queue>` (looked up on each check, made when missing: a pause lifted
/// by hand comes back); when resumed, the other way round, once; while running, the running
/// marker made once per connection (its applications' checks then answer without a refusal).
async fn keep_paused(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &RabbitConn,
    object: &ConsumerRef,
    changes: &mut Changes,
) -> Result<(), SubOutcome> {
    let queue = &object.name;
    let shown_paused = matches!(t.pause_shown.as_deref(), Some(s) if s != "False");
    let marked = || {
        conn.running_marked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(queue)
    };
    if !t.pause.is_paused() && !shown_paused && marked() {
        return Ok(());
    }
    let known = Some(object.clone());
    let broker = |e| failure(BrokerError::of(e), known.clone());
    let amqp = conn
        .connection()
        .await
        .map_err(|e| failure(BrokerError::of(e), known.clone()))?;
    let note_marked = |running: bool| {
        let mut m = conn
            .running_marked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if running {
            m.insert(queue.clone());
        } else {
            m.remove(queue);
        }
    };
    if t.pause.is_paused() {
        ctx.metrics.js("queue.pause_marker");
        // As an application that last saw it running asks: the running marker must be gone.
        if pause::is_paused(&amqp, queue, false)
            .await
            .map_err(broker)?
        {
            return Ok(());
        }
        ctx.metrics.js("queue.pause");
        pause::pause(&amqp, queue, &t.owner).await.map_err(broker)?;
        note_marked(false);
        let note = format!(
            "paused queue {queue} {}: made the marker exchange {} (and removed {}), every application stops consuming within its pause poll interval",
            t.pause.until_text(),
            pause::paused_marker(queue),
            pause::running_marker(queue)
        );
        tracing::info!(subscription = %t.owner, %queue, op = ChangeKind::Paused.op(), "{note}");
        changes.push(ChangeKind::Paused, note);
    } else if shown_paused {
        ctx.metrics.js("queue.resume");
        pause::resume(&amqp, queue, &t.owner)
            .await
            .map_err(broker)?;
        note_marked(true);
        let note = format!(
            "resumed queue {queue}: removed the marker exchange {}",
            pause::paused_marker(queue)
        );
        tracing::info!(subscription = %t.owner, %queue, op = ChangeKind::Resumed.op(), "{note}");
        changes.push(ChangeKind::Resumed, note);
    } else {
        ctx.metrics.js("queue.running_marker");
        pause::mark_running(&amqp, queue, &t.owner)
            .await
            .map_err(broker)?;
        note_marked(true);
    }
    Ok(())
}

async fn converge(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &RabbitConn,
    changes: &mut Changes,
) -> SubOutcome {
    let known = t.known.clone();
    let uid = t.uid();
    let policy = &t.policy;
    let want = queue::desired(&t.namespace, &t.name, policy, &conn.exchanges).for_object(uid);
    let here = ConsumerRef {
        stream: want.binding.exchange.clone(),
        name: want.name.clone(),
    };
    let ready = || SubOutcome::Ready {
        kind: ObjectKind::RabbitmqQueue,
        object: here.clone(),
    };
    // Refused for a limit before and its gate still closed: not a single broker call.
    let backend = (t.namespace.clone(), t.sub.spec.backend_ref.name.clone());
    let who = (t.namespace.clone(), t.name.clone());
    if let Some(limit) = ctx.conns.gates.held(&backend, &who) {
        return failure(BrokerError::Limit(limit), None);
    }
    let amqp = match conn.connection().await {
        Ok(c) => c,
        Err(e) => return failure(BrokerError::of(e), known),
    };
    let found = match find(ctx, conn, &amqp, &want.name).await {
        Ok(f) => f,
        Err(e) => return failure(e, known),
    };
    if matches!(found, Found::Missing) {
        if let Some(limit) = ctx
            .conns
            .gates
            .check(&backend, &want.binding.exchange, &who)
        {
            return failure(BrokerError::Limit(limit), None);
        }
        if policy.mode == Mode::AtLeastOnce {
            copy_dead_letters(t, ctx, conn, &amqp, &want).await;
        }
        return match create(t, ctx, &amqp, &want, &here).await {
            Ok(change) => {
                ctx.conns.gates.created(&backend, &want.binding.exchange);
                changes.push(change.kind, change.note);
                ready()
            }
            Err(o) => {
                if let SubOutcome::Broker { error, .. } = &o
                    && let Some(limit) = error.limit()
                {
                    let delay = ctx.conns.gates.refused(&backend, limit.clone(), &who);
                    tracing::info!(subscription = %t.owner, limit = limit.label(), retry_in = ?delay, "the broker refused the queue for a limit: creates it holds back wait");
                }
                o
            }
        };
    }
    let shown = known.as_ref().is_some_and(|k| k.name == want.name);
    let Whose {
        claim: claimed,
        mark,
        taken,
    } = claim_found(t, ctx, &amqp, &found, &want.name, shown).await;
    match &claimed {
        // Settle did not make it: taken over only as spec.adopt asks (R13).
        Claim::NotOurs(Holder::Unmarked) => {
            let owner = match (t.adoption(&ctx.adopt_namespaces), &found) {
                (Adoption::IfCompatible, Found::Shown(live)) => {
                    return adopt(t, ctx, conn, &amqp, &want, live, here, changes).await;
                }
                (Adoption::NotAllowed, _) => {
                    Holder::Unadoptable(Unadoptable::NamespaceNotAllowed(t.namespace.clone()))
                }
                _ => Holder::Unmarked,
            };
            return SubOutcome::Conflict {
                kind: ObjectKind::RabbitmqQueue,
                object: here,
                owner,
            };
        }
        Claim::NotOurs(holder) => {
            return SubOutcome::Conflict {
                kind: ObjectKind::RabbitmqQueue,
                object: here,
                owner: holder.clone(),
            };
        }
        Claim::Ours | Claim::Adopted(_) => {
            if !shown
                && mark.as_deref() != uid
                && let Err(o) = mark_object(t, ctx, &amqp).await
            {
                // Whose queue it is, written where the runtime reads it, first.
                return *o;
            }
        }
    }
    if let Claim::Adopted(old) = &claimed {
        // Taken over without arguments by the earlier object: its adopted mark names this one now.
        if taken && let Err(o) = mark_adopted(t, ctx, &amqp, &want.name).await {
            return *o;
        }
        let note = format!(
            "took over queue {} (with what it holds), left by the earlier Subscription of this name with uid {old}, as annotation {ADOPT_ANNOTATION} asked",
            want.name
        );
        tracing::info!(subscription = %t.owner, queue = %want.name, "{note}");
        changes.push(ChangeKind::Adopted, note);
    }
    let Found::Shown(live) = found else {
        // AMQP only: redeclare (refused when a compared argument differs) and bind again
        // (harmless when bound).
        ctx.metrics.js("queue.declare");
        match admin::declare(&amqp, &want).await {
            Ok(()) => {}
            Err(AdminError::Differs { text, .. }) => {
                return SubOutcome::Immutable {
                    kind: ObjectKind::RabbitmqQueue,
                    object: here,
                    fields: vec![format!(
                        "one of {} ({text})",
                        want.arguments
                            .keys()
                            .filter(|k| k.as_str() != OWNER_ARG && k.as_str() != OBJECT_ARG)
                            .cloned()
                            .collect::<Vec<_>>()
                            .join(", ")
                    )],
                };
            }
            Err(e) => return failure(BrokerError::of(e), known),
        }
        ctx.metrics.js("queue.bind");
        if let Err(e) = admin::bind(&amqp, &want.name, &want.binding).await {
            return failure(BrokerError::of(e), known);
        }
        return ready();
    };
    match judge(&want, &live) {
        Verdict::Immutable(fields) => SubOutcome::Immutable {
            kind: ObjectKind::RabbitmqQueue,
            object: here,
            fields,
        },
        Verdict::Repair { bind, unbind } => {
            let edits = match repair(ctx, &amqp, &want, bind, &unbind).await {
                Ok(edits) => edits,
                Err(e) => return failure(e, known),
            };
            if !edits.is_empty() {
                let edits = edits.join("; ");
                tracing::info!(subscription = %t.owner, queue = %want.name, changes = %edits, "repaired the queue's binding in place");
                changes.push(ChangeKind::Updated, format!("queue {}: {edits}", want.name));
            }
            ready()
        }
    }
}

/// The binding repairs [`judge`] asked for, done: what each did, as an Event says it.
async fn repair(
    ctx: &Ctx,
    amqp: &lapin::Connection,
    want: &QueueSpec,
    bind: bool,
    unbind: &[queue::Binding],
) -> Result<Vec<String>, BrokerError> {
    let mut edits = Vec::new();
    if bind {
        ctx.metrics.js("queue.bind");
        admin::bind(amqp, &want.name, &want.binding)
            .await
            .map_err(BrokerError::of)?;
        edits.push(format!(
            "bound it to exchange {} with {}",
            want.binding.exchange, want.binding.routing_key
        ));
    }
    for b in unbind {
        ctx.metrics.js("queue.unbind");
        admin::unbind(amqp, &want.name, b)
            .await
            .map_err(BrokerError::of)?;
        edits.push(format!(
            "removed its binding to {} with {}",
            b.exchange, b.routing_key
        ));
    }
    Ok(edits)
}

/// Marks queue `queue` as taken over by this object, beside it (R13).
async fn mark_adopted(
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
async fn adopt(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &RabbitConn,
    amqp: &lapin::Connection,
    want: &QueueSpec,
    live: &queue::LiveQueue,
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

/// Makes and binds the Backend's dead-letter copy queue, if it has a dead-letter exchange,
/// before the queue that dead-letters is made (R9): the account then sees that queue's dead
/// letters from its start. Afterwards the account keeps it (made again, bound again). A failure
/// is logged: the account says what it cannot count, and the queue does not wait for it.
async fn copy_dead_letters(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &RabbitConn,
    amqp: &lapin::Connection,
    want: &QueueSpec,
) {
    let Some(dlx) = &conn.exchanges.dead_letter else {
        return;
    };
    let ns = &t.namespace;
    let backend = &t.sub.spec.backend_ref.name;
    ctx.metrics.js("deadletters.copy");
    let copy = deadletter::ensure_copy(
        amqp,
        ns,
        backend,
        dlx,
        std::slice::from_ref(&want.binding.routing_key),
        ctx.dead_letter_copy_max_length,
    )
    .await;
    let who = &t.owner;
    match copy {
        Ok(
            deadletter::Copy::Whole { made: true } | deadletter::Copy::Partial { made: true, .. },
        ) => {
            tracing::info!(subscription = %who, queue = %deadletter::copy_queue(ns, backend), "made the Backend's dead-letter copy queue")
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(subscription = %who, error = %e, "cannot make the Backend's dead-letter copy queue")
        }
    }
}

/// Marks the Subscription's queue as made for this object (its UID), where the runtime reads it.
async fn mark_object(
    t: &Target<'_>,
    ctx: &Ctx,
    amqp: &lapin::Connection,
) -> Result<(), Box<SubOutcome>> {
    let Some(uid) = t.uid() else {
        return Ok(());
    };
    ctx.metrics.js("object.mark");
    report::mark_object(amqp, &t.namespace, &t.name, uid)
        .await
        .map_err(|e| {
            // The mark is a queue too: a vhost's queue limit refuses it first.
            let error = match admin::limit_of(&e.to_string()) {
                Some(l) => BrokerError::Limit(l),
                None => BrokerError::Unreachable(format!("cannot mark the queue's object: {e}")),
            };
            Box::new(failure(error, None))
        })
}

/// Makes the account's queues of the Subscription ([`report::account_queues`]) before its
/// own: each is a place under a vhost's `max-queues`, so a limit refuses the Subscription
/// before it holds a queue its account could not follow. Refused, it takes back what this call
/// declared that is empty and unused (a new Subscription's), so a refused Subscription holds no
/// place another could take (a refused declare closes only the channel opened for it).
async fn make_account_queues(
    t: &Target<'_>,
    ctx: &Ctx,
    amqp: &lapin::Connection,
) -> Result<(), Box<SubOutcome>> {
    let unreachable = |e: String| {
        Box::new(failure(
            BrokerError::Unreachable(format!("cannot make the account's queues: {e}")),
            None,
        ))
    };
    ctx.metrics.js("account.declare");
    let ch = amqp
        .create_channel()
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    let refused = match report::declare_account(&ch, &t.namespace, &t.name).await {
        Ok(()) => {
            let _ = ch.close(200, "made".into()).await;
            return Ok(());
        }
        Err(r) => r,
    };
    let Some(limit) = admin::limit_of(&refused.error.to_string()) else {
        return Err(unreachable(refused.to_string()));
    };
    for q in &refused.declared {
        ctx.metrics.js("account.take_back");
        if let Err(e) = admin::delete_if_idle(amqp, q).await {
            tracing::debug!(queue = %q, error = %e, "cannot take back an account queue a limit left alone");
        }
    }
    Err(Box::new(failure(BrokerError::Limit(limit), None)))
}

/// Declares and binds the queue, and says what it did: made for the first time, or again after
/// it was deleted on the broker.
async fn create(
    t: &Target<'_>,
    ctx: &Ctx,
    amqp: &lapin::Connection,
    want: &QueueSpec,
    here: &ConsumerRef,
) -> Result<super::step::Change, SubOutcome> {
    // The object mark first: a runtime that finds the queue finds whose it is, and so does the
    // next check without the management API (R8).
    let (ns, name, known) = (&t.namespace, &t.name, &t.known);
    ctx.metrics.js("object.read");
    let before = report::read_object(amqp, ns, name).await;
    make_account_queues(t, ctx, amqp).await.map_err(|o| *o)?;
    mark_object(t, ctx, amqp).await.map_err(|o| *o)?;
    ctx.metrics.js("queue.declare");
    match admin::declare(amqp, want).await {
        Ok(()) => {}
        Err(AdminError::Differs { text, .. }) => {
            // Made meanwhile by someone else, with other arguments: not this object's. The mark
            // written for it is taken back, so it claims nothing (R8); judged on the next check.
            let undone = match &before {
                Some(old) => report::mark_object(amqp, ns, name, old)
                    .await
                    .map_err(|e| e.to_string()),
                None => admin::delete(amqp, &report::object_queue(ns, name))
                    .await
                    .map_err(|e| e.to_string()),
            };
            if let Err(e) = undone {
                tracing::warn!(subscription = %t.owner, queue = %want.name, error = %e, "cannot take back the object mark of a queue made meanwhile by someone else");
            }
            return Err(failure(BrokerError::Refused(text), known.clone()));
        }
        Err(e) => return Err(failure(BrokerError::of(e), known.clone())),
    }
    ctx.metrics.js("queue.bind");
    if let Err(e) = admin::bind(amqp, &want.name, &want.binding).await {
        return Err(failure(BrokerError::of(e), known.clone()));
    }
    let again = known.as_ref() == Some(here);
    let (kind, note) = if again {
        (
            ChangeKind::Recreated,
            format!(
                "queue {} was missing from the broker (deleted there): made it again and bound it to {} with {}",
                want.name, want.binding.exchange, want.binding.routing_key
            ),
        )
    } else {
        (
            ChangeKind::Created,
            format!(
                "created quorum queue {} bound to {} with {}",
                want.name, want.binding.exchange, want.binding.routing_key
            ),
        )
    };
    tracing::info!(subscription = %t.owner, queue = %want.name, op = kind.op(), "queue");
    Ok(super::step::Change { kind, note })
}

/// The cleanup's broker call on RabbitMQ: deletes this Subscription's queue (with the messages
/// it holds), if it is there and this object's ([`claim`]): never a queue another made.
pub async fn remove(t: &Target<'_>, ctx: &Ctx, conn: &RabbitConn) -> Removal {
    let (ns, name, owner) = (&t.namespace, &t.name, &t.owner);
    let shown = &t.known;
    let queue_name = match shown {
        Some(c) => c.name.clone(),
        None => queue::queue_name(ns, name, &t.policy),
    };
    let amqp = match conn.connection().await {
        Ok(c) => c,
        Err(e) => return Removal::Wait(e.to_string()),
    };
    let found = match find(ctx, conn, &amqp, &queue_name).await {
        Ok(Found::Missing) => {
            // Gone already: its pause markers, named after it, go too.
            let _ = pause::forget(&amqp, &queue_name).await;
            return Removal::Nothing;
        }
        Ok(f) => f,
        Err(e) if e.is_unreachable() => return Removal::Wait(e.to_string()),
        Err(e) => return Removal::Failed(e.to_string()),
    };
    let whose = claim_found(t, ctx, &amqp, &found, &queue_name, shown.is_some()).await;
    if let Claim::NotOurs(holder) = whose.claim {
        tracing::info!(subscription = %owner, queue = %queue_name, holder = ?holder, "the queue is not this Subscription object's: left alone");
        return Removal::Nothing;
    }
    ctx.metrics.js("queue.delete");
    match admin::delete(&amqp, &queue_name).await {
        Ok(()) => {
            let object = report::object_queue(ns, name);
            if let Err(e) = admin::delete(&amqp, &object).await {
                tracing::debug!(queue = %object, error = %e, "cannot delete the object mark");
            }
            if whose.taken {
                let adopted = report::adopted_queue(&queue_name);
                if let Err(e) = admin::delete(&amqp, &adopted).await {
                    tracing::debug!(queue = %adopted, error = %e, "cannot delete the adopted mark");
                }
            }
            if let Err(e) = pause::forget(&amqp, &queue_name).await {
                tracing::debug!(queue = %queue_name, error = %e, "cannot delete the pause markers");
            }
            conn.running_marked
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&queue_name);
            tracing::info!(subscription = %owner, queue = %queue_name, "deleted the queue");
            // Two queues fewer in the vhost: a create its limit refused may go now (the
            // account's three go once the object is gone, and say so again, `Term::freed`).
            ctx.conns
                .gates
                .freed(&(ns.clone(), t.sub.spec.backend_ref.name.clone()), None);
            Removal::Deleted(format!(
                "deleted queue {queue_name} (with any messages it held)"
            ))
        }
        Err(e) if e.is_unreachable() => Removal::Wait(e.to_string()),
        Err(e) => Removal::Failed(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use settle::api::{DeliveryPolicy, Mode};
    use settle::backend::rabbitmq::queue::{Binding, Exchanges, LiveQueue};
    use settle::policy::ResolvedPolicy;

    fn want() -> QueueSpec {
        let p = ResolvedPolicy::resolve(&DeliveryPolicy {
            pattern: "orders.>".into(),
            mode: Mode::AtLeastOnce,
            durable_name: Some("orders".into()),
            max_deliver: Some(3),
            ..DeliveryPolicy::default()
        });
        queue::desired("shop", "orders", &p, &Exchanges::default())
    }

    fn live_of(q: &QueueSpec) -> LiveQueue {
        LiveQueue {
            arguments: q.arguments.clone(),
            bindings: vec![q.binding.clone()],
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
