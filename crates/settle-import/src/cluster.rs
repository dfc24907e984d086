//! `--from-cluster`: NACK's Consumers, Streams and Accounts read from an API server (one
//! namespace, or all), into the same [`Input`] files make. Reads only.

use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::{Api, Client};

use super::nack::{ACCOUNTS, CONSUMERS, GROUP, Input, STREAMS};

/// NACK's version that serves these kinds (v0.16).
const VERSION: &str = "v1beta2";

/// Why the cluster could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(
        "NACK's CRDs ({CONSUMERS}.{GROUP}) are not installed in this cluster: nothing to import (check the kubeconfig's context)"
    )]
    NoCrds,
    #[error("cannot list {what}: {source} (is the API server reachable, and may you list them?)")]
    List {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("{0}")]
    Parse(String),
}

/// NACK's resources in `namespace` (all namespaces when `None`).
pub async fn read(client: &Client, namespace: Option<&str>) -> Result<Input, ClusterError> {
    let mut input = Input::default();
    for (kind, plural, required) in [
        ("Consumer", CONSUMERS, true),
        ("Stream", STREAMS, false),
        ("Account", ACCOUNTS, false),
    ] {
        let resource =
            ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, kind), plural);
        let api: Api<DynamicObject> = match namespace {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
            None => Api::all_with(client.clone(), &resource),
        };
        let list = match api.list(&ListParams::default()).await {
            Ok(l) => l,
            Err(kube::Error::Api(e)) if e.code == 404 && required => {
                return Err(ClusterError::NoCrds);
            }
            // Streams and Accounts are optional: NACK can be installed with Consumers only used.
            Err(kube::Error::Api(e)) if e.code == 404 => continue,
            Err(source) => {
                return Err(ClusterError::List {
                    what: format!("{plural}.{GROUP}"),
                    source,
                });
            }
        };
        for item in list.items {
            let mut doc =
                serde_json::to_value(&item).map_err(|e| ClusterError::Parse(e.to_string()))?;
            if let Some(o) = doc.as_object_mut() {
                o.insert("apiVersion".into(), format!("{GROUP}/{VERSION}").into());
                o.insert("kind".into(), kind.into());
            }
            input.add(doc).map_err(ClusterError::Parse)?;
        }
    }
    Ok(input)
}
