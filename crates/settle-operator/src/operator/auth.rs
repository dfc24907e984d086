//! `--metrics-auth`: who may read `/metrics` and a Subscription's `/lag`, decided by the API server
//! as kubebuilder's scaffold does. A bearer token is authenticated with a TokenReview, and the
//! user it names authorized with a SubjectAccessReview: for `/metrics`, verb `get` on the
//! non-resource URL `/metrics` (the `settle-metrics-reader` ClusterRole grants it); for
//! `/lag/<namespace>/<name>`, verb `get` on that Subscription (whoever may read its status).
//! Verdicts are remembered for `--metrics-auth-cache-ttl`, by the SHA-256 of the token and what
//! it asked for (never the token), for at most
//! `--metrics-auth-cache-size` tokens; one more evicts the verdict closest to expiry, counted in
//! `settle_metrics_auth_cache_evicted_total`. Every request's outcome is counted in
//! `settle_metrics_auth_total{result}`.
//!
//! It must not log or keep a token, and must not allow anything when the API server cannot be
//! asked (the scrape gets a 503 and is not cached).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::PostParams;
use kube::{Api, Client};
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

/// How long one TokenReview or SubjectAccessReview may take.
pub const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);

/// What a request asks to read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Access {
    /// `/metrics`: `get` on the non-resource URL.
    Metrics,
    /// `/lag/<namespace>/<name>`: `get` on that Subscription.
    Subscription { namespace: String, name: String },
}

impl Access {
    /// What the cache key adds to the token (a verdict for one never answers another).
    fn key(&self) -> String {
        match self {
            Access::Metrics => "metrics".into(),
            Access::Subscription { namespace, name } => format!("subscription/{namespace}/{name}"),
        }
    }

    /// What a 403 says the user may not do.
    pub fn what(&self) -> String {
        match self {
            Access::Metrics => {
                "get /metrics; bind it to the settle-metrics-reader ClusterRole".into()
            }
            Access::Subscription { namespace, name } => format!(
                "get subscriptions.{} {name} in namespace {namespace}; grant it get on subscriptions there",
                settle::api::GROUP
            ),
        }
    }

    fn attributes(&self) -> (Option<NonResourceAttributes>, Option<ResourceAttributes>) {
        match self {
            Access::Metrics => (
                Some(NonResourceAttributes {
                    path: Some("/metrics".to_string()),
                    verb: Some("get".to_string()),
                }),
                None,
            ),
            Access::Subscription { namespace, name } => (
                None,
                Some(ResourceAttributes {
                    group: Some(settle::api::GROUP.to_string()),
                    resource: Some("subscriptions".to_string()),
                    namespace: Some(namespace.clone()),
                    name: Some(name.clone()),
                    verb: Some("get".to_string()),
                    ..Default::default()
                }),
            ),
        }
    }
}

/// What a request to `/metrics` or `/lag` gets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    /// No token, or one the API server does not authenticate: 401.
    Unauthenticated,
    /// The user (named) may not read what it asked for: 403.
    Forbidden(String),
    /// The API server could not be asked: 503, not cached.
    Unavailable(String),
}

impl Verdict {
    fn label(&self) -> &'static str {
        match self {
            Verdict::Allowed => "allowed",
            Verdict::Unauthenticated => "unauthenticated",
            Verdict::Forbidden(_) => "forbidden",
            Verdict::Unavailable(_) => "unavailable",
        }
    }
}

/// The cache's bounds (the flags).
#[derive(Clone, Copy, Debug)]
pub struct AuthConfig {
    pub cache_ttl: Duration,
    pub cache_size: usize,
}

/// Asks the API server about tokens, remembering its answers a little while.
pub struct Authorizer {
    client: Client,
    config: AuthConfig,
    cache: Mutex<HashMap<[u8; 32], (Verdict, Instant)>>,
    results: IntCounterVec,
    evicted: IntCounter,
}

impl Authorizer {
    pub fn new(
        client: Client,
        config: AuthConfig,
        registry: &Registry,
    ) -> Result<Self, prometheus::Error> {
        let results = IntCounterVec::new(
            Opts::new(
                "settle_metrics_auth_total",
                "Requests for /metrics and /lag under --metrics-auth, by result: allowed, \
                 unauthenticated, forbidden, unavailable (the API server could not be asked).",
            ),
            &["result"],
        )?;
        for label in ["allowed", "unauthenticated", "forbidden", "unavailable"] {
            results.with_label_values(&[label]);
        }
        let evicted = IntCounter::new(
            "settle_metrics_auth_cache_evicted_total",
            "Cached token verdicts dropped before they expired, because --metrics-auth-cache-size \
             tokens were cached.",
        )?;
        registry.register(Box::new(results.clone()))?;
        registry.register(Box::new(evicted.clone()))?;
        Ok(Authorizer {
            client,
            config: AuthConfig {
                cache_ttl: config.cache_ttl,
                cache_size: config.cache_size.max(1),
            },
            cache: Mutex::new(HashMap::new()),
            results,
            evicted,
        })
    }

    /// The verdict for a request bearing `token` (`None`: no bearer token) that asks for
    /// `access`.
    pub async fn check(&self, token: Option<&str>, access: &Access) -> Verdict {
        let verdict = match token {
            None => Verdict::Unauthenticated,
            Some(token) => {
                let mut digest = Sha256::new();
                digest.update(token.as_bytes());
                digest.update([0]);
                digest.update(access.key().as_bytes());
                let key: [u8; 32] = digest.finalize().into();
                match self.cached(&key) {
                    Some(v) => v,
                    None => {
                        let v = self.ask(token, access).await;
                        if !matches!(v, Verdict::Unavailable(_)) {
                            self.remember(key, v.clone());
                        }
                        v
                    }
                }
            }
        };
        self.results.with_label_values(&[verdict.label()]).inc();
        if let Verdict::Unavailable(e) = &verdict {
            tracing::warn!(error = %e, "could not check a /metrics or /lag token with the API server");
        }
        verdict
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], (Verdict, Instant)>> {
        // Nothing panics while holding it; a poisoned cache is still a valid cache.
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn cached(&self, key: &[u8; 32]) -> Option<Verdict> {
        let cache = self.lock();
        cache
            .get(key)
            .filter(|(_, until)| *until > Instant::now())
            .map(|(v, _)| v.clone())
    }

    fn remember(&self, key: [u8; 32], verdict: Verdict) {
        let now = Instant::now();
        let mut cache = self.lock();
        cache.retain(|_, (_, until)| *until > now);
        while cache.len() >= self.config.cache_size && !cache.contains_key(&key) {
            let Some(soonest) = cache
                .iter()
                .min_by_key(|(_, (_, until))| *until)
                .map(|(k, _)| *k)
            else {
                break;
            };
            cache.remove(&soonest);
            self.evicted.inc();
        }
        cache.insert(key, (verdict, now + self.config.cache_ttl));
    }

    /// One TokenReview, then (if authenticated) one SubjectAccessReview.
    async fn ask(&self, token: &str, access: &Access) -> Verdict {
        let reviews: Api<TokenReview> = Api::all(self.client.clone());
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_string(),
                audiences: None,
            },
            ..Default::default()
        };
        let reviewed = match tokio::time::timeout(
            REVIEW_TIMEOUT,
            reviews.create(&PostParams::default(), &review),
        )
        .await
        {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => return Verdict::Unavailable(format!("TokenReview: {e}")),
            Err(_) => {
                return Verdict::Unavailable(format!(
                    "TokenReview: no answer within {REVIEW_TIMEOUT:?}"
                ));
            }
        };
        let status = reviewed.status.unwrap_or_default();
        let user = match (status.authenticated, status.user) {
            (Some(true), Some(user)) => user,
            _ => return Verdict::Unauthenticated,
        };
        let name = user.username.clone().unwrap_or_default();
        let reviews: Api<SubjectAccessReview> = Api::all(self.client.clone());
        let (non_resource_attributes, resource_attributes) = access.attributes();
        let sar = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                groups: user.groups,
                uid: user.uid,
                extra: user.extra,
                non_resource_attributes,
                resource_attributes,
            },
            ..Default::default()
        };
        match tokio::time::timeout(REVIEW_TIMEOUT, reviews.create(&PostParams::default(), &sar))
            .await
        {
            Ok(Ok(r)) if r.status.as_ref().is_some_and(|s| s.allowed) => Verdict::Allowed,
            Ok(Ok(_)) => Verdict::Forbidden(name),
            Ok(Err(e)) => Verdict::Unavailable(format!("SubjectAccessReview: {e}")),
            Err(_) => Verdict::Unavailable(format!(
                "SubjectAccessReview: no answer within {REVIEW_TIMEOUT:?}"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client for an API server that is never there: the cache tests never reach it.
    fn authorizer(cache_size: usize, registry: &Registry) -> Authorizer {
        let config = kube::Config::new("http://127.0.0.1:1".parse().expect("a URL"));
        let client = Client::try_from(config).expect("a client");
        Authorizer::new(
            client,
            AuthConfig {
                cache_ttl: Duration::from_secs(10),
                cache_size,
            },
            registry,
        )
        .expect("metrics register")
    }

    fn key(n: u8) -> [u8; 32] {
        [n; 32]
    }

    #[tokio::test(start_paused = true)]
    async fn the_cache_forgets_after_its_ttl_and_evicts_the_soonest_to_expire_when_full() {
        let registry = Registry::new();
        let auth = authorizer(2, &registry);
        auth.remember(key(1), Verdict::Allowed);
        tokio::time::advance(Duration::from_secs(1)).await;
        auth.remember(key(2), Verdict::Forbidden("u".into()));
        assert_eq!(auth.cached(&key(1)), Some(Verdict::Allowed));

        // Full: the third evicts the first (it expires soonest), counted.
        auth.remember(key(3), Verdict::Unauthenticated);
        assert_eq!(auth.cached(&key(1)), None);
        assert_eq!(auth.cached(&key(2)), Some(Verdict::Forbidden("u".into())));
        assert_eq!(auth.cached(&key(3)), Some(Verdict::Unauthenticated));
        assert_eq!(auth.evicted.get(), 1);
        // Remembering a cached token again evicts nothing.
        auth.remember(key(3), Verdict::Allowed);
        assert_eq!(auth.evicted.get(), 1);

        // Past the TTL nothing is served from the cache, and expired entries make room
        // without counting as evicted.
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(auth.cached(&key(3)), None);
        auth.remember(key(4), Verdict::Allowed);
        auth.remember(key(5), Verdict::Allowed);
        assert_eq!(auth.evicted.get(), 1);
        assert_eq!(auth.lock().len(), 2);
    }

    #[tokio::test]
    async fn no_token_is_unauthenticated_and_an_unreachable_api_server_allows_nothing_nor_is_cached()
     {
        let registry = Registry::new();
        let auth = authorizer(4, &registry);
        assert_eq!(
            auth.check(None, &Access::Metrics).await,
            Verdict::Unauthenticated
        );
        let v = auth.check(Some("a-token"), &Access::Metrics).await;
        assert!(
            matches!(v, Verdict::Unavailable(ref e) if e.starts_with("TokenReview")),
            "{v:?}"
        );
        assert!(
            auth.lock().is_empty(),
            "an unavailable verdict is not cached"
        );
        for (result, want) in [("unauthenticated", 1), ("unavailable", 1), ("allowed", 0)] {
            assert_eq!(
                auth.results.with_label_values(&[result]).get(),
                want,
                "{result}"
            );
        }
    }
}
