//! The Backend rules on whom the operator acts for and where it connects (A18–A21): a Secret is
//! used only when it carries [`CREDENTIALS_LABEL`] (its owner opted in), a broker host only when
//! the installer's allow-list ([`BackendRules`], [`HostPattern`]) matches it, the operator pod's
//! own cloud identity (SQS without a Secret) only in the namespaces the installer listed; and
//! where credentials would travel unencrypted, a warning.
//!
//! Pure: what a Secret carries is asked through the caller's `secrets` function. It must not
//! judge a URL's shape (that is [`super::urls`]).

use std::fmt;
use std::str::FromStr;

use super::secrets_named;
use super::urls::{dns1123_subdomain, parse_url};
use crate::api::BackendSpec;
use crate::policy::rules::Verdict;

/// The label a Secret must carry, with value [`CREDENTIALS_LABEL_VALUE`], before a Backend may
/// use it (A18).
pub const CREDENTIALS_LABEL: &str = "settle.dev/backend-credentials";
/// The value [`CREDENTIALS_LABEL`] must have.
pub const CREDENTIALS_LABEL_VALUE: &str = "true";

/// What the installer allows Backends (operator flags `--allowed-broker-hosts` and
/// `--sqs-pod-identity-namespaces`). The default allows any host and pod identity nowhere.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendRules {
    /// Host patterns a broker URL's host must match (A19); empty: any host.
    pub allowed_hosts: Vec<HostPattern>,
    /// Namespaces whose SQS Backends may run without a Secret, as the operator pod's own cloud
    /// identity (A20); empty: none.
    pub pod_identity_namespaces: Vec<String>,
}

/// One allowed host: `nats.messaging.svc` exactly, or `*.example.com` (any host ending in
/// `.example.com`, not `example.com` itself). Compared without case.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPattern(String);

impl FromStr for HostPattern {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let p = s.trim().to_ascii_lowercase();
        let rest = p.strip_prefix("*.").unwrap_or(&p);
        let ok = !rest.is_empty()
            && rest.len() <= 253
            && rest
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | ':' | '[' | ']'));
        if ok {
            Ok(HostPattern(p))
        } else {
            Err(format!(
                "{s:?} is not a host pattern: give a host (nats.messaging.svc, 10.0.0.7) or `*.` and a domain (*.messaging.svc)"
            ))
        }
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl HostPattern {
    pub fn matches(&self, host: &str) -> bool {
        let host = host.to_ascii_lowercase();
        match self.0.strip_prefix("*.") {
            Some(domain) => host
                .strip_suffix(domain)
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            None => host == self.0,
        }
    }
}

/// What the API server holds under a Secret name a Backend gives, as far as the caller knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SecretView {
    /// It exists and carries the opt-in label.
    Labelled,
    /// It exists without the opt-in label: never used.
    Unlabelled,
    /// No Secret of that name (yet).
    Missing,
    /// It could not be read (the operator may not read Secrets in this namespace).
    Unknown,
}

// Long on purpose: the Backend's access rules (A16, A18–A21) one after another, each a guarded
// finding on its field, as docs/semantics.md gives them.
pub(super) fn access_rules(
    v: &mut Verdict,
    spec: &BackendSpec,
    namespace: &str,
    secrets: &dyn Fn(&str) -> SecretView,
    rules: &BackendRules,
    at_admission: bool,
) {
    // A18: a Secret is used only if its owner opted in.
    for (field, name) in secrets_named(spec) {
        if dns1123_subdomain(name).is_err() {
            continue;
        }
        let label = format!("{CREDENTIALS_LABEL}={CREDENTIALS_LABEL_VALUE}");
        match secrets(name) {
            SecretView::Labelled => {}
            SecretView::Unlabelled => v.error(
                field,
                format!(
                    "Secret {name:?} does not carry the label {label}, which a Secret needs before a Backend may use it \
                     (Settle never reads or sends an unlabelled Secret): if this Secret is meant for this Backend, run \
                     `kubectl label secret {name} -n {namespace} {label}`"
                ),
            ),
            SecretView::Missing if at_admission => v.warn(
                field,
                format!(
                    "Secret {name:?} does not exist in namespace {namespace} yet; create it with the label {label}, \
                     until then the Backend is not Ready"
                ),
            ),
            SecretView::Unknown if at_admission => v.warn(
                field,
                format!(
                    "Secret {name:?} could not be read to check its label {label}; the operator checks it again before using it"
                ),
            ),
            SecretView::Missing | SecretView::Unknown => {}
        }
    }

    // A19: broker hosts only from the installer's allow-list.
    if !rules.allowed_hosts.is_empty() {
        let allowed = rules
            .allowed_hosts
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        for (field, host) in hosts_named(spec) {
            match host {
                Some(host) if rules.allowed_hosts.iter().any(|p| p.matches(&host)) => {}
                Some(host) => v.error(
                    &field,
                    format!(
                        "host {host:?} is not among the broker hosts this installation allows ({allowed}, the operator's \
                         --allowed-broker-hosts): point the Backend at an allowed broker, or ask the installer to allow this one"
                    ),
                ),
                None => v.error(
                    &field,
                    format!(
                        "names no host to check against the broker hosts this installation allows ({allowed}): set it \
                         explicitly"
                    ),
                ),
            }
        }
    }

    // A20: the operator pod's own cloud identity only where the installer allowed it.
    if let Some(q) = &spec.sqs
        && q.credentials_secret_ref.is_none()
        && !rules.pod_identity_namespaces.iter().any(|n| n == namespace)
    {
        v.error(
            "spec.sqs.credentialsSecretRef",
            format!(
                "required in namespace {namespace}: without it the Backend would run as the operator pod's own cloud \
                 identity, which this installation allows only in the namespaces listed in the operator's \
                 --sqs-pod-identity-namespaces ({}). Set credentialsSecretRef to a Secret with keys accessKeyId and \
                 secretAccessKey and the label {CREDENTIALS_LABEL}={CREDENTIALS_LABEL_VALUE}",
                if rules.pod_identity_namespaces.is_empty() {
                    "none".to_string()
                } else {
                    rules.pod_identity_namespaces.join(", ")
                }
            ),
        );
    }
}

/// Every broker host a Backend makes the operator connect to: (field, host). `None`: the host
/// cannot be told from the spec (an unparsable URL, or SQS in the pod's own region).
fn hosts_named(spec: &BackendSpec) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let host = |u: &str| parse_url(u).ok().map(|p| p.host.to_string());
    if let Some(n) = &spec.nats {
        for (i, s) in n.servers.iter().enumerate() {
            out.push((format!("spec.nats.servers[{i}]"), host(s)));
        }
    }
    if let Some(r) = &spec.rabbitmq {
        for (i, u) in r.urls.iter().enumerate() {
            out.push((format!("spec.rabbitmq.urls[{i}]"), host(u)));
        }
        if let Some(m) = &r.management_url {
            out.push(("spec.rabbitmq.managementUrl".into(), host(m)));
        }
    }
    if let Some(q) = &spec.sqs {
        match (&q.endpoint, &q.region) {
            (Some(e), _) => out.push(("spec.sqs.endpoint".into(), host(e))),
            (None, Some(r)) => out.push((
                "spec.sqs.region".into(),
                Some(format!("sqs.{r}.amazonaws.com")),
            )),
            (None, None) => out.push(("spec.sqs.region".into(), None)),
        }
    }
    out
}

/// A21: where credentials would travel unencrypted: (field, warning). Not a refusal (local
/// development uses it); the controller also says it in Ready's reason and a Warning Event.
pub fn plaintext_with_credentials(spec: &BackendSpec) -> Vec<(String, String)> {
    let scheme = |u: &str| parse_url(u).ok().map(|p| p.scheme.to_ascii_lowercase());
    let mut out = Vec::new();
    let say = |what: &str, fix: &str| {
        format!(
            "sends the credentials Secret's {what} unencrypted: anyone on the path can read them; {fix} \
             (admitted, for local development)"
        )
    };
    if let Some(n) = &spec.nats
        && n.credentials_secret_ref.is_some()
        && n.tls
            .as_ref()
            .and_then(|t| t.ca_secret_ref.as_ref())
            .is_none()
    {
        for (i, s) in n.servers.iter().enumerate() {
            if scheme(s).as_deref() == Some("nats") {
                out.push((
                    format!("spec.nats.servers[{i}]"),
                    say(
                        "credentials",
                        "use tls:// (or set spec.nats.tls.caSecretRef)",
                    ),
                ));
            }
        }
    }
    if let Some(r) = &spec.rabbitmq
        && r.credentials_secret_ref.is_some()
    {
        for (i, u) in r.urls.iter().enumerate() {
            if scheme(u).as_deref() == Some("amqp") {
                out.push((
                    format!("spec.rabbitmq.urls[{i}]"),
                    say("username and password", "use amqps://"),
                ));
            }
        }
        if let Some(m) = &r.management_url
            && scheme(m).as_deref() == Some("http")
        {
            out.push((
                "spec.rabbitmq.managementUrl".into(),
                say("username and password", "use https://"),
            ));
        }
    }
    if let Some(q) = &spec.sqs
        && q.credentials_secret_ref.is_some()
        && let Some(e) = &q.endpoint
        && scheme(e).as_deref() == Some("http")
    {
        out.push((
            "spec.sqs.endpoint".into(),
            say("signed requests", "use https://"),
        ));
    }
    out
}
