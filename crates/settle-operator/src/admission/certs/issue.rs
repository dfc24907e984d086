//! Issuing a CA and the serving certificate it signs, with `rcgen`: [`issue`] and [`issue_for`].
//!
//! Pure: this file must not store, serve or judge a certificate (`secret`, `resolver` and
//! `assess` do), nor talk to the Kubernetes API.

use std::fmt;
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use super::CertError;

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
