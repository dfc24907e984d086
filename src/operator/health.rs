//! The operator's plain-HTTP endpoint: `/metrics` (Prometheus text, every `settle_*` metric),
//! `/healthz` (the process answers) and `/readyz` (the Backend cache has synced, so admission
//! answers with real capabilities; and, on the leader, the controllers' caches have synced).
//!
//! It must not serve anything that changes state.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;

use bytes::Bytes;
use futures::FutureExt;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use kube::runtime::reflector::Store;
use prometheus::{Encoder, Registry, TextEncoder};
use tokio::net::TcpListener;

use crate::api::Backend;
use crate::reconcile::Readiness;

#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    #[error("could not listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
}

pub struct Server {
    listener: TcpListener,
    registry: Registry,
    backends: Store<Backend>,
    controllers: Readiness,
}

impl Server {
    pub async fn bind(
        addr: SocketAddr,
        registry: Registry,
        backends: Store<Backend>,
        controllers: Readiness,
    ) -> Result<Self, HealthError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| HealthError::Bind { addr, source })?;
        tracing::info!(addr = %listener.local_addr().unwrap_or(addr), "metrics and health listening");
        Ok(Server {
            listener,
            registry,
            backends,
            controllers,
        })
    }

    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), HealthError> {
        tokio::pin!(shutdown);
        loop {
            let (tcp, _) = tokio::select! {
                () = &mut shutdown => return Ok(()),
                accepted = self.listener.accept() => match accepted {
                    Ok(conn) => conn,
                    Err(e) => {
                        tracing::warn!(error = %e, "metrics accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let registry = self.registry.clone();
            let backends = self.backends.clone();
            let controllers = self.controllers.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let response = answer(&req, &registry, &backends, &controllers);
                    async move { Ok::<_, Infallible>(response) }
                });
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
            });
        }
    }
}

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

fn answer(
    req: &Request<Incoming>,
    registry: &Registry,
    backends: &Store<Backend>,
    controllers: &Readiness,
) -> Response<Full<Bytes>> {
    const PLAIN: &str = "text/plain; charset=utf-8";
    if req.method() != Method::GET {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed\n",
            PLAIN,
        );
    }
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n", PLAIN),
        "/readyz" => {
            // A Store is ready once its first list has arrived.
            if !matches!(backends.wait_until_ready().now_or_never(), Some(Ok(()))) {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the Backend cache has not synced yet\n",
                    PLAIN,
                )
            } else if !controllers.ready() {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "leading, and the controllers' caches have not synced yet\n",
                    PLAIN,
                )
            } else {
                text(StatusCode::OK, "ok\n", PLAIN)
            }
        }
        "/metrics" => {
            let mut buf = Vec::new();
            match TextEncoder::new().encode(&registry.gather(), &mut buf) {
                Ok(()) => text(StatusCode::OK, buf, "text/plain; version=0.0.4"),
                Err(e) => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("could not encode metrics: {e}\n"),
                    PLAIN,
                ),
            }
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: /metrics, /healthz, /readyz\n",
            PLAIN,
        ),
    }
}
