//! A Backend's finalizer ([`BACKEND_FINALIZER`]): put on before the Backend's first connection,
//! taken off once no Subscription that names it still holds its own finalizer (each deletes its
//! consumer or queue through this Backend's connection, which stays open meanwhile), or once the
//! Backend has been deleting for `--backend-deletion-grace`, whichever comes first. Then a Warning
//! Event names the Subscriptions left; each of those that later finds its Backend gone says what
//! it leaves on the broker (`settle_consumers_left_total`). So deleting a namespace, or a Backend
//! before its Subscriptions, or both at once, deletes every consumer a `Delete` Subscription owns,
//! and a broken Backend never blocks a deletion for longer than the grace.
//!
//! It must not delete anything on the broker, connect, or write status: the Backend controller
//! connects, the Subscription controller deletes.

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};

use super::index;
use super::metrics::BACKEND;
use super::{Ctx, Error};
use crate::events::{Event, EventType};
use settle::api::{BACKEND_FINALIZER, Backend, FINALIZER};

/// How often a deleting Backend looks again at the Subscriptions it waits for.
const RECHECK: Duration = Duration::from_secs(2);

/// Whether the Backend carries the finalizer.
pub fn held(b: &Backend) -> bool {
    b.finalizers().iter().any(|f| f == BACKEND_FINALIZER)
}

/// Puts the finalizer on (before anything is connected).
pub async fn hold(ctx: &Ctx, b: &Backend) -> Result<(), Error> {
    let mut list = b.finalizers().to_vec();
    list.push(BACKEND_FINALIZER.to_string());
    set(ctx, b, list).await
}

/// Replaces the Backend's finalizer list ([`super::set_finalizers`]).
async fn set(ctx: &Ctx, b: &Backend, finalizers: Vec<String>) -> Result<(), Error> {
    let api: Api<Backend> = Api::namespaced(ctx.client.clone(), &b.namespace().unwrap_or_default());
    super::set_finalizers(&api, b, ctx, BACKEND, finalizers).await
}

/// How long a deleting Backend has been deleting.
fn deleting_for(b: &Backend) -> Duration {
    b.metadata
        .deletion_timestamp
        .as_ref()
        .map(|t| Timestamp::now().duration_since(t.0).unsigned_abs())
        .unwrap_or_default()
}

/// Whether [`release`] lets deleting Backend `b` go now: no Subscription needs it, or its
/// grace is over (the Backend controller deletes what the Backend itself had on the broker
/// first).
pub fn goes_now(ctx: &Ctx, b: &Backend) -> bool {
    users(ctx, &b.namespace().unwrap_or_default(), &b.name_any()).is_empty()
        || deleting_for(b) >= ctx.backend_deletion_grace
}

/// A deleting Backend: waits while Subscriptions need it, within the grace; then lets it go.
pub async fn release(ctx: &Ctx, b: &Backend) -> Result<Action, Error> {
    let ns = b.namespace().unwrap_or_default();
    let users = users(ctx, &ns, &b.name_any());
    let since = deleting_for(b);
    if !users.is_empty() && since < ctx.backend_deletion_grace {
        tracing::debug!(backend = %format!("{ns}/{}", b.name_any()), waiting_for = ?users, "the Backend is deleting: it stays while these Subscriptions delete their consumers");
        return Ok(Action::requeue(RECHECK));
    }
    if !users.is_empty() {
        let note = format!(
            "deleted {}s ago; these Subscriptions had not deleted their consumers or queues within \
             --backend-deletion-grace ({}s) and will leave them on the broker: {}",
            since.as_secs(),
            ctx.backend_deletion_grace.as_secs(),
            users.join(", ")
        );
        tracing::warn!(backend = %format!("{ns}/{}", b.name_any()), %note, "the Backend goes before its Subscriptions");
        ctx.metrics.kube(BACKEND, "event");
        let ev = Event {
            type_: EventType::Warning,
            reason: "DeletionGraceOver".into(),
            note: Some(note.chars().take(1024).collect()),
            action: "Delete".into(),
            secondary: None,
        };
        if let Err(e) = ctx.recorder.publish(&ev, &b.object_ref(&())).await {
            tracing::warn!(backend = %b.name_any(), error = %e, "could not record an Event");
        }
    }
    let list = b
        .finalizers()
        .iter()
        .filter(|f| *f != BACKEND_FINALIZER)
        .cloned()
        .collect();
    set(ctx, b, list).await?;
    Ok(Action::await_change())
}

/// The Subscriptions of namespace `ns` that still exist, whichever Backend they name: all but
/// those deleted whose finalizer is gone (their account queues are leftovers).
pub fn existing(ctx: &Ctx, ns: &str) -> Vec<String> {
    ctx.subs
        .state()
        .iter()
        .filter(|s| s.namespace().as_deref() == Some(ns))
        .filter(|s| {
            s.metadata.deletion_timestamp.is_none() || s.finalizers().iter().any(|f| f == FINALIZER)
        })
        .map(|s| s.name_any())
        .collect()
}

/// The Subscriptions of namespace `ns` that name Backend `name` and still hold their finalizer
/// (their consumer may still be on the broker), by name, from the cache.
fn users(ctx: &Ctx, ns: &str, name: &str) -> Vec<String> {
    let state = ctx.subs.state();
    let mut out: Vec<String> = index::subscriptions_of(state.iter().map(AsRef::as_ref), ns, name)
        .into_iter()
        .filter(|s| s.finalizers().iter().any(|f| f == FINALIZER))
        .map(ResourceExt::name_any)
        .collect();
    out.sort();
    out
}
