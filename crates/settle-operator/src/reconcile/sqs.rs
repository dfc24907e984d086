//! The Subscription controller's broker step on SQS: the queue and, under AtLeastOnce with
//! maxDeliver, its dead-letter queue, from the one mapping (`backend::sqs::queue::desired`):
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
use settle::backend::sqs::queue::{self, DLQ_SUFFIX, REDRIVE_POLICY};
use settle::backend::sqs::{pause, report};

fn failure(e: AdminError, known: &Option<ConsumerRef>) -> SubOutcome {
    let error = BrokerError::of(e);
    let consumer = error.is_unreachable().then(|| known.clone()).flatten();
    SubOutcome::Broker { error, consumer }
}

/// How a queue is this Subscription object's (see [`owned`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Take {
    /// Tagged with this object's UID.
    Ours,
    /// Tagged for this Subscription by a Settle from before UIDs: this Subscription's, as it was
    /// then, and tagged with this object's UID now.
    Untagged,
    /// Left by the earlier object of this name with this UID, taken over by the adopt
    /// annotation: tagged with this object's UID now.
    Adopted(String),
}

/// Whether a queue with owner tags `tags` is Subscription `owner` (object `uid`)'s, with the
/// adopt annotation `adopt`; else whose it is (pure; docs/semantics.md Q7).
pub fn owned(
    tags: &OwnerTags,
    owner: &str,
    uid: Option<&str>,
    adopt: Option<&str>,
) -> Result<Take, Holder> {
    match &tags.subscription {
        None => return Err(Holder::Unmarked),
        Some(t) if t != owner => return Err(Holder::Other(t.clone())),
        Some(_) => {}
    }
    match (&tags.object, uid) {
        (_, None) => Ok(Take::Ours),
        (None, Some(_)) => Ok(Take::Untagged),
        (Some(o), Some(u)) if o == u => Ok(Take::Ours),
        (Some(o), _) if adopt == Some(o.as_str()) => Ok(Take::Adopted(o.clone())),
        (Some(o), _) => Err(Holder::Earlier {
            owner: owner.to_string(),
            uid: o.clone(),
        }),
    }
}

/// Whether a dead-letter queue may go with its Subscription: Settle made it for this object
/// (or it was taken over) and it holds nothing (visible, in flight or delayed).
pub fn dead_letter_deletable(
    owns: bool,
    attributes: &std::collections::BTreeMap<String, String>,
) -> bool {
    let (visible, in_flight) = admin::gauges_of(attributes);
    let delayed = attributes
        .get("ApproximateNumberOfMessagesDelayed")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    owns && visible + in_flight + delayed == 0
}

/// Whose the queue at `url` is, for this object: its tags read and judged; and the pause tag
/// it carries.
async fn judged(
    client: &Client,
    ctx: &Ctx,
    t: &Target<'_>,
    url: &str,
) -> Result<(Result<Take, Holder>, Option<String>), AdminError> {
    ctx.metrics.js("sqs.tags");
    let tags = admin::owner(client, url).await?;
    Ok((owned(&tags, &t.owner, t.uid(), t.adopt()), tags.paused))
}

/// A queue found or made: its URL, whether Settle made it now, and its pause tag.
struct Found {
    url: String,
    new: bool,
    paused: Option<String>,
}

/// A queue's URL and whether Settle made it now, or the outcome that stops the step. An
/// `adoptable` queue (the Subscription's queue and dead-letter queue, never the account's) that
/// Settle did not make is taken over as `spec.adopt` says (Q11).
async fn find_or_create(
    client: &Client,
    ctx: &Ctx,
    t: &Target<'_>,
    name: &str,
    attributes: std::collections::BTreeMap<String, String>,
    adoptable: bool,
    changes: &mut Changes,
) -> Result<Found, SubOutcome> {
    let (owner, known) = (&t.owner, &t.known);
    let uid = t.uid();
    ctx.metrics.js("sqs.url");
    let url = match admin::queue_url(client, name).await {
        Err(e) => return Err(failure(e, known)),
        Ok(None) => {
            ctx.metrics.js("sqs.create");
            return match admin::create(client, name, attributes, owner, uid).await {
                Ok(url) => Ok(Found {
                    url,
                    new: true,
                    paused: None,
                }),
                Err(e) => Err(failure(e, known)),
            };
        }
        Ok(Some(url)) => url,
    };
    let (take, paused) = match judged(client, ctx, t, &url).await {
        Err(e) => return Err(failure(e, known)),
        Ok((Err(Holder::Unmarked), paused)) if adoptable => {
            let owner = match t.adoption(&ctx.adopt_namespaces) {
                Adoption::IfCompatible => {
                    ctx.metrics.js("sqs.tag");
                    if let Err(e) = admin::tag_owner(client, &url, owner, uid).await {
                        return Err(failure(e, known));
                    }
                    let note = format!(
                        "took over SQS queue {name}, which Settle did not make, as spec.adopt IfCompatible asked: the same queue, with the messages it holds"
                    );
                    tracing::info!(subscription = %owner, queue = %name, op = ChangeKind::Adopted.op(), "{note}");
                    changes.push(ChangeKind::Adopted, note);
                    return Ok(Found {
                        url,
                        new: false,
                        paused,
                    });
                }
                Adoption::NotAllowed => {
                    Holder::Unadoptable(Unadoptable::NamespaceNotAllowed(t.namespace.clone()))
                }
                Adoption::Never => Holder::Unmarked,
            };
            return Err(SubOutcome::Conflict {
                kind: ObjectKind::SqsQueue,
                object: ConsumerRef {
                    stream: SQS_STREAM.into(),
                    name: name.to_string(),
                },
                owner,
            });
        }
        Ok((Err(holder), _)) => {
            return Err(SubOutcome::Conflict {
                kind: ObjectKind::SqsQueue,
                object: ConsumerRef {
                    stream: SQS_STREAM.into(),
                    name: name.to_string(),
                },
                owner: holder,
            });
        }
        Ok((Ok(take), paused)) => (take, paused),
    };
    if let (Take::Untagged | Take::Adopted(_), Some(uid)) = (&take, uid) {
        ctx.metrics.js("sqs.tag");
        if let Err(e) = admin::tag_object(client, &url, uid).await {
            return Err(failure(e, known));
        }
    }
    if let Take::Adopted(old) = &take {
        let note = format!(
            "took over SQS queue {name} (with what it holds), left by the earlier Subscription of this name with uid {old}, as annotation {ADOPT_ANNOTATION} asked"
        );
        tracing::info!(subscription = %owner, queue = %name, "{note}");
        changes.push(ChangeKind::Adopted, note);
    }
    Ok(Found {
        url,
        new: false,
        paused,
    })
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

/// The queue's pause tag equal to the spec's (semantics W4): read with its owner tags, so a
/// steady state costs nothing more; tagged or untagged only when it differs (a tag removed by
/// hand comes back).
async fn keep_paused(
    t: &Target<'_>,
    ctx: &Ctx,
    conn: &SqsConn,
    object: &ConsumerRef,
    found: &Found,
    changes: &mut Changes,
) -> Result<(), SubOutcome> {
    let want = pause::value(t.pause);
    if want == found.paused {
        return Ok(());
    }
    let client = conn.broker.client();
    let (result, kind, note) = match &want {
        Some(v) => {
            ctx.metrics.js("sqs.tag");
            (
                pause::set(client, &found.url, v).await,
                ChangeKind::Paused,
                format!(
                    "paused SQS queue {} {}: tagged {}={v}, every application stops receiving within its pause poll interval",
                    object.name,
                    t.pause.until_text(),
                    pause::TAG
                ),
            )
        }
        None => {
            ctx.metrics.js("sqs.untag");
            (
                pause::clear(client, &found.url).await,
                ChangeKind::Resumed,
                format!(
                    "resumed SQS queue {}: removed its tag {}",
                    object.name,
                    pause::TAG
                ),
            )
        }
    };
    if let Err(e) = result {
        return Err(failure(e, &Some(object.clone())));
    }
    tracing::info!(subscription = %t.owner, queue = %object.name, op = kind.op(), "{note}");
    changes.push(kind, note);
    Ok(())
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
    let want = match queue::desired(conn.broker.queue_prefix(), &t.policy) {
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
    let dlq_arn = match &want.redrive {
        None => None,
        Some(r) => {
            let Found { url, new, .. } = match find_or_create(
                client,
                ctx,
                t,
                &r.dead_letter_queue,
                queue::dead_letter_attributes(),
                true,
                changes,
            )
            .await
            {
                Ok(x) => x,
                Err(o) => return o,
            };
            if new {
                made.push(format!("dead-letter queue {}", r.dead_letter_queue));
            }
            ctx.metrics.js("sqs.attributes");
            match admin::attributes(client, &url).await {
                Ok(Some(a)) => a.get("QueueArn").cloned(),
                Ok(None) => {
                    return failure(
                        AdminError::Unreachable {
                            operation: "GetQueueAttributes",
                            detail: format!(
                                "queue {} was deleted while Settle looked at it; checking again",
                                r.dead_letter_queue
                            ),
                        },
                        known,
                    );
                }
                Err(e) => return failure(e, known),
            }
        }
    };
    let attributes = queue::attributes(&want, dlq_arn.as_deref());
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
    } else {
        ctx.metrics.js("sqs.attributes");
        let live = match admin::attributes(client, &url).await {
            Ok(Some(a)) => a,
            // Deleted meanwhile: made again on the next check.
            Ok(None) => {
                return failure(
                    AdminError::Unreachable {
                        operation: "GetQueueAttributes",
                        detail: format!(
                            "queue {} was deleted while Settle looked at it; checking again",
                            want.name
                        ),
                    },
                    known,
                );
            }
            Err(e) => return failure(e, known),
        };
        let diff = queue::diff(&want, &live);
        if !diff.is_empty() {
            let mut set = attributes;
            if want.redrive.is_none() {
                // An empty RedrivePolicy removes it.
                set.insert(REDRIVE_POLICY.to_string(), String::new());
            }
            ctx.metrics.js("sqs.set_attributes");
            if let Err(e) = admin::set_attributes(client, &url, set).await {
                return failure(e, known);
            }
            let edits = diff
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ");
            tracing::info!(subscription = %owner, queue = %want.name, changes = %edits, "updated the queue's attributes in place");
            changes.push(
                ChangeKind::Updated,
                format!("updated SQS queue {} in place: {edits}", want.name),
            );
        }
    }
    // The account's queues beside it: where the runtime reports and the operator keeps its
    // ledger (`backend::sqs::report`). Made again when deleted on the server.
    for (account_queue, attributes) in [
        (
            report::report_queue(&want.name),
            report::report_attributes(),
        ),
        (
            report::ledger_queue(&want.name),
            report::ledger_attributes(),
        ),
    ] {
        match find_or_create(client, ctx, t, &account_queue, attributes, false, changes).await {
            Ok(Found { new: true, .. }) => made.push(format!("account queue {account_queue}")),
            Ok(Found { new: false, .. }) => {}
            Err(o) => return o,
        }
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

fn waiting(e: AdminError) -> Removal {
    if e.is_unreachable() {
        Removal::Wait(e.to_string())
    } else {
        Removal::Failed(e.to_string())
    }
}

/// The cleanup's broker call on SQS: deletes this Subscription's queue if it is its own, and its
/// dead-letter queue if Settle made it and it is empty.
pub async fn remove(t: &Target<'_>, ctx: &Ctx, conn: &SqsConn) -> Removal {
    let owner = &t.owner;
    let client = conn.broker.client();
    let queue_name = match &t.known {
        Some(c) if c.stream == SQS_STREAM => c.name.clone(),
        _ => match queue::desired(conn.broker.queue_prefix(), &t.policy) {
            Ok(w) => w.name,
            // No valid queue name: Settle never made one.
            Err(_) => return Removal::Nothing,
        },
    };
    let mut notes = Vec::new();
    ctx.metrics.js("sqs.url");
    match admin::queue_url(client, &queue_name).await {
        Err(e) => return waiting(e),
        Ok(None) => {}
        Ok(Some(url)) => {
            let owns = match judged(client, ctx, t, &url).await {
                Ok((t, _)) => t.is_ok(),
                Err(e) => return waiting(e),
            };
            if owns {
                ctx.metrics.js("sqs.delete");
                if let Err(e) = admin::delete(client, &url).await {
                    return waiting(e);
                }
                notes.push(format!("deleted SQS queue {queue_name}"));
            } else {
                tracing::info!(subscription = %owner, queue = %queue_name, "the queue is not this Subscription object's: left alone");
                return Removal::Nothing;
            }
        }
    }
    for account_queue in [
        report::report_queue(&queue_name),
        report::ledger_queue(&queue_name),
    ] {
        ctx.metrics.js("sqs.url");
        match admin::queue_url(client, &account_queue).await {
            Err(e) => return waiting(e),
            Ok(None) => {}
            Ok(Some(url)) => match judged(client, ctx, t, &url).await {
                Err(e) => return waiting(e),
                Ok((Ok(_), _)) => {
                    ctx.metrics.js("sqs.delete");
                    if let Err(e) = admin::delete(client, &url).await {
                        return waiting(e);
                    }
                    notes.push(format!("deleted its account queue {account_queue}"));
                }
                Ok((Err(_), _)) => {
                    tracing::info!(subscription = %owner, queue = %account_queue, "the account queue is not this Subscription object's: left alone");
                }
            },
        }
    }
    let dlq = format!("{queue_name}{DLQ_SUFFIX}");
    ctx.metrics.js("sqs.url");
    match admin::queue_url(client, &dlq).await {
        Err(e) => return waiting(e),
        Ok(None) => {}
        Ok(Some(url)) => {
            let owns = match judged(client, ctx, t, &url).await {
                Ok((t, _)) => t.is_ok(),
                Err(e) => return waiting(e),
            };
            let attributes = match admin::attributes(client, &url).await {
                Ok(a) => a.unwrap_or_default(),
                Err(e) => return waiting(e),
            };
            if dead_letter_deletable(owns, &attributes) {
                ctx.metrics.js("sqs.delete");
                if let Err(e) = admin::delete(client, &url).await {
                    return waiting(e);
                }
                notes.push(format!("deleted its empty dead-letter queue {dlq}"));
            } else if owns {
                let (visible, in_flight) = admin::gauges_of(&attributes);
                notes.push(format!(
                    "kept its dead-letter queue {dlq}: it holds about {} exhausted messages (delete it when done with them)",
                    visible + in_flight
                ));
            }
        }
    }
    tracing::info!(subscription = %owner, queue = %queue_name, "cleanup: {}", notes.join("; "));
    if notes.is_empty() {
        Removal::Nothing
    } else {
        Removal::Deleted(notes.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn tags(sub: Option<&str>, object: Option<&str>) -> OwnerTags {
        OwnerTags {
            subscription: sub.map(str::to_string),
            object: object.map(str::to_string),
            ..OwnerTags::default()
        }
    }

    #[test]
    fn only_the_owners_tags_are_its_own_and_the_uid_decides() {
        let o = "shop/orders";
        let me = Some("u-1");
        assert_eq!(owned(&tags(Some(o), me), o, me, None), Ok(Take::Ours));
        assert_eq!(
            owned(&tags(Some("shop/other"), me), o, me, None),
            Err(Holder::Other("shop/other".into()))
        );
        assert_eq!(
            owned(&tags(None, me), o, me, Some("u-1")),
            Err(Holder::Unmarked)
        );
        // Made by a Settle from before UIDs: this Subscription's (and tagged now).
        assert_eq!(owned(&tags(Some(o), None), o, me, None), Ok(Take::Untagged));
        // An earlier object's: only the annotation with its UID takes it.
        let left = tags(Some(o), Some("u-0"));
        assert_eq!(
            owned(&left, o, me, None),
            Err(Holder::Earlier {
                owner: o.into(),
                uid: "u-0".into(),
            })
        );
        assert_eq!(
            owned(&left, o, me, Some("u-7")),
            Err(Holder::Earlier {
                owner: o.into(),
                uid: "u-0".into(),
            })
        );
        assert_eq!(
            owned(&left, o, me, Some("u-0")),
            Ok(Take::Adopted("u-0".into()))
        );
    }

    #[test]
    fn a_dead_letter_queue_goes_only_when_settles_and_empty() {
        let attrs = |v: &str, nv: &str, d: &str| -> BTreeMap<String, String> {
            [
                ("ApproximateNumberOfMessages", v),
                ("ApproximateNumberOfMessagesNotVisible", nv),
                ("ApproximateNumberOfMessagesDelayed", d),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
        };
        assert!(dead_letter_deletable(true, &attrs("0", "0", "0")));
        assert!(!dead_letter_deletable(true, &attrs("3", "0", "0")));
        assert!(!dead_letter_deletable(true, &attrs("0", "1", "0")));
        assert!(!dead_letter_deletable(true, &attrs("0", "0", "2")));
        assert!(!dead_letter_deletable(false, &attrs("0", "0", "0")));
    }
}
