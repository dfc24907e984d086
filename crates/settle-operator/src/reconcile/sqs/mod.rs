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

async fn converge(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &SqsConn,
    changes: &mut Changes,
    queue_found: &mut Option<Found>,
) -> SubOutcome {
    let (owner, known) = (&t.owner, &t.known);
    let client = conn.broker.client();
    let want = match mapping::desired(conn.broker.queue_prefix(), &t.policy) {
        Ok(w) => w,
        Err(e) => return SubOutcome::Invalid(e.to_string()),
    };
    let here = ConsumerRef {
        stream: SQS_STREAM.into(),
        name: want.name.clone(),
    };
    let again = known.as_ref() == Some(&here);
    let mut made = Vec::new();

    // The dead-letter queue first: the queue's redrive policy names its ARN.
    let dlq_arn = match dead_letter_arn(t, ctx, client, &want, changes, &mut made).await {
        Ok(arn) => arn,
        Err(o) => return o,
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
    } else if let Some(failed) =
        update_in_place(t, ctx, client, &want, &url, attributes, changes).await
    {
        return failed;
    }
    if let Err(o) = account_queues(t, ctx, client, &want.name, changes, &mut made).await {
        return o;
    }
    if !made.is_empty() {
        let made = made.join(" and ");
        let (kind, note) = if again {
            (
                ChangeKind::Recreated,
                format!("{made} missing from SQS (deleted there): made again"),
            )
        } else {
            (ChangeKind::Created, format!("created SQS {made}"))
        };
        tracing::info!(subscription = %owner, %made, op = kind.op(), "SQS queue");
        changes.push(kind, note);
    }
    SubOutcome::Ready {
        kind: ObjectKind::SqsQueue,
        object: here,
    }
}

/// The account's queues beside `queue`: where the runtime reports and the operator keeps its
/// ledger (`backend::sqs::report`), found or made (said in `made`); made again when deleted on
/// the server.
async fn account_queues(
    t: &Target<'_>,
    ctx: &Ctx,
    client: &Client,
    queue: &str,
    changes: &mut Changes,
    made: &mut Vec<String>,
) -> Result<(), SubOutcome> {
    for (account_queue, attributes) in [
        (report::report_queue(queue), report::report_attributes()),
        (report::ledger_queue(queue), report::ledger_attributes()),
    ] {
        match find_or_create(client, ctx, t, &account_queue, attributes, false, changes).await {
            Ok(Found { new: true, .. }) => made.push(format!("account queue {account_queue}")),
            Ok(Found { new: false, .. }) => {}
            Err(o) => return Err(o),
        }
    }
    Ok(())
}

/// The dead-letter queue the spec asks for, found or made (said in `made`), and its ARN for the
/// queue's redrive policy; `None` when the spec asks for none.
async fn dead_letter_arn(
    t: &Target<'_>,
    ctx: &Ctx,
    client: &Client,
    want: &mapping::QueueSpec,
    changes: &mut Changes,
    made: &mut Vec<String>,
) -> Result<Option<String>, SubOutcome> {
    let Some(r) = &want.redrive else {
        return Ok(None);
    };
    let dead_letters = mapping::dead_letter_attributes();
    let Found { url, new, .. } = find_or_create(
        client,
        ctx,
        t,
        &r.dead_letter_queue,
        dead_letters,
        true,
        changes,
    )
    .await?;
    if new {
        made.push(format!("dead-letter queue {}", r.dead_letter_queue));
    }
    ctx.metrics.js("sqs.attributes");
    match admin::attributes(client, &url).await {
        Ok(Some(a)) => Ok(a.get("QueueArn").cloned()),
        Ok(None) => Err(deleted_meanwhile(&r.dead_letter_queue, &t.known)),
        Err(e) => Err(failure(e, &t.known)),
    }
}

/// A queue that was there is brought to the spec's attributes in one call where they differ
/// (`attributes`: all of them, the redrive policy's ARN resolved). `Some` says why it was not.
async fn update_in_place(
    t: &Target<'_>,
    ctx: &Ctx,
    client: &Client,
    want: &mapping::QueueSpec,
    url: &str,
    attributes: std::collections::BTreeMap<String, String>,
    changes: &mut Changes,
) -> Option<SubOutcome> {
    ctx.metrics.js("sqs.attributes");
    let live = match admin::attributes(client, url).await {
        Ok(Some(a)) => a,
        // Deleted meanwhile: made again on the next check.
        Ok(None) => return Some(deleted_meanwhile(&want.name, &t.known)),
        Err(e) => return Some(failure(e, &t.known)),
    };
    let diff = mapping::diff(want, &live);
    if diff.is_empty() {
        return None;
    }
    let mut set = attributes;
    if want.redrive.is_none() {
        // An empty RedrivePolicy removes it.
        set.insert(REDRIVE_POLICY.to_string(), String::new());
    }
    ctx.metrics.js("sqs.set_attributes");
    if let Err(e) = admin::set_attributes(client, url, set).await {
        return Some(failure(e, &t.known));
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
    None
}

/// A queue gone between finding it and reading it: checked again on the next round.
fn deleted_meanwhile(queue: &str, known: &Option<ConsumerRef>) -> SubOutcome {
    failure(
        AdminError::Unreachable {
            operation: "GetQueueAttributes",
            detail: format!("queue {queue} was deleted while Settle looked at it; checking again"),
        },
        known,
    )
}
