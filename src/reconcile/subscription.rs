//! The Subscription controller: every Subscription becomes a live JetStream consumer, and stays
//! one. Its reconcile reads as the pipeline it runs:
//!
//! 1. deleting? delete the consumer (unless `deletionPolicy: Retain`), then drop the finalizer;
//! 2. make sure the finalizer is on (before any consumer exists);
//! 3. check the spec again with the one `validate` (no I/O) — invalid: `Accepted=False`, no consumer;
//! 4. find the Backend and its connection (cache, no I/O);
//! 5. resolve the stream, read the consumer, create or update it through the one mapping (broker);
//! 6. write status only if it changed (API), and an Event for what was done.
//!
//! It must not build a consumer config (that is `backend::nats::consumer`), decide the admission
//! rules (that is `policy`), or write the account's fields.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};

use super::conditions::{events, reasons, types};
use super::connections::{Conn, Lookup};
use super::metrics::SUBSCRIPTION;
use super::status::{SubOutcome, subscription_status};
use super::{Ctx, Error, FIELD_MANAGER};
use crate::api::{Backend, ConsumerRef, DeletionPolicy, Subscription};
use crate::backend::nats::advisory::ChangeKind;
use crate::backend::nats::consumer;
use crate::backend::nats::jsapi::{self, NatsError};
use crate::policy::{BackendKind, BackendView, ResolvedPolicy, effective_capabilities, validate};

/// The finalizer that makes deleting a Subscription delete its consumer first.
pub const FINALIZER: &str = "messaging.settle.dev/consumer";

/// JetStream's "consumer already exists" (two creates raced).
const CONSUMER_EXISTS: u64 = 10_148;

/// Reconciles one Subscription.
pub async fn reconcile(sub: Arc<Subscription>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let _timer = ctx
        .metrics
        .duration
        .with_label_values(&[SUBSCRIPTION])
        .start_timer();
    let ns = sub.namespace().unwrap_or_default();
    let name = sub.name_any();
    let api: Api<Subscription> = Api::namespaced(ctx.client.clone(), &ns);
    let fkey = format!("subscription/{ns}/{name}");

    if sub.metadata.deletion_timestamp.is_some() {
        if has_finalizer(&sub) {
            cleanup(&sub, &ctx).await?;
            remove_finalizer(&api, &sub, &ctx).await?;
        }
        ctx.succeeded(&fkey);
        return Ok(Action::await_change());
    }
    if !has_finalizer(&sub) {
        add_finalizer(&api, &sub, &ctx).await?;
    }

    let Some(outcome) = converge(&sub, &ctx).await else {
        // The Backend's connection is being made; its first event reconciles this again.
        return Ok(Action::requeue(Duration::from_secs(1)));
    };
    write_status(&api, &sub, &outcome, &ctx).await?;
    Ok(match &outcome {
        o if o.is_ready() => {
            ctx.succeeded(&fkey);
            Action::requeue(ctx.resync)
        }
        // Only a change of the spec (or of the consumer, by its advisory) can help these: never
        // retried in a loop.
        SubOutcome::Invalid(_)
        | SubOutcome::NotManagedYet(_)
        | SubOutcome::ImmutableField { .. }
        | SubOutcome::Conflict { .. }
        | SubOutcome::BackendNotFound(_) => {
            ctx.succeeded(&fkey);
            Action::await_change()
        }
        _ => Action::requeue(ctx.failed(&fkey, Duration::from_secs(60))),
    })
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
    set_finalizers(api, sub, ctx, list).await
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
    set_finalizers(api, sub, ctx, list).await
}

/// Replaces the finalizer list, guarded by the resourceVersion it was read at, so a concurrent
/// writer's finalizer is never lost (a conflict is retried with the fresh object).
async fn set_finalizers(
    api: &Api<Subscription>,
    sub: &Subscription,
    ctx: &Ctx,
    finalizers: Vec<String>,
) -> Result<(), Error> {
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": sub.resource_version(),
            "finalizers": finalizers,
        }
    });
    ctx.metrics.kube(SUBSCRIPTION, "patch_finalizer");
    match api
        .patch(
            &sub.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        // Gone already: nothing left to guard.
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The Backend a Subscription names, from the cache.
fn backend_of(sub: &Subscription, ctx: &Ctx) -> Option<Arc<Backend>> {
    let ns = sub.namespace()?;
    ctx.backends
        .get(&ObjectRef::new(&sub.spec.backend_ref.name).within(&ns))
}

/// Steps 3–5: what the broker now holds for this Subscription. `None`: not known yet (the
/// Backend's first connection attempt has not finished).
async fn converge(sub: &Subscription, ctx: &Ctx) -> Option<SubOutcome> {
    let ns = sub.namespace().unwrap_or_default();
    let name = sub.name_any();
    let known = sub.status.as_ref().and_then(|s| s.consumer.clone());
    let backend_name = &sub.spec.backend_ref.name;

    // 3. The one validate, before the broker is touched.
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
    if backend.spec.nats.is_none() {
        return Some(match BackendKind::of(&backend.spec) {
            Some(BackendKind::Memory) | None => SubOutcome::InProcess,
            Some(kind) => SubOutcome::NotManagedYet(kind),
        });
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
    if !conn.connected() {
        return Some(SubOutcome::Broker {
            error: NatsError::Unreachable("the connection is down; reconnecting".into()),
            consumer: known,
        });
    }

    // 5. The broker.
    let policy = ResolvedPolicy::resolve(&sub.spec.policy);
    ctx.metrics.js("stream");
    let stream =
        match jsapi::resolve_stream(&conn.js, sub.spec.stream.as_deref(), &policy.pattern).await {
            Ok(s) => s,
            Err(error) => return Some(broker_failure(error, known)),
        };
    let want = consumer::desired(&ns, &name, &stream, &policy);
    let here = ConsumerRef {
        stream: stream.clone(),
        name: want.name.clone(),
    };
    ctx.metrics.js("info");
    let live = match jsapi::consumer_info(&conn.js, &stream, &want.name).await {
        Ok(live) => live,
        Err(error) => return Some(broker_failure(error, known)),
    };
    let Some(info) = live else {
        // Missing: made for the first time, or again after someone (or a lost stream) removed it.
        let again = known.as_ref() == Some(&here);
        if let Err(error) = create(&conn, ctx, &want).await {
            return Some(broker_failure(error, known));
        }
        let (op, reason, note) = if again {
            (
                "recreate",
                events::RECREATED,
                format!(
                    "consumer {} on stream {stream} was missing from the broker (deleted there, or lost): made it again",
                    want.name
                ),
            )
        } else {
            (
                "create",
                events::CREATED,
                format!("created consumer {} on stream {stream}", want.name),
            )
        };
        ctx.metrics.op(op);
        tracing::info!(subscription = %format!("{ns}/{name}"), %stream, consumer = %want.name, %op, "consumer");
        publish(ctx, sub, EventType::Normal, reason, "Reconcile", note).await;
        return Some(SubOutcome::Ready(here));
    };
    let live = consumer::normalise(&stream, &want.name, &info.config);
    let owner = format!("{ns}/{name}");
    if live.owner() != Some(owner.as_str()) {
        return Some(SubOutcome::Conflict {
            consumer: here,
            owner: live.owner().map(str::to_string),
        });
    }
    let d = consumer::diff(&want, &live);
    if !d.immutable.is_empty() {
        return Some(SubOutcome::ImmutableField {
            consumer: here,
            fields: d.immutable,
        });
    }
    if !d.editable.is_empty() {
        let changes = d
            .editable
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        ctx.metrics.js("update");
        if let Err(error) = jsapi::update_consumer(&conn.js, &want).await {
            return Some(broker_failure(error, known));
        }
        ctx.metrics.op("update");
        tracing::info!(subscription = %owner, %stream, consumer = %want.name, %changes, "updated the consumer in place");
        publish(
            ctx,
            sub,
            EventType::Normal,
            events::UPDATED,
            "Reconcile",
            format!("updated consumer {} in place: {changes}", want.name),
        )
        .await;
    }
    Some(SubOutcome::Ready(here))
}

async fn create(conn: &Conn, ctx: &Ctx, want: &consumer::ConsumerConfig) -> Result<(), NatsError> {
    conn.mark_own(ChangeKind::Created, &want.stream, &want.name);
    ctx.metrics.js("create");
    match jsapi::create_consumer(&conn.js, want).await {
        Ok(_) => Ok(()),
        // Made meanwhile by a racing reconcile (an old leader's last call): converge next time.
        Err(e) if e.code() == Some(CONSUMER_EXISTS) => Err(NatsError::Unreachable(
            "the consumer was created concurrently; checking it again".into(),
        )),
        Err(e) => Err(e),
    }
}

fn broker_failure(error: NatsError, known: Option<ConsumerRef>) -> SubOutcome {
    // Only while the broker cannot answer is the consumer known from before still shown.
    let consumer = matches!(error, NatsError::Unreachable(_))
        .then_some(known)
        .flatten();
    SubOutcome::Broker { error, consumer }
}

/// Step 6: the status, only when it changed; and an Event when Ready changes its reason for a
/// failure (once per transition, not per retry).
async fn write_status(
    api: &Api<Subscription>,
    sub: &Subscription,
    outcome: &SubOutcome,
    ctx: &Ctx,
) -> Result<(), Error> {
    let now = Time(Timestamp::now());
    let Some(patch) =
        subscription_status(sub.status.as_ref(), sub.metadata.generation, outcome, &now)
    else {
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

/// Step 1: the consumer goes with the Subscription, unless it is retained. Returns `Err` while the
/// broker cannot be asked (deletion waits); a missing Backend or consumer is done.
async fn cleanup(sub: &Subscription, ctx: &Ctx) -> Result<(), Error> {
    let ns = sub.namespace().unwrap_or_default();
    let name = sub.name_any();
    if sub.spec.deletion_policy == DeletionPolicy::Retain {
        let note = match sub.status.as_ref().and_then(|s| s.consumer.as_ref()) {
            Some(c) => format!(
                "deletionPolicy is Retain: consumer {} on stream {} stays on the broker",
                c.name, c.stream
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
        tracing::info!(subscription = %format!("{ns}/{name}"), backend = %sub.spec.backend_ref.name, "the Backend is gone: nothing to delete the consumer with");
        return Ok(());
    };
    if backend.spec.nats.is_none() {
        return Ok(());
    }
    let conn = match ctx
        .conns
        .get(&(ns.clone(), sub.spec.backend_ref.name.clone()))
    {
        Lookup::Up(c) if c.connected() => c,
        Lookup::Up(_) => return Err(Error::Waiting("the Backend's connection is down".into())),
        Lookup::Failed(why) => {
            return Err(Error::Waiting(format!("the Backend is not ready: {why}")));
        }
        Lookup::Unknown => {
            return Err(Error::Waiting(
                "the Backend's connection is being made".into(),
            ));
        }
    };
    let policy = ResolvedPolicy::resolve(&sub.spec.policy);
    let target = match sub.status.as_ref().and_then(|s| s.consumer.clone()) {
        Some(c) => c,
        None => {
            ctx.metrics.js("stream");
            match jsapi::resolve_stream(&conn.js, sub.spec.stream.as_deref(), &policy.pattern).await
            {
                Ok(stream) => ConsumerRef {
                    name: consumer::consumer_name(&ns, &name, &policy),
                    stream,
                },
                Err(NatsError::Unreachable(m)) => return Err(Error::Waiting(m)),
                // No stream, or several: Settle never made a consumer for it.
                Err(_) => return Ok(()),
            }
        }
    };
    ctx.metrics.js("info");
    let info = match jsapi::consumer_info(&conn.js, &target.stream, &target.name).await {
        Ok(i) => i,
        Err(NatsError::Unreachable(m)) => return Err(Error::Waiting(m)),
        Err(e) => return Err(Error::Broker(e)),
    };
    let Some(info) = info else {
        return Ok(());
    };
    let owner = format!("{ns}/{name}");
    if consumer::normalise(&target.stream, &target.name, &info.config).owner()
        != Some(owner.as_str())
    {
        tracing::info!(subscription = %owner, consumer = %target.name, "the consumer is not this Subscription's: left alone");
        return Ok(());
    }
    conn.mark_own(ChangeKind::Deleted, &target.stream, &target.name);
    ctx.metrics.js("delete");
    match jsapi::delete_consumer(&conn.js, &target.stream, &target.name).await {
        Ok(_) => {}
        Err(NatsError::Unreachable(m)) => return Err(Error::Waiting(m)),
        Err(e) => return Err(Error::Broker(e)),
    }
    ctx.metrics.op("delete");
    tracing::info!(subscription = %owner, stream = %target.stream, consumer = %target.name, "deleted the consumer");
    publish(
        ctx,
        sub,
        EventType::Normal,
        events::DELETED,
        "Delete",
        format!(
            "deleted consumer {} on stream {}",
            target.name, target.stream
        ),
    )
    .await;
    Ok(())
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
