//! Connecting to NATS: an application's [`NatsBroker`] from one URL (a user and password in it
//! given to the client) with an inbox prefix of its namespace's, and the operator's client from
//! plain data: server URLs, the credential
//! forms a Backend documents (`creds`, `nkey`, `token`, or `user` + `password`) and an optional
//! CA. The operator reads the Secrets and hands their bytes here; this module knows NATS, not
//! Kubernetes.
//!
//! It must not read Kubernetes objects nor decide what a failure means for a resource's status
//! (it only classifies it as a [`ConnectFailure`], which names its [`Failure`] class), and must not write files: the CA goes into the
//! client's TLS configuration in memory, so the operator runs on a read-only root filesystem.

use std::collections::BTreeMap;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use async_nats::rustls::pki_types::CertificateDer;
use async_nats::rustls::pki_types::pem::PemObject;
use async_nats::rustls::{self, ClientConfig, RootCertStore};
use async_nats::{ConnectErrorKind, ConnectOptions};

use super::{NatsBroker, err};
use crate::backend::{Classify, Failure};
use crate::bus::BusError;

/// Credentials, as the Secret's keys spell them. `Debug` shows the form and a user name, never
/// a secret.
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum Credentials {
    /// A `.creds` file (user JWT and nkey seed).
    Creds(String),
    /// An nkey seed.
    Nkey(String),
    Token(String),
    UserPassword {
        user: String,
        password: String,
    },
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::Creds(_) => f.write_str("Creds(<redacted>)"),
            Credentials::Nkey(_) => f.write_str("Nkey(<redacted>)"),
            Credentials::Token(_) => f.write_str("Token(<redacted>)"),
            Credentials::UserPassword { user, .. } => f
                .debug_struct("UserPassword")
                .field("user", user)
                .field("password", &"<redacted>")
                .finish(),
        }
    }
}

/// The Secret keys that hold credentials, in the order they are looked for.
pub const CREDENTIAL_KEYS: &[&str] = &["creds", "nkey", "token", "user", "password"];
/// The Secret key holding the CA certificate (PEM).
pub const CA_KEY: &str = "ca.crt";

impl Credentials {
    /// The credentials in a Secret's data, or the reason there are none usable: a message naming
    /// the keys it expects.
    pub fn from_secret_data(data: &BTreeMap<String, Vec<u8>>) -> Result<Credentials, String> {
        let text = |k: &str| -> Result<Option<String>, String> {
            match data.get(k) {
                None => Ok(None),
                Some(b) => String::from_utf8(b.clone())
                    .map(|s| Some(s.trim_end_matches(['\n', '\r']).to_string()))
                    .map_err(|_| format!("key {k:?} is not UTF-8 text")),
            }
        };
        if let Some(c) = data.get("creds") {
            return String::from_utf8(c.clone())
                .map(Credentials::Creds)
                .map_err(|_| "key \"creds\" is not UTF-8 text".to_string());
        }
        if let Some(n) = text("nkey")? {
            return Ok(Credentials::Nkey(n));
        }
        if let Some(t) = text("token")? {
            return Ok(Credentials::Token(t));
        }
        match (text("user")?, text("password")?) {
            (Some(user), Some(password)) => Ok(Credentials::UserPassword { user, password }),
            (Some(_), None) => Err("key \"user\" is set but \"password\" is missing".into()),
            (None, Some(_)) => Err("key \"password\" is set but \"user\" is missing".into()),
            (None, None) => {
                Err("it has none of the keys creds, nkey, token, or user and password".to_string())
            }
        }
    }
}

/// Everything a connection is made from. Two equal `ConnectSpec`s make the same connection, so a
/// caller keeps one connection per spec and reconnects when the spec changes (a rotated Secret).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConnectSpec {
    pub servers: Vec<String>,
    pub credentials: Option<Credentials>,
    /// The CA that signed the server's certificate (PEM); TLS is then required.
    pub ca_pem: Option<String>,
    /// The connection's name, as the server shows it (and in its advisories).
    pub name: String,
}

impl ConnectSpec {
    /// A fingerprint of the spec (credentials included), to tell a changed one apart.
    pub fn fingerprint(&self) -> u64 {
        crate::backend::fingerprint(self)
    }
}

/// Why a connection could not be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConnectFailure {
    /// No server answered (refused, timed out, unresolvable).
    #[error("no NATS server answered at {servers}: {detail}")]
    Unreachable { servers: String, detail: String },
    /// The server refused the credentials.
    #[error("the NATS server refused the credentials: {0}")]
    AuthFailed(String),
    /// The credentials or the CA could not be used at all.
    #[error("{0}")]
    BadConfig(String),
}

impl Classify for ConnectFailure {
    fn class(&self) -> Failure {
        match self {
            ConnectFailure::Unreachable { .. } => Failure::Unreachable,
            ConnectFailure::AuthFailed(_) => Failure::AuthFailed,
            ConnectFailure::BadConfig(_) => Failure::Refused,
        }
    }
}

/// How long one connection attempt may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long one request (a JetStream API call) waits for its answer.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects once (the first attempt fails fast, so the caller can report why); once connected, the
/// client reconnects by itself, trying again every 250 ms to 2 s, for ever. `on_event` hears of
/// every disconnect and reconnect.
pub async fn connect<F>(
    spec: &ConnectSpec,
    on_event: F,
) -> Result<async_nats::Client, ConnectFailure>
where
    F: Fn(async_nats::Event) + Send + Sync + 'static,
{
    let servers_text = spec.servers.join(",");
    let mut opts = ConnectOptions::new()
        .name(&spec.name)
        .custom_inbox_prefix(OPERATOR_INBOX_PREFIX)
        .connection_timeout(CONNECT_TIMEOUT)
        .request_timeout(Some(REQUEST_TIMEOUT))
        .max_reconnects(None)
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis((250 * attempts as u64).clamp(250, 2000))
        })
        .event_callback(move |event| {
            on_event(event);
            async {}
        });
    match &spec.credentials {
        None => {}
        Some(Credentials::Creds(c)) => {
            opts = opts.credentials(c).map_err(|e| {
                ConnectFailure::BadConfig(format!("the creds file cannot be read: {e}"))
            })?;
        }
        Some(Credentials::Nkey(seed)) => opts = opts.nkey(seed.clone()),
        Some(Credentials::Token(t)) => opts = opts.token(t.clone()),
        Some(Credentials::UserPassword { user, password }) => {
            opts = opts.user_and_password(user.clone(), password.clone())
        }
    }
    if let Some(ca) = &spec.ca_pem {
        opts = opts.tls_client_config(tls_config(ca)?).require_tls(true);
    }
    let addrs: Vec<async_nats::ServerAddr> = spec
        .servers
        .iter()
        .map(|s| {
            s.parse().map_err(|e| {
                ConnectFailure::BadConfig(format!("server URL {s:?} cannot be parsed: {e}"))
            })
        })
        .collect::<Result<_, _>>()?;
    opts.connect(addrs.as_slice())
        .await
        .map_err(|e| classify(&servers_text, e))
}

fn classify(servers: &str, e: async_nats::ConnectError) -> ConnectFailure {
    match e.kind() {
        ConnectErrorKind::Authentication | ConnectErrorKind::AuthorizationViolation => {
            ConnectFailure::AuthFailed(e.to_string())
        }
        ConnectErrorKind::ServerParse => ConnectFailure::BadConfig(e.to_string()),
        ConnectErrorKind::Tls => ConnectFailure::BadConfig(format!("TLS: {e}")),
        _ => ConnectFailure::Unreachable {
            servers: servers.to_string(),
            detail: e.to_string(),
        },
    }
}

/// The TLS configuration that trusts exactly the CA in `pem` (every certificate in it), built in
/// memory (no file is written or read), on the ring provider the rest of Settle uses.
pub fn tls_config(pem: &str) -> Result<ClientConfig, ConnectFailure> {
    let bad = |what: String| {
        ConnectFailure::BadConfig(format!(
            "the CA (spec.nats.tls.caSecretRef, key {CA_KEY:?}) {what}"
        ))
    };
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        let cert = cert.map_err(|e| bad(format!("is not PEM: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| bad(format!("is not a usable certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(bad("holds no PEM certificate".into()));
    }
    Ok(
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(format!("cannot be used with TLS: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// The variable that sets an application's inbox prefix (see [`inbox_prefix`]).
pub const INBOX_PREFIX_ENV: &str = "SETTLE_NATS_INBOX_PREFIX";

/// The inbox prefix of the operator's own connections. No namespace name begins with `_`, so
/// no tenant's prefix ([`inbox_prefix`]) covers it, and a tenant allowed only its own prefix
/// never reads the operator's replies (ledgers, consumer infos).
pub const OPERATOR_INBOX_PREFIX: &str = "_INBOX._settle";

/// The inbox prefix of an application of `namespace`: `_INBOX.<namespace>`. Every reply the
/// client waits for (pulled messages, with their `$JS.ACK` subjects, and API answers) arrives
/// under it, so a shared NATS account can grant each tenant `subscribe: _INBOX.<namespace>.>`
/// only, and no tenant reads another's deliveries (with the client's default, `_INBOX`, every
/// tenant would need `_INBOX.>`).
pub fn inbox_prefix(namespace: &str) -> String {
    format!("_INBOX.{namespace}")
}

/// The inbox prefix `value` (from [`INBOX_PREFIX_ENV`]) if it is one: tokens of visible
/// characters separated by single dots, no wildcard.
fn checked_inbox_prefix(value: &str) -> Result<String, BusError> {
    let ok = !value.is_empty()
        && value.split('.').all(|t| {
            !t.is_empty()
                && t.chars()
                    .all(|c| c.is_ascii_graphic() && c != '*' && c != '>')
        });
    if ok {
        Ok(value.to_string())
    } else {
        Err(err(format!(
            "{INBOX_PREFIX_ENV}={value:?} is not an inbox prefix: give subject tokens separated by \
             single dots, without wildcards or spaces (for example `_INBOX.team-a`)"
        )))
    }
}

impl NatsBroker {
    /// Connects to a NATS server (for example `nats://127.0.0.1:4222`), or to any of a
    /// comma-separated list of them (the servers of a cluster), with the inbox prefix
    /// [`INBOX_PREFIX_ENV`] gives, or else that of `POD_NAMESPACE` (the namespace a [`Bus`]
    /// reports under unless told another; `default` without it). An application that runs
    /// Subscriptions of another namespace uses [`NatsBroker::connect_in`].
    ///
    /// [`Bus`]: crate::bus::Bus
    pub async fn connect(url: &str) -> Result<NatsBroker, BusError> {
        let namespace = std::env::var("POD_NAMESPACE").unwrap_or_else(|_| "default".into());
        NatsBroker::connect_in(url, &namespace).await
    }

    /// [`NatsBroker::connect`] for an application of `namespace`: its inbox prefix is
    /// [`INBOX_PREFIX_ENV`]'s, or else [`inbox_prefix`]`(namespace)`.
    pub async fn connect_in(url: &str, namespace: &str) -> Result<NatsBroker, BusError> {
        let prefix = match std::env::var(INBOX_PREFIX_ENV) {
            Ok(value) => checked_inbox_prefix(&value)?,
            Err(_) => inbox_prefix(namespace),
        };
        // The client does not read a user and password from the URL: taken out and given to it,
        // so an application connects as its tenant's user (`nats://team-a:secret@host:4222`).
        let (url, user) = split_user(url);
        let mut options = async_nats::ConnectOptions::new().custom_inbox_prefix(prefix);
        if let Some((user, password)) = user {
            options = options.user_and_password(user, password);
        }
        let servers: Vec<&str> = url.split(',').collect();
        let client = options
            .connect(servers)
            .await
            .map_err(|e| err(format!("cannot connect to {url}: {e}")))?;
        Ok(NatsBroker::from_client(client))
    }
}

/// A NATS URL without its `user:password@` (every server of a comma-separated list), and that
/// user and password (the first given).
fn split_user(url: &str) -> (String, Option<(String, String)>) {
    let mut user = None;
    let servers: Vec<String> = url
        .split(',')
        .map(|server| {
            let Some((scheme, rest)) = server.split_once("://") else {
                return server.to_string();
            };
            match rest.split_once('@') {
                Some((info, host)) => {
                    if user.is_none()
                        && let Some((u, p)) = info.split_once(':')
                    {
                        user = Some((u.to_string(), p.to_string()));
                    }
                    format!("{scheme}://{host}")
                }
                None => server.to_string(),
            }
        })
        .collect();
    (servers.join(","), user)
}

/// The server's version as it announced it, once connected.
pub fn server_version(client: &async_nats::Client) -> Option<String> {
    client
        .try_server_info()
        .map(|i| i.version)
        .filter(|v| !v.is_empty())
}

/// Whether the client is connected now (not reconnecting).
pub fn is_connected(client: &async_nats::Client) -> bool {
    client.connection_state() == async_nats::connection::State::Connected
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_in_the_url_is_taken_out_and_given_to_the_client() {
        assert_eq!(
            split_user("nats://team-a:pw@127.0.0.1:4222"),
            (
                "nats://127.0.0.1:4222".to_string(),
                Some(("team-a".to_string(), "pw".to_string()))
            )
        );
        assert_eq!(
            split_user("nats://127.0.0.1:4222,nats://u:p@h:1"),
            (
                "nats://127.0.0.1:4222,nats://h:1".to_string(),
                Some(("u".to_string(), "p".to_string()))
            )
        );
        assert_eq!(split_user("nats://h:1"), ("nats://h:1".to_string(), None));
    }

    #[test]
    fn an_inbox_prefix_is_subject_tokens_without_wildcards() {
        assert_eq!(inbox_prefix("team-a"), "_INBOX.team-a");
        assert_eq!(
            checked_inbox_prefix("_INBOX.team-a").ok(),
            Some("_INBOX.team-a".to_string())
        );
        for bad in ["", "_INBOX.", ".x", "a..b", "_INBOX.>", "a.*", "a b"] {
            let e = checked_inbox_prefix(bad).expect_err(bad).to_string();
            assert!(e.contains(INBOX_PREFIX_ENV), "{e}");
        }
    }

    #[test]
    fn debug_never_prints_a_secret() {
        for c in [
            Credentials::Creds("-----BEGIN NATS USER JWT----- s3cr3t".into()),
            Credentials::Nkey("SUAs3cr3t".into()),
            Credentials::Token("s3cr3t".into()),
            Credentials::UserPassword {
                user: "alice".into(),
                password: "s3cr3t".into(),
            },
        ] {
            let spec = ConnectSpec {
                servers: vec!["nats://n:4222".into()],
                credentials: Some(c.clone()),
                ca_pem: None,
                name: "settle".into(),
            };
            for text in [format!("{c:?}"), format!("{spec:?}"), format!("{spec:#?}")] {
                assert!(!text.contains("s3cr3t"), "{text}");
                assert!(text.contains("<redacted>"), "{text}");
            }
        }
    }

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, Vec<u8>> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn each_documented_credential_form_is_read() {
        assert_eq!(
            Credentials::from_secret_data(&data(&[("token", "s3cret\n")])),
            Ok(Credentials::Token("s3cret".into()))
        );
        assert_eq!(
            Credentials::from_secret_data(&data(&[("user", "a"), ("password", "b")])),
            Ok(Credentials::UserPassword {
                user: "a".into(),
                password: "b".into()
            })
        );
        assert_eq!(
            Credentials::from_secret_data(&data(&[("nkey", "SUAX")])),
            Ok(Credentials::Nkey("SUAX".into()))
        );
        assert!(matches!(
            Credentials::from_secret_data(&data(&[("creds", "-----BEGIN")])),
            Ok(Credentials::Creds(_))
        ));
    }

    #[test]
    fn a_secret_without_usable_keys_says_which_keys_it_needs() {
        let e = Credentials::from_secret_data(&data(&[("pass", "x")])).unwrap_err();
        assert!(
            e.contains("creds, nkey, token, or user and password"),
            "{e}"
        );
        let e = Credentials::from_secret_data(&data(&[("user", "x")])).unwrap_err();
        assert!(e.contains("\"password\" is missing"), "{e}");
    }

    #[test]
    fn a_ca_is_read_into_the_tls_config_and_a_bad_one_is_bad_config() {
        assert!(tls_config(TEST_CA).is_ok());
        for (pem, says) in [
            ("", "holds no PEM certificate"),
            ("not a certificate\n", "holds no PEM certificate"),
            (
                "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
                "is not a usable certificate",
            ),
        ] {
            match tls_config(pem) {
                Err(ConnectFailure::BadConfig(m)) => {
                    assert!(
                        m.starts_with("the CA (spec.nats.tls.caSecretRef, key \"ca.crt\")"),
                        "{m}"
                    );
                    assert!(m.contains(says), "{pem:?}: {m}");
                }
                other => panic!("{pem:?}: expected BadConfig, got {other:?}"),
            }
        }
    }

    /// A self-signed CA certificate (CN "settle test CA", P-256), made once with openssl.
    const TEST_CA: &str = "\
-----BEGIN CERTIFICATE-----\n\
MIIBijCCAS+gAwIBAgIUJ0V/Qy2oqJvEmT4o0Q+8TLCszwYwCgYIKoZIzj0EAwIw\n\
GTEXMBUGA1UEAwwOc2V0dGxlIHRlc3QgQ0EwIBcNMjYxMjAxMTAwOTI3WhgPMjEy\n\
NjExMDcxMDA5MjdaMBkxFzAVBgNVBAMMDnNldHRsZSB0ZXN0IENBMFkwEwYHKoZI\n\
zj0CAQYIKoZIzj0DAQcDQgAE5s2OoyL4sZm5w8WGxzDoDdAgo0iGamOhqmPMLfyn\n\
TojdfjiiIPQgI/kpDiLXcuaAziVJyp4yfAImUjvZC7CupqNTMFEwHQYDVR0OBBYE\n\
FBeUTL9w/LxVYplSEl0WO8TPt94zMB8GA1UdIwQYMBaAFBeUTL9w/LxVYplSEl0W\n\
O8TPt94zMA8GA1UdEwEB/wQFMAMBAf8wCgYIKoZIzj0EAwIDSQAwRgIhAKh7JlsM\n\
mqyFGpuPSEORPNONkmy7MOyClk+nkSy1OMmuAiEAgGnuxFcubjCy72MuA61jIEVU\n\
YTgARTBNUtErYWCrd6U=\n\
-----END CERTIFICATE-----\n\
";

    #[test]
    fn a_changed_secret_changes_the_fingerprint() {
        let a = ConnectSpec {
            servers: vec!["nats://127.0.0.1:4222".into()],
            credentials: Some(Credentials::Token("a".into())),
            ca_pem: None,
            name: "settle".into(),
        };
        let mut b = a.clone();
        assert_eq!(a.fingerprint(), b.fingerprint());
        b.credentials = Some(Credentials::Token("b".into()));
        assert_ne!(a.fingerprint(), b.fingerprint());
    }
}
