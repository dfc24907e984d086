//! The self-managed certificate's store: the Secret (`ca.crt`, `tls.crt`, `tls.key`) that
//! [`ensure_secret`] creates, reuses while it may be served on, and rotates otherwise.
//!
//! This file must not touch any Secret it did not create: a Secret without Settle's `managed-by`
//! label is refused ([`CertError::ForeignSecret`]), never overwritten.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};

use super::assess::{Assessment, assess, ca_expired};
use super::issue::{CertBundle, Sans, issue_for};
use super::{CertError, MANAGED_BY_LABEL, MANAGED_BY_VALUE};

/// Where the operator keeps its own CA and serving certificate, and whom it tells.
#[derive(Clone, Debug)]
pub struct SelfManagedConfig {
    /// The Secret's namespace (usually the operator's own).
    pub namespace: String,
    /// The Secret's name, e.g. `settle-webhook-tls`.
    pub secret_name: String,
    /// The ValidatingWebhookConfiguration whose `webhooks[*].clientConfig.caBundle` is patched,
    /// e.g. `settle`; `None` patches nothing.
    pub webhook_configuration: Option<String>,
    /// The names the serving certificate is valid for.
    pub sans: Sans,
    /// Lifetime of a new CA and certificate (default 365 days).
    pub validity: Duration,
    /// How often the background task re-checks the Secret (default 1 h; capped at a tenth of
    /// `validity` so a rotation is never missed).
    pub check_interval: Duration,
    /// Set as the Secret's owner whenever it is written (the operator's ServiceAccount, so the
    /// Secret goes with the install); `None`: no owner.
    /// (Boxed: the other certificate source is small.)
    pub owner: Option<Box<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>>,
}

impl SelfManagedConfig {
    pub fn new(namespace: impl Into<String>, secret_name: impl Into<String>, sans: Sans) -> Self {
        SelfManagedConfig {
            namespace: namespace.into(),
            secret_name: secret_name.into(),
            webhook_configuration: None,
            sans,
            validity: Duration::from_secs(365 * 24 * 3600),
            check_interval: Duration::from_secs(3600),
            owner: None,
        }
    }

    pub(super) fn interval(&self) -> Duration {
        self.check_interval
            .min(self.validity / 10)
            .max(Duration::from_secs(1))
    }
}

/// What [`ensure_secret`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SecretOutcome {
    Created,
    Reused,
    Rotated,
}

/// Makes sure the Secret holds a bundle that may be served on (creating or rotating it), and
/// returns it with the CA it replaced, if any (to keep in caBundle until it expires).
pub async fn ensure_secret(
    client: &Client,
    config: &SelfManagedConfig,
) -> Result<(CertBundle, SecretOutcome, Option<String>), CertError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), &config.namespace);
    let (ns, name) = (&config.namespace, &config.secret_name);
    for _ in 0..5 {
        match api.get_opt(name).await? {
            None => {
                let bundle = issue_for(&config.sans, config.validity)?;
                match api
                    .create(
                        &PostParams::default(),
                        &secret_object(config, &bundle, None),
                    )
                    .await
                {
                    Ok(_) => {
                        tracing::info!(secret = %format!("{ns}/{name}"), "created the webhook CA and serving certificate");
                        return Ok((bundle, SecretOutcome::Created, None));
                    }
                    Err(kube::Error::Api(s)) if s.is_already_exists() => continue,
                    Err(e) => return Err(e.into()),
                }
            }
            Some(secret) => {
                if secret
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(MANAGED_BY_LABEL))
                    .map(String::as_str)
                    != Some(MANAGED_BY_VALUE)
                {
                    return Err(CertError::ForeignSecret {
                        namespace: ns.clone(),
                        name: name.clone(),
                    });
                }
                let stored = bundle_of(&secret);
                let reason = match &stored {
                    Some(b) => match assess(b, &config.sans, SystemTime::now()) {
                        Assessment::Reuse => return Ok((b.clone(), SecretOutcome::Reused, None)),
                        Assessment::Rotate(reason) => reason,
                    },
                    None => "the Secret lacks ca.crt, tls.crt or tls.key".to_string(),
                };
                let bundle = issue_for(&config.sans, config.validity)?;
                let previous_ca = stored
                    .map(|b| b.ca_pem)
                    .filter(|ca| !ca_expired(ca, SystemTime::now()));
                let object =
                    secret_object(config, &bundle, secret.metadata.resource_version.clone());
                match api.replace(name, &PostParams::default(), &object).await {
                    Ok(_) => {
                        tracing::info!(secret = %format!("{ns}/{name}"), %reason, "rotated the webhook CA and serving certificate");
                        return Ok((bundle, SecretOutcome::Rotated, previous_ca));
                    }
                    // Another replica wrote it first: read theirs.
                    Err(kube::Error::Api(s)) if s.code == 409 => continue,
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    Err(CertError::Contended {
        namespace: ns.clone(),
        name: name.clone(),
    })
}

fn secret_object(
    config: &SelfManagedConfig,
    bundle: &CertBundle,
    resource_version: Option<String>,
) -> Secret {
    let data = BTreeMap::from([
        (
            "ca.crt".to_string(),
            ByteString(bundle.ca_pem.clone().into_bytes()),
        ),
        (
            "tls.crt".to_string(),
            ByteString(bundle.cert_pem.clone().into_bytes()),
        ),
        (
            "tls.key".to_string(),
            ByteString(bundle.key_pem.clone().into_bytes()),
        ),
    ]);
    Secret {
        metadata: ObjectMeta {
            name: Some(config.secret_name.clone()),
            namespace: Some(config.namespace.clone()),
            labels: Some(BTreeMap::from([(
                MANAGED_BY_LABEL.to_string(),
                MANAGED_BY_VALUE.to_string(),
            )])),
            resource_version,
            owner_references: config.owner.as_deref().cloned().map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".to_string()),
        data: Some(data),
        ..Secret::default()
    }
}

fn bundle_of(secret: &Secret) -> Option<CertBundle> {
    let data = secret.data.as_ref()?;
    let text = |key: &str| {
        data.get(key)
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
    };
    Some(CertBundle {
        ca_pem: text("ca.crt")?,
        cert_pem: text("tls.crt")?,
        key_pem: text("tls.key")?,
    })
}
