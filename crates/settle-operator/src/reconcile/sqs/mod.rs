//! The Subscription controller's broker step on SQS: the queue and, under AtLeastOnce with
//! maxDeliver, its dead-letter queue, from the one mapping (`backend::sqs::mapping::desired`):
//! made when missing (again when deleted on the server), each tagged with the Subscription it
//! belongs to (`namespace/name`, and the object's UID, which decides); attribute drift
//! (VisibilityTimeout, RedrivePolicy) repaired in place with SetQueueAttributes; a queue tagged
//! for another Subscription, untagged, or left by an earlier object of this name, left alone
//! (`ConsumerConflict`) unless the `settle.dev/adopt` annotation names that object's UID
//! (docs/semantics.md Q7). An untagged queue (or dead-letter queue) of the name, one Settle did
//! not make, is taken over and tagged when `spec.adopt: IfCompatible` asks and the namespace may
//! (`--adopt-namespaces`): SQS can change every attribute the mapping sets in place, so any
//! such queue is compatible, and its attributes are then brought to the spec (Q11). Deleting the Subscription deletes its queue, and its dead-letter queue
//! only when it is this object's and empty (what it holds was Exhausted: kept for a person).
//! Beside them, the same way (made, tagged, made again, deleted with the Subscription), the
//! account's report and ledger queues (`backend::sqs::report`). A paused Subscription's queue
//! carries the tag `settle-paused` its applications read (`backend::sqs::pause`, W4): set or
//! removed as the spec says, compared with the tags read for the owner anyway.
//!
//! The files, the same on every broker: this one is the step (`ensure`: converge); [`claim`]
//! says whose a live object is or takes it over, [`create`] makes one, [`pause`] keeps its
//! pause, [`remove`] deletes it.
//!
//! It must not write status or Events, add finalizers or decide requeues (the pipeline in
//! [`super::subscription`] does: this step returns what it changed, [`super::step`]), nor re-state an admission rule: the pipeline's one
//! `policy::validate` has refused what this broker cannot honour (`spec.stream`, A15) before
//! this step runs.

use aws_sdk_sqs::Client;

use super::Ctx;
use super::connections::SqsConn;
use super::status::{ADOPT_ANNOTATION, BrokerError, Holder, ObjectKind, SubOutcome, Unadoptable};
use super::step::{Adoption, ChangeKind, Changes, Converged, Removal, SQS_STREAM, Target};
use settle::api::ConsumerRef;
use settle::backend::Classify;
use settle::backend::sqs::admin::{self, AdminError, OwnerTags};
use settle::backend::sqs::mapping::{self, DLQ_SUFFIX, REDRIVE_POLICY};
use settle::backend::sqs::report;

mod claim;
mod create;
mod pause;
mod remove;

use claim::*;
use create::*;
use pause::*;
pub use remove::remove;

pub(super) fn failure(e: AdminError, known: &Option<ConsumerRef>) -> SubOutcome {
    let error = BrokerError::of(e);
    let consumer = error.is_unreachable().then(|| known.clone()).flatten();
    SubOutcome::Broker { error, consumer }
}

/// Step 5 on SQS: the queue (and its dead-letter queue) exist and match the spec, its pause
/// tag included, or why not.
pub async fn ensure(t: &Target<'_>, ctx: &Ctx, conn: &SqsConn) -> Converged {
    let mut changes = Changes::default();
    let mut queue = None;
    let mut outcome = converge(t, ctx, conn, &mut changes, &mut queue).await;
    if let (SubOutcome::Ready { object, .. }, Some(found)) = (&outcome, &queue)
        && let Err(failed) = keep_paused(t, ctx, conn, object, found, &mut changes).await
    {
        outcome = failed;
    }
    changes.with(outcome)
}

/// The queues as the spec asks, step by step: the [`dead_letter_queue`] first, then the queue
/// found or made ([`find_or_create`]) and, when it was there, its attributes [`repair`]ed in
/// place, then the [`account_queues`] beside it; what was made is said once ([`note_made`]).
async fn converge(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &SqsConn,
    changes: &mut Changes,
    queue_found: &mut Option<Found>,
) -> SubOutcome {
    let client = conn.broker.client();
    let want = match mapping::desired(conn.broker.queue_prefix(), &t.policy) {
        Ok(w) => w,
        Err(e) => return SubOutcome::Invalid(e.to_string()),
    };
    let here = ConsumerRef {
        stream: SQS_STREAM.into(),
        name: want.name.clone(),
    };
    let again = t.known.as_ref() == Some(&here);
    let mut made = Vec::new();

    // The dead-letter queue first: the queue's redrive policy names its ARN.
    let dlq_arn = match &want.redrive {
        None => None,
        Some(r) => match dead_letter_queue(client, ctx, t, r, &mut made, changes).await {
            Ok(arn) => arn,
            Err(o) => return o,
        },
    };
    let attributes = mapping::attributes(&want, dlq_arn.as_deref());
    let found = match find_or_create(
        client,
        ctx,
        t,
        &want.name,
        attributes.clone(),
        true,
        changes,
    )
    .await
    {
        Ok(x) => x,
        Err(o) => return o,
    };
    let (url, new) = (found.url.clone(), found.new);
    *queue_found = Some(found);
    if new {
        made.insert(0, format!("queue {}", want.name));
    } else if let Err(o) = repair(client, ctx, t, &want, &url, attributes, changes).await {
        return o;
    }
    if let Err(o) = account_queues(client, ctx, t, &want.name, &mut made, changes).await {
        return o;
    }
    note_made(t, again, made, changes);
    SubOutcome::Ready {
        kind: ObjectKind::SqsQueue,
        object: here,
    }
}

/// The dead-letter queue found or made (`made` says so), and its ARN for the queue's redrive
/// policy.
async fn dead_letter_queue(
    client: &Client,
    ctx: &Ctx,
    t: &Target<'_>,
    r: &mapping::Redrive,
    made: &mut Vec<String>,
    changes: &mut Changes,
) -> Result<Option<String>, SubOutcome> {
    let Found { url, new, .. } = find_or_create(
        client,
        ctx,
        t,
        &r.dead_letter_queue,
        mapping::dead_letter_attributes(),
        true,
        changes,
    )
    .await?;
    if new {
        made.push(format!("dead-letter queue {}", r.dead_letter_queue));
    }
    let attributes = read_attributes(client, ctx, t, &url, &r.dead_letter_queue).await?;
    Ok(attributes.get("QueueArn").cloned())
}

/// A queue's attributes; one deleted meanwhile is made again on the next check.
async fn read_attributes(
    client: &Client,
    ctx: &Ctx,
    t: &Target<'_>,
    url: &str,
    name: &str,
) -> Result<std::collections::BTreeMap<String, String>, SubOutcome> {
    ctx.metrics.js("sqs.attributes");
    match admin::attributes(client, url).await {
        Ok(Some(a)) => Ok(a),
        // Deleted meanwhile: made again on the next check.
        Ok(None) => Err(failure(
            AdminError::Unreachable {
                operation: "GetQueueAttributes",
                detail: format!(
                    "queue {name} was deleted while Settle looked at it; checking again"
                ),
            },
            &t.known,
        )),
        Err(e) => Err(failure(e, &t.known)),
    }
}

/// Attribute drift of a queue that was there, repaired in place with SetQueueAttributes.
async fn repair(
    client: &Client,
    ctx: &Ctx,
    t: &Target<'_>,
    want: &mapping::QueueSpec,
    url: &str,
    attributes: std::collections::BTreeMap<String, String>,
    changes: &mut Changes,
) -> Result<(), SubOutcome> {
    let live = read_attributes(client, ctx, t, url, &want.name).await?;
    let diff = mapping::diff(want, &live);
    if diff.is_empty() {
        return Ok(());
    }
    let mut set = attributes;
    if want.redrive.is_none() {
        // An empty RedrivePolicy removes it.
        set.insert(REDRIVE_POLICY.to_string(), String::new());
    }
    ctx.metrics.js("sqs.set_attributes");
    if let Err(e) = admin::set_attributes(client, url, set).await {
        return Err(failure(e, &t.known));
    }
    let edits = diff
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    tracing::info!(subscription = %t.owner, queue = %want.name, changes = %edits, "updated the queue's attributes in place");
    changes.push(
        ChangeKind::Updated,
        format!("updated SQS queue {} in place: {edits}", want.name),
    );
    Ok(())
}

/// The account's queues beside the queue: where the runtime reports and the operator keeps its
/// ledger (`backend::sqs::report`). Made again when deleted on the server.
async fn account_queues(
    client: &Client,
    ctx: &Ctx,
    t: &Target<'_>,
    queue: &str,
    made: &mut Vec<String>,
    changes: &mut Changes,
) -> Result<(), SubOutcome> {
    for (account_queue, attributes) in [
        (report::report_queue(queue), report::report_attributes()),
        (report::ledger_queue(queue), report::ledger_attributes()),
    ] {
        if find_or_create(client, ctx, t, &account_queue, attributes, false, changes)
            .await?
            .new
        {
            made.push(format!("account queue {account_queue}"));
        }
    }
    Ok(())
}

/// What was made, said in one change: created, or made again when status showed the queue.
fn note_made(t: &Target<'_>, again: bool, made: Vec<String>, changes: &mut Changes) {
    if made.is_empty() {
        return;
    }
    let made = made.join(" and ");
    let (kind, note) = if again {
        (
            ChangeKind::Recreated,
            format!("{made} missing from SQS (deleted there): made again"),
        )
    } else {
        (ChangeKind::Created, format!("created SQS {made}"))
    };
    tracing::info!(subscription = %t.owner, %made, op = kind.op(), "SQS queue");
    changes.push(kind, note);
}
