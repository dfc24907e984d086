//! Leader election on a `coordination.k8s.io/v1` Lease: of the operator's replicas, the one that
//! holds the Lease reconciles; the others stand by and take over within 15 s of its death. Every
//! replica serves the webhook whatever this module says.
//!
//! - [`record`]: what a replica does with the Lease as it reads it ([`decide`]) and the record it
//!   writes ([`take`], [`renew`], [`release`]): pure, table-tested;
//! - [`handle`]: what the rest of the operator holds ([`Leadership`], [`LeaderGate`]);
//! - [`elector`]: the one I/O loop that reads and writes the Lease.
//!
//! How it decides:
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

mod elector;
mod handle;
mod record;

use std::time::Duration;

pub use handle::{LeaderGate, Leadership, start};
pub use record::{Decision, decide, holder, lease_duration, release, renew, take};

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
#[derive(Clone, Debug, PartialEq)]
pub struct LeaseConfig {
    /// The Lease's namespace (the operator's `--namespace`).
    pub namespace: String,
    /// The Lease's name (`--lease-name`).
    pub name: String,
    /// This replica's `holderIdentity`, unique among the replicas ([`identity`]).
    pub identity: String,
    /// Set as the Lease's owner when it is created (the operator's ServiceAccount, so the Lease
    /// goes with the install); `None`: no owner.
    pub owner: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>,
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
            owner: None,
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

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn a_killed_leaders_held_sqs_reports_are_back_before_a_standby_can_lead() {
        // The holder renewed at most one interval before it died; the Lease is taken at the
        // earliest its duration after that renewal.
        assert!(crate::account::sqs::REPORT_HIDE + RENEW_INTERVAL <= LEASE_DURATION);
    }
}
