//! How NACK reached the servers of each Consumer, as Settle Backends: one per namespace and
//! distinct connection (a NACK `Account`, or a server list with its credential files).
//!
//! NACK read credentials from files on its controller (`creds`, `nkey`, `tls.rootCas`) or from
//! the Secrets an `Account` names; Settle reads one labelled Secret per Backend (keys `creds`,
//! `nkey`, `ca.crt`). The Backend names that Secret, and its plan carries the commands that make
//! it: the user runs them, as this module never reads a credential. Every value in a command is
//! shell-quoted, and a credential file or Secret key that is not a plain name is refused as a
//! finding: those strings are the tenant's, and the platform admin runs the commands.

use std::collections::BTreeMap;

use super::super::{BackendPlan, Finding, Severity};
use super::{AccountSpec, ConsumerSpec};
use settle::api::{BackendSpec, NatsBackendSpec, NatsTlsSpec, SecretRef};
use settle::policy::{CREDENTIALS_LABEL, CREDENTIALS_LABEL_VALUE};

/// What makes two Consumers share a Backend.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Key {
    Account {
        account: String,
        servers: Vec<String>,
    },
    Servers {
        servers: Vec<String>,
        creds: Option<String>,
        nkey: Option<String>,
        cas: Vec<String>,
    },
}

/// The Backends made so far, by namespace.
#[derive(Default)]
pub struct Backends {
    by_key: BTreeMap<(String, Key), usize>,
    plans: Vec<BackendPlan>,
}

/// `host:port` without a scheme, as NACK accepted it, with `nats://`.
fn url(server: &str) -> String {
    if server.contains("://") {
        server.to_string()
    } else {
        format!("nats://{server}")
    }
}

fn label_command(namespace: &str, secret: &str) -> String {
    format!(
        "kubectl -n {} label secret {} {CREDENTIALS_LABEL}={CREDENTIALS_LABEL_VALUE}",
        sh(namespace),
        sh(secret)
    )
}

/// `value` as one word to a POSIX shell: as it is when it holds only characters no shell reads
/// specially, else in single quotes (a quote inside closed, escaped and reopened).
pub fn sh(value: &str) -> String {
    let plain = !value.is_empty()
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._/-:=@%+,".contains(c));
    if plain {
        value.to_string()
    } else {
        format!("'{}'", value.replace('\'', "'\\''"))
    }
}

/// The longest credential path or Secret key taken.
const MAX_NAME: usize = 1_024;

/// A file path NACK's controller read (`spec.creds`, `spec.nkey`, `spec.tls.rootCas`), refused
/// unless it is a plain path: letters, digits and `._/-:=@%+,~` (nothing a shell or YAML reads
/// specially), not an option (`-…`), at most 1,024 characters. It goes into commands the
/// platform admin runs.
fn plain_path(field: &str, value: &str) -> Result<(), Finding> {
    let plain = !value.is_empty()
        && value.len() <= MAX_NAME
        && !value.starts_with('-')
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._/-:=@%+,~".contains(c));
    if plain {
        return Ok(());
    }
    Err(Finding {
        severity: Severity::Refused,
        field: field.into(),
        message: format!(
            "not a plain file path ({}): it would go into the commands that make the Backend's \
             Secret. Make the Secret by hand from the file NACK's controller read, label it \
             {CREDENTIALS_LABEL}={CREDENTIALS_LABEL_VALUE}, and name it in \
             spec.nats.credentialsSecretRef",
            describe(value)
        ),
    })
}

/// A key of a Secret an `Account` names (`spec.creds.file`, `spec.tls.ca`), refused unless it is
/// one Kubernetes allows (`[-._a-zA-Z0-9]+`, at most 253 characters).
fn secret_key(field: &str, value: &str) -> Result<(), Finding> {
    let plain = !value.is_empty()
        && value.len() <= 253
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-._".contains(c));
    if plain {
        return Ok(());
    }
    Err(Finding {
        severity: Severity::Refused,
        field: field.into(),
        message: format!(
            "not a Secret key Kubernetes allows ({}; keys are [-._a-zA-Z0-9]+): name the key the \
             Account's Secret holds",
            describe(value)
        ),
    })
}

/// A refused value for a finding: its length, and its first characters with anything that is
/// not printable escaped (a finding is printed, and written as a comment).
fn describe(value: &str) -> String {
    let shown: String = value
        .chars()
        .take(40)
        .flat_map(char::escape_default)
        .collect();
    format!("{} characters, starting \"{shown}\"", value.chars().count())
}

/// Every credential file a Consumer names, and every Secret key its Account names, plain.
fn plain_names(spec: &ConsumerSpec, account: Option<&AccountSpec>) -> Result<(), Finding> {
    if let Some(path) = &spec.creds {
        plain_path("spec.creds", path)?;
    }
    if let Some(path) = &spec.nkey {
        plain_path("spec.nkey", path)?;
    }
    for (i, path) in spec.tls.iter().flat_map(|t| &t.root_cas).enumerate() {
        plain_path(&format!("spec.tls.rootCas[{i}]"), path)?;
    }
    let Some(acc) = account else { return Ok(()) };
    if let Some(file) = acc.creds.as_ref().and_then(|c| c.file.as_ref()) {
        secret_key("Account spec.creds.file", file)?;
    }
    if let Some(ca) = acc.tls.as_ref().and_then(|t| t.ca.as_ref()) {
        secret_key("Account spec.tls.ca", ca)?;
    }
    Ok(())
}

/// `{.data.KEY}` for kubectl's jsonpath, with the dots of a file name escaped.
fn data_path(key: &str) -> String {
    format!("{{.data.{}}}", key.replace('.', "\\."))
}

impl Backends {
    /// The Backend of the Consumer `spec` in `namespace` (made on first use), with what the
    /// Consumer should know about it; an error when no Backend can be made.
    pub fn backend_for(
        &mut self,
        namespace: &str,
        spec: &ConsumerSpec,
        account: Option<(&str, Option<&AccountSpec>)>,
        default_servers: &[String],
    ) -> Result<(String, Vec<Finding>), Finding> {
        let mut findings = Vec::new();
        if let Some(tls) = &spec.tls
            && (tls.client_cert.is_some() || tls.client_key.is_some())
        {
            findings.push(client_cert_finding("spec.tls.clientCert"));
        }
        plain_names(spec, account.and_then(|(_, acc)| acc))?;
        let key = key(spec, account, default_servers, &mut findings)?;
        let k = (namespace.to_string(), key);
        if let Some(&i) = self.by_key.get(&k) {
            return Ok((self.plans[i].name.clone(), findings));
        }
        let name = self.add(k, account.and_then(|(_, acc)| acc));
        Ok((name, findings))
    }

    /// A new Backend for `k` (namespace and key), filled from its Account when it has one;
    /// returns its name.
    fn add(&mut self, k: (String, Key), account: Option<&AccountSpec>) -> String {
        let namespace = k.0.as_str();
        let name = self.free_name(namespace, &k.1);
        let plan = match &k.1 {
            Key::Account { account, servers } => from_account(namespace, &name, account, servers),
            Key::Servers {
                servers,
                creds,
                nkey,
                cas,
            } => from_files(namespace, &name, servers, creds, nkey, cas),
        };
        let plan = match (plan, account) {
            (mut p, Some(acc)) => {
                fill_account(&mut p, acc);
                p
            }
            (p, _) => p,
        };
        self.plans.push(plan);
        self.by_key.insert(k, self.plans.len() - 1);
        name
    }

    /// A Backend name not yet taken in `namespace`: the Account's name, else `nats`, `nats-2`, ...
    fn free_name(&self, namespace: &str, key: &Key) -> String {
        let base = match key {
            Key::Account { account, .. } => account.clone(),
            Key::Servers { .. } => "nats".to_string(),
        };
        let taken = |n: &str| {
            self.plans
                .iter()
                .any(|p| p.namespace == namespace && p.name == n)
        };
        (1..)
            .map(|i| {
                if i == 1 {
                    base.clone()
                } else {
                    format!("{base}-{i}")
                }
            })
            .find(|n| !taken(n))
            .unwrap_or(base)
    }

    pub fn into_plans(self) -> Vec<BackendPlan> {
        self.plans
    }
}

/// What makes the Consumer's Backend: its Account (which must be in the input) and servers, or
/// its servers (else `default_servers`) and credential files.
fn key(
    spec: &ConsumerSpec,
    account: Option<(&str, Option<&AccountSpec>)>,
    default_servers: &[String],
    findings: &mut Vec<Finding>,
) -> Result<Key, Finding> {
    let mut servers: Vec<String> = spec.servers.iter().map(|s| url(s)).collect();
    servers.sort();
    servers.dedup();
    match account {
        Some((name, None)) => Err(Finding {
            severity: Severity::Refused,
            field: "spec.account".into(),
            message: format!(
                "names NACK Account {name:?}, which is not in the input (or not in this \
                 namespace): add it (or use --from-cluster) so its servers and Secrets are known"
            ),
        }),
        Some((name, Some(acc))) => {
            if acc
                .tls
                .as_ref()
                .is_some_and(|t| t.cert.is_some() || t.key.is_some())
            {
                findings.push(client_cert_finding("Account spec.tls.cert"));
            }
            Ok(Key::Account {
                account: name.to_string(),
                servers,
            })
        }
        None => {
            if servers.is_empty() {
                if default_servers.is_empty() {
                    return Err(Finding {
                        severity: Severity::Refused,
                        field: "spec.servers".into(),
                        message: "not set, and no account: NACK's controller connected with its \
                                  own -s flag, which no resource shows. Pass --servers URL (the \
                                  -s NACK runs with)"
                            .into(),
                    });
                }
                servers = default_servers.iter().map(|s| url(s)).collect();
            }
            Ok(Key::Servers {
                servers,
                creds: spec.creds.clone(),
                nkey: spec.nkey.clone(),
                cas: spec
                    .tls
                    .as_ref()
                    .map(|t| t.root_cas.clone())
                    .unwrap_or_default(),
            })
        }
    }
}

fn client_cert_finding(field: &str) -> Finding {
    Finding {
        severity: Severity::Change,
        field: field.into(),
        message:
            "a client certificate: Settle's Backends present none (only a CA to trust); a server \
                  that requires one refuses Settle's connection and the Backend is not Ready. \
                  Authenticate with creds, an nkey or a token instead"
                .into(),
    }
}

fn from_account(namespace: &str, name: &str, account: &str, servers: &[String]) -> BackendPlan {
    BackendPlan {
        namespace: namespace.to_string(),
        name: name.to_string(),
        spec: BackendSpec {
            nats: Some(NatsBackendSpec {
                servers: servers.to_vec(),
                ..NatsBackendSpec::default()
            }),
            ..BackendSpec::default()
        },
        from: format!("NACK Account {namespace}/{account}"),
        steps: Vec::new(),
        findings: Vec::new(),
    }
}

/// The Account's servers added, and its Secrets copied into the one Settle reads.
fn fill_account(plan: &mut BackendPlan, acc: &AccountSpec) {
    let namespace = plan.namespace.clone();
    let secret = format!("{}-credentials", plan.name);
    let Some(nats) = plan.spec.nats.as_mut() else {
        return;
    };
    let mut servers: Vec<String> = nats
        .servers
        .iter()
        .cloned()
        .chain(acc.servers.iter().map(|s| url(s)))
        .collect();
    servers.sort();
    servers.dedup();
    nats.servers = servers;
    let mut from = Vec::new();
    if let Some(c) = &acc.creds
        && let (Some(s), Some(file)) = (c.secret.as_ref().and_then(|s| s.name.clone()), &c.file)
    {
        from.push(("creds", s, file.clone()));
    }
    if let Some(t) = &acc.tls
        && let (Some(s), Some(ca)) = (t.secret.as_ref().and_then(|s| s.name.clone()), &t.ca)
    {
        from.push(("ca.crt", s, ca.clone()));
    }
    if from.is_empty() {
        return;
    }
    let mut files = Vec::new();
    for (key, old, file) in &from {
        let local = key.replace('.', "-");
        plan.steps.push(format!(
            "kubectl -n {} get secret {} -o jsonpath={} | base64 -d > {}",
            sh(&namespace),
            sh(old),
            sh(&data_path(file)),
            sh(&local)
        ));
        files.push(sh(&format!("--from-file={key}={local}")));
    }
    plan.steps.push(format!(
        "kubectl -n {} create secret generic {} {}",
        sh(&namespace),
        sh(&secret),
        files.join(" ")
    ));
    plan.steps.push(label_command(&namespace, &secret));
    if from.iter().any(|(k, ..)| *k == "creds") {
        nats.credentials_secret_ref = Some(SecretRef {
            name: secret.clone(),
        });
    }
    if from.iter().any(|(k, ..)| *k == "ca.crt") {
        nats.tls = Some(NatsTlsSpec {
            ca_secret_ref: Some(SecretRef { name: secret }),
        });
    }
}

/// A server list, with the credential files NACK's controller read turned into one Secret.
fn from_files(
    namespace: &str,
    name: &str,
    servers: &[String],
    creds: &Option<String>,
    nkey: &Option<String>,
    cas: &[String],
) -> BackendPlan {
    let secret = format!("{name}-credentials");
    let mut nats = NatsBackendSpec {
        servers: servers.to_vec(),
        ..NatsBackendSpec::default()
    };
    let mut steps = Vec::new();
    let mut files = Vec::new();
    // NACK prefers creds to an nkey when both are set; so does this.
    if let Some(path) = creds {
        files.push(sh(&format!("--from-file=creds={path}")));
    } else if let Some(path) = nkey {
        files.push(sh(&format!("--from-file=nkey={path}")));
    }
    match cas {
        [] => {}
        [one] => files.push(sh(&format!("--from-file=ca.crt={one}"))),
        many => {
            let many: Vec<String> = many.iter().map(|p| sh(p)).collect();
            steps.push(format!("cat {} > ca.crt", many.join(" ")));
            files.push("--from-file=ca.crt=ca.crt".to_string());
        }
    }
    if !files.is_empty() {
        steps.push(format!(
            "kubectl -n {} create secret generic {} {}   # the files NACK's controller read",
            sh(namespace),
            sh(&secret),
            files.join(" ")
        ));
        steps.push(label_command(namespace, &secret));
        if creds.is_some() || nkey.is_some() {
            nats.credentials_secret_ref = Some(SecretRef {
                name: secret.clone(),
            });
        }
        if !cas.is_empty() {
            nats.tls = Some(NatsTlsSpec {
                ca_secret_ref: Some(SecretRef { name: secret }),
            });
        }
    }
    BackendPlan {
        namespace: namespace.to_string(),
        name: name.to_string(),
        spec: BackendSpec {
            nats: Some(nats),
            ..BackendSpec::default()
        },
        from: format!("the servers {}", servers.join(", ")),
        steps,
        findings: Vec::new(),
    }
}
