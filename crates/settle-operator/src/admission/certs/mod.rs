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
//!
//! The parts: `resolver` (what rustls serves), `issue` and `assess` (pure), `secret` and
//! `ca_bundle` (the self-managed source's Kubernetes objects), `files` (the mounted source) and
//! `serving` (starting either, and keeping it current).

mod assess;
mod ca_bundle;
mod files;
mod issue;
mod resolver;
mod secret;
mod serving;

use std::path::PathBuf;
use std::time::Duration;

pub use assess::{Assessment, assess};
pub use ca_bundle::patch_ca_bundle;
pub use files::FileCertConfig;
pub use issue::{CertBundle, Sans, issue, issue_for};
pub use resolver::{CertResolver, crypto_provider};
pub use secret::{SecretOutcome, SelfManagedConfig, ensure_secret};
pub use serving::{CertSource, ServingCerts, start};

/// Label put on the Secret Settle manages; a Secret without it is never overwritten.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
const MANAGED_BY_VALUE: &str = "settle";
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
