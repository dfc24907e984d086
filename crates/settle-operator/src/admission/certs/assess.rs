//! Judging a stored CA and serving certificate: may it be served on ([`assess`]), and has an old
//! CA expired (so it can leave caBundle).
//!
//! Pure: this file must not issue, store or serve a certificate, nor talk to the Kubernetes API.

use std::net::IpAddr;
use std::time::SystemTime;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use super::issue::{CertBundle, Sans};
use super::resolver::certified_key;

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
pub(super) fn ca_expired(pem: &str, now: SystemTime) -> bool {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let Ok(der) = CertificateDer::from_pem_slice(pem.as_bytes()) else {
        return true;
    };
    let Ok((_, cert)) = X509Certificate::from_der(&der) else {
        return true;
    };
    cert.validity().not_after.to_datetime() <= time::OffsetDateTime::from(now)
}
