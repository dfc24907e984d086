//! The Subscriptions of one NATS Backend as its keeper sees them in a round: each with its
//! object's UID, the consumer the controller verified as its own and what of its policy the
//! account needs, found by name or by that consumer.
//!
//! They are built from the operator's cache again only when the cache holds other objects for
//! this Backend than at the last build (the cache replaces an object's `Arc` on every change,
//! so the same pointers mean the same objects): at rest a round copies nothing. An advisory's
//! owner is found through an index by consumer, not by a search of every Subscription.
//!
//! It must not decide what counts (that is `count` and the ledger).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kube::ResourceExt;
use kube::runtime::reflector::Store;

use super::SubKey;
use settle::api::Subscription;
use settle::backend::nats::mapping::consumer_name;
use settle::policy::ResolvedPolicy;

/// A Subscription of this Backend, and the consumer the controller verified as its own.
pub(super) struct Member {
    pub sub: Arc<Subscription>,
    pub max_deliver: Option<u32>,
    pub mode: settle::api::Mode,
}

impl Member {
    /// The object's UID.
    pub fn uid(&self) -> Option<&str> {
        self.sub.metadata.uid.as_deref()
    }

    /// Whether the controller has not yet said how this generation of the object stands (no
    /// status of its own, or one of an earlier generation): a consumer it made may not be in
    /// `status.consumer` yet. One it checked and found in conflict, refused or failing is not.
    pub fn unchecked(&self) -> bool {
        let observed = self.sub.status.as_ref().and_then(|s| s.observed_generation);
        observed.is_none() || observed != self.sub.metadata.generation
    }

    /// `(stream, consumer)` from `status.consumer`: only through it does the broker count.
    pub fn consumer(&self) -> Option<(&str, &str)> {
        let c = self.sub.status.as_ref()?.consumer.as_ref()?;
        Some((c.stream.as_str(), c.name.as_str()))
    }
}

/// Every Subscription of one Backend, by name and by consumer.
///
/// The two indexes hold a hash and a place, not copies of names: what a member's object holds
/// is read from the object (each copy had been two or three strings a Subscription, issue:
/// scale). Two names with one hash (one chance in 2^64) are told apart by a search.
#[derive(Default)]
pub(super) struct Members {
    members: Vec<(SubKey, Member)>,
    /// The hash of a member's key → its place in `members`.
    by_key: HashMap<u64, usize>,
    /// The hash of `(stream, consumer)` → the place of the member that verified it as its own.
    by_consumer: HashMap<u64, usize>,
    /// The hashes of the consumer names members the controller has not checked yet (and
    /// without a verified consumer) would make.
    awaiting: HashSet<u64>,
    /// The addresses of the cache's objects these were built from, in the cache's order: the
    /// same list again means nothing of this Backend changed. The `Arc`s in `members` keep each
    /// object alive, so no other object can take its address while it is listed.
    built_from: Vec<usize>,
}

fn hash(a: &str, b: &str) -> u64 {
    settle::backend::fingerprint(&(a, b))
}

impl Members {
    /// The Subscriptions of `backend` in `subs` now. Returns whether they changed (when not,
    /// nothing was copied).
    pub fn refresh(&mut self, subs: &Store<Subscription>, backend: &SubKey) -> bool {
        let ours: Vec<Arc<Subscription>> = subs
            .state()
            .into_iter()
            .filter(|sub| {
                sub.metadata.namespace.as_deref() == Some(backend.0.as_str())
                    && sub.spec.backend_ref.name == backend.1
            })
            .collect();
        if ours.len() == self.built_from.len()
            && ours
                .iter()
                .zip(&self.built_from)
                .all(|(sub, was)| Arc::as_ptr(sub).addr() == *was)
        {
            return false;
        }
        self.built_from = ours.iter().map(|sub| Arc::as_ptr(sub).addr()).collect();
        self.members = Vec::with_capacity(ours.len());
        self.by_key = HashMap::with_capacity(ours.len());
        self.by_consumer = HashMap::new();
        self.awaiting = HashSet::new();
        for sub in ours {
            let key = (sub.namespace().unwrap_or_default(), sub.name_any());
            let policy = ResolvedPolicy::resolve(&sub.spec.policy);
            let member = Member {
                max_deliver: policy.max_deliver,
                mode: policy.mode,
                sub,
            };
            let at = self.members.len();
            self.by_key.insert(hash(&key.0, &key.1), at);
            match member.consumer() {
                Some((stream, consumer)) => {
                    self.by_consumer.insert(hash(stream, consumer), at);
                }
                None if member.unchecked() => {
                    self.awaiting
                        .insert(hash(&consumer_name(&key.0, &key.1, &policy), ""));
                }
                None => {}
            }
            self.members.push((key, member));
        }
        true
    }

    /// The member at the place `index` names for `h`, if `is` says it is the one; else the one
    /// a search finds (two names with one hash).
    fn find(
        &self,
        index: &HashMap<u64, usize>,
        h: u64,
        is: impl Fn(&(SubKey, Member)) -> bool,
    ) -> Option<&(SubKey, Member)> {
        let at = *index.get(&h)?;
        match self.members.get(at) {
            Some(m) if is(m) => Some(m),
            _ => self.members.iter().find(|m| is(m)),
        }
    }

    pub fn get(&self, key: &SubKey) -> Option<&Member> {
        self.find(&self.by_key, hash(&key.0, &key.1), |(k, _)| k == key)
            .map(|(_, m)| m)
    }

    pub fn contains_key(&self, key: &SubKey) -> bool {
        self.get(key).is_some()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&SubKey, &Member)> {
        self.members.iter().map(|(k, m)| (k, m))
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether a member the controller has not checked yet ([`Member::unchecked`]; its status
    /// names no consumer) would make one named `consumer`: the controller may have made it and
    /// its status saying so not reached the cache, so an advisory of it may be this member's
    /// once it does. A stream is not known before then.
    pub fn awaits(&self, consumer: &str) -> bool {
        self.awaiting.contains(&hash(consumer, ""))
    }

    /// The Subscription that verified `stream`'s `consumer` as its own, if one did.
    pub fn owner(&self, stream: &str, consumer: &str) -> Option<(&SubKey, &Member)> {
        self.find(&self.by_consumer, hash(stream, consumer), |(_, m)| {
            m.consumer() == Some((stream, consumer))
        })
        .map(|(k, m)| (k, m))
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::reflector;
    use kube::runtime::watcher::Event;

    use super::*;

    fn sub(ns: &str, name: &str, backend: &str, consumer: Option<&str>, rv: &str) -> Subscription {
        let mut value = serde_json::json!({
            "apiVersion": "messaging.settle.dev/v1alpha1",
            "kind": "Subscription",
            "metadata": {"name": name, "namespace": ns, "uid": format!("uid-{name}"), "resourceVersion": rv},
            "spec": {"backendRef": {"name": backend}, "pattern": "orders.>", "maxDeliver": 3}
        });
        if let Some(consumer) = consumer {
            value["status"] =
                serde_json::json!({"consumer": {"stream": "ORDERS", "name": consumer}});
        }
        serde_json::from_value(value).expect("a Subscription")
    }

    #[test]
    fn built_again_only_when_this_backends_objects_changed_and_found_by_consumer() {
        let (store, mut writer) = reflector::store::<Subscription>();
        let backend = ("shop".to_string(), "nats".to_string());
        writer.apply_watcher_event(&Event::Apply(sub("shop", "a", "nats", Some("a-c"), "1")));
        writer.apply_watcher_event(&Event::Apply(sub("shop", "b", "nats", None, "1")));
        writer.apply_watcher_event(&Event::Apply(sub("shop", "x", "other", Some("x-c"), "1")));
        writer.apply_watcher_event(&Event::Apply(sub("farm", "a", "nats", Some("f-c"), "1")));

        let mut members = Members::default();
        assert!(members.refresh(&store, &backend), "the first build");
        assert_eq!(members.len(), 2, "only this Backend's, in its namespace");
        let a = ("shop".to_string(), "a".to_string());
        let m = members.get(&a).expect("shop/a");
        assert_eq!(m.uid(), Some("uid-a"));
        assert_eq!(m.max_deliver, Some(3));
        assert_eq!(members.owner("ORDERS", "a-c").map(|(k, _)| k), Some(&a));
        assert!(
            members.owner("ORDERS", "x-c").is_none(),
            "another Backend's consumer"
        );
        assert!(
            members.owner("ORDERS", "f-c").is_none(),
            "another namespace's consumer"
        );
        assert!(
            members.awaits("settle_shop_b"),
            "b's status names no consumer yet: one of the name it would make may be its"
        );
        assert!(!members.awaits("a-c"), "a's consumer is verified");
        let mut checked = sub("shop", "c", "nats", None, "1");
        checked.status = Some(settle::api::SubscriptionStatus {
            observed_generation: Some(1),
            ..Default::default()
        });
        checked.metadata.generation = Some(1);
        writer.apply_watcher_event(&Event::Apply(checked));
        assert!(members.refresh(&store, &backend));
        assert!(
            !members.awaits("settle_shop_c"),
            "c was checked (in conflict, say) with no consumer: its name's losses are not held"
        );
        writer.apply_watcher_event(&Event::Delete(sub("shop", "c", "nats", None, "1")));
        assert!(members.refresh(&store, &backend));
        assert!(!members.awaits("settle_farm_a"), "another namespace's");

        assert!(
            !members.refresh(&store, &backend),
            "nothing changed: not built again"
        );
        writer.apply_watcher_event(&Event::Apply(sub("shop", "x", "other", None, "2")));
        assert!(
            !members.refresh(&store, &backend),
            "another Backend's object changed: not built again"
        );

        // This Backend's object changed (its consumer verified): built again, found by it.
        writer.apply_watcher_event(&Event::Apply(sub("shop", "b", "nats", Some("b-c"), "2")));
        assert!(members.refresh(&store, &backend));
        let b = ("shop".to_string(), "b".to_string());
        assert_eq!(members.owner("ORDERS", "b-c").map(|(k, _)| k), Some(&b));
        assert!(!members.awaits("settle_shop_b"), "b's consumer is verified");

        // One deleted: gone, and its consumer no longer found.
        writer.apply_watcher_event(&Event::Delete(sub("shop", "a", "nats", Some("a-c"), "2")));
        assert!(members.refresh(&store, &backend));
        assert!(!members.contains_key(&a));
        assert!(members.owner("ORDERS", "a-c").is_none());
        assert_eq!(members.iter().count(), 1);
    }

    #[test]
    fn two_names_with_one_hash_are_told_apart_by_a_search() {
        let (store, mut writer) = reflector::store::<Subscription>();
        let backend = ("shop".to_string(), "nats".to_string());
        writer.apply_watcher_event(&Event::Apply(sub("shop", "a", "nats", Some("a-c"), "1")));
        writer.apply_watcher_event(&Event::Apply(sub("shop", "b", "nats", Some("b-c"), "1")));
        let mut members = Members::default();
        members.refresh(&store, &backend);
        let (a, b) = (
            ("shop".to_string(), "a".to_string()),
            ("shop".to_string(), "b".to_string()),
        );
        // As if b's names had a's hash: each index sends both to the same place.
        let place_of = |members: &Members, key: &SubKey| {
            members
                .members
                .iter()
                .position(|(k, _)| k == key)
                .expect("a member")
        };
        let at_a = place_of(&members, &a);
        members.by_key.insert(hash(&b.0, &b.1), at_a);
        members.by_consumer.insert(hash("ORDERS", "b-c"), at_a);
        assert_eq!(members.get(&b).and_then(Member::uid), Some("uid-b"));
        assert_eq!(members.owner("ORDERS", "b-c").map(|(k, _)| k), Some(&b));
        assert_eq!(members.owner("ORDERS", "a-c").map(|(k, _)| k), Some(&a));
        assert!(members.owner("ORDERS", "c-c").is_none());
        assert!(!members.contains_key(&("shop".to_string(), "c".to_string())));
    }
}
