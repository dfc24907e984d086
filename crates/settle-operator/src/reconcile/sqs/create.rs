//! Finding a Subscription's SQS queue, or making it (its dead-letter queue and report queue
//! first). It must not decide whose an existing queue is (`claim`).

use super::*;

/// A queue found or made: its URL, whether Settle made it now, and its pause tag.
pub(super) struct Found {
    pub(super) url: String,
    pub(super) new: bool,
    pub(super) paused: Option<String>,
}

/// A queue's URL and whether Settle made it now, or the outcome that stops the step. An
/// `adoptable` queue (the Subscription's queue and dead-letter queue, never the account's) that
/// Settle did not make is taken over as `spec.adopt` says (Q11, [`adopt`]); one this object
/// takes as its own gets its UID tag ([`take`]).
pub(super) async fn find_or_create(
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
    let (how, paused) = match judged(client, ctx, t, &url).await {
        Err(e) => return Err(failure(e, known)),
        Ok((Err(Holder::Unmarked), paused)) if adoptable => {
            return adopt(client, ctx, t, name, url, paused, changes).await;
        }
        Ok((Err(holder), _)) => return Err(conflict(name, holder)),
        Ok((Ok(how), paused)) => (how, paused),
    };
    take(client, ctx, t, name, &url, &how, changes).await?;
    Ok(Found {
        url,
        new: false,
        paused,
    })
}

/// Queue `name` is not this object's: a conflict naming who holds it.
fn conflict(name: &str, owner: Holder) -> SubOutcome {
    SubOutcome::Conflict {
        kind: ObjectKind::SqsQueue,
        object: ConsumerRef {
            stream: SQS_STREAM.into(),
            name: name.to_string(),
        },
        owner,
    }
}

/// A queue Settle did not make: tagged as this object's when `spec.adopt: IfCompatible` asks
/// and the namespace may (SQS can change every attribute the mapping sets in place), else a
/// conflict saying why not.
async fn adopt(
    client: &Client,
    ctx: &Ctx,
    t: &Target<'_>,
    name: &str,
    url: String,
    paused: Option<String>,
    changes: &mut Changes,
) -> Result<Found, SubOutcome> {
    let (owner, uid) = (&t.owner, t.uid());
    let holder = match t.adoption(&ctx.adopt_namespaces) {
        Adoption::IfCompatible => {
            ctx.metrics.js("sqs.tag");
            if let Err(e) = admin::tag_owner(client, &url, owner, uid).await {
                return Err(failure(e, &t.known));
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
    Err(conflict(name, holder))
}

/// This object's queue: tagged with its UID where the tag is not there yet (from before UIDs,
/// or taken over by the adopt annotation), the takeover said.
async fn take(
    client: &Client,
    ctx: &Ctx,
    t: &Target<'_>,
    name: &str,
    url: &str,
    how: &Take,
    changes: &mut Changes,
) -> Result<(), SubOutcome> {
    if let (Take::Untagged | Take::Adopted(_), Some(uid)) = (how, t.uid()) {
        ctx.metrics.js("sqs.tag");
        if let Err(e) = admin::tag_object(client, url, uid).await {
            return Err(failure(e, &t.known));
        }
    }
    if let Take::Adopted(old) = how {
        let note = format!(
            "took over SQS queue {name} (with what it holds), left by the earlier Subscription of this name with uid {old}, as annotation {ADOPT_ANNOTATION} asked"
        );
        tracing::info!(subscription = %t.owner, queue = %name, "{note}");
        changes.push(ChangeKind::Adopted, note);
    }
    Ok(())
}
