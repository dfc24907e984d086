//! The Subscription controller: every Subscription becomes a live consumer on its broker (a
//! JetStream consumer, a RabbitMQ quorum queue and its binding, an SQS queue and its dead-letter
//! queue), and stays one. Its reconcile reads as the pipeline it runs, one for every kind:
//!
//! 1. deleting? delete the consumer or queue (unless `deletionPolicy: Retain`), then drop the finalizer;
//! 2. make sure the finalizer is on (before anything exists on the broker);
//! 3. check the spec again with the one `validate` (no I/O) — invalid: `Accepted=False`, nothing made;
//! 4. find the Backend and its connection (cache, no I/O);
//! 5. converge on the broker through the kind's one mapping: [`super::nats`], [`super::rabbitmq`],
//!    [`super::sqs`] (the only step, with the cleanup's broker call, that differs by kind). Each
//!    is handed the [`Target`] built once here and returns what the broker holds and what it
//!    changed ([`super::step`]);
//! 6. an Event and an operation count for each change, status written only if it changed
//!    (API), and the `settle_subscription_ready` gauge. A pause (`spec.paused`) is part of what
//!    step 5 converges (each kind's own way, semantics W2–W4) and shows as `Paused`; one
//!    with a `pausedUntil` is reconciled again when it ends.
//!
//! Kinds with broker events (NATS advisories) are re-checked on the resync interval (by the
//! controllers' resync walk, not a requeue each, once Ready); kinds
//! without (RabbitMQ without plugins, SQS) on the shorter drift interval, so a queue deleted on
//! the broker comes back.
//!
//! It must not build a consumer config or queue (the `backend` mappings do), decide the
//! admission rules (that is `policy`), or write the account's fields (`status.stats`,
//! `statsUpdatedAt`).

use std::sync::Arc;
use std::time::Duration;

use crate::events::{Event, EventType};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};

use super::conditions::{events, reasons, types};
use super::connections::{Conn, Lookup};
use super::metrics::SUBSCRIPTION;
use super::status::{SubOutcome, subscription_status};
use super::step::{Change, Removal, SQS_STREAM, Target};
use super::{Ctx, Error, FIELD_MANAGER};
use settle::api::{Backend, DeletionPolicy, FINALIZER, Subscription};
use settle::policy::{BackendKind, BackendView, Pause, effective_capabilities, validate};

/// Reconciles one Subscription.
pub async fn reconcile(sub: Arc<Subscription>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let _timer = ctx
        .metrics
        .duration
        .with_label_values(&[SUBSCRIPTION])
        .start_timer();
    let target = Target::of(&sub, Timestamp::now());
    let (ns, name) = (&target.namespace, &target.name);
    let api: Api<Subscription> = Api::namespaced(ctx.client.clone(), ns);
    let fkey = format!("subscription/{ns}/{name}");
    // Every step below reads the Backend from the cache, the deletion too, so none runs before
    // the cache holds its first list: a replica that just took the lead would otherwise find no
    // Backend, say BackendNotFound of one that exists (a lie that fires alerts on every
    // handover), and finish a deletion as if the Backend were gone, leaving the consumer or
    // queue on the broker. A writer gone (the term is ending) ends the wait.
    super::cache_ready(&ctx.backends).await;

    if sub.metadata.deletion_timestamp.is_some() {
        if has_finalizer(&sub) {
            cleanup(&target, &ctx).await?;
        }
        // Its rows go before the object does: once it is gone, /metrics no longer shows it.
        ctx.conns.gates.forget(
            &(ns.clone(), sub.spec.backend_ref.name.clone()),
            &(ns.clone(), name.clone()),
        );
        ctx.metrics.forget_subscription(ns, name);
        if has_finalizer(&sub) {
            remove_finalizer(&api, &sub, &ctx).await?;
        }
        ctx.succeeded(&fkey);
        return Ok(Action::await_change());
    }
    if !has_finalizer(&sub) {
        add_finalizer(&api, &sub, &ctx).await?;
    }

    // A changed spec (another stream, perhaps) is not held back by the gate its old one waited
    // on: it asks the broker afresh (and waits again if the same limit refuses it).
    if sub.status.as_ref().and_then(|s| s.observed_generation) != sub.metadata.generation {
        ctx.conns.gates.forget(
            &(ns.clone(), sub.spec.backend_ref.name.clone()),
            &(ns.clone(), name.clone()),
        );
    }
    let Some(outcome) = converge(&target, &ctx).await else {
        // The Backend's connection is being made; its first event reconciles this again.
        return Ok(Action::requeue(Duration::from_secs(1)));
    };
    write_status(&api, &sub, &outcome, target.pause, &ctx).await?;
    ctx.metrics.subscription_ready(ns, name, outcome.is_ready());
    Ok(next_look(&sub, &ctx, &outcome, target.pause, &fkey))
}

/// When to look at a Subscription again after its step ended in `outcome` (its failures counted
/// and backed off under `fkey`).
fn next_look(
    sub: &Subscription,
    ctx: &Ctx,
    outcome: &SubOutcome,
    pause: Pause,
    fkey: &str,
) -> Action {
    // Kinds without broker events are polled for drift.
    let polled = backend_of(sub, ctx)
        .and_then(|b| BackendKind::of(&b.spec))
        .is_some_and(|k| matches!(k, BackendKind::Rabbitmq | BackendKind::Sqs));
    match outcome {
        o if o.is_ready() => {
            ctx.succeeded(fkey);
            // A pause that ends by itself is looked at again when it ends: `Paused` turns
            // False then, and the RabbitMQ marker goes.
            let ends = until_pause_ends(pause, Timestamp::now());
            if polled {
                Action::requeue(ends.map_or(ctx.drift, |d| d.min(ctx.drift)))
            } else {
                // The resync walk looks at it again (`reconcile::resync_walk`), and its broker's
                // events at once.
                ends.map_or_else(Action::await_change, Action::requeue)
            }
        }
        // Nothing on the broker announces that these were fixed there (a queue): looked at
        // again.
        SubOutcome::Immutable { kind, .. } | SubOutcome::Conflict { kind, .. }
            if !kind.announced() =>
        {
            ctx.succeeded(fkey);
            Action::requeue(ctx.drift)
        }
        // Refused for a broker's limit: the Backend's gate for that limit triggers it again
        // (a place freed, or its delay over); the resync is only the safety net.
        SubOutcome::Broker { error, .. } if error.limit().is_some() => {
            ctx.succeeded(fkey);
            Action::requeue(ctx.resync)
        }
        // Only a change of the spec (or of the consumer, by its advisory) can help these: never
        // retried in a loop.
        SubOutcome::Invalid(_)
        | SubOutcome::Immutable { .. }
        | SubOutcome::Conflict { .. }
        | SubOutcome::BackendNotFound(_) => {
            ctx.succeeded(fkey);
            Action::await_change()
        }
        _ => Action::requeue(ctx.failed(fkey, Duration::from_secs(60))),
    }
}

/// How long until `pause` ends by itself (a second past its time, so the next look finds it
/// passed), if it does.
fn until_pause_ends(pause: Pause, now: Timestamp) -> Option<Duration> {
    let until = pause.until()?;
    let left = until.duration_since(now).as_millis().max(0);
    Some(Duration::from_millis(u64::try_from(left).unwrap_or(u64::MAX)) + Duration::from_secs(1))
}

/// Kubernetes API failures: tried again with a growing delay.
pub fn error_policy(sub: Arc<Subscription>, error: &Error, ctx: Arc<Ctx>) -> Action {
    let key = format!(
        "subscription/{}/{}",
        sub.namespace().unwrap_or_default(),
        sub.name_any()
    );
    let delay = ctx.failed(&key, Duration::from_secs(60));
    tracing::warn!(subscription = %key, error = %error, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

fn has_finalizer(sub: &Subscription) -> bool {
    sub.finalizers().iter().any(|f| f == FINALIZER)
}

async fn add_finalizer(
    api: &Api<Subscription>,
    sub: &Subscription,
    ctx: &Ctx,
) -> Result<(), Error> {
    let mut list = sub.finalizers().to_vec();
    list.push(FINALIZER.to_string());
    super::set_finalizers(api, sub, ctx, SUBSCRIPTION, list).await
}

async fn remove_finalizer(
    api: &Api<Subscription>,
    sub: &Subscription,
    ctx: &Ctx,
) -> Result<(), Error> {
    let list: Vec<String> = sub
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .cloned()
        .collect();
    super::set_finalizers(api, sub, ctx, SUBSCRIPTION, list).await
}

/// The Backend a Subscription names, from the cache.
fn backend_of(sub: &Subscription, ctx: &Ctx) -> Option<Arc<Backend>> {
    let ns = sub.namespace()?;
    ctx.backends
        .get(&ObjectRef::new(&sub.spec.backend_ref.name).within(&ns))
}

/// Steps 3–5: what the broker now holds for this Subscription, with an Event for each change
/// the broker step made. `None`: not known yet (the Backend's first connection attempt has not
/// finished).
async fn converge(t: &Target<'_>, ctx: &Ctx) -> Option<SubOutcome> {
    let (sub, ns) = (t.sub, &t.namespace);
    let backend_name = &sub.spec.backend_ref.name;

    // 3. The one validate, before the broker is touched (the Backend cache holds its first
    // list: `reconcile` waited for it).
    let backend = backend_of(sub, ctx);
    let capabilities = backend.as_deref().and_then(effective_capabilities);
    let view = match (&backend, &capabilities) {
        (Some(_), Some(c)) => BackendView::Known {
            name: backend_name,
            capabilities: c,
        },
        _ => BackendView::Missing { name: backend_name },
    };
    let verdict = validate(&sub.spec, None, view);
    if !verdict.allowed() {
        return Some(SubOutcome::Invalid(verdict.error_text()));
    }

    // 4. The Backend and its connection.
    let Some(backend) = backend else {
        return Some(SubOutcome::BackendNotFound(backend_name.clone()));
    };
    match BackendKind::of(&backend.spec) {
        Some(BackendKind::Memory) | None => return Some(SubOutcome::InProcess),
        Some(_) => {}
    }
    let conn = match ctx.conns.get(&(ns.clone(), backend_name.clone())) {
        Lookup::Up(c) => c,
        Lookup::Failed(why) => {
            return Some(SubOutcome::BackendNotReady(format!(
                "Backend {backend_name:?} is not ready: {why} (kubectl describe backend {backend_name} -n {ns})"
            )));
        }
        Lookup::Unknown => return None,
    };

    // 5. The broker, by kind.
    let converged = match &*conn {
        Conn::Nats(c) => super::nats::ensure(t, ctx, c).await,
        Conn::Rabbitmq(c) => super::rabbitmq::ensure(t, ctx, c).await,
        Conn::Sqs(c) => super::sqs::ensure(t, ctx, c).await,
    };
    for Change { kind, note } in converged.changes {
        ctx.metrics.op(kind.op());
        publish(
            ctx,
            sub,
            EventType::Normal,
            kind.reason(),
            "Reconcile",
            note,
        )
        .await;
    }
    Some(converged.outcome)
}

/// Step 6: the status, only when it changed; and an Event when Ready changes its reason for a
/// failure (once per transition, not per retry).
async fn write_status(
    api: &Api<Subscription>,
    sub: &Subscription,
    outcome: &SubOutcome,
    pause: Pause,
    ctx: &Ctx,
) -> Result<(), Error> {
    let now = Time(Timestamp::now());
    let Some(patch) = subscription_status(
        sub.status.as_ref(),
        sub.metadata.generation,
        outcome,
        pause,
        &now,
    ) else {
        return Ok(());
    };
    let body = serde_json::json!({
        "apiVersion": "messaging.settle.dev/v1alpha1",
        "kind": "Subscription",
        "status": patch,
    });
    ctx.metrics.kube(SUBSCRIPTION, "patch_status");
    match api
        .patch_status(
            &sub.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    ctx.metrics
        .status_writes
        .with_label_values(&[SUBSCRIPTION])
        .inc();
    let previous = sub
        .status
        .as_ref()
        .and_then(|s| super::conditions::find(&s.conditions, types::READY))
        .map(|c| c.reason.clone());
    let [accepted, ready] = outcome.wants();
    if !outcome.is_ready() && previous.as_deref() != Some(ready.reason) {
        let (reason, note) = if accepted.reason == reasons::INVALID {
            (events::INVALID, accepted.message)
        } else {
            (ready.reason, ready.message)
        };
        publish(ctx, sub, EventType::Warning, reason, "Reconcile", note).await;
    }
    Ok(())
}

/// The consumer or queue `c` names, as an Event says it.
fn broker_object(c: &settle::api::ConsumerRef) -> String {
    if c.stream == SQS_STREAM {
        format!("SQS queue {}", c.name)
    } else {
        format!("consumer {} on stream {}", c.name, c.stream)
    }
}

/// Step 1: the consumer (or queue) goes with the Subscription, unless it is retained. Returns
/// `Err` while the broker cannot be asked (deletion waits); a missing Backend or consumer is done.
async fn cleanup(t: &Target<'_>, ctx: &Ctx) -> Result<(), Error> {
    let (sub, ns, name) = (t.sub, &t.namespace, &t.name);
    if sub.spec.deletion_policy == DeletionPolicy::Retain {
        let note = match &t.known {
            Some(c) => format!(
                "deletionPolicy is Retain: {} stays on the broker",
                broker_object(c)
            ),
            None => "deletionPolicy is Retain: the consumer, if any, stays on the broker".into(),
        };
        publish(
            ctx,
            sub,
            EventType::Normal,
            events::RETAINED,
            "Delete",
            note,
        )
        .await;
        return Ok(());
    }
    let Some(backend) = backend_of(sub, ctx) else {
        // The Backend stays while its Subscriptions need it (its finalizer), up to
        // --backend-deletion-grace: past that, or removed by hand, what is left is said.
        let what = match &t.known {
            Some(c) => broker_object(c),
            None => {
                tracing::info!(subscription = %format!("{ns}/{name}"), backend = %sub.spec.backend_ref.name, "the Backend is gone, and the status named no consumer: nothing to delete");
                return Ok(());
            }
        };
        let note = format!(
            "Backend {:?} was gone before this Subscription: {what} stays on the broker; delete it there",
            sub.spec.backend_ref.name
        );
        tracing::warn!(subscription = %format!("{ns}/{name}"), %note, "deleted without its Backend");
        ctx.metrics.consumers_left.inc();
        publish(
            ctx,
            sub,
            EventType::Warning,
            events::LEFT_ON_BROKER,
            "Delete",
            note,
        )
        .await;
        return Ok(());
    };
    if matches!(
        BackendKind::of(&backend.spec),
        Some(BackendKind::Memory) | None
    ) {
        return Ok(());
    }
    let conn = match ctx
        .conns
        .get_for_deletion(&(ns.clone(), sub.spec.backend_ref.name.clone()))
    {
        Lookup::Up(c) => c,
        Lookup::Failed(why) => {
            return Err(Error::Waiting(format!("the Backend is not ready: {why}")));
        }
        Lookup::Unknown => {
            return Err(Error::Waiting(
                "the Backend's connection is being made".into(),
            ));
        }
    };
    let removal = match &*conn {
        Conn::Nats(c) => super::nats::remove(t, ctx, c).await,
        Conn::Rabbitmq(c) => super::rabbitmq::remove(t, ctx, c).await,
        Conn::Sqs(c) => super::sqs::remove(t, ctx, c).await,
    };
    match removal {
        Removal::Deleted(note) => {
            ctx.metrics.op("delete");
            publish(ctx, sub, EventType::Normal, events::DELETED, "Delete", note).await;
            Ok(())
        }
        Removal::Nothing => Ok(()),
        Removal::Wait(m) => Err(Error::Waiting(m)),
        Removal::Failed(m) => Err(Error::Broker(m)),
    }
}

/// Records a Kubernetes Event on the Subscription; a failure to record is logged, never fatal.
async fn publish(
    ctx: &Ctx,
    sub: &Subscription,
    type_: EventType,
    reason: &str,
    action: &str,
    note: String,
) {
    ctx.metrics.kube(SUBSCRIPTION, "event");
    let ev = Event {
        type_,
        reason: reason.to_string(),
        note: Some(note),
        action: action.to_string(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &sub.object_ref(&())).await {
        tracing::warn!(subscription = %sub.name_any(), error = %e, "could not record an Event");
    }
}
