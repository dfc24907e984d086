//! What the operator holds of leader election: a [`Leadership`] (started with [`start`], or
//! [`Leadership::always`] without election) and the [`LeaderGate`]s handed to what leadership
//! gates. It must not talk to the API server itself: that is the [`super::elector`]'s.

use kube::{Api, Client};
use prometheus::{IntGauge, Registry};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use super::elector::{Elector, Role};
use super::{LeaderError, LeaseConfig};

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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

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
