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
use async_nats::jetstream::consumer;
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

/// What one converge works on: the Subscription, its connection, and the consumer it should
/// have (`want`, named `here`), with the gate keys of its Backend and itself.
struct Work<'a> {
    t: &'a Target<'a>,
    ctx: &'a Ctx,
    conn: &'a NatsConn,
    stream: String,
    want: mapping::ConsumerConfig,
    here: ConsumerRef,
    backend: BackendKey,
    who: Who,
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
    let want =
        mapping::desired(ns, name, &stream, policy).for_object(t.uid(), t.sub.spec.deletion_policy);
    let here = ConsumerRef {
        stream: stream.clone(),
        name: want.name.clone(),
    };
    let w = Work {
        t,
        ctx,
        conn,
        stream,
        want,
        here,
        backend,
        who,
    };
    if let Some(done) = w.create_at_once(changes, live_pause).await {
        return done;
    }
    ctx.metrics.js("info");
    let live = match admin::consumer_info(&conn.js, &w.stream, &w.want.name).await {
        Ok(live) => live,
        Err(error) => return broker_failure(error, known),
    };
    let Some(info) = live else {
        return w.make_missing(changes, live_pause).await;
    };
    *live_pause = Some(LivePause::of(&info));
    w.match_live(&info, changes, live_pause).await
}

impl Work<'_> {
    /// Never made for this object (no consumer in its status): most likely none is there, so it
    /// is made at once. JetStream's create answers an identical config with the consumer (ours:
    /// the config carries this object's marks) and refuses one that differs (10148): that one
    /// is read next like any other (`None`). One call fewer per new Subscription. One this
    /// connection just made is read instead: a check that runs before the status saying so
    /// reaches the cache (a Backend's reconnect re-checks every Subscription) made it again,
    /// an extra call and a second "created" Event.
    async fn create_at_once(
        &self,
        changes: &mut Changes,
        live_pause: &mut Option<LivePause>,
    ) -> Option<SubOutcome> {
        let (t, ctx, conn, want, stream) = (self.t, self.ctx, self.conn, &self.want, &self.stream);
        if t.known.is_some() {
            conn.made_shown(stream, &want.name);
            return None;
        }
        if conn.made_recently(stream, &want.name) {
            return None;
        }
        if let Some(limit) = ctx.conns.gates.check(&self.backend, stream, &self.who) {
            return Some(limited(limit));
        }
        conn.mark_own(Own::Created, stream, &want.name);
        ctx.metrics.js("create");
        match admin::create_consumer_paused(&conn.js, want, pause_api::request(t.pause)).await {
            Ok(info) => {
                conn.note_made(stream, &want.name);
                *live_pause = Some(LivePause::of(&info));
                ctx.conns.gates.created(&self.backend, stream);
                tracing::info!(subscription = %t.owner, %stream, consumer = %want.name, op = ChangeKind::Created.op(), "consumer");
                changes.push(
                    ChangeKind::Created,
                    format!("created consumer {} on stream {stream}", want.name),
                );
                Some(ready(self.here.clone()))
            }
            Err(e) if e.code() == Some(CONSUMER_EXISTS) => None,
            Err(NatsError::Limit(limit)) => Some(refused(t, ctx, conn, limit).await),
            Err(error) => Some(broker_failure(error, t.known.clone())),
        }
    }

    /// Missing: made for the first time, or again after someone (or a lost stream) removed it.
    /// Made again: the status names it, or this connection made it lately and the status
    /// saying so has not reached the cache yet (deleted on the broker within a moment of its
    /// making: an Event saying "created" would hide that it was lost).
    async fn make_missing(
        &self,
        changes: &mut Changes,
        live_pause: &mut Option<LivePause>,
    ) -> SubOutcome {
        let (t, ctx, conn, want, stream) = (self.t, self.ctx, self.conn, &self.want, &self.stream);
        let again = t.known.as_ref() == Some(&self.here) || conn.made_recently(stream, &want.name);
        if let Some(limit) = ctx.conns.gates.check(&self.backend, stream, &self.who) {
            return limited(limit);
        }
        match create(conn, ctx, want, t.pause).await {
            Ok(made) => *live_pause = Some(made),
            Err(NatsError::Limit(limit)) => return refused(t, ctx, conn, limit).await,
            Err(error) => return broker_failure(error, t.known.clone()),
        }
        ctx.conns.gates.created(&self.backend, stream);
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
        ready(self.here.clone())
    }

    /// The consumer is there: made anew when an earlier object left it to be deleted, refused
    /// when it is another's (or taken over as spec.adopt or the adopt annotation asks), else
    /// brought to the spec in place where JetStream allows.
    async fn match_live(
        &self,
        info: &consumer::Info,
        changes: &mut Changes,
        live_pause: &mut Option<LivePause>,
    ) -> SubOutcome {
        let (t, want, stream) = (self.t, &self.want, &self.stream);
        let live = mapping::normalise(stream, &want.name, &info.config);
        let (owner, uid) = (t.owner.as_str(), t.uid());
        if live.left_over_for_deletion(owner, uid) {
            return self.replace_left_over(&live, changes, live_pause).await;
        }
        // Kept (Retain) by an earlier object of this name: taken over only when the adopt
        // annotation names that object's UID; its marks are then updated in place (metadata is
        // editable).
        let adopted = live.owner() == Some(owner)
            && live
                .owner_uid()
                .is_some_and(|u| Some(u) != uid && Some(u) == t.adopt());
        if !adopted && !live.belongs_to(owner, uid) {
            return self.not_ours(&live, info, changes).await;
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
        self.update_in_place(&live, changes).await
    }

    /// Made for an earlier object of this name, deleted while no operator ran: it asked for its
    /// consumer to go with it. Removed, and made anew for this object.
    async fn replace_left_over(
        &self,
        live: &mapping::ConsumerConfig,
        changes: &mut Changes,
        live_pause: &mut Option<LivePause>,
    ) -> SubOutcome {
        let (t, ctx, conn, want, stream) = (self.t, self.ctx, self.conn, &self.want, &self.stream);
        conn.mark_own(Own::Deleted, stream, &want.name);
        ctx.metrics.js("delete");
        if let Err(error) = admin::delete_consumer(&conn.js, stream, &want.name).await {
            return broker_failure(error, t.known.clone());
        }
        match create(conn, ctx, want, t.pause).await {
            Ok(made) => *live_pause = Some(made),
            Err(error) => return broker_failure(error, t.known.clone()),
        }
        let note = format!(
            "consumer {} on stream {stream} was left over from an earlier Subscription of this name (uid {}), deleted while the operator was not running: deleted it, as that Subscription's deletionPolicy asked, and made it again for this one",
            want.name,
            live.owner_uid().unwrap_or("?")
        );
        tracing::info!(subscription = %t.owner, %stream, consumer = %want.name, "{note}");
        changes.push(ChangeKind::Recreated, note);
        ready(self.here.clone())
    }

    /// Another's, or kept by an earlier object of this name (its UID differs): a conflict, unless
    /// Settle did not make it and spec.adopt takes it over (J9).
    async fn not_ours(
        &self,
        live: &mapping::ConsumerConfig,
        info: &consumer::Info,
        changes: &mut Changes,
    ) -> SubOutcome {
        let (t, ctx) = (self.t, self.ctx);
        let by = match (live.owner(), live.owner_uid()) {
            (Some(o), Some(u)) if o == t.owner.as_str() => Holder::Earlier {
                owner: o.to_string(),
                uid: u.to_string(),
            },
            (Some(o), _) => Holder::Other(o.to_string()),
            (None, _) => match t.adoption(&ctx.adopt_namespaces) {
                Adoption::Never => Holder::Unmarked,
                Adoption::NotAllowed => {
                    Holder::Unadoptable(Unadoptable::NamespaceNotAllowed(t.namespace.clone()))
                }
                Adoption::IfCompatible => {
                    let d = mapping::diff(&self.want, live);
                    if d.immutable.is_empty() {
                        let here = self.here.clone();
                        return adopt(t, ctx, self.conn, &self.want, &d, info, here, changes).await;
                    }
                    Holder::Unadoptable(Unadoptable::Differs(
                        d.immutable.iter().map(ToString::to_string).collect(),
                    ))
                }
            },
        };
        SubOutcome::Conflict {
            kind: ObjectKind::Consumer,
            object: self.here.clone(),
            owner: by,
        }
    }

    /// Ours: refused when a field JetStream cannot change differs, else the editable ones are
    /// brought to the spec in one update.
    async fn update_in_place(
        &self,
        live: &mapping::ConsumerConfig,
        changes: &mut Changes,
    ) -> SubOutcome {
        let (t, ctx, conn, want, stream) = (self.t, self.ctx, self.conn, &self.want, &self.stream);
        let d = mapping::diff(want, live);
        if !d.immutable.is_empty() {
            return SubOutcome::Immutable {
                kind: ObjectKind::Consumer,
                object: self.here.clone(),
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
            if let Err(error) = admin::update_consumer(&conn.js, want).await {
                return broker_failure(error, t.known.clone());
            }
            tracing::info!(subscription = %t.owner, %stream, consumer = %want.name, changes = %edits, "updated the consumer in place");
            changes.push(
                ChangeKind::Updated,
                format!("updated consumer {} in place: {edits}", want.name),
            );
        }
        ready(self.here.clone())
    }
}

pub(super) fn broker_failure(error: NatsError, known: Option<ConsumerRef>) -> SubOutcome {
    // Only while the broker cannot answer is the consumer known from before still shown.
    let consumer = error.is_unreachable().then_some(known).flatten();
    SubOutcome::Broker {
        error: error.into(),
        consumer,
    }
}
