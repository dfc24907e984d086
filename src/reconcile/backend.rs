//! The Backend controller: reads the Secrets a Backend names, keeps one connection to its broker
//! (reconnecting when a Secret or the spec changes), and writes what it found to status: the
//! server's version, the capabilities of its kind, and a `Ready` condition with a reason a
//! person can act on.
//!
//! It must not touch consumers (that is the Subscription controller) nor write the account's
//! fields.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};

use super::connections::Key;
use super::metrics::BACKEND;
use super::status::{BackendOutcome, backend_status};
use super::{Ctx, Error, FIELD_MANAGER};
use crate::api::{Backend, NatsBackendSpec};
use crate::backend::nats::connect::{self, CA_KEY, ConnectFailure, ConnectSpec, Credentials};
use crate::backend::nats::jsapi;
use crate::policy::{BackendKind, capabilities_of};

/// Reconciles one Backend.
pub async fn reconcile(b: Arc<Backend>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let _timer = ctx
        .metrics
        .duration
        .with_label_values(&[BACKEND])
        .start_timer();
    let ns = b.namespace().unwrap_or_default();
    let key: Key = (ns.clone(), b.name_any());
    let Some(kind) = BackendKind::of(&b.spec) else {
        // The API server refuses such a spec; nothing to do until it changes.
        return Ok(Action::await_change());
    };
    let outcome = match (&b.spec.nats, kind) {
        (Some(nats), _) => observe(&ctx, &key, nats).await?,
        (None, BackendKind::Memory) => {
            ctx.conns.remove(&key);
            BackendOutcome::InProcess
        }
        (None, other) => {
            ctx.conns.remove(&key);
            BackendOutcome::NotManagedYet(other)
        }
    };
    let now = Time(Timestamp::now());
    if let Some(patch) = backend_status(
        b.status.as_ref(),
        b.metadata.generation,
        capabilities_of(kind),
        &outcome,
        &now,
    ) {
        let api: Api<Backend> = Api::namespaced(ctx.client.clone(), &ns);
        let body = serde_json::json!({
            "apiVersion": "messaging.settle.dev/v1alpha1",
            "kind": "Backend",
            "status": patch,
        });
        ctx.metrics.kube(BACKEND, "patch_status");
        match api
            .patch_status(
                &key.1,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await
        {
            Ok(_) => {
                ctx.metrics
                    .status_writes
                    .with_label_values(&[BACKEND])
                    .inc();
                let c = &patch.conditions[0];
                tracing::info!(backend = %format!("{}/{}", key.0, key.1), ready = %c.status, reason = %c.reason, message = %c.message, "Backend status");
            }
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Action::await_change()),
            Err(e) => return Err(e.into()),
        }
    }
    let healthy = matches!(
        outcome,
        BackendOutcome::Connected { .. } | BackendOutcome::InProcess
    );
    let fkey = format!("backend/{}/{}", key.0, key.1);
    Ok(if healthy {
        ctx.succeeded(&fkey);
        Action::requeue(ctx.resync)
    } else {
        Action::requeue(ctx.failed(&fkey, Duration::from_secs(30)))
    })
}

/// Connects (or reuses the connection) and asks JetStream whether it answers.
async fn observe(ctx: &Ctx, key: &Key, nats: &NatsBackendSpec) -> Result<BackendOutcome, Error> {
    let spec = match connect_spec(ctx, &key.0, nats).await? {
        Ok(spec) => spec,
        Err(message) => {
            ctx.conns.fail(key, message.clone());
            return Ok(BackendOutcome::SecretMissing(message));
        }
    };
    let conn = match ctx.conns.ensure(key, &spec).await {
        Ok(c) => c,
        Err(f) => return Ok(BackendOutcome::Connect(f)),
    };
    let version = connect::server_version(&conn.client);
    if !conn.connected() {
        return Ok(BackendOutcome::Connect(ConnectFailure::Unreachable {
            servers: spec.servers.join(","),
            detail: "the connection dropped; reconnecting".into(),
        }));
    }
    ctx.metrics.js("account");
    Ok(match jsapi::account_info(&conn.js).await {
        Ok(()) => BackendOutcome::Connected { version },
        Err(error) => BackendOutcome::Broker { error, version },
    })
}

/// What to connect with: the servers, and the credentials and CA read from the named Secrets.
/// The inner `Err` says what is missing, for the Backend's status.
async fn connect_spec(
    ctx: &Ctx,
    ns: &str,
    nats: &NatsBackendSpec,
) -> Result<Result<ConnectSpec, String>, Error> {
    let credentials = match &nats.credentials_secret_ref {
        None => None,
        Some(r) => match secret_data(ctx, ns, &r.name).await? {
            Err(m) => return Ok(Err(m)),
            Ok(data) => match Credentials::from_secret_data(&data) {
                Ok(c) => Some(c),
                Err(m) => {
                    return Ok(Err(format!(
                        "Secret {:?} (spec.nats.credentialsSecretRef) has no usable credentials: {m}",
                        r.name
                    )));
                }
            },
        },
    };
    let ca_pem = match nats.tls.as_ref().and_then(|t| t.ca_secret_ref.as_ref()) {
        None => None,
        Some(r) => match secret_data(ctx, ns, &r.name).await? {
            Err(m) => return Ok(Err(m)),
            Ok(data) => match data.get(CA_KEY).map(|b| String::from_utf8(b.clone())) {
                Some(Ok(pem)) => Some(pem),
                _ => {
                    return Ok(Err(format!(
                        "Secret {:?} (spec.nats.tls.caSecretRef) has no key {CA_KEY:?} holding a PEM certificate: add it",
                        r.name
                    )));
                }
            },
        },
    };
    Ok(Ok(ConnectSpec {
        servers: nats.servers.clone(),
        credentials,
        ca_pem,
        name: ctx.conns.client_name.clone(),
    }))
}

/// A Secret's data, or what to tell the user when it cannot be read.
async fn secret_data(
    ctx: &Ctx,
    ns: &str,
    name: &str,
) -> Result<Result<BTreeMap<String, Vec<u8>>, String>, Error> {
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    ctx.metrics.kube(BACKEND, "get_secret");
    match api.get_opt(name).await {
        Ok(Some(s)) => Ok(Ok(s
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect())),
        Ok(None) => Ok(Err(format!(
            "Secret {name:?} does not exist in namespace {ns}: create it, or fix the Backend's Secret reference"
        ))),
        Err(kube::Error::Api(s)) if s.code == 403 => Ok(Err(format!(
            "the operator may not read Secret {name:?} in namespace {ns}: add {ns} to the chart's watchNamespaces \
             (it grants Secret access there), or set rbac.secretsClusterWide"
        ))),
        Err(e) => Err(e.into()),
    }
}
