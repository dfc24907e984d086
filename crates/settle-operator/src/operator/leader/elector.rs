//! The elector: the one loop that reads, takes, renews and releases the Lease through the API
//! server, deciding with [`super::record`], and tells the [`super::LeaderGate`]s. Every write
//! is a `replace` carrying the resourceVersion read, so two replicas never both lead.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{ObjectMeta, PostParams};
use prometheus::IntGauge;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use super::record::{Decision, decide, holder, release, renew, take};
use super::*;

pub(super) enum Role {
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

pub(super) struct Elector {
    pub(super) api: Api<Lease>,
    pub(super) config: LeaseConfig,
    pub(super) tx: watch::Sender<bool>,
    pub(super) gauge: IntGauge,
    pub(super) role: Role,
    /// The resourceVersion last seen, and since when it has been the same.
    pub(super) seen: Option<(String, Instant)>,
    /// The holder last logged, so a new one is logged once.
    pub(super) holder_seen: Option<String>,
}

impl Elector {
    pub(super) async fn run(
        mut self,
        mut release: oneshot::Receiver<()>,
    ) -> Result<(), LeaderError> {
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
                owner_references: self.config.owner.clone().map(|o| vec![o]),
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
