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
/// Settle did not make is taken over as `spec.adopt` says (Q11).
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
    let create = || async {
        ctx.metrics.js("sqs.create");
        match admin::create(client, name, attributes, owner, uid).await {
            Ok(url) => Ok(Found {
                url,
                new: true,
                paused: None,
            }),
            Err(e) => Err(failure(e, known)),
        }
    };
    let url = match admin::queue_url(client, name).await {
        Err(e) => return Err(failure(e, known)),
        Ok(None) => return create().await,
        Ok(Some(url)) => url,
    };
    let (take, paused) = match judged(client, ctx, t, &url).await {
        // Deleted on the server between the lookup and the tags: missing, so made again.
        Err(_) if matches!(admin::queue_url(client, name).await, Ok(None)) => {
            return create().await;
        }
        Err(e) => return Err(failure(e, known)),
        Ok((Err(Holder::Unmarked), paused)) if adoptable => {
            return adopt_unmarked(client, ctx, t, name, url, paused, changes).await;
        }
        Ok((Err(holder), _)) => return Err(conflict(name, holder)),
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

/// A queue Settle did not make: taken over when `spec.adopt: IfCompatible` asks and the
/// namespace may (its owner tags written, the same queue with what it holds), else a conflict.
async fn adopt_unmarked(
    client: &Client,
    ctx: &Ctx,
    t: &Target<'_>,
    name: &str,
    url: String,
    paused: Option<String>,
    changes: &mut Changes,
) -> Result<Found, SubOutcome> {
    let holder = match t.adoption(&ctx.adopt_namespaces) {
        Adoption::IfCompatible => {
            ctx.metrics.js("sqs.tag");
            if let Err(e) = admin::tag_owner(client, &url, &t.owner, t.uid()).await {
                return Err(failure(e, &t.known));
            }
            let note = format!(
                "took over SQS queue {name}, which Settle did not make, as spec.adopt IfCompatible asked: the same queue, with the messages it holds"
            );
            tracing::info!(subscription = %t.owner, queue = %name, op = ChangeKind::Adopted.op(), "{note}");
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

/// Queue `name` is not this object's: `owner` holds it.
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
