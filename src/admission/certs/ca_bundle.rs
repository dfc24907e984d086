//! Telling the API server whom to trust: [`patch_ca_bundle`] writes the CA into `caBundle` of
//! Settle's own ValidatingWebhookConfiguration.
//!
//! This file must not touch any webhook configuration but the one it is named.

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};

use super::CertError;

/// Field manager name for the caBundle patch.
const FIELD_MANAGER: &str = "settle-webhook-certs";

/// Patches `caBundle` of every webhook in the named ValidatingWebhookConfiguration that does not
/// trust `ca_pem` yet, to `ca_pem` followed by `previous_ca_pem` (so a replica still serving the
/// old certificate keeps working until it reloads). Returns how many webhooks were patched.
pub async fn patch_ca_bundle(
    client: &Client,
    configuration: &str,
    ca_pem: &str,
    previous_ca_pem: Option<&str>,
) -> Result<usize, CertError> {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let vwc = api.get(configuration).await?;
    let mut bundle = ca_pem.trim_end().to_string();
    bundle.push('\n');
    if let Some(prev) = previous_ca_pem.filter(|p| p.trim() != ca_pem.trim()) {
        bundle.push_str(prev.trim_end());
        bundle.push('\n');
    }
    let wanted = ca_pem.trim();
    let stale: Vec<&str> = vwc
        .webhooks
        .iter()
        .flatten()
        .filter(|w| {
            let current = w
                .client_config
                .ca_bundle
                .as_ref()
                .map(|b| String::from_utf8_lossy(&b.0).into_owned())
                .unwrap_or_default();
            !current.contains(wanted)
        })
        .map(|w| w.name.as_str())
        .collect();
    if stale.is_empty() {
        return Ok(0);
    }
    let webhooks: Vec<serde_json::Value> = stale
        .iter()
        .map(|name| serde_json::json!({"name": name, "clientConfig": {"caBundle": ByteString(bundle.clone().into_bytes())}}))
        .collect();
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": vwc.metadata.resource_version},
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
