//! Finding the Backend a Subscription names, and what a Secret a Backend names carries (its
//! opt-in label): the [`BackendLookup`] seam, the operator's reflector-backed [`StoreLookup`]
//! (Secrets by one metadata GET: their data is never read here) and the map-backed
//! [`StaticLookup`] of tests and benchmarks.
//!
//! This file must not judge what it finds (that is `review` and `policy::validate`) and must
//! not write anything: a lookup only reads.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use kube::runtime::reflector::{ObjectRef, Store};

use settle::api::Backend;
use settle::policy::{CREDENTIALS_LABEL, CREDENTIALS_LABEL_VALUE, SecretView};

/// Why a Backend could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error("the Backend cache has not synced with the API server yet")]
    NotReady,
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{0}")]
    Other(String),
}

/// Finds a Backend by namespace and name: a reflector store in the operator ([`StoreLookup`]),
/// a map in tests and benchmarks ([`StaticLookup`]).
pub trait BackendLookup: Send + Sync {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Arc<Backend>>, LookupError>>;

    /// Whether Secret `namespace/name` exists and carries the opt-in label (its data is never
    /// read). A Secret the operator may not read is [`SecretView::Unknown`].
    fn secret<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<SecretView, LookupError>>;
}

/// What a Secret's labels say.
pub fn view_of_labels(labels: Option<&std::collections::BTreeMap<String, String>>) -> SecretView {
    if labels
        .and_then(|l| l.get(CREDENTIALS_LABEL))
        .is_some_and(|v| v == CREDENTIALS_LABEL_VALUE)
    {
        SecretView::Labelled
    } else {
        SecretView::Unlabelled
    }
}

/// Backends from the operator's reflector store. A miss is confirmed with one GET, so a Backend
/// created a moment before its Subscription (`kubectl apply -f dir/`) is not reported missing
/// just because the watch has not delivered it yet.
#[derive(Clone)]
pub struct StoreLookup {
    store: Store<Backend>,
    client: kube::Client,
    ready_timeout: Duration,
}

impl StoreLookup {
    pub fn new(store: Store<Backend>, client: kube::Client) -> Self {
        StoreLookup {
            store,
            client,
            ready_timeout: Duration::from_secs(2),
        }
    }
}

impl BackendLookup for StoreLookup {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Arc<Backend>>, LookupError>> {
        Box::pin(async move {
            match tokio::time::timeout(self.ready_timeout, self.store.wait_until_ready()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    return Err(LookupError::Other(format!(
                        "the Backend cache is gone: {e}"
                    )));
                }
                Err(_) => return Err(LookupError::NotReady),
            }
            if let Some(found) = self.store.get(&ObjectRef::new(name).within(namespace)) {
                return Ok(Some(found));
            }
            let api: kube::Api<Backend> = kube::Api::namespaced(self.client.clone(), namespace);
            Ok(api.get_opt(name).await?.map(Arc::new))
        })
    }

    fn secret<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<SecretView, LookupError>> {
        Box::pin(async move {
            let api: kube::Api<k8s_openapi::api::core::v1::Secret> =
                kube::Api::namespaced(self.client.clone(), namespace);
            match api.get_metadata_opt(name).await {
                Ok(Some(m)) => Ok(view_of_labels(m.metadata.labels.as_ref())),
                Ok(None) => Ok(SecretView::Missing),
                Err(kube::Error::Api(s)) if s.code == 403 => Ok(SecretView::Unknown),
                Err(e) => Err(e.into()),
            }
        })
    }
}

/// Backends from a fixed map, keyed by (namespace, name).
#[derive(Clone, Default)]
pub struct StaticLookup {
    backends: HashMap<(String, String), Arc<Backend>>,
    secrets: HashMap<(String, String), SecretView>,
}

impl StaticLookup {
    pub fn new() -> Self {
        StaticLookup::default()
    }

    /// Adds a Backend under its `metadata.namespace` (empty if unset) and `metadata.name`.
    pub fn with(mut self, backend: Backend) -> Self {
        let key = (
            backend.metadata.namespace.clone().unwrap_or_default(),
            backend.metadata.name.clone().unwrap_or_default(),
        );
        self.backends.insert(key, Arc::new(backend));
        self
    }

    /// Adds Secret `namespace/name`, labelled or not (any other is [`SecretView::Missing`]).
    pub fn with_secret(mut self, namespace: &str, name: &str, labelled: bool) -> Self {
        let view = if labelled {
            SecretView::Labelled
        } else {
            SecretView::Unlabelled
        };
        self.secrets
            .insert((namespace.to_string(), name.to_string()), view);
        self
    }
}

impl BackendLookup for StaticLookup {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Arc<Backend>>, LookupError>> {
        let found = self
            .backends
            .get(&(namespace.to_string(), name.to_string()))
            .cloned();
        Box::pin(async move { Ok(found) })
    }

    fn secret<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<SecretView, LookupError>> {
        let view = self
            .secrets
            .get(&(namespace.to_string(), name.to_string()))
            .copied()
            .unwrap_or(SecretView::Missing);
        Box::pin(async move { Ok(view) })
    }
}
