//! One client connection from accept to close, with a deadline on every phase:
//!
//! | phase | deadline |
//! |---|---|
//! | TLS handshake (a server with TLS) | `tls_handshake_timeout` |
//! | first bytes to the first request's headers (protocol detection, the HTTP/2 preface and SETTINGS, HTTP/1.1 headers) | `first_request_timeout` |
//! | each later HTTP/1.1 request's headers | `header_read_timeout` (hyper) |
//! | an HTTP/2 peer that stops answering pings | `h2_keepalive_interval` + `h2_keepalive_timeout` (hyper) |
//! | no request in flight (HTTP/1.1 keep-alive or HTTP/2) | `idle_timeout`, then a graceful close (HTTP/2: GOAWAY) |
//! | a graceful close the peer does not finish | [`CLOSE_GRACE`], or the time a request in flight may still take |
//!
//! Request bodies are the handler's (the webhook's `server` gives them their own deadline). This
//! file must not read bodies or decide anything: it runs hyper on the connection and ends it when
//! a deadline passes, reporting why.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http::{Request, Response};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use super::Limits;

/// How long a connection closed gracefully for being idle may take to finish the close (the
/// HTTP/2 GOAWAY and PING round trip) before it is dropped.
pub const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Why a connection ended; the label of `settle_<server>_connections_closed_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closed {
    /// The client closed it, or it ended after a graceful close the client finished.
    Client,
    /// An HTTP error: bad framing, an HTTP/1.1 header read timeout, an HTTP/2 ping unanswered.
    Error,
    TlsHandshakeFailed,
    TlsHandshakeTimeout,
    FirstRequestTimeout,
    IdleTimeout,
    Shutdown,
}

impl Closed {
    pub const ALL: [Closed; 7] = [
        Closed::Client,
        Closed::Error,
        Closed::TlsHandshakeFailed,
        Closed::TlsHandshakeTimeout,
        Closed::FirstRequestTimeout,
        Closed::IdleTimeout,
        Closed::Shutdown,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Closed::Client => "client",
            Closed::Error => "error",
            Closed::TlsHandshakeFailed => "tls_handshake_failed",
            Closed::TlsHandshakeTimeout => "tls_handshake_timeout",
            Closed::FirstRequestTimeout => "first_request_timeout",
            Closed::IdleTimeout => "idle_timeout",
            Closed::Shutdown => "shutdown",
        }
    }
}

/// HTTP/2: how many requests may be open on one connection ... Go's HTTP/2 client (the API
/// server's, and load generators such as vegeta) dials a new connection (a TLS handshake) when
/// one has this many in flight, and sends up to 100 on a new connection before the server's
/// SETTINGS reach it: the surplus over a lower limit is refused (REFUSED_STREAM), and Go retries
/// a request refused a second time only after a 1 s backoff (net/http's h2_bundle.go,
/// `RoundTripOpt`). With 16, vegeta at 5,000 reviews/s on a loaded machine opened connection
/// after connection and got 780–1,760 answers/s; with 128, 2,500–4,300/s (README, Benchmarks).
const H2_MAX_STREAMS: u32 = 128;
/// ... and how much of each body may be in flight before the server reads it. The connection's
/// window holds a full window for every stream (128 × 16 KiB: 2 MiB), so bodies waiting for
/// their turn to be read can never fill it and starve the one being read. A review of the usual
/// few KiB fits in one window; a 3 MiB one takes more window updates.
const H2_STREAM_WINDOW: u32 = 16 << 10;

/// The HTTP/1.1 and HTTP/2 settings every connection is served with.
pub fn http_builder(config: &Limits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(config.h2_keepalive_interval)
        .keep_alive_timeout(config.h2_keepalive_timeout)
        .max_concurrent_streams(H2_MAX_STREAMS)
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_MAX_STREAMS * H2_STREAM_WINDOW);
    builder
}

/// What requests a connection has seen: the deadlines follow from it.
#[derive(Clone, Default)]
struct Activity(Arc<Mutex<Counts>>);

#[derive(Default)]
struct Counts {
    begun: u64,
    in_flight: usize,
    last_end: Option<Instant>,
}

/// One request in flight; ends when dropped (answered, or abandoned by the client).
struct InFlight(Activity);

impl Activity {
    fn counts(&self) -> MutexGuard<'_, Counts> {
        // Nothing panics while holding it; a poisoned count is still the best count there is.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn begin(&self) -> InFlight {
        let mut c = self.counts();
        c.begun += 1;
        c.in_flight += 1;
        InFlight(self.clone())
    }

    fn in_flight(&self) -> usize {
        self.counts().in_flight
    }

    /// When the connection is next due a look, and why it would close then (`None`: a request
    /// is in flight; look again later).
    fn next_deadline(&self, served_since: Instant, config: &Limits) -> (Instant, Option<Closed>) {
        let c = self.counts();
        if c.begun == 0 {
            (
                served_since + config.first_request_timeout,
                Some(Closed::FirstRequestTimeout),
            )
        } else if c.in_flight > 0 {
            (Instant::now() + config.idle_timeout, None)
        } else {
            let since = c.last_end.unwrap_or(served_since);
            (since + config.idle_timeout, Some(Closed::IdleTimeout))
        }
    }

    /// Why the connection should close now, if a deadline has passed.
    fn due(&self, served_since: Instant, config: &Limits) -> Option<Closed> {
        let (deadline, why) = self.next_deadline(served_since, config);
        why.filter(|_| deadline <= Instant::now())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut c = self.0.counts();
        c.in_flight = c.in_flight.saturating_sub(1);
        c.last_end = Some(Instant::now());
    }
}

/// Serves one accepted connection (over TLS when `acceptor` is given) until it ends, and says why
/// it ended. `stop` turns true when the server shuts down: the connection is then closed
/// gracefully, letting requests in flight finish.
pub(super) async fn serve<H, F>(
    tcp: TcpStream,
    peer: SocketAddr,
    acceptor: Option<TlsAcceptor>,
    builder: Arc<auto::Builder<TokioExecutor>>,
    config: Limits,
    stop: watch::Receiver<bool>,
    handle: H,
) -> Closed
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let Some(acceptor) = acceptor else {
        return serve_http(TokioIo::new(tcp), peer, builder, config, stop, handle).await;
    };
    let tls = match tokio::time::timeout(config.tls_handshake_timeout, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            tracing::debug!(%peer, error = %e, "TLS handshake failed");
            return Closed::TlsHandshakeFailed;
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake timed out");
            return Closed::TlsHandshakeTimeout;
        }
    };
    serve_http(TokioIo::new(tls), peer, builder, config, stop, handle).await
}

/// HTTP on a connection (after TLS, if any), with the deadlines of the table above.
async fn serve_http<I, H, F>(
    io: TokioIo<I>,
    peer: SocketAddr,
    builder: Arc<auto::Builder<TokioExecutor>>,
    config: Limits,
    mut stop: watch::Receiver<bool>,
    handle: H,
) -> Closed
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let served_since = Instant::now();
    let activity = Activity::default();
    let service = {
        let activity = activity.clone();
        hyper::service::service_fn(move |req| {
            let in_flight = activity.begin();
            let answer = handle(req);
            async move {
                let response = answer.await;
                drop(in_flight);
                Ok::<_, Infallible>(response)
            }
        })
    };
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);

    // Set once the connection is being closed: why, and when it is dropped at the latest.
    let mut closing: Option<(Closed, Instant)> = None;
    loop {
        let wake = match closing {
            Some((_, drop_at)) => drop_at,
            None => activity.next_deadline(served_since, &config).0,
        };
        tokio::select! {
            ended = conn.as_mut() => {
                return match (closing, ended) {
                    (Some((why, _)), _) => why,
                    (None, Ok(())) => Closed::Client,
                    (None, Err(e)) => {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                        Closed::Error
                    }
                };
            }
            // Requests may have come and gone while asleep: look again at what is due now.
            () = tokio::time::sleep_until(wake) => match (closing, activity.due(served_since, &config)) {
                (Some((why, _)), _) => {
                    tracing::debug!(%peer, reason = why.label(), "dropped a connection that did not close in time");
                    return why;
                }
                (None, Some(Closed::FirstRequestTimeout)) => {
                    // Nothing was ever asked on it, so nothing can be lost: drop it now.
                    tracing::debug!(%peer, "closed a connection that sent no request in time");
                    return Closed::FirstRequestTimeout;
                }
                (None, Some(why)) => {
                    tracing::debug!(%peer, reason = why.label(), "closing a connection");
                    conn.as_mut().graceful_shutdown();
                    closing = Some((why, Instant::now() + grace(&activity, &config)));
                }
                // Not yet, or a request is in flight: look again later.
                (None, None) => {}
            },
            changed = stop.changed(), if closing.is_none() => {
                if changed.is_err() || *stop.borrow() {
                    conn.as_mut().graceful_shutdown();
                    closing = Some((
                        Closed::Shutdown,
                        Instant::now() + config.request_timeout,
                    ));
                }
            }
        }
    }
}

/// How long a graceful close may take: [`CLOSE_GRACE`], or, if a request slipped in just as the
/// connection went idle, as long as that request may take.
fn grace(activity: &Activity, config: &Limits) -> Duration {
    if activity.in_flight() > 0 {
        config.request_timeout
    } else {
        CLOSE_GRACE
    }
}
