//! The HTTPS server: [`Server`] binds, terminates TLS with a certificate from `admission::certs`,
//! serves `POST /validate`, `POST /mutate` and `GET /healthz` over HTTP/1.1 and HTTP/2, and stops
//! gracefully (while draining, each HTTP/1.1 answer closes its connection: [`Server::draining_from`]).
//!
//! What a client can hold, and for how long, is bounded: at most `max_connections` connections
//! are open (a connection beyond is closed as soon as it is accepted, and counted), each phase of
//! a connection has a deadline (both `crate::serve`'s, shared with the metrics port), a body is
//! at most `max_body_bytes`, and at most `max_concurrent_reviews` bodies are read and parsed at
//! once, so a burst of big reviews costs about `max_concurrent_reviews × max_body_bytes` and no
//! more.
//!
//! This file must not decide admission (it hands each body to `review`, or to `mutate`) and
//! must never let a client hang it: every wait has a deadline and every body a size limit.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use prometheus::Registry;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, SemaphorePermit, watch};
use tokio_rustls::TlsAcceptor;

use super::LOOKUP_TIMEOUT;
use super::lookup::BackendLookup;
use super::metrics::{Counted, Rejected, WebhookMetrics};
use super::{mutate, review};
use crate::admission::certs::{CertResolver, crypto_provider};
use crate::serve;

/// The largest AdmissionReview body accepted by default: 7 MiB.
///
/// The API server refuses any request body over 3 MiB (`MaxRequestBodyBytes` in
/// k8s.io/apiserver/pkg/server/config.go: twice etcd's default 1.5 MiB request limit, as JSON
/// may be larger than the protobuf etcd stores), so an object it sends for review is about
/// 3 MiB at most. An UPDATE review carries two (the new object and the stored one), and the
/// envelope (userInfo, options) adds a little: 2 × 3 MiB + 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 7 << 20;

/// How the webhook server listens, and how much any client may hold and for how long. The
/// defaults are those of `settle operator`'s flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WebhookConfig {
    /// Where to listen, e.g. `0.0.0.0:8443` (`127.0.0.1:0` in tests).
    pub addr: SocketAddr,
    /// The largest request body accepted (default [`DEFAULT_MAX_BODY_BYTES`]).
    pub max_body_bytes: usize,
    /// How many request bodies are read and parsed at once (default 4); the others wait their
    /// turn, within `body_timeout`.
    pub max_concurrent_reviews: usize,
    /// How many connections may be open at once (default 512); a connection beyond is closed
    /// as soon as it is accepted.
    pub max_connections: usize,
    /// The TLS handshake (default 5 s).
    pub tls_handshake_timeout: Duration,
    /// From the end of the TLS handshake to the first request's headers: protocol detection,
    /// the HTTP/2 preface and SETTINGS, HTTP/1.1 headers (default 5 s).
    pub first_request_timeout: Duration,
    /// Each later HTTP/1.1 request's headers (default 5 s).
    pub header_read_timeout: Duration,
    /// Waiting for a turn to read a body, and reading it (default 5 s).
    pub body_timeout: Duration,
    /// An HTTP/2 connection that sent nothing for this long is pinged (default 20 s) ...
    pub h2_keepalive_interval: Duration,
    /// ... and closed if the ping is not answered within this (default 10 s).
    pub h2_keepalive_timeout: Duration,
    /// A connection with no request in flight for this long is closed, HTTP/2 with a GOAWAY
    /// first (default 60 s).
    pub idle_timeout: Duration,
    /// What Backends may name (broker hosts, SQS pod identity); default: any host, pod
    /// identity nowhere.
    pub backend_rules: settle::policy::BackendRules,
}

impl WebhookConfig {
    /// What one connection may hold, and for how long.
    pub fn limits(&self) -> serve::Limits {
        serve::Limits {
            max_connections: self.max_connections,
            tls_handshake_timeout: self.tls_handshake_timeout,
            first_request_timeout: self.first_request_timeout,
            header_read_timeout: self.header_read_timeout,
            h2_keepalive_interval: self.h2_keepalive_interval,
            h2_keepalive_timeout: self.h2_keepalive_timeout,
            idle_timeout: self.idle_timeout,
            request_timeout: self.body_timeout + LOOKUP_TIMEOUT,
        }
    }

    /// The defaults, listening on `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        WebhookConfig {
            addr,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_concurrent_reviews: 4,
            max_connections: 512,
            tls_handshake_timeout: Duration::from_secs(5),
            first_request_timeout: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(5),
            h2_keepalive_interval: Duration::from_secs(20),
            h2_keepalive_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            backend_rules: settle::policy::BackendRules::default(),
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

/// What every review is answered with: the Backends to judge against, the metrics, the limits,
/// and the turns to read a body.
struct Reviewer {
    backends: Arc<dyn BackendLookup>,
    metrics: WebhookMetrics,
    config: WebhookConfig,
    /// Turns to read and parse a body.
    reading: Semaphore,
}

/// A bound webhook server: [`Server::local_addr`] tells the port (useful with port 0), and
/// [`Server::run`] serves until shutdown.
pub struct Server {
    listener: TcpListener,
    acceptor: TlsAcceptor,
    reviewer: Arc<Reviewer>,
    draining: Option<watch::Receiver<bool>>,
}

impl Server {
    /// Binds `config.addr`, sets up TLS from `certs` (swapped in place on rotation) and registers
    /// the metrics in `registry`.
    pub async fn bind(
        mut config: WebhookConfig,
        backends: Arc<dyn BackendLookup>,
        certs: Arc<CertResolver>,
        registry: &Registry,
    ) -> Result<Self, WebhookError> {
        config.max_concurrent_reviews = config.max_concurrent_reviews.max(1);
        config.max_connections = config.max_connections.max(1);
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
            reviewer: Arc::new(Reviewer {
                backends,
                metrics,
                reading: Semaphore::new(config.max_concurrent_reviews),
                config,
            }),
            draining: None,
        })
    }

    /// From when `draining` turns true (the operator's SIGTERM, the start of its shutdown
    /// delay) until the server stops, every HTTP/1.1 answer says `Connection: close` and its
    /// connection is closed after it. The API server calls webhooks over HTTP/1.1 and keeps
    /// connections alive; one the server closes idle at its stop can be picked for a review at
    /// that moment, which then fails (`write: broken pipe`) and, the call being a POST, is not
    /// retried: the apply is refused. Closed after an answer, a connection is never reused, so
    /// by the stop few idle ones are left to race.
    pub fn draining_from(mut self, draining: watch::Receiver<bool>) -> Self {
        self.draining = Some(draining);
        self
    }

    pub fn local_addr(&self) -> Result<SocketAddr, WebhookError> {
        Ok(self.listener.local_addr()?)
    }

    /// Serves until `shutdown` completes, then stops accepting and lets answers in flight finish
    /// (for at most `body_timeout` plus [`LOOKUP_TIMEOUT`]).
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), WebhookError> {
        let Server {
            listener,
            acceptor,
            reviewer,
            draining,
        } = self;
        let config = reviewer.config.clone();
        tracing::info!(
            addr = %listener.local_addr()?,
            max_connections = config.max_connections,
            max_concurrent_reviews = config.max_concurrent_reviews,
            max_body_bytes = config.max_body_bytes,
            "admission webhook listening"
        );
        let server = serve::Bounded {
            listener,
            tls: Some(acceptor),
            limits: config.limits(),
            metrics: reviewer.metrics.connections.clone(),
            what: "admission webhook",
            cap_flag: "--webhook-max-connections",
        };
        server
            .run(shutdown, move |req| {
                let reviewer = reviewer.clone();
                let close = req.version() == http::Version::HTTP_11
                    && draining.as_ref().is_some_and(|d| *d.borrow());
                async move {
                    let mut response = handle(&reviewer, req).await;
                    if close {
                        response.headers_mut().insert(
                            header::CONNECTION,
                            header::HeaderValue::from_static("close"),
                        );
                    }
                    response
                }
            })
            .await;
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

async fn handle(reviewer: &Reviewer, req: Request<Incoming>) -> Response<Full<Bytes>> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => plain(StatusCode::OK, "ok\n"),
        (&Method::POST, "/validate") => answer_review(reviewer, req, Hook::Validate).await,
        (&Method::POST, "/mutate") => answer_review(reviewer, req, Hook::Mutate).await,
        (_, "/validate" | "/mutate" | "/healthz") => {
            plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n")
        }
        _ => plain(
            StatusCode::NOT_FOUND,
            "not found: the admission webhook serves POST /validate, POST /mutate and GET /healthz\n",
        ),
    }
}

/// Which webhook a review was sent to.
#[derive(Clone, Copy)]
enum Hook {
    /// `POST /validate`: judged by the rules.
    Validate,
    /// `POST /mutate`: the finalizer put on, nothing judged.
    Mutate,
}

/// `POST /validate` and `POST /mutate`: wait for a turn, read and parse the body, give the turn
/// back, then decide (the Backend lookup may wait on the API server; it holds no body).
async fn answer_review(
    reviewer: &Reviewer,
    req: Request<Incoming>,
    hook: Hook,
) -> Response<Full<Bytes>> {
    let started = Instant::now();
    let deadline = tokio::time::Instant::from_std(started) + reviewer.config.body_timeout;
    let read = match read_in_turn(reviewer, req, deadline).await {
        Ok(read) => read,
        Err(rejected) => return rejected,
    };
    let answer = match hook {
        Hook::Mutate => answer_mutate(reviewer, read),
        Hook::Validate => answer_validate(reviewer, read, started).await,
    };
    respond(answer)
}

/// A body read, with the turn it was read in and the gauge counting it, both held until it is
/// parsed.
struct InTurn<'a> {
    body: Vec<u8>,
    turn: SemaphorePermit<'a>,
    reading: Counted,
}

/// Refuses a body that says it is too large, waits for a turn and reads the body, all by
/// `deadline`; or the rejection to answer.
async fn read_in_turn<'a>(
    reviewer: &'a Reviewer,
    req: Request<Incoming>,
    deadline: tokio::time::Instant,
) -> Result<InTurn<'a>, Response<Full<Bytes>>> {
    let config = &reviewer.config;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > config.max_body_bytes as u64) {
        return Err(too_large(reviewer));
    }
    let turn = wait_for_turn(reviewer, deadline).await?;
    let reading = reviewer.metrics.reading();
    let capacity = declared.map_or(0, |n| n as usize);
    let body = read_by(reviewer, req.into_body(), capacity, deadline).await?;
    Ok(InTurn {
        body,
        turn,
        reading,
    })
}

/// Waits for a turn to read a body until `deadline`, counted as waiting; or the 503 to answer.
async fn wait_for_turn(
    reviewer: &Reviewer,
    deadline: tokio::time::Instant,
) -> Result<SemaphorePermit<'_>, Response<Full<Bytes>>> {
    let config = &reviewer.config;
    let waiting = reviewer.metrics.waiting();
    let turn = tokio::time::timeout_at(deadline, reviewer.reading.acquire()).await;
    drop(waiting);
    let Ok(Ok(turn)) = turn else {
        return Err(reject(
            reviewer,
            Rejected::Busy,
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the admission webhook is busy: {} reviews were being read for {:?}; retry in a moment\n",
                config.max_concurrent_reviews, config.body_timeout
            ),
        ));
    };
    Ok(turn)
}

/// Reads the body until `deadline`; or the rejection to answer (too large, unreadable, slow).
async fn read_by(
    reviewer: &Reviewer,
    body: Incoming,
    capacity: usize,
    deadline: tokio::time::Instant,
) -> Result<Vec<u8>, Response<Full<Bytes>>> {
    let config = &reviewer.config;
    match tokio::time::timeout_at(deadline, read_body(body, config.max_body_bytes, capacity)).await
    {
        Ok(Ok(body)) => Ok(body),
        Ok(Err(BodyError::TooLarge)) => Err(too_large(reviewer)),
        Ok(Err(BodyError::Read(e))) => Err(reject(
            reviewer,
            Rejected::UnreadableBody,
            StatusCode::BAD_REQUEST,
            format!("could not read the body: {e}\n"),
        )),
        Err(_) => Err(reject(
            reviewer,
            Rejected::SlowBody,
            StatusCode::REQUEST_TIMEOUT,
            "the body did not arrive in time\n".to_string(),
        )),
    }
}

/// The 413 for a body over `max_body_bytes`, declared or read.
fn too_large(reviewer: &Reviewer) -> Response<Full<Bytes>> {
    reject(
        reviewer,
        Rejected::TooLarge,
        StatusCode::PAYLOAD_TOO_LARGE,
        format!(
            "the body is larger than {} bytes\n",
            reviewer.config.max_body_bytes
        ),
    )
}

/// A request refused before it is reviewed: counted, logged at WARN, answered in plain text.
fn reject(
    reviewer: &Reviewer,
    why: Rejected,
    status: StatusCode,
    text: String,
) -> Response<Full<Bytes>> {
    reviewer.metrics.request_rejected(why);
    tracing::warn!(
        reason = why.label(),
        status = status.as_u16(),
        "{}",
        text.trim_end()
    );
    plain(status, text)
}

/// `POST /mutate`: the patch, from the body alone; the turn is given back before it is counted.
fn answer_mutate(reviewer: &Reviewer, read: InTurn<'_>) -> review::Answer {
    let InTurn {
        body,
        turn,
        reading,
    } = read;
    let (answer, patched) = mutate::mutate(&body);
    drop(body);
    drop((reading, turn));
    reviewer.metrics.mutated(&answer, patched);
    answer
}

/// `POST /validate`: the body parsed, the turn given back, then the verdict (which may wait on
/// a Backend lookup), observed from `started`.
async fn answer_validate(
    reviewer: &Reviewer,
    read: InTurn<'_>,
    started: Instant,
) -> review::Answer {
    let InTurn {
        body,
        turn,
        reading,
    } = read;
    let read = review::read(&body);
    drop(body);
    drop((reading, turn));
    let answer = match read {
        Ok(review) => {
            review::answer(
                review,
                reviewer.backends.as_ref(),
                &reviewer.config.backend_rules,
            )
            .await
        }
        Err(bad_request) => bad_request,
    };
    reviewer.metrics.observe(&answer, started.elapsed());
    answer
}

/// The HTTP response for an answer: JSON when it is an AdmissionReview (200), plain text
/// otherwise.
fn respond(answer: review::Answer) -> Response<Full<Bytes>> {
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

enum BodyError {
    TooLarge,
    Read(Box<dyn std::error::Error + Send + Sync>),
}

/// Reads a whole body into one buffer, sized up front from Content-Length when the client sent
/// one (so a big body is not copied while it grows).
async fn read_body(body: Incoming, limit: usize, capacity: usize) -> Result<Vec<u8>, BodyError> {
    let mut body = Limited::new(body, limit);
    let mut buf = Vec::with_capacity(capacity.min(limit));
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                BodyError::TooLarge
            } else {
                BodyError::Read(e)
            }
        })?;
        if let Some(data) = frame.data_ref() {
            buf.extend_from_slice(data);
        }
    }
    Ok(buf)
}
