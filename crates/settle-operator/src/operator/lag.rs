//! `/lag/<namespace>/<subscription>` on the metrics port: one Subscription's lag as JSON, for
//! KEDA's `metrics-api` trigger (`valueLocation: lag`). The lag is `status.stats.pending +
//! status.stats.ackPending`, read from the Subscription's status with one GET, so it is the
//! number `kubectl describe` shows and the same definition on every broker (the account writes
//! both gauges on NATS, RabbitMQ and SQS); any replica answers, leader or not.
//!
//! Served only under `--metrics-auth`, and only to a bearer token the API server allows to `get`
//! that Subscription (`auth::Access::Subscription`): one team's token reads its own
//! Subscriptions' lag and no other's (plain `/metrics` carries every namespace's gauges).
//!
//! It must not serve anything but a Subscription's gauges, nor write anything.

use std::time::Duration;

use kube::{Api, Client};
use serde::Serialize;

use settle::api::Subscription;

/// How long the GET of the Subscription may take.
pub const GET_TIMEOUT: Duration = Duration::from_secs(5);

/// The path prefix.
pub const PREFIX: &str = "/lag/";

/// A parsed `/lag/<namespace>/<subscription>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub namespace: String,
    pub name: String,
}

/// What is wrong with a lag path, said to the caller.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error(
        "the lag path is /lag/<namespace>/<subscription>, each a DNS-1123 name of at most 253 characters"
    )]
    Malformed,
}

/// Whether `s` can be a namespace or object name (DNS-1123 subdomain: lowercase alphanumerics,
/// `-` and `.`, starting and ending alphanumeric, at most 253).
fn dns_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && s.as_bytes()
            .first()
            .zip(s.as_bytes().last())
            .is_some_and(|(f, l)| f.is_ascii_alphanumeric() && l.is_ascii_alphanumeric())
}

/// The Subscription a path names (a query string is ignored).
pub fn parse(path: &str) -> Result<Target, PathError> {
    let rest = path.strip_prefix(PREFIX).ok_or(PathError::Malformed)?;
    let mut parts = rest.split('/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(ns), Some(name), None) if dns_name(ns) && dns_name(name) => Ok(Target {
            namespace: ns.to_string(),
            name: name.to_string(),
        }),
        _ => Err(PathError::Malformed),
    }
}

/// The answer's body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Lag {
    pub namespace: String,
    pub subscription: String,
    /// `pending + ackPending`: what KEDA scales on.
    pub lag: u64,
    pub pending: u64,
    pub ack_pending: u64,
    /// When the account last wrote the gauges (RFC 3339), absent before its first write.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stats_updated_at: Option<String>,
}

/// Why a lag cannot be answered.
#[derive(Debug, thiserror::Error)]
pub enum LagError {
    #[error("subscription {0}/{1} not found")]
    NotFound(String, String),
    #[error("could not read subscription {0}/{1} from the API server: {2}")]
    Unavailable(String, String, String),
}

/// The lag of a Subscription as its status has it (zero before the account's first write).
pub fn of(sub: &Subscription, target: &Target) -> Lag {
    let status = sub.status.as_ref();
    let stats = status.and_then(|s| s.stats.as_ref());
    let (pending, ack_pending) = stats.map_or((0, 0), |s| (s.pending, s.ack_pending));
    Lag {
        namespace: target.namespace.clone(),
        subscription: target.name.clone(),
        lag: pending.saturating_add(ack_pending),
        pending,
        ack_pending,
        stats_updated_at: status
            .and_then(|s| s.stats_updated_at.as_ref())
            .map(|t| t.0.to_string()),
    }
}

/// Reads the Subscription and its lag.
pub async fn read(client: &Client, target: &Target) -> Result<Lag, LagError> {
    let api: Api<Subscription> = Api::namespaced(client.clone(), &target.namespace);
    let unavailable =
        |e: String| LagError::Unavailable(target.namespace.clone(), target.name.clone(), e);
    match tokio::time::timeout(GET_TIMEOUT, api.get_opt(&target.name)).await {
        Ok(Ok(Some(sub))) => Ok(of(&sub, target)),
        Ok(Ok(None)) => Err(LagError::NotFound(
            target.namespace.clone(),
            target.name.clone(),
        )),
        Ok(Err(e)) => Err(unavailable(e.to_string())),
        Err(_) => Err(unavailable(format!("no answer within {GET_TIMEOUT:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use settle::api::{SubscriptionStats, SubscriptionStatus};

    #[test]
    fn a_path_names_one_subscription_or_is_refused() {
        assert_eq!(
            parse("/lag/shop/orders"),
            Ok(Target {
                namespace: "shop".into(),
                name: "orders".into()
            })
        );
        for bad in [
            "/lag/",
            "/lag/shop",
            "/lag/shop/",
            "/lag/shop/orders/x",
            "/lag//orders",
            "/lag/Shop/orders",
            "/lag/shop/-orders",
            "/lag/shop/or%2Fders",
            "/lag/../orders",
            "/metrics",
        ] {
            assert_eq!(parse(bad), Err(PathError::Malformed), "{bad}");
        }
        let long = format!("/lag/shop/{}", "a".repeat(254));
        assert_eq!(parse(&long), Err(PathError::Malformed));
    }

    #[test]
    fn the_lag_is_pending_plus_ack_pending_from_status() {
        let target = Target {
            namespace: "shop".into(),
            name: "orders".into(),
        };
        let mut sub: Subscription = serde_json::from_value(serde_json::json!({
            "apiVersion": "messaging.settle.dev/v1alpha1",
            "kind": "Subscription",
            "metadata": {"name": "orders", "namespace": "shop"},
            "spec": {"backendRef": {"name": "nats"}, "pattern": "orders.>"},
        }))
        .expect("a Subscription");
        assert_eq!(of(&sub, &target).lag, 0, "before the account's first write");
        sub.status = Some(SubscriptionStatus {
            stats: Some(SubscriptionStats {
                pending: 7,
                ack_pending: 3,
                ..Default::default()
            }),
            ..Default::default()
        });
        let lag = of(&sub, &target);
        assert_eq!((lag.lag, lag.pending, lag.ack_pending), (10, 7, 3));
        let json = serde_json::to_value(&lag).expect("serialises");
        assert_eq!(json["lag"], 10);
        assert_eq!(json["ackPending"], 3);
    }
}
