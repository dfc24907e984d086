//! The Subscription controller's broker step on NATS JetStream: resolve the stream, create the
//! consumer of a new Subscription at once, else read it and create it or update it in place,
//! through the one mapping (`backend::nats::mapping`), then keep its pause equal to the spec's
//! (`backend::nats::pause`: read back from the info, set with `CONSUMER.PAUSE` when it differs,
//! never through the config diff),
//! and delete it when the Subscription goes. A consumer of another Subscription, or one an earlier
//! object of this name kept (deletionPolicy Retain), is left alone unless the `settle.dev/adopt`
//! annotation names that object's UID (docs/semantics.md C15, J8). One Settle did not make (no
//! owner mark) is left alone too, unless `spec.adopt: IfCompatible` asks for it, the namespace
//! may (`--adopt-namespaces`) and it equals the mapping where JetStream cannot change it in
//! place: then it is marked this object's in one update, with its position (J9).
//!
//! The files, the same on every broker: this one is the step (`ensure`: converge); [`claim`]
//! says whose a live object is or takes it over, [`create`] makes one, [`pause`] keeps its
//! pause, [`remove`] deletes it.
//!
//! It must not write status or Events, add finalizers or decide requeues (the pipeline in
//! [`super::subscription`] does); it returns what the broker now holds and what it changed
//! ([`super::step`]).

use super::Ctx;
use super::connections::NatsConn;
use super::gate::{BackendKey, Who};
use super::status::{ADOPT_ANNOTATION, Holder, ObjectKind, SubOutcome, Unadoptable};
use super::step::{Adoption, ChangeKind, Changes, Converged, Removal, Target};
use settle::api::ConsumerRef;
use settle::backend::Classify;
use settle::backend::limit::{BrokerLimit, LimitScope, SetBy};
use settle::backend::nats::admin::{self, NatsError};
use settle::backend::nats::advisory::ChangeKind as Own;
use settle::backend::nats::mapping;
use settle::backend::nats::pause::{self as pause_api, LivePause};
use settle::policy::Pause;

mod claim;
mod create;
mod pause;
mod remove;

use claim::*;
use create::*;
use pause::*;
pub use remove::remove;

/// JetStream's "consumer already exists" (two creates raced).
pub(super) const CONSUMER_EXISTS: u64 = 10_148;

/// Step 5 on NATS: the consumer exists and matches the spec, its pause included, or why not.
pub async fn ensure(t: &Target<'_>, ctx: &Ctx, conn: &NatsConn) -> Converged {
    let mut changes = Changes::default();
    let mut live_pause = None;
    let mut outcome = converge(t, ctx, conn, &mut changes, &mut live_pause).await;
    if let SubOutcome::Ready { object, .. } = &outcome
        && let Err(failed) = keep_paused(t, ctx, conn, object, live_pause, &mut changes).await
    {
        outcome = failed;
    }
    changes.with(outcome)
}

async fn converge(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &NatsConn,
    changes: &mut Changes,
    live_pause: &mut Option<LivePause>,
) -> SubOutcome {
    let (ns, name, known) = (&t.namespace, &t.name, t.known.clone());
    if !conn.connected() {
        return SubOutcome::Broker {
            error: NatsError::Unreachable("the connection is down; reconnecting".into()).into(),
            consumer: known,
        };
    }
    // Refused for a limit before and its gate still closed: not a single broker call.
    let (backend, who) = keys(t);
    if let Some(limit) = ctx.conns.gates.held(&backend, &who) {
        return limited(limit);
    }
    let policy = &t.policy;
    ctx.metrics.js("stream");
    let stream = match admin::resolve_stream(
        &conn.js,
        t.sub.spec.stream.as_deref(),
        &policy.pattern,
    )
    .await
    {
        Ok(s) => s,
        Err(error) => return broker_failure(error, known),
    };
    let uid = t.uid();
    let want =
        mapping::desired(ns, name, &stream, policy).for_object(uid, t.sub.spec.deletion_policy);
    let here = ConsumerRef {
        stream: stream.clone(),
        name: want.name.clone(),
    };
    // Never made for this object (no consumer in its status): most likely none is there, so it
    // is made at once. JetStream's create answers an identical config with the consumer (ours:
    // the config carries this object's marks) and refuses one that differs (10148): that one
    // is read below like any other. One call fewer per new Subscription (issue 21). One this
    // connection just made is read instead: a check that runs before the status saying so
    // reaches the cache (a Backend's reconnect re-checks every Subscription) made it again,
    // an extra call and a second "created" Event.
    if known.is_some() {
        conn.made_shown(&stream, &want.name);
    }
    if known.is_none() && !conn.made_recently(&stream, &want.name) {
        if let Some(limit) = ctx.conns.gates.check(&backend, &stream, &who) {
            return limited(limit);
        }
        conn.mark_own(Own::Created, &stream, &want.name);
        ctx.metrics.js("create");
        match admin::create_consumer_paused(&conn.js, &want, pause_api::request(t.pause)).await {
            Ok(info) => {
                conn.note_made(&stream, &want.name);
                *live_pause = Some(LivePause::of(&info));
                ctx.conns.gates.created(&backend, &stream);
                tracing::info!(subscription = %t.owner, %stream, consumer = %want.name, op = ChangeKind::Created.op(), "consumer");
                changes.push(
                    ChangeKind::Created,
                    format!("created consumer {} on stream {stream}", want.name),
                );
                return ready(here);
            }
            Err(e) if e.code() == Some(CONSUMER_EXISTS) => {}
            Err(NatsError::Limit(limit)) => return refused(t, ctx, conn, limit).await,
            Err(error) => return broker_failure(error, known),
        }
    }
    ctx.metrics.js("info");
    let live = match admin::consumer_info(&conn.js, &stream, &want.name).await {
        Ok(live) => live,
        Err(error) => return broker_failure(error, known),
    };
    let Some(info) = live else {
        // Missing: made for the first time, or again after someone (or a lost stream) removed it.
        // Made again: the status names it, or this connection made it lately and the status
        // saying so has not reached the cache yet (deleted on the broker within a moment of its
        // making: an Event saying "created" would hide that it was lost).
        let again = known.as_ref() == Some(&here) || conn.made_recently(&stream, &want.name);
        if let Some(limit) = ctx.conns.gates.check(&backend, &stream, &who) {
            return limited(limit);
        }
        match create(conn, ctx, &want, t.pause).await {
            Ok(made) => *live_pause = Some(made),
            Err(NatsError::Limit(limit)) => return refused(t, ctx, conn, limit).await,
            Err(error) => return broker_failure(error, known),
        }
        ctx.conns.gates.created(&backend, &stream);
        let (kind, note) = if again {
            (
                ChangeKind::Recreated,
                format!(
                    "consumer {} on stream {stream} was missing from the broker (deleted there, or lost): made it again",
                    want.name
                ),
            )
        } else {
            (
                ChangeKind::Created,
                format!("created consumer {} on stream {stream}", want.name),
            )
        };
        tracing::info!(subscription = %t.owner, %stream, consumer = %want.name, op = kind.op(), "consumer");
        changes.push(kind, note);
        return ready(here);
    };
    *live_pause = Some(LivePause::of(&info));
    let live = mapping::normalise(&stream, &want.name, &info.config);
    let owner = t.owner.as_str();
    if live.left_over_for_deletion(owner, uid) {
        // Made for an earlier object of this name, deleted while no operator ran: it asked for
        // its consumer to go with it. Removed, and made anew for this object.
        conn.mark_own(Own::Deleted, &stream, &want.name);
        ctx.metrics.js("delete");
        if let Err(error) = admin::delete_consumer(&conn.js, &stream, &want.name).await {
            return broker_failure(error, known);
        }
        match create(conn, ctx, &want, t.pause).await {
            Ok(made) => *live_pause = Some(made),
            Err(error) => return broker_failure(error, known),
        }
        let note = format!(
            "consumer {} on stream {stream} was left over from an earlier Subscription of this name (uid {}), deleted while the operator was not running: deleted it, as that Subscription's deletionPolicy asked, and made it again for this one",
            want.name,
            live.owner_uid().unwrap_or("?")
        );
        tracing::info!(subscription = %owner, %stream, consumer = %want.name, "{note}");
        changes.push(ChangeKind::Recreated, note);
        return ready(here);
    }
    // Kept (Retain) by an earlier object of this name: taken over only when the adopt annotation
    // names that object's UID; its marks are then updated in place (metadata is editable).
    let adopted = live.owner() == Some(owner)
        && live
            .owner_uid()
            .is_some_and(|u| Some(u) != uid && Some(u) == t.adopt());
    if !adopted && !live.belongs_to(owner, uid) {
        // Another's, or kept by an earlier object of this name (its UID differs).
        let by = match (live.owner(), live.owner_uid()) {
            (Some(o), Some(u)) if o == owner => Holder::Earlier {
                owner: o.to_string(),
                uid: u.to_string(),
            },
            (Some(o), _) => Holder::Other(o.to_string()),
            // Settle did not make it: taken over only as spec.adopt asks (J9).
            (None, _) => match t.adoption(&ctx.adopt_namespaces) {
                Adoption::Never => Holder::Unmarked,
                Adoption::NotAllowed => {
                    Holder::Unadoptable(Unadoptable::NamespaceNotAllowed(ns.clone()))
                }
                Adoption::IfCompatible => {
                    let d = mapping::diff(&want, &live);
                    if d.immutable.is_empty() {
                        return adopt(t, ctx, conn, &want, &d, &info, here, changes).await;
                    }
                    Holder::Unadoptable(Unadoptable::Differs(
                        d.immutable.iter().map(ToString::to_string).collect(),
                    ))
                }
            },
        };
        return SubOutcome::Conflict {
            kind: ObjectKind::Consumer,
            object: here,
            owner: by,
        };
    }
    if adopted {
        let note = format!(
            "took over consumer {} on stream {stream}, kept by the earlier Subscription of this name with uid {}, as annotation {ADOPT_ANNOTATION} asked",
            want.name,
            live.owner_uid().unwrap_or("?")
        );
        tracing::info!(subscription = %owner, %stream, consumer = %want.name, "{note}");
        changes.push(ChangeKind::Adopted, note);
    }
    let d = mapping::diff(&want, &live);
    if !d.immutable.is_empty() {
        return SubOutcome::Immutable {
            kind: ObjectKind::Consumer,
            object: here,
            fields: d.immutable.iter().map(ToString::to_string).collect(),
        };
    }
    if !d.editable.is_empty() {
        let edits = d
            .editable
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        ctx.metrics.js("update");
        if let Err(error) = admin::update_consumer(&conn.js, &want).await {
            return broker_failure(error, known);
        }
        tracing::info!(subscription = %owner, %stream, consumer = %want.name, changes = %edits, "updated the consumer in place");
        changes.push(
            ChangeKind::Updated,
            format!("updated consumer {} in place: {edits}", want.name),
        );
    }
    ready(here)
}

pub(super) fn broker_failure(error: NatsError, known: Option<ConsumerRef>) -> SubOutcome {
    // Only while the broker cannot answer is the consumer known from before still shown.
    let consumer = error.is_unreachable().then_some(known).flatten();
    SubOutcome::Broker {
        error: error.into(),
        consumer,
    }
}
