//! Whose an SQS queue is, by its owner tags (docs/semantics.md Q8, Q11; pure [`owned`]), and
//! whether a dead-letter queue is Settle's to delete. It must not create or delete a queue.

use super::*;

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
pub(super) async fn judged(
    client: &Client,
    ctx: &Ctx,
    t: &Target<'_>,
    url: &str,
) -> Result<(Result<Take, Holder>, Option<String>), AdminError> {
    ctx.metrics.js("sqs.tags");
    let tags = admin::owner(client, url).await?;
    Ok((owned(&tags, &t.owner, t.uid(), t.adopt()), tags.paused))
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
