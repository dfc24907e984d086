//! `settle operator`: the long-running process. Every replica serves the admission webhook (with
//! its certificates and a Backend cache behind it) and a metrics/health endpoint, and contends for
//! the leader Lease; only the leader runs the controllers (`reconcile`), gated on
//! [`leader::LeaderGate`].
//!
//! This module wires parts together and owns process concerns (its flags, in `args`; logging;
//! signals). It must not hold admission rules or broker logic: those live in `admission/` and
//! `backend/`.

mod args;
mod auth;
mod health;
mod lag;
pub mod leader;
mod memory;
mod owner;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Client;
use kube::runtime::{WatchStreamExt, reflector};
use prometheus::Registry;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::account;
use crate::admission::certs::{
    self, CertResolver, CertSource, FileCertConfig, Sans, SelfManagedConfig,
};
use crate::admission::webhook::{self, StoreLookup};
use crate::exposition::Exposition;
use crate::reconcile;
use settle::api::Backend;

pub use args::{LogFormat, OperatorArgs};
pub use memory::tune_allocator;

/// Why the operator stopped.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("cannot reach the Kubernetes API (set KUBECONFIG, or run in a pod): {0}")]
    Kube(#[from] kube::Error),
    #[error("webhook certificate: {0}")]
    Certs(#[from] certs::CertError),
    #[error("admission webhook: {0}")]
    Webhook(#[from] webhook::WebhookError),
    #[error("metrics server: {0}")]
    Health(#[from] health::HealthError),
    #[error("leader election: {0}")]
    Leader(#[from] leader::LeaderError),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// Sets up logging: JSON lines in a cluster (or when asked), human text otherwise. RUST_LOG
/// filters as usual; the default is `info`.
pub fn init_logging(format: LogFormat) {
    let json = match format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => std::env::var_os("KUBERNETES_SERVICE_HOST").is_some(),
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}

/// Runs until SIGTERM or SIGINT.
pub async fn run(args: OperatorArgs) -> Result<(), OperatorError> {
    let client = Client::try_default().await?;
    // What /metrics writes: the registry's families, then the per-Subscription series the
    // tables write from their rows.
    let exposition = Exposition::default();
    let (registry, tables) = (&exposition.registry, &exposition.tables);
    memory::spawn_release(args.release_memory_interval.get(), registry);
    let shutdown = spawn_shutdown(args.shutdown_delay.get());
    let stopping_rx = shutdown.stop.clone();

    // The Backends admission resolves capabilities from, cached by a watch of the watched
    // namespaces only (a Backend elsewhere is looked up with one GET when a review names it).
    let watch_namespaces = watched_namespaces(&args);
    let (store, backends_task) = spawn_backend_watch(&client, &watch_namespaces);

    // What the operator creates for itself goes with its ServiceAccount (helm uninstall).
    let owner = owner::own_service_account(&client, &args.namespace).await;

    // Contend for the Lease from the start; only what reconciles waits on it.
    let leadership = contend_for_lease(&client, &args, &owner, registry)?;

    let source = cert_source(&client, &args, &owner);
    let serving = certs::start(source).await?;

    let webhook = bind_webhook(&args, &client, &store, &serving.resolver, registry)
        .await?
        .draining_from(shutdown.stop.clone());
    // The controllers run while this replica leads; /readyz waits for their caches too.
    let readiness = reconcile::Readiness::default();
    let metrics_auth = metrics_auth(&client, &args, registry, &serving.resolver)?;
    let health = health::Server::bind(
        args.health_config(),
        client.clone(),
        exposition.clone(),
        store.clone(),
        readiness.clone(),
        stopping_rx,
        metrics_auth,
    )
    .await?;
    let controllers = reconcile::run(
        client.clone(),
        reconcile_config(&args, watch_namespaces),
        leadership.gate().receiver(),
        reconcile::Metrics::new(registry, tables)?,
        readiness,
        Some(account_hook(
            account_config(&args),
            account::Metrics::new(registry, tables)?,
        )),
        shutdown.stopped(),
    );

    let lease = hold_lease(leadership, &shutdown);
    let closed = || shutdown.closed();
    let result = tokio::try_join!(
        async { webhook.run(closed()).await.map_err(OperatorError::from) },
        async { health.run(closed()).await.map_err(OperatorError::from) },
        async {
            controllers.await;
            Ok(())
        },
        lease,
    );
    serving.task.abort();
    backends_task.abort();
    // Give in-flight log lines a moment; nothing else is pending.
    tokio::time::sleep(Duration::from_millis(10)).await;
    result.map(|_| ())
}

/// The two moments of shutdown: `stop` (the signal: the Lease and the controllers stop,
/// `/readyz` turns 503) and `close` (the shutdown delay later: the ports close).
struct Shutdown {
    stop: watch::Receiver<bool>,
    close: watch::Receiver<bool>,
}

impl Shutdown {
    /// Completes at the signal.
    fn stopped(&self) -> impl Future<Output = ()> + use<> {
        until(self.stop.clone())
    }

    /// Completes when the shutdown delay has passed after the signal (or at a second signal).
    fn closed(&self) -> impl Future<Output = ()> + use<> {
        until(self.close.clone())
    }
}

async fn until(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Spawns the task that turns SIGTERM or SIGINT into the two moments of [`Shutdown`]: `stop` at
/// once, `close` after `delay` (or at a second signal).
fn spawn_shutdown(delay: Duration) -> Shutdown {
    let (stop_tx, stop_rx) = watch::channel(false);
    let (close_tx, close_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!(
            shutdown_delay = ?delay,
            "shutting down: the Lease is released now, admission is answered until the delay ends"
        );
        let _ = stop_tx.send(true);
        tokio::select! {
            () = tokio::time::sleep(delay) => {},
            () = shutdown_signal() => tracing::info!("a second signal: closing at once"),
        }
        let _ = close_tx.send(true);
    });
    Shutdown {
        stop: stop_rx,
        close: close_rx,
    }
}

/// `--watch-namespaces` without the empty entries.
fn watched_namespaces(args: &OperatorArgs) -> Vec<String> {
    args.watch_namespaces
        .iter()
        .filter(|n| !n.is_empty())
        .cloned()
        .collect()
}

/// Spawns the watch that keeps the Backends of `watch_namespaces` in the returned store.
fn spawn_backend_watch(
    client: &Client,
    watch_namespaces: &[String],
) -> (reflector::Store<Backend>, JoinHandle<()>) {
    let (store, writer) = reflector::store::<Backend>();
    let backends = reconcile::watch::<Backend>(client, watch_namespaces)
        .reflect(writer)
        .touched_objects()
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::warn!(error = %e, "Backend watch error; retrying");
            }
        });
    (store, tokio::spawn(backends))
}

/// Starts contending for the Lease (`--leader-election`), or leads always without it.
fn contend_for_lease(
    client: &Client,
    args: &OperatorArgs,
    owner: &Option<OwnerReference>,
    registry: &Registry,
) -> Result<leader::Leadership, OperatorError> {
    if args.leader_election {
        let mut lease =
            leader::LeaseConfig::new(&args.namespace, &args.lease_name, leader::identity());
        lease.owner = owner.clone();
        Ok(leader::start(client.clone(), lease, registry)?)
    } else {
        tracing::warn!(
            "leader election is off: this replica reconciles as if it were the only one; run one replica"
        );
        Ok(leader::Leadership::always(registry)?)
    }
}

/// Binds the admission webhook, answering from the Backends in `store` (and a GET for one not
/// in it), and logs where.
async fn bind_webhook(
    args: &OperatorArgs,
    client: &Client,
    store: &reflector::Store<Backend>,
    resolver: &Arc<CertResolver>,
    registry: &Registry,
) -> Result<webhook::Server, OperatorError> {
    let lookup = Arc::new(StoreLookup::new(store.clone(), client.clone()));
    let webhook =
        webhook::Server::bind(args.webhook_config(), lookup, resolver.clone(), registry).await?;
    tracing::info!(addr = %webhook.local_addr()?, "admission webhook bound");
    Ok(webhook)
}

/// Where the webhook's certificate comes from: the files given, or a self-managed Secret.
fn cert_source(client: &Client, args: &OperatorArgs, owner: &Option<OwnerReference>) -> CertSource {
    match (&args.tls_cert_file, &args.tls_key_file) {
        (Some(cert), Some(key)) => CertSource::Files(FileCertConfig::new(cert, key)),
        _ => {
            let mut config = SelfManagedConfig::new(
                &args.namespace,
                &args.webhook_secret,
                Sans {
                    dns_names: args.webhook_dns_names.clone(),
                    ip_addresses: args.webhook_ips.clone(),
                },
            );
            config.webhook_configuration =
                Some(args.webhook_configuration.clone()).filter(|s| !s.is_empty());
            config.owner = owner.clone().map(Box::new);
            CertSource::SelfManaged {
                client: client.clone(),
                config,
            }
        }
    }
}

/// What guards `/metrics` (`--metrics-auth`): the authorizer and the certificate it is served
/// with; none when it is off.
fn metrics_auth(
    client: &Client,
    args: &OperatorArgs,
    registry: &Registry,
    resolver: &Arc<CertResolver>,
) -> Result<Option<(auth::Authorizer, Arc<CertResolver>)>, OperatorError> {
    if !args.metrics_auth {
        return Ok(None);
    }
    let authorizer = auth::Authorizer::new(
        client.clone(),
        auth::AuthConfig {
            cache_ttl: args.metrics_auth_cache_ttl,
            cache_size: args.metrics_auth_cache_size.get(),
        },
        registry,
    )?;
    Ok(Some((authorizer, resolver.clone())))
}

/// The controllers' configuration, from the flags.
fn reconcile_config(args: &OperatorArgs, watch_namespaces: Vec<String>) -> reconcile::Config {
    reconcile::Config {
        watch_namespaces,
        resync: args.resync_interval,
        drift: args.drift_interval,
        backend_deletion_grace: args.backend_deletion_grace,
        max_backends_per_namespace: args.max_backends_per_namespace,
        concurrency: args.concurrency,
        identity: leader::identity(),
        backend_rules: args.backend_rules(),
        dead_letter_copy_max_length: args.dead_letter_copy_max_length,
        adopt_namespaces: reconcile::AdoptNamespaces::new(&args.adopt_namespaces),
    }
}

/// The account's configuration, from the flags.
fn account_config(args: &OperatorArgs) -> account::Config {
    account::Config {
        stats_interval: args.stats_interval,
        status_writes_per_second: args.status_writes_per_second,
        loss_window: args.loss_window,
        stall_window: args.stall_window,
        fold_after: args.fold_after,
        unverified_grace: args.unverified_advisory_grace,
        capture_max_bytes: i64::try_from(args.capture_max_bytes).unwrap_or(i64::MAX),
        replicas: usize::from(args.account_replicas),
        limits: account::Limits {
            max_report_bytes: usize::try_from(args.max_report_bytes).unwrap_or(usize::MAX),
            max_instances: usize::try_from(args.max_instances_per_subscription)
                .unwrap_or(usize::MAX),
            early: std::sync::Arc::new(account::early::EarlyBudget::new(
                usize::try_from(args.max_early_report_bytes).unwrap_or(usize::MAX),
                account::early::EARLY_REPORTS,
            )),
            max_sequence_jump: args.max_sequence_jump,
            max_clock_skew_ms: u64::try_from(args.max_clock_skew.as_millis()).unwrap_or(u64::MAX),
            report_bucket: account::BucketLimits {
                max_value_bytes: args.report_bucket_max_value_bytes,
                max_bytes: args.report_bucket_max_bytes,
            },
            report_prefetch: args.report_prefetch,
            dead_letter_prefetch: args.dead_letter_prefetch,
            dead_letter_copy_max_length: args.dead_letter_copy_max_length,
        },
    }
}

/// Holds the Lease until the signal, then releases it at once, so a standby leads while this
/// replica's webhook drains; if leader election stops by itself, ends with its error (and the
/// process with it). Nothing runs until `run`'s `try_join!` polls it.
async fn hold_lease(
    mut leadership: leader::Leadership,
    shutdown: &Shutdown,
) -> Result<(), OperatorError> {
    let ended = tokio::select! {
        () = shutdown.stopped() => None,
        e = leadership.ended() => Some(e),
    };
    match ended {
        None => {
            leadership.release().await;
            Ok(())
        }
        Some(e) => Err(OperatorError::from(e)),
    }
}

/// The account runs beside the controllers, on their caches and connections, term by term.
fn account_hook(config: account::Config, metrics: account::Metrics) -> reconcile::TermHook {
    Arc::new(move |term: reconcile::Term| {
        Box::pin(account::run(term, config.clone(), metrics.clone()))
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
