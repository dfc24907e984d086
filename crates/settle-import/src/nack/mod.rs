//! NACK's resources, as its CRDs (`jetstream.nats.io/v1beta2`, NACK v0.16) define them, and the
//! conversion of its `Consumer`s into Subscriptions and Backends.
//!
//! [`Input`] collects the Consumers, Streams and Accounts of any number of documents (`kind: List`
//! too, which `kubectl get -o yaml` writes), with NACK's CRD defaults applied to what a file
//! leaves out, as the API server would (`ackPolicy: none`, `ackWait: 1ns`, `deliverPolicy: all`,
//! `replayPolicy: instant`). [`convert`] maps each Consumer field by field ([`consumer`]),
//! groups the connections into Backends ([`connection`]), and runs Settle's own
//! `policy::validate` and `policy::validate_backend` on what it made: what admission would refuse
//! is never written. Pure: no I/O.

mod connection;
mod consumer;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;

use super::{BackendPlan, Finding, Migration, Severity};
use settle::policy::{
    BackendKind, BackendRules, BackendView, SecretView, capabilities_of, validate, validate_backend,
};

/// NACK's API group.
pub const GROUP: &str = "jetstream.nats.io";
/// The plural names of the kinds read, for the API server.
pub const CONSUMERS: &str = "consumers";
pub const STREAMS: &str = "streams";
pub const ACCOUNTS: &str = "accounts";

/// A NACK resource: its metadata, spec and status (the rest is ignored).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Object<S> {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: S,
    #[serde(default)]
    pub status: Option<Status>,
}

impl<S> Object<S> {
    fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }
}

/// NACK's status: its conditions (`Ready` with the reason NACK gives).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Status {
    #[serde(default)]
    pub conditions: Vec<StatusCondition>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StatusCondition {
    #[serde(default, rename = "type")]
    pub type_: String,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub message: String,
}

/// A NACK `Consumer`'s spec. `None` and empty mean "not set"; the CRD's defaults are applied by
/// [`ConsumerSpec::with_defaults`].
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerSpec {
    pub stream_name: Option<String>,
    pub durable_name: Option<String>,
    pub deliver_policy: Option<String>,
    pub opt_start_seq: Option<i64>,
    pub opt_start_time: Option<String>,
    pub deliver_subject: Option<String>,
    pub deliver_group: Option<String>,
    pub ack_policy: Option<String>,
    pub ack_wait: Option<String>,
    pub max_deliver: Option<i64>,
    #[serde(default)]
    pub backoff: Vec<String>,
    pub filter_subject: Option<String>,
    #[serde(default)]
    pub filter_subjects: Vec<String>,
    pub replay_policy: Option<String>,
    pub sample_freq: Option<String>,
    pub max_waiting: Option<i64>,
    pub rate_limit_bps: Option<i64>,
    pub max_ack_pending: Option<i64>,
    pub description: Option<String>,
    #[serde(default)]
    pub flow_control: bool,
    #[serde(default)]
    pub headers_only: bool,
    pub heartbeat_interval: Option<String>,
    pub max_request_batch: Option<i64>,
    pub max_request_expires: Option<String>,
    pub max_request_max_bytes: Option<i64>,
    pub replicas: Option<i64>,
    #[serde(default)]
    pub mem_storage: bool,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    pub tls: Option<ClientTls>,
    #[serde(default)]
    pub servers: Vec<String>,
    pub creds: Option<String>,
    pub nkey: Option<String>,
    pub account: Option<String>,
    #[serde(default)]
    pub prevent_delete: bool,
    #[serde(default)]
    pub prevent_update: bool,
}

/// NACK's defaults (its CRD's `default:` values), which the API server fills in.
pub const DEFAULT_ACK_POLICY: &str = "none";
pub const DEFAULT_ACK_WAIT: &str = "1ns";
pub const DEFAULT_DELIVER_POLICY: &str = "all";
pub const DEFAULT_REPLAY_POLICY: &str = "instant";

impl ConsumerSpec {
    /// The spec with NACK's CRD defaults where a field is not set (as the API server stores it),
    /// and empty strings read as unset (NACK's Go code does not tell them apart).
    pub fn with_defaults(&self) -> ConsumerSpec {
        let set = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
        let mut s = self.clone();
        for v in [
            &mut s.stream_name,
            &mut s.durable_name,
            &mut s.opt_start_time,
            &mut s.deliver_subject,
            &mut s.deliver_group,
            &mut s.filter_subject,
            &mut s.sample_freq,
            &mut s.description,
            &mut s.heartbeat_interval,
            &mut s.max_request_expires,
            &mut s.creds,
            &mut s.nkey,
            &mut s.account,
        ] {
            *v = set(v);
        }
        let or = |v: &Option<String>, d: &str| set(v).or_else(|| Some(d.to_string()));
        s.ack_policy = or(&self.ack_policy, DEFAULT_ACK_POLICY);
        s.ack_wait = or(&self.ack_wait, DEFAULT_ACK_WAIT);
        s.deliver_policy = or(&self.deliver_policy, DEFAULT_DELIVER_POLICY);
        s.replay_policy = or(&self.replay_policy, DEFAULT_REPLAY_POLICY);
        s
    }
}

/// A Consumer's own TLS files (paths on NACK's controller).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientTls {
    pub client_cert: Option<String>,
    pub client_key: Option<String>,
    #[serde(default)]
    pub root_cas: Vec<String>,
}

/// A NACK `Stream`'s spec: only what the conversion needs.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamSpec {
    /// The JetStream stream's name (what a Consumer's `streamName` names).
    pub name: Option<String>,
    #[serde(default)]
    pub subjects: Vec<String>,
}

/// A NACK `Account`'s spec: where the servers are and which Secrets hold the credentials.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AccountSpec {
    #[serde(default)]
    pub servers: Vec<String>,
    pub tls: Option<AccountTls>,
    pub creds: Option<AccountCreds>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct AccountTls {
    pub secret: Option<SecretName>,
    /// The file (key) in the Secret holding the CA.
    pub ca: Option<String>,
    pub cert: Option<String>,
    pub key: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct AccountCreds {
    pub secret: Option<SecretName>,
    /// The key in the Secret holding the .creds file.
    pub file: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct SecretName {
    pub name: Option<String>,
}

/// NACK's resources, from files or a cluster.
#[derive(Clone, Debug, Default)]
pub struct Input {
    pub consumers: Vec<Object<ConsumerSpec>>,
    pub streams: Vec<Object<StreamSpec>>,
    pub accounts: Vec<Object<AccountSpec>>,
    /// Documents that are not NACK Consumers, Streams or Accounts (skipped).
    pub skipped: usize,
}

impl Input {
    /// Adds one parsed document: a NACK Consumer, Stream or Account, or a `List` of them; other
    /// documents are counted as skipped. Errors name the object and the field.
    pub fn add(&mut self, doc: serde_json::Value) -> Result<(), String> {
        let kind = doc.get("kind").and_then(|k| k.as_str()).unwrap_or_default();
        let api_version = doc
            .get("apiVersion")
            .and_then(|k| k.as_str())
            .unwrap_or_default();
        if kind == "List" || kind.ends_with("List") && api_version.starts_with(GROUP) {
            let items = doc
                .get("items")
                .and_then(|i| i.as_array())
                .cloned()
                .unwrap_or_default();
            let item_kind = kind.strip_suffix("List").unwrap_or_default().to_string();
            for mut item in items {
                // A typed list's items may leave out their own apiVersion and kind.
                if let Some(o) = item.as_object_mut()
                    && !item_kind.is_empty()
                {
                    o.entry("kind").or_insert_with(|| item_kind.clone().into());
                    o.entry("apiVersion")
                        .or_insert_with(|| api_version.to_string().into());
                }
                self.add(item)?;
            }
            return Ok(());
        }
        if api_version.split('/').next() != Some(GROUP) {
            self.skipped += 1;
            return Ok(());
        }
        let name = doc
            .pointer("/metadata/name")
            .and_then(|n| n.as_str())
            .unwrap_or("<no name>")
            .to_string();
        let what = format!("NACK {kind} {name:?}");
        match kind {
            "Consumer" => self.consumers.push(parse(doc, &what)?),
            "Stream" => self.streams.push(parse(doc, &what)?),
            "Account" => self.accounts.push(parse(doc, &what)?),
            _ => self.skipped += 1,
        }
        Ok(())
    }
}

fn parse<T: serde::de::DeserializeOwned>(doc: serde_json::Value, what: &str) -> Result<T, String> {
    serde_path_to_error::deserialize(doc)
        .map_err(|e| format!("{what}: {}: {}", e.path(), e.inner()))
}

/// What the conversion needs beside the input.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// The namespace of resources that name none (files written without one).
    pub namespace: String,
    /// The NATS servers of consumers that name neither `servers` nor an `account`: NACK's
    /// controller connected them with its own `-s` flag, which no resource shows.
    pub servers: Vec<String>,
}

/// Converts every NACK Consumer in `input` (in namespace and name order).
pub fn convert(input: &Input, options: &Options) -> Migration {
    let mut migration = plan_consumers(input, options);
    // Settle's own admission rules, on what was made: what they refuse is not written.
    admit_backends(&mut migration.backends);
    admit_subscriptions(&mut migration);
    migration.notes = notes(input, &migration);
    migration
}

/// A Subscription per Consumer (in namespace and name order) and the Backends they share.
fn plan_consumers(input: &Input, options: &Options) -> Migration {
    let mut consumers: Vec<&Object<ConsumerSpec>> = input.consumers.iter().collect();
    let ns_of = |m: &ObjectMeta| {
        m.namespace
            .clone()
            .unwrap_or_else(|| options.namespace.clone())
    };
    consumers.sort_by_key(|c| (ns_of(&c.metadata), c.name().to_string()));
    let streams: Vec<(String, &StreamSpec)> = input
        .streams
        .iter()
        .map(|s| (ns_of(&s.metadata), &s.spec))
        .collect();
    let accounts: Vec<(String, &Object<AccountSpec>)> = input
        .accounts
        .iter()
        .map(|a| (ns_of(&a.metadata), a))
        .collect();

    let mut backends = connection::Backends::default();
    let mut migration = Migration::default();
    for c in consumers {
        let namespace = ns_of(&c.metadata);
        let spec = c.spec.with_defaults();
        let subjects = spec
            .stream_name
            .as_deref()
            .and_then(|name| stream_subjects(&streams, name, &namespace));
        let mut plan = consumer::plan(&namespace, c.name(), &spec, subjects.as_deref());
        if let Some(status) = &c.status {
            consumer::status_findings(&mut plan, status);
        }
        let account = spec.account.as_deref().map(|a| {
            (
                a,
                accounts
                    .iter()
                    .find(|(ns, acc)| *ns == namespace && acc.name() == a)
                    .map(|(_, acc)| &acc.spec),
            )
        });
        match backends.backend_for(&namespace, &spec, account, &options.servers) {
            Ok((name, findings)) => {
                plan.findings.extend(findings);
                if let Some(s) = plan.spec.as_mut() {
                    s.backend_ref.name = name;
                }
            }
            Err(finding) => {
                plan.findings.push(finding);
                plan.spec = None;
            }
        }
        migration.subscriptions.push(plan);
    }
    migration.backends = backends.into_plans();
    migration
}

/// The subjects of the Stream `name`: one in `namespace` before one elsewhere.
fn stream_subjects(
    streams: &[(String, &StreamSpec)],
    name: &str,
    namespace: &str,
) -> Option<Vec<String>> {
    streams
        .iter()
        .filter(|(_, s)| s.name.as_deref() == Some(name))
        // A Stream in the Consumer's namespace before one elsewhere.
        .min_by_key(|(ns, _)| ns != namespace)
        .map(|(_, s)| s.subjects.clone())
}

/// `policy::validate_backend` on each Backend: its errors refuse it, its warnings are noted.
fn admit_backends(backends: &mut [BackendPlan]) {
    for b in backends {
        let v = validate_backend(
            &b.spec,
            None,
            &b.namespace,
            &|_| SecretView::Missing,
            &BackendRules::default(),
        );
        for e in v.errors {
            b.findings.push(Finding {
                severity: Severity::Refused,
                field: format!("settle {}", e.field),
                message: format!("admission would refuse this Backend: {}", e.message),
            });
        }
        // The Secret is missing by construction (the user makes it): said in `steps` instead.
        for w in v
            .warnings
            .into_iter()
            .filter(|w| !w.field.contains("SecretRef"))
        {
            b.findings.push(Finding {
                severity: Severity::Note,
                field: format!("settle {}", w.field),
                message: w.message,
            });
        }
    }
}

/// `policy::validate` on each Subscription against its Backend: refused with a refused
/// Backend or on an error, its warnings noted.
fn admit_subscriptions(migration: &mut Migration) {
    let nats = capabilities_of(BackendKind::Nats);
    for plan in &mut migration.subscriptions {
        let Some(spec) = &plan.spec else { continue };
        let backend = migration
            .backends
            .iter()
            .find(|b| b.namespace == plan.namespace && b.name == spec.backend_ref.name);
        if let Some(b) = backend.filter(|b| b.refused()) {
            plan.findings.push(Finding {
                severity: Severity::Refused,
                field: "settle spec.backendRef".into(),
                message: format!("its Backend {:?} would be refused (above)", b.name),
            });
            plan.spec = None;
            continue;
        }
        let v = validate(
            spec,
            None,
            BackendView::Known {
                name: &spec.backend_ref.name,
                capabilities: &nats,
            },
        );
        for w in v.warnings {
            plan.findings.push(Finding {
                severity: Severity::Note,
                field: format!("settle {}", w.field),
                message: w.message,
            });
        }
        if !v.errors.is_empty() {
            for e in v.errors {
                plan.findings.push(Finding {
                    severity: Severity::Refused,
                    field: format!("settle {}", e.field),
                    message: format!("admission would refuse it: {}", e.message),
                });
            }
            plan.spec = None;
        }
    }
}

/// What applies to the whole migration.
fn notes(input: &Input, migration: &Migration) -> Vec<String> {
    let mut notes = Vec::new();
    if !input.streams.is_empty() {
        let names: Vec<&str> = input
            .streams
            .iter()
            .map(|s| s.spec.name.as_deref().unwrap_or(s.name()))
            .collect();
        notes.push(format!(
            "Streams are not migrated: Settle makes consumers, never streams. Keep managing {} \
             with NACK (or by hand); only the Consumers move to Settle.",
            names.join(", ")
        ));
    }
    if !migration.subscriptions.is_empty() {
        notes.push(
            "Before you delete the NACK Consumer resources: NACK deletes the JetStream consumer of a \
             Consumer resource deleted while its controller runs, unless that resource has \
             spec.preventDelete: true. Stop NACK's controller first, or set preventDelete on each: \
             kubectl patch consumers.jetstream.nats.io NAME -n NAMESPACE --type merge -p '{\"spec\":{\"preventDelete\":true}}'"
                .to_string(),
        );
        notes.push(
            "Apply these with Settle's operator running and allowed to take consumers over in these \
             namespaces (--adopt-namespaces; the chart's controller.adoptNamespaces): each \
             Subscription takes over its consumer (Event Adopted) and keeps its position. kubectl \
             settle explain NAME says why one is not Ready."
                .to_string(),
        );
    }
    notes
}
