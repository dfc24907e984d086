//! The operator's two small HTTP ports, each with `crate::serve`'s connection cap and deadlines:
//!
//! - the metrics port: `/metrics` (Prometheus text, every `settle_*` metric), over plain HTTP, or,
//!   with `--metrics-auth`, over HTTPS (the webhook's certificate) and only for a bearer token
//!   the API server authenticates and authorizes for `get` on `/metrics` (`auth`). Under
//!   `--metrics-auth` it also serves `/lag/<namespace>/<subscription>` (`lag`: one
//!   Subscription's lag as JSON, for KEDA, to a token allowed to get that Subscription). It
//!   also answers `/healthz` and `/readyz`, for scripts that look there; its `/readyz` also
//!   waits, on the leader, for the controllers' caches;
//! - the probe port: `/healthz` (the process answers) and `/readyz` (the Backend cache has
//!   synced, so admission answers with real capabilities), for the kubelet alone, so that scrapes
//!   and idle connections on the metrics port can never make a probe fail. It does not wait for
//!   the controllers: readiness puts a replica in the webhook's Service and counts it healthy for
//!   the PodDisruptionBudget, and a replica that just took the Lease serves admission as well as
//!   before while its controllers sync.
//!
//! From the shutdown signal on, both `/readyz` answer 503 while the ports stay open for the
//! shutdown delay (`operator::run` closes them).
//!
//! No body is ever read: anything but `GET` is answered 405. It must not serve anything that
//! changes state.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use futures::FutureExt;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use kube::Client;
use kube::runtime::reflector::Store;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

use super::auth::{Access, Authorizer, Verdict};
use super::lag::{self, LagError};
use crate::admission::certs::{CertResolver, crypto_provider};
use crate::exposition::Exposition;
use crate::reconcile::Readiness;
use crate::serve::{Bounded, ConnectionMetrics, Limits};
use settle::api::Backend;

#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    #[error("could not listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("could not set up TLS for --metrics-auth: {0}")]
    Tls(#[from] rustls::Error),
}

/// The two ports and their limits.
#[derive(Clone, Debug)]
pub struct HealthConfig {
    pub metrics_addr: SocketAddr,
    pub metrics_limits: Limits,
    pub probe_addr: SocketAddr,
    pub probe_limits: Limits,
}

/// What `/readyz` looks at.
#[derive(Clone)]
struct Ready {
    backends: Store<Backend>,
    controllers: Readiness,
    /// True from the shutdown signal on: `/readyz` answers 503 so the replica leaves the
    /// webhook's Service while it still answers reviews.
    stopping: watch::Receiver<bool>,
}

/// Both ports, bound.
pub struct Server {
    metrics: Bounded,
    probe: Bounded,
    exposition: Exposition,
    ready: Ready,
    auth: Option<Arc<Authorizer>>,
    client: Client,
}

async fn listen(addr: SocketAddr) -> Result<TcpListener, HealthError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| HealthError::Bind { addr, source })
}

impl Server {
    /// Binds both ports. With `auth` (and the webhook's certificate in `certs`), the metrics port
    /// serves HTTPS and asks the API server about every token it has not seen lately.
    pub async fn bind(
        config: HealthConfig,
        client: Client,
        exposition: Exposition,
        backends: Store<Backend>,
        controllers: Readiness,
        stopping: watch::Receiver<bool>,
        auth: Option<(Authorizer, Arc<CertResolver>)>,
    ) -> Result<Self, HealthError> {
        let metrics_listener = listen(config.metrics_addr).await?;
        let probe_listener = listen(config.probe_addr).await?;
        let (tls, auth) = match auth {
            Some((authorizer, certs)) => {
                let mut tls = rustls::ServerConfig::builder_with_provider(crypto_provider())
                    .with_safe_default_protocol_versions()?
                    .with_no_client_auth()
                    .with_cert_resolver(certs);
                tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
                (
                    Some(TlsAcceptor::from(Arc::new(tls))),
                    Some(Arc::new(authorizer)),
                )
            }
            None => (None, None),
        };
        tracing::info!(
            addr = %metrics_listener.local_addr().unwrap_or(config.metrics_addr),
            max_connections = config.metrics_limits.max_connections,
            auth = auth.is_some(),
            "metrics and health listening"
        );
        tracing::info!(
            addr = %probe_listener.local_addr().unwrap_or(config.probe_addr),
            max_connections = config.probe_limits.max_connections,
            "probes listening"
        );
        let metrics = Bounded {
            listener: metrics_listener,
            metrics: ConnectionMetrics::register(
                &exposition.registry,
                "metrics",
                "--metrics-max-connections",
                tls.is_some(),
            )?,
            tls,
            limits: config.metrics_limits,
            what: "metrics",
            cap_flag: "--metrics-max-connections",
        };
        let probe = Bounded {
            listener: probe_listener,
            metrics: ConnectionMetrics::register(
                &exposition.registry,
                "probe",
                "--probe-max-connections",
                false,
            )?,
            tls: None,
            limits: config.probe_limits,
            what: "probe",
            cap_flag: "--probe-max-connections",
        };
        Ok(Server {
            metrics,
            probe,
            exposition,
            ready: Ready {
                backends,
                controllers,
                stopping,
            },
            auth,
            client,
        })
    }

    /// Serves both ports until `shutdown` completes.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), HealthError> {
        let shutdown = shutdown.shared();
        let Server {
            metrics,
            probe,
            exposition,
            ready,
            auth,
            client,
        } = self;
        let probe_ready = ready.clone();
        let on_metrics = move |req: Request<Incoming>| {
            let (exposition, ready, auth, client) = (
                exposition.clone(),
                ready.clone(),
                auth.clone(),
                client.clone(),
            );
            async move { metrics_answer(&req, &exposition, &ready, auth.as_deref(), &client).await }
        };
        let on_probe = move |req: Request<Incoming>| {
            let ready = probe_ready.clone();
            async move { probe_answer(&req, &ready, Controllers::Ignored).unwrap_or_else(not_found) }
        };
        tokio::join!(
            metrics.run(shutdown.clone(), on_metrics),
            probe.run(shutdown, on_probe),
        );
        Ok(())
    }
}

const PLAIN: &str = "text/plain; charset=utf-8";

fn text(
    status: StatusCode,
    body: impl Into<Bytes>,
    content_type: &'static str,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    r
}

fn not_found(_: ()) -> Response<Full<Bytes>> {
    text(
        StatusCode::NOT_FOUND,
        "not found: the probe port serves /healthz, /readyz\n",
        PLAIN,
    )
}

/// Whether `/readyz` waits for the leader's controllers to sync.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Controllers {
    /// The metrics port's, for scripts: ready means everything has synced.
    Awaited,
    /// The probe port's, for the kubelet: ready means admission answers.
    Ignored,
}

/// `/healthz` and `/readyz`, or `Err` for any other path.
fn probe_answer(
    req: &Request<Incoming>,
    ready: &Ready,
    controllers: Controllers,
) -> Result<Response<Full<Bytes>>, ()> {
    if !matches!(req.uri().path(), "/healthz" | "/readyz") {
        return Err(());
    }
    if req.method() != Method::GET {
        return Ok(text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed\n",
            PLAIN,
        ));
    }
    if req.uri().path() == "/healthz" {
        return Ok(text(StatusCode::OK, "ok\n", PLAIN));
    }
    // A Store is ready once its first list has arrived.
    Ok(if *ready.stopping.borrow() {
        text(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting down: admission is still answered until the shutdown delay ends\n",
            PLAIN,
        )
    } else if !matches!(
        ready.backends.wait_until_ready().now_or_never(),
        Some(Ok(()))
    ) {
        text(
            StatusCode::SERVICE_UNAVAILABLE,
            "the Backend cache has not synced yet\n",
            PLAIN,
        )
    } else if controllers == Controllers::Awaited && !ready.controllers.ready() {
        text(
            StatusCode::SERVICE_UNAVAILABLE,
            "leading, and the controllers' caches have not synced yet\n",
            PLAIN,
        )
    } else {
        text(StatusCode::OK, "ok\n", PLAIN)
    })
}

/// The refusal for a request `auth` does not allow to read `access`, or `None` when allowed.
async fn refused(
    req: &Request<Incoming>,
    auth: &Authorizer,
    access: &Access,
) -> Option<Response<Full<Bytes>>> {
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty());
    match auth.check(token, access).await {
        Verdict::Allowed => None,
        Verdict::Unauthenticated => {
            let mut r = text(
                StatusCode::UNAUTHORIZED,
                "unauthorized: send a ServiceAccount token as Authorization: Bearer <token>\n",
                PLAIN,
            );
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            Some(r)
        }
        Verdict::Forbidden(user) => Some(text(
            StatusCode::FORBIDDEN,
            format!("forbidden: {user} may not {}\n", access.what()),
            PLAIN,
        )),
        Verdict::Unavailable(e) => Some(text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("could not check the token with the API server: {e}\n"),
            PLAIN,
        )),
    }
}

/// `/lag/<namespace>/<subscription>`: only under `--metrics-auth`, for a token allowed to get
/// that Subscription.
async fn lag_answer(
    req: &Request<Incoming>,
    auth: Option<&Authorizer>,
    client: &Client,
) -> Response<Full<Bytes>> {
    let Some(auth) = auth else {
        return text(
            StatusCode::NOT_FOUND,
            "not found: /lag is served only with --metrics-auth (metrics.auth: true in the chart), \
             to a token allowed to get the Subscription\n",
            PLAIN,
        );
    };
    let target = match lag::parse(req.uri().path()) {
        Ok(t) => t,
        Err(e) => return text(StatusCode::NOT_FOUND, format!("not found: {e}\n"), PLAIN),
    };
    let access = Access::Subscription {
        namespace: target.namespace.clone(),
        name: target.name.clone(),
    };
    if let Some(refusal) = refused(req, auth, &access).await {
        return refusal;
    }
    match lag::read(client, &target).await {
        Ok(lag) => match serde_json::to_vec(&lag) {
            Ok(body) => text(StatusCode::OK, body, "application/json"),
            Err(e) => text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("could not encode the lag: {e}\n"),
                PLAIN,
            ),
        },
        Err(e @ LagError::NotFound(..)) => text(StatusCode::NOT_FOUND, format!("{e}\n"), PLAIN),
        Err(e @ LagError::Unavailable(..)) => {
            tracing::warn!(error = %e, "could not answer a /lag request");
            text(StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n"), PLAIN)
        }
    }
}

async fn metrics_answer(
    req: &Request<Incoming>,
    exposition: &Exposition,
    ready: &Ready,
    auth: Option<&Authorizer>,
    client: &Client,
) -> Response<Full<Bytes>> {
    if let Ok(probe) = probe_answer(req, ready, Controllers::Awaited) {
        return probe;
    }
    let path = req.uri().path();
    if path != "/metrics" && !path.starts_with(lag::PREFIX) {
        return text(
            StatusCode::NOT_FOUND,
            "not found: the metrics port serves /metrics, /lag/<namespace>/<subscription> (with \
             --metrics-auth), /healthz and /readyz\n",
            PLAIN,
        );
    }
    if req.method() != Method::GET {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed\n",
            PLAIN,
        );
    }
    if path.starts_with(lag::PREFIX) {
        return lag_answer(req, auth, client).await;
    }
    if let Some(auth) = auth
        && let Some(refusal) = refused(req, auth, &Access::Metrics).await
    {
        return refusal;
    }
    match exposition.text() {
        Ok(body) => text(StatusCode::OK, body, "text/plain; version=0.0.4"),
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("could not encode metrics: {e}\n"),
            PLAIN,
        ),
    }
}

/// The limits of a port from its flags (h2 keepalive: the webhook's defaults).
pub fn limits(
    max_connections: usize,
    first_request_timeout: std::time::Duration,
    idle_timeout: std::time::Duration,
) -> Limits {
    Limits {
        max_connections,
        tls_handshake_timeout: first_request_timeout,
        first_request_timeout,
        header_read_timeout: first_request_timeout,
        h2_keepalive_interval: std::time::Duration::from_secs(20),
        h2_keepalive_timeout: std::time::Duration::from_secs(10),
        idle_timeout,
        // A scrape, or a token review on the way (kube's client has its own timeouts).
        request_timeout: super::auth::REVIEW_TIMEOUT + std::time::Duration::from_secs(5),
    }
}
