//! The Subscription controller's broker step on RabbitMQ: the quorum queue from the one mapping
//! (`backend::rabbitmq::mapping::desired`), bound to the Backend's exchange by the pattern; made
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
//! The files: this one is the step (`ensure`: converge, repair in place); [`claim`] says whose
//! a live queue is, [`create`] makes one, [`pause`] keeps its markers, [`remove`] deletes it.
//!
//! It must not write status or Events, add finalizers or decide requeues (the pipeline in
//! [`super::subscription`] does: this step returns what it changed, [`super::step`]), nor re-state an admission rule: the pipeline's one
//! `policy::validate` has refused what this broker cannot honour (`spec.stream`, A15) before
//! this step runs.

use super::Ctx;
use super::connections::RabbitConn;
use super::gate::{BackendKey, Who};
use super::status::{ADOPT_ANNOTATION, BrokerError, Holder, ObjectKind, SubOutcome, Unadoptable};
use super::step::{Adoption, ChangeKind, Changes, Converged, Removal, Target};
use settle::api::ConsumerRef;
use settle::api::Mode;
use settle::backend::Classify;
use settle::backend::rabbitmq::admin::{self, AdminError};
use settle::backend::rabbitmq::dead_letters;
use settle::backend::rabbitmq::mapping::{self, Arg, OBJECT_ARG, OWNER_ARG, QueueSpec};
use settle::backend::rabbitmq::report::{self, AdoptedMark};

mod claim;
mod create;
mod pause;
mod remove;

use claim::*;
use create::*;
use pause::*;
pub use remove::{remove, remove_account_leftovers, remove_copy_queue};

pub(super) fn failure(error: BrokerError, known: Option<ConsumerRef>) -> SubOutcome {
    // Only while the broker cannot answer is the queue known from before still shown.
    let consumer = error.is_unreachable().then_some(known).flatten();
    SubOutcome::Broker { error, consumer }
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

/// What one converge works on: the Subscription, its connection, and the queue it should have
/// (`want`, named `here`), with the gate keys of its Backend and itself.
struct Work<'a> {
    t: &'a Target<'a>,
    ctx: &'a Ctx,
    conn: &'a RabbitConn,
    want: QueueSpec,
    here: ConsumerRef,
    backend: BackendKey,
    who: Who,
}

async fn converge(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &RabbitConn,
    changes: &mut Changes,
) -> SubOutcome {
    let known = t.known.clone();
    let want =
        mapping::desired(&t.namespace, &t.name, &t.policy, &conn.exchanges).for_object(t.uid());
    let here = ConsumerRef {
        stream: want.binding.exchange.clone(),
        name: want.name.clone(),
    };
    let w = Work {
        t,
        ctx,
        conn,
        want,
        here,
        backend: (t.namespace.clone(), t.sub.spec.backend_ref.name.clone()),
        who: (t.namespace.clone(), t.name.clone()),
    };
    // Refused for a limit before and its gate still closed: not a single broker call.
    if let Some(limit) = ctx.conns.gates.held(&w.backend, &w.who) {
        return failure(BrokerError::Limit(limit), None);
    }
    let amqp = match conn.connection().await {
        Ok(c) => c,
        Err(e) => return failure(BrokerError::of(e), known),
    };
    let found = match find(ctx, conn, &amqp, &w.want.name).await {
        Ok(f) => f,
        Err(e) => return failure(e, known),
    };
    if matches!(found, Found::Missing) {
        // A queue made again is judged afresh, not by the one of its name that ran nothing.
        w.conn
            .stateless
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&w.want.name);
        return w.make(&amqp, changes).await;
    }
    if let Some(stop) = w.claim(&amqp, &found, changes).await {
        return stop;
    }
    let Found::Shown(live) = found else {
        return w.redeclare(&amqp).await;
    };
    if let Some(down) = w.unavailable(&live).await {
        return down;
    }
    w.repair_live(&amqp, &live, changes).await
}

/// How long a queue may show no state in the management API before it counts as run by
/// nothing: three of RabbitMQ's statistics intervals (5 s unless configured), within which a
/// queue just made shows its first.
pub const STATELESS_FOR: std::time::Duration = std::time::Duration::from_secs(15);

impl Work<'_> {
    fn ready(&self) -> SubOutcome {
        SubOutcome::Ready {
            kind: ObjectKind::RabbitmqQueue,
            object: self.here.clone(),
        }
    }

    /// Missing: made (the dead-letter copy first under AtLeastOnce), unless a limit's gate holds
    /// creates back; a refusal for a limit closes it.
    async fn make(&self, amqp: &lapin::Connection, changes: &mut Changes) -> SubOutcome {
        let (t, ctx, want) = (self.t, self.ctx, &self.want);
        let gates = &ctx.conns.gates;
        if let Some(limit) = gates.check(&self.backend, &want.binding.exchange, &self.who) {
            return failure(BrokerError::Limit(limit), None);
        }
        if t.policy.mode == Mode::AtLeastOnce {
            copy_dead_letters(t, ctx, self.conn, amqp, want).await;
        }
        match create(t, ctx, amqp, want, &self.here).await {
            Ok(change) => {
                gates.created(&self.backend, &want.binding.exchange);
                changes.push(change.kind, change.note);
                self.ready()
            }
            Err(o) => {
                if let SubOutcome::Broker { error, .. } = &o
                    && let Some(limit) = error.limit()
                {
                    let delay = gates.refused(&self.backend, limit.clone(), &self.who);
                    tracing::info!(subscription = %t.owner, limit = limit.label(), retry_in = ?delay, "the broker refused the queue for a limit: creates it holds back wait");
                }
                o
            }
        }
    }

    /// Whose the queue is: another's is a conflict (one Settle did not make taken over only as
    /// spec.adopt asks, R13); this object's is marked where the runtime reads it, and one taken
    /// over from an earlier object of this name said. `Some` ends the step with that outcome.
    async fn claim(
        &self,
        amqp: &lapin::Connection,
        found: &Found,
        changes: &mut Changes,
    ) -> Option<SubOutcome> {
        let (t, ctx, want) = (self.t, self.ctx, &self.want);
        let shown = t.known.as_ref().is_some_and(|k| k.name == want.name);
        let Whose {
            claim: claimed,
            mark,
            taken,
        } = claim_found(t, ctx, amqp, found, &want.name, shown).await;
        let conflict = |owner| SubOutcome::Conflict {
            kind: ObjectKind::RabbitmqQueue,
            object: self.here.clone(),
            owner,
        };
        match &claimed {
            Claim::NotOurs(Holder::Unmarked) => {
                let owner = match (t.adoption(&ctx.adopt_namespaces), found) {
                    (Adoption::IfCompatible, Found::Shown(live)) => {
                        let (conn, here) = (self.conn, self.here.clone());
                        return Some(adopt(t, ctx, conn, amqp, want, live, here, changes).await);
                    }
                    (Adoption::NotAllowed, _) => {
                        Holder::Unadoptable(Unadoptable::NamespaceNotAllowed(t.namespace.clone()))
                    }
                    _ => Holder::Unmarked,
                };
                return Some(conflict(owner));
            }
            Claim::NotOurs(holder) => return Some(conflict(holder.clone())),
            Claim::Ours | Claim::Adopted(_) => {
                if !shown
                    && mark.as_deref() != t.uid()
                    && let Err(o) = mark_object(t, ctx, amqp).await
                {
                    // Whose queue it is, written where the runtime reads it, first.
                    return Some(*o);
                }
            }
        }
        if let Claim::Adopted(old) = &claimed {
            // Taken over without arguments by the earlier object: its adopted mark names this
            // one now.
            if taken && let Err(o) = mark_adopted(t, ctx, amqp, &want.name).await {
                return Some(*o);
            }
            let note = format!(
                "took over queue {} (with what it holds), left by the earlier Subscription of this name with uid {old}, as annotation {ADOPT_ANNOTATION} asked",
                want.name
            );
            tracing::info!(subscription = %t.owner, queue = %want.name, "{note}");
            changes.push(ChangeKind::Adopted, note);
        }
        None
    }

    /// AMQP only: redeclare (refused when a compared argument differs) and bind again (harmless
    /// when bound).
    async fn redeclare(&self, amqp: &lapin::Connection) -> SubOutcome {
        let (ctx, want) = (self.ctx, &self.want);
        ctx.metrics.js("queue.declare");
        match admin::declare(amqp, want).await {
            Ok(()) => {}
            Err(AdminError::Differs { text, .. }) => {
                return SubOutcome::Immutable {
                    kind: ObjectKind::RabbitmqQueue,
                    object: self.here.clone(),
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
            Err(e) => return failure(BrokerError::of(e), self.t.known.clone()),
        }
        ctx.metrics.js("queue.bind");
        if let Err(e) = admin::bind(amqp, &want.name, &want.binding).await {
            return failure(BrokerError::of(e), self.t.known.clone());
        }
        self.ready()
    }

    /// Whether RabbitMQ runs nothing for the queue it lists: shown `down`, `crashed` or
    /// `stopped`, or without any state for [`STATELESS_FOR`] (a quorum queue made just before
    /// its node crashed can stay so after the node is back: it refuses every publish and
    /// never answers a consumer). Said, not repaired: deleting it would lose what it holds
    /// (semantics R14). A broker that keeps no statistics shows no queue's state: nothing is
    /// judged by its lack there.
    async fn unavailable(&self, live: &mapping::LiveQueue) -> Option<SubOutcome> {
        let name = &self.want.name;
        if live.state.is_none() && self.stats_disabled().await {
            return None;
        }
        let why = {
            let mut stateless = self
                .conn
                .stateless
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match live.state.as_deref() {
                Some(s @ ("down" | "crashed" | "stopped")) => {
                    stateless.remove(name);
                    format!("RabbitMQ shows queue {name} {s}")
                }
                Some(_) => {
                    stateless.remove(name);
                    return None;
                }
                None => {
                    let now = std::time::Instant::now();
                    // A queue deleted while it had no state yet is not looked at again.
                    stateless.retain(|_, (_, last)| now.duration_since(*last).as_secs() < 600);
                    let (since, last) = stateless.entry(name.clone()).or_insert((now, now));
                    *last = now;
                    let since = *since;
                    if since.elapsed() < STATELESS_FOR {
                        return None;
                    }
                    format!(
                        "RabbitMQ lists queue {name} but runs nothing for it (no state in its management API for {} s)",
                        since.elapsed().as_secs()
                    )
                }
            }
        };
        tracing::warn!(subscription = %self.t.owner, queue = %name, "{why}");
        Some(failure(BrokerError::Unavailable(why), self.t.known.clone()))
    }

    /// Whether the Backend's broker keeps no statistics, read once per connection (unknown:
    /// as if it kept them, so a queue without a state is judged as usual).
    async fn stats_disabled(&self) -> bool {
        let known = *self
            .conn
            .stats_disabled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(disabled) = known {
            return disabled;
        }
        let Some(m) = &self.conn.management else {
            return false;
        };
        self.ctx.metrics.js("overview");
        match m.stats_disabled().await {
            Ok(disabled) => {
                *self
                    .conn
                    .stats_disabled
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(disabled);
                disabled
            }
            Err(_) => false,
        }
    }

    /// Shown by the management API: an argument RabbitMQ cannot change is said, the binding
    /// repaired in place.
    async fn repair_live(
        &self,
        amqp: &lapin::Connection,
        live: &mapping::LiveQueue,
        changes: &mut Changes,
    ) -> SubOutcome {
        let (t, want) = (self.t, &self.want);
        match judge(want, live) {
            Verdict::Immutable(fields) => SubOutcome::Immutable {
                kind: ObjectKind::RabbitmqQueue,
                object: self.here.clone(),
                fields,
            },
            Verdict::Repair { bind, unbind } => {
                let edits = match repair(self.ctx, amqp, want, bind, &unbind).await {
                    Ok(edits) => edits,
                    Err(e) => return failure(e, t.known.clone()),
                };
                if !edits.is_empty() {
                    let edits = edits.join("; ");
                    tracing::info!(subscription = %t.owner, queue = %want.name, changes = %edits, "repaired the queue's binding in place");
                    changes.push(ChangeKind::Updated, format!("queue {}: {edits}", want.name));
                }
                self.ready()
            }
        }
    }
}

/// The binding repairs [`judge`] asked for, done: what each did, as an Event says it.
async fn repair(
    ctx: &Ctx,
    amqp: &lapin::Connection,
    want: &QueueSpec,
    bind: bool,
    unbind: &[mapping::Binding],
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
