//! The runtime's side of a pause on brokers that have none (RabbitMQ, SQS): the operator leaves
//! a signal on the broker while a Subscription is paused (RabbitMQ: the marker exchange
//! `settle.paused.<queue>`, `rabbitmq::pause`; SQS: the queue tag `settle-paused`,
//! `sqs::pause`), and every application bound to that Subscription's queue checks it once per
//! interval and stops fetching while it is there (docs/semantics.md W3, W4). The runtime does
//! not talk to Kubernetes, so the broker is the one place both sides reach.
//!
//! This is the bounded poll both share: one check per subscription per interval
//! (`SETTLE_PAUSE_POLL_INTERVAL`, 5s unless set, at least 100ms), counted in
//! `settle_runtime_pause_checks_total{backend,subscription,result}` (`paused`, `running`,
//! `failed`) on the process's default Prometheus registry, which an application exports with
//! its own metrics. A failed check changes nothing: a broker that does not answer neither pauses
//! nor resumes a subscription. Only operator-made queues are polled (a code-defined
//! subscription has no operator to pause it).
//!
//! It must not decide what the signal is (each broker's `pause` module does) nor stop fetching
//! itself (each broker's consumer does, on this watch).

use std::future::Future;
use std::sync::LazyLock;
use std::time::Duration;

use prometheus::{IntCounterVec, IntGaugeVec, Opts};
use tokio::sync::watch;

use crate::policy::BackendKind;

/// The variable that sets how often a paused signal is checked.
pub const POLL_ENV: &str = "SETTLE_PAUSE_POLL_INTERVAL";
/// How often, unless [`POLL_ENV`] says otherwise.
pub const DEFAULT_POLL: Duration = Duration::from_secs(5);
/// The shortest interval taken (a smaller one is raised to it).
pub const MIN_POLL: Duration = Duration::from_millis(100);

/// The interval from [`POLL_ENV`] (a duration such as `5s` or `500ms`), else [`DEFAULT_POLL`];
/// one that does not parse is logged and the default used.
pub fn poll_interval_from_env() -> Duration {
    match std::env::var(POLL_ENV) {
        Ok(v) => match v.parse::<crate::api::Duration>() {
            Ok(d) => d.get().max(MIN_POLL),
            Err(e) => {
                tracing::warn!(variable = POLL_ENV, value = %v, error = %e, "not a duration (such as 5s or 500ms): the pause is checked every {DEFAULT_POLL:?}");
                DEFAULT_POLL
            }
        },
        Err(_) => DEFAULT_POLL,
    }
}

struct Metrics {
    checks: IntCounterVec,
    paused: IntGaugeVec,
}

static METRICS: LazyLock<Option<Metrics>> = LazyLock::new(|| {
    let checks = IntCounterVec::new(
        Opts::new(
            "settle_runtime_pause_checks_total",
            "Checks of a subscription's pause signal on the broker, by result (paused, running, failed)",
        ),
        &["backend", "subscription", "result"],
    )
    .ok()?;
    let paused = IntGaugeVec::new(
        Opts::new(
            "settle_runtime_paused",
            "1 while a subscription's fetching is stopped for a pause, else 0",
        ),
        &["backend", "subscription"],
    )
    .ok()?;
    let r = prometheus::default_registry();
    // Registered once per process; another registration of the same names (a second copy of
    // the library) leaves the metrics unexported, never fails the runtime.
    let _ = r.register(Box::new(checks.clone()));
    let _ = r.register(Box::new(paused.clone()));
    Some(Metrics { checks, paused })
});

/// Notes that `subscription`'s fetching stopped (`true`) or started again (`false`) for a pause:
/// the `settle_runtime_paused` gauge.
pub fn shown(backend: BackendKind, subscription: &str, paused: bool) {
    if let Some(m) = METRICS.as_ref() {
        m.paused
            .with_label_values(&[backend.name(), subscription])
            .set(i64::from(paused));
    }
}

/// Whether a subscription is paused, as its poller last saw the broker's signal; the poller
/// stops when this is dropped.
pub struct PauseWatch {
    rx: watch::Receiver<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PauseWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PauseWatch {
    /// A watch that never pauses (a code-defined subscription: no operator leaves a signal).
    pub fn never() -> PauseWatch {
        let (_, rx) = watch::channel(false);
        PauseWatch {
            rx,
            task: tokio::spawn(async {}),
        }
    }

    /// Checks `check` (true: the signal is there) at once, then every `interval`, for
    /// `subscription` on `backend`.
    pub fn start<F, Fut>(
        backend: BackendKind,
        subscription: &str,
        interval: Duration,
        check: F,
    ) -> PauseWatch
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: Future<Output = Result<bool, String>> + Send,
    {
        let (tx, rx) = watch::channel(false);
        let name = subscription.to_string();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval.max(MIN_POLL));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut failing = false;
            loop {
                tick.tick().await;
                let result = check().await;
                let label = match &result {
                    Ok(true) => "paused",
                    Ok(false) => "running",
                    Err(_) => "failed",
                };
                if let Some(m) = METRICS.as_ref() {
                    m.checks
                        .with_label_values(&[backend.name(), &name, label])
                        .inc();
                }
                match result {
                    Ok(paused) => {
                        if failing {
                            tracing::info!(subscription = %name, "the pause signal can be read again");
                            failing = false;
                        }
                        let changed =
                            tx.send_if_modified(|p| std::mem::replace(p, paused) != paused);
                        if changed {
                            tracing::info!(subscription = %name, paused, "the operator's pause signal changed: {}", if paused { "fetching stops (deliveries already taken finish)" } else { "fetching resumes" });
                        }
                    }
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!(subscription = %name, error = %e, "cannot read the pause signal: the subscription keeps its current state until it can");
                    }
                    Err(_) => {}
                }
                if tx.is_closed() {
                    return;
                }
            }
        });
        PauseWatch { rx, task }
    }

    /// Whether the signal was there at the last check.
    pub fn is_paused(&self) -> bool {
        *self.rx.borrow()
    }

    /// A receiver of the same state, for a task of the consumer's own.
    pub fn receiver(&self) -> watch::Receiver<bool> {
        self.rx.clone()
    }
}

/// Waits until `rx` reads `paused` (at once if it does); `false` if the poller is gone.
pub async fn until(rx: &mut watch::Receiver<bool>, paused: bool) -> bool {
    rx.wait_for(|p| *p == paused).await.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    #[tokio::test(start_paused = true)]
    async fn the_watch_follows_the_signal_once_per_interval_and_a_failed_check_changes_nothing() {
        let signal = Arc::new(AtomicBool::new(false));
        let fail = Arc::new(AtomicBool::new(false));
        let calls = Arc::new(AtomicU32::new(0));
        let (s, f, c) = (signal.clone(), fail.clone(), calls.clone());
        let w = PauseWatch::start(
            BackendKind::Rabbitmq,
            "t",
            Duration::from_secs(5),
            move || {
                let (s, f, c) = (s.clone(), f.clone(), c.clone());
                async move {
                    c.fetch_add(1, Ordering::SeqCst);
                    if f.load(Ordering::SeqCst) {
                        Err("down".to_string())
                    } else {
                        Ok(s.load(Ordering::SeqCst))
                    }
                }
            },
        );
        let mut rx = w.receiver();
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(!w.is_paused());
        assert_eq!(calls.load(Ordering::SeqCst), 1, "checked at once");
        signal.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(!w.is_paused(), "not before the interval");
        assert!(until(&mut rx, true).await);
        assert_eq!(calls.load(Ordering::SeqCst), 2, "one check per interval");
        fail.store(true, Ordering::SeqCst);
        signal.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(17)).await;
        assert!(
            w.is_paused(),
            "a broker that does not answer resumes nothing"
        );
        fail.store(false, Ordering::SeqCst);
        assert!(until(&mut rx, false).await);
        assert_eq!(
            calls.load(Ordering::SeqCst),
            6,
            "checks at 0, 5, 10, 15, 20, 25 s"
        );
    }
}
