//! The HTTPS server: [`Server`] binds, terminates TLS with a certificate from `admission::certs`,
//! serves `POST /validate` and `GET /healthz` over HTTP/1.1 and HTTP/2, and stops gracefully.
//!
//! This file must not decide admission (it hands each body to `review`) and must never let a
//! client hang it: every read has a deadline and every body a size limit.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use prometheus::Registry;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::LOOKUP_TIMEOUT;
use super::lookup::BackendLookup;
use super::metrics::WebhookMetrics;
use super::review;
use crate::admission::certs::{CertResolver, crypto_provider};

/// How the webhook server listens.
#[derive(Clone, Debug)]
pub struct WebhookConfig {
    /// Where to listen, e.g. `0.0.0.0:8443` (`127.0.0.1:0` in tests).
    pub addr: SocketAddr,
    /// The largest request body accepted (default 8 MiB: an object and its old version).
    pub max_body_bytes: usize,
    /// How long a client may take to finish the TLS handshake or send its request (default 5 s).
    pub client_timeout: Duration,
}

impl WebhookConfig {
    pub fn new(addr: SocketAddr) -> Self {
        WebhookConfig {
            addr,
            max_body_bytes: 8 << 20,
            client_timeout: Duration::from_secs(5),
        }
    }
}

/// Why the webhook server could not run.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("could not listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("could not set up TLS: {0}")]
    Tls(#[from] rustls::Error),
    #[error("could not register the webhook metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("the listener failed: {0}")]
    Io(#[from] std::io::Error),
}

struct Shared {
    backends: Arc<dyn BackendLookup>,
    metrics: WebhookMetrics,
    config: WebhookConfig,
}

/// A bound webhook server: [`Server::local_addr`] tells the port (useful with port 0), and
/// [`Server::run`] serves until shutdown.
pub struct Server {
    listener: TcpListener,
    acceptor: TlsAcceptor,
    shared: Arc<Shared>,
}

impl Server {
    /// Binds `config.addr`, sets up TLS from `certs` (swapped in place on rotation) and registers
    /// the metrics in `registry`.
    pub async fn bind(
        config: WebhookConfig,
        backends: Arc<dyn BackendLookup>,
        certs: Arc<CertResolver>,
        registry: &Registry,
    ) -> Result<Self, WebhookError> {
        let mut tls = rustls::ServerConfig::builder_with_provider(crypto_provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(certs);
        tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let listener =
            TcpListener::bind(config.addr)
                .await
                .map_err(|source| WebhookError::Bind {
                    addr: config.addr,
                    source,
                })?;
        let metrics = WebhookMetrics::register(registry)?;
        Ok(Server {
            listener,
            acceptor: TlsAcceptor::from(Arc::new(tls)),
            shared: Arc::new(Shared {
                backends,
                metrics,
                config,
            }),
        })
    }

    pub fn local_addr(&self) -> Result<SocketAddr, WebhookError> {
        Ok(self.listener.local_addr()?)
    }

    /// Serves until `shutdown` completes, then stops accepting and lets answers in flight finish
    /// (for at most `client_timeout` plus [`LOOKUP_TIMEOUT`]).
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), WebhookError> {
        let Server {
            listener,
            acceptor,
            shared,
        } = self;
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(shared.config.client_timeout);
        builder.http2().timer(TokioTimer::new());
        let builder = Arc::new(builder);
        tracing::info!(addr = %listener.local_addr()?, "admission webhook listening");

        tokio::pin!(shutdown);
        loop {
            let (tcp, peer) = tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok(conn) => conn,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            let shared = shared.clone();
            let builder = builder.clone();
            let watcher = graceful.watcher();
            tokio::spawn(async move {
                let tls =
                    match tokio::time::timeout(shared.config.client_timeout, acceptor.accept(tcp))
                        .await
                    {
                        Ok(Ok(tls)) => tls,
                        Ok(Err(e)) => {
                            return tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        }
                        Err(_) => return tracing::debug!(%peer, "TLS handshake timed out"),
                    };
                let service = hyper::service::service_fn(move |req| {
                    let shared = shared.clone();
                    async move { Ok::<_, Infallible>(handle(&shared, req).await) }
                });
                let conn = builder.serve_connection(TokioIo::new(tls), service);
                if let Err(e) = watcher.watch(conn.into_owned()).await {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
            });
        }
        drop(listener);
        let grace = shared.config.client_timeout + LOOKUP_TIMEOUT;
        if tokio::time::timeout(grace, graceful.shutdown())
            .await
            .is_err()
        {
            tracing::warn!("admission webhook stopped with connections still open");
        }
        tracing::info!("admission webhook stopped");
        Ok(())
    }
}

fn plain(status: StatusCode, text: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(text.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

async fn handle(shared: &Shared, req: Request<Incoming>) -> Response<Full<Bytes>> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => plain(StatusCode::OK, "ok\n"),
        (&Method::POST, "/validate") => {
            let started = Instant::now();
            let limited = Limited::new(req.into_body(), shared.config.max_body_bytes);
            let body =
                match tokio::time::timeout(shared.config.client_timeout, limited.collect()).await {
                    Ok(Ok(collected)) => collected.to_bytes(),
                    Ok(Err(e)) => {
                        return if e
                            .downcast_ref::<http_body_util::LengthLimitError>()
                            .is_some()
                        {
                            plain(
                                StatusCode::PAYLOAD_TOO_LARGE,
                                format!(
                                    "the body is larger than {} bytes\n",
                                    shared.config.max_body_bytes
                                ),
                            )
                        } else {
                            plain(
                                StatusCode::BAD_REQUEST,
                                format!("could not read the body: {e}\n"),
                            )
                        };
                    }
                    Err(_) => {
                        return plain(
                            StatusCode::REQUEST_TIMEOUT,
                            "the body did not arrive in time\n",
                        );
                    }
                };
            let read = review::read(&body);
            drop(body);
            let answer = match read {
                Ok(review) => review::answer(review, shared.backends.as_ref()).await,
                Err(bad_request) => bad_request,
            };
            shared.metrics.observe(&answer, started.elapsed());
            let content_type = if answer.status == StatusCode::OK {
                "application/json"
            } else {
                "text/plain; charset=utf-8"
            };
            let mut response = Response::new(Full::new(Bytes::from(answer.body)));
            *response.status_mut() = answer.status;
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static(content_type),
            );
            response
        }
        (_, "/validate" | "/healthz") => {
            plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n")
        }
        _ => plain(
            StatusCode::NOT_FOUND,
            "not found: the admission webhook serves POST /validate and GET /healthz\n",
        ),
    }
}
