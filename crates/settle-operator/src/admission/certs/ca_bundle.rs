//! Telling the API server whom to trust: [`patch_ca_bundle`] writes the CA into `caBundle` of
//! Settle's own ValidatingWebhookConfiguration, and of its MutatingWebhookConfiguration of the
//! same name when there is one.
//!
//! This file must not touch any webhook configuration but the two it is named.

use std::fmt::Debug;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde::de::DeserializeOwned;

use super::CertError;

/// Field manager name for the caBundle patch.
const FIELD_MANAGER: &str = "settle-webhook-certs";

/// Patches `caBundle` of every webhook that does not trust `ca_pem` yet, to `ca_pem` followed by
/// `previous_ca_pem` (so a replica still serving the old certificate keeps working until it
/// reloads), in the named ValidatingWebhookConfiguration (which must exist) and the
/// MutatingWebhookConfiguration of the same name (if it exists: without it the controller puts
/// the finalizer on). Returns how many webhooks were patched.
pub async fn patch_ca_bundle(
    client: &Client,
    configuration: &str,
    ca_pem: &str,
    previous_ca_pem: Option<&str>,
) -> Result<usize, CertError> {
    let mut bundle = ca_pem.trim_end().to_string();
    bundle.push('\n');
    if let Some(prev) = previous_ca_pem.filter(|p| p.trim() != ca_pem.trim()) {
        bundle.push_str(prev.trim_end());
        bundle.push('\n');
    }
    let wanted = ca_pem.trim();

    let validating: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let vwc = validating.get(configuration).await?;
    let hooks = vwc.webhooks.iter().flatten();
    let seen = hooks.map(|w| (w.name.as_str(), w.client_config.ca_bundle.as_ref()));
    let rv = vwc.metadata.resource_version.clone();
    let mut patched = patch_stale(&validating, configuration, rv, seen, &bundle, wanted).await?;

    let mutating: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    if let Some(mwc) = mutating.get_opt(configuration).await? {
        let hooks = mwc.webhooks.iter().flatten();
        let seen = hooks.map(|w| (w.name.as_str(), w.client_config.ca_bundle.as_ref()));
        let rv = mwc.metadata.resource_version.clone();
        patched += patch_stale(&mutating, configuration, rv, seen, &bundle, wanted).await?;
    }
    Ok(patched)
}

/// Patches the webhooks of one configuration (read at `resource_version`) whose caBundle does not
/// hold `wanted` to `bundle`; returns how many.
async fn patch_stale<'a, K>(
    api: &Api<K>,
    configuration: &str,
    resource_version: Option<String>,
    webhooks: impl Iterator<Item = (&'a str, Option<&'a ByteString>)>,
    bundle: &str,
    wanted: &str,
) -> Result<usize, CertError>
where
    K: Clone + DeserializeOwned + Debug,
{
    let stale: Vec<&str> = webhooks
        .filter(|(_, current)| {
            let current = current
                .map(|b| String::from_utf8_lossy(&b.0).into_owned())
                .unwrap_or_default();
            !current.contains(wanted)
        })
        .map(|(name, _)| name)
        .collect();
    if stale.is_empty() {
        return Ok(0);
    }
    let webhooks: Vec<serde_json::Value> = stale
        .iter()
        .map(|name| serde_json::json!({"name": name, "clientConfig": {"caBundle": ByteString(bundle.as_bytes().to_vec())}}))
        .collect();
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": resource_version},
        "webhooks": webhooks,
    });
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..PatchParams::default()
    };
    api.patch(configuration, &params, &Patch::Strategic(patch))
        .await?;
    tracing::info!(configuration, webhooks = ?stale, "patched the webhook caBundle");
    Ok(stale.len())
}
