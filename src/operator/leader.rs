//! Leader election on a `coordination.k8s.io/v1` Lease: of the operator's replicas, the one that
//! holds the Lease reconciles; the others stand by and take over within 15 s of its death. Every
//! replica serves the webhook whatever this module says.
//!
//! How it decides (the pure part is [`decide`], the record written is [`take`], [`renew`] and
//! [`release`]):
//! - every write is a `replace` carrying the resourceVersion that was read (or last written), so
//!   of two replicas that read the same record only one write succeeds: two cannot both lead;
//! - the holder renews every [`RENEW_INTERVAL`]; a holder whose last successful renewal was sent
//!   [`RENEW_DEADLINE`] ago stops leading, well before anyone else may take the Lease;
//! - a standby reads the Lease every [`RETRY_INTERVAL`] and takes it when it has no holder, or when
//!   the very same record (same resourceVersion) has stood unchanged for its `leaseDurationSeconds`
//!   by the standby's own clock, so clocks of different machines are never compared;
//! - on shutdown the holder clears `holderIdentity`, and a standby takes it at its next read.
//!
//! Why a loop of our own: of the crates for this, kubert's lease is built on kube 1, and
//! kube-lease-manager 0.13 (on kube 5) renews and releases an expired Lease by patches without a
//! resourceVersion precondition: a contender acting on a stale read can clear a holder that has
//! just taken the Lease, and both then believe they lead until the next renewal.
//!
//! It must not know what leadership gates: callers wait on a [`LeaderGate`]. It imports nothing of
//! Settle's.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use prometheus::{IntGauge, Registry};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How long the Lease stays taken after its last renewal (written as `leaseDurationSeconds`).
/// With a read every [`RETRY_INTERVAL`], a standby takes over at most
/// `LEASE_DURATION + 2 * RETRY_INTERVAL` (12 s) after the leader's last renewal.
pub const LEASE_DURATION: Duration = Duration::from_secs(10);
/// How often the holder renews.
pub const RENEW_INTERVAL: Duration = Duration::from_secs(2);
/// A holder whose last successful renewal was sent this long ago stops leading: 4 s before a
/// standby could take the Lease.
pub const RENEW_DEADLINE: Duration = Duration::from_secs(6);
/// How often a standby reads the Lease, and how soon a failed call is tried again.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(1);
/// One call to the API server; a slower one counts as failed.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Attempts to clear `holderIdentity` on shutdown (each bounded by [`REQUEST_TIMEOUT`]).
const RELEASE_ATTEMPTS: u32 = 3;
/// The field manager of every write.
const FIELD_MANAGER: &str = "settle-leader";

/// Which Lease to contend for, and under what name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    /// The Lease's namespace (the operator's `--namespace`).
    pub namespace: String,
    /// The Lease's name (`--lease-name`).
    pub name: String,
    /// This replica's `holderIdentity`, unique among the replicas ([`identity`]).
    pub identity: String,
}

impl LeaseConfig {
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Self {
        LeaseConfig {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
        }
    }
}

/// This replica's holder identity: `POD_NAME` when set (the chart sets it from the pod's name),
/// else `<hostname>-<pid>`.
pub fn identity() -> String {
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok());
    identity_from(std::env::var("POD_NAME").ok(), hostname, std::process::id())
}

/// [`identity`] from its inputs.
pub fn identity_from(pod_name: Option<String>, hostname: Option<String>, pid: u32) -> String {
    let clean = |s: Option<String>| s.map(|s| s.trim().to_string()).filter(|s| !s.is_empty());
    if let Some(pod) = clean(pod_name) {
        return pod;
    }
    let host = clean(hostname).unwrap_or_else(|| "settle".to_string());
    format!("{host}-{pid}")
}

/// Why leader election stopped. Only what retrying cannot fix ends it; everything else is logged
/// and tried again.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error(
        "not allowed to {verb} Lease {namespace}/{name} ({message}): grant get, create and update on leases (apiGroup coordination.k8s.io) in namespace {namespace} to the operator's ServiceAccount, or run a single replica with --leader-election=false"
    )]
    Forbidden {
        verb: &'static str,
        namespace: String,
        name: String,
        message: String,
    },
    #[error(
        "the API server refused to {verb} Lease {namespace}/{name}: {message}; check that --namespace (SETTLE_NAMESPACE) names an existing namespace and --lease-name (SETTLE_LEASE_NAME) is a valid object name"
    )]
    Refused {
        verb: &'static str,
        namespace: String,
        name: String,
        message: String,
    },
    #[error("registering the settle_leader gauge: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("the leader election task stopped unexpectedly: {0}")]
    Stopped(String),
}

/// What a replica should do with the Lease as it reads it now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// It is ours: renew it.
    Renew,
    /// It has no holder, or its holder let it expire: take it.
    Take,
    /// Another replica holds it: wait. It may be taken once the record has stood unchanged for
    /// `expires_in` more.
    Wait {
        holder: String,
        expires_in: Duration,
    },
}

/// How long a record written by `spec`'s holder keeps it taken: its `leaseDurationSeconds`, or
/// [`LEASE_DURATION`] when a writer left that out.
pub fn lease_duration(spec: &LeaseSpec) -> Duration {
    match spec.lease_duration_seconds {
        Some(s) => Duration::from_secs(u64::try_from(s).unwrap_or(0)),
        None => LEASE_DURATION,
    }
}

/// The holder named by `spec`, if any (an empty `holderIdentity` is no holder).
pub fn holder(spec: &LeaseSpec) -> Option<&str> {
    spec.holder_identity.as_deref().filter(|h| !h.is_empty())
}

/// The decision for replica `me`, reading `spec`, whose record (resourceVersion) this replica
/// has seen unchanged for `unchanged_for`.
pub fn decide(me: &str, spec: &LeaseSpec, unchanged_for: Duration) -> Decision {
    match holder(spec) {
        None => Decision::Take,
        Some(h) if h == me => Decision::Renew,
        Some(h) => {
            let duration = lease_duration(spec);
            if unchanged_for >= duration {
                Decision::Take
            } else {
                Decision::Wait {
                    holder: h.to_string(),
                    expires_in: duration - unchanged_for,
                }
            }
        }
    }
}

/// The record `me` writes to take the Lease: holder, acquire and renew times; one more transition
/// unless `me` held it already.
pub fn take(me: &str, previous: &LeaseSpec, now: Timestamp) -> LeaseSpec {
    let transitions = previous.lease_transitions.unwrap_or(0);
    let was_mine = holder(previous) == Some(me);
    LeaseSpec {
        holder_identity: Some(me.to_string()),
        acquire_time: Some(MicroTime(now)),
        renew_time: Some(MicroTime(now)),
        lease_duration_seconds: Some(duration_seconds(LEASE_DURATION)),
        lease_transitions: Some(if was_mine {
            transitions
        } else {
            transitions + 1
        }),
        ..previous.clone()
    }
}

/// The record the holder writes to renew: only the renew time and the duration change.
pub fn renew(previous: &LeaseSpec, now: Timestamp) -> LeaseSpec {
    LeaseSpec {
        renew_time: Some(MicroTime(now)),
        lease_duration_seconds: Some(duration_seconds(LEASE_DURATION)),
        ..previous.clone()
    }
}

/// The record the holder writes on shutdown: no holder, so the next reader takes it.
pub fn release(previous: &LeaseSpec) -> LeaseSpec {
    LeaseSpec {
        holder_identity: None,
        acquire_time: None,
        renew_time: None,
        ..previous.clone()
    }
}

fn duration_seconds(d: Duration) -> i32 {
    i32::try_from(d.as_secs()).unwrap_or(i32::MAX)
}

/// Whether this replica leads now; cheap to clone, one per consumer.
#[derive(Clone, Debug)]
pub struct LeaderGate {
    rx: watch::Receiver<bool>,
}

impl LeaderGate {
    /// True while this replica holds the Lease (never once leader election has stopped).
    pub fn is_leader(&self) -> bool {
        self.rx.has_changed().is_ok() && *self.rx.borrow()
    }

    /// Resolves when this replica leads (at once if it does). Never resolves once leader
    /// election has stopped.
    pub async fn acquired(&mut self) {
        let leading = self.rx.wait_for(|leading| *leading).await.is_ok();
        if !leading || self.rx.has_changed().is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Resolves when this replica does not lead (at once if it does not), or leader election
    /// has stopped. Race work against it: `select! { _ = work => .., _ = gate.lost() => .. }`.
    pub async fn lost(&mut self) {
        let _ = self.rx.wait_for(|leading| !*leading).await;
    }

    /// The underlying channel, for callers that want every change.
    pub fn receiver(&self) -> watch::Receiver<bool> {
        self.rx.clone()
    }
}

/// A running leader election: its gate, its task and its release.
pub struct Leadership {
    gate: LeaderGate,
    release: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), LeaderError>>>,
    /// Keeps the gate's channel open when no task owns its sender ([`Leadership::always`]).
    _always: Option<watch::Sender<bool>>,
}

/// Starts contending for the Lease `config` names and registers `settle_leader` in `registry`.
/// Call from inside a Tokio runtime.
pub fn start(
    client: Client,
    config: LeaseConfig,
    registry: &Registry,
) -> Result<Leadership, LeaderError> {
    let gauge = leader_gauge(registry)?;
    let (tx, rx) = watch::channel(false);
    let (release_tx, release_rx) = oneshot::channel();
    let elector = Elector {
        api: Api::namespaced(client, &config.namespace),
        config,
        tx,
        gauge,
        role: Role::Following,
        seen: None,
        holder_seen: None,
    };
    let task = tokio::spawn(elector.run(release_rx));
    Ok(Leadership {
        gate: LeaderGate { rx },
        release: Some(release_tx),
        task: Some(task),
        _always: None,
    })
}

fn leader_gauge(registry: &Registry) -> Result<IntGauge, prometheus::Error> {
    let gauge = IntGauge::new(
        "settle_leader",
        "1 while this replica holds the operator's Lease (it reconciles), 0 while it stands by",
    )?;
    registry.register(Box::new(gauge.clone()))?;
    Ok(gauge)
}

impl Leadership {
    /// Leadership without election (`--leader-election=false`): this replica always leads.
    pub fn always(registry: &Registry) -> Result<Leadership, LeaderError> {
        let gauge = leader_gauge(registry)?;
        gauge.set(1);
        let (tx, rx) = watch::channel(true);
        Ok(Leadership {
            gate: LeaderGate { rx },
            release: None,
            task: None,
            _always: Some(tx),
        })
    }

    /// A gate for one consumer.
    pub fn gate(&self) -> LeaderGate {
        self.gate.clone()
    }

    pub fn is_leader(&self) -> bool {
        self.gate.is_leader()
    }

    /// Resolves only if leader election stops by itself (an error retrying cannot fix, or a
    /// panic); the caller `select!`s on it and ends the process. Pending forever otherwise.
    pub async fn ended(&mut self) -> LeaderError {
        let Some(task) = self.task.as_mut() else {
            return std::future::pending().await;
        };
        let outcome = task.await;
        self.task = None;
        match outcome {
            Ok(Err(e)) => e,
            Ok(Ok(())) => LeaderError::Stopped("it returned without being asked to".into()),
            Err(e) => LeaderError::Stopped(e.to_string()),
        }
    }

    /// Stops leading and clears the Lease's holder (if this replica holds it) so a standby takes
    /// over at once; returns when that is done or has failed (logged). For shutdown.
    pub async fn release(mut self) {
        if let Some(tx) = self.release.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            match task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "leader election had stopped"),
                Err(e) => tracing::warn!(error = %e, "leader election task failed"),
            }
        }
    }
}

impl Drop for Leadership {
    /// Dropped without [`Leadership::release`]: renewals stop at once and the Lease expires by
    /// itself, as if the process had died.
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

enum Role {
    Following,
    /// `lease` as last written by us; `until` is when we stop leading unless a renewal succeeds.
    Leading {
        lease: Box<Lease>,
        until: Instant,
    },
}

/// A failed call, by what the loop does next.
enum Failure {
    /// 409: someone wrote (or created) it first. Read again now.
    Conflict,
    /// 404: no such Lease.
    Missing,
    /// Retrying cannot help.
    Fatal(LeaderError),
    /// Anything else (timeouts, 5xx, connection errors): log, try again later.
    Transient(String),
}

struct Elector {
    api: Api<Lease>,
    config: LeaseConfig,
    tx: watch::Sender<bool>,
    gauge: IntGauge,
    role: Role,
    /// The resourceVersion last seen, and since when it has been the same.
    seen: Option<(String, Instant)>,
    /// The holder last logged, so a new one is logged once.
    holder_seen: Option<String>,
}

impl Elector {
    async fn run(mut self, mut release: oneshot::Receiver<()>) -> Result<(), LeaderError> {
        tracing::info!(
            lease = %format!("{}/{}", self.config.namespace, self.config.name),
            identity = %self.config.identity,
            "leader election started"
        );
        loop {
            // `Err` from `release`: the Leadership was dropped, not released; stop without a word.
            let pause = tokio::select! {
                step = self.step() => Some(step?),
                asked = &mut release => if asked.is_ok() { None } else { return Ok(()) },
            };
            let Some(pause) = pause else {
                self.release().await;
                return Ok(());
            };
            let wake = Instant::now() + pause;
            loop {
                let until = match &self.role {
                    Role::Leading { until, .. } => Some(*until),
                    Role::Following => None,
                };
                tokio::select! {
                    () = tokio::time::sleep_until(wake) => break,
                    () = sleep_until_opt(until) => {
                        self.step_down(&format!(
                            "no renewal succeeded for {}s",
                            RENEW_DEADLINE.as_secs()
                        ));
                    }
                    asked = &mut release => {
                        if asked.is_ok() {
                            self.release().await;
                        }
                        return Ok(());
                    }
                }
            }
        }
    }

    /// One round: renew if leading, else read and act. Returns how long to pause before the next.
    async fn step(&mut self) -> Result<Duration, LeaderError> {
        if let Role::Leading { lease, .. } = &self.role {
            let lease = lease.clone();
            let sent = Instant::now();
            let spec = renew(&lease.spec.clone().unwrap_or_default(), Timestamp::now());
            let next = Lease {
                spec: Some(spec),
                ..*lease
            };
            match self.replace(next).await {
                Ok(written) => {
                    self.lead(written, sent, "renewed");
                    return Ok(RENEW_INTERVAL);
                }
                // Someone else wrote it, or deleted it: read it and decide afresh.
                Err(Failure::Conflict | Failure::Missing) => {}
                Err(Failure::Fatal(e)) => return Err(self.fail(e)),
                Err(Failure::Transient(e)) => {
                    tracing::warn!(error = %e, "could not renew the Lease; trying again");
                    return Ok(RETRY_INTERVAL);
                }
            }
        }
        self.read_and_act().await
    }

    async fn read_and_act(&mut self) -> Result<Duration, LeaderError> {
        let sent = Instant::now();
        let found = match self.call("get", self.api.get_opt(&self.config.name)).await {
            Ok(found) => found,
            Err(Failure::Fatal(e)) => return Err(self.fail(e)),
            Err(e) => {
                tracing::warn!(error = %describe(&e), "could not read the Lease; trying again");
                return Ok(RETRY_INTERVAL);
            }
        };
        let Some(lease) = found else {
            return self.create(sent).await;
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let unchanged_for = self.observe(lease.metadata.resource_version.as_deref(), sent);
        let decision = decide(&self.config.identity, &spec, unchanged_for);
        match decision {
            Decision::Renew | Decision::Take => {
                let spec = if decision == Decision::Renew {
                    renew(&spec, Timestamp::now())
                } else {
                    take(&self.config.identity, &spec, Timestamp::now())
                };
                let next = Lease {
                    spec: Some(spec),
                    ..lease
                };
                match self.replace(next).await {
                    Ok(written) => {
                        self.lead(written, sent, "took the Lease");
                        Ok(RENEW_INTERVAL)
                    }
                    Err(Failure::Conflict | Failure::Missing) => Ok(Duration::ZERO),
                    Err(Failure::Fatal(e)) => Err(self.fail(e)),
                    Err(Failure::Transient(e)) => {
                        tracing::warn!(error = %e, "could not take the Lease; trying again");
                        Ok(RETRY_INTERVAL)
                    }
                }
            }
            Decision::Wait { holder, expires_in } => {
                self.step_down(&format!("{holder} holds the Lease"));
                if self.holder_seen.as_deref() != Some(holder.as_str()) {
                    tracing::info!(%holder, "standing by: another replica leads");
                    self.holder_seen = Some(holder);
                }
                Ok(expires_in.min(RETRY_INTERVAL))
            }
        }
    }

    async fn create(&mut self, sent: Instant) -> Result<Duration, LeaderError> {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.config.name.clone()),
                namespace: Some(self.config.namespace.clone()),
                labels: Some(
                    [(
                        "app.kubernetes.io/managed-by".to_string(),
                        "settle".to_string(),
                    )]
                    .into(),
                ),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                lease_transitions: Some(0),
                ..take(
                    &self.config.identity,
                    &LeaseSpec::default(),
                    Timestamp::now(),
                )
            }),
        };
        let created = self
            .call("create", self.api.create(&post_params(), &lease))
            .await;
        match created {
            Ok(written) => {
                tracing::info!(lease = %self.config.name, "created the Lease");
                self.lead(written, sent, "created the Lease");
                Ok(RENEW_INTERVAL)
            }
            // Another replica created it first: read theirs now.
            Err(Failure::Conflict) => Ok(Duration::ZERO),
            // 404 on create: the namespace does not exist.
            Err(Failure::Missing) => Err(self.fail(LeaderError::Refused {
                verb: "create",
                namespace: self.config.namespace.clone(),
                name: self.config.name.clone(),
                message: format!("namespace {} not found", self.config.namespace),
            })),
            Err(Failure::Fatal(e)) => Err(self.fail(e)),
            Err(Failure::Transient(e)) => {
                tracing::warn!(error = %e, "could not create the Lease; trying again");
                Ok(RETRY_INTERVAL)
            }
        }
    }

    /// A replace guarded by the resourceVersion in `lease`: it fails with a conflict if anyone
    /// wrote the Lease since that version was read.
    async fn replace(&self, lease: Lease) -> Result<Lease, Failure> {
        self.call(
            "update",
            self.api.replace(&self.config.name, &post_params(), &lease),
        )
        .await
    }

    async fn call<T>(
        &self,
        verb: &'static str,
        request: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, Failure> {
        // A leader gives up at the end of its leadership, so it can step down on time.
        let mut deadline = Instant::now() + REQUEST_TIMEOUT;
        if let Role::Leading { until, .. } = &self.role {
            deadline = deadline.min(*until);
        }
        match tokio::time::timeout_at(deadline, request).await {
            Ok(result) => result.map_err(|e| self.classify(verb, e)),
            Err(_) => Err(Failure::Transient(format!("{verb}: no answer in time"))),
        }
    }

    fn classify(&self, verb: &'static str, e: kube::Error) -> Failure {
        let kube::Error::Api(status) = &e else {
            return Failure::Transient(format!("{verb}: {e}"));
        };
        let namespace = self.config.namespace.clone();
        let name = self.config.name.clone();
        let message = status.message.clone();
        match status.code {
            409 => Failure::Conflict,
            404 => Failure::Missing,
            401 | 403 => Failure::Fatal(LeaderError::Forbidden {
                verb,
                namespace,
                name,
                message,
            }),
            400 | 422 => Failure::Fatal(LeaderError::Refused {
                verb,
                namespace,
                name,
                message,
            }),
            _ => Failure::Transient(format!("{verb}: {e}")),
        }
    }

    /// Records that `version` was read at `at`; returns how long it has stood unchanged.
    fn observe(&mut self, version: Option<&str>, at: Instant) -> Duration {
        let version = version.unwrap_or_default();
        match &self.seen {
            Some((v, since)) if v == version => at.saturating_duration_since(*since),
            _ => {
                self.seen = Some((version.to_string(), at));
                Duration::ZERO
            }
        }
    }

    /// We wrote `lease` with a request sent at `sent`.
    fn lead(&mut self, lease: Lease, sent: Instant, how: &str) {
        self.observe(lease.metadata.resource_version.as_deref(), sent);
        self.role = Role::Leading {
            lease: Box::new(lease),
            until: sent + RENEW_DEADLINE,
        };
        self.holder_seen = Some(self.config.identity.clone());
        if !*self.tx.borrow() {
            tracing::info!(identity = %self.config.identity, how, "became the leader");
            self.publish(true);
        }
    }

    fn step_down(&mut self, why: &str) {
        self.role = Role::Following;
        if *self.tx.borrow() {
            tracing::info!(identity = %self.config.identity, reason = why, "no longer the leader");
            self.publish(false);
        }
    }

    fn publish(&self, leading: bool) {
        self.gauge.set(i64::from(leading));
        self.tx.send_replace(leading);
    }

    fn fail(&mut self, e: LeaderError) -> LeaderError {
        self.step_down("leader election stopped");
        tracing::error!(error = %e, "leader election stopped");
        e
    }

    /// Clears the holder if it is us. Reads first unless we hold a record we wrote ourselves.
    async fn release(&mut self) {
        let mut known = match std::mem::replace(&mut self.role, Role::Following) {
            Role::Leading { lease, .. } => Some(*lease),
            Role::Following => None,
        };
        self.step_down("shutting down");
        for _ in 0..RELEASE_ATTEMPTS {
            let lease = match known.take() {
                Some(lease) => lease,
                None => match self.call("get", self.api.get_opt(&self.config.name)).await {
                    Ok(Some(lease)) => lease,
                    Ok(None) => return,
                    Err(e) => {
                        tracing::warn!(error = %describe(&e), "could not read the Lease to release it");
                        continue;
                    }
                },
            };
            let spec = lease.spec.clone().unwrap_or_default();
            if holder(&spec) != Some(self.config.identity.as_str()) {
                return;
            }
            let next = Lease {
                spec: Some(release(&spec)),
                ..lease
            };
            match self.replace(next).await {
                Ok(_) => {
                    tracing::info!(lease = %self.config.name, "released the Lease");
                    return;
                }
                Err(Failure::Conflict) => continue,
                Err(Failure::Missing) => return,
                Err(e) => {
                    tracing::warn!(error = %describe(&e), "could not release the Lease");
                }
            }
        }
        tracing::warn!(
            "gave up releasing the Lease; a standby takes over when it expires (within {}s)",
            LEASE_DURATION.as_secs()
        );
    }
}

fn describe(f: &Failure) -> String {
    match f {
        Failure::Conflict => "conflict: it changed meanwhile".into(),
        Failure::Missing => "not found".into(),
        Failure::Fatal(e) => e.to_string(),
        Failure::Transient(e) => e.clone(),
    }
}

fn post_params() -> PostParams {
    PostParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..PostParams::default()
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn held(holder: Option<&str>, seconds: Option<i32>) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(str::to_string),
            lease_duration_seconds: seconds,
            ..LeaseSpec::default()
        }
    }

    fn wait(holder: &str, secs: u64) -> Decision {
        Decision::Wait {
            holder: holder.to_string(),
            expires_in: Duration::from_secs(secs),
        }
    }

    #[test]
    fn decisions_for_every_kind_of_record() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        // (what the record says, how long it has stood unchanged, what replica "a" does)
        let cases: Vec<(LeaseSpec, Duration, Decision)> = vec![
            // No holder: free, however fresh.
            (held(None, Some(10)), s(0), Decision::Take),
            (held(None, None), s(0), Decision::Take),
            (held(Some(""), Some(10)), s(0), Decision::Take),
            (LeaseSpec::default(), s(100), Decision::Take),
            // Ours: renew, whatever its age (nobody else may have written it).
            (held(Some("a"), Some(10)), s(0), Decision::Renew),
            (held(Some("a"), Some(10)), s(9), Decision::Renew),
            (held(Some("a"), Some(10)), s(3600), Decision::Renew),
            (held(Some("a"), None), s(0), Decision::Renew),
            (held(Some("a"), Some(0)), s(0), Decision::Renew),
            // Someone else's, fresh: wait for the rest of its duration.
            (held(Some("b"), Some(10)), s(0), wait("b", 10)),
            (held(Some("b"), Some(10)), s(4), wait("b", 6)),
            (
                held(Some("b"), Some(10)),
                ms(9_999),
                Decision::Wait {
                    holder: "b".into(),
                    expires_in: ms(1),
                },
            ),
            (held(Some("b"), Some(15)), s(10), wait("b", 5)),
            (held(Some("b"), Some(3600)), s(60), wait("b", 3540)),
            // Someone else's, expired: exactly at, and past, its duration.
            (held(Some("b"), Some(10)), s(10), Decision::Take),
            (held(Some("b"), Some(10)), s(11), Decision::Take),
            (held(Some("b"), Some(1)), s(1), Decision::Take),
            // A writer that left the duration out: ours applies.
            (held(Some("b"), None), s(9), wait("b", 1)),
            (held(Some("b"), None), LEASE_DURATION, Decision::Take),
            // Zero or negative durations expire at once.
            (held(Some("b"), Some(0)), s(0), Decision::Take),
            (held(Some("b"), Some(-5)), s(0), Decision::Take),
            // Identities compare exactly: a prefix or another case is someone else.
            (held(Some("a-1"), Some(10)), s(0), wait("a-1", 10)),
            (held(Some("A"), Some(10)), s(0), wait("A", 10)),
            (held(Some(" a"), Some(10)), s(0), wait(" a", 10)),
        ];
        for (spec, unchanged_for, want) in cases {
            assert_eq!(
                decide("a", &spec, unchanged_for),
                want,
                "record {spec:?} unchanged for {unchanged_for:?}"
            );
        }
    }

    fn any_spec() -> impl Strategy<Value = LeaseSpec> {
        (
            prop::option::of(prop_oneof![
                Just(String::new()),
                Just("me".to_string()),
                "[a-z]{1,6}"
            ]),
            prop::option::of(-5i32..120),
            prop::option::of(0i32..50),
        )
            .prop_map(|(holder, seconds, transitions)| LeaseSpec {
                holder_identity: holder,
                lease_duration_seconds: seconds,
                lease_transitions: transitions,
                ..LeaseSpec::default()
            })
    }

    proptest! {
        #[test]
        fn another_holders_record_is_never_taken_before_its_duration(
            spec in any_spec(), millis in 0u64..200_000,
        ) {
            let unchanged_for = Duration::from_millis(millis);
            let decision = decide("me", &spec, unchanged_for);
            match holder(&spec) {
                None => prop_assert_eq!(decision, Decision::Take),
                Some("me") => prop_assert_eq!(decision, Decision::Renew),
                Some(other) => {
                    let duration = lease_duration(&spec);
                    if unchanged_for < duration {
                        prop_assert_eq!(decision, Decision::Wait {
                            holder: other.to_string(),
                            expires_in: duration - unchanged_for,
                        });
                    } else {
                        prop_assert_eq!(decision, Decision::Take);
                    }
                }
            }
        }

        #[test]
        fn waiting_longer_never_turns_take_back_into_wait(
            spec in any_spec(), a in 0u64..200_000, b in 0u64..200_000,
        ) {
            let (early, late) = (a.min(b), a.max(b));
            let early = decide("me", &spec, Duration::from_millis(early));
            let late = decide("me", &spec, Duration::from_millis(late));
            if early == Decision::Take {
                prop_assert_eq!(late, Decision::Take);
            }
        }

        #[test]
        fn taking_names_me_and_counts_a_transition_unless_it_was_mine(spec in any_spec()) {
            let now = Timestamp::from_second(1_800_000_000).unwrap();
            let taken = take("me", &spec, now);
            prop_assert_eq!(taken.holder_identity.as_deref(), Some("me"));
            prop_assert_eq!(&taken.acquire_time, &Some(MicroTime(now)));
            prop_assert_eq!(&taken.renew_time, &Some(MicroTime(now)));
            prop_assert_eq!(taken.lease_duration_seconds, Some(10));
            let before = spec.lease_transitions.unwrap_or(0);
            let want = if holder(&spec) == Some("me") { before } else { before + 1 };
            prop_assert_eq!(taken.lease_transitions, Some(want));
            // And the result is ours to renew at once.
            prop_assert_eq!(decide("me", &taken, Duration::ZERO), Decision::Renew);
            prop_assert_eq!(decide("other", &taken, Duration::ZERO), wait("me", 10));
        }

        #[test]
        fn a_released_record_is_free_for_anyone_at_once(spec in any_spec(), who in "[a-z]{1,6}") {
            let released = release(&spec);
            prop_assert_eq!(holder(&released), None);
            prop_assert_eq!(decide(&who, &released, Duration::ZERO), Decision::Take);
            prop_assert_eq!(released.lease_transitions, spec.lease_transitions);
            prop_assert_eq!(released.lease_duration_seconds, spec.lease_duration_seconds);
        }
    }

    #[test]
    fn renewing_moves_only_the_renew_time() {
        let acquired = Timestamp::from_second(1_800_000_000).unwrap();
        let later = Timestamp::from_second(1_800_000_042).unwrap();
        let spec = LeaseSpec {
            holder_identity: Some("me".into()),
            acquire_time: Some(MicroTime(acquired)),
            renew_time: Some(MicroTime(acquired)),
            lease_duration_seconds: Some(10),
            lease_transitions: Some(7),
            preferred_holder: Some("someone".into()),
            strategy: Some("OldestEmulationVersion".into()),
        };
        let renewed = renew(&spec, later);
        assert_eq!(
            renewed,
            LeaseSpec {
                renew_time: Some(MicroTime(later)),
                ..spec.clone()
            }
        );
        // Taking it again while ours keeps the count; from someone else it adds one, and the
        // fields this module does not own survive.
        assert_eq!(take("me", &spec, later).lease_transitions, Some(7));
        let stolen = take("thief", &spec, later);
        assert_eq!(stolen.lease_transitions, Some(8));
        assert_eq!(stolen.preferred_holder.as_deref(), Some("someone"));
        assert_eq!(stolen.strategy.as_deref(), Some("OldestEmulationVersion"));
        // Released: no holder, no times; the count and duration stay.
        let released = release(&spec);
        assert_eq!(
            released,
            LeaseSpec {
                holder_identity: None,
                acquire_time: None,
                renew_time: None,
                ..spec
            }
        );
    }

    #[test]
    fn identity_is_the_pod_name_else_host_and_pid() {
        let s = |v: &str| Some(v.to_string());
        let cases = [
            (s("settle-7d9f-abcde"), s("node-1"), 42, "settle-7d9f-abcde"),
            (s("  settle-0 \n"), s("node-1"), 42, "settle-0"),
            (s(""), s("node-1\n"), 42, "node-1-42"),
            (s("   "), s("node-1"), 7, "node-1-7"),
            (None, s("laptop"), 1234, "laptop-1234"),
            (None, s(""), 99, "settle-99"),
            (None, None, 99, "settle-99"),
        ];
        for (pod, host, pid, want) in cases {
            assert_eq!(
                identity_from(pod.clone(), host.clone(), pid),
                want,
                "{pod:?} {host:?} {pid}"
            );
        }
    }

    #[test]
    fn the_timings_keep_takeover_within_15s_and_two_leaders_apart() {
        // A standby sees the last renewal at most one read late, and notices expiry at most one
        // read late: with a prompt API server, takeover is this long after the leader's death.
        let worst_takeover = LEASE_DURATION + 2 * RETRY_INTERVAL;
        assert!(
            worst_takeover <= Duration::from_secs(12),
            "{worst_takeover:?}"
        );
        // A leader that cannot renew stops leading before a standby may start.
        assert!(RENEW_INTERVAL < RENEW_DEADLINE);
        assert!(RENEW_DEADLINE + Duration::from_secs(2) < LEASE_DURATION);
        // A renewal that hangs is abandoned with time left to try again before the deadline.
        assert!(RENEW_INTERVAL + REQUEST_TIMEOUT < RENEW_DEADLINE);
    }

    #[tokio::test]
    async fn the_gate_resolves_on_each_transition() {
        let (tx, rx) = watch::channel(false);
        let mut gate = LeaderGate { rx };
        assert!(!gate.is_leader());
        // Not leading: lost() is immediate, acquired() waits.
        gate.lost().await;
        let mut waiting = gate.clone();
        let acquired = tokio::spawn(async move { waiting.acquired().await });
        tokio::task::yield_now().await;
        assert!(!acquired.is_finished());
        tx.send_replace(true);
        acquired.await.unwrap();
        assert!(gate.is_leader());
        gate.acquired().await;
        let mut waiting = gate.clone();
        let lost = tokio::spawn(async move { waiting.lost().await });
        tx.send_replace(false);
        lost.await.unwrap();
        // Once election stops, nothing leads: lost() resolves, acquired() never does.
        tx.send_replace(true);
        drop(tx);
        gate.lost().await;
        assert!(!gate.is_leader());
        let never = tokio::time::timeout(Duration::from_millis(50), gate.acquired()).await;
        assert!(never.is_err());
    }

    #[tokio::test]
    async fn without_election_this_replica_always_leads() {
        let registry = Registry::new();
        let mut leadership = Leadership::always(&registry).unwrap();
        assert!(leadership.is_leader());
        leadership.gate().acquired().await;
        let gauge = registry
            .gather()
            .into_iter()
            .find(|m| m.name() == "settle_leader")
            .expect("settle_leader registered");
        assert_eq!(gauge.get_metric()[0].get_gauge().value(), 1.0);
        let ended = tokio::time::timeout(Duration::from_millis(50), leadership.ended()).await;
        assert!(ended.is_err(), "no task to end");
        leadership.release().await;
    }
}
