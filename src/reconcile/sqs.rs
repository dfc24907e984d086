//! The Subscription controller's broker step on SQS: the queue and, under AtLeastOnce with
//! maxDeliver, its dead-letter queue, from the one mapping (`backend::sqs::queue::desired`):
//! made when missing (again when deleted on the server), each tagged with the Subscription it
//! belongs to; attribute drift (VisibilityTimeout, RedrivePolicy) repaired in place with
//! SetQueueAttributes; a queue tagged for another Subscription, or untagged, left alone
//! (`ConsumerConflict`). Deleting the Subscription deletes its queue, and its dead-letter queue
//! only when Settle made it and it is empty (what it holds was Exhausted: kept for a person).
//!
//! It must not write status, add finalizers or decide requeues (the pipeline in
//! [`super::subscription`] does), nor re-state an admission rule: the pipeline's one
//! `policy::validate` has refused what this broker cannot honour (`spec.stream`, A15) before
//! this step runs.

use aws_sdk_sqs::Client;
use kube::ResourceExt;
use kube::runtime::events::EventType;

use super::Ctx;
use super::conditions::events;
use super::connections::SqsConn;
use super::status::{BrokerError, SubOutcome};
use super::subscription::{Removal, SQS_STREAM, publish};
use crate::api::{ConsumerRef, Subscription};
use crate::backend::sqs::admin::{self, AdminError};
use crate::backend::sqs::queue::{self, DLQ_SUFFIX, REDRIVE_POLICY};
use crate::policy::{BackendKind, ResolvedPolicy};

fn broker_error(e: AdminError) -> BrokerError {
    match e {
        AdminError::Unreachable { .. } => BrokerError::Unreachable(e.to_string()),
        AdminError::AuthFailed { .. } => BrokerError::AuthFailed(e.to_string()),
        AdminError::Refused { .. } => BrokerError::Refused(e.to_string()),
    }
}

fn failure(e: AdminError, known: &Option<ConsumerRef>) -> SubOutcome {
    let error = broker_error(e);
    let consumer = error.is_unreachable().then(|| known.clone()).flatten();
    SubOutcome::Broker { error, consumer }
}

/// Whether a queue tagged `tag` may be used by Subscription `owner`; else the conflict.
pub fn owned(tag: Option<&str>, owner: &str) -> Result<(), Option<String>> {
    match tag {
        Some(t) if t == owner => Ok(()),
        other => Err(other.map(str::to_string)),
    }
}

/// Whether a dead-letter queue may go with its Subscription: Settle made it (tagged for this
/// Subscription) and it holds nothing (visible, in flight or delayed).
pub fn dead_letter_deletable(
    tag: Option<&str>,
    owner: &str,
    attributes: &std::collections::BTreeMap<String, String>,
) -> bool {
    let (visible, in_flight) = admin::gauges_of(attributes);
    let delayed = attributes
        .get("ApproximateNumberOfMessagesDelayed")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    owned(tag, owner).is_ok() && visible + in_flight + delayed == 0
}

/// A queue's URL and whether Settle made it now, or the outcome that stops the step.
async fn find_or_create(
    client: &Client,
    ctx: &Ctx,
    name: &str,
    attributes: std::collections::BTreeMap<String, String>,
    owner: &str,
    known: &Option<ConsumerRef>,
) -> Result<(String, bool), SubOutcome> {
    ctx.metrics.js("sqs.url");
    match admin::queue_url(client, name).await {
        Err(e) => Err(failure(e, known)),
        Ok(None) => {
            ctx.metrics.js("sqs.create");
            match admin::create(client, name, attributes, owner).await {
                Ok(url) => Ok((url, true)),
                Err(e) => Err(failure(e, known)),
            }
        }
        Ok(Some(url)) => {
            ctx.metrics.js("sqs.tags");
            match admin::owner(client, &url).await {
                Err(e) => Err(failure(e, known)),
                Ok(tag) => match owned(tag.as_deref(), owner) {
                    Ok(()) => Ok((url, false)),
                    Err(other) => Err(SubOutcome::QueueConflict {
                        kind: BackendKind::Sqs,
                        queue: name.to_string(),
                        owner: other,
                    }),
                },
            }
        }
    }
}

/// Step 5 on SQS: the queue (and its dead-letter queue) exist and match the spec, or why not.
pub async fn ensure(
    sub: &Subscription,
    ctx: &Ctx,
    conn: &SqsConn,
    known: Option<ConsumerRef>,
) -> SubOutcome {
    let ns = sub.namespace().unwrap_or_default();
    let name = sub.name_any();
    let owner = format!("{ns}/{name}");
    let client = conn.broker.client();
    let policy = ResolvedPolicy::resolve(&sub.spec.policy);
    let want = match queue::desired(conn.broker.queue_prefix(), &policy) {
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
            let (url, new) = match find_or_create(
                client,
                ctx,
                &r.dead_letter_queue,
                queue::dead_letter_attributes(),
                &owner,
                &known,
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
                        &known,
                    );
                }
                Err(e) => return failure(e, &known),
            }
        }
    };
    let attributes = queue::attributes(&want, dlq_arn.as_deref());
    let (url, new) =
        match find_or_create(client, ctx, &want.name, attributes.clone(), &owner, &known).await {
            Ok(x) => x,
            Err(o) => return o,
        };
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
                    &known,
                );
            }
            Err(e) => return failure(e, &known),
        };
        let changes = queue::diff(&want, &live);
        if !changes.is_empty() {
            let mut set = attributes;
            if want.redrive.is_none() {
                // An empty RedrivePolicy removes it.
                set.insert(REDRIVE_POLICY.to_string(), String::new());
            }
            ctx.metrics.js("sqs.set_attributes");
            if let Err(e) = admin::set_attributes(client, &url, set).await {
                return failure(e, &known);
            }
            let changes = changes
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ");
            ctx.metrics.op("update");
            tracing::info!(subscription = %owner, queue = %want.name, %changes, "updated the queue's attributes in place");
            publish(
                ctx,
                sub,
                EventType::Normal,
                events::UPDATED,
                "Reconcile",
                format!("updated SQS queue {} in place: {changes}", want.name),
            )
            .await;
        }
    }
    if !made.is_empty() {
        let made = made.join(" and ");
        let (op, reason, note) = if again {
            (
                "recreate",
                events::RECREATED,
                format!("{made} missing from SQS (deleted there): made again"),
            )
        } else {
            ("create", events::CREATED, format!("created SQS {made}"))
        };
        ctx.metrics.op(op);
        tracing::info!(subscription = %owner, %made, %op, "SQS queue");
        publish(ctx, sub, EventType::Normal, reason, "Reconcile", note).await;
    }
    SubOutcome::QueueReady {
        kind: BackendKind::Sqs,
        queue: here,
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
pub async fn remove(sub: &Subscription, ctx: &Ctx, conn: &SqsConn) -> Removal {
    let ns = sub.namespace().unwrap_or_default();
    let name = sub.name_any();
    let owner = format!("{ns}/{name}");
    let client = conn.broker.client();
    let queue_name = match sub.status.as_ref().and_then(|s| s.consumer.as_ref()) {
        Some(c) if c.stream == SQS_STREAM => c.name.clone(),
        _ => match queue::desired(
            conn.broker.queue_prefix(),
            &ResolvedPolicy::resolve(&sub.spec.policy),
        ) {
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
            ctx.metrics.js("sqs.tags");
            let tag = match admin::owner(client, &url).await {
                Ok(t) => t,
                Err(e) => return waiting(e),
            };
            if owned(tag.as_deref(), &owner).is_ok() {
                ctx.metrics.js("sqs.delete");
                if let Err(e) = admin::delete(client, &url).await {
                    return waiting(e);
                }
                notes.push(format!("deleted SQS queue {queue_name}"));
            } else {
                tracing::info!(subscription = %owner, queue = %queue_name, "the queue is not this Subscription's: left alone");
                return Removal::Nothing;
            }
        }
    }
    let dlq = format!("{queue_name}{DLQ_SUFFIX}");
    ctx.metrics.js("sqs.url");
    match admin::queue_url(client, &dlq).await {
        Err(e) => return waiting(e),
        Ok(None) => {}
        Ok(Some(url)) => {
            let tag = match admin::owner(client, &url).await {
                Ok(t) => t,
                Err(e) => return waiting(e),
            };
            let attributes = match admin::attributes(client, &url).await {
                Ok(a) => a.unwrap_or_default(),
                Err(e) => return waiting(e),
            };
            if dead_letter_deletable(tag.as_deref(), &owner, &attributes) {
                ctx.metrics.js("sqs.delete");
                if let Err(e) = admin::delete(client, &url).await {
                    return waiting(e);
                }
                notes.push(format!("deleted its empty dead-letter queue {dlq}"));
            } else if owned(tag.as_deref(), &owner).is_ok() {
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

    #[test]
    fn only_the_owners_tag_is_its_own() {
        assert_eq!(owned(Some("shop/orders"), "shop/orders"), Ok(()));
        assert_eq!(
            owned(Some("shop/other"), "shop/orders"),
            Err(Some("shop/other".into()))
        );
        assert_eq!(owned(None, "shop/orders"), Err(None));
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
        let o = "shop/orders";
        assert!(dead_letter_deletable(Some(o), o, &attrs("0", "0", "0")));
        assert!(!dead_letter_deletable(Some(o), o, &attrs("3", "0", "0")));
        assert!(!dead_letter_deletable(Some(o), o, &attrs("0", "1", "0")));
        assert!(!dead_letter_deletable(Some(o), o, &attrs("0", "0", "2")));
        assert!(!dead_letter_deletable(None, o, &attrs("0", "0", "0")));
        assert!(!dead_letter_deletable(
            Some("x/y"),
            o,
            &attrs("0", "0", "0")
        ));
    }
}
