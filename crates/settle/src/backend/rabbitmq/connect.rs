//! Connecting to RabbitMQ: an application's [`RabbitBroker`] from one AMQP URL (over TLS with a
//! CA), kept with how to dial it again when the connection is lost, and the operator's
//! connection from a Backend's settings: the AMQP URLs (tried in order), the vhost, the
//! credentials and CA read from its Secrets, and a failure told apart as unreachable, refused
//! credentials or unusable settings (its [`Failure`] class), so the Backend's `Ready` says which.
//!
//! It must not read Kubernetes objects (the caller passes the Secrets' data) nor declare queues.

use std::collections::BTreeMap;
use std::hash::Hash;

use std::time::Duration;

use lapin::types::LongString;
use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties};

use super::mapping::Exchanges;
use std::sync::Arc;

use futures::FutureExt;

use super::{Dial, RabbitBroker, RabbitError, broker_err};
use crate::backend::{Classify, Failure};
use crate::bus::BusError;

/// The Secret key holding the CA certificate (PEM).
pub const CA_KEY: &str = "ca.crt";
/// How long one connection attempt may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// User name and password, from the Backend's credentials Secret (`username`, `password`).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}:<redacted>)", self.username)
    }
}

impl Credentials {
    /// From a Secret's data; the error says which key is missing.
    pub fn from_secret_data(data: &BTreeMap<String, Vec<u8>>) -> Result<Credentials, String> {
        let text = |k: &str| {
            data.get(k)
                .map(|v| {
                    String::from_utf8_lossy(v)
                        .trim_end_matches('\n')
                        .to_string()
                })
                .filter(|v| !v.is_empty())
        };
        match (text("username"), text("password")) {
            (Some(username), Some(password)) => Ok(Credentials { username, password }),
            (None, _) => Err("key \"username\" is missing or empty".into()),
            (_, None) => Err("key \"password\" is missing or empty".into()),
        }
    }
}

/// Everything a connection is made from. Two equal specs make the same connection, so a caller
/// keeps one connection per spec and reconnects when it changes (a rotated Secret). `Debug`
/// shows the URLs with any password in them replaced, and the credentials redacted.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RabbitConnectSpec {
    pub urls: Vec<String>,
    /// The vhost, replacing the URL's path when set.
    pub vhost: Option<String>,
    /// Replacing the URL's user and password when set.
    pub credentials: Option<Credentials>,
    /// The CA that signed the broker's certificate (PEM), for `amqps://`.
    pub ca_pem: Option<String>,
    pub management_url: Option<String>,
    pub exchanges: Exchanges,
    /// The connection's name, as the management UI shows it.
    pub name: String,
}

impl std::fmt::Debug for RabbitConnectSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitConnectSpec")
            .field(
                "urls",
                &self.urls.iter().map(|u| redact(u)).collect::<Vec<_>>(),
            )
            .field("vhost", &self.vhost)
            .field("credentials", &self.credentials)
            .field("ca_pem", &self.ca_pem.as_ref().map(|_| "<PEM>"))
            .field(
                "management_url",
                &self.management_url.as_deref().map(redact),
            )
            .field("exchanges", &self.exchanges)
            .field("name", &self.name)
            .finish()
    }
}

impl RabbitConnectSpec {
    /// A fingerprint of the spec (credentials included), to tell a changed one apart.
    pub fn fingerprint(&self) -> u64 {
        crate::backend::fingerprint(self)
    }

    /// Each URL with the spec's vhost and credentials put in, in order.
    pub fn uris(&self) -> Result<Vec<AMQPUri>, ConnectFailure> {
        self.urls
            .iter()
            .map(|u| {
                let mut uri: AMQPUri = u.parse().map_err(|e| {
                    ConnectFailure::BadConfig(format!(
                        "{:?} is not an AMQP URL ({e}): fix spec.rabbitmq.urls",
                        redact(u)
                    ))
                })?;
                if let Some(v) = &self.vhost {
                    uri.vhost = v.clone();
                }
                if let Some(c) = &self.credentials {
                    uri.authority.userinfo.username = c.username.clone();
                    uri.authority.userinfo.password = c.password.clone();
                }
                Ok(uri)
            })
            .collect()
    }

    /// The vhost connections use (the spec's, else the first URL's).
    pub fn effective_vhost(&self) -> String {
        match (
            &self.vhost,
            self.uris().ok().and_then(|u| u.into_iter().next()),
        ) {
            (Some(v), _) => v.clone(),
            (None, Some(u)) => u.vhost,
            (None, None) => "/".into(),
        }
    }

    /// The user and password connections use (for the management API too).
    pub fn effective_credentials(&self) -> Credentials {
        match (
            &self.credentials,
            self.uris().ok().and_then(|u| u.into_iter().next()),
        ) {
            (Some(c), _) => c.clone(),
            (None, Some(u)) => Credentials {
                username: u.authority.userinfo.username,
                password: u.authority.userinfo.password,
            },
            (None, None) => Credentials {
                username: "guest".into(),
                password: "guest".into(),
            },
        }
    }
}

/// Why a connection could not be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConnectFailure {
    /// No broker answered (refused, timed out, unresolvable).
    #[error("no RabbitMQ broker answered at {urls}: {detail}")]
    Unreachable { urls: String, detail: String },
    /// The broker refused the credentials (or the vhost).
    #[error("RabbitMQ refused the credentials or the vhost: {0}")]
    AuthFailed(String),
    /// The URL, credentials or CA could not be used at all.
    #[error("{0}")]
    BadConfig(String),
    /// The broker closed the last connections within seconds of their making: the next one is
    /// made only `pause` after the last drop (the message stays the same while it waits, so a
    /// status that shows it is not written again for every check).
    #[error(
        "RabbitMQ closed the last {drops} connections within seconds of their making{}; the next one is made {}s after the last drop",
        last_word(.last_error),
        .pause.as_secs_f64()
    )]
    Unsteady {
        drops: u32,
        pause: std::time::Duration,
        last_error: Option<String>,
    },
}

fn last_word(e: &Option<String>) -> String {
    e.as_deref()
        .map(|e| format!(" (last: {e})"))
        .unwrap_or_default()
}

impl Classify for ConnectFailure {
    fn class(&self) -> Failure {
        match self {
            ConnectFailure::Unreachable { .. } | ConnectFailure::Unsteady { .. } => {
                Failure::Unreachable
            }
            ConnectFailure::AuthFailed(_) => Failure::AuthFailed,
            ConnectFailure::BadConfig(_) => Failure::Refused,
        }
    }
}

/// Connects to the first URL that answers.
pub async fn connect(spec: &RabbitConnectSpec) -> Result<Connection, ConnectFailure> {
    let uris = spec.uris()?;
    let mut last = None;
    for uri in uris {
        let props = ConnectionProperties::default()
            .with_connection_name(LongString::from(spec.name.as_str()));
        let attempt = async {
            match &spec.ca_pem {
                None => Connection::connect_uri(uri, props).await,
                Some(ca) => {
                    let runtime = lapin::runtime::default_runtime()?;
                    let tls = lapin::tcp::OwnedTLSConfig {
                        identity: None,
                        cert_chain: Some(ca.clone()),
                    };
                    Connection::connect_uri_with_config(uri, props, tls, runtime).await
                }
            }
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, attempt).await {
            Ok(Ok(c)) => return Ok(c),
            Ok(Err(e)) => {
                let text = e.to_string();
                let refused = matches!(e.kind(), lapin::ErrorKind::ProtocolError(p) if p.get_id() == 403 || p.get_id() == 530)
                    || text.contains("ACCESS_REFUSED")
                    || text.contains("NOT_ALLOWED");
                if refused {
                    return Err(ConnectFailure::AuthFailed(text));
                }
                last = Some(text);
            }
            Err(_) => last = Some(format!("no answer within {CONNECT_TIMEOUT:?}")),
        }
    }
    Err(ConnectFailure::Unreachable {
        urls: spec
            .urls
            .iter()
            .map(|u| redact(u))
            .collect::<Vec<_>>()
            .join(","),
        detail: last.unwrap_or_else(|| "no URL given".into()),
    })
}

impl RabbitBroker {
    /// Connects to a broker (for example `amqp://guest:guest@127.0.0.1:5672/%2f`; the path is
    /// the vhost), publishing to and binding on `amq.topic`.
    pub async fn connect(url: &str) -> Result<RabbitBroker, BusError> {
        let to = url.to_string();
        RabbitBroker::dialled(
            url,
            Arc::new(move || {
                let url = to.clone();
                async move { Connection::connect(&url, ConnectionProperties::default()).await }
                    .boxed()
            }),
        )
        .await
    }

    /// Connects over TLS (`amqps://`), trusting the CA certificate(s) in `ca_pem`.
    pub async fn connect_with_ca(url: &str, ca_pem: &str) -> Result<RabbitBroker, BusError> {
        let (to, ca) = (url.to_string(), ca_pem.to_string());
        RabbitBroker::dialled(
            url,
            Arc::new(move || {
                let (url, ca) = (to.clone(), ca.clone());
                async move {
                    let runtime = lapin::runtime::default_runtime()?;
                    let tls = lapin::tcp::OwnedTLSConfig {
                        identity: None,
                        cert_chain: Some(ca),
                    };
                    Connection::connect_with_config(
                        &url,
                        ConnectionProperties::default(),
                        tls,
                        runtime,
                    )
                    .await
                }
                .boxed()
            }),
        )
        .await
    }

    /// A broker on the connection `dial` makes, made again by it whenever it is lost.
    async fn dialled(url: &str, dial: Dial) -> Result<RabbitBroker, BusError> {
        let conn = dial().await.map_err(|source| {
            broker_err(RabbitError::Connect {
                url: hide_password(url),
                source,
            })
        })?;
        Ok(RabbitBroker::with_link(conn, Some(dial)).with_user(url_user(url)))
    }
}

/// The user an AMQP URL authenticates as (RabbitMQ's default `guest` when it names none).
fn url_user(url: &str) -> String {
    url.parse::<lapin::uri::AMQPUri>()
        .map(|u| u.authority.userinfo.username)
        .unwrap_or_else(|_| "guest".to_string())
}

/// The URL without its password (`***`), for an application's connect errors; the operator's
/// messages use [`redact`].
fn hide_password(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

/// The URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{}{user}:<redacted>{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_prints_a_password() {
        let mut s = spec(&["amqp://guest:s3cr3t@r:5672/%2f"]);
        s.credentials = Some(Credentials {
            username: "alice".into(),
            password: "s3cr3t".into(),
        });
        s.management_url = Some("http://bob:s3cr3t@r:15672".into());
        for text in [format!("{s:?}"), format!("{:?}", s.credentials)] {
            assert!(!text.contains("s3cr3t"), "{text}");
            assert!(text.contains("<redacted>"), "{text}");
        }
    }

    fn spec(urls: &[&str]) -> RabbitConnectSpec {
        RabbitConnectSpec {
            urls: urls.iter().map(|s| s.to_string()).collect(),
            vhost: None,
            credentials: None,
            ca_pem: None,
            management_url: None,
            exchanges: Exchanges::default(),
            name: "t".into(),
        }
    }

    #[test]
    fn the_spec_replaces_the_urls_vhost_and_credentials() {
        let mut s = spec(&["amqp://guest:guest@127.0.0.1:5672/%2f"]);
        assert_eq!(s.effective_vhost(), "/");
        assert_eq!(s.effective_credentials().username, "guest");
        s.vhost = Some("orders".into());
        s.credentials = Some(Credentials {
            username: "app".into(),
            password: "pw".into(),
        });
        let u = &s.uris().expect("valid")[0];
        assert_eq!(u.vhost, "orders");
        assert_eq!(u.authority.userinfo.username, "app");
        assert_eq!(u.authority.userinfo.password, "pw");
        assert_eq!(s.effective_vhost(), "orders");
    }

    #[test]
    fn a_changed_secret_changes_the_fingerprint() {
        let a = spec(&["amqp://127.0.0.1"]);
        let mut b = a.clone();
        assert_eq!(a.fingerprint(), b.fingerprint());
        b.credentials = Some(Credentials {
            username: "u".into(),
            password: "p".into(),
        });
        assert_ne!(a.fingerprint(), b.fingerprint());
    }

    #[test]
    fn credentials_need_both_keys() {
        let data = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
                .collect::<BTreeMap<_, _>>()
        };
        assert!(
            Credentials::from_secret_data(&data(&[("username", "u"), ("password", "p")])).is_ok()
        );
        let e = Credentials::from_secret_data(&data(&[("username", "u")])).unwrap_err();
        assert!(e.contains("password"), "{e}");
        let e = Credentials::from_secret_data(&data(&[])).unwrap_err();
        assert!(e.contains("username"), "{e}");
        assert_eq!(
            format!(
                "{:?}",
                Credentials::from_secret_data(&data(&[("username", "u"), ("password", "p")]))
            ),
            "Ok(Credentials(u:<redacted>))"
        );
    }

    #[test]
    fn urls_lose_their_password_in_messages() {
        assert_eq!(
            hide_password("amqp://guest:secret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            hide_password("amqp://127.0.0.1:5672"),
            "amqp://127.0.0.1:5672"
        );
    }

    #[test]
    fn a_bad_url_names_the_field() {
        let e = spec(&["http://x:y@z"]).uris().unwrap_err();
        assert!(e.to_string().contains("spec.rabbitmq.urls"), "{e}");
        assert!(
            !e.to_string().contains(":y@"),
            "the password stays out: {e}"
        );
    }
}
