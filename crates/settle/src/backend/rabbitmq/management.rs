//! RabbitMQ's management API (the `rabbitmq_management` plugin's HTTP API), read-only: the
//! server's version, a queue's arguments and bindings (what AMQP cannot show, for
//! [`super::mapping::diff`] and the owner check), and its gauges (messages ready and
//! unacknowledged) for the account.
//!
//! It must not change anything on the broker (queues are declared, bound and deleted over AMQP,
//! [`super::admin`]) nor decide what a difference means.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use super::mapping::{Binding, LiveQueue, normalise};
use crate::backend::{Classify, Failure};

/// How much of an unexpected answer's body the DEBUG log shows.
const BODY_LOG_MAX: usize = 256;

/// How long one request may take.
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A failed management API call.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ManagementError {
    /// No answer (refused, timed out): try again later.
    #[error("the RabbitMQ management API at {url} did not answer: {detail}")]
    Unreachable { url: String, detail: String },
    /// 401/403: the user may not read it (it needs the `monitoring` or `management` tag).
    #[error(
        "the RabbitMQ management API at {url} refused the credentials ({status}): give the user the \
         `monitoring` tag, or fix spec.rabbitmq.managementUrl"
    )]
    Unauthorized { url: String, status: u16 },
    /// Any other answer than the one asked for. What the server sent is never carried here
    /// (it reaches status): only the status code and a fixed description; the body goes to
    /// the DEBUG log, truncated.
    #[error("the RabbitMQ management API answered {status} to {path}: {detail}")]
    Status {
        path: String,
        status: u16,
        detail: String,
    },
    /// The settings cannot be used (a bad URL or CA).
    #[error("{0}")]
    BadConfig(String),
}

impl Classify for ManagementError {
    fn class(&self) -> Failure {
        match self {
            ManagementError::Unreachable { .. } => Failure::Unreachable,
            ManagementError::Unauthorized { .. } => Failure::AuthFailed,
            ManagementError::Status { .. } | ManagementError::BadConfig(_) => Failure::Refused,
        }
    }
}

/// A client of one broker's management API. `Debug` shows its URL, never the authorization.
#[derive(Clone)]
pub struct Management {
    base: String,
    authorization: String,
    client: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
}

impl std::fmt::Debug for Management {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Management")
            .field("base", &super::connect::redact(&self.base))
            .field("authorization", &"<redacted>")
            .finish_non_exhaustive()
    }
}

/// A queue's counts, as the management API shows them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueGauges {
    /// Messages waiting to be delivered.
    pub ready: u64,
    /// Messages delivered and not yet acknowledged.
    pub unacknowledged: u64,
}

/// A path segment with every byte outside RFC 3986's unreserved set percent-encoded (a vhost
/// `/` is `%2F`).
pub fn segment(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The bindings of a queue from `GET /api/queues/<vhost>/<name>/bindings`, without the implicit
/// one on the default exchange (every queue has it; it cannot be removed).
pub fn bindings_of(json: &serde_json::Value) -> Vec<Binding> {
    let mut out: Vec<Binding> = json
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|b| {
            let exchange = b.get("source")?.as_str()?;
            let routing_key = b.get("routing_key")?.as_str()?;
            (!exchange.is_empty()).then(|| Binding {
                exchange: exchange.to_string(),
                routing_key: routing_key.to_string(),
            })
        })
        .collect();
    out.sort();
    out
}

impl Management {
    /// A client for `url` (`http://` or `https://`; with `ca_pem`, only that CA is trusted for
    /// `https://`, else the system's roots), authenticating as `username`.
    pub fn new(
        url: &str,
        username: &str,
        password: &str,
        ca_pem: Option<&str>,
    ) -> Result<Management, ManagementError> {
        let base = url.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(ManagementError::BadConfig(format!(
                "spec.rabbitmq.managementUrl {base:?} is not an http:// or https:// URL"
            )));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = hyper_rustls::HttpsConnectorBuilder::new();
        let builder = match ca_pem {
            Some(pem) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                    let cert = cert.map_err(|e| {
                        ManagementError::BadConfig(format!(
                            "the CA (spec.rabbitmq.tls.caSecretRef) is not PEM: {e}"
                        ))
                    })?;
                    roots.add(cert).map_err(|e| {
                        ManagementError::BadConfig(format!(
                            "the CA (spec.rabbitmq.tls.caSecretRef) is not usable: {e}"
                        ))
                    })?;
                }
                if roots.is_empty() {
                    return Err(ManagementError::BadConfig(
                        "the CA (spec.rabbitmq.tls.caSecretRef) holds no PEM certificate".into(),
                    ));
                }
                let config = rustls::ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .map_err(|e| ManagementError::BadConfig(e.to_string()))?
                    .with_root_certificates(roots)
                    .with_no_client_auth();
                builder.with_tls_config(config)
            }
            None if base.starts_with("https://") => builder
                .with_provider_and_native_roots(provider)
                .map_err(|e| {
                    ManagementError::BadConfig(format!(
                        "no system CA certificates to check {base}: {e}; name the CA in spec.rabbitmq.tls.caSecretRef"
                    ))
                })?,
            // Plain HTTP: no certificate is ever checked (an image without system roots works).
            None => builder.with_tls_config(
                rustls::ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .map_err(|e| ManagementError::BadConfig(e.to_string()))?
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth(),
            ),
        };
        let connector = builder.https_or_http().enable_http1().build();
        let client = Client::builder(TokioExecutor::new()).build(connector);
        let authorization = format!(
            "Basic {}",
            aws_smithy_types::base64::encode(format!("{username}:{password}"))
        );
        Ok(Management {
            base,
            authorization,
            client,
        })
    }

    /// `GET path` as JSON; `None` on 404.
    async fn get(&self, path: &str) -> Result<Option<serde_json::Value>, ManagementError> {
        let url = format!("{}{path}", self.base);
        let unreachable = |detail: String| ManagementError::Unreachable {
            url: self.base.clone(),
            detail,
        };
        let req = http::Request::get(&url)
            .header(http::header::AUTHORIZATION, &self.authorization)
            .body(Empty::<Bytes>::new())
            .map_err(|e| ManagementError::BadConfig(format!("{url:?}: {e}")))?;
        let call = async {
            let res = self
                .client
                .request(req)
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            let status = res.status().as_u16();
            let body = res
                .into_body()
                .collect()
                .await
                .map_err(|e| unreachable(e.to_string()))?
                .to_bytes();
            Ok::<_, ManagementError>((status, body))
        };
        let (status, body) = tokio::time::timeout(REQUEST_TIMEOUT, call)
            .await
            .map_err(|_| unreachable(format!("no answer within {REQUEST_TIMEOUT:?}")))??;
        let log_body = || {
            tracing::debug!(
                url = %self.base,
                path,
                status,
                body = %String::from_utf8_lossy(&body[..body.len().min(BODY_LOG_MAX)]),
                "the RabbitMQ management API's answer (truncated)"
            );
        };
        match status {
            200 => serde_json::from_slice(&body).map(Some).map_err(|e| {
                log_body();
                ManagementError::Status {
                    path: path.to_string(),
                    status,
                    // Line and column only: serde's message can quote the body.
                    detail: format!(
                        "the answer is not the JSON expected (at line {}, column {})",
                        e.line(),
                        e.column()
                    ),
                }
            }),
            404 => Ok(None),
            401 | 403 => Err(ManagementError::Unauthorized {
                url: self.base.clone(),
                status,
            }),
            _ => {
                log_body();
                Err(ManagementError::Status {
                    path: path.to_string(),
                    status,
                    detail: "an unexpected answer (its body is in the operator's debug log)".into(),
                })
            }
        }
    }

    /// The broker's version (`GET /api/overview`, `rabbitmq_version`).
    pub async fn version(&self) -> Result<Option<String>, ManagementError> {
        Ok(self
            .get("/api/overview")
            .await?
            .and_then(|v| v.get("rabbitmq_version")?.as_str().map(str::to_string)))
    }

    /// Whether the broker keeps no statistics (`GET /api/overview`, `disable_stats`): then no
    /// queue shows a state.
    pub async fn stats_disabled(&self) -> Result<bool, ManagementError> {
        Ok(self
            .get("/api/overview")
            .await?
            .and_then(|v| v.get("disable_stats")?.as_bool())
            .unwrap_or(false))
    }

    /// Queue `name` in `vhost` as [`super::mapping::diff`] compares it: its arguments and its
    /// bindings, and its state; `None` when it does not exist.
    pub async fn queue(
        &self,
        vhost: &str,
        name: &str,
    ) -> Result<Option<LiveQueue>, ManagementError> {
        let path = format!("/api/queues/{}/{}", segment(vhost), segment(name));
        let Some(q) = self.get(&path).await? else {
            return Ok(None);
        };
        let arguments = q
            .get("arguments")
            .and_then(|a| a.as_object())
            .map(normalise)
            .unwrap_or_default();
        let bindings = self
            .get(&format!("{path}/bindings"))
            .await?
            .map(|b| bindings_of(&b))
            .unwrap_or_default();
        let state = q.get("state").and_then(|s| s.as_str()).map(str::to_string);
        Ok(Some(LiveQueue {
            arguments,
            bindings,
            state,
        }))
    }

    /// The names of every queue in `vhost`.
    pub async fn queue_names(&self, vhost: &str) -> Result<Vec<String>, ManagementError> {
        let path = format!("/api/queues/{}?columns=name", segment(vhost));
        Ok(self
            .get(&path)
            .await?
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|q| q.get("name")?.as_str().map(str::to_string))
            .collect())
    }

    /// Queue `name`'s counts; `None` when it does not exist.
    pub async fn gauges(
        &self,
        vhost: &str,
        name: &str,
    ) -> Result<Option<QueueGauges>, ManagementError> {
        let path = format!("/api/queues/{}/{}", segment(vhost), segment(name));
        Ok(self.get(&path).await?.map(|q| {
            let n = |k: &str| q.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
            QueueGauges {
                ready: n("messages_ready"),
                unacknowledged: n("messages_unacknowledged"),
            }
        }))
    }
}

/// The account's gauges for one queue, `(pending, ack_pending)`: messages ready (waiting for a
/// consumer) and messages unacknowledged (delivered, not yet settled), as the management API
/// last sampled them (it refreshes every few seconds). `None` when the queue does not exist.
pub async fn queue_gauges(
    management: &Management,
    vhost: &str,
    queue: &str,
) -> Result<Option<(u64, u64)>, ManagementError> {
    Ok(management
        .gauges(vhost, queue)
        .await?
        .map(|g| (g.ready, g.unacknowledged)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_prints_the_authorization() {
        let m = Management::new("http://r:15672", "alice", "s3cr3t", None).expect("a client");
        let text = format!("{m:?}");
        assert!(text.contains("<redacted>"), "{text}");
        // Basic auth is base64 of user:password.
        assert!(
            !text.contains("s3cr3t") && !text.contains("YWxpY2U6czNjcjN0"),
            "{text}"
        );
    }

    #[test]
    fn segments_are_percent_encoded() {
        assert_eq!(segment("/"), "%2F");
        assert_eq!(segment("orders.eu_1-x~"), "orders.eu_1-x~");
        assert_eq!(segment("a b/c"), "a%20b%2Fc");
    }

    #[test]
    fn the_default_exchange_binding_is_left_out_and_the_rest_sorted() {
        let json = serde_json::json!([
            {"source": "", "routing_key": "q", "destination": "q"},
            {"source": "amq.topic", "routing_key": "orders.#", "destination": "q"},
            {"source": "audit", "routing_key": "#", "destination": "q"},
        ]);
        assert_eq!(
            bindings_of(&json),
            vec![
                Binding {
                    exchange: "amq.topic".into(),
                    routing_key: "orders.#".into()
                },
                Binding {
                    exchange: "audit".into(),
                    routing_key: "#".into()
                },
            ]
        );
    }

    #[test]
    fn plain_http_needs_no_certificates_and_a_ca_without_one_is_refused() {
        assert!(Management::new("http://127.0.0.1:1/", "u", "p", None).is_ok());
        let e =
            Management::new("https://x", "u", "p", Some("not a certificate")).expect_err("refused");
        assert!(e.to_string().contains("caSecretRef"), "{e}");
    }

    #[test]
    fn a_url_that_is_not_http_is_refused_naming_the_field() {
        let e = Management::new("amqp://x", "u", "p", None).expect_err("refused");
        assert!(e.to_string().contains("managementUrl"), "{e}");
    }
}
