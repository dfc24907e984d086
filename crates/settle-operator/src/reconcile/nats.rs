//! The Subscription controller's broker step on NATS JetStream: resolve the stream, create the
//! consumer of a new Subscription at once, else read it and create it or update it in place,
//! through the one mapping (`backend::nats::consumer`), then keep its pause equal to the spec's
//! (`backend::nats::pause`: read back from the info, set with `CONSUMER.PAUSE` when it differs,
//! never through the config diff),
//! and delete it when the Subscription goes. A consumer of another Subscription, or one an earlier
//! object of this name kept (deletionPolicy Retain), is left alone unless the `settle.dev/adopt`
//! annotation names that object's UID (docs/semantics.md C15, J8). One Settle did not make (no
//! owner mark) is left alone too, unless `spec.adopt: IfCompatible` asks for it, the namespace
//! may (`--adopt-namespaces`) and it equals the mapping where JetStream cannot change it in
//! place: then it is marked this object's in one update, with its position (J9).
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
use settle::backend::nats::advisory::ChangeKind as Own;
use settle::backend::nats::consumer;
use settle::backend::nats::jsapi::{self, NatsError};
use settle::backend::nats::pause::{self, LivePause};
use settle::policy::Pause;

/// JetStream's "consumer already exists" (two creates raced).
const CONSUMER_EXISTS: u64 = 10_148;

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

/// The consumer's pause equal to the spec's (semantics W2): read back from `CONSUMER.INFO`
/// (`live`, when the converge step read it or made the consumer), and set with `CONSUMER.PAUSE`
/// only when it differs, so a consumer resumed (or paused) by hand is put back.
async fn keep_paused(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &NatsConn,
    object: &ConsumerRef,
    live: Option<LivePause>,
    changes: &mut Changes,
) -> Result<(), SubOutcome> {
    let live = match live {
        Some(l) => l,
        None => {
            ctx.metrics.js("info");
            match jsapi::consumer_info(&conn.js, &object.stream, &object.name).await {
                Ok(Some(info)) => LivePause::of(&info),
                Ok(None) => {
                    return Err(broker_failure(
                        NatsError::Unreachable("the consumer went while it was checked".into()),
                        Some(object.clone()),
                    ));
                }
                Err(e) => return Err(broker_failure(e, Some(object.clone()))),
            }
        }
    };
    if live.matches(t.pause) {
        return Ok(());
    }
    ctx.metrics.js("pause");
    let now = match jsapi::pause_consumer(
        &conn.js,
        &object.stream,
        &object.name,
        pause::request(t.pause),
    )
    .await
    {
        Ok(now) => now,
        Err(e) => return Err(broker_failure(e, Some(object.clone()))),
    };
    if !now.matches(t.pause) {
        return Err(broker_failure(
            NatsError::Api {
                code: 0,
                description: format!(
                    "CONSUMER.PAUSE answered paused={} (until {:?}) where the spec asks to be {} (JetStream's pause needs nats-server 2.11 or newer)",
                    now.paused,
                    now.until.map(|t| t.to_string()),
                    if t.pause.is_paused() {
                        "paused"
                    } else {
                        "running"
                    }
                ),
            },
            Some(object.clone()),
        ));
    }
    let (kind, note) = match t.pause {
        Pause::Running => (
            ChangeKind::Resumed,
            format!(
                "resumed consumer {} on stream {}",
                object.name, object.stream
            ),
        ),
        p => (
            ChangeKind::Paused,
            format!(
                "paused consumer {} on stream {} {} (it was {})",
                object.name,
                object.stream,
                p.until_text(),
                if live.paused {
                    "paused until another time"
                } else {
                    "running"
                }
            ),
        ),
    };
    tracing::info!(subscription = %t.owner, stream = %object.stream, consumer = %object.name, op = kind.op(), "{note}");
    changes.push(kind, note);
    Ok(())
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
    let stream = match jsapi::resolve_stream(
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
        consumer::desired(ns, name, &stream, policy).for_object(uid, t.sub.spec.deletion_policy);
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
        match jsapi::create_consumer_paused(&conn.js, &want, pause::request(t.pause)).await {
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
    let live = match jsapi::consumer_info(&conn.js, &stream, &want.name).await {
        Ok(live) => live,
        Err(error) => return broker_failure(error, known),
    };
    let Some(info) = live else {
        // Missing: made for the first time, or again after someone (or a lost stream) removed it.
        let again = known.as_ref() == Some(&here);
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
    let live = consumer::normalise(&stream, &want.name, &info.config);
    let owner = t.owner.as_str();
    if live.left_over_for_deletion(owner, uid) {
        // Made for an earlier object of this name, deleted while no operator ran: it asked for
        // its consumer to go with it. Removed, and made anew for this object.
        conn.mark_own(Own::Deleted, &stream, &want.name);
        ctx.metrics.js("delete");
        if let Err(error) = jsapi::delete_consumer(&conn.js, &stream, &want.name).await {
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
                    let d = consumer::diff(&want, &live);
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
    let d = consumer::diff(&want, &live);
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
        if let Err(error) = jsapi::update_consumer(&conn.js, &want).await {
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

/// Takes over a consumer Settle did not make that equals `want` where JetStream cannot change
/// it in place (J9): one update writes this object's marks and brings the editable fields
/// (`d.editable`) to the spec, on the same consumer, so its position (what it delivered, its
/// acknowledgement floor, what waits for an ack) stays as it was. Two Subscriptions that take
/// the same consumer at once (namespaces sharing a broker, both allowed): the later update's
/// marks hold, and the other's next check finds it another's.
#[allow(clippy::too_many_arguments)]
async fn adopt(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &NatsConn,
    want: &consumer::ConsumerConfig,
    d: &consumer::Diff,
    before: &async_nats::jetstream::consumer::Info,
    here: ConsumerRef,
    changes: &mut Changes,
) -> SubOutcome {
    ctx.metrics.js("update");
    let after = match jsapi::update_consumer(&conn.js, want).await {
        Ok(info) => info,
        Err(error) => return broker_failure(error, t.known.clone()),
    };
    let edits = d
        .editable
        .iter()
        // The marks are the takeover itself, said once.
        .filter(|f| f.field != "metadata" && f.field != "description")
        .map(ToString::to_string)
        .collect::<Vec<_>>();
    let note = format!(
        "took over consumer {} on stream {}, which Settle did not make, as spec.adopt IfCompatible asked: \
         the same consumer (created {}), with its position (delivered up to stream sequence {}, {} delivered \
         and not yet acknowledged, {} pending){}",
        want.name,
        want.stream,
        before.created,
        after.delivered.stream_sequence,
        after.num_ack_pending,
        after.num_pending,
        if edits.is_empty() {
            String::new()
        } else {
            format!("; brought to the spec in place: {}", edits.join("; "))
        }
    );
    tracing::info!(subscription = %t.owner, stream = %want.stream, consumer = %want.name, op = ChangeKind::Adopted.op(), "{note}");
    changes.push(ChangeKind::Adopted, note);
    ready(here)
}

/// The Backend's and the Subscription's keys, as the gates know them.
fn keys(t: &Target<'_>) -> (BackendKey, Who) {
    (
        (t.namespace.clone(), t.sub.spec.backend_ref.name.clone()),
        (t.namespace.clone(), t.name.clone()),
    )
}

fn limited(limit: BrokerLimit) -> SubOutcome {
    SubOutcome::Broker {
        error: NatsError::Limit(limit).into(),
        consumer: None,
    }
}

/// A create refused for `limit`: named (which limit, read once while the gate is closed) and
/// its gate closed.
async fn refused(t: &Target<'_>, ctx: &Ctx, conn: &NatsConn, limit: BrokerLimit) -> SubOutcome {
    let (backend, who) = keys(t);
    let limit = match limit {
        BrokerLimit::StreamConsumers {
            stream, max: None, ..
        } => {
            match ctx
                .conns
                .gates
                .known(&backend, &LimitScope::Stream(stream.clone()))
            {
                Some(known) => known,
                None => {
                    ctx.metrics.js("stream");
                    jsapi::consumer_limit(&conn.js, &stream).await.unwrap_or(
                        BrokerLimit::StreamConsumers {
                            stream,
                            max: None,
                            set_by: SetBy::Unknown,
                        },
                    )
                }
            }
        }
        other => other,
    };
    let delay = ctx.conns.gates.refused(&backend, limit.clone(), &who);
    tracing::info!(subscription = %t.owner, limit = limit.label(), retry_in = ?delay, "the broker refused the consumer for a limit: creates it holds back wait");
    limited(limit)
}

fn ready(object: ConsumerRef) -> SubOutcome {
    SubOutcome::Ready {
        kind: ObjectKind::Consumer,
        object,
    }
}

/// Creates `want`, paused from the start when the spec asks; returns its pause.
async fn create(
    conn: &NatsConn,
    ctx: &Ctx,
    want: &consumer::ConsumerConfig,
    pause: Pause,
) -> Result<LivePause, NatsError> {
    conn.mark_own(Own::Created, &want.stream, &want.name);
    ctx.metrics.js("create");
    match jsapi::create_consumer_paused(&conn.js, want, pause::request(pause)).await {
        Ok(info) => {
            conn.note_made(&want.stream, &want.name);
            Ok(LivePause::of(&info))
        }
        // Made meanwhile by a racing reconcile (an old leader's last call): converge next time.
        Err(e) if e.code() == Some(CONSUMER_EXISTS) => Err(NatsError::Unreachable(
            "the consumer was created concurrently; checking it again".into(),
        )),
        Err(e) => Err(e),
    }
}

fn broker_failure(error: NatsError, known: Option<ConsumerRef>) -> SubOutcome {
    // Only while the broker cannot answer is the consumer known from before still shown.
    let consumer = error.is_unreachable().then_some(known).flatten();
    SubOutcome::Broker {
        error: error.into(),
        consumer,
    }
}

fn waiting(e: NatsError) -> Removal {
    match e {
        NatsError::Unreachable(m) => Removal::Wait(m),
        e => Removal::Failed(e.to_string()),
    }
}

/// The cleanup's broker call on NATS: deletes this Subscription's consumer, if it is there and
/// its own.
pub async fn remove(t: &Target<'_>, ctx: &Ctx, conn: &NatsConn) -> Removal {
    if !conn.connected() {
        return Removal::Wait("the Backend's connection is down".into());
    }
    let target = match t.known.clone() {
        Some(c) => c,
        None => {
            ctx.metrics.js("stream");
            match jsapi::resolve_stream(&conn.js, t.sub.spec.stream.as_deref(), &t.policy.pattern)
                .await
            {
                Ok(stream) => ConsumerRef {
                    name: consumer::consumer_name(&t.namespace, &t.name, &t.policy),
                    stream,
                },
                Err(NatsError::Unreachable(m)) => return Removal::Wait(m),
                // No stream, or several: Settle never made a consumer for it.
                Err(_) => return Removal::Nothing,
            }
        }
    };
    ctx.metrics.js("info");
    let info = match jsapi::consumer_info(&conn.js, &target.stream, &target.name).await {
        Ok(Some(i)) => i,
        Ok(None) => return Removal::Nothing,
        Err(e) => return waiting(e),
    };
    let owner = &t.owner;
    if !consumer::normalise(&target.stream, &target.name, &info.config).belongs_to(owner, t.uid()) {
        tracing::info!(subscription = %owner, consumer = %target.name, "the consumer is not this Subscription's: left alone");
        return Removal::Nothing;
    }
    conn.mark_own(Own::Deleted, &target.stream, &target.name);
    ctx.metrics.js("delete");
    if let Err(e) = jsapi::delete_consumer(&conn.js, &target.stream, &target.name).await {
        return waiting(e);
    }
    // A place on the stream: a create its limit refused may go now.
    ctx.conns.gates.freed(&keys(t).0, Some(&target.stream));
    tracing::info!(subscription = %owner, stream = %target.stream, consumer = %target.name, "deleted the consumer");
    Removal::Deleted(format!(
        "deleted consumer {} on stream {}",
        target.name, target.stream
    ))
}
