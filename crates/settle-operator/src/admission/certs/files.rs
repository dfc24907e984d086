//! A serving certificate mounted from disk (a cert-manager Secret): where the files are and how
//! they are read.
//!
//! This file must not write the files nor patch anything: caBundle is cert-manager's job then.

use std::path::PathBuf;
use std::time::Duration;

use super::CertError;

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

pub(super) async fn read_files(config: &FileCertConfig) -> Result<(Vec<u8>, Vec<u8>), CertError> {
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
