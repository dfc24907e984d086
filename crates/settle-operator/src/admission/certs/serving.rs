//! Starting either source of the serving certificate ([`start`]) and the background task that
//! keeps it current: re-checking the Secret and caBundle (self-managed) or re-reading the files.
//!
//! This file must not issue, judge or store certificates itself: it calls `secret`, `ca_bundle`
//! and `files`, and swaps what they return into the `resolver`.

use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use tokio::task::JoinHandle;

use super::ca_bundle::patch_ca_bundle;
use super::files::{FileCertConfig, read_files};
use super::issue::CertBundle;
use super::resolver::CertResolver;
use super::secret::{SelfManagedConfig, ensure_secret};
use super::{CertError, RETRY};

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
