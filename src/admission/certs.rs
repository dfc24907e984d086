//! The admission webhook's serving certificate: where it comes from, and how it is swapped in
//! without a restart.
//!
//! Two sources. By default ([`SelfManagedConfig`]) the operator makes its own CA and serving
//! certificate with `rcgen`, keeps them in a Secret (`ca.crt`, `tls.crt`, `tls.key`), reuses them
//! across restarts while more than a third of their lifetime is left, rotates them (new CA and
//! certificate) otherwise, and patches `caBundle` of Settle's own ValidatingWebhookConfiguration.
//! Alternatively ([`FileCertConfig`]) it serves a certificate mounted from disk (a cert-manager
//! Secret), reloaded when the files change; then it patches nothing.
//!
//! This module must not touch any Secret it did not create (a Secret without Settle's
//! `managed-by` label is refused, never overwritten), nor any webhook configuration but the one
//! it is named. It decides nothing about admission itself.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::task::JoinHandle;

/// Label put on the Secret Settle manages; a Secret without it is never overwritten.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
const MANAGED_BY_VALUE: &str = "settle";
/// Field manager name for the caBundle patch.
const FIELD_MANAGER: &str = "settle-webhook-certs";
/// How soon a failed check is retried.
const RETRY: Duration = Duration::from_secs(30);

/// Why a certificate could not be made, read, stored or served.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("could not generate a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("could not read the certificate or key: {0}")]
    Pem(String),
    #[error("the certificate and key do not fit together or cannot be served: {0}")]
    Tls(#[from] rustls::Error),
    #[error("could not read {path}: {source}")]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(
        "Secret {namespace}/{name} exists but is not managed by Settle (no label {MANAGED_BY_LABEL}={MANAGED_BY_VALUE}): \
         delete it, name another Secret, or serve a cert-manager certificate from files"
    )]
    ForeignSecret { namespace: String, name: String },
    #[error("gave up writing Secret {namespace}/{name}: it kept changing under us")]
    Contended { namespace: String, name: String },
}

// ---------------------------------------------------------------------------------------------
// The certificate the TLS server presents, swappable at run time.

/// The serving certificate, as the TLS server asks for it on every handshake. Swapping it
/// (`set_pem`) takes effect for the next handshake; open connections keep theirs.
pub struct CertResolver {
    current: RwLock<Arc<CertifiedKey>>,
}

impl fmt::Debug for CertResolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertResolver").finish_non_exhaustive()
    }
}

impl CertResolver {
    /// A resolver serving this PEM certificate chain (leaf first) and PEM private key.
    pub fn from_pem(cert_chain_pem: &[u8], key_pem: &[u8]) -> Result<Self, CertError> {
        Ok(CertResolver {
            current: RwLock::new(Arc::new(certified_key(cert_chain_pem, key_pem)?)),
        })
    }

    /// Serve this certificate from the next handshake on. On error the old one stays.
    pub fn set_pem(&self, cert_chain_pem: &[u8], key_pem: &[u8]) -> Result<(), CertError> {
        let key = Arc::new(certified_key(cert_chain_pem, key_pem)?);
        *self
            .current
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = key;
        Ok(())
    }

    /// The DER of the leaf certificate served now.
    pub fn leaf_der(&self) -> Option<CertificateDer<'static>> {
        self.current().cert.first().cloned()
    }

    fn current(&self) -> Arc<CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// The crypto provider the webhook's TLS uses (ring, as the kube client does).
pub fn crypto_provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certified_key(cert_chain_pem: &[u8], key_pem: &[u8]) -> Result<CertifiedKey, CertError> {
    let chain = CertificateDer::pem_slice_iter(cert_chain_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CertError::Pem(format!("certificate: {e}")))?;
    if chain.is_empty() {
        return Err(CertError::Pem("no CERTIFICATE block found".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| CertError::Pem(format!("private key: {e}")))?;
    Ok(CertifiedKey::from_der(chain, key, &crypto_provider())?)
}

// ---------------------------------------------------------------------------------------------
// Issuing and judging a CA + serving certificate.

/// The names the serving certificate is valid for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sans {
    /// DNS names, e.g. `settle-webhook.settle-system.svc`.
    pub dns_names: Vec<String>,
    /// IP addresses, e.g. `127.0.0.1` when the API server reaches the webhook by `url:`.
    pub ip_addresses: Vec<IpAddr>,
}

impl Sans {
    fn to_rcgen(&self) -> Result<Vec<SanType>, CertError> {
        let mut out = Vec::with_capacity(self.dns_names.len() + self.ip_addresses.len());
        for name in &self.dns_names {
            out.push(SanType::DnsName(name.clone().try_into()?));
        }
        out.extend(self.ip_addresses.iter().copied().map(SanType::IpAddress));
        Ok(out)
    }
}

/// A CA and the serving certificate it signed, as PEM; the CA's key is not kept (a rotation
/// makes a new CA).
#[derive(Clone, PartialEq, Eq)]
pub struct CertBundle {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl fmt::Debug for CertBundle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertBundle")
            .field("ca_pem", &self.ca_pem)
            .field("cert_pem", &self.cert_pem)
            .finish_non_exhaustive()
    }
}

/// Makes a new CA and a serving certificate for `sans`, both valid from `not_before` to
/// `not_after`.
pub fn issue(
    sans: &Sans,
    not_before: SystemTime,
    not_after: SystemTime,
) -> Result<CertBundle, CertError> {
    let (not_before, not_after) = (
        time::OffsetDateTime::from(not_before),
        time::OffsetDateTime::from(not_after),
    );

    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name = rcgen::DistinguishedName::new();
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "settle-webhook-ca");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca_params.not_before = not_before;
    ca_params.not_after = not_after;
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);

    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(
        DnType::CommonName,
        sans.dns_names
            .first()
            .cloned()
            .unwrap_or_else(|| "settle-webhook".to_string()),
    );
    params.subject_alt_names = sans.to_rcgen()?;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = not_before;
    params.not_after = not_after;
    let cert = params.signed_by(&key, &issuer)?;

    Ok(CertBundle {
        ca_pem: ca_cert.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Makes a new CA and serving certificate valid from a minute ago for `validity`.
pub fn issue_for(sans: &Sans, validity: Duration) -> Result<CertBundle, CertError> {
    let now = SystemTime::now();
    let not_before = now.checked_sub(Duration::from_secs(60)).unwrap_or(now);
    issue(sans, not_before, now + validity)
}

/// Whether a stored bundle may be served on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Assessment {
    Reuse,
    /// Rotate, for this reason.
    Rotate(String),
}

/// Judges a stored bundle at `now`: reuse it only if its certificate and key fit, it names every
/// SAN in `sans`, it was issued by the stored CA, and both have more than a third of their
/// lifetime left.
pub fn assess(bundle: &CertBundle, sans: &Sans, now: SystemTime) -> Assessment {
    match assess_inner(bundle, sans, now) {
        Ok(a) => a,
        Err(reason) => Assessment::Rotate(reason),
    }
}

fn assess_inner(bundle: &CertBundle, sans: &Sans, now: SystemTime) -> Result<Assessment, String> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

    certified_key(bundle.cert_pem.as_bytes(), bundle.key_pem.as_bytes())
        .map_err(|e| format!("stored tls.crt/tls.key unusable: {e}"))?;
    let leaf_der = CertificateDer::from_pem_slice(bundle.cert_pem.as_bytes())
        .map_err(|e| format!("tls.crt: {e}"))?;
    let ca_der = CertificateDer::from_pem_slice(bundle.ca_pem.as_bytes())
        .map_err(|e| format!("ca.crt: {e}"))?;
    let (_, leaf) = X509Certificate::from_der(&leaf_der).map_err(|e| format!("tls.crt: {e}"))?;
    let (_, ca) = X509Certificate::from_der(&ca_der).map_err(|e| format!("ca.crt: {e}"))?;

    if leaf.issuer() != ca.subject() || leaf.verify_signature(Some(ca.public_key())).is_err() {
        return Ok(Assessment::Rotate(
            "tls.crt was not issued by ca.crt".into(),
        ));
    }
    let now = time::OffsetDateTime::from(now);
    for (what, cert) in [("tls.crt", &leaf), ("ca.crt", &ca)] {
        let validity = cert.validity();
        let (from, until) = (
            validity.not_before.to_datetime(),
            validity.not_after.to_datetime(),
        );
        let lifetime = until - from;
        if now < from {
            return Ok(Assessment::Rotate(format!(
                "{what} is not valid before {from}"
            )));
        }
        if until - now <= lifetime / 3 {
            return Ok(Assessment::Rotate(format!(
                "{what} expires at {until}: less than a third of its lifetime is left"
            )));
        }
    }

    let mut dns = Vec::new();
    let mut ips = Vec::new();
    if let Ok(Some(ext)) = leaf.subject_alternative_name() {
        for name in &ext.value.general_names {
            match name {
                GeneralName::DNSName(d) => dns.push(d.to_string()),
                GeneralName::IPAddress(bytes) => match bytes.len() {
                    4 => ips.push(IpAddr::from(
                        <[u8; 4]>::try_from(*bytes).unwrap_or_default(),
                    )),
                    16 => ips.push(IpAddr::from(
                        <[u8; 16]>::try_from(*bytes).unwrap_or_default(),
                    )),
                    _ => {}
                },
                _ => {}
            }
        }
    }
    if let Some(missing) = sans
        .dns_names
        .iter()
        .find(|d| !dns.iter().any(|x| x.eq_ignore_ascii_case(d)))
    {
        return Ok(Assessment::Rotate(format!(
            "tls.crt does not name {missing}"
        )));
    }
    if let Some(missing) = sans.ip_addresses.iter().find(|ip| !ips.contains(ip)) {
        return Ok(Assessment::Rotate(format!(
            "tls.crt does not name {missing}"
        )));
    }
    Ok(Assessment::Reuse)
}

/// Whether `pem` (a CA certificate) has expired at `now`; unreadable counts as expired.
fn ca_expired(pem: &str, now: SystemTime) -> bool {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let Ok(der) = CertificateDer::from_pem_slice(pem.as_bytes()) else {
        return true;
    };
    let Ok((_, cert)) = X509Certificate::from_der(&der) else {
        return true;
    };
    cert.validity().not_after.to_datetime() <= time::OffsetDateTime::from(now)
}

// ---------------------------------------------------------------------------------------------
// Self-managed: Secret + caBundle.

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
        }
    }

    fn interval(&self) -> Duration {
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

// ---------------------------------------------------------------------------------------------
// Files: a mounted cert-manager certificate.

/// A serving certificate mounted from disk (e.g. cert-manager's Secret at
/// `/etc/settle/webhook/tls.crt` and `tls.key`).
#[derive(Clone, Debug)]
pub struct FileCertConfig {
    /// PEM certificate chain, leaf first.
    pub cert_path: PathBuf,
    /// PEM private key.
    pub key_path: PathBuf,
    /// How often the files are re-read (default 10 s).
    pub poll_interval: Duration,
}

impl FileCertConfig {
    pub fn new(cert_path: impl Into<PathBuf>, key_path: impl Into<PathBuf>) -> Self {
        FileCertConfig {
            cert_path: cert_path.into(),
            key_path: key_path.into(),
            poll_interval: Duration::from_secs(10),
        }
    }
}

async fn read_files(config: &FileCertConfig) -> Result<(Vec<u8>, Vec<u8>), CertError> {
    let read = |path: PathBuf| async move {
        tokio::fs::read(&path)
            .await
            .map_err(|source| CertError::File { path, source })
    };
    Ok((
        read(config.cert_path.clone()).await?,
        read(config.key_path.clone()).await?,
    ))
}

// ---------------------------------------------------------------------------------------------
// Starting either source.

/// Where the serving certificate comes from.
pub enum CertSource {
    /// The operator's own CA and certificate, kept in a Secret, caBundle patched.
    SelfManaged {
        client: Client,
        config: SelfManagedConfig,
    },
    /// A certificate mounted from files; caBundle is someone else's job (cert-manager's CA
    /// injector).
    Files(FileCertConfig),
}

/// The serving certificate, kept current by a background task.
pub struct ServingCerts {
    /// Hand this to the webhook server.
    pub resolver: Arc<CertResolver>,
    /// The task that re-checks (self-managed) or re-reads (files). It runs until aborted.
    pub task: JoinHandle<()>,
}

/// Loads or makes the first certificate (an error here means the webhook cannot start), then
/// starts the task that keeps it current.
pub async fn start(source: CertSource) -> Result<ServingCerts, CertError> {
    match source {
        CertSource::SelfManaged { client, config } => {
            let (bundle, _, previous_ca) = ensure_secret(&client, &config).await?;
            let resolver = Arc::new(CertResolver::from_pem(
                bundle.cert_pem.as_bytes(),
                bundle.key_pem.as_bytes(),
            )?);
            let mut first_wait = config.interval();
            if let Some(vwc) = &config.webhook_configuration
                && let Err(e) =
                    patch_ca_bundle(&client, vwc, &bundle.ca_pem, previous_ca.as_deref()).await
            {
                // Serve anyway (the API server cannot call us until it trusts us, so nothing is
                // admitted wrongly); the task retries soon.
                tracing::warn!(configuration = %vwc, error = %e, "could not patch the webhook caBundle; retrying");
                first_wait = RETRY.min(first_wait);
            }
            let task = tokio::spawn(keep_self_managed(
                client,
                config,
                resolver.clone(),
                bundle,
                first_wait,
            ));
            Ok(ServingCerts { resolver, task })
        }
        CertSource::Files(config) => {
            let (cert, key) = read_files(&config).await?;
            let resolver = Arc::new(CertResolver::from_pem(&cert, &key)?);
            let task = tokio::spawn(keep_files(config, resolver.clone(), (cert, key)));
            Ok(ServingCerts { resolver, task })
        }
    }
}

async fn keep_self_managed(
    client: Client,
    config: SelfManagedConfig,
    resolver: Arc<CertResolver>,
    mut serving: CertBundle,
    first_wait: Duration,
) {
    let interval = config.interval();
    let mut wait = first_wait;
    loop {
        tokio::time::sleep(wait).await;
        match refresh_self_managed(&client, &config, &resolver, &serving).await {
            Ok(bundle) => {
                serving = bundle;
                wait = interval;
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not check the webhook certificate; retrying");
                wait = interval.min(RETRY);
            }
        }
    }
}

/// One pass of the background task: rotate if due, serve what the Secret holds (another
/// replica may have rotated it), and make sure caBundle trusts it.
async fn refresh_self_managed(
    client: &Client,
    config: &SelfManagedConfig,
    resolver: &CertResolver,
    serving: &CertBundle,
) -> Result<CertBundle, CertError> {
    let (bundle, _, previous_ca) = ensure_secret(client, config).await?;
    // Patch caBundle before swapping: the API server must trust the new CA before it is shown it.
    if let Some(vwc) = &config.webhook_configuration {
        let previous = previous_ca
            .or_else(|| (serving.ca_pem != bundle.ca_pem).then(|| serving.ca_pem.clone()));
        patch_ca_bundle(client, vwc, &bundle.ca_pem, previous.as_deref()).await?;
    }
    if bundle.cert_pem != serving.cert_pem {
        resolver.set_pem(bundle.cert_pem.as_bytes(), bundle.key_pem.as_bytes())?;
        tracing::info!("serving the new webhook certificate");
    }
    Ok(bundle)
}

async fn keep_files(
    config: FileCertConfig,
    resolver: Arc<CertResolver>,
    mut loaded: (Vec<u8>, Vec<u8>),
) {
    loop {
        tokio::time::sleep(config.poll_interval).await;
        let files = match read_files(&config).await {
            Ok(files) => files,
            Err(e) => {
                tracing::warn!(error = %e, "could not re-read the webhook certificate files; serving the old certificate");
                continue;
            }
        };
        if files == loaded {
            continue;
        }
        // The two files are replaced together by the kubelet, but not necessarily read together:
        // a mismatch is retried on the next poll.
        match resolver.set_pem(&files.0, &files.1) {
            Ok(()) => {
                tracing::info!(cert = %config.cert_path.display(), "reloaded the webhook certificate from files");
                loaded = files;
            }
            Err(e) => {
                tracing::warn!(error = %e, "the changed webhook certificate files are not usable (yet); serving the old certificate")
            }
        }
    }
}
