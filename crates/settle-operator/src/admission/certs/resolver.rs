//! The certificate the TLS server presents, swappable at run time: [`CertResolver`] hands rustls
//! the current certificate on every handshake, and a rotation swaps it in place.
//!
//! This file must not decide where a certificate comes from (that is `serving`, `secret` and
//! `files`) nor talk to the Kubernetes API.

use std::fmt;
use std::sync::{Arc, RwLock};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use super::CertError;

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

pub(super) fn certified_key(
    cert_chain_pem: &[u8],
    key_pem: &[u8],
) -> Result<CertifiedKey, CertError> {
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
