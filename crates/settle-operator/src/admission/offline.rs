//! `settle check`: the admission rules applied to manifests on disk, with no cluster.
//!
//! Reads YAML files (several documents each), finds the Subscriptions, resolves each one's
//! Backend from the same input (or from `--backend-kind`), and runs the same `validate` as the
//! webhook; each Backend is judged by the webhook's `validate_backend`, with the labels of the
//! Secrets found in the same input (a Secret not in the input is a warning). The installer's
//! flags (`--allowed-broker-hosts`, `--sqs-pod-identity-namespaces`) are not known here, so
//! those two rules are left to the webhook. It must not talk to a cluster or a broker.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;

use super::read_subscription;
use settle::api::{Backend, Capabilities, Subscription};
use settle::policy::{
    BackendKind, BackendRules, BackendView, CREDENTIALS_LABEL, CREDENTIALS_LABEL_VALUE, FieldIssue,
    SecretView, capabilities_of, effective_capabilities, validate, validate_backend,
};

/// Why input could not be checked at all.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: no .yaml or .yml files found")]
    Empty { path: PathBuf },
}

/// The verdict on one object.
#[derive(Debug)]
pub struct Finding {
    /// `file#document`, e.g. `samples/orders.yaml#1`.
    pub source: String,
    /// `Kind namespace/name`.
    pub object: String,
    pub errors: Vec<String>,
    pub warnings: Vec<String>,
    /// Which backend the capabilities came from, e.g. `nats (Backend "nats" in input)`.
    pub backend: Option<String>,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = if self.errors.is_empty() {
            "ok"
        } else {
            "REFUSED"
        };
        write!(f, "{}: {} {}", self.source, self.object, verdict)?;
        if let Some(b) = &self.backend {
            write!(f, " (backend: {b})")?;
        }
        for e in &self.errors {
            write!(f, "\n  error: {e}")?;
        }
        for w in &self.warnings {
            write!(f, "\n  warning: {w}")?;
        }
        Ok(())
    }
}

/// Everything `settle check` found.
#[derive(Debug, Default)]
pub struct Report {
    pub findings: Vec<Finding>,
    /// Files (or their rest) that are not valid YAML and so could not be checked at all; each
    /// is also a finding. `settle check` exits 2 when there is one.
    pub unreadable: usize,
}

impl Report {
    pub fn has_errors(&self) -> bool {
        self.findings.iter().any(|f| !f.errors.is_empty())
    }
}

/// Collects `.yaml`/`.yml` files: the file itself, or every such file under a directory, sorted.
pub fn collect_files(path: &Path) -> Result<Vec<PathBuf>, CheckError> {
    let read_err = |source| CheckError::Read {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(read_err)?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out = Vec::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).map_err(|source| CheckError::Read {
            path: dir.clone(),
            source,
        })? {
            let p = entry
                .map_err(|source| CheckError::Read {
                    path: dir.clone(),
                    source,
                })?
                .path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                out.push(p);
            }
        }
    }
    out.sort();
    if out.is_empty() {
        return Err(CheckError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(out)
}

/// A Secret's metadata (its data is never read).
#[derive(Deserialize)]
struct SecretMeta {
    #[serde(default)]
    metadata: ObjectMeta,
}

#[derive(Deserialize)]
struct TypeMeta {
    #[serde(rename = "apiVersion", default)]
    api_version: String,
    #[serde(default)]
    kind: String,
}

/// Checks manifests given as (source name, YAML text). `kind_override` makes every Subscription
/// be checked against that backend kind (`--backend-kind`); otherwise each one's Backend is
/// looked up in the input by namespace and name, and a Subscription whose Backend is not in the
/// input is checked against `nats` (the backend Settle drives first) and says so.
///
/// Findings come in this order: what is refused on reading (in input order), then the
/// Backends, then the Subscriptions.
pub fn check(inputs: &[(String, String)], kind_override: Option<BackendKind>) -> Report {
    let mut report = Report::default();
    let mut found = Found::default();
    for (name, text) in inputs {
        read_file(name, text, &mut found, &mut report);
    }
    check_backends(found.backend_specs, &found.secrets, &mut report);
    check_subscriptions(
        found.subscriptions,
        &found.backends,
        kind_override,
        &mut report,
    );
    report
}

/// What the input holds that `check` judges, or judges by.
#[derive(Default)]
struct Found {
    /// The Subscriptions, with their source.
    subscriptions: Vec<(String, Subscription)>,
    /// Each Backend's kind and capabilities, by (namespace, name).
    backends: HashMap<(String, String), (BackendKind, Capabilities)>,
    /// The Backends to judge, with their source.
    backend_specs: Vec<(String, Backend)>,
    /// Each Secret's label, by (namespace, name).
    secrets: HashMap<(String, String), SecretView>,
}

/// Reads one file's documents into `found`; what cannot be read becomes a finding.
fn read_file(name: &str, text: &str, found: &mut Found, report: &mut Report) {
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let source = format!("{name}#{}", i + 1);
        let value = match serde_yaml::Value::deserialize(doc) {
            Ok(serde_yaml::Value::Null) => continue,
            Ok(v) => v,
            Err(e) => {
                // The parser cannot resynchronise after a syntax error (it would yield the
                // same error forever), so the rest of this file is not read.
                report.unreadable += 1;
                report.findings.push(unreadable(
                    source,
                    "document",
                    format!("not valid YAML, rest of file not read: {e}"),
                ));
                break;
            }
        };
        read_document(source, value, found, report);
    }
}

/// Sorts one document: a Secret's label, a Subscription or a Backend of Settle's; anything else
/// is someone else's and skipped.
fn read_document(source: String, value: serde_yaml::Value, found: &mut Found, report: &mut Report) {
    let meta: TypeMeta = serde_yaml::from_value(value.clone()).unwrap_or(TypeMeta {
        api_version: String::new(),
        kind: String::new(),
    });
    if meta.api_version == "v1" && meta.kind == "Secret" {
        if let Ok(secret) = serde_yaml::from_value::<SecretMeta>(value.clone()) {
            found.secrets.insert(
                (
                    namespace_of(&secret.metadata),
                    secret.metadata.name.clone().unwrap_or_default(),
                ),
                secret_view(&secret),
            );
        }
        return;
    }
    if !meta.api_version.starts_with(settle::api::GROUP) {
        return; // not Settle's: someone else's manifest in the same directory
    }
    match meta.kind.as_str() {
        "Subscription" => {
            let read = serde_json::to_value(&value)
                .map_err(|e| format!("not representable as JSON: {e}"))
                .and_then(|json| read_subscription(&json));
            match read {
                Ok(s) => found.subscriptions.push((source, s)),
                Err(e) => report.findings.push(unreadable(source, "Subscription", e)),
            }
        }
        "Backend" => match serde_path_to_error::deserialize::<_, Backend>(value) {
            Ok(b) => read_backend(source, b, found, report),
            Err(e) => report
                .findings
                .push(unreadable(source, "Backend", e.to_string())),
        },
        _ => {}
    }
}

/// Whether a Secret carries the credentials label.
fn secret_view(secret: &SecretMeta) -> SecretView {
    if secret
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(CREDENTIALS_LABEL))
        .is_some_and(|v| v == CREDENTIALS_LABEL_VALUE)
    {
        SecretView::Labelled
    } else {
        SecretView::Unlabelled
    }
}

/// Keeps a Backend to judge and to resolve Subscriptions against; one that sets no single kind
/// is a finding instead.
fn read_backend(source: String, b: Backend, found: &mut Found, report: &mut Report) {
    match (BackendKind::of(&b.spec), effective_capabilities(&b)) {
        (Some(kind), Some(caps)) => {
            found.backend_specs.push((source.clone(), b.clone()));
            found.backends.insert(
                (
                    namespace_of(&b.metadata),
                    b.metadata.name.clone().unwrap_or_default(),
                ),
                (kind, caps),
            );
        }
        _ => report.findings.push(Finding {
            source,
            object: object_name("Backend", &b.metadata),
            errors: vec![
                "spec: exactly one backend kind must be set: nats, rabbitmq, sqs or memory".into(),
            ],
            warnings: vec![],
            backend: None,
        }),
    }
}

/// Judges each Backend by `validate_backend`, with the labels of the Secrets in the input.
fn check_backends(
    backend_specs: Vec<(String, Backend)>,
    secrets: &HashMap<(String, String), SecretView>,
    report: &mut Report,
) {
    for (source, b) in backend_specs {
        let ns = namespace_of(&b.metadata);
        let view = |name: &str| {
            secrets
                .get(&(ns.clone(), name.to_string()))
                .copied()
                .unwrap_or(SecretView::Unknown)
        };
        // The installer's host allow-list and pod-identity namespaces are the webhook's to check.
        let rules = BackendRules {
            allowed_hosts: vec![],
            pod_identity_namespaces: vec![ns.clone()],
        };
        let verdict = validate_backend(&b.spec, None, &ns, &view, &rules);
        report.findings.push(Finding {
            source,
            object: object_name("Backend", &b.metadata),
            errors: verdict.errors.iter().map(FieldIssue::to_string).collect(),
            warnings: verdict.warnings.iter().map(FieldIssue::to_string).collect(),
            backend: None,
        });
    }
}

/// Judges each Subscription by `validate`, against the capabilities of its backend.
fn check_subscriptions(
    subscriptions: Vec<(String, Subscription)>,
    backends: &HashMap<(String, String), (BackendKind, Capabilities)>,
    kind_override: Option<BackendKind>,
    report: &mut Report,
) {
    for (source, sub) in subscriptions {
        let backend_name = sub.spec.backend_ref.name.clone();
        let (kind, caps, from) = backend_of(&sub, &backend_name, backends, kind_override);
        let verdict = validate(
            &sub.spec,
            None,
            BackendView::Known {
                name: &backend_name,
                capabilities: &caps,
            },
        );
        let warnings: Vec<String> = verdict.warnings.iter().map(FieldIssue::to_string).collect();
        report.findings.push(Finding {
            source,
            object: object_name("Subscription", &sub.metadata),
            errors: verdict.errors.iter().map(FieldIssue::to_string).collect(),
            warnings,
            backend: Some(format!("{kind}, {from}")),
        });
    }
}

/// The backend kind and capabilities a Subscription is checked against, and where they came
/// from: `--backend-kind`, its Backend in the input, or `nats` assumed.
fn backend_of(
    sub: &Subscription,
    backend_name: &str,
    backends: &HashMap<(String, String), (BackendKind, Capabilities)>,
    kind_override: Option<BackendKind>,
) -> (BackendKind, Capabilities, String) {
    match kind_override {
        Some(k) => (k, capabilities_of(k), "--backend-kind".to_string()),
        None => match backends.get(&(namespace_of(&sub.metadata), backend_name.to_string())) {
            Some((k, caps)) => (
                *k,
                caps.clone(),
                format!("Backend {backend_name:?} in input"),
            ),
            None => (
                BackendKind::Nats,
                capabilities_of(BackendKind::Nats),
                format!(
                    "Backend {backend_name:?} not in input; assumed nats, pass --backend-kind to choose"
                ),
            ),
        },
    }
}

fn unreadable(source: String, kind: &str, error: String) -> Finding {
    Finding {
        source,
        object: kind.to_string(),
        errors: vec![error],
        warnings: vec![],
        backend: None,
    }
}

fn namespace_of(meta: &ObjectMeta) -> String {
    meta.namespace.clone().unwrap_or_else(|| "default".into())
}

fn object_name(kind: &str, meta: &ObjectMeta) -> String {
    format!(
        "{kind} {}/{}",
        namespace_of(meta),
        meta.name.as_deref().unwrap_or("<unnamed>")
    )
}
