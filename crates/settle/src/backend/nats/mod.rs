//! The NATS JetStream backend: [`NatsBroker`], the `bus::Broker` that binds a subscription to a
//! pull consumer on the stream whose subjects cover its pattern, turns each JetStream message
//! into a `Delivery`, settles with JetStream's ack protocol (docs/semantics.md J1–J7), and
//! publishes with JetStream's publish acknowledgement. Also the stats-report sink (a KV bucket).
//!
//! Its files, the same as every broker's: [`connect`] (an application's URL, and a Backend's
//! servers, credentials and CA, to a client), `consume` (the consumer bound to, each delivery
//! and its settlement), [`mapping`] (the one spec → consumer mapping) and [`admin`] (the typed
//! JetStream calls: the operator's, and the runtime's for its own consumers), [`pause`] (a
//! Subscription's pause as the server's consumer pause, and its live state). Beside them:
//! [`advisory`] (the advisories the operator reads: consumer changes, delivery outcomes) and
//! [`capture`] (where the account reads and keeps its facts on the server).
//!
//! It must not count anything (the settle path does) nor create streams (the platform or the
//! operator owns them); it creates or binds the consumer only.

use std::sync::Arc;

use async_nats::jetstream::{self, kv};
use async_nats::{Client, HeaderMap};
use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::OnceCell;

pub mod admin;
pub mod advisory;
pub mod capture;
pub mod connect;
mod consume;
pub mod mapping;
pub mod pause;

pub use consume::{DEFAULT_PULL_BYTES, MIN_PULL_BATCH, PULL_BYTES_MARGIN, nak_body};

use crate::bus::report::{REPORT_BUCKET, REPORT_BUCKET_MAX_BYTES, REPORT_BUCKET_MAX_VALUE_BYTES};
use crate::bus::{Broker, BusError, Consumer, StatsSink, SubscriptionCtx};
use crate::policy::BackendKind;

fn err(e: impl std::fmt::Display) -> BusError {
    BusError::backend(BackendKind::Nats, e)
}

/// NATS JetStream as a backend. Clones share one connection.
#[derive(Clone)]
pub struct NatsBroker {
    client: Client,
    js: jetstream::Context,
    bucket: String,
    kv: Arc<OnceCell<kv::Store>>,
    /// The bytes one pull asks for, before [`NatsBroker::pull_bytes`] raises it to what the
    /// server's largest message needs.
    pull_bytes: usize,
    /// The operator's consumer each subscription is bound to (by subscription name): stream
    /// and consumer, where its mark is read again.
    bound: Arc<std::sync::Mutex<std::collections::HashMap<String, (String, String)>>>,
}

impl NatsBroker {
    /// Uses an existing connection.
    pub fn from_client(client: Client) -> NatsBroker {
        let js = jetstream::new(client.clone());
        NatsBroker {
            client,
            js,
            bucket: REPORT_BUCKET.to_string(),
            kv: Arc::default(),
            pull_bytes: DEFAULT_PULL_BYTES,
            bound: Arc::default(),
        }
    }

    /// The most bytes one pull of a subscription asks the server for (default
    /// [`DEFAULT_PULL_BYTES`]; never less than the server's largest message allows, see
    /// [`NatsBroker::pull_bytes`]). Every subscription of this broker shares its connection, and
    /// the server closes a connection that has more than its `max_pending` (64 MiB by default)
    /// waiting to be read: keep `subscriptions × 1.5 × bytes` under it.
    pub fn with_pull_bytes(mut self, bytes: usize) -> NatsBroker {
        self.pull_bytes = bytes;
        self
    }

    /// The bytes one pull asks for: the configured bound, raised to the server's `max_payload`
    /// plus [`PULL_BYTES_MARGIN`] (the subject and ack reply the server counts too), so the
    /// largest message the server takes always fits in a pull (a pull it cannot fit in is ended
    /// without the message, again and again).
    pub fn pull_bytes(&self) -> usize {
        let largest = self.client.server_info().max_payload;
        self.pull_bytes
            .max(largest.saturating_add(PULL_BYTES_MARGIN))
    }

    /// Stats reports go to this KV bucket instead of `settle-stats`.
    pub fn with_stats_bucket(mut self, bucket: impl Into<String>) -> NatsBroker {
        self.bucket = bucket.into();
        self.kv = Arc::default();
        self
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// The stats-report bucket, created (history 1: last value per key) if missing.
    pub async fn stats_bucket(&self) -> Result<kv::Store, BusError> {
        self.kv
            .get_or_try_init(|| async {
                if let Ok(store) = self.js.get_key_value(&self.bucket).await {
                    return Ok(store);
                }
                let created = self
                    .js
                    .create_key_value(kv::Config {
                        bucket: self.bucket.clone(),
                        description: "Settle runtime stats reports: <namespace>.<subscription>.<instance> -> JSON (docs/stats-report.md)".into(),
                        history: 1,
                        max_value_size: REPORT_BUCKET_MAX_VALUE_BYTES,
                        max_bytes: REPORT_BUCKET_MAX_BYTES,
                        ..Default::default()
                    })
                    .await;
                match created {
                    Ok(store) => Ok(store),
                    // Another instance may have created it meanwhile.
                    Err(e) => self.js.get_key_value(&self.bucket).await.map_err(|_| err(format!("cannot create KV bucket {}: {e}", self.bucket))),
                }
            })
            .await
            .cloned()
    }
}

impl Broker for NatsBroker {
    fn kind(&self) -> BackendKind {
        BackendKind::Nats
    }

    fn hands_on_slow_handlers(&self) -> bool {
        true
    }

    fn open(
        &self,
        ctx: Arc<SubscriptionCtx>,
    ) -> BoxFuture<'_, Result<Box<dyn Consumer>, BusError>> {
        self.consume(ctx).boxed()
    }

    fn publish(
        &self,
        subject: String,
        headers: Vec<(String, String)>,
        payload: Bytes,
    ) -> BoxFuture<'_, Result<(), BusError>> {
        async move {
            let ack = if headers.is_empty() {
                self.js.publish(subject, payload).await
            } else {
                let mut map = HeaderMap::new();
                for (k, v) in headers {
                    map.append(k.as_str(), v.as_str());
                }
                self.js.publish_with_headers(subject, map, payload).await
            }
            .map_err(err)?;
            ack.await.map_err(err)?;
            Ok(())
        }
        .boxed()
    }

    fn stats_sink(&self) -> Option<Arc<dyn StatsSink>> {
        Some(Arc::new(self.clone()))
    }

    fn read_mark<'a>(&'a self, ctx: &'a SubscriptionCtx) -> BoxFuture<'a, Option<String>> {
        self.mark_of(ctx.name()).boxed()
    }
}

impl StatsSink for NatsBroker {
    fn put(&self, key: String, value: Bytes) -> BoxFuture<'_, Result<(), BusError>> {
        async move {
            let store = self.stats_bucket().await?;
            store.put(key, value).await.map_err(err)?;
            Ok(())
        }
        .boxed()
    }
}
