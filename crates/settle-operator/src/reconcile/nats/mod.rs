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

/// The consumer as the spec asks, step by step: resolve the stream, make a new Subscription's
/// consumer at once, else [`Check::find`] it, and make it again ([`Check::recreate`]), replace
/// an earlier object's leftover ([`Check::replace_left_over`]), leave another's alone or take it
/// over ([`Check::not_ours`], [`Check::note_adopted`]), or bring it to the spec in place
/// ([`Check::repair`]).
async fn converge(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &NatsConn,
    changes: &mut Changes,
    live_pause: &mut Option<LivePause>,
) -> SubOutcome {
    if !conn.connected() {
        return SubOutcome::Broker {
            error: NatsError::Unreachable("the connection is down; reconnecting".into()).into(),
            consumer: t.known.clone(),
        };
    }
    // Refused for a limit before and its gate still closed: not a single broker call.
    let (backend, who) = keys(t);
    if let Some(limit) = ctx.conns.gates.held(&backend, &who) {
        return limited(limit);
    }
    let stream = match resolve(t, ctx, conn).await {
        Ok(s) => s,
        Err(o) => return o,
    };
    let c = Check::of(t, ctx, conn, &stream);
    // Never made for this object (no consumer in its status): most likely none is there, so it
    // is made at once. JetStream's create answers an identical config with the consumer (ours:
    // the config carries this object's marks) and refuses one that differs (10148): that one
    // is read below like any other. One call fewer per new Subscription (issue 21). One this
    // connection just made is read instead: a check that runs before the status saying so
    // reaches the cache (a Backend's reconnect re-checks every Subscription) made it again,
    // an extra call and a second "created" Event.
    if t.known.is_some() {
        conn.made_shown(&stream, &c.want.name);
    }
    if t.known.is_none()
        && !conn.made_recently(&stream, &c.want.name)
        && let Some(done) = c.create_new(changes, live_pause).await
    {
        return done;
    }
    let info = match c.find().await {
        Ok(Some(info)) => info,
        Ok(None) => return c.recreate(changes, live_pause).await,
        Err(o) => return o,
    };
    *live_pause = Some(LivePause::of(&info));
    let live = mapping::normalise(&stream, &c.want.name, &info.config);
    if live.left_over_for_deletion(&t.owner, t.uid()) {
        return c.replace_left_over(&live, changes, live_pause).await;
    }
    let adopted = c.adopted(&live);
    if !adopted && !live.belongs_to(&t.owner, t.uid()) {
        // Another's, or kept by an earlier object of this name (its UID differs).
        return c.not_ours(&live, &info, changes).await;
    }
    if adopted {
        c.note_adopted(&live, changes);
    }
    c.repair(&live, changes).await
}

/// The stream the Subscription's consumer lives on (`spec.stream`, or the one whose subjects
/// take the pattern).
async fn resolve(t: &Target<'_>, ctx: &Ctx, conn: &NatsConn) -> Result<String, SubOutcome> {
    ctx.metrics.js("stream");
    admin::resolve_stream(&conn.js, t.sub.spec.stream.as_deref(), &t.policy.pattern)
        .await
        .map_err(|error| broker_failure(error, t.known.clone()))
}

/// One check of one consumer: what every step of [`converge`] reads.
struct Check<'a, 's> {
    t: &'a Target<'s>,
    ctx: &'a Ctx,
    conn: &'a NatsConn,
    /// The consumer the mapping asks for, with this object's marks.
    want: mapping::ConsumerConfig,
    /// Where it is: its stream and name, as status shows it.
    here: ConsumerRef,
}

impl<'a, 's> Check<'a, 's> {
    fn of(t: &'a Target<'s>, ctx: &'a Ctx, conn: &'a NatsConn, stream: &str) -> Self {
        let want = mapping::desired(&t.namespace, &t.name, stream, &t.policy)
            .for_object(t.uid(), t.sub.spec.deletion_policy);
        let here = ConsumerRef {
            stream: stream.to_string(),
            name: want.name.clone(),
        };
        Check {
            t,
            ctx,
            conn,
            want,
            here,
        }
    }

    fn failure(&self, error: NatsError) -> SubOutcome {
        broker_failure(error, self.t.known.clone())
    }

    /// A new Subscription's consumer made at once; `None` when JetStream has one of the name
    /// already (10148), to be read like any other.
    async fn create_new(
        &self,
        changes: &mut Changes,
        live_pause: &mut Option<LivePause>,
    ) -> Option<SubOutcome> {
        let (t, ctx, conn) = (self.t, self.ctx, self.conn);
        let (want, stream) = (&self.want, &self.here.stream);
        let (backend, who) = keys(t);
        if let Some(limit) = ctx.conns.gates.check(&backend, stream, &who) {
            return Some(limited(limit));
        }
        conn.mark_own(Own::Created, stream, &want.name);
        ctx.metrics.js("create");
        match admin::create_consumer_paused(&conn.js, want, pause_api::request(t.pause)).await {
            Ok(info) => {
                conn.note_made(stream, &want.name);
                *live_pause = Some(LivePause::of(&info));
                ctx.conns.gates.created(&backend, stream);
                tracing::info!(subscription = %t.owner, %stream, consumer = %want.name, op = ChangeKind::Created.op(), "consumer");
                changes.push(
                    ChangeKind::Created,
                    format!("created consumer {} on stream {stream}", want.name),
                );
                Some(ready(self.here.clone()))
            }
            Err(e) if e.code() == Some(CONSUMER_EXISTS) => None,
            Err(NatsError::Limit(limit)) => Some(refused(t, ctx, conn, limit).await),
            Err(error) => Some(self.failure(error)),
        }
    }

    /// The live consumer's info (`None`: there is none).
    async fn find(&self) -> Result<Option<async_nats::jetstream::consumer::Info>, SubOutcome> {
        self.ctx.metrics.js("info");
        admin::consumer_info(&self.conn.js, &self.here.stream, &self.want.name)
            .await
            .map_err(|error| self.failure(error))
    }

    /// Missing: made for the first time, or again after someone (or a lost stream) removed it.
    async fn recreate(
        &self,
        changes: &mut Changes,
        live_pause: &mut Option<LivePause>,
    ) -> SubOutcome {
        let (t, ctx, conn) = (self.t, self.ctx, self.conn);
        let (want, stream) = (&self.want, &self.here.stream);
        // Made again: the status names it, or this connection made it lately and the status
        // saying so has not reached the cache yet (deleted on the broker within a moment of its
        // making: an Event saying "created" would hide that it was lost).
        let again = t.known.as_ref() == Some(&self.here) || conn.made_recently(stream, &want.name);
        let (backend, who) = keys(t);
        if let Some(limit) = ctx.conns.gates.check(&backend, stream, &who) {
            return limited(limit);
        }
        match create(conn, ctx, want, t.pause).await {
            Ok(made) => *live_pause = Some(made),
            Err(NatsError::Limit(limit)) => return refused(t, ctx, conn, limit).await,
            Err(error) => return self.failure(error),
        }
        ctx.conns.gates.created(&backend, stream);
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

    /// Made for an earlier object of this name, deleted while no operator ran: it asked for
    /// its consumer to go with it. Removed, and made anew for this object.
    async fn replace_left_over(
        &self,
        live: &mapping::ConsumerConfig,
        changes: &mut Changes,
        live_pause: &mut Option<LivePause>,
    ) -> SubOutcome {
        let (t, ctx, conn) = (self.t, self.ctx, self.conn);
        let (want, stream) = (&self.want, &self.here.stream);
        conn.mark_own(Own::Deleted, stream, &want.name);
        ctx.metrics.js("delete");
        if let Err(error) = admin::delete_consumer(&conn.js, stream, &want.name).await {
            return self.failure(error);
        }
        match create(conn, ctx, want, t.pause).await {
            Ok(made) => *live_pause = Some(made),
            Err(error) => return self.failure(error),
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

    /// Kept (Retain) by an earlier object of this name: taken over only when the adopt
    /// annotation names that object's UID; its marks are then updated in place (metadata is
    /// editable).
    fn adopted(&self, live: &mapping::ConsumerConfig) -> bool {
        let (owner, uid) = (self.t.owner.as_str(), self.t.uid());
        live.owner() == Some(owner)
            && live
                .owner_uid()
                .is_some_and(|u| Some(u) != uid && Some(u) == self.t.adopt())
    }

    /// Another's, or kept by an earlier object of this name: a conflict naming its holder, or,
    /// for one Settle did not make, taken over as spec.adopt asks (J9).
    async fn not_ours(
        &self,
        live: &mapping::ConsumerConfig,
        info: &async_nats::jetstream::consumer::Info,
        changes: &mut Changes,
    ) -> SubOutcome {
        let (t, ctx) = (self.t, self.ctx);
        let owner = t.owner.as_str();
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
                    Holder::Unadoptable(Unadoptable::NamespaceNotAllowed(t.namespace.clone()))
                }
                Adoption::IfCompatible => {
                    let d = mapping::diff(&self.want, live);
                    if d.immutable.is_empty() {
                        return adopt(
                            t,
                            ctx,
                            self.conn,
                            &self.want,
                            &d,
                            info,
                            self.here.clone(),
                            changes,
                        )
                        .await;
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

    /// The takeover by the adopt annotation, said.
    fn note_adopted(&self, live: &mapping::ConsumerConfig, changes: &mut Changes) {
        let (want, stream) = (&self.want, &self.here.stream);
        let note = format!(
            "took over consumer {} on stream {stream}, kept by the earlier Subscription of this name with uid {}, as annotation {ADOPT_ANNOTATION} asked",
            want.name,
            live.owner_uid().unwrap_or("?")
        );
        tracing::info!(subscription = %self.t.owner, %stream, consumer = %want.name, "{note}");
        changes.push(ChangeKind::Adopted, note);
    }

    /// This object's consumer against the mapping: a field JetStream cannot change in place
    /// reported, the editable ones updated in place.
    async fn repair(&self, live: &mapping::ConsumerConfig, changes: &mut Changes) -> SubOutcome {
        let (want, stream) = (&self.want, &self.here.stream);
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
            self.ctx.metrics.js("update");
            if let Err(error) = admin::update_consumer(&self.conn.js, want).await {
                return self.failure(error);
            }
            tracing::info!(subscription = %self.t.owner, %stream, consumer = %want.name, changes = %edits, "updated the consumer in place");
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
