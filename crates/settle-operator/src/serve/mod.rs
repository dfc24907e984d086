//! Bounded HTTP serving, shared by every port the operator listens on (the admission webhook,
//! metrics, probes): an accept loop that holds at most `max_connections` connections (one more
//! is closed as soon as it is accepted, and counted), and for each connection a deadline on every
//! phase (`connection`), optionally behind TLS. What each server answers is its handler's.
//!
//! This module must not decide what a request gets, read bodies, or import anything else of the
//! crate: it sits below every layer so that `admission` and `operator` can both use it.

mod connection;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use http::{Request, Response};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio_rustls::TlsAcceptor;

pub use connection::{CLOSE_GRACE, Closed};

/// What any client of one server may hold, and for how long.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at most; one more is closed as soon as it is accepted.
    pub max_connections: usize,
    /// The TLS handshake (a server with TLS).
    pub tls_handshake_timeout: Duration,
    /// From accept (or the end of the TLS handshake) to the first request's headers.
    pub first_request_timeout: Duration,
    /// Each later HTTP/1.1 request's headers.
    pub header_read_timeout: Duration,
    /// An HTTP/2 connection that sent nothing for this long is pinged ...
    pub h2_keepalive_interval: Duration,
    /// ... and closed if the ping is not answered within this.
    pub h2_keepalive_timeout: Duration,
    /// A connection with no request in flight for this long is closed (HTTP/2 with a GOAWAY).
    pub idle_timeout: Duration,
    /// The longest one request may take once its headers are in (reading its body, answering):
    /// how long a closing connection waits for a request in flight.
    pub request_timeout: Duration,
}

/// The connection metrics of one server, named after it (`webhook`, `metrics`, `probe`):
/// `settle_<server>_connections_open`, `settle_<server>_connections_refused_total` (refused for
/// being over the cap) and `settle_<server>_connections_closed_total{reason}`.
#[derive(Clone)]
pub struct ConnectionMetrics {
    open: IntGauge,
    refused: IntCounter,
    closed: IntCounterVec,
}

impl ConnectionMetrics {
    /// Registers the metrics of the server `name`, whose cap is set by `cap_flag` (named in the
    /// help text); with `tls`, the TLS reasons of `closed_total` are shown from the start.
    pub fn register(
        registry: &Registry,
        name: &str,
        cap_flag: &str,
        tls: bool,
    ) -> Result<Self, prometheus::Error> {
        let open = IntGauge::new(
            format!("settle_{name}_connections_open"),
            format!("Connections to the {name} port open now (TLS handshake included)."),
        )?;
        let refused = IntCounter::new(
            format!("settle_{name}_connections_refused_total"),
            format!(
                "Connections to the {name} port closed as soon as accepted because {cap_flag} were open."
            ),
        )?;
        let closed = IntCounterVec::new(
            Opts::new(
                format!("settle_{name}_connections_closed_total"),
                format!(
                    "Connections to the {name} port ended, by why: client, error, tls_handshake_failed, \
                     tls_handshake_timeout, first_request_timeout, idle_timeout, shutdown."
                ),
            ),
            &["reason"],
        )?;
        for why in Closed::ALL {
            if tls
                || !matches!(
                    why,
                    Closed::TlsHandshakeFailed | Closed::TlsHandshakeTimeout
                )
            {
                closed.with_label_values(&[why.label()]);
            }
        }
        registry.register(Box::new(open.clone()))?;
        registry.register(Box::new(refused.clone()))?;
        registry.register(Box::new(closed.clone()))?;
        Ok(ConnectionMetrics {
            open,
            refused,
            closed,
        })
    }
}

/// One server: where it listens, its limits and metrics, and what the logs call it.
pub struct Bounded {
    pub listener: TcpListener,
    /// TLS on every connection; `None`: plain HTTP.
    pub tls: Option<TlsAcceptor>,
    pub limits: Limits,
    pub metrics: ConnectionMetrics,
    /// What the logs call it: "admission webhook", "metrics", "probe".
    pub what: &'static str,
    /// The flag that raises the cap, named in the warning about refused connections.
    pub cap_flag: &'static str,
}

impl Bounded {
    /// Serves every connection with `handle` until `shutdown` completes, then stops accepting
    /// and lets requests in flight finish (for at most `request_timeout` + [`CLOSE_GRACE`]).
    pub async fn run<H, F>(self, shutdown: impl Future<Output = ()> + Send, handle: H)
    where
        H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
        F: Future<Output = Response<Full<Bytes>>> + Send + 'static,
    {
        let Bounded {
            listener,
            tls,
            limits,
            metrics,
            what,
            cap_flag,
        } = self;
        let max = limits.max_connections.max(1);
        let builder = Arc::new(connection::http_builder(&limits));
        let open = Arc::new(OpenConnections::default());
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut refusals = RefusalLog::default();

        tokio::pin!(shutdown);
        loop {
            let (tcp, peer) = tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok(conn) => conn,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(server = what, error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Some(slot) = open.try_take(max, &metrics) else {
                // Refused at once, not queued: closing the socket tells the client now.
                drop(tcp);
                metrics.refused.inc();
                refusals.refused(what, cap_flag, max);
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let (tls, builder, limits, stop, handle, metrics) = (
                tls.clone(),
                builder.clone(),
                limits.clone(),
                stop_rx.clone(),
                handle.clone(),
                metrics.clone(),
            );
            tokio::spawn(async move {
                let why = connection::serve(tcp, peer, tls, builder, limits, stop, handle).await;
                metrics.closed.with_label_values(&[why.label()]).inc();
                drop(slot);
            });
        }
        drop(listener);
        let _ = stop_tx.send(true);
        let grace = limits.request_timeout + CLOSE_GRACE;
        if tokio::time::timeout(grace, open.all_closed())
            .await
            .is_err()
        {
            tracing::warn!(server = what, "stopped with connections still open");
        }
    }
}

/// The count of open connections, kept in step with `settle_<server>_connections_open`.
#[derive(Default)]
struct OpenConnections {
    count: AtomicUsize,
    closed: Notify,
}

/// One open connection's place; given back when dropped.
struct Slot {
    open: Arc<OpenConnections>,
    gauge: IntGauge,
}

impl OpenConnections {
    fn try_take(self: &Arc<Self>, max: usize, metrics: &ConnectionMetrics) -> Option<Slot> {
        self.count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        metrics.open.inc();
        Some(Slot {
            open: self.clone(),
            gauge: metrics.open.clone(),
        })
    }

    async fn all_closed(&self) {
        loop {
            let closed = self.closed.notified();
            if self.count.load(Ordering::Acquire) == 0 {
                return;
            }
            closed.await;
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gauge.dec();
        if self.open.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.open.closed.notify_waiters();
        }
    }
}

/// Warns about refused connections at most once a minute, with how many there were.
#[derive(Default)]
struct RefusalLog {
    last: Option<Instant>,
    since: u64,
}

impl RefusalLog {
    const EVERY: Duration = Duration::from_secs(60);

    fn refused(&mut self, what: &str, cap_flag: &str, max: usize) {
        self.since += 1;
        if self.last.is_none_or(|t| t.elapsed() >= Self::EVERY) {
            tracing::warn!(
                refused = self.since,
                max_connections = max,
                "refusing new {what} connections: the maximum is open (raise {cap_flag} if a client you need is among those refused)"
            );
            self.last = Some(Instant::now());
            self.since = 0;
        }
    }
}
