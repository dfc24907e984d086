//! The validating admission webhook: `POST /validate` (and `GET /healthz`) over HTTPS.
//!
//! [`review`] turns one AdmissionReview body into one answer without a network: it reads the
//! Subscription (and the stored one on UPDATE), looks up the Backend it names through a
//! [`BackendLookup`], and asks the one `policy::validate` for the verdict. [`Server`] serves
//! it over rustls with a certificate from `admission::certs`, with metrics and a log line per
//! decision.
//!
//! This module must not write admission rules (they live in `policy`), must not change
//! anything anywhere (the webhook declares `sideEffects: None`; `dryRun` requests are handled
//! exactly like the others), and must never panic or hang on what a client sends: malformed
//! input gets a 400 or a denial that says why, and a Backend it cannot read fails closed.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use kube::core::admission::{AdmissionResponse, META_API_VERSION_V1, META_KIND};
use kube::core::{Status, TypeMeta};
use kube::runtime::reflector::{ObjectRef, Store};
use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts, Registry};
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::certs::{CertResolver, crypto_provider};
use super::read_subscription;
use crate::api::{Backend, Capabilities, GROUP};
use crate::policy::{BackendView, effective_capabilities, validate};

/// How long a Backend lookup may take before the webhook gives up and denies (fail closed);
/// well inside the API server's 10 s webhook timeout.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(3);
/// `admission.k8s.io/v1beta1`, still accepted and answered in kind.
const META_API_VERSION_V1BETA1: &str = "admission.k8s.io/v1beta1";

// ---------------------------------------------------------------------------------------------
// Finding Backends.

/// Why a Backend could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error("the Backend cache has not synced with the API server yet")]
    NotReady,
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{0}")]
    Other(String),
}

/// Finds a Backend by namespace and name: a reflector store in the operator ([`StoreLookup`]),
/// a map in tests and benchmarks ([`StaticLookup`]).
pub trait BackendLookup: Send + Sync {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Arc<Backend>>, LookupError>>;
}

/// Backends from the operator's reflector store. A miss is confirmed with one GET, so a Backend
/// created a moment before its Subscription (`kubectl apply -f dir/`) is not reported missing
/// just because the watch has not delivered it yet.
#[derive(Clone)]
pub struct StoreLookup {
    store: Store<Backend>,
    client: kube::Client,
    ready_timeout: Duration,
}

impl StoreLookup {
    pub fn new(store: Store<Backend>, client: kube::Client) -> Self {
        StoreLookup {
            store,
            client,
            ready_timeout: Duration::from_secs(2),
        }
    }
}

impl BackendLookup for StoreLookup {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Arc<Backend>>, LookupError>> {
        Box::pin(async move {
            match tokio::time::timeout(self.ready_timeout, self.store.wait_until_ready()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    return Err(LookupError::Other(format!(
                        "the Backend cache is gone: {e}"
                    )));
                }
                Err(_) => return Err(LookupError::NotReady),
            }
            if let Some(found) = self.store.get(&ObjectRef::new(name).within(namespace)) {
                return Ok(Some(found));
            }
            let api: kube::Api<Backend> = kube::Api::namespaced(self.client.clone(), namespace);
            Ok(api.get_opt(name).await?.map(Arc::new))
        })
    }
}

/// Backends from a fixed map, keyed by (namespace, name).
#[derive(Clone, Default)]
pub struct StaticLookup {
    backends: HashMap<(String, String), Arc<Backend>>,
}

impl StaticLookup {
    pub fn new() -> Self {
        StaticLookup::default()
    }

    /// Adds a Backend under its `metadata.namespace` (empty if unset) and `metadata.name`.
    pub fn with(mut self, backend: Backend) -> Self {
        let key = (
            backend.metadata.namespace.clone().unwrap_or_default(),
            backend.metadata.name.clone().unwrap_or_default(),
        );
        self.backends.insert(key, Arc::new(backend));
        self
    }
}

impl BackendLookup for StaticLookup {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Arc<Backend>>, LookupError>> {
        let found = self
            .backends
            .get(&(namespace.to_string(), name.to_string()))
            .cloned();
        Box::pin(async move { Ok(found) })
    }
}

// ---------------------------------------------------------------------------------------------
// One review.

/// The part of an AdmissionReview the webhook reads. `object` and `oldObject` stay raw JSON so
/// that an object that is not a valid Subscription still gets an answer carrying the uid.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReviewIn {
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    kind: String,
    request: Option<RequestIn>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RequestIn {
    uid: String,
    kind: KindIn,
    #[serde(default)]
    sub_resource: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    operation: String,
    #[serde(default)]
    object: Option<serde_json::Value>,
    #[serde(default)]
    old_object: Option<serde_json::Value>,
    #[serde(default)]
    dry_run: Option<bool>,
}

#[derive(Deserialize)]
struct KindIn {
    #[serde(default)]
    group: String,
    #[serde(default)]
    kind: String,
}

/// One answer, and what the metrics and log need to know about it.
struct Answer {
    status: StatusCode,
    body: Vec<u8>,
    operation: String,
    allowed: bool,
}

/// Answers one AdmissionReview body: HTTP 200 with an AdmissionReview response (allowed, or
/// denied with the reason), or HTTP 400 with a plain-text reason when the body is not an
/// AdmissionReview at all. Never panics; takes at most about [`LOOKUP_TIMEOUT`].
pub async fn review(body: &[u8], backends: &dyn BackendLookup) -> (StatusCode, Vec<u8>) {
    let answer = answer(body, backends).await;
    (answer.status, answer.body)
}

async fn answer(body: &[u8], backends: &dyn BackendLookup) -> Answer {
    let bad_request = |reason: String| {
        tracing::warn!(%reason, "refused a request that is not an AdmissionReview");
        Answer {
            status: StatusCode::BAD_REQUEST,
            body: reason.into_bytes(),
            operation: "unknown".into(),
            allowed: false,
        }
    };
    let review: ReviewIn = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return bad_request(format!("the body is not an AdmissionReview: {e}\n")),
    };
    if review.kind != META_KIND {
        return bad_request(format!(
            "the body is not an AdmissionReview: kind is {:?}, expected {META_KIND:?}\n",
            review.kind
        ));
    }
    if review.api_version != META_API_VERSION_V1 && review.api_version != META_API_VERSION_V1BETA1 {
        return bad_request(format!(
            "unsupported AdmissionReview apiVersion {:?}: expected {META_API_VERSION_V1:?}\n",
            review.api_version
        ));
    }
    let Some(request) = review.request else {
        return bad_request("the AdmissionReview has no request\n".into());
    };
    if request.uid.is_empty() {
        return bad_request("the AdmissionReview request has an empty uid\n".into());
    }

    let decision = decide(&request, backends).await;
    let allowed = decision.error.is_none();
    let namespace = request.namespace.as_deref().unwrap_or("");
    let name = request.name.as_deref().unwrap_or("");
    tracing::info!(
        uid = %request.uid,
        object = %format!("{namespace}/{name}"),
        kind = %request.kind.kind,
        operation = %request.operation,
        dry_run = request.dry_run.unwrap_or(false),
        allowed,
        warnings = decision.warnings.len(),
        reason = decision.error.as_ref().map(|s| s.message.as_str()).unwrap_or(""),
        "admission decision"
    );

    let mut response = AdmissionResponse::invalid("");
    response.types = TypeMeta {
        api_version: review.api_version,
        kind: META_KIND.to_string(),
    };
    response.uid = request.uid;
    response.allowed = allowed;
    response.result = decision.error.unwrap_or_default();
    response.warnings = (!decision.warnings.is_empty()).then_some(decision.warnings);
    match serde_json::to_vec(&response.into_review()) {
        Ok(body) => Answer {
            status: StatusCode::OK,
            body,
            operation: request.operation,
            allowed,
        },
        // Cannot happen for these types; still an answer, not a panic.
        Err(e) => Answer {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            body: format!("could not encode the answer: {e}\n").into_bytes(),
            operation: request.operation,
            allowed: false,
        },
    }
}

/// What to answer: `error` is the denial (none: allowed); warnings go out either way.
#[derive(Default)]
struct Decision {
    error: Option<Status>,
    warnings: Vec<String>,
}

impl Decision {
    fn allow() -> Self {
        Decision::default()
    }

    fn deny(code: u16, reason: &str, message: String) -> Self {
        Decision {
            error: Some(Status::failure(&message, reason).with_code(code)),
            warnings: Vec::new(),
        }
    }
}

async fn decide(request: &RequestIn, backends: &dyn BackendLookup) -> Decision {
    // Backends (and anything else) are checked by the API server's CEL rules; status and other
    // subresources carry no spec change to judge, and must never be blocked by a spec that got
    // in while the webhook was down.
    if request.kind.group != GROUP
        || request.kind.kind != "Subscription"
        || request
            .sub_resource
            .as_deref()
            .is_some_and(|s| !s.is_empty())
    {
        return Decision::allow();
    }
    let update = match request.operation.as_str() {
        "CREATE" => false,
        "UPDATE" => true,
        "DELETE" | "CONNECT" => return Decision::allow(),
        other => {
            return Decision::deny(
                400,
                "BadRequest",
                format!("unknown admission operation {other:?}"),
            );
        }
    };

    let Some(object) = &request.object else {
        return Decision::deny(
            400,
            "BadRequest",
            "the admission request carries no object to validate".into(),
        );
    };
    let new = match read_subscription(object) {
        Ok(s) => s,
        Err(why) => {
            return Decision::deny(
                400,
                "BadRequest",
                format!("the Subscription could not be read: {why}"),
            );
        }
    };
    let old = if update {
        match request.old_object.as_ref().map(read_subscription) {
            Some(Ok(old)) => Some(old),
            Some(Err(why)) => {
                return Decision::deny(
                    400,
                    "BadRequest",
                    format!(
                        "the stored Subscription could not be read ({why}): delete it and create it again"
                    ),
                );
            }
            None => {
                return Decision::deny(
                    400,
                    "BadRequest",
                    "the UPDATE request carries no oldObject to compare with".into(),
                );
            }
        }
    } else {
        None
    };

    let Some(namespace) = request
        .namespace
        .as_deref()
        .or(new.metadata.namespace.as_deref())
        .filter(|n| !n.is_empty())
    else {
        return Decision::deny(
            400,
            "BadRequest",
            "the admission request names no namespace".into(),
        );
    };
    let backend_name = new.spec.backend_ref.name.as_str();
    let found =
        match tokio::time::timeout(LOOKUP_TIMEOUT, backends.get(namespace, backend_name)).await {
            Ok(Ok(found)) => found,
            Ok(Err(e)) => return lookup_failed(namespace, backend_name, &e),
            Err(_) => {
                return lookup_failed(
                    namespace,
                    backend_name,
                    &LookupError::Timeout(LOOKUP_TIMEOUT),
                );
            }
        };

    let capabilities: Option<Capabilities> = match &found {
        None => None,
        Some(backend) => match effective_capabilities(backend) {
            Some(caps) => Some(caps),
            None => {
                return Decision::deny(
                    422,
                    "Invalid",
                    format!(
                        "spec.backendRef.name: Backend {namespace}/{backend_name} names no single backend kind, so \
                         what it can honour is unknown: fix the Backend (set exactly one of nats, memory)"
                    ),
                );
            }
        },
    };
    let view = match &capabilities {
        Some(capabilities) => BackendView::Known {
            name: backend_name,
            capabilities,
        },
        None => BackendView::Missing { name: backend_name },
    };

    let verdict = validate(&new.spec, old.as_ref().map(|o| &o.spec), view);
    let warnings = verdict.warnings.iter().map(ToString::to_string).collect();
    if verdict.allowed() {
        Decision {
            error: None,
            warnings,
        }
    } else {
        let mut d = Decision::deny(422, "Invalid", verdict.error_text());
        d.warnings = warnings;
        d
    }
}

fn lookup_failed(namespace: &str, name: &str, e: &LookupError) -> Decision {
    tracing::warn!(backend = %format!("{namespace}/{name}"), error = %e, "admission could not read a Backend; denying");
    Decision::deny(
        503,
        "ServiceUnavailable",
        format!(
            "the Settle admission webhook could not read Backend {namespace}/{name} ({e}), so it cannot tell whether \
             the backend can honour this Subscription: retry in a moment"
        ),
    )
}

// ---------------------------------------------------------------------------------------------
// Metrics.

/// `settle_admission_requests_total{operation,allowed}` and `settle_admission_duration_seconds`.
#[derive(Clone)]
pub struct WebhookMetrics {
    requests: IntCounterVec,
    duration: Histogram,
}

impl WebhookMetrics {
    /// Makes the metrics and registers them in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                "settle_admission_requests_total",
                "Admission reviews answered, by operation and whether allowed.",
            ),
            &["operation", "allowed"],
        )?;
        let duration = Histogram::with_opts(
            HistogramOpts::new(
                "settle_admission_duration_seconds",
                "Time to answer one admission review, body read to answer.",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0,
            ]),
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        Ok(WebhookMetrics { requests, duration })
    }

    fn observe(&self, answer: &Answer, elapsed: Duration) {
        let operation = match answer.operation.as_str() {
            op @ ("CREATE" | "UPDATE" | "DELETE" | "CONNECT") => op,
            _ => "unknown",
        };
        self.requests
            .with_label_values(&[operation, if answer.allowed { "true" } else { "false" }])
            .inc();
        self.duration.observe(elapsed.as_secs_f64());
    }
}

// ---------------------------------------------------------------------------------------------
// The HTTPS server.

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

/// Binds and serves until `shutdown`: what `settle operator` calls.
pub async fn serve(
    config: WebhookConfig,
    backends: Arc<dyn BackendLookup>,
    certs: Arc<CertResolver>,
    registry: &Registry,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), WebhookError> {
    Server::bind(config, backends, certs, registry)
        .await?
        .run(shutdown)
        .await
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
            let answer = answer(&body, shared.backends.as_ref()).await;
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
