//! The Backend controller: re-checks what a Backend may name (docs/semantics.md A18–A20: every
//! Secret it names carries the opt-in label, every broker host is allowed, SQS without a Secret
//! only where pod identity is allowed) before it reads any Secret's data into a connection or
//! connects at all (a refusal is `Ready=False` naming the fix and a Warning Event, and any
//! connection it held is closed); then reads the Secrets a Backend names, keeps one connection
//! to its broker (reconnecting when a Secret or the spec changes), and writes what it found to
//! status: the server's version, the capabilities of its kind (the one table), and a `Ready`
//! condition with a reason a person can act on (`PlaintextCredentials` when connected with
//! credentials over plaintext, A21). Every kind: NATS (JetStream must answer), RabbitMQ (AMQP, and
//! the management API when named), SQS (ListQueues under the prefix must answer).
//!
//! Before any of that it puts its finalizer on ([`backend_finalizer`]: a deleted Backend keeps
//! its connection while its Subscriptions delete their consumers, within a grace; as it goes,
//! a RabbitMQ Backend's copy of its dead-letter exchange is deleted through it) and connects
//! only the oldest `--max-backends-per-namespace` of a namespace ([`backend_limit`]).
//!
//! It must not touch consumers (that is the Subscription controller) nor write the account's
//! fields.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::events::{Event, EventType};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};

use super::conditions::reasons;
use super::connections::{Conn, Key, Lookup};
use super::metrics::BACKEND;
use super::status::{BackendOutcome, BrokerError, backend_status, broker_reason};
use super::{Ctx, Error, FIELD_MANAGER};
use super::{backend_finalizer, backend_limit, shared_vhost};
use settle::api::{Backend, NatsBackendSpec, RabbitmqBackendSpec, SqsBackendSpec};
use settle::backend::nats::admin::{self, NatsError};
use settle::backend::nats::connect::{self, CA_KEY, ConnectFailure, ConnectSpec, Credentials};
use settle::backend::rabbitmq::connect::{self as amqp, RabbitConnectSpec};
use settle::backend::rabbitmq::mapping::{DEFAULT_EXCHANGE, Exchanges};
use settle::backend::sqs::admin as sqs_admin;
use settle::backend::sqs::{SqsCredentials, SqsSettings};
use settle::backend::{Classify, Failure};
use settle::policy::{
    BackendKind, CREDENTIALS_LABEL, CREDENTIALS_LABEL_VALUE, SecretView, backend_access,
    capabilities_of, secrets_named,
};

/// The Secrets a Backend names, each read once per reconcile: what the access check and the
/// connection are both made from.
type Fetched = BTreeMap<String, SecretRead>;

/// One named Secret, as read.
enum SecretRead {
    Found(Box<Secret>),
    Missing,
    /// Not readable; what to tell the user.
    Unreadable(String),
}

fn labelled(s: &Secret) -> bool {
    s.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(CREDENTIALS_LABEL))
        .is_some_and(|v| v == CREDENTIALS_LABEL_VALUE)
}

/// How often a Backend beyond its namespace's bound looks again for a free place.
const BEYOND_RECHECK: Duration = Duration::from_secs(10);

/// Reconciles one Backend.
pub async fn reconcile(b: Arc<Backend>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let _timer = ctx
        .metrics
        .duration
        .with_label_values(&[BACKEND])
        .start_timer();
    // A deleting Backend stays while the Subscriptions cache shows one that still needs it: a
    // replica that just took the lead reads that cache once it holds its first list, or it
    // would find none and let the Backend go before their consumers were deleted. (The
    // Backends cache is full already: the controller runs nothing before it is.)
    super::cache_ready(&ctx.subs).await;
    let ns = b.namespace().unwrap_or_default();
    let key: Key = (ns.clone(), b.name_any());
    let Some(kind) = BackendKind::of(&b.spec) else {
        // The API server refuses such a spec; nothing to do until it changes.
        return Ok(Action::await_change());
    };
    // Deleting: the Backend stays while its Subscriptions delete their consumers through the
    // connection it has (its Secret may be gone already), or makes one if it has none.
    let deleting = b.metadata.deletion_timestamp.is_some();
    if deleting && !backend_finalizer::held(&b) {
        return Ok(Action::await_change());
    }
    if deleting && let Lookup::Up(conn) = ctx.conns.get_for_deletion(&key) {
        if backend_finalizer::goes_now(&ctx, &b)
            && let Conn::Rabbitmq(r) = conn.as_ref()
        {
            if b.spec
                .rabbitmq
                .as_ref()
                .is_some_and(|s| s.dead_letter_exchange.is_some())
            {
                super::rabbitmq::remove_copy_queue(r, &ns, &b.name_any()).await;
            }
            super::rabbitmq::remove_account_leftovers(
                r,
                &ns,
                &backend_finalizer::existing(&ctx, &ns),
            )
            .await;
        }
        return backend_finalizer::release(&ctx, &b).await;
    }
    // A connection kept for deletions after its Secret went missing is not kept for ever.
    if !deleting {
        ctx.conns.close_retired(&key, ctx.backend_deletion_grace);
    }
    if !deleting && !backend_finalizer::held(&b) {
        backend_finalizer::hold(&ctx, &b).await?;
    }
    if !deleting && let Some(message) = backend_limit::beyond(&ctx, &b) {
        ctx.conns.remove(&key);
        ctx.conns.fail(&key, message.clone());
        let outcome = BackendOutcome::down(reasons::BACKEND_LIMIT, message);
        write_status(&ctx, &b, &key, kind, &outcome).await?;
        // Looked at again now and then: a deleted sibling frees a place.
        return Ok(Action::requeue(BEYOND_RECHECK));
    }
    let sharing = shared_vhost::of(&ctx, &b);
    if !deleting && let shared_vhost::Sharing::Refused(message) = &sharing {
        ctx.conns.remove(&key);
        ctx.conns.fail(&key, message.clone());
        let outcome = BackendOutcome::down(reasons::SHARED_VHOST, message.clone());
        write_status(&ctx, &b, &key, kind, &outcome).await?;
        // Looked at again now and then: the older Backend may go, or consent.
        return Ok(Action::requeue(BEYOND_RECHECK));
    }
    let s = &b.spec;
    let fetched = fetch_secrets(&ctx, &ns, s).await?;
    let views = |name: &str| match fetched.get(name) {
        Some(SecretRead::Found(s)) if labelled(s) => SecretView::Labelled,
        Some(SecretRead::Found(_)) => SecretView::Unlabelled,
        Some(SecretRead::Missing) | None => SecretView::Missing,
        Some(SecretRead::Unreadable(_)) => SecretView::Unknown,
    };
    let access = backend_access(s, &ns, &views, &ctx.backend_rules);
    let outcome = if !access.allowed() {
        refused(&ctx, &b, &key, &access).await
    } else {
        match (kind, &s.nats, &s.rabbitmq, &s.sqs) {
            (BackendKind::Nats, Some(nats), _, _) => observe(&ctx, &key, nats, &fetched).await?,
            (BackendKind::Rabbitmq, _, Some(r), _) => {
                observe_rabbitmq(&ctx, &key, r, &fetched).await?
            }
            (BackendKind::Sqs, _, _, Some(q)) => observe_sqs(&ctx, &key, q, &fetched).await?,
            _ => {
                ctx.conns.remove(&key);
                BackendOutcome::InProcess
            }
        }
    };
    let outcome = said_if_plaintext(&ctx, &b, outcome).await;
    let outcome = shared_vhost::said(outcome, &sharing);
    if !write_status(&ctx, &b, &key, kind, &outcome).await? {
        return Ok(Action::await_change());
    }
    if deleting {
        return backend_finalizer::release(&ctx, &b).await;
    }
    let healthy = outcome.is_ready();
    let fkey = format!("backend/{}/{}", key.0, key.1);
    Ok(if healthy {
        ctx.succeeded(&fkey);
        Action::requeue(ctx.resync)
    } else {
        Action::requeue(ctx.failed(&fkey, Duration::from_secs(30)))
    })
}

/// A21: connected with credentials over plaintext: Ready, but said, and a Warning Event.
async fn said_if_plaintext(ctx: &Ctx, b: &Backend, outcome: BackendOutcome) -> BackendOutcome {
    let plaintext = settle::policy::plaintext_with_credentials(&b.spec);
    match outcome {
        BackendOutcome::Connected { version, .. } if !plaintext.is_empty() => {
            let message = format!(
                "connected, but the credentials travel unencrypted: {}",
                plaintext
                    .iter()
                    .map(|(field, m)| format!("{field}: {m}"))
                    .collect::<Vec<_>>()
                    .join("; ")
            );
            warn_event(ctx, b, reasons::PLAINTEXT_CREDENTIALS, &message).await;
            BackendOutcome::Warned {
                reason: reasons::PLAINTEXT_CREDENTIALS,
                version,
                message,
            }
        }
        other => other,
    }
}

/// Writes the Backend's status when `outcome` changes it; `false` when the Backend is gone.
async fn write_status(
    ctx: &Ctx,
    b: &Backend,
    key: &Key,
    kind: BackendKind,
    outcome: &BackendOutcome,
) -> Result<bool, Error> {
    let now = Time(Timestamp::now());
    let Some(patch) = backend_status(
        b.status.as_ref(),
        b.metadata.generation,
        capabilities_of(kind),
        outcome,
        &now,
    ) else {
        return Ok(true);
    };
    let api: Api<Backend> = Api::namespaced(ctx.client.clone(), &key.0);
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
            Ok(true)
        }
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// A Backend that names what it may not (A18–A20): any connection it held is closed, nothing
/// is read or sent, and Ready says why with the fix; a Warning Event says it too.
async fn refused(
    ctx: &Ctx,
    b: &Backend,
    key: &Key,
    access: &settle::policy::Verdict,
) -> BackendOutcome {
    let first = access.errors.first();
    let reason = match first {
        Some(e) if e.field == "spec.sqs.credentialsSecretRef" => reasons::POD_IDENTITY_NOT_ALLOWED,
        Some(e) if e.field.ends_with("SecretRef.name") => reasons::SECRET_NOT_LABELLED,
        _ => reasons::HOST_NOT_ALLOWED,
    };
    let message = access.error_text();
    ctx.conns.remove(key);
    ctx.conns.fail(key, message.clone());
    tracing::warn!(backend = %format!("{}/{}", key.0, key.1), %reason, %message, "Backend refused: not connecting");
    warn_event(ctx, b, reason, &message).await;
    BackendOutcome::down(reason, message)
}

/// A Warning Event on the Backend (the Recorder folds repeats into a series).
async fn warn_event(ctx: &Ctx, b: &Backend, reason: &str, message: &str) {
    ctx.metrics.kube(BACKEND, "event");
    let ev = Event {
        type_: EventType::Warning,
        reason: reason.to_string(),
        note: Some(message.chars().take(1024).collect()),
        action: "Connect".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &b.object_ref(&())).await {
        tracing::warn!(backend = %b.name_any(), error = %e, "could not record an Event");
    }
}

/// Reads every Secret the Backend names, once. Data is only used after [`backend_access`]
/// found each of them labelled.
async fn fetch_secrets(
    ctx: &Ctx,
    ns: &str,
    spec: &settle::api::BackendSpec,
) -> Result<Fetched, Error> {
    let mut out = Fetched::new();
    for (_, name) in secrets_named(spec) {
        if out.contains_key(name) {
            continue;
        }
        let api: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
        ctx.metrics.kube(BACKEND, "get_secret");
        let read = match api.get_opt(name).await {
            Ok(Some(s)) => SecretRead::Found(Box::new(s)),
            Ok(None) => SecretRead::Missing,
            Err(kube::Error::Api(s)) if s.code == 403 => SecretRead::Unreadable(format!(
                "the operator may not read Secret {name:?} in namespace {ns}: add {ns} to the chart's watchNamespaces \
                 (it grants Secret access there), or set rbac.secretsClusterWide"
            )),
            Err(e) => return Err(e.into()),
        };
        out.insert(name.to_string(), read);
    }
    Ok(out)
}

/// Connects (or reuses the connection) and asks JetStream whether it answers.
async fn observe(
    ctx: &Ctx,
    key: &Key,
    nats: &NatsBackendSpec,
    fetched: &Fetched,
) -> Result<BackendOutcome, Error> {
    let spec = match connect_spec(ctx, &key.0, nats, fetched)? {
        Ok(spec) => spec,
        Err(message) => {
            ctx.conns.fail(key, message.clone());
            return Ok(BackendOutcome::down(reasons::SECRET_MISSING, message));
        }
    };
    let conn = match ctx.conns.ensure(key, &spec).await {
        Ok(c) => c,
        Err(f) => return Ok(nats_down(&f)),
    };
    let Conn::Nats(conn) = &*conn else {
        return Err(Error::Waiting(
            "the Backend's kind changed; reconnecting".into(),
        ));
    };
    let version = connect::server_version(&conn.client);
    if !conn.connected() {
        return Ok(nats_down(&ConnectFailure::Unreachable {
            servers: spec.servers.join(","),
            detail: "the connection dropped; reconnecting".into(),
        }));
    }
    ctx.metrics.js("account");
    Ok(match admin::account_info(&conn.js).await {
        Ok(()) => BackendOutcome::Connected {
            kind: BackendKind::Nats,
            version,
            detail: "with JetStream".into(),
        },
        Err(error) => jetstream_down(error, version),
    })
}

/// NATS could not be connected to: the reason, and what to do.
fn nats_down(f: &ConnectFailure) -> BackendOutcome {
    let (reason, message) = match f.class() {
        Failure::Unreachable => (
            reasons::UNREACHABLE,
            format!("{f}: check spec.nats.servers and that the server runs; Settle keeps trying"),
        ),
        Failure::AuthFailed => (
            reasons::AUTH_FAILED,
            format!(
                "{f}: fix the credentials Secret (spec.nats.credentialsSecretRef); Settle picks up the change"
            ),
        ),
        Failure::Refused => (
            reasons::SECRET_MISSING,
            format!("{f}: fix the Secret or spec.nats"),
        ),
    };
    BackendOutcome::down(reason, message)
}

/// Connected to NATS (`version`), but JetStream does not answer as it should.
fn jetstream_down(error: NatsError, version: Option<String>) -> BackendOutcome {
    let (reason, message) = broker_reason(&BrokerError::Nats(error));
    BackendOutcome::Down {
        reason,
        message,
        version,
    }
}

/// What connecting to a RabbitMQ Backend takes: its credentials and CA read from the Secrets
/// it names, or what is missing from them (the message says which Secret and field, and the fix).
fn rabbitmq_connect_spec(
    ctx: &Ctx,
    key: &Key,
    r: &RabbitmqBackendSpec,
    fetched: &Fetched,
) -> Result<RabbitConnectSpec, String> {
    let credentials = match &r.credentials_secret_ref {
        None => None,
        Some(sr) => match secret_data(fetched, &key.0, &sr.name) {
            Err(m) => return Err(m),
            Ok(data) => match amqp::Credentials::from_secret_data(&data) {
                Ok(c) => Some(c),
                Err(m) => {
                    return Err(format!(
                        "Secret {:?} (spec.rabbitmq.credentialsSecretRef) has no usable credentials: {m}",
                        sr.name
                    ));
                }
            },
        },
    };
    let ca_pem = match r.tls.as_ref().and_then(|t| t.ca_secret_ref.as_ref()) {
        None => None,
        Some(sr) => match secret_data(fetched, &key.0, &sr.name) {
            Err(m) => return Err(m),
            Ok(data) => match data.get(amqp::CA_KEY).map(|b| String::from_utf8(b.clone())) {
                Some(Ok(pem)) => Some(pem),
                _ => {
                    return Err(format!(
                        "Secret {:?} (spec.rabbitmq.tls.caSecretRef) has no key {:?} holding a PEM certificate: add it",
                        sr.name,
                        amqp::CA_KEY
                    ));
                }
            },
        },
    };
    Ok(RabbitConnectSpec {
        urls: r.urls.clone(),
        vhost: r.vhost.clone(),
        credentials,
        ca_pem,
        management_url: r.management_url.clone(),
        exchanges: Exchanges {
            exchange: r
                .exchange
                .clone()
                .unwrap_or_else(|| DEFAULT_EXCHANGE.to_string()),
            dead_letter: r.dead_letter_exchange.clone(),
        },
        name: ctx.conns.client_name.clone(),
    })
}

/// Connects to RabbitMQ (or reuses the connection) and, when the Backend names it, asks the
/// management API for the version.
async fn observe_rabbitmq(
    ctx: &Ctx,
    key: &Key,
    r: &RabbitmqBackendSpec,
    fetched: &Fetched,
) -> Result<BackendOutcome, Error> {
    let spec = match rabbitmq_connect_spec(ctx, key, r, fetched) {
        Ok(spec) => spec,
        Err(message) => {
            ctx.conns.fail(key, message.clone());
            return Ok(BackendOutcome::down(reasons::SECRET_MISSING, message));
        }
    };
    let down = |reason: &'static str, message: String| Ok(BackendOutcome::down(reason, message));
    let conn = match ctx.conns.ensure_rabbitmq(key, &spec).await {
        Ok(c) => c,
        Err(f) => return down(down_reason(f.class()), amqp_message(&f)),
    };
    let Conn::Rabbitmq(conn) = &*conn else {
        return Err(Error::Waiting(
            "the Backend's kind changed; reconnecting".into(),
        ));
    };
    ctx.metrics.js("amqp.connect");
    if let Err(f) = conn.connection().await {
        return down(down_reason(f.class()), amqp_message(&f));
    }
    let Some(m) = &conn.management else {
        return Ok(BackendOutcome::Connected {
            kind: BackendKind::Rabbitmq,
            version: None,
            detail: "AMQP answers (no spec.rabbitmq.managementUrl: the version, queue arguments, owners and \
                     gauges cannot be read)"
                .into(),
        });
    };
    ctx.metrics.js("management.overview");
    Ok(match m.version().await {
        Ok(version) => BackendOutcome::Connected {
            kind: BackendKind::Rabbitmq,
            version,
            detail: "AMQP and the management API answer".into(),
        },
        Err(e) => BackendOutcome::down(down_reason(e.class()), format!("AMQP answers, but: {e}")),
    })
}

/// A RabbitMQ or SQS Backend's `Ready` reason when it is not reached, by the failure's class.
fn down_reason(class: Failure) -> &'static str {
    match class {
        Failure::Unreachable => reasons::UNREACHABLE,
        Failure::AuthFailed => reasons::AUTH_FAILED,
        Failure::Refused => reasons::BAD_CONFIG,
    }
}

fn amqp_message(f: &amqp::ConnectFailure) -> String {
    if matches!(f, amqp::ConnectFailure::Unsteady { .. }) {
        return format!("{f}: the broker's log says why it closes them");
    }
    match f.class() {
        Failure::Unreachable => {
            format!("{f}: check spec.rabbitmq.urls and that the broker runs; Settle keeps trying")
        }
        Failure::AuthFailed => format!(
            "{f}: fix the credentials Secret (spec.rabbitmq.credentialsSecretRef) or spec.rabbitmq.vhost; \
             Settle picks up the change"
        ),
        Failure::Refused => f.to_string(),
    }
}

/// Makes the SQS client (or reuses it) and asks for one queue under the prefix.
async fn observe_sqs(
    ctx: &Ctx,
    key: &Key,
    q: &SqsBackendSpec,
    fetched: &Fetched,
) -> Result<BackendOutcome, Error> {
    let credentials = match &q.credentials_secret_ref {
        None => SqsCredentials::DefaultChain,
        Some(sr) => match secret_data(fetched, &key.0, &sr.name) {
            Err(m) => {
                ctx.conns.fail(key, m.clone());
                return Ok(BackendOutcome::down(reasons::SECRET_MISSING, m));
            }
            Ok(data) => {
                let text = |k: &str| {
                    data.get(k)
                        .map(|v| String::from_utf8_lossy(v).trim().to_string())
                        .filter(|v| !v.is_empty())
                };
                match (text("accessKeyId"), text("secretAccessKey")) {
                    (Some(access_key_id), Some(secret_access_key)) => SqsCredentials::Static {
                        access_key_id,
                        secret_access_key,
                    },
                    _ => {
                        let m = format!(
                            "Secret {:?} (spec.sqs.credentialsSecretRef) needs keys \"accessKeyId\" and \"secretAccessKey\": add them",
                            sr.name
                        );
                        ctx.conns.fail(key, m.clone());
                        return Ok(BackendOutcome::down(reasons::SECRET_MISSING, m));
                    }
                }
            }
        },
    };
    let settings = SqsSettings::from_spec(q, credentials);
    let conn = match ctx.conns.ensure_sqs(key, &settings).await {
        Ok(c) => c,
        Err(m) => {
            return Ok(BackendOutcome::down(reasons::BAD_CONFIG, m));
        }
    };
    let Conn::Sqs(conn) = &*conn else {
        return Err(Error::Waiting(
            "the Backend's kind changed; reconnecting".into(),
        ));
    };
    let at = q
        .endpoint
        .clone()
        .or_else(|| q.region.clone())
        .unwrap_or_else(|| "the pod's region".into());
    ctx.metrics.js("sqs.list");
    Ok(
        match sqs_admin::ping(conn.broker.client(), conn.broker.queue_prefix()).await {
            Ok(_) => BackendOutcome::Connected {
                kind: BackendKind::Sqs,
                version: None,
                detail: format!("ListQueues answers at {at}"),
            },
            Err(e) => BackendOutcome::down(
                down_reason(e.class()),
                match e.class() {
                    Failure::Unreachable => format!(
                        "{e}: check spec.sqs.endpoint or spec.sqs.region; Settle keeps trying"
                    ),
                    Failure::AuthFailed => format!(
                        "{e}: fix the credentials (spec.sqs.credentialsSecretRef, or the pod's identity)"
                    ),
                    Failure::Refused => e.to_string(),
                },
            ),
        },
    )
}

/// What to connect with: the servers, and the credentials and CA read from the named Secrets.
/// The inner `Err` says what is missing, for the Backend's status.
fn connect_spec(
    ctx: &Ctx,
    ns: &str,
    nats: &NatsBackendSpec,
    fetched: &Fetched,
) -> Result<Result<ConnectSpec, String>, Error> {
    let credentials = match &nats.credentials_secret_ref {
        None => None,
        Some(r) => match secret_data(fetched, ns, &r.name) {
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
        Some(r) => match secret_data(fetched, ns, &r.name) {
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

/// A Secret's data, or what to tell the user when it cannot be read. An unlabelled Secret's data
/// is never handed out (the access check refused it already; this is the second lock).
fn secret_data(
    fetched: &Fetched,
    ns: &str,
    name: &str,
) -> Result<BTreeMap<String, Vec<u8>>, String> {
    match fetched.get(name) {
        Some(SecretRead::Found(s)) if labelled(s) => Ok(s
            .data
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect()),
        Some(SecretRead::Found(_)) => Err(format!(
            "Secret {name:?} does not carry the label {CREDENTIALS_LABEL}={CREDENTIALS_LABEL_VALUE}: label it"
        )),
        Some(SecretRead::Unreadable(m)) => Err(m.clone()),
        Some(SecretRead::Missing) | None => Err(format!(
            "Secret {name:?} does not exist in namespace {ns}: create it (with the label \
             {CREDENTIALS_LABEL}={CREDENTIALS_LABEL_VALUE}), or fix the Backend's Secret reference"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::status::backend::tests::assert_maps_and_settles;

    #[test]
    fn nats_failures_map_to_reasons_and_settle() {
        assert_maps_and_settles(vec![
            (
                nats_down(&ConnectFailure::Unreachable {
                    servers: "nats://127.0.0.1:1".into(),
                    detail: "refused".into(),
                }),
                "False",
                reasons::UNREACHABLE,
            ),
            (
                nats_down(&ConnectFailure::AuthFailed(
                    "authorization violation".into(),
                )),
                "False",
                reasons::AUTH_FAILED,
            ),
            (
                jetstream_down(NatsError::JetStreamDisabled, Some("2.15.3".into())),
                "False",
                reasons::JETSTREAM_DISABLED,
            ),
        ]);
    }

    /// Word for word as status showed them before every kind's outcome was made one.
    #[test]
    fn nats_failures_say_what_they_said_before() {
        let message = |o: BackendOutcome| o.want().message;
        assert_eq!(
            message(nats_down(&ConnectFailure::Unreachable {
                servers: "nats://127.0.0.1:1".into(),
                detail: "refused".into(),
            })),
            "no NATS server answered at nats://127.0.0.1:1: refused: check spec.nats.servers and that the server runs; Settle keeps trying"
        );
        assert_eq!(
            message(nats_down(&ConnectFailure::AuthFailed(
                "authorization violation".into()
            ))),
            "the NATS server refused the credentials: authorization violation: fix the credentials Secret (spec.nats.credentialsSecretRef); Settle picks up the change"
        );
        let bad = nats_down(&ConnectFailure::BadConfig("bad".into()));
        assert_eq!(bad.want().reason, reasons::SECRET_MISSING);
        assert_eq!(message(bad), "bad: fix the Secret or spec.nats");
        assert_eq!(
            message(jetstream_down(NatsError::JetStreamDisabled, None)),
            "JetStream is not enabled on the NATS server (start nats-server with -js)"
        );
    }

    #[test]
    fn a_nats_backend_without_jetstream_shows_the_version_it_reached() {
        assert_eq!(
            jetstream_down(NatsError::JetStreamDisabled, Some("2.15.3".into()))
                .version()
                .map(String::as_str),
            Some("2.15.3")
        );
    }
}
