//! What the account kept on a NATS server for Subscriptions and Backends that are gone, removed:
//! the ledger and report keys of a namespace's gone Subscriptions, a deleted Backend's reader of
//! the capture, and the readers of a namespace's Backends deleted while no operator ran. Each
//! judges only its own namespace: another namespace's keys and readers are its keepers'.
//!
//! It must not count, nor touch anything of a Subscription or Backend in the cache.

use std::collections::HashSet;

use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use kube::ResourceExt;
use kube::runtime::reflector::Store;

use super::reader_name;
use settle::api::Subscription;
use settle::backend::nats::capture;
use settle::bus::report::report_key;

/// Removes from `bucket` the keys under `namespace` that `ours` says are of a Subscription and
/// whose Subscription no longer exists (keys are `<namespace>.<subscription>.<...>`, each part
/// reduced to the key alphabet).
pub(super) async fn sweep_keys(
    bucket: &kv::Store,
    subs: &Store<Subscription>,
    namespace: &str,
    ours: impl Fn(&str) -> bool,
) {
    let Ok(keys) = bucket.keys().await else {
        return;
    };
    let keys: Vec<String> = keys.filter_map(|k| async move { k.ok() }).collect().await;
    let subscription_part = |key: &str| -> Option<String> {
        let mut parts = key.splitn(3, '.');
        let (ns, sub) = (parts.next()?, parts.next()?);
        Some(format!("{ns}.{sub}"))
    };
    // A set: with thousands of Subscriptions, a list searched once per key was quadratic.
    let alive: HashSet<String> = subs
        .state()
        .iter()
        .filter(|s| s.namespace().as_deref() == Some(namespace))
        .filter_map(|s| subscription_part(&report_key(namespace, &s.name_any(), "_")))
        .collect();
    let prefix = match report_key(namespace, "_", "_").split_once('.') {
        Some((ns, _)) => format!("{ns}."),
        None => return,
    };
    for key in keys {
        if key.starts_with(&prefix)
            && ours(&key)
            && subscription_part(&key).is_some_and(|s| !alive.contains(&s))
        {
            match bucket.purge(&key).await {
                Ok(()) => {
                    tracing::info!(key = %key, "removed the account's key of a Subscription that is gone")
                }
                Err(e) => tracing::debug!(key = %key, error = %e, "cannot remove a leftover key"),
            }
        }
    }
}

/// What the account kept on the broker for deleted Backend `namespace/backend`'s
/// Subscriptions that are gone (a namespace deleted at once takes the keeper before its round
/// drops them), removed through `client`: their ledgers and reports, and the Backend's reader
/// of the capture.
pub async fn drop_backend(
    client: async_nats::Client,
    subs: Store<Subscription>,
    namespace: &str,
    backend: &str,
) {
    let js = jetstream::new(client);
    if let Ok(ledgers) = js.get_key_value(capture::ACCOUNT_BUCKET).await {
        sweep_keys(&ledgers, &subs, namespace, |k| k.ends_with(".ledger")).await;
    }
    if let Ok(reports) = js.get_key_value(settle::bus::report::REPORT_BUCKET).await {
        sweep_keys(&reports, &subs, namespace, |_| true).await;
    }
    let name = reader_name(namespace, backend);
    match capture::drop_reader(&js, &name).await {
        Ok(()) => {
            tracing::debug!(backend = %format!("{namespace}/{backend}"), reader = %name, "the Backend is gone: its reader of the capture is deleted")
        }
        Err(e) => {
            tracing::warn!(backend = %format!("{namespace}/{backend}"), reader = %name, error = %e, "the Backend is gone, but its reader of the capture could not be deleted")
        }
    }
}

/// Deletes the capture's readers of namespace `namespace`'s Backends that are gone (deleted
/// while no operator ran), keeping those named in `alive` (the readers of its Backends in the
/// cache). Readers of other namespaces are their keepers' to judge.
pub async fn drop_gone_readers(
    client: async_nats::Client,
    namespace: String,
    alive: HashSet<String>,
) {
    let js = jetstream::new(client);
    let Ok(stream) = js.get_stream(capture::CAPTURE_STREAM).await else {
        return;
    };
    // `settle-account_<namespace>_`: the first `_` ends a namespace, so no other's shares it.
    let prefix = reader_name(&namespace, "");
    let names: Vec<String> = stream
        .consumer_names()
        .filter_map(|n| async move { n.ok() })
        .collect()
        .await;
    for name in names {
        if name.starts_with(&prefix) && !alive.contains(&name) {
            match capture::drop_reader(&js, &name).await {
                Ok(()) => {
                    tracing::info!(reader = %name, "deleted the capture reader of a Backend deleted while no operator ran")
                }
                Err(e) => {
                    tracing::debug!(reader = %name, error = %e, "cannot delete a leftover capture reader")
                }
            }
        }
    }
}
