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
use settle::api::{Backend, Capabilities};
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
pub fn check(inputs: &[(String, String)], kind_override: Option<BackendKind>) -> Report {
    let mut report = Report::default();
    let mut subscriptions = Vec::new();
    let mut backends: HashMap<(String, String), (BackendKind, Capabilities)> = HashMap::new();
    let mut backend_specs = Vec::new();
    let mut secrets: HashMap<(String, String), SecretView> = HashMap::new();

    for (name, text) in inputs {
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
            let meta: TypeMeta = serde_yaml::from_value(value.clone()).unwrap_or(TypeMeta {
                api_version: String::new(),
                kind: String::new(),
            });
            if meta.api_version == "v1" && meta.kind == "Secret" {
                if let Ok(secret) = serde_yaml::from_value::<SecretMeta>(value.clone()) {
                    let view = if secret
                        .metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(CREDENTIALS_LABEL))
                        .is_some_and(|v| v == CREDENTIALS_LABEL_VALUE)
                    {
                        SecretView::Labelled
                    } else {
                        SecretView::Unlabelled
                    };
                    secrets.insert(
                        (
                            namespace_of(&secret.metadata),
                            secret.metadata.name.clone().unwrap_or_default(),
                        ),
                        view,
                    );
                }
                continue;
            }
            if !meta.api_version.starts_with(settle::api::GROUP) {
                continue; // not Settle's: someone else's manifest in the same directory
            }
            match meta.kind.as_str() {
                "Subscription" => {
                    let read = serde_json::to_value(&value)
                        .map_err(|e| format!("not representable as JSON: {e}"))
                        .and_then(|json| read_subscription(&json));
                    match read {
                        Ok(s) => subscriptions.push((source, s)),
                        Err(e) => report.findings.push(unreadable(source, "Subscription", e)),
                    }
                }
                "Backend" => match serde_path_to_error::deserialize::<_, Backend>(value) {
                    Ok(b) => match (BackendKind::of(&b.spec), effective_capabilities(&b)) {
                        (Some(kind), Some(caps)) => {
                            backend_specs.push((source.clone(), b.clone()));
                            backends.insert(
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
                    },
                    Err(e) => report
                        .findings
                        .push(unreadable(source, "Backend", e.to_string())),
                },
                _ => {}
            }
        }
    }

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

    for (source, sub) in subscriptions {
        let backend_name = sub.spec.backend_ref.name.clone();
        let (kind, caps, from) = match kind_override {
            Some(k) => (k, capabilities_of(k), "--backend-kind".to_string()),
            None => match backends.get(&(namespace_of(&sub.metadata), backend_name.clone())) {
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
        };
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
    report
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
