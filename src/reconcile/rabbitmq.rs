//! The Subscription controller's broker step on RabbitMQ: the quorum queue from the one mapping
//! (`backend::rabbitmq::queue::desired`), bound to the Backend's exchange by the pattern; made
//! when missing (again when deleted on the broker), its binding repaired in place, an argument
//! RabbitMQ cannot change in place reported `ImmutableField` with the argument and its field
//! named, a queue owned by another Subscription left alone (`ConsumerConflict`); deleted when
//! the Subscription goes.
//!
//! With the Backend's management API (spec.rabbitmq.managementUrl) the live queue's arguments,
//! bindings and owner are read and compared. Without it only AMQP is there: a missing queue is
//! made and its binding declared again on every check; a differing argument shows as the
//! broker's refusal to redeclare the queue; the owner cannot be read, so deletion removes only
//! the queue this Subscription's status names.
//!
//! It must not write status, add finalizers or decide requeues (the pipeline in
//! [`super::subscription`] does), nor re-state an admission rule: the pipeline's one
//! `policy::validate` has refused what this broker cannot honour (`spec.stream`, A15) before
//! this step runs.

use kube::ResourceExt;
use kube::runtime::events::EventType;

use super::Ctx;
use super::conditions::events;
use super::connections::RabbitConn;
use super::status::{BrokerError, SubOutcome};
use super::subscription::{Removal, publish};
use crate::api::{ConsumerRef, Subscription};
use crate::backend::rabbitmq::admin::{self, AdminError};
use crate::backend::rabbitmq::connect::ConnectFailure;
use crate::backend::rabbitmq::management::ManagementError;
use crate::backend::rabbitmq::queue::{self, Arg, OWNER_ARG, QueueSpec};
use crate::backend::rabbitmq::report;
use crate::policy::{BackendKind, ResolvedPolicy};

fn connect_error(e: ConnectFailure) -> BrokerError {
    match e {
        ConnectFailure::Unreachable { .. } => BrokerError::Unreachable(e.to_string()),
        ConnectFailure::AuthFailed(_) => BrokerError::AuthFailed(e.to_string()),
        ConnectFailure::BadConfig(_) => BrokerError::Refused(e.to_string()),
    }
}

fn admin_error(e: AdminError) -> BrokerError {
    match e {
        AdminError::Unreachable(_) => BrokerError::Unreachable(e.to_string()),
        AdminError::Differs { .. } | AdminError::Refused { .. } => {
            BrokerError::Refused(e.to_string())
        }
    }
}

fn management_error(e: ManagementError) -> BrokerError {
    match e {
        ManagementError::Unreachable { .. } => BrokerError::Unreachable(e.to_string()),
        ManagementError::Unauthorized { .. } => BrokerError::AuthFailed(e.to_string()),
        ManagementError::Status { .. } | ManagementError::BadConfig(_) => {
            BrokerError::Refused(e.to_string())
        }
    }
}

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

/// What to do with a live queue, given the mapping's and what the management API shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Another Subscription's queue, or one Settle did not make: left alone.
    Conflict(Option<String>),
    /// Arguments differ (RabbitMQ cannot change them in place): each difference.
    Immutable(Vec<String>),
    /// Ours and as wanted, after these binding repairs (none: nothing to do).
    Repair {
        bind: bool,
        unbind: Vec<queue::Binding>,
    },
}

/// Decides about a live queue (pure).
pub fn judge(want: &QueueSpec, live: &queue::LiveQueue) -> Verdict {
    let owner = owner_of(&live.arguments);
    if owner.as_deref() != want.owner() {
        return Verdict::Conflict(owner);
    }
    let d = queue::diff(want, live);
    if !d.arguments.is_empty() {
        return Verdict::Immutable(d.arguments.iter().map(ToString::to_string).collect());
    }
    Verdict::Repair {
        bind: d.missing_binding,
        unbind: d.stale_bindings,
    }
}

/// Step 5 on RabbitMQ: the queue exists, is bound, and matches the spec, or why not.
pub async fn ensure(
    sub: &Subscription,
    ctx: &Ctx,
    conn: &RabbitConn,
    known: Option<ConsumerRef>,
) -> SubOutcome {
    let ns = sub.namespace().unwrap_or_default();
    let name = sub.name_any();
    let policy = ResolvedPolicy::resolve(&sub.spec.policy);
    let want = queue::desired(&ns, &name, &policy, &conn.exchanges);
    let here = ConsumerRef {
        stream: want.binding.exchange.clone(),
        name: want.name.clone(),
    };
    let ready = || SubOutcome::QueueReady {
        kind: BackendKind::Rabbitmq,
        queue: here.clone(),
    };
    let amqp = match conn.connection().await {
        Ok(c) => c,
        Err(e) => return failure(connect_error(e), known),
    };
    if known.is_none()
        && let Err(o) = mark(sub, ctx, &amqp).await
    {
        // A new object (or one from before queues were marked): whose queue it is, first.
        return *o;
    }
    let Some(management) = &conn.management else {
        // AMQP only: make it when missing; else redeclare (refused when a compared argument
        // differs) and bind again (harmless when bound).
        ctx.metrics.js("queue.exists");
        match admin::exists(&amqp, &want.name).await {
            Ok(false) => {
                return match create(sub, ctx, &amqp, &want, &known, &here).await {
                    Ok(()) => ready(),
                    Err(o) => o,
                };
            }
            Ok(true) => {}
            Err(e) => return failure(admin_error(e), known),
        }
        ctx.metrics.js("queue.declare");
        match admin::declare(&amqp, &want).await {
            Ok(()) => {}
            Err(AdminError::Differs { text, .. }) => {
                return SubOutcome::QueueImmutable {
                    queue: here,
                    fields: vec![format!(
                        "one of {} ({text})",
                        want.arguments
                            .keys()
                            .filter(|k| k.as_str() != OWNER_ARG)
                            .cloned()
                            .collect::<Vec<_>>()
                            .join(", ")
                    )],
                };
            }
            Err(e) => return failure(admin_error(e), known),
        }
        ctx.metrics.js("queue.bind");
        if let Err(e) = admin::bind(&amqp, &want.name, &want.binding).await {
            return failure(admin_error(e), known);
        }
        return ready();
    };
    ctx.metrics.js("queue.info");
    let live = match management.queue(&conn.vhost, &want.name).await {
        Ok(l) => l,
        Err(e) => return failure(management_error(e), known),
    };
    let Some(live) = live else {
        return match create(sub, ctx, &amqp, &want, &known, &here).await {
            Ok(()) => ready(),
            Err(o) => o,
        };
    };
    match judge(&want, &live) {
        Verdict::Conflict(owner) => SubOutcome::QueueConflict {
            kind: BackendKind::Rabbitmq,
            queue: want.name,
            owner,
        },
        Verdict::Immutable(fields) => SubOutcome::QueueImmutable {
            queue: here,
            fields,
        },
        Verdict::Repair { bind, unbind } => {
            let mut changes = Vec::new();
            if bind {
                ctx.metrics.js("queue.bind");
                if let Err(e) = admin::bind(&amqp, &want.name, &want.binding).await {
                    return failure(admin_error(e), known);
                }
                changes.push(format!(
                    "bound it to exchange {} with {}",
                    want.binding.exchange, want.binding.routing_key
                ));
            }
            for b in &unbind {
                ctx.metrics.js("queue.unbind");
                if let Err(e) = admin::unbind(&amqp, &want.name, b).await {
                    return failure(admin_error(e), known);
                }
                changes.push(format!(
                    "removed its binding to {} with {}",
                    b.exchange, b.routing_key
                ));
            }
            if !changes.is_empty() {
                let changes = changes.join("; ");
                ctx.metrics.op("update");
                tracing::info!(subscription = %format!("{ns}/{name}"), queue = %want.name, %changes, "repaired the queue's binding in place");
                publish(
                    ctx,
                    sub,
                    EventType::Normal,
                    events::UPDATED,
                    "Reconcile",
                    format!("queue {}: {changes}", want.name),
                )
                .await;
            }
            ready()
        }
    }
}

/// Marks the Subscription's queue as made for this object (its UID), where the runtime reads it.
async fn mark(
    sub: &Subscription,
    ctx: &Ctx,
    amqp: &lapin::Connection,
) -> Result<(), Box<SubOutcome>> {
    let Some(uid) = sub.metadata.uid.as_deref() else {
        return Ok(());
    };
    ctx.metrics.js("object.mark");
    report::mark_object(
        amqp,
        &sub.namespace().unwrap_or_default(),
        &sub.name_any(),
        uid,
    )
    .await
    .map_err(|e| {
        Box::new(failure(
            BrokerError::Unreachable(format!("cannot mark the queue's object: {e}")),
            None,
        ))
    })
}

/// Declares and binds the queue, and says so: made for the first time, or again after it was
/// deleted on the broker.
async fn create(
    sub: &Subscription,
    ctx: &Ctx,
    amqp: &lapin::Connection,
    want: &QueueSpec,
    known: &Option<ConsumerRef>,
    here: &ConsumerRef,
) -> Result<(), SubOutcome> {
    // The object mark first: a runtime that finds the queue finds whose it is.
    mark(sub, ctx, amqp).await.map_err(|o| *o)?;
    ctx.metrics.js("queue.declare");
    match admin::declare(amqp, want).await {
        Ok(()) => {}
        Err(AdminError::Differs { text, .. }) => {
            // Made meanwhile with other arguments: judged on the next check.
            return Err(failure(BrokerError::Refused(text), known.clone()));
        }
        Err(e) => return Err(failure(admin_error(e), known.clone())),
    }
    ctx.metrics.js("queue.bind");
    if let Err(e) = admin::bind(amqp, &want.name, &want.binding).await {
        return Err(failure(admin_error(e), known.clone()));
    }
    let again = known.as_ref() == Some(here);
    let (op, reason, note) = if again {
        (
            "recreate",
            events::RECREATED,
            format!(
                "queue {} was missing from the broker (deleted there): made it again and bound it to {} with {}",
                want.name, want.binding.exchange, want.binding.routing_key
            ),
        )
    } else {
        (
            "create",
            events::CREATED,
            format!(
                "created quorum queue {} bound to {} with {}",
                want.name, want.binding.exchange, want.binding.routing_key
            ),
        )
    };
    ctx.metrics.op(op);
    tracing::info!(subscription = %format!("{}/{}", sub.namespace().unwrap_or_default(), sub.name_any()), queue = %want.name, %op, "queue");
    publish(ctx, sub, EventType::Normal, reason, "Reconcile", note).await;
    Ok(())
}

/// The cleanup's broker call on RabbitMQ: deletes this Subscription's queue (with the messages
/// it holds), if it is there and its own.
pub async fn remove(sub: &Subscription, ctx: &Ctx, conn: &RabbitConn) -> Removal {
    let ns = sub.namespace().unwrap_or_default();
    let name = sub.name_any();
    let owner = format!("{ns}/{name}");
    let shown = sub.status.as_ref().and_then(|s| s.consumer.clone());
    let queue_name = match &shown {
        Some(c) => c.name.clone(),
        None => queue::queue_name(&ns, &name, &ResolvedPolicy::resolve(&sub.spec.policy)),
    };
    let amqp = match conn.connection().await {
        Ok(c) => c,
        Err(e) => return Removal::Wait(e.to_string()),
    };
    match &conn.management {
        Some(m) => {
            ctx.metrics.js("queue.info");
            match m.queue(&conn.vhost, &queue_name).await {
                Ok(None) => return Removal::Nothing,
                Ok(Some(live)) if owner_of(&live.arguments).as_deref() != Some(owner.as_str()) => {
                    tracing::info!(subscription = %owner, queue = %queue_name, "the queue is not this Subscription's: left alone");
                    return Removal::Nothing;
                }
                Ok(Some(_)) => {}
                Err(e) if e.is_unreachable() => return Removal::Wait(e.to_string()),
                Err(e) => return Removal::Failed(e.to_string()),
            }
        }
        // Without the management API the owner cannot be read: only the queue this
        // Subscription's status shows (made by it) is deleted.
        None if shown.is_none() => return Removal::Nothing,
        None => {}
    }
    ctx.metrics.js("queue.delete");
    match admin::delete(&amqp, &queue_name).await {
        Ok(()) => {
            let object = report::object_queue(&ns, &name);
            if let Err(e) = admin::delete(&amqp, &object).await {
                tracing::debug!(queue = %object, error = %e, "cannot delete the object mark");
            }
            tracing::info!(subscription = %owner, queue = %queue_name, "deleted the queue");
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
    use crate::api::{DeliveryPolicy, Mode};
    use crate::backend::rabbitmq::queue::{Binding, Exchanges, LiveQueue};

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

    #[test]
    fn another_owner_or_none_is_a_conflict_before_anything_else() {
        let w = want();
        let mut l = live_of(&w);
        l.arguments
            .insert(OWNER_ARG.into(), Arg::Str("other/orders".into()));
        l.arguments.insert("x-delivery-limit".into(), Arg::Int(9));
        assert_eq!(
            judge(&w, &l),
            Verdict::Conflict(Some("other/orders".into()))
        );
        l.arguments.remove(OWNER_ARG);
        assert_eq!(judge(&w, &l), Verdict::Conflict(None));
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
